"""``shardio pack``: turn a tree of small files into checksummed shards plus a manifest.

Pipeline: scan SRC into key-sorted samples → plan shard boundaries from file sizes (so the plan,
and therefore every output byte, is independent of the worker count) → write shards in forked
processes, each to a temp name, fsynced and renamed → write the manifest last, atomically.  A
fresh pack of a directory tree streams (:func:`_pack_streaming`): the walk yields samples in key
order, and each shard is planned and handed to a worker as soon as it is full, while the walk
goes on; every other pack (resume, ``--overwrite`` of a non-empty OUT, ``--files-from``,
``--zstd-dict``, ``--part``) scans first.  Both plan with :mod:`shardio.packplan`'s
``_Planner``, so they write the same bytes.

Resumability: a state file ``.shardio-pack.json`` records the job fingerprint (options that shape
the output plus every input path, size and mtime; ``null`` while a streaming pack still scans)
and a fingerprint of the output options.  Each shard's index records a fingerprint of its own
samples' entries and the options (``job_shard``) and the files it skipped (``skipped``, with
``on_error="skip"``).  Rerunning the same command finds the state, removes temp files left by a
killed run, keeps every shard whose fingerprint matches its new plan and whose bytes still hash
to the digest recorded when it was written (counting its skipped files again), writes only the
rest, and deletes shards numbered beyond the new plan before it publishes
(:mod:`shardio.packstate`).  ``on_error`` is in neither fingerprint (:meth:`PackOptions.job_key`),
so a run stopped by a bad file resumes with ``--on-error skip``.

Multi-node pack (``PackOptions.part = (I, N)``, ``shardio pack --part I/N|auto``): every part
scans the same input and computes the same global plan and job fingerprint (which holds neither
I nor N), then writes only the contiguous range of global shards :func:`split_plan` gives it
(cut at byte quantiles of the plan), under their global names, so parts never collide and the
union of their shards is exactly the single-process output.  Files a part keeps in OUT::

    .shardio-pack-IIII-of-NNNN.json   its resumable state (job, range), written before anything
                                      else, removed by merge
    .shardio-part-IIII-of-NNNN.json   its record, published last and atomically: job, I, N, the
                                      shard range, every written shard's facts (path, samples,
                                      bytes, digest, index, index digest, stored/raw bytes,
                                      fields), the scan's facts (files, labels, skip counts), the
                                      output options, the dictionary digest, the layout note and
                                      SRC, with a digest of the record itself

A part accepts an OUT holding files of its own job (other parts run concurrently); with
``--overwrite`` it deletes only what no part of its job can own (another job's manifest,
records and state files, shards beyond its plan), never another part's shards.  It never writes
the manifest.  A ``--zstd-dict`` dictionary is trained by every part from the global scan
(training is deterministic), and ``zstd.dict`` is written atomically, with the same bytes, by
whichever part finds it missing.  :func:`shardio.parts.merge` checks that the records form one whole job and
that their shards are on disk, then publishes through the same :func:`_publish` as the single
process pack, so the manifest is byte for byte the same; it then removes the part files.
"""

from __future__ import annotations

import gc
import errno
import os
import queue
import stat
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import xxhash

from . import __version__, _inject
from ._fsutil import (
    BIG_READ,
    atomic_write_bytes,
)
from ._packpool import Task as _Task
from ._scan import AUTO_SCAN_THREADS, LABEL_FIELD, Sample, Walk, scan_source
from .checksum import DEFAULT_DIGEST, digest_bytes
from .codec import Codec, train_dictionary
from .config import PackOptions, parse_parity
from .errors import (
    EmptySourceError,
    FileChangedError,
    ShardioError,
    UnreadableFileError,
    UsageError,
)
from .formats import WrittenShard, open_writer, shard_suffix
from .lustre import LayoutRequest, detect_fs
from .manifest import MANIFEST_NAME, Manifest, ShardEntry
from .packplan import (
    _canonical,
    _drop_too_large,
    _estimates,
    _estimator,
    _job_text,
    _JobHash,
    _Planner,
    _sample_docs,
    _shard_fingerprint,
    plan_shards,
)
from .packstate import (
    DICT_NAME,
    STATE_NAME,
    _check_paths,
    _empty,
    _is_done,
    _make_out,
    _prepare_out,
    _read_json,
    _record_digest,
    _remove_parity,
    _remove_stale_shards,
    _write_state,
)

if TYPE_CHECKING:
    from .parts import PartResult

__all__ = ["pack", "plan_shards"]

# O_NONBLOCK: a source file the scan saw as regular may since have been replaced by a FIFO,
# whose open would otherwise wait for a writer for ever.  (No effect on a regular file.)
_O_READ = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK
# A shard whose reads the scan left to decide (Task.read_threads 0) times its first
# _READ_PROBE samples, and reads the rest in threads when they took more than _SLOW_FILE a file
# beyond what _READ_BANDWIDTH would explain.  A local read of a cached 20 KB file takes ~5 us;
# with its first buffers' page faults and two workers and a scan sharing 2 CPUs, 128 of them
# took up to ~30 ms here (200 us a file, the first threshold, sent every 2-worker pack of the
# benchmark to threads); a parallel filesystem's open and read take 0.5-2 ms.
_READ_PROBE = 128
_SLOW_FILE = 500e-6
_READ_BANDWIDTH = 1e9


class _ReadProbe:
    """The first :data:`_READ_PROBE` samples a process reads for a pack, timed across its
    shards (a shard may be shorter than the probe), and the verdict: ``None`` until then,
    then whether the reads were slow (:func:`_slow_reads`).  Reset when a pack starts writing,
    before it forks its workers, so each pack and each worker finds out for itself."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.samples = self.files = self.nbytes = 0
        self.seconds = 0.0
        self.verdict: bool | None = None

    def want(self) -> int:
        return 0 if self.verdict is not None else _READ_PROBE - self.samples

    def add(self, samples: list[Sample], seconds: float) -> bool:
        """Count ``samples``, read in ``seconds``; True once the verdict is "slow"."""
        self.samples += len(samples)
        self.files += sum(len(s.files) for s in samples)
        self.nbytes += sum(s.size for s in samples)
        self.seconds += seconds
        if self.verdict is None and self.samples >= _READ_PROBE:
            self.verdict = _slow_reads(self.files, self.nbytes, self.seconds)
        return bool(self.verdict)


_PROBE = _ReadProbe()


def _read_fix(err: int | None) -> str:
    """What to do about a source file that could not be read with error ``err``."""
    skip = "pass --on-error skip to leave it out"
    if err in (errno.EACCES, errno.EPERM):
        return f"fix its permissions or {skip}"
    if err in (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.EINVAL):
        return (f"it changed since the scan (removed or replaced): rerun the pack with "
                f"--resume when the source is settled (finished shards are kept), or {skip}")
    return f"check the file and the storage it is on, or {skip}"


def _read_file(path: str, size: int = 0) -> bytes:
    try:
        fd = os.open(path, _O_READ)
        try:
            # One read when the size from the scan still holds; a short read of a regular file
            # is EOF (it shrank: packed as it is now).  A file over the kernel's cap on one read
            # (~2 GiB) is read on: before, it was packed cut at the cap.
            data = os.read(fd, size + 1)
            if len(data) > size or len(data) >= BIG_READ:
                rest, got = [data], len(data)
                while got <= size and (chunk := os.read(fd, max(1 << 20, min(size + 1 - got,
                                                                               BIG_READ)))):
                    rest.append(chunk)
                    got += len(chunk)
                data = b"".join(rest)
            elif len(data) < size and not stat.S_ISREG(os.fstat(fd).st_mode):
                # (a FIFO read without a writer ends at once: not a sample of 0 bytes)
                raise OSError(errno.EINVAL, "not a regular file any more")
        finally:
            os.close(fd)
    except OSError as exc:
        raise UnreadableFileError(exc.errno, f"cannot read {path}: {exc.strerror}; "
                                  f"{_read_fix(exc.errno)}") from exc
    if len(data) > size:
        # Still being written (a copy in progress, a log): what would be packed is a moment of
        # it, and the shard would outgrow the size the plan gave it.
        raise FileChangedError(
            errno.EBUSY, f"{path} grew from {size} bytes since the scan: it is being written; "
            "rerun the pack when it is complete (--resume keeps the finished shards), or pass "
            "--on-error skip to leave it out")
    return data


def _read_sample(s: Sample) -> list[tuple[str, bytes]]:
    """A sample's fields as read from its files (raises :class:`UnreadableFileError`)."""
    fields = []
    for name, path, size, _mtime in s.files:
        data = _read_file(path, size)
        if _inject.ACTIVE:
            _inject.delay(path, len(data))
        fields.append((name, data))
    return fields


class _ScanAhead:
    """The streaming pack's tasks, planned one shard ahead in a thread while this process
    writes the current one (one worker: see :func:`_pack_streaming`).

    Without it, one worker's scan and writes take turns: the walk stops while a shard is
    written.  The scan's stats (``fstatat`` in shardio/_listdir.c, or the stat threads on a
    slow store) and the C loop's reads both release the GIL, so in a thread they overlap: a
    1-worker pack of the 20,000-file benchmark tree took 0.42-0.47 s against 0.43-0.54 s, and
    2.17-2.36 s against 2.66-2.75 s on the simulated 0.5 ms store (6 and 3 alternating runs,
    2026-11-30).  At most one planned task waits in the queue (a shard's samples in memory
    beside the one being written and the one being planned).  A scan error is raised where
    the iteration reaches it, as without the thread; :meth:`close` (also on an error in the
    writer, or Ctrl-C) stops the scan at its next task, closes the walk (its stat threads
    with it) and joins the thread, so none outlives the pack.
    """

    _TASK, _END, _ERROR = 0, 1, 2

    def __init__(self, tasks: Iterable[_Task]) -> None:
        self._tasks = iter(tasks)
        self._queue: queue.Queue[tuple[int, Any]] = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="shardio-scan", daemon=True)
        self._thread.start()

    def _put(self, item: tuple[int, Any]) -> bool:
        """Queue ``item`` unless :meth:`close` was called meanwhile (then False)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for task in self._tasks:
                if not self._put((self._TASK, task)):
                    return
            self._put((self._END, None))
        except BaseException as exc:  # handed to the writer's thread, raised there
            self._put((self._ERROR, exc))
        finally:
            close = getattr(self._tasks, "close", None)
            if close is not None:
                close()  # the walk's finally: its stat threads stop here, in this thread

    def __iter__(self) -> Iterator[_Task]:
        while True:
            kind, value = self._queue.get()
            if kind == self._ERROR:
                raise value
            if kind == self._END:
                return
            yield value

    def close(self) -> None:
        """Stop the scan at its next task and wait for the thread (idempotent)."""
        self._stop.set()
        self._thread.join()


class _ReadAhead:
    """The files of a shard's samples, read by ``threads`` threads ahead of the writer, handed
    out in order.

    On a parallel filesystem opening and reading a small file is a round trip or two (~0.5-2
    ms), so one reader manages a few hundred files a second whatever the bandwidth.  A pack
    reads such a source's files in threads (``Task.read_threads``, or :func:`_slow_reads`'s
    verdict on a shard's first reads): in the C loop's threads where the writer has the C loop
    (``add_files``: shardio/_tarpack.c), else here, for a writer without it (compressed
    fields, no C extension), whose samples then go through its ``add``.  A read releases the
    GIL.  At most ``ahead_bytes`` (and ``4 x threads`` samples, the one being written
    included) are in flight at once.
    """

    def __init__(self, samples: list[Sample], threads: int, ahead_bytes: int = 64 << 20,
                 start: int = 0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.samples, self.threads, self.ahead_bytes = samples, threads, ahead_bytes
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="shardio-read")
        self.pending: dict[int, tuple[Any, int]] = {}  # index -> (future, its scan size)
        self.queued = 0  # bytes pending
        self.next = start  # the first sample it will be asked for

    def get(self, i: int) -> list[tuple[str, bytes]]:
        """Sample ``i``'s fields (``i`` counting up from ``start``, each once; raises what
        reading it raised)."""
        while self.next < len(self.samples) and (
                self.next <= i or (len(self.pending) < 4 * self.threads
                                   and self.queued < self.ahead_bytes)):
            s = self.samples[self.next]
            self.pending[self.next] = (self.pool.submit(_read_sample, s), s.size)
            self.queued += s.size
            self.next += 1
        future, size = self.pending.pop(i)
        self.queued -= size
        return future.result()  # type: ignore[no-any-return]

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


def _slow_reads(files: int, nbytes: int, seconds: float) -> bool:
    """Whether reading (and adding) ``files`` files of ``nbytes`` in ``seconds`` was
    latency-bound."""
    return seconds >= files * _SLOW_FILE + nbytes / _READ_BANDWIDTH


def _pack_shard(task: _Task, fmt: str, codec: Codec, checksum: str, fsync: bool,
                on_error: str, layout: LayoutRequest | None = None
                ) -> tuple[int, WrittenShard, Counter[str]]:
    """Write one shard (runs in a worker process, or inline with one worker)."""
    skipped: Counter[str] = Counter()
    writer = open_writer(fmt, task.final, codec, checksum, fsync, layout)
    add, op, rd, cl = writer.add, os.open, os.read, os.close
    labels: dict[int, bytes] = {}
    # Files are opened relative to a descriptor of their directory, so the kernel resolves one
    # name rather than the whole path per file.  The files of a sample share a directory and
    # key order keeps a directory's samples together, so one descriptor (the last) is kept.
    cur_dir, dfd = "", -1
    # The C loop (TarWriter.add_files) takes runs of samples and hands back any it does not
    # handle (a file it cannot read, a name that needs a pax header, ...) to the code below.
    add_files = writer.add_files
    samples = task.samples if isinstance(task.samples, list) else list(task.samples)
    # A slow source's files are read in threads: by the C loop where the writer has one (its
    # threads read a batch's files into place), else ahead of the Python code (_ReadAhead).
    threads, ahead = 1, None
    if task.read_threads > 1:  # the scan found the source slow
        threads = task.read_threads
    # Task.read_threads 0: time the first reads (_PROBE), and go on in threads if they are slow.
    probe = 0
    if task.read_threads == 0:
        if _PROBE.verdict:
            threads = AUTO_SCAN_THREADS
        else:
            probe = min(len(samples), _PROBE.want())
    if threads > 1 and add_files is None:
        ahead = _ReadAhead(samples, threads)
    t_probe = time.perf_counter()
    # A simulated slow store (SHARDIO_SLOW_READS) under the source: every read pays its delay,
    # the C loop's too (it sleeps each sample's, in the thread reading it).
    slow_store = bool(samples and samples[0].files) and _inject.covers(samples[0].files[0][1])
    delays = _inject.sample_delays(samples) if slow_store and add_files is not None else None
    i, n = 0, len(samples)
    try:
        while i < n:
            if probe and i >= probe:
                probe = 0
                if _PROBE.add(samples[:i], time.perf_counter() - t_probe):
                    threads = AUTO_SCAN_THREADS
                    if add_files is None:
                        ahead = _ReadAhead(samples, threads, start=i)
            if add_files is not None:
                # While probing, the C loop stops at the end of the probe (it would otherwise
                # write the whole shard in one call).
                i = add_files(samples[:probe] if probe else samples, i, LABEL_FIELD, threads,
                              None if delays is None else delays[:probe] if probe else delays)
                if i >= n:
                    break
                if probe and i >= probe:
                    continue  # decide before the next sample
            s = samples[i]
            i += 1
            fields: list[tuple[str, bytes]] = []
            try:
                if ahead is not None:
                    fields = ahead.get(i - 1)
                elif slow_store:
                    fields = _read_sample(s)
                else:
                    for name, path, size, _mtime in s.files:
                        # _read_file inlined for the common case (~10% of a pack's time is this
                        # loop); an error or a file that grew goes through _read_file for its
                        # handling.
                        d, _sep, base = path.rpartition(os.sep)
                        if d != cur_dir:
                            if dfd >= 0:
                                cl(dfd)
                            cur_dir, dfd = d, -1
                            dfd = _open_dir(d)
                        try:
                            fd = (op(base, _O_READ, dir_fd=dfd) if dfd >= 0
                                  else op(path, _O_READ))
                            try:
                                data = rd(fd, size + 1)
                            finally:
                                cl(fd)
                        except OSError:
                            # A second try, raising the typed error.
                            data = _read_file(path, size)
                        else:
                            if len(data) != size or len(data) >= BIG_READ:
                                # (grown, shrunk or replaced by a FIFO: _read_file tells)
                                data = _read_file(path, size)
                        fields.append((name, data))
            except UnreadableFileError as exc:
                if on_error == "raise":
                    raise
                skipped["changed" if isinstance(exc, FileChangedError) else "unreadable"] += 1
                continue
            label = s.label
            if label is not None:
                lb = labels.get(label)
                if lb is None:
                    lb = labels[label] = str(label).encode()
                fields.append((LABEL_FIELD, lb))
                fields.sort()
            add(s.key, fields)
        if probe and i >= probe:  # a shard no longer than the probe: it counts for the next
            _PROBE.add(samples[:i], time.perf_counter() - t_probe)
        meta: dict[str, Any] = {"job_shard": task.fingerprint}
        if skipped:  # kept by a resume, the shard still counts them (packstate._is_done)
            meta["skipped"] = dict(sorted(skipped.items()))
        written = writer.close(meta)
    except BaseException:
        writer.abort()
        raise
    finally:
        if ahead is not None:
            ahead.close()
        if dfd >= 0:
            cl(dfd)
    if fmt != "tar":  # an HDF5 shard's digest has no .idx to travel in
        _record_digest(written)
    return task.number, written, skipped


def _open_dir(path: str) -> int:
    """A descriptor of directory ``path`` to open its files by name, or -1 (then use paths)."""
    if not path:
        return -1
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1


def _dictionary(out: str, samples: list[Sample], level: int, claims: set[str],
                skip: bool = False) -> bytes:
    """The job's zstd dictionary: ``OUT/zstd.dict`` when its digest is one an unfinished run of
    this job recorded (``claims``), else trained afresh from the global scan.

    Training is deterministic (same samples, single-threaded), so every part of a multi-node
    pack trains the same bytes; the file is rewritten only when it differs.  With ``skip``
    (``on_error="skip"``) a file that cannot be read is left out of the training, as the
    writer leaves it out of its shard; else its error is raised, as the writer would.
    """
    path = os.path.join(out, DICT_NAME)
    try:
        with open(path, "rb") as f:
            existing: bytes | None = f.read()
    except OSError:
        existing = None
    if existing is not None and digest_bytes(existing) in claims:
        return existing
    step = max(1, len(samples) // 4000)
    training = []
    for s in samples[::step]:
        for _n, p, size, _m in s.files:
            if 0 < size <= 64 * 1024:
                try:
                    training.append(_read_file(p, size))
                except UnreadableFileError:
                    if not skip:
                        raise
    data = train_dictionary(training, level=level)
    if claims and digest_bytes(data) not in claims:
        # Shards already written with the recorded dictionary would not decode with this one.
        raise ShardioError(
            f"the zstd dictionary trained now differs from the one this job's unfinished run "
            f"recorded, and {path} is gone or damaged; start over with --overwrite, or pack "
            "without --zstd-dict"
        )
    if existing != data:
        atomic_write_bytes(path, data)
    return data


def _run_tasks(tasks: Iterable[_Task], options: PackOptions, codec: Codec,
               done: Callable[[WrittenShard, Counter[str]], None],
               layout: LayoutRequest | None = None) -> None:
    """Write ``tasks`` (a list, or the streaming pack's generator, which scans as it is
    iterated): inline with one worker, else in forked worker processes."""
    args = (options.format, codec, options.checksum, options.fsync, options.on_error, layout)
    if options.workers <= 1:
        for t in tasks:
            _n, w, sk = _pack_shard(t, *args)
            done(w, sk)
        return
    if options.format == "hdf5":
        # Import h5py (~0.15 s) once, here, so the forked workers inherit it.
        from .formats.hdf5 import _h5py

        _h5py()
    from ._packpool import run_forked

    # The lambda looks _pack_shard up when a worker calls it (so a test's patch reaches it).
    run_forked(tasks, options.workers, lambda t: _pack_shard(t, *args)[1:], done)


def _release_buffers(fmt: str) -> None:
    if fmt == "tar":
        from .formats.tar import release_buffers as release_tar

        release_tar()
    if fmt == "hdf5" and "shardio.formats.hdf5" in sys.modules:
        from .formats.hdf5 import release_buffers

        release_buffers()


def pack(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    files_from: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
    **kwargs: Any,
) -> Manifest | PartResult:
    """Pack the files under ``src`` into shards in ``out`` and return the published manifest.

    With ``options.part`` set, pack only that part's share of the shards and return a
    :class:`PartResult` instead; once every part has finished, :func:`merge` publishes the
    manifest (the module docstring describes the multi-node protocol).

    Args:
        src: source directory (keys are paths relative to it).
        out: output directory; created if missing.
        options: a :class:`PackOptions`; or pass its fields as keyword arguments.
        files_from: a file listing the paths to pack (relative to ``src`` or absolute inside it).
        progress: show a progress bar; ``None`` shows one when stderr is a terminal.

    Raises:
        UsageError: bad options, OUT inside SRC, OUT not empty (OutputNotEmptyError).
        SourceError: bad input files or an oversize sample (unless ``on_error="skip"``), empty
            source.
        StorageFullError: the output filesystem filled up; nothing was published.
        PartInProgressError: (``options.part``) another run of the same part is writing to
            ``out`` now.
    """
    # The scan builds ~10^5 long-lived objects and the pack frees none in reference cycles: the
    # cyclic collector would only traverse them again and again (~5% of a warm pack).
    gc_enabled = gc.isenabled()
    gc.disable()
    try:
        return _pack(src, out, options, files_from, progress, kwargs)
    finally:
        if gc_enabled:
            gc.enable()


def _pack(src: str | os.PathLike[str], out: str | os.PathLike[str], options: PackOptions | None,
          files_from: str | os.PathLike[str] | None, progress: bool | None,
          kwargs: dict[str, Any]) -> Manifest | PartResult:
    if options is None:
        options = PackOptions(**kwargs)
    elif kwargs:
        raise UsageError("pass either options= or keyword options, not both")
    src, out = os.fspath(src), os.fspath(out)
    flist = os.fspath(files_from) if files_from is not None else None
    _check_paths(src, out, flist)
    part = _parts._resolve_part(options.part)
    if part is None:
        return _pack_resolved(src, out, options, flist, None, progress)
    # Before the scan: a second run of this part fails at once (PartInProgressError).
    _make_out(out)
    with _parts._part_lock(out, part):
        return _pack_resolved(src, out, options, flist, part, progress)


def _pack_resolved(src: str, out: str, options: PackOptions, flist: str | None,
                   part: tuple[int, int] | None, progress: bool | None
                   ) -> Manifest | PartResult:
    """:func:`pack` once its arguments are checked and the part resolved (under the part's
    lock for a part)."""
    if part is None and flist is None and not options.zstd_dict and not options.resume \
            and _empty(out):
        return _pack_streaming(src, out, options, progress)
    scan = scan_source(src, out, files_from=flist, label_from_dir=options.label_from_dir,
                       on_error=options.on_error, scan_threads=options.scan_threads,
                       zstd=options.codec_name == "zstd")
    sizes = _drop_too_large(scan, options, _estimates(scan.samples, options))
    ranges = plan_shards(scan.samples, options, sizes)
    key = options.job_key()
    docs = _sample_docs(scan.samples)
    job = xxhash.xxh3_128_hexdigest(_job_text(docs, scan.labels, key).encode())
    _make_out(out)
    if part is not None:
        return _parts._pack_part(
            _parts._Job(src, out, flist, options, scan, sizes, ranges, job, docs), part, progress)
    complete = _prepare_out(out, job, options)
    if complete is not None:
        return complete
    state_path = os.path.join(out, STATE_NAME)
    state = _read_json(state_path) or {}
    claims = {state["dictionary_digest"]} if state.get("dictionary_digest") else set()
    codec = _codec(out, scan.samples, options, claims)
    _write_state(out, options, job, len(ranges), codec, fsync=options.fsync)
    tasks = _make_tasks(scan.samples, docs, ranges, range(len(ranges)), out, options,
                        scan.threads, codec)
    bar = _progress_bar(progress, sum(s.size for s in scan.samples), f"packing {scan.files} files")
    written, skipped, layout_note, _kept = _write_shards(tasks, options, codec, out, bar)
    skipped.update(scan.skipped)
    return _publish(out, options, scan.labels, codec, job, written, skipped, layout_note)


def _pack_streaming(src: str, out: str, options: PackOptions, progress: bool | None) -> Manifest:
    """A fresh pack of a directory tree that writes shards while the scan goes on.

    The walk yields samples in key order (:class:`~shardio._scan.Walk`) and the planner cuts a
    shard as soon as the next sample would overflow it, so shard ``n`` is written (by a worker
    process, or here with one worker while :class:`_ScanAhead` plans the next) before the scan
    of the rest of the tree ends: the same shards, bytes and manifest as a pack that scans
    first.  The job fingerprint is only known at the end of the scan, so the state file is
    written twice: before the first shard with ``job: null`` (a rerun then resumes whatever the
    input: every kept shard is checked against its own fingerprint), and again when the scan
    ends, with the job (not synced: if a crash loses it, the first one still stands).  A scan error with
    ``on_error="raise"`` (or an oversize sample) can come after some shards were published;
    no manifest is, and a rerun after the fix resumes.
    """
    walk = Walk(src, out, label_from_dir=options.label_from_dir, on_error=options.on_error,
                scan_threads=options.scan_threads, zstd=options.codec_name == "zstd")
    codec = Codec(options.codec_name, options.codec_level, None)
    key = options.job_key()
    job = _JobHash()
    result: dict[str, str] = {}
    # The total grows as the scan plans shards; the description gets the file count at its end.
    bar = _progress_bar(progress, 0, "packing (scanning)")

    def started() -> None:
        _make_out(out)
        _write_state(out, options, None, None, codec, fsync=options.fsync)

    def scanned(shards: int) -> None:
        result["job"] = job.finish(walk.labels, key)
        _write_state(out, options, result["job"], shards, codec, fsync=False)
        if bar is not None:
            bar.set_description_str(f"packing {walk.files} files", refresh=False)

    tasks: Iterable[_Task] = _stream_tasks(walk, options, out, job, started, scanned)
    ahead = _ScanAhead(tasks) if options.workers == 1 else None
    try:
        written, skipped, layout_note, _kept = _write_shards(
            ahead if ahead is not None else tasks, options, codec, out, bar, grow=True)
    finally:
        if ahead is not None:
            ahead.close()
    skipped.update(walk.skipped)
    return _publish(out, options, walk.labels, codec, result["job"], written, skipped,
                    layout_note)


def _stream_tasks(samples: Iterable[Sample], options: PackOptions, out: str, job: _JobHash,
                  started: Callable[[], None], scanned: Callable[[int], None]) -> Iterator[_Task]:
    """Cut key-ordered ``samples`` into shard tasks as they come (:class:`_Planner`, the cuts
    :func:`plan_shards` makes over the whole list); feeds ``job`` each shard's entries.
    ``started`` runs before the first task is handed out, ``scanned(shards)`` after the last
    sample was planned.  Oversize samples are skipped (``on_error="skip"``, counted in
    ``samples.skipped``) or raise :class:`SampleTooLargeError`."""
    estimate, planner = _estimator(options), _Planner(options)
    skip = options.on_error == "skip"
    options_text = _canonical(options.job_key())
    suffix = shard_suffix(options.format)
    chunk: list[Sample] = []
    n = 0

    def task() -> _Task:
        entries = ",".join(_sample_docs(chunk))
        job.add(entries)
        stats = getattr(samples, "stats", None)  # a Walk: read as it stats (Task.read_threads)
        return _Task(n, os.path.join(out, f"{options.prefix}-{n:06d}{suffix}"), chunk,
                     _shard_fingerprint(options_text, n, entries),
                     stats.read_threads if stats is not None else 1)

    for s in samples:
        size = estimate(s)
        if planner.too_large(size):
            if not skip:
                raise planner.error(s.key, size)
            samples.skipped["too_large"] += 1  # type: ignore[attr-defined]
            continue
        if planner.cut(size):
            t = task()
            if n == 0:
                started()
            yield t
            n += 1
            chunk = []
        chunk.append(s)
    if not chunk:
        raise EmptySourceError(
            f"every sample is larger than --shard-size {options.shard_bytes}; raise --shard-size"
        )
    last = task()
    if n == 0:
        started()
    scanned(n + 1)
    yield last


def _codec(out: str, samples: list[Sample], options: PackOptions, claims: set[str]) -> Codec:
    dictionary = None
    if options.zstd_dict:
        dictionary = _dictionary(out, samples, options.codec_level, claims,
                                 skip=options.on_error == "skip")
    return Codec(options.codec_name, options.codec_level, dictionary)


def _make_tasks(samples: list[Sample], docs: list[str], ranges: list[tuple[int, int]],
                numbers: range, out: str, options: PackOptions, read_threads: int = 1,
                codec: Codec | None = None) -> list[_Task]:
    """The write tasks of global shards ``numbers`` (their names and fingerprints are global,
    so a shard is the same file whichever process, or part, writes it); ``docs`` are the
    samples' job-document entries.  A shard compressed with a zstd dictionary (``codec``'s)
    decodes only with that one: its fingerprint covers the dictionary's digest, so a rerun
    never keeps a shard compressed with another (a job whose input changed trains another)."""
    suffix = shard_suffix(options.format)
    options_text = _canonical(options.job_key())
    if codec is not None and codec.dictionary:
        options_text += f"|zstd.dict={digest_bytes(codec.dictionary)}"
    tasks = []
    for n in numbers:
        a, b = ranges[n]
        fp = _shard_fingerprint(options_text, n, ",".join(docs[a:b]))
        tasks.append(_Task(n, os.path.join(out, f"{options.prefix}-{n:06d}{suffix}"),
                           samples[a:b], fp, read_threads))
    return tasks


def _write_shards(tasks: Iterable[_Task], options: PackOptions, codec: Codec, out: str, bar: Any,
                  grow: bool = False) -> tuple[list[WrittenShard], Counter[str], str, int]:
    """Write every task not already done, as ``tasks`` yields them; returns the shards in task
    order, the samples skipped while writing, the layout note and how many finished shards were
    kept.  With ``grow`` the progress bar's total grows by each task's bytes as it comes (the
    streaming pack does not know the total before its scan ends)."""
    results: dict[str, WrittenShard] = {}
    skipped: Counter[str] = Counter()
    order: list[str] = []
    kept = 0
    _PROBE.reset()  # see _pack_shard: each pack finds out for itself

    def done(w: WrittenShard, sk: Counter[str]) -> None:
        results[w.path] = w
        skipped.update(sk)
        if bar is not None:
            bar.update(w.raw_bytes)
            bar.set_postfix_str(f"shards {len(results)}/{len(order)}", refresh=False)

    def todo() -> Iterator[_Task]:
        nonlocal kept
        for t in tasks:
            order.append(t.final)
            if grow and bar is not None:
                bar.total += sum(s.size for s in t.samples)
                bar.refresh()
            finished = _is_done(t, options)
            if finished is None:
                for p in (t.final, t.final + ".idx"):
                    if os.path.exists(p):
                        os.unlink(p)
                yield t
            else:
                kept += 1
                done(*finished)  # with the files it skipped when it was written

    layout, layout_note = _layout_for(out, options)
    try:
        _run_tasks(todo(), options, codec, done, layout)
    finally:
        _release_buffers(options.format)
        if bar is not None:
            bar.close()
    return [results[p] for p in order], skipped, layout_note, kept


def _layout_for(out: str, options: PackOptions) -> tuple[LayoutRequest | None, str]:
    """The Lustre layout to create shards with (None off Lustre) and a line for the summary."""
    fs = detect_fs(out)
    pool = f" in pool {options.stripe_pool}" if options.stripe_pool else ""
    count = "all OSTs" if options.stripe_count == -1 else f"{options.stripe_count} stripe(s)"
    want = f"{count} of {options.stripe_size >> 10} KiB{pool}"
    if fs.kind != "lustre":
        return None, f"{fs.kind} filesystem ({fs.fstype}), not Lustre: layout ({want}) not set"
    request = LayoutRequest(stripe_count=options.stripe_count, stripe_size=options.stripe_size,
                            pool=options.stripe_pool)
    return request, f"Lustre: each shard created with {want}, read back and confirmed"


def _progress_bar(progress: bool | None, total: int, desc: str) -> Any:
    """A bar over ``total`` source bytes (None when ``progress`` is off or stderr is piped)."""
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    tqdm.monitor_interval = 0
    return tqdm(total=total, unit="B", unit_scale=True,
                unit_divisor=1024, file=sys.stderr, desc=desc, dynamic_ncols=True)


def _publish(out: str, options: PackOptions, labels: list[str] | None, codec: Codec, job: str,
             written: list[WrittenShard], skipped: Counter[str], layout_note: str = "") -> Manifest:
    """Build the manifest of a finished job, write its parity, publish it (last, atomically).

    ``stats["files_in"]`` counts the source files whose bytes are in the shards: every field
    of every sample, less the label field ``label_from_dir`` adds to each (a source file named
    like it is refused).  Whatever was left out (by the scan, or unreadable when its shard was
    written) is in ``stats["skipped"]`` by kind instead, so the count is the same whichever way
    the pack found its files (a walk, ``--files-from``, parts) and is what a loader of the
    small files would open each epoch (``metadata_ops_small_files``).

    The single-process pack and :func:`merge` both end here, so a merged dataset's manifest is
    byte for byte the one a single process writes.  Shards numbered beyond ``written`` (an
    earlier run of the job planned more: its input shrank since) and every parity file are
    deleted first, so the manifest never lands beside files a verify would call extra.
    """
    _remove_stale_shards(out, options.prefix, len(written))
    _remove_parity(out)  # this job's is written next; a killed run's temp files go too
    fields: Counter[str] = Counter()
    for w in written:
        fields.update(w.fields)
    samples = sum(w.samples for w in written)
    files_in = sum(fields.values()) - (samples if options.label_from_dir else 0)
    raw = sum(w.raw_bytes for w in written)
    stored = sum(w.stored_bytes for w in written)
    per_shard_ops = 4 if options.format == "tar" else 2
    compression = None
    if codec.name:
        compression = {
            "codec": codec.name, "level": codec.level,
            "dictionary": DICT_NAME if codec.dictionary else None,
            "dictionary_digest": digest_bytes(codec.dictionary) if codec.dictionary else None,
        }
    manifest = Manifest(
        shard_format=options.format,
        shards=[ShardEntry(
            path=os.path.basename(w.path), samples=w.samples, bytes=w.bytes, digest=w.digest,
            index=os.path.basename(w.index_path) if w.index_path else None,
            index_digest=w.index_digest, stored_bytes=w.stored_bytes, raw_bytes=w.raw_bytes,
        ) for w in written],
        fields=dict(fields),
        checksum=options.checksum,
        digest=DEFAULT_DIGEST,
        compression=compression,
        labels={"field": LABEL_FIELD, "names": labels} if labels is not None else None,
        stats={
            "files_in": files_in,
            "samples": samples,
            "shards": len(written),
            "raw_bytes": raw,
            "stored_bytes": stored,
            "shard_bytes": sum(w.bytes for w in written),
            "compression_ratio": round(raw / stored, 4) if stored else 1.0,
            "skipped": dict(sorted(skipped.items())),
            "metadata_ops_small_files": 2 * files_in,
            "metadata_ops_shards": per_shard_ops * len(written),
            "layout": layout_note,
        },
        job=job,
        created_by=f"shardio {__version__}",
    )
    if options.parity:
        from .parity import write_parity

        k, m = parse_parity(options.parity)
        manifest.parity = write_parity(out, manifest, k, m, fsync=options.fsync)
        manifest.stats["parity_bytes"] = sum(sum(g["bytes"]) for g in manifest.parity["groups"])
    if options.fsync:
        manifest.save(out)
    else:
        # Manifest.save always syncs; with --no-fsync the shards it lists are not synced either,
        # so the sync would guard nothing.  Same bytes, same atomic rename.
        atomic_write_bytes(os.path.join(out, MANIFEST_NAME), manifest.to_json(), fsync=False)
    try:
        os.unlink(os.path.join(out, STATE_NAME))
    except FileNotFoundError:
        pass
    return manifest


# The multi-node half of packing lives in shardio.parts, which builds on the functions above:
# imported last, when they exist (and eagerly, so a pack never imports modules mid-run).
from . import parts as _parts  # noqa: E402
