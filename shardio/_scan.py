"""Find the sample files of a pack source and group them into samples.

A sample is every file sharing a key: the path relative to SRC up to the first dot of the file
name (WebDataset's rule), so ``cats/0001.jpg`` and ``cats/0001.json`` form sample ``cats/0001``
with fields ``jpg`` and ``json``.  Hidden files and directories (leading dot) are ignored.
Symbolic links are followed; a link back to a directory on the current path is a loop.

Stats in threads: on a parallel filesystem a stat is a round trip to the metadata server (on
Lustre also a glimpse of the size from the storage targets), ~0.1-1 ms, so a one-thread scan of
millions of files takes minutes to hours while the writers wait for their first shards.  The
scan times its first :data:`_PROBE_STATS` stats; when they average :data:`_SLOW_STAT` or more, it
fetches each directory's stats through :data:`AUTO_SCAN_THREADS` threads (a stat releases the
GIL) before it reads them in order, so the samples and their order are the same.  On a local disk
with the dentries cached a stat takes ~2 us, and threads would only add handoffs: they stay off,
and the scan times its stats again every :data:`_REPROBE_STATS` (the first directory's may have
been cached by an ``ls``, or a slow mount may lie further down the tree).  ``scan_threads``
(``shardio pack --scan-threads``) sets the number instead (1: never).  A directory of
:data:`_STREAM_MIN` entries or more whose stats go through the threads yields its samples as
their stats arrive, in runs (:meth:`Walk._walk_streamed`), rather than once the last is in: a
folder of 20,000 files on the simulated 0.5 ms store gave its first sample after 0.13 s, not
0.86 s, and a 1-worker pack of it took 1.79-2.18 s against 2.31-2.43 s (2 workers: 1.38-1.47 s
against 1.71-1.94 s; measured 2026-11-30).

Stats in one thread (they proved fast, or ``scan_threads=1``): each directory is listed and
stat'ed by :func:`_list_dir` (``shardio/_listdir.c``: ``fstatat`` relative to the directory's
descriptor without the GIL, entries grouped and sorted in C), 20,000 files in ~60 ms against
~95 ms through ``scandir``, and one directory of 200,000 files in 0.85 s with 111 MB of peak
memory against 1.7 s and 284 MB (measured 2026-11-30).  An automatic scan has it time the first
:data:`_PROBE_STATS` stats of each directory: when they are slow, that directory and the rest
go through threads.  It hands a directory it does not handle (a name that is not valid UTF-8,
or not ASCII where the filesystem encoding is not UTF-8; an entry it cannot stat, a special
file, a file with no extension, a label file) back whole, and
:meth:`Walk._list` lists it: the problems are the Python code's.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from . import _inject
from .errors import (
    BrokenSymlinkError,
    DuplicateKeyError,
    EmptySourceError,
    NonUtf8NameError,
    ShardioError,
    SourceError,
    SymlinkLoopError,
    UnreadableFileError,
    UsageError,
)
from .formats.tar import RESERVED_FIELDS, skipped_member

try:  # a directory listed and stat'ed in C (shardio/_listdir.c); _list is the reference
    from ._listdir import list_dir as _list_dir
except ImportError:  # not built
    _list_dir = None
# Whether a name that is valid UTF-8 decodes as UTF-8 here (the usual Linux set-up, and
# Python's UTF-8 mode): then _list_dir lists directories with such names too.
_FS_UTF8 = (sys.getfilesystemencoding().lower().replace("-", "") == "utf8"
            and sys.getfilesystemencodeerrors() == "surrogateescape")

__all__ = ["AUTO_SCAN_THREADS", "Sample", "ScanResult", "Walk", "scan_source"]

LABEL_FIELD = "cls"
_O_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

# Stats in threads (see the module docstring).
AUTO_SCAN_THREADS = 16
_PROBE_STATS = 64  # stats timed before the scan decides
_REPROBE_STATS = 4096  # stats in one thread after which an automatic scan times them again
_SLOW_STAT = 50e-6  # mean seconds a stat takes from which threads pay
_MIN_POOLED = 16  # fewer stats than this in a directory are not worth the pool
# A directory of at least _STREAM_MIN entries whose stats go through the pool yields its first
# samples as their stats arrive (Walk._walk_streamed), fetched _STREAM_PER a task.
_STREAM_MIN = 2048
_STREAM_PER = 64


@dataclass(slots=True)
class Sample:
    """One sample to pack: its key and ``(field, path, size, mtime_ns)`` per file, field-sorted."""

    key: str
    files: list[tuple[str, str, int, int]]
    label: int | None = None

    @property
    def size(self) -> int:
        return sum(f[2] for f in self.files)


@dataclass
class ScanResult:
    samples: list[Sample]
    labels: list[str] | None
    files: int  # regular files found (a progress count: the manifest's files_in is what was packed)
    skipped: Counter[str] = field(default_factory=Counter)
    # How the pack reads the files (shardio._packpool.Task.read_threads): the threads the scan
    # fetched its stats through in the end, or 0 (automatic: the reads decide) or 1 (never).
    threads: int = 1


class _Problems:
    def __init__(self, on_error: str) -> None:
        self.on_error = on_error
        self.skipped: Counter[str] = Counter()

    def __call__(self, kind: str, exc: ShardioError) -> None:
        if self.on_error == "raise":
            raise exc
        self.skipped[kind] += 1


def _utf8(rel: str, problem: _Problems) -> bool:
    if rel.isascii():  # nearly every name: no encode needed
        return True
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        problem("non_utf8_name", NonUtf8NameError(
            f"path {os.fsencode(rel)!r} is not valid UTF-8 and cannot become a sample key; rename "
            "it (e.g. `convmv -f latin1 -t utf8`) or pass --on-error skip"
        ))
        return False
    return True


def _no_extension(path: str) -> SourceError:
    return SourceError(f"{path} has no extension, so it has no field name; rename it (e.g. add "
                       ".bin) or pass --on-error skip")


def _unlistable(path: str, exc: OSError) -> UnreadableFileError:
    fix = ("its path is longer than the system takes (PATH_MAX): move the tree to a shorter "
           "path" if exc.errno == errno.ENAMETOOLONG else "fix its permissions")
    return UnreadableFileError(exc.errno, f"cannot list directory {path}: {exc.strerror}; {fix} "
                               "or pass --on-error skip")


def _not_regular(path: str, mode: int) -> UnreadableFileError:
    what = ("a FIFO (named pipe)" if stat_mod.S_ISFIFO(mode) else "a socket"
            if stat_mod.S_ISSOCK(mode) else "a device file")
    return UnreadableFileError(
        errno.EINVAL, f"{path} is {what}, not a regular file: it has no bytes to pack (reading "
        "it could block for ever); remove it from SRC or pass --on-error skip")


def _no_class_dir(key: str) -> SourceError:
    return SourceError(f"sample {key!r} is not inside a class folder, so --label-from-dir cannot "
                       "label it; move it into SRC/<class>/ or pass --on-error skip")


def _case_clash(key: str, fl: list[_File], label: bool) -> DuplicateKeyError | None:
    """The error for two fields of sample ``key`` whose names differ only by case (with
    ``label``, also a field named like the label field in another case), or None: WebDataset
    lowercases field names, and refuses a sample that then has one twice."""
    seen = {LABEL_FIELD: LABEL_FIELD} if label else {}
    for f in fl:
        name = f[0]
        low = name.lower()
        other = seen.get(low)
        if other is not None and other != name:
            what = (f"a {name!r} file, which WebDataset reads as the {LABEL_FIELD!r} field that "
                    "--label-from-dir adds" if other == LABEL_FIELD and label and
                    low == LABEL_FIELD else f"fields {other!r} and {name!r}, which differ only "
                    "by case: WebDataset lowercases field names and refuses the tar")
            return DuplicateKeyError(f"sample {key!r} has {what}; rename one of its files ({f[1]})"
                                     " or pass --on-error skip")
        seen[low] = name
    return None


def _has_label_file(key: str) -> DuplicateKeyError:
    return DuplicateKeyError(f"sample {key!r} already has a {LABEL_FIELD!r} file, which "
                             "--label-from-dir would overwrite; drop one of them")


def _reserved(key: str, fl: list[_File]) -> SourceError | None:
    """The error for a sample WebDataset would not read as packed, or None: a field named like
    its ``__key__``/``__url__`` entries, or a key that makes a member name it skips."""
    for f in fl:
        if f[0] in RESERVED_FIELDS:
            return DuplicateKeyError(
                f"sample {key!r} has a field named {f[0]!r} ({f[1]}), the name of an entry every "
                "sample has: WebDataset refuses the tar (duplicate file name); rename the file "
                "or pass --on-error skip")
    if key.startswith("__") and any(skipped_member(f"{key}.{f[0]}") for f in fl):
        return SourceError(
            f"sample {key!r} ({fl[0][1]}): WebDataset skips tar members named __x__ or under a "
            "__x__/ directory (its metadata), so it would not see this sample; rename the file "
            "or its directory, or pass --on-error skip")
    return None


def _zst_clash(key: str, fl: list[_File]) -> DuplicateKeyError | None:
    """With ``--compress zstd`` a compressed field F is the tar member ``key.F.zst``: the error
    for a sample that also has a field ``F.zst``, or None."""
    names = {f[0] for f in fl}
    for f in fl:
        if f[0] + ".zst" in names:
            return DuplicateKeyError(
                f"sample {key!r} has fields {f[0]!r} and {f[0] + '.zst'!r}: with --compress zstd "
                f"the first is stored as the tar member {key}.{f[0]}.zst, the name of the second; "
                "rename one of the files, pack without --compress, or pass --on-error skip")
    return None


def _lowered(fl: list[_File]) -> list[_File]:
    """``fl`` with its field names lowercased, as WebDataset reads them (after
    :func:`_case_clash`: no two then share a name), in field order."""
    for f in fl:
        if f[0] != f[0].lower():
            return sorted(((f[0].lower(), *f[1:]) for f in fl), key=lambda f: f[0])
    return fl


def check_sample(key: str, fl: list[_File], label: bool, zst: bool
                 ) -> list[_File] | tuple[str, SourceError]:
    """The files of sample ``key`` as it is packed (field names lowercased), or ``(skip kind,
    error)`` for a sample WebDataset would not read as shardio does: two fields differing only
    by case (with ``label``, one named like the label field), a reserved field name or a member
    name it skips, and with ``zst`` (``--compress zstd``) fields F and F.zst."""
    if len(fl) > 1 or label:
        clash = _case_clash(key, fl, label)
        if clash is not None:
            return "duplicate_key", clash
    fl = _lowered(fl)
    bad = (_reserved(key, fl) if len(fl) > 1 or key[:1] == "_" or fl[0][0][:1] == "_"
           else None)
    if bad is None and zst and len(fl) > 1:
        bad = _zst_clash(key, fl)
    if bad is not None:
        return ("reserved_name" if type(bad) is SourceError else "duplicate_key"), bad
    return fl


def _fetch_entries(entries: Sequence[os.DirEntry[str]], latency: float = 0.0) -> list[Any]:
    """Stat ``entries`` (following links) into their caches; a failure is left for the caller's
    own ``stat()`` to meet again.  ``latency``: the simulated one (``SHARDIO_SLOW_STATS``)."""
    for e in entries:
        if latency:
            time.sleep(latency)
        try:
            e.stat(follow_symlinks=True)
        except OSError:
            pass
    return []


def _stat_paths(paths: Sequence[str], latency: Callable[[str], float] | None = None
                ) -> list[os.stat_result | OSError]:
    out: list[os.stat_result | OSError] = []
    for p in paths:
        if latency is not None:
            time.sleep(latency(p))
        try:
            out.append(os.stat(p))
        except OSError as exc:
            out.append(exc)
    return out


class _Stats:
    """Whether, and through how many threads, a scan fetches its stats (see the module
    docstring).  ``threads``: ``None`` decides from the first stats; 1 never uses threads."""

    def __init__(self, threads: int | None) -> None:
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise UsageError(f"scan_threads must be an integer >= 1, got {threads!r}")
        self.threads = threads
        self.auto = threads is None
        self.decided = not self.auto
        self.probed = 0
        self.probe_s = 0.0
        self.unprobed = 0  # stats made in one thread since the automatic decision
        self.probes = 0  # decisions made (tests)
        self._pool: Any = None  # a ThreadPoolExecutor, made at first use (after any fork)
        self._latency: dict[str, float] = {}

    @property
    def pooled(self) -> bool:
        return self.decided and (self.threads or 1) > 1

    @property
    def read_threads(self) -> int:
        """How the pack should read the files (``Task.read_threads``): the threads stats go
        through now; else 0 (let the reads decide: an automatic scan) or 1 (never)."""
        if self.pooled:
            return self.threads or 1
        return 0 if self.auto else 1

    def _probe(self, fetch: Callable[[Any, Any], list[Any]], items: Sequence[Any],
               latency: Any) -> list[Any]:
        """``fetch(items, latency)``, timed towards the decision."""
        t = time.perf_counter()
        got = fetch(items, latency)
        self.probe_s += time.perf_counter() - t
        self.probed += len(items)
        if self.probed >= _PROBE_STATS:
            self.decided = True
            self.probes += 1
            self.threads = AUTO_SCAN_THREADS if self.probe_s / self.probed >= _SLOW_STAT else 1
        return got

    @property
    def fast(self) -> bool:
        """Whether a directory may be listed by :func:`_list_dir`, stats in one thread: they
        proved fast, or threads are off, and no latency is simulated."""
        return self.decided and not self.pooled and not _inject.STATS_ACTIVE

    def probe_args(self) -> tuple[int, float]:
        """:func:`_list_dir`'s ``probe`` and ``slow_s``: an automatic scan times the first
        :data:`_PROBE_STATS` stats of each directory it lists in C; 1 thread never."""
        return (_PROBE_STATS, _SLOW_STAT) if self.auto else (0, 0.0)

    def slow(self) -> None:
        """:func:`_list_dir` found stats slow: fetch them through threads from now on (as the
        probe decides)."""
        self.decided, self.threads, self.unprobed = True, AUTO_SCAN_THREADS, 0
        self.probes += 1

    def passed(self, n: int) -> None:
        """``n`` more stats were made in one thread: after :data:`_REPROBE_STATS` of them, an
        automatic scan times the next ones again."""
        if not self.auto or self.pooled:
            return
        self.unprobed += n
        if self.unprobed >= _REPROBE_STATS:
            self.decided, self.probed, self.probe_s, self.unprobed = False, 0, 0.0, 0

    def _executor(self) -> Any:
        """The stat pool (a ThreadPoolExecutor of ``threads`` threads), made at first use."""
        if self._pool is None:
            # Imported here: ~5 ms of every pack's start otherwise, and most scans never need it.
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(self.threads or 1, thread_name_prefix="shardio-stat")
        return self._pool

    def _map(self, fn: Callable[[Any], list[Any]], items: Sequence[Any]) -> list[Any]:
        """``fn`` over chunks of ``items`` in the pool, results concatenated in order."""
        per = max(8, -(-len(items) // ((self.threads or 1) * 4)))
        parts = self._executor().map(fn, [items[i:i + per] for i in range(0, len(items), per)])
        return [r for part in parts for r in part]

    def fetch(self, directory: str, entries: Sequence[os.DirEntry[str]]) -> list[Any]:
        """Start fetching the stats of ``entries`` in the pool (``_STREAM_PER`` a task); the
        futures, to wait on before reading them (:meth:`Walk._walk_streamed`)."""
        lat = self._dir_latency(directory) if _inject.STATS_ACTIVE else 0.0
        pool = self._executor()
        return [pool.submit(_fetch_entries, entries[i:i + _STREAM_PER], lat)
                for i in range(0, len(entries), _STREAM_PER)]

    def _dir_latency(self, directory: str) -> float:
        """The simulated latency of a stat in ``directory`` (``SHARDIO_SLOW_STATS``)."""
        got = self._latency.get(directory)
        if got is None:
            got = self._latency[directory] = _inject.stat_latency(directory)
        return got

    def latency(self, path: str) -> float:
        return self._dir_latency(os.path.dirname(path))

    def probe(self, directory: str, entries: list[os.DirEntry[str]]) -> int:
        """While undecided, time the stats of the first of ``entries`` (visible ones) that the
        decision still needs; how many it stat'ed.  Also called ahead of :meth:`entries` for a
        large directory, which streams only through the pool (:meth:`Walk._walk_streamed`), so
        that must be known before it is walked."""
        if self.decided or not entries:
            return 0
        head = entries[:_PROBE_STATS - self.probed]
        lat = self._dir_latency(directory) if _inject.STATS_ACTIVE else 0.0
        self._probe(_fetch_entries, head, lat)
        return len(head)

    def entries(self, directory: str, entries: list[os.DirEntry[str]]) -> None:
        """Fetch the stats of a directory's entries (hidden ones aside) into their caches
        before the walk reads them in order: in the pool once stats proved slow; timed while
        that is undecided; with the simulated latency when one is set."""
        lat = self._dir_latency(directory) if _inject.STATS_ACTIVE else 0.0
        if self.decided and not self.pooled:
            self.passed(len(entries))
            if not lat:
                return
        todo = [e for e in entries if e.name[0] != "."]
        if not self.decided and todo:
            todo = todo[self.probe(directory, todo):]
            if self.decided and not self.pooled:
                self.passed(len(todo))  # the rest, fetched by the walk itself
        if not todo:
            return
        if self.pooled and len(todo) >= _MIN_POOLED:
            self._map(lambda chunk: _fetch_entries(chunk, lat), todo)
        elif lat:
            _fetch_entries(todo, lat)

    def paths(self, paths: list[str]) -> list[os.stat_result | OSError]:
        """``os.stat`` of each of ``paths`` in order, the ``OSError`` in place of a failed one."""
        lat = self.latency if _inject.STATS_ACTIVE else None
        out: list[os.stat_result | OSError] = []
        for at in range(0, len(paths), _REPROBE_STATS):
            rest = paths[at:at + _REPROBE_STATS]
            if not self.decided:
                head, rest = rest[:_PROBE_STATS - self.probed], rest[_PROBE_STATS - self.probed:]
                out += self._probe(_stat_paths, head, lat)
            if self.pooled and len(rest) >= _MIN_POOLED:
                out += self._map(lambda chunk: _stat_paths(chunk, lat), rest)
            else:
                out += _stat_paths(rest, lat)
                if self.decided:
                    self.passed(len(rest))
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _stream_order(entries: list[os.DirEntry[str]]) -> list[tuple[str, str, Any]] | None:
    """``(place, name, entry)`` of a directory's visible entries in the walk's order (a file's
    place is its stem, a directory's its name and "/"), from the types ``readdir`` gave; None
    when an entry is a symbolic link (its place needs its target's stat)."""
    keyed = []
    for e in entries:
        name = e.name
        if name[0] == ".":
            continue
        if e.is_symlink():
            return None
        keyed.append((name + "/" if e.is_dir(follow_symlinks=False) else name.partition(".")[0],
                      name, e))
    keyed.sort(key=lambda k: (k[0], k[1]))
    return keyed


# (directory relative to SRC, file name, path, size, mtime_ns)
_Found = tuple[str, str, str, int, int]
_File = tuple[str, str, int, int]  # (field, path, size, mtime_ns), as in Sample.files


class Walk:
    """The samples under ``src``, yielded in key order while the tree is still being walked.

    A pack can plan and write its first shards before the last directory is listed (on a
    parallel filesystem the scan of millions of files is minutes of metadata traffic).  Key
    order comes out of a depth-first walk because each directory's entries are visited sorted by
    where their keys fall: a file by its stem, a subdirectory ``d`` by ``d + "/"`` (every key
    below it starts with that, and no stem holds a ``/``), which is exactly the order of
    ``sorted()`` over the full keys.  With ``label_from_dir``, ``labels`` (every top-level
    folder, sorted: a sample's label is its folder's position) is set once the top level is
    listed; ``files`` and ``skipped`` are final once the iteration ends.

    Raises (while iterating):
        EmptySourceError, BrokenSymlinkError, SymlinkLoopError, NonUtf8NameError,
        UnreadableFileError, SourceError, DuplicateKeyError: per the ``on_error`` policy.
    """

    def __init__(self, src: str, out: str, *, label_from_dir: bool, on_error: str,
                 scan_threads: int | None = None, zstd: bool = False) -> None:
        self.src, self.label_from_dir, self.zstd = src, label_from_dir, zstd
        self.stats = _Stats(scan_threads)
        self.out_real = os.path.realpath(out)
        self.problem = _Problems(on_error)
        self.labels: list[str] | None = [] if label_from_dir else None
        self.files = 0
        self.samples = 0

    @property
    def skipped(self) -> Counter[str]:
        return self.problem.skipped

    def __iter__(self) -> Iterator[Sample]:
        root = os.stat(self.src)
        try:
            yield from self._visit(self.src, "", frozenset({(root.st_dev, root.st_ino)}), None)
        finally:
            self.stats.close()  # no stat thread outlives the walk (the packer forks after it)
        if not self.samples:
            raise EmptySourceError(
                f"no sample files found in {self.src}"
                + (f"; skipped: {dict(self.skipped)}" if self.skipped else "")
                + "; point SRC at the directory holding the files (hidden files are ignored)"
            )

    def _visit(self, path: str, rel: str, ancestors: frozenset[tuple[int, int]],
               cls: int | None) -> Iterator[Sample]:
        """Samples below directory ``path`` (``rel`` relative to SRC); ``cls`` is the label of
        the class folder it lies in (with ``label_from_dir``)."""
        problem = self.problem
        # The directory is listed through a descriptor so that each entry's stat is an fstatat
        # relative to it, not a walk of the whole path again (~20% of a scan).
        try:
            dfd = os.open(path, _O_DIR)
        except OSError as exc:
            problem("unreadable", _unlistable(path, exc))
            return
        try:
            if _list_dir is not None and self.stats.fast:
                base = path if path.endswith(os.sep) else path + os.sep
                got = _list_dir(dfd, base, LABEL_FIELD if self.label_from_dir else None,
                                *self.stats.probe_args(), _FS_UTF8)
                if got is False:  # stats became slow: this directory's go through threads
                    self.stats.slow()
                elif got is not None:
                    os.close(dfd)
                    dfd = -1
                    yield from self._walk_fast(base, rel, ancestors, cls, *got)
                    return
            try:
                with os.scandir(dfd) as it:
                    entries = list(it)
            except OSError as exc:
                problem("unreadable", _unlistable(path, exc))
                return
            if rel and len(entries) >= _STREAM_MIN and (self.stats.pooled
                                                        or not self.stats.decided):
                keyed = _stream_order(entries)
                if keyed is not None:
                    self.stats.probe(path, [k[2] for k in keyed])  # (once decided: nothing)
                if keyed is not None and self.stats.pooled:
                    del entries
                    yield from self._walk_streamed(path, dfd, rel, ancestors, cls, keyed)
                    return
            self.stats.entries(path, entries)  # their stats, fetched ahead when that pays
            groups, subdirs = self._list(path, dfd, rel, ancestors, entries)
            # Let the entries (and the stats they cache) go before the walk goes down: this
            # frame lives until every directory below has been walked.
            del entries
        finally:
            if dfd >= 0:
                os.close(dfd)
        yield from self._walk_listed(rel, ancestors, cls, groups, subdirs)

    def _walk_streamed(self, path: str, dfd: int, rel: str,
                       ancestors: frozenset[tuple[int, int]], cls: int | None,
                       keyed: list[Any]) -> Iterator[Sample]:
        """The samples of a large directory whose stats go through the pool, yielded as their
        stats arrive rather than once all have: ``keyed`` (:func:`_stream_order`) is cut into
        runs of ``threads x _STREAM_PER`` entries that end where a key changes, each run's
        stats fetched while the one before it is read (by :meth:`_list`, so the samples, their
        order and the problems are the Python code's; problems come in key order rather than
        directory order).  On a parallel filesystem a folder of a million files would otherwise
        hold the pack's first shard until its last stat (~30 s at 0.5 ms and 16 threads).
        ``dfd`` stays open until the last stat (a DirEntry stats through it)."""
        step = (self.stats.threads or 1) * _STREAM_PER
        runs = []
        a, n = 0, len(keyed)
        while a < n:
            b = min(n, a + step)
            while b < n and keyed[b][0] == keyed[b - 1][0]:
                b += 1
            runs.append((a, b))
            a = b
        pending: deque[list[Any]] = deque()  # the fetches of the next runs, two at most
        started = 0

        def fetch_next() -> None:
            nonlocal started
            s, e = runs[started]
            pending.append(self.stats.fetch(path, [k[2] for k in keyed[s:e]]))
            started += 1

        try:
            fetch_next()
            for a, b in runs:
                if started < len(runs):  # the next run's stats, while this one's arrive
                    fetch_next()
                for future in pending.popleft():
                    future.result()
                run = [k[2] for k in keyed[a:b]]
                keyed[a:b] = [None] * (b - a)  # let the stats go once read
                groups, subdirs = self._list(path, dfd, rel, ancestors, run)
                del run
                yield from self._walk_listed(rel, ancestors, cls, groups, subdirs)
        finally:
            # Closed early (an error, or the pack stopped): no stat may still run through
            # ``dfd`` once the caller closes it.
            for futures in pending:
                for future in futures:
                    if not future.cancel():
                        future.exception()

    def _walk_fast(self, base: str, rel: str, ancestors: frozenset[tuple[int, int]],
                   cls: int | None, files: int, groups: list[tuple[str, list[_File]]],
                   dirs: list[tuple[str, int, int]]) -> Iterator[Sample]:
        """:meth:`_walk_listed` of a directory :func:`_list_dir` listed."""
        self.files += files
        if files + len(dirs) < _PROBE_STATS:
            # Untimed by list_dir (a larger directory's first stats were): these count towards
            # the scan's next probe.
            self.stats.passed(files + len(dirs))
        subdirs: dict[str, tuple[str, tuple[int, int]]] = {}
        for name, dev, ino in dirs:
            self._subdir(subdirs, base + name, (dev, ino), ancestors)
        yield from self._walk_listed(rel, ancestors, cls, groups, subdirs)

    def _walk_listed(self, rel: str, ancestors: frozenset[tuple[int, int]], cls: int | None,
                     groups: dict[str, list[_File]] | list[tuple[str, list[_File]]],
                     subdirs: dict[str, tuple[str, tuple[int, int]]]) -> Iterator[Sample]:
        """The samples of a listed directory and of those below it, in key order: ``groups``
        maps each stem to its files in field order (or is a list of such pairs sorted by stem,
        from :func:`_list_dir`); ``subdirs`` as :meth:`_list` returns them."""
        problem = self.problem
        prefix = f"{rel}/" if rel else ""
        top = self.label_from_dir and not rel
        if top:
            # Every class folder gets an id, empty or not, in sorted order (torchvision's
            # ImageFolder rule), so that ids are known before the folders are walked.
            self.labels = sorted(place[:-1] for place in subdirs)
            ids = {name: i for i, name in enumerate(self.labels)}
        if isinstance(groups, dict) or subdirs:
            files = groups if isinstance(groups, dict) else dict(groups)
            order: Iterable[tuple[str, list[_File] | None]] = [
                (place, files.get(place)) for place in sorted([*files, *subdirs])]
        else:
            order = groups
        for place, fl in order:
            if fl is None:
                full, ident = subdirs[place]
                name = place[:-1]
                yield from self._visit(full, prefix + name, ancestors | {ident},
                                       ids[name] if top else cls)
                continue
            key = prefix + place
            checked = check_sample(key, fl, self.label_from_dir, self.zstd)
            if type(checked) is tuple:
                problem(*checked)
                continue
            fl = checked
            if not self.label_from_dir:
                self.samples += 1
                yield Sample(key, fl)
                continue
            if cls is None:
                problem("no_class_dir", _no_class_dir(key))
                continue
            if fl[0][0] == LABEL_FIELD if len(fl) == 1 else any(f[0] == LABEL_FIELD for f in fl):
                problem("duplicate_key", _has_label_file(key))
                continue
            self.samples += 1
            yield Sample(key, fl, cls)

    def _list(self, path: str, dfd: int, rel: str, ancestors: frozenset[tuple[int, int]],
              entries: list[os.DirEntry[str]]
              ) -> tuple[dict[str, list[_File]], dict[str, tuple[str, tuple[int, int]]]]:
        """Stat a directory's entries: its files grouped by stem (``{stem: [file, ...]}`` in
        field order) and its subdirectories (``{name + "/": (path, (dev, ino))}``)."""
        problem = self.problem
        prefix = f"{rel}/" if rel else ""
        base = path if path.endswith(os.sep) else path + os.sep  # os.path.join(path, name)
        isdir, isreg = stat_mod.S_ISDIR, stat_mod.S_ISREG
        groups: dict[str, dict[str, _File]] = {}
        subdirs: dict[str, tuple[str, tuple[int, int]]] = {}
        for e in entries:
            name = e.name
            if name[0] == ".":
                continue
            try:
                st = e.stat(follow_symlinks=True)
            except FileNotFoundError:
                if e.is_symlink():
                    problem("broken_symlink", BrokenSymlinkError(
                        2, f"{base + name} is a symbolic link to "
                        f"{os.readlink(name, dir_fd=dfd)!r}, which does not exist; fix or remove "
                        "the link, or pass --on-error skip"))
                continue
            except OSError as exc:
                if exc.errno == 40:  # ELOOP: a chain of links that never ends
                    problem("symlink_loop", SymlinkLoopError(
                        exc.errno, f"{base + name}: too many levels of symbolic links; remove the "
                        "loop or pass --on-error skip"))
                else:
                    problem("unreadable", UnreadableFileError(
                        exc.errno, f"cannot stat {base + name}: {exc.strerror}; pass --on-error "
                        "skip to leave it out"))
                continue
            if not name.isascii() and not _utf8(prefix + name, problem):
                continue
            mode = st.st_mode
            if isreg(mode):
                self.files += 1
                stem, dot, ext = name.partition(".")
                if not dot:
                    problem("no_extension", _no_extension(base + name))
                    continue
                entry = (ext, base + name, st.st_size, st.st_mtime_ns)
                have = groups.get(stem)
                if have is None:
                    groups[stem] = {ext: entry}
                else:
                    have[ext] = entry  # names are unique in a directory: so is (stem, ext)
            elif isdir(mode):
                self._subdir(subdirs, base + name, (st.st_dev, st.st_ino), ancestors)
            else:
                problem("not_regular", _not_regular(base + name, mode))
        return {stem: [have[f] for f in sorted(have)] if len(have) > 1 else list(have.values())
                for stem, have in groups.items()}, subdirs

    def _subdir(self, subdirs: dict[str, tuple[str, tuple[int, int]]], full: str,
                ident: tuple[int, int], ancestors: frozenset[tuple[int, int]]) -> None:
        """Add directory ``full`` to ``subdirs`` unless it is a loop (a problem) or OUT."""
        if ident in ancestors:
            self.problem("symlink_loop", SymlinkLoopError(
                40, f"{full} links back to a directory above it "
                f"({os.path.realpath(full)}); remove the link or pass --on-error skip"))
            return
        if os.path.realpath(full) == self.out_real:
            return
        subdirs[full[full.rindex(os.sep) + 1:] + "/"] = (full, ident)


def _outside(rel: str) -> bool:
    """Whether a path relative to SRC leaves it (``..`` or ``../x``; ``..x`` is a hidden name
    inside it, which a list may name)."""
    return rel == os.pardir or rel.startswith(os.pardir + os.sep)


def _from_list(src: str, list_path: str, problem: _Problems, stats: _Stats) -> list[_Found]:
    try:
        with open(list_path, "rb") as f:
            text = f.read()
    except OSError as exc:
        raise UsageError(f"cannot read --files-from {list_path}: {exc.strerror}") from exc
    if b"\0" in text:  # no path holds one (os.stat would raise ValueError)
        raise UsageError(
            f"--files-from {list_path} holds NUL bytes (a `find -print0` list?); it takes one "
            "path per line: write it with `find ... -print` (or `tr '\\0' '\\n'` it)"
        )
    lines = text.splitlines()
    src_real = os.path.realpath(src)
    listed: list[tuple[str, str]] = []  # (path, rel)
    for raw in lines:
        # Every other line is a path, as tar -T reads them: no comments, so that a file named
        # "#1.jpg" (in find's output, say) is not silently left out.
        if not raw.strip():
            continue
        name = os.fsdecode(raw.rstrip(b"\r"))
        path = name if os.path.isabs(name) else os.path.join(src, name)
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(src))
        if _outside(rel):
            rel = os.path.relpath(os.path.realpath(path), src_real)
            if _outside(rel):
                raise UsageError(
                    f"--files-from entry {name!r} lies outside SRC {src}; keys are paths relative "
                    "to SRC, so pass a SRC that contains every listed file"
                )
        rel = rel.replace(os.sep, "/")
        if not _utf8(rel, problem):
            continue
        listed.append((path, rel))
    found = []
    try:
        results = stats.paths([path for path, _rel in listed])
    finally:
        stats.close()
    for (path, rel), st in zip(listed, results):
        if isinstance(st, FileNotFoundError):
            if os.path.islink(path):
                problem("broken_symlink", BrokenSymlinkError(
                    2, f"{path} is a broken symbolic link; fix it or pass --on-error skip"))
            else:
                problem("unreadable", UnreadableFileError(
                    2, f"listed file {path} does not exist; fix the list or pass --on-error skip"))
            continue
        if isinstance(st, OSError):
            kind = "symlink_loop" if st.errno == 40 else "unreadable"
            cls = SymlinkLoopError if st.errno == 40 else UnreadableFileError
            problem(kind, cls(st.errno, f"cannot stat {path}: {st.strerror}; "
                              "pass --on-error skip to leave it out"))
            continue
        if stat_mod.S_ISREG(st.st_mode):
            d, base = os.path.split(rel)
            found.append((d, base, path, st.st_size, st.st_mtime_ns))
        elif not stat_mod.S_ISDIR(st.st_mode):
            problem("not_regular", _not_regular(path, st.st_mode))
    return found


def _listed_twice(key: str, ext: str, first: str, path: str, files_from: str
                  ) -> DuplicateKeyError:
    """The error for a ``--files-from`` entry giving sample ``key`` field ``ext`` again: with
    paths relative to SRC, nearly always one file listed twice (renaming it fixes nothing)."""
    try:
        same = os.path.samefile(first, path)
    except OSError:
        same = False
    if same:
        return DuplicateKeyError(
            f"{path} is listed twice in --files-from {files_from} (also as {first}), which "
            f"gives sample {key!r} field {ext!r} twice; remove the repeated line (e.g. `sort -u` "
            "the list) or pass --on-error skip")
    return DuplicateKeyError(f"two files give sample {key!r} field {ext!r}: {first} and {path}; "
                             "rename one or pass --on-error skip")


def scan_source(
    src: str, out: str, *, files_from: str | None, label_from_dir: bool, on_error: str,
    scan_threads: int | None = None, zstd: bool = False,
) -> ScanResult:
    """Scan ``src`` (or the list ``files_from`` relative to it) into key-sorted samples;
    ``scan_threads``: see the module docstring; ``zstd``: the pack compresses fields
    (:func:`check_sample`).

    Raises:
        EmptySourceError, DuplicateKeyError, BrokenSymlinkError, SymlinkLoopError,
        NonUtf8NameError, UnreadableFileError, SourceError: per the ``on_error`` policy.
    """
    if not files_from:
        walk = Walk(src, out, label_from_dir=label_from_dir, on_error=on_error,
                    scan_threads=scan_threads, zstd=zstd)
        samples = list(walk)
        return ScanResult(samples, walk.labels, walk.files, walk.skipped,
                          walk.stats.read_threads)
    problem = _Problems(on_error)
    stats = _Stats(scan_threads)
    files = _from_list(src, files_from, problem, stats)
    # key -> its one file (the common case: no dict per key), or {field: file} for several.
    by_key: dict[str, _File | dict[str, _File]] = {}
    for d, base, path, size, mtime in files:
        if "." not in base:
            problem("no_extension", _no_extension(path))
            continue
        stem, ext = base.split(".", 1)
        key = f"{d}/{stem}" if d else stem
        if not key:  # a listed ".x.txt" at the top (listed hidden files are packed: d/.h.txt
            # is key "d/", as WebDataset reads it)
            problem("empty_key", SourceError(
                f"{path}: a file whose name starts with a dot, at the top of SRC, has an empty "
                "key, and WebDataset skips such a sample; rename it, move it into a folder, or "
                "pass --on-error skip"))
            continue
        entry = (ext, path, size, mtime)
        have = by_key.get(key)
        if have is None:
            by_key[key] = entry
            continue
        if type(have) is tuple:
            have = by_key[key] = {have[0]: have}
        if ext in have:
            problem("duplicate_key", _listed_twice(key, ext, have[ext][1], path, files_from))
            continue
        have[ext] = entry
    labels: list[str] | None = None
    cls_id: dict[str, int] = {}
    if label_from_dir:
        classes = sorted({k.split("/", 1)[0] for k in by_key if "/" in k})
        labels = classes
        cls_id = {c: i for i, c in enumerate(classes)}
    samples: list[Sample] = []
    append = samples.append
    for key in sorted(by_key):
        have = by_key[key]
        if type(have) is tuple:
            fl = [have]
            has_label_file = have[0] == LABEL_FIELD
        else:
            fl = [have[f] for f in sorted(have)]
            has_label_file = LABEL_FIELD in have
        checked = check_sample(key, fl, label_from_dir and not has_label_file, zstd)
        if type(checked) is tuple:
            problem(*checked)
            continue
        fl = checked
        if not label_from_dir:
            append(Sample(key, fl))
            continue
        cls, slash, _rest = key.partition("/")
        if not slash:
            problem("no_class_dir", _no_class_dir(key))
            continue
        if has_label_file:
            problem("duplicate_key", _has_label_file(key))
            continue
        append(Sample(key, fl, cls_id[cls]))
    if not samples:
        raise EmptySourceError(
            f"no sample files found in {src}" + (f" (list {files_from})" if files_from else "")
            + (f"; skipped: {dict(problem.skipped)}" if problem.skipped else "")
            + "; point SRC at the directory holding the files (hidden files are ignored)"
        )
    return ScanResult(samples, labels, len(files), problem.skipped, stats.read_threads)
