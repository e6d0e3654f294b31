"""``shardio bench storage PATH``: measure a filesystem before choosing shard size, striping,
loader workers and staging depth.

What is measured, in this order (each phase gets a share of ``time_limit_s`` that grows with the
time earlier phases left unused; a phase that runs out stops early, reports what it did, and
says so with ``"stopped_early": true``)::

    seq_write     max(#I/O sizes, max threads) test files, each written with one I/O size (in
                  turn), sequential os.write timed through fsync; every 4 KiB block unique
    seq_read      each file read sequentially per I/O size, through the page cache (its pages
                  dropped first: fsync + POSIX_FADV_DONTNEED) and with O_DIRECT (aligned mmap
                  buffers, os.preadv); O_DIRECT refused (EINVAL, e.g. ramfs) -> a note, no crash
    random_read   os.preadv at random 4 KiB-aligned offsets over every test file, at 4 KiB and
                  at a sample size, with each thread count: IOPS, MB/s, latency P50/P99/P99.9
    metadata      create / stat / open+close / unlink per second on up to 2000 empty files
    streams       aggregate bandwidth of T threads each reading its own file (T loader workers),
                  T = the --threads values and the powers of two below the largest
    lustre_osts   on Lustre only: one file pinned to each OST (stripe count 1, stripe_offset k,
                  delayed create + lustre.lov), written and read; a failed pin ends with a note
    cache_dir     optional: a sequential read on the node-local cache, to decide staging

Safety: everything lives in a fresh ``PATH/.shardio-bench-<random>`` directory (and one under
``cache_dir``), named before it is made (:func:`_temp_name`) so that a Ctrl-C at any moment finds
its removal armed, and removed in a ``finally`` with SIGINT/SIGTERM blocked while it goes;
SIGTERM is turned into KeyboardInterrupt while the bench runs.  Bytes written never exceed the
budget, which is capped at half the free space (statvfs) before anything is written.
ENOSPC/EDQUOT (a quota statvfs does not see, another writer) stops the run with
``"error": "disk full ..."``, except while the metadata phase creates its empty files: running
out of inodes there ends that phase's creates with a note, and the run goes on.

The result is a JSON-ready dict (sections above plus ``fs``, ``config``, ``recommendations``,
``notes``, ``bytes_written``, ``elapsed_s``, ``error``); :func:`format_report` renders it as text.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import mmap
import numbers
import os
import re
import secrets
import shutil
import signal
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from . import lustre
from ._fsutil import parse_size
from .errors import LayoutError, ShardioError, UsageError

__all__ = ["add_arguments", "format_report", "recommend", "run_cli", "run_storage_bench"]

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
DEFAULT_IO_SIZES = (64 * KiB, MiB, 4 * MiB, 16 * MiB)
DEFAULT_THREADS = (1, 4)
MIN_BUDGET = 4 * MiB
TEMP_PREFIX = ".shardio-bench-"
MAX_META_FILES = 2000
MAX_OST_PROBE = 16  # OSTs tried one by one when `lfs df` cannot list them
_ALIGN = 4096  # O_DIRECT offset/size alignment that suits every common logical block size
_FULL = (errno.ENOSPC, errno.EDQUOT)
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_WEIGHTS = {"seq_write": 2.0, "seq_read": 2.5, "random_read": 2.5, "metadata": 1.0,
            "streams": 1.5, "lustre_osts": 2.0, "cache_dir": 0.5}

Progress = Callable[[str, str], None]


def _mbps(nbytes: float, seconds: float) -> float:
    return round(nbytes / max(seconds, 1e-9) / 1e6, 2)


def _size(n: float) -> str:
    for unit, name in ((GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if n >= unit:
            return f"{n / unit:g} {name}" if n % unit == 0 else f"{n / unit:.1f} {name}"
    return f"{n:g} B"


def _percentiles_us(*lat_ns: array) -> dict[str, float]:
    """P50/P99/P99.9 in microseconds of the nanosecond latencies in ``lat_ns`` (array("q")s)."""
    import numpy as np  # loaded only when the bench runs, so building the CLI parser stays cheap

    every = np.concatenate([np.frombuffer(a, dtype=np.int64) for a in lat_ns])
    p = np.maximum.accumulate(np.percentile(every / 1e3, [50, 99, 99.9]))
    return {"p50": round(float(p[0]), 2), "p99": round(float(p[1]), 2),
            "p99_9": round(float(p[2]), 2)}


class _Clock:
    """Hands each phase a deadline: its weight's share of the time still left."""

    def __init__(self, limit: float, phases: Sequence[str]) -> None:
        self.end = time.monotonic() + limit
        self.left = {p: _WEIGHTS[p] for p in phases}

    def deadline(self, phase: str) -> float:
        w = self.left.pop(phase)
        now = time.monotonic()
        return now + max(0.0, self.end - now) * w / (w + sum(self.left.values()))


@contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """While the bench runs, SIGTERM raises KeyboardInterrupt so the ``finally`` cleans up."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old if old is not None else signal.SIG_DFL)


def _temp_name(parent: str) -> str:
    """A fresh name for a temp directory under ``parent``; nothing is made.  The caller keeps
    the name, then makes the directory (``os.mkdir(name, 0o700)``): a Ctrl-C that lands at any
    moment finds the name kept, so its ``finally`` removes whatever was made.  (``mkdtemp``
    returns the name only once the directory exists: an interrupt between the two, which a
    signal mask cannot hold off when another thread takes the signal, left the directory.)"""
    return os.path.join(parent, TEMP_PREFIX + secrets.token_hex(12))


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT/SIGTERM back in this thread while a temp directory is removed; a held
    signal is delivered after."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _remove_tree(path: str) -> str | None:
    """rmtree with signals held; what could not be removed, or None."""
    failed: list[str] = []

    def note(_fn: object, where: str, exc: BaseException) -> None:
        if not isinstance(exc, FileNotFoundError):
            failed.append(f"{where}: {exc}")

    with _signals_held():
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=note)
        else:
            shutil.rmtree(path, onerror=lambda fn, where, info: note(fn, where, info[1]))
    return "; ".join(failed) or None


def _check_options(path: str, budget: int, time_limit: float, io_sizes: Sequence[int],
                   threads: Sequence[int], sample_size: int) -> None:
    if not os.path.isdir(path):
        raise UsageError(f"{path} is not a directory; pass the directory to measure")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{path} is not writable; pass a directory you can write to")
    if not (isinstance(time_limit, (int, float)) and 0 < time_limit < 1e6):  # (not inf, NaN)
        raise UsageError(f"time limit must be > 0 seconds, got {time_limit!r}; pass --time-limit")
    if budget < MIN_BUDGET:
        raise UsageError(f"budget {_size(budget)} is below the minimum {_size(MIN_BUDGET)}; "
                         f"pass --budget {_size(MIN_BUDGET).replace(' ', '')} or more")
    for s in (*io_sizes, sample_size):
        if s <= 0 or s % _ALIGN:
            raise UsageError(f"I/O size {s} is not a positive multiple of 4 KiB (O_DIRECT needs "
                             "aligned sizes); pass e.g. --io-sizes 64KiB,1MiB,4MiB")
    if not io_sizes or not threads or any(
            isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 1 <= t <= 256
            for t in threads):  # (2.0 passed, then failed deep in the run with a TypeError)
        raise UsageError(f"need at least one I/O size and thread counts in 1..256, got "
                         f"{list(io_sizes)} / {list(threads)}; pass e.g. --threads 1,4")


def _effective_budget(path: str, requested: int) -> tuple[int, int | None]:
    """(budget, free bytes): the requested budget capped at half the free space.  A filesystem
    that reports no size at all (ramfs, some FUSE) has free None and the budget is not capped."""
    st = os.statvfs(path)
    if st.f_blocks == 0:
        return requested, None
    free = st.f_bavail * st.f_frsize
    budget = min(requested, free // 2)
    if budget < MIN_BUDGET:
        raise UsageError(
            f"{path} has {_size(free)} free; the storage bench writes at most half the free "
            f"space and needs --budget of at least {_size(MIN_BUDGET)} (here at most "
            f"{_size(free // 2)}): free space on that filesystem or choose another PATH")
    return budget, free


class _Bench:
    """One run: the temp directory, the test files, and the result being filled in."""

    def __init__(self, path: str, budget: int, io_sizes: Sequence[int], threads: Sequence[int],
                 direct: bool, sample_size: int, progress: Progress | None) -> None:
        import numpy as np

        self.path, self.budget, self.progress = path, budget, progress
        self.io_sizes = sorted(set(io_sizes))
        self.threads = sorted({int(t) for t in threads})  # (numpy ints: not JSON)
        self.sample_size, self.want_direct = sample_size, direct and bool(_O_DIRECT)
        self.direct_ok = False
        self.probe = lustre.FsProbe()
        self.fs = lustre.detect_fs(path, self.probe)
        self.tmp = ""
        self.n_files = self.file_size = 0
        self.written = 0
        self.stop = threading.Event()
        self.notes: list[str] = []
        self.files: list[tuple[str, int]] = []  # (path, size) of the data files
        self.rng = np.random.default_rng(0x5EED)
        self.buf = np.zeros(0, dtype=np.uint8)  # the write buffer: made by plan()
        self.res: dict[str, Any] = {"seq_write": [], "seq_read": [], "random_read": [],
                                    "metadata": {}, "streams": [], "lustre_osts": None,
                                    "cache_dir": None}

    def say(self, phase: str, message: str) -> None:
        if self.progress is not None:
            self.progress(phase, message)

    # -- primitive timed I/O --------------------------------------------------------------------

    def write_file(self, fd: int, io: int, size: int, deadline: float) -> tuple[int, float, bool]:
        """Write ``size`` bytes to ``fd`` in ``io`` chunks, fsync; (bytes, seconds, stopped)."""
        words = self.buf.view("<u8")
        view = memoryview(self.buf)
        done, stopped = 0, False
        t0 = time.perf_counter()
        while done < size:
            n = min(io, size - done, self.budget - self.written)
            if n <= 0:
                stopped = True
                break
            # Every 4 KiB block unique (no dedup, no compression): only the blocks about to be
            # written are marked (marking the whole buffer, up to the largest I/O size, cost
            # more than a small write itself and was timed with it).
            words[:(n + 7) // 8:_ALIGN // 8] += 1
            n = os.write(fd, view[:n])
            done += n
            self.written += n
            if self.stop.is_set() or time.monotonic() >= deadline:
                stopped = done < size
                break
        os.fsync(fd)
        seconds = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return done, seconds, stopped

    def open_read(self, path: str, direct: bool) -> int:
        flags = os.O_RDONLY | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
        fd = os.open(path, flags)
        if not direct:  # fsync'd already: drop the cached pages so the read reaches the device
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return fd

    def read_file(self, path: str, io: int, direct: bool,
                  deadline: float) -> tuple[int, float, bool]:
        """Read ``path`` sequentially in ``io`` chunks; (bytes, seconds, stopped early)."""
        fd = self.open_read(path, direct)
        buf = mmap.mmap(-1, io)  # page-aligned, as O_DIRECT needs
        try:
            size, done = os.fstat(fd).st_size, 0
            t0 = time.perf_counter()
            while done < size:
                n = os.preadv(fd, [buf], done)
                if n <= 0:
                    break
                done += n
                if self.stop.is_set() or time.monotonic() >= deadline:
                    break
            return done, time.perf_counter() - t0, done < size
        finally:
            buf.close()
            os.close(fd)

    def probe_direct(self, path: str) -> None:
        if not self.want_direct:
            why = "--no-direct" if _O_DIRECT else "this OS has no O_DIRECT"
            self.notes.append(f"O_DIRECT not used ({why}): random-read and stream figures went "
                              "through the page cache, dropped before each pass")
            return
        buf = mmap.mmap(-1, _ALIGN)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _O_DIRECT)
            try:
                os.preadv(fd, [buf], 0)
            finally:
                os.close(fd)
            self.direct_ok = True
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                raise
            self.notes.append(f"O_DIRECT refused on {self.fs.fstype or self.fs.kind} "
                              f"({os.strerror(exc.errno)}): direct-read figures are missing; "
                              "random-read and stream figures went through the page cache, "
                              "dropped before each pass")
        finally:
            buf.close()

    def run_threads(self, n: int, target: Callable[[int], None]) -> float:
        """Run ``target(i)`` on ``n`` threads; the wall time.  A thread's error is re-raised."""
        errors: list[BaseException] = []

        def wrap(i: int) -> None:
            try:
                target(i)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
                errors.append(exc)
                self.stop.set()

        ts = [threading.Thread(target=wrap, args=(i,), daemon=True, name=f"shardio-bench-{i}")
              for i in range(n)]
        t0 = time.perf_counter()
        try:
            for t in ts:
                t.start()
            for t in ts:
                while t.is_alive():
                    t.join(0.1)
        except BaseException:
            self.stop.set()
            for t in ts:
                # A signal can land inside t.start(): that thread may never count as started,
                # and join() would raise instead of the interrupt (daemon threads: never waited).
                if t.is_alive():
                    t.join(2.0)
            raise
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    # -- phases ---------------------------------------------------------------------------------

    def run(self, time_limit: float, cache_dir: str | None) -> str | None:
        """Every phase inside a fresh temp directory, removed at the end whatever happens; the
        error line when the OS failed a write or read (ENOSPC first among them), else None."""
        lustre_share = self.budget // 4 if self.fs.kind == "lustre" else 0
        cache_share = self.budget // 10 if cache_dir else 0
        self.plan(self.budget - lustre_share - cache_share)
        phases = ["seq_write", "seq_read", "random_read", "metadata", "streams"]
        phases += ["lustre_osts"] * bool(lustre_share) + ["cache_dir"] * bool(cache_dir)
        clock = _Clock(time_limit, phases)
        try:
            self.tmp = _temp_name(self.path)
            os.mkdir(self.tmp, 0o700)
            self.seq_write(clock.deadline("seq_write"))
            self.seq_read(clock.deadline("seq_read"))
            self.random_read(clock.deadline("random_read"))
            self.metadata(clock.deadline("metadata"))
            self.streams(clock.deadline("streams"))
            if lustre_share:
                self.lustre_osts(lustre_share, clock.deadline("lustre_osts"))
            if cache_dir:
                self.cache_dir(cache_dir, cache_share, clock.deadline("cache_dir"))
        except OSError as exc:
            kind = "disk full" if exc.errno in _FULL else "I/O error"
            return (f"{kind}: {exc.strerror or exc} after writing {_size(self.written)} under "
                    f"{self.path}; the run stopped there (free space, or pass a smaller --budget)")
        finally:
            self.stop.set()
            left = _remove_tree(self.tmp) if self.tmp else None
            if left:
                self.notes.append(f"could not remove {self.tmp}: {left}")
        return None

    def plan(self, data_share: int) -> None:
        """Number and size of the data files: one per I/O size and at least one per stream."""
        import numpy as np

        n = max(len(self.io_sizes), max(self.threads))
        size = data_share // n // (64 * KiB) * (64 * KiB)
        if size < min(self.io_sizes):
            raise UsageError(
                f"a budget of {_size(self.budget)} gives {n} test files of {_size(size)}, smaller "
                f"than the smallest I/O size {_size(min(self.io_sizes))}; pass a larger --budget, "
                "smaller --io-sizes or fewer --threads")
        self.n_files, self.file_size = n, size
        # As large as the largest I/O size that is used (those above the file size are skipped):
        # an --io-sizes far above the budget allocated that much memory before anything ran.
        top = max(s for s in self.io_sizes if s <= size)
        self.buf = np.frombuffer(bytearray(self.rng.bytes(top)), dtype=np.uint8)

    def seq_write(self, deadline: float) -> None:
        n_files, size = self.n_files, self.file_size
        fits = [s for s in self.io_sizes if s <= size]
        if len(fits) < len(self.io_sizes):
            self.notes.append(f"I/O sizes above {_size(size)} skipped: the test files are only "
                              f"{_size(size)} (raise --budget)")
        per = {s: [0, 0.0, False] for s in fits}
        for i in range(n_files):
            io = fits[i % len(fits)]
            self.say("seq_write", f"file {i + 1}/{n_files}: {_size(size)} in {_size(io)} writes")
            path = os.path.join(self.tmp, f"data-{i:03d}")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                end = time.monotonic() + (deadline - time.monotonic()) / (n_files - i)
                done, secs, stopped = self.write_file(fd, io, size, end)
            finally:
                os.close(fd)
            self.files.append((path, done))
            acc = per[io]
            acc[0], acc[1], acc[2] = acc[0] + done, acc[1] + secs, acc[2] or stopped
            if i == 0:
                self.probe_direct(path)
        self.res["seq_write"] = [{"io_size": s, "bytes": b, "seconds": round(t, 6),
                                  "mb_per_s": _mbps(b, t), "stopped_early": st}
                                 for s, (b, t, st) in per.items() if b]

    def seq_read(self, deadline: float) -> None:
        modes = ["page_cache", "direct"] if self.direct_ok else ["page_cache"]
        runs = [(s, m) for s in self.io_sizes for m in modes]
        for k, (io, mode) in enumerate(runs):
            files = [f for f in self.files if f[1] >= io]
            if not files:
                continue
            path, size = files[k % len(files)]  # a different file each run where possible
            self.say("seq_read", f"{_size(size)} in {_size(io)} reads ({mode})")
            end = time.monotonic() + (deadline - time.monotonic()) / (len(runs) - k)
            done, secs, stopped = self.read_file(path, io, mode == "direct", end)
            self.res["seq_read"].append({"io_size": io, "mode": mode, "bytes": done,
                                         "seconds": round(secs, 6), "mb_per_s": _mbps(done, secs),
                                         "stopped_early": stopped})

    def random_read(self, deadline: float) -> None:
        sizes = sorted({4 * KiB, self.sample_size})
        runs = [(s, t) for s in sizes for t in self.threads]
        for k, (io, nt) in enumerate(runs):
            files = [(p, s) for p, s in self.files if s >= io]
            if not files:
                continue
            self.say("random_read", f"{_size(io)} reads, {nt} thread(s)")
            end = time.monotonic() + (deadline - time.monotonic()) / (len(runs) - k)
            self.res["random_read"].append(self.random_run(files, io, nt, end))

    def random_run(self, files: list[tuple[str, int]], io: int, nt: int,
                   deadline: float) -> dict[str, Any]:
        import numpy as np

        direct = self.direct_ok
        fds: list[int] = []
        try:
            for p, _ in files:
                fds.append(self.open_read(p, direct))
        except BaseException:
            for fd in fds:  # (the files opened before the one that failed)
                os.close(fd)
            raise
        if not direct:
            # Without O_DIRECT, a read must not find its pages cached: no read-ahead around
            # each read, and each read's pages dropped after it (untimed).  Dropping whole files
            # once per working set read, as before, left ~45% of 4 KiB reads served from
            # memory (read-ahead and repeated offsets): IOPS doubled, P50 a memory latency.
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        blocks = np.array([(s - io) // _ALIGN + 1 for _, s in files], dtype=np.int64)
        lats = [array("q") for _ in range(nt)]  # 8 bytes per sample: millions fit

        def work(i: int) -> None:
            rng = np.random.default_rng(1000 + i)
            buf = mmap.mmap(-1, io)
            lat, clock = lats[i], time.perf_counter_ns
            drop = os.POSIX_FADV_DONTNEED
            try:
                while True:  # at least one batch, however little time is left
                    which = rng.integers(0, len(fds), 64)
                    offs = rng.integers(0, blocks[which]) * _ALIGN
                    for f, off in zip(which.tolist(), offs.tolist(), strict=True):
                        t0 = clock()
                        os.preadv(fds[f], [buf], off)
                        lat.append(clock() - t0)
                        if not direct:
                            os.posix_fadvise(fds[f], off, io, drop)
                    if self.stop.is_set() or time.monotonic() >= deadline:
                        break
            finally:
                buf.close()

        try:
            wall = self.run_threads(nt, work)
        finally:
            for fd in fds:
                os.close(fd)
        ops = sum(len(lat) for lat in lats)
        return {"io_size": io, "threads": nt, "mode": "direct" if direct else "page_cache",
                "ops": ops, "seconds": round(wall, 6), "iops": round(ops / max(wall, 1e-9), 1),
                "mb_per_s": _mbps(ops * io, wall), "latency_us": _percentiles_us(*lats)}

    def metadata(self, deadline: float) -> None:
        d = os.path.join(self.tmp, "meta")
        os.mkdir(d)
        st = os.statvfs(d)
        n = min(MAX_META_FILES, self.budget // _ALIGN)
        if st.f_files > 0:
            n = min(n, st.f_favail // 2)
        names = [os.path.join(d, f"f{i:05d}") for i in range(max(n, 1))]

        def create(p: str) -> None:
            os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))

        def open_close(p: str) -> None:
            os.close(os.open(p, os.O_RDONLY | os.O_CLOEXEC))

        out: dict[str, Any] = {"files": 0}
        ops = (("create", create), ("stat", os.stat), ("open_close", open_close),
               ("unlink", os.unlink))
        for k, (name, op) in enumerate(ops):
            self.say("metadata", f"{name} on {len(names)} files")
            end = time.monotonic() + (deadline - time.monotonic()) / (len(ops) - k)
            lat = array("q")
            clock = time.perf_counter_ns
            for p in names:
                t0 = clock()
                try:
                    op(p)
                except OSError as exc:
                    if name != "create" or exc.errno not in _FULL:
                        raise
                    # Out of inodes where statvfs did not say so (a quota, a filesystem that
                    # reports no inode count, another writer): the files made so far are
                    # measured, the run goes on.  (Before, the whole run ended as "disk full
                    # ... pass a smaller --budget", its metadata figures lost.)
                    self.notes.append(
                        f"metadata: creating files stopped after {len(lat)} ({exc.strerror}: an "
                        f"inode quota or a full inode table under {self.path}); the metadata "
                        "figures are for those files")
                    break
                lat.append(clock() - t0)
                if self.stop.is_set() or time.monotonic() >= end:
                    break
            if name == "create":
                out["stopped_early"] = len(lat) < len(names)
                names = names[:len(lat)]
                out["files"] = len(names)
            out[f"{name}_per_s"] = round(len(lat) / max(sum(lat) / 1e9, 1e-9), 1)
            out[f"{name}_latency_us"] = _percentiles_us(lat)
        self.res["metadata"] = out

    def streams(self, deadline: float) -> None:
        top = max(self.threads)
        ladder = sorted(set(self.threads) | {1 << i for i in range(top.bit_length())
                                             if 1 << i <= top})
        files = sorted(self.files, key=lambda f: -f[1])
        io = max([s for s in self.io_sizes if s <= min(4 * MiB, files[-1][1])]
                 or [min(self.io_sizes)])
        direct = self.direct_ok
        for k, nt in enumerate(ladder):
            self.say("streams", f"{nt} stream(s) of {_size(io)} reads")
            end = time.monotonic() + (deadline - time.monotonic()) / (len(ladder) - k)
            done = [0] * nt

            def work(i: int, end: float = end, done: list[int] = done) -> None:
                done[i] = self.read_file(files[i][0], io, direct, end)[0]

            wall = self.run_threads(nt, work)
            self.res["streams"].append({"threads": nt, "io_size": io,
                                        "mode": "direct" if direct else "page_cache",
                                        "bytes": sum(done), "seconds": round(wall, 6),
                                        "mb_per_s": _mbps(sum(done), wall)})

    def lustre_osts(self, share: int, deadline: float) -> None:
        listed = _list_osts(self.probe, self.path)
        osts = listed if listed else list(range(MAX_OST_PROBE))
        osts = osts[:max(1, share // (256 * KiB))]
        size = max(64 * KiB, share // len(osts) // (64 * KiB) * (64 * KiB))
        out: dict[str, Any] = {"osts": [], "listed": listed is not None, "notes": []}
        if listed and len(osts) < len(listed):
            out["notes"].append(f"measured {len(osts)} of {len(listed)} OSTs: raise --budget "
                                "for all of them")
        self.res["lustre_osts"] = out
        for k, ost in enumerate(osts):
            self.say("lustre_osts", f"OST {ost}: {_size(size)} pinned file")
            path = os.path.join(self.tmp, f"ost-{ost:04d}")
            fd, why = self.pinned(path, ost)
            if fd is None:
                out["notes"].append(why)
                if listed is None:
                    break  # probing one by one: the first failure is taken as the end of the list
                continue
            end = time.monotonic() + (deadline - time.monotonic()) / (len(osts) - k)
            try:
                wrote, wsecs, _ = self.write_file(fd, MiB, size, (end + time.monotonic()) / 2)
            finally:
                os.close(fd)
            got, rsecs, _ = self.read_file(path, min(MiB, size), self.direct_ok, end)
            out["osts"].append({"ost": ost, "bytes": wrote, "write_mb_per_s": _mbps(wrote, wsecs),
                                "read_mb_per_s": _mbps(got, rsecs)})
        if listed is None and len(out["osts"]) == len(osts):
            out["notes"].append(f"OSTs 0..{osts[-1]} measured one by one (`lfs df` unavailable); "
                                "the filesystem may have more")

    def pinned(self, path: str, ost: int) -> tuple[int | None, str]:
        """Create ``path`` with one stripe on OST ``ost``; (fd, "") or (None, why not)."""
        try:
            fd = self.probe.open_delay_create(path)
        except OSError as exc:
            return None, f"OST {ost}: creating the file failed: {exc.strerror or exc}"
        try:
            self.probe.fsetxattr(fd, "lustre.lov", lustre.build_lov(MiB, 1, None, ost))
            layout = lustre.get_layout(path, self.probe)
        except (OSError, LayoutError, UsageError) as exc:
            why = f"OST {ost}: pinning a file to it failed ({exc})"
        else:
            if layout is not None and layout.first_ost == ost:
                return fd, ""
            got = layout.first_ost if layout is not None else None
            why = f"OST {ost}: Lustre placed the pinned file on OST {got} instead"
        os.close(fd)
        os.unlink(path)
        return None, why

    def cache_dir(self, cache: str, share: int, deadline: float) -> None:
        tmp: str | None = None
        try:  # (one try for the temp directory's whole life: see _temp_name)
            try:
                st = os.statvfs(cache)
                if st.f_blocks:
                    share = min(share, st.f_bavail * st.f_frsize // 2)
                share = min(share, self.file_size) // (64 * KiB) * (64 * KiB)
                io = max([s for s in self.io_sizes if s <= share] or [64 * KiB])
                if share < io:
                    self.notes.append(f"--cache-dir {cache}: not enough free space to measure it")
                    return
                tmp = _temp_name(cache)
                os.mkdir(tmp, 0o700)
            except OSError as exc:
                self.notes.append(f"--cache-dir {cache}: cannot be used ({exc.strerror or exc})")
                return
            self.say("cache_dir", f"{_size(share)} written and read in {cache}")
            try:
                wrote, got, secs = self.cache_pass(os.path.join(tmp, "data"), io, share,
                                                   deadline)
            except OSError as exc:  # (PATH's figures stand: not the run's error, nor PATH's)
                self.notes.append(f"--cache-dir {cache}: writing or reading a test file there "
                                  f"failed ({exc.strerror or exc}); it was not measured")
                return
            fs = lustre.detect_fs(cache, self.probe)
            self.res["cache_dir"] = {"path": cache, "kind": fs.kind, "bytes": wrote,
                                     "read_mb_per_s": _mbps(got, secs)}
        finally:
            if tmp is not None:
                left = _remove_tree(tmp)
                if left:
                    self.notes.append(f"could not remove {tmp}: {left}")

    def cache_pass(self, path: str, io: int, share: int,
                   deadline: float) -> tuple[int, int, float]:
        """Write ``share`` bytes to ``path`` in the cache, read them; (written, read, seconds)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            wrote, _, _ = self.write_file(fd, io, share, (deadline + time.monotonic()) / 2)
        finally:
            os.close(fd)
        try:
            got, secs, _ = self.read_file(path, io, self.direct_ok, deadline)
        except OSError as exc:  # the cache's filesystem may refuse O_DIRECT where PATH did not
            if not self.direct_ok or exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                raise
            got, secs, _ = self.read_file(path, io, False, deadline)
        return wrote, got, secs


def _list_osts(probe: lustre.FsProbe, path: str) -> list[int] | None:
    """Active OST indices from ``lfs df PATH`` ("... /mnt/fs[OST:3]"), or None."""
    text = probe.lfs("df", path)
    found = sorted({int(m) for m in re.findall(r"\[OST:(\d+)\]", text or "")})
    return found or None


def run_storage_bench(path: str | os.PathLike[str], *, budget_bytes: int | str = GiB,
                      time_limit_s: float = 60.0, io_sizes: Sequence[int | str] = DEFAULT_IO_SIZES,
                      threads: Sequence[int] = DEFAULT_THREADS, direct: bool = True,
                      sample_size: int | str = 64 * KiB, cache_dir: str | None = None,
                      progress: Progress | None = None) -> dict[str, Any]:
    """Measure the filesystem holding ``path``; return the figures and recommendations.

    Args:
        path: an existing directory on the filesystem to measure.
        budget_bytes: most bytes written (capped at half the free space).
        time_limit_s: wall-clock bound of the whole run; each phase gets a share.
        io_sizes: sequential I/O sizes (multiples of 4 KiB).
        threads: thread counts for random reads and parallel streams.
        direct: also measure with O_DIRECT where the filesystem allows it.
        sample_size: the "typical sample" random-read size, beside 4 KiB.
        cache_dir: a node-local directory to compare with ``path`` (staging recommendation).
        progress: called as ``progress(phase, message)`` when each step starts.

    Returns:
        A JSON-serialisable dict; ``result["error"]`` is None, or starts with "disk full" when
        ENOSPC/EDQUOT stopped the run, or "I/O error" for another OS failure.  Partial figures
        stay in the result either way.

    Raises:
        UsageError: a bad option, or even the minimum budget does not fit (names --budget).
        KeyboardInterrupt: SIGINT or SIGTERM; the temporary files are removed first.
    """
    path = os.path.abspath(os.fspath(path))
    budget_req = parse_size(budget_bytes)
    sizes = [parse_size(s) for s in io_sizes]
    sample = parse_size(sample_size)
    _check_options(path, budget_req, time_limit_s, sizes, list(threads), sample)
    budget, free = _effective_budget(path, budget_req)
    b = _Bench(path, budget, sizes, threads, direct, sample, progress)
    t0 = time.monotonic()
    with _sigterm_as_interrupt():
        error = b.run(time_limit_s, cache_dir)
    fs = b.fs
    result: dict[str, Any] = {
        "path": path,
        "fs": {"kind": fs.kind, "fstype": fs.fstype, "mount_point": fs.mount_point,
               "source": fs.source, "shared": fs.shared},
        "config": {"budget_bytes": budget_req, "budget_used_limit": budget, "free_bytes": free,
                   "time_limit_s": time_limit_s, "io_sizes": b.io_sizes, "threads": b.threads,
                   "sample_size": sample, "direct": direct, "direct_used": b.direct_ok,
                   "files": b.n_files, "file_size": b.file_size},
        **b.res, "bytes_written": b.written, "elapsed_s": round(time.monotonic() - t0, 3),
        "error": error,
    }
    if free is None:
        b.notes.append("the filesystem reports no size (statvfs f_blocks 0): the budget could "
                       "not be capped at half the free space")
    result["notes"] = _notes(result, b.notes, budget < budget_req)
    result["recommendations"] = recommend(result)
    return result


def _notes(r: dict[str, Any], extra: list[str], capped: bool) -> list[str]:
    notes = [("sequential writes are timed through fsync, so the page cache cannot absorb them; "
              "every 4 KiB block written is unique random data (no compression or dedup gains)"),
             ("page-cache reads (mode page_cache) follow fsync + POSIX_FADV_DONTNEED on the file, "
              "so they measure the device plus kernel read-ahead (random reads: read-ahead off, "
              "each read's pages dropped after it); a network filesystem client may keep pages "
              "anyway, which would show as read MB/s far above write MB/s")]
    if r["config"]["direct_used"]:
        notes.append("random reads and streams used O_DIRECT: no page cache involved")
    notes.append("latencies are timed around each os.preadv/os.open call from Python, which adds "
                 "about a microsecond; threads release the GIL while the call waits")
    notes.append("metadata rates are for files this client just created (its metadata cache is "
                 "warm); a first open elsewhere costs more, so the shard size is a lower bound")
    if capped:
        limit = _size(r["config"]["budget_used_limit"])
        notes.append(f"budget capped at half the free space: {limit}")
    if r["fs"]["kind"] == "tmpfs":
        notes.append("PATH is in memory (tmpfs/ramfs): every figure is memory speed, not a device")
    if r["metadata"].get("stopped_early") or any(
            e.get("stopped_early") for sec in ("seq_write", "seq_read") for e in r[sec]):
        notes.append("some phases hit their share of --time-limit and stopped early (fewer bytes "
                     "or iterations): raise --time-limit for steadier figures")
    return notes + extra


def _pow2_clamp(n: float, lo: int, hi: int) -> int:
    return min(hi, max(lo, 1 << max(0, math.ceil(math.log2(max(n, 1))))))


def recommend(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Shard size, Lustre striping, loader workers, read size and staging depth from the figures.

    Each entry is ``{"value": ..., "display": str, "reason": str}``; ``value`` is None when the
    figures it needs are missing.
    """
    out: dict[str, dict[str, Any]] = {}
    reads = [e for e in result["seq_read"] if e["mb_per_s"] > 0]
    best = max(reads, key=lambda e: e["mb_per_s"]) if reads else None
    meta = result["metadata"]
    lat = meta.get("open_close_latency_us", {}).get("p50")
    if best and lat:
        bw = best["mb_per_s"] * 1e6
        need = 100 * lat / 1e6 * bw
        shard = _pow2_clamp(need, 64 * MiB, 4 * GiB)
        bound = (" (64 MiB floor: fewer files, less metadata load)" if need < 64 * MiB else
                 " (4 GiB cap)" if need > 4 * GiB else " (next power of two)")
        out["shard_size"] = {"value": shard, "display": _size(shard), "reason": (
            f"open+close takes {lat:.0f} us and one stream reads {best['mb_per_s']:.0f} MB/s, so "
            f">= {_size(need)} keeps opening under 1% of reading{bound}")}
    else:
        out["shard_size"] = {"value": None, "display": "-",
                             "reason": "not measured (sequential read or open latency missing)"}
    shard = out["shard_size"]["value"] or 256 * MiB
    if result["fs"]["kind"] == "lustre":
        n_osts = len((result.get("lustre_osts") or {}).get("osts", [])) or None
        count = 1 if shard < GiB else min(shard // GiB, n_osts or shard // GiB)
        out["stripe"] = {"value": {"stripe_count": count, "stripe_size": 4 * MiB},
                         "display": f"{count} x 4 MiB", "reason": (
            "shards under 1 GiB: one stripe each, so parallelism comes from reading many shards "
            "on different OSTs" if count == 1 else
            f"{_size(shard)} shards: one stripe per GiB spreads a shard's bytes over {count} OSTs")}
    else:
        out["stripe"] = {"value": None, "display": "-", "reason":
                         f"not Lustre ({result['fs']['fstype'] or result['fs']['kind']}): "
                         "striping does not apply"}
    streams = [e for e in result["streams"] if e["mb_per_s"] > 0]
    if streams:
        top = max(streams, key=lambda e: e["mb_per_s"])
        pick = min((e for e in streams if e["mb_per_s"] >= 0.9 * top["mb_per_s"]),
                   key=lambda e: e["threads"])
        more = " (the most tried: pass more --threads to see if it still scales)" \
            if top["threads"] == max(e["threads"] for e in streams) else ""
        out["workers"] = {"value": pick["threads"], "display": str(pick["threads"]), "reason": (
            f"{pick['threads']} parallel stream(s) reach {pick['mb_per_s']:.0f} MB/s, >= 90% of "
            f"the best {top['mb_per_s']:.0f} MB/s at {top['threads']}{more}")}
    else:
        out["workers"] = {"value": None, "display": "-", "reason": "streams not measured"}
    if best:
        top_bw = best["mb_per_s"]
        pick = min((e for e in reads if e["mb_per_s"] >= 0.9 * top_bw), key=lambda e: e["io_size"])
        out["read_size"] = {"value": pick["io_size"], "display": _size(pick["io_size"]),
                            "reason": "the smallest read size within 90% of the best sequential "
                                      f"read ({top_bw:.0f} MB/s)"}
    out["staging_depth"] = _staging(result, best)
    return out


def _staging(result: dict[str, Any], best: dict[str, Any] | None) -> dict[str, Any]:
    cache = result.get("cache_dir")
    if cache and best:
        fast = cache["read_mb_per_s"] >= 2 * best["mb_per_s"]
        return {"value": int(fast), "display": str(int(fast)), "reason": (
            f"the cache {cache['path']} reads {cache['read_mb_per_s']:.0f} MB/s vs "
            f"{best['mb_per_s']:.0f} MB/s here: " + ("stage one epoch ahead" if fast else
                                                     "not 2x faster, staging would not pay"))}
    if not result["fs"]["shared"]:
        return {"value": 0, "display": "0", "reason":
                "PATH is node-local already: staging to another local disk gains little"}
    return {"value": 0, "display": "0?", "reason": "not measured: pass --cache-dir DIR (node-local "
            "NVMe) to compare it with this shared filesystem"}


def format_report(result: dict[str, Any]) -> str:
    """The result as a human-readable table."""
    r, c = result, result["config"]
    fs = r["fs"]
    where = f"{fs['fstype'] or fs['kind']}" + (f" at {fs['mount_point']}" if fs["mount_point"]
                                               else "")
    lines = [f"shardio storage bench: {r['path']} ({fs['kind']}, {where})",
             (f"  wrote {_size(r['bytes_written'])} (budget {_size(c['budget_used_limit'])}) in "
              f"{r['elapsed_s']:.1f} s (limit {c['time_limit_s']:g} s); {c['files']} test files "
              f"of {_size(c['file_size'])}"), ""]
    reads = {(e["io_size"], e["mode"]): e["mb_per_s"] for e in r["seq_read"]}
    writes = {e["io_size"]: e["mb_per_s"] for e in r["seq_write"]}
    lines.append(f"{'sequential MB/s':<18}{'io size':>9}{'write':>10}{'read cached':>13}"
                 f"{'read direct':>13}")
    for s in c["io_sizes"]:
        cells = [writes.get(s), reads.get((s, "page_cache")), reads.get((s, "direct"))]
        lines.append(f"{'':<18}{_size(s):>9}" + "".join(
            f"{('-' if v is None else f'{v:.1f}'):>{w}}"
            for v, w in zip(cells, (10, 13, 13), strict=True)))
    lines += ["", (f"{'random reads':<18}{'io size':>9}{'threads':>8}{'mode':>11}{'IOPS':>10}"
                   f"{'MB/s':>9}{'P50 us':>9}{'P99 us':>9}{'P99.9 us':>10}")]
    for e in r["random_read"]:
        p = e["latency_us"]
        lines.append(f"{'':<18}{_size(e['io_size']):>9}{e['threads']:>8}{e['mode']:>11}"
                     f"{e['iops']:>10.0f}{e['mb_per_s']:>9.1f}{p['p50']:>9.1f}{p['p99']:>9.1f}"
                     f"{p['p99_9']:>10.1f}")
    m = r["metadata"]
    if m:
        lines += ["", (f"{'metadata':<18}{'files':>9}{'create/s':>10}{'stat/s':>10}"
                       f"{'open+close/s':>14}{'unlink/s':>10}"),
                  (f"{'':<18}{m['files']:>9}{m['create_per_s']:>10.0f}{m['stat_per_s']:>10.0f}"
                   f"{m['open_close_per_s']:>14.0f}{m['unlink_per_s']:>10.0f}")]
    if r["streams"]:
        lines += ["", f"{'parallel streams':<18}{'threads':>9}{'io size':>10}{'MB/s':>10}"]
        lines += [f"{'':<18}{e['threads']:>9}{_size(e['io_size']):>10}{e['mb_per_s']:>10.1f}"
                  for e in r["streams"]]
    if r["lustre_osts"] is not None:
        lo = r["lustre_osts"]
        lines += ["", f"{'Lustre OSTs':<18}{'ost':>9}{'write MB/s':>12}{'read MB/s':>11}"]
        lines += [f"{'':<18}{e['ost']:>9}{e['write_mb_per_s']:>12.1f}{e['read_mb_per_s']:>11.1f}"
                  for e in lo["osts"]] + [f"{'':<18}{n}" for n in lo["notes"]]
    if r["cache_dir"]:
        cd = r["cache_dir"]
        lines += ["", f"{'cache dir':<18}{cd['path']}: read {cd['read_mb_per_s']:.1f} MB/s"]
    lines += ["", "recommendations"]
    lines += [f"  {k:<15}{v['display']:>10}  {v['reason']}" for k, v in
              r["recommendations"].items()]
    lines += ["", "notes"] + [f"  - {n}" for n in r["notes"]]
    if r["error"]:
        lines += ["", f"error: {r['error']}"]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``shardio bench storage``."""
    parser.add_argument("path", metavar="PATH",
                        help="directory to measure (a temporary subdirectory is made and removed)")
    parser.add_argument("--budget", default="1GiB", metavar="SIZE",
                        help="most bytes to write (default 1GiB; capped at half the free space)")
    parser.add_argument("--time-limit", type=float, default=60.0, metavar="SECONDS",
                        help="wall-clock bound of the whole run (default 60)")
    parser.add_argument("--io-sizes", default="64KiB,1MiB,4MiB,16MiB", metavar="LIST",
                        help="sequential I/O sizes, comma-separated "
                             "(default 64KiB,1MiB,4MiB,16MiB)")
    parser.add_argument("--threads", default="1,4", metavar="LIST",
                        help="thread counts for random reads and parallel streams (default 1,4)")
    parser.add_argument("--no-direct", action="store_true",
                        help="do not use O_DIRECT (page-cache reads only, cache dropped first)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="node-local cache directory to compare with PATH (staging depth)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _int_list(text: str, what: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{what} {text!r} is not a comma-separated list of integers; pass e.g. "
                         "--threads 1,4") from None


def run_cli(args: argparse.Namespace, *, progress: Progress | None = None) -> int:
    """Run the bench from parsed :func:`add_arguments` options; the exit code.

    0 success, 1 disk full or an I/O error (reported in the output), 2 bad usage, 130 interrupted.
    ``progress`` defaults to one line per step on stderr when stderr is a terminal.
    """
    def show(phase: str, message: str) -> None:
        print(f"[{phase}] {message}", file=sys.stderr, flush=True)

    if progress is None and sys.stderr.isatty():
        progress = show

    try:
        result = run_storage_bench(
            args.path, budget_bytes=args.budget, time_limit_s=args.time_limit,
            io_sizes=[t for t in args.io_sizes.split(",") if t.strip()],
            threads=_int_list(args.threads, "--threads"), direct=not args.no_direct,
            cache_dir=args.cache_dir, progress=progress)
    except UsageError as exc:
        print(f"shardio bench storage: error: {exc}", file=sys.stderr)
        return 2
    except ShardioError as exc:
        print(f"shardio bench storage: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shardio bench storage: interrupted; temporary files removed", file=sys.stderr)
        return 130
    print(json.dumps(result) if args.json else format_report(result))
    if result["error"]:
        print(f"shardio bench storage: {result['error']}", file=sys.stderr)
        return 1
    return 0
