"""Clairvoyant staging of shards to node-local storage, one stager per node for every process on it.

The order of every epoch is known in advance (:mod:`shardio.order`), so the stager knows which
shards this node reads, and when.  It copies them, in the order they will be read, from the shared
filesystem to a node-local cache directory (NVMe), within a byte budget and a free-space reserve,
and evicts by Belady's rule (the cached shard needed farthest ahead goes first), not LRU.

The cache's files, the node file's layout, the readers' progress reports and their protocol with
the stager are :mod:`shardio.nodecache`'s; this module runs the stager.

Staging loop (:class:`Stager`; the decisions are :mod:`shardio.stageplan`'s, pure and tested
on their own)
    The accesses of epochs ``[e, e + lookahead]`` (``e`` the frontier's epoch, re-planned when it
    changes) are walked in order of first use.  An access whose interval has begun (frontier max
    at or past its first step) is being read directly: it is skipped, and its shard staged for its
    next use instead.  A cached shard is re-verified once in each later epoch that uses it
    (``verify_reuse``), before that use except for accesses readers began before the stager
    saw the new epoch: it learns of an epoch from their reports, so a shard read in the
    epoch's first steps may be read once more before its re-hash lands (with ``verify=True``
    every sample is checked on read anyway).  A missing shard is admitted when it fits; otherwise
    :func:`belady_plan` names the victims: cached shards needed later than the newcomer's *next*
    use (farthest first), or refuses (the newcomer would be evicted first: it is read directly,
    exactly as a bypass in Belady's MIN).  Victims still in use, or needed before the newcomer,
    make the stager wait for the readers (polling the frontier, no busy spin).  The walk never
    evicts a shard whose interval overlaps the frontier span.  :func:`simulate` runs the same
    planner on a model, with readers in lockstep, and is what tests compare the stager with.

Copies
    Read in 4 MiB blocks (``POSIX_FADV_SEQUENTIAL``, a token bucket when ``bandwidth`` is set),
    hashed while copying, written to a temp name (``TMP_MARK``) in the same directory, fsynced,
    compared with the manifest digests (shard and index), then renamed (index first, shard last,
    directory fsynced).  A mismatch means the original is corrupt: nothing is published,
    ``verify_failures`` is counted, readers (and the repair ladder) deal with the original.
    An original that failed (mismatch or read error) is not copied again for another use while
    the stager plans the same epoch and the file is unchanged (inode, size, mtime, ctime): each
    attempt reads the whole shard (journal event ``known_bad``).
    ENOSPC/EDQUOT, or free space that would fall below ``reserve``, shrink the budget to what is in
    use, with one warning on the ``shardio.stage`` logger; readers read the rest directly.

Budget accounting counts file bytes (shard + index), temp files included.
"""

from __future__ import annotations

import faulthandler
import fcntl
import gc
import json
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _inject
from ._atomics import fence as _fence
from ._atomics import fetch_add_u64 as _fetch_add_u64
from ._atomics import futex_wake as _futex_wake
from ._atomics import load_u32 as _load_u32
from ._atomics import load_u64 as _load_u64
from ._atomics import store_u32 as _store_u32
from ._atomics import store_u64 as _store_u64
from ._fsutil import TMP_MARK, fsync_dir, resolve_in, set_pdeathsig, tmp_name
from .checksum import file_digest, new_digest
from .config import START_TIMEOUT  # a stager that has not written its pid by then
from .errors import StagingError, UsageError
from .nodecache import (
    _FULL,
    _OFF_GEN,
    _OFF_IDLE,
    _OFF_LEFT,
    _OFF_PID,
    _OFF_STATE,
    _SLOT,
    _WAKE_ALL,
    COUNTERS,
    DEFAULT_FALLBACKS,
    GAUGES,
    NodeCache,
    ShardState,
    StageOptions,
    _Reporters,
    _staging_error,
    _unlink,
    find_cache_dir,
)
from .stageplan import (
    _POS_BITS,
    _Planner,
    _schedule_of,
    belady_plan,
    simulate,
    time_key,
)

__all__ = ["COUNTERS", "DEFAULT_FALLBACKS", "GAUGES", "NodeCache", "ShardState", "StageOptions",
           "Stager", "belady_plan", "find_cache_dir", "simulate", "time_key"]

log = logging.getLogger("shardio.stage")

_BLOCK = 4 << 20  # copy block


# --- the stager ------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Epochs:
    """The epochs a run stages: ``listed`` explicitly, or ``first..last`` (``None``: open)."""

    listed: tuple[int, ...] | None
    first: int
    last: int | None

    def horizon(self, e: int, lookahead: int) -> list[int]:
        if self.listed is not None:
            return [x for x in self.listed if x >= e][: lookahead + 1]
        hi = e + lookahead if self.last is None else min(e + lookahead, self.last)
        return list(range(e, hi + 1))

    def plan_epoch(self, e: int) -> int | None:
        """The epoch to plan when readers are in ``e``; ``None``: past every epoch of the run."""
        if self.listed is not None:
            return next((x for x in self.listed if x >= e), None)
        if self.last is not None and e > self.last:
            return None
        return max(e, self.first)


class _TokenBucket:
    """Reads of ``rate`` bytes/s on average, bursts of at most 0.1 s worth (or one block)."""

    def __init__(self, rate: int, stopped: Callable[[], bool]) -> None:
        self.rate, self.stopped = float(rate), stopped
        self.capacity = max(self.rate * 0.1, 1.0)
        self.tokens, self.t = self.capacity, time.monotonic()

    def take(self, n: int) -> None:
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.t) * self.rate) - n
        self.t = now
        while self.tokens < 0 and not self.stopped():
            time.sleep(min(-self.tokens / self.rate, 0.1))
            now = time.monotonic()
            self.tokens += (now - self.t) * self.rate
            self.t = now


class _Runner:
    """The staging loop with real I/O, in whichever process holds the lock."""

    def __init__(self, cache: NodeCache, schedule: Callable[[int], Any], options: StageOptions,
                 verified: dict[int, int], stopped: Callable[[], bool]) -> None:
        self.cache, self.schedule, self.opt, self.stopped = cache, schedule, options, stopped
        self.mm = cache._mm
        self.verified = verified
        self.reporters = _Reporters(cache.progress_dir)
        self.bucket = (_TokenBucket(int(options.bandwidth), stopped)  # type: ignore[arg-type]
                       if options.bandwidth else None)
        self.planner = _Planner(self._size_of, 0, options.verify_reuse)
        self._index_sizes: dict[int, int] = {}
        self._schedules: dict[int, Any] = {}
        self._journal: Any = None
        self._idle = -1
        self._warned = False
        self._buf = bytearray(_BLOCK)
        self._counted: set[tuple[int, int]] = set()  # uses (shard, epoch) counted (_count_use)
        # shard -> (planned epoch, its originals' identity) of a copy that failed verification
        # or reading: not read again for another use while both are the same (_known_bad)
        self._bad: dict[int, tuple[int | None, tuple[Any, ...]]] = {}

    # --- bookkeeping ---------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        _fetch_add_u64(self.mm, _SLOT[name], n)

    def _count_use(self, name: str, shard: int, epoch: int) -> None:
        """Count a use once, as what was decided for it first, although re-planning may decide
        it again, or otherwise (a use bypassed while planning ahead, then begun by the readers
        when they reached it, was counted as both ``bypassed`` and ``skipped_in_use``)."""
        if (shard, epoch) not in self._counted:
            self._counted.add((shard, epoch))
            self._count(name)

    def _gauges(self) -> None:
        p = self.planner
        for name, v in (("cached_bytes", p.used), ("cached_shards", len(p.cached)),
                        ("budget", p.budget)):
            _store_u64(self.mm, _SLOT[name], max(0, int(v)))

    def _event(self, event: str, shard: int, epoch: int, **extra: Any) -> None:
        if self._journal is not None:
            rec = {"t": round(time.time(), 6), "event": event, "shard": shard, "epoch": epoch}
            try:
                self._journal.write(json.dumps({**rec, **extra}) + "\n")
                self._journal.flush()
            except OSError as exc:  # a full cache filesystem: diagnostics must not stop staging
                log.warning("node cache: journal disabled (%s)", exc)
                self._journal = None

    def _set_state(self, i: int, state: ShardState) -> None:
        off = _OFF_STATE + 4 * i
        _store_u32(self.mm, off, int(state))
        _futex_wake(self.mm, off, _WAKE_ALL)

    def _set_idle(self, word: int) -> None:
        if word != self._idle:
            self._idle = word
            _store_u64(self.mm, _OFF_IDLE, word)

    def _size_of(self, i: int) -> int:
        entry = self.cache.manifest.shards[i]
        if entry.index is None:
            return entry.bytes
        if i not in self._index_sizes:
            try:
                self._index_sizes[i] = os.stat(resolve_in(self.cache.root, entry.index)).st_size
            except OSError:  # (not kept: a copy would compare the file, once back, with 0 bytes)
                return entry.bytes
        return entry.bytes + self._index_sizes[i]

    def _schedule(self, e: int) -> Any:
        if e not in self._schedules:
            self._schedules = {x: s for x, s in self._schedules.items() if x >= e - 1}
            self._schedules[e] = self.schedule(e)
        return self._schedules[e]

    def _free(self) -> int:
        st = os.statvfs(self.cache.data_dir)
        return st.f_bavail * st.f_frsize

    # --- run -----------------------------------------------------------------------------
    def run(self, epochs: _Epochs, lookahead: int, wait: bool) -> None:
        self._begin()
        try:
            self._loop(epochs, lookahead, wait)
        finally:
            if _load_u64(self.mm, _OFF_PID) == os.getpid():
                _store_u64(self.mm, _OFF_IDLE, 0)
                _store_u64(self.mm, _OFF_PID, 0)
            if self._journal is not None:
                self._journal.close()
            self.reporters.close()

    def _begin(self) -> None:
        cache = self.cache
        for d, _, files in os.walk(cache.data_dir):  # temps of a stager that was killed
            for name in files:
                if TMP_MARK in name:
                    _unlink(os.path.join(d, name))
        p = self.planner
        for i, entry in enumerate(cache.manifest.shards):
            size = self._local_size(i, entry.bytes)
            if size is not None:
                p.cached[i] = size
                p.used += size
            want = ShardState.LOCAL if size is not None else ShardState.REMOTE
            was = _load_u32(self.mm, _OFF_STATE + 4 * i)
            if was != want:
                self._set_state(i, want)
                if was == ShardState.LOCAL:  # (a copy that is not whole any more)
                    cache.note_removal()
        for i in [i for i in self.verified if i not in p.cached]:
            del self.verified[i]
        p.verified = self.verified
        free = self._free()
        p.budget = (max(0, p.used + free - int(self.opt.reserve))  # type: ignore[arg-type]
                    if self.opt.budget is None else int(self.opt.budget))
        _store_u64(self.mm, _OFF_LEFT, 0)  # (a run before this stager's)
        _store_u64(self.mm, _OFF_PID, os.getpid())
        _fetch_add_u64(self.mm, _OFF_GEN, 1)
        self._gauges()
        if self.opt.journal:
            path = os.path.join(cache.dir, ".journal")
            self._journal = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by run()

    def _local_size(self, i: int, expected: int) -> int | None:
        """Bytes of a complete copy of shard ``i`` already in the cache, else ``None`` (and any
        partial leftover is removed)."""
        path, index = self.cache.path(i), self.cache.index_path(i)
        try:
            size = os.stat(path).st_size
            isize = 0 if index is None else os.stat(index).st_size
        except FileNotFoundError:
            size = -1
        if size == expected:
            return size + isize
        _unlink(path)
        _unlink(index)
        return None

    def _loop(self, epochs: _Epochs, lookahead: int, wait: bool) -> None:
        p = self.planner
        reached_last = False
        while not self.stopped():
            span = self.reporters.poll()
            lo, hi = span if span is not None else (None, None)
            pe = p.epoch if p.epoch is not None else epochs.first
            if lo is not None:
                fe = lo >> _POS_BITS
                reached_last = reached_last or (epochs.last is not None and fe >= epochs.last)
                target = epochs.plan_epoch(fe)
                if target is None and wait:
                    return  # every reader is past the last epoch of this run
                pe = pe if target is None else target
            if pe != p.epoch:
                p.plan(pe, [(e, self._schedule(e)) for e in epochs.horizon(pe, lookahead)])
                self._counted = {c for c in self._counted if c[1] >= pe}
            self._sync_discards(hi)
            act = p.next_action(lo, hi)
            if act[0] in ("wait", "end"):
                if not wait:
                    return
                if span is None and (self._left_after(epochs.last) or (
                        act[0] == "end" and reached_last and epochs.last in p.epochs)):
                    return  # the readers have gone after the last epoch
                self._set_idle(1 if lo is None else lo + 2)
                time.sleep(self.opt.poll_interval)
                continue
            self._set_idle(0)
            self._do(act, hi)

    def _left_after(self, last: int | None) -> bool:
        """A reader left (withdrew or closed) in or after epoch ``last``: the readers may have
        read it between two looks of ours, never seen in it (see the node file's ``left``)."""
        word = _load_u64(self.mm, _OFF_LEFT)
        return last is not None and word != 0 and (word - 1) >> _POS_BITS >= last

    def _sync_discards(self, hi: int | None) -> None:
        """Copies a reader discarded (state REMOTE while we hold them)."""
        p = self.planner
        if not p.cached:
            return
        states = np.frombuffer(self.mm, dtype="<u4", count=self.cache.n, offset=_OFF_STATE)
        held = np.fromiter(p.cached, dtype=np.int64, count=len(p.cached))
        gone = held[states[held] != ShardState.LOCAL].tolist()
        del states
        for j in gone:
            _unlink(self.cache.path(j))
            _unlink(self.cache.index_path(j))
            p.evict(j)
            p.requeue(j, hi)
            self._event("discard", j, int(p.epoch or 0))
        if gone:
            self._gauges()

    def _drop(self, j: int, event: str, epoch: int) -> None:
        self._set_state(j, ShardState.REMOTE)
        for path in (self.cache.path(j), self.cache.index_path(j)):  # shard first: lookup's key
            try:
                _unlink(path)
            except OSError as exc:
                log.warning("node cache: cannot remove %s: %s", path, exc)
        self.cache.note_removal()  # readers holding the copy open let it go
        self.planner.evict(j)
        self._gauges()
        self._event(event, j, epoch)

    def _do(self, act: tuple[Any, ...], hi: int | None) -> None:
        p = self.planner
        if act[0] == "trim":
            for j in act[1]:
                self._count("evictions")
                self._drop(j, "evict", int(p.epoch or 0))
            return
        k = act[1]
        s, e = p.shard[k], p.ep[k]
        if act[0] == "skip":
            self._count_use("skipped_in_use", s, e)
            self._event("skip", s, e)
            p.advance(k)
        elif act[0] == "bypass":
            self._count_use("bypassed", s, e)
            self._event("bypass", s, e)
            p.advance(k)
        elif act[0] == "reverify":
            if self._verify_copy(s):
                self._count("reverified")
                self._event("reverify", s, e)
                p.verified[s] = e
                p.advance(k)
            else:
                self._count("reverify_failures")
                log.warning("node cache: the copy of shard %s no longer matches its digest; "
                            "copying it again", self.cache.manifest.shards[s].path)
                self._drop(s, "corrupt_copy", e)
        else:
            self._stage(k, act[2])

    def _stage(self, k: int, victims: list[int]) -> None:
        p = self.planner
        s, e = p.shard[k], p.ep[k]
        if s in self._bad and self._known_bad(s):
            self._event("known_bad", s, e)
            p.advance(k)
            return
        size = self._size_of(s)
        reserve = int(self.opt.reserve)  # type: ignore[arg-type]
        if reserve > 0:
            free = self._free()
            if free + sum(p.cached[j] for j in victims) - reserve < size:
                new = max(0, min(p.budget, p.used + free - reserve))
                if new >= p.budget:  # cannot shrink further: read this one directly
                    self._count_use("bypassed", s, e)
                    self._event("bypass", s, e)
                    p.advance(k)
                else:
                    self._shrink(new, f"free space ({free} bytes) would fall below the reserve "
                                      f"({reserve} bytes)")
                return
        for j in victims:
            self._count("evictions")
            self._drop(j, "evict", e)
        self._set_state(s, ShardState.STAGING)
        _fence()  # pairs with lookup()'s fence: we see the report, or the reader sees STAGING
        span = self.reporters.poll()
        if span is not None and p.start[k] <= span[1]:
            self._set_state(s, ShardState.REMOTE)
            self._count_use("skipped_in_use", s, e)
            self._event("skip", s, e)
            p.advance(k)
            return
        result = self._copy(s)
        if result == "ok":
            self._count("shards_staged")  # before LOCAL: whoever sees the copy sees the count
            p.admit(k, size)
            self._gauges()
            self._event("stage", s, e)
            self._set_state(s, ShardState.LOCAL)
            return
        self._set_state(s, ShardState.REMOTE)
        if result in ("full", "write_error") and p.used < p.budget:
            if result == "full":
                self._count("enospc")
            self._shrink(p.used, "the cache filesystem is full (ENOSPC/EDQUOT)"
                         if result == "full" else "writing to the cache failed")
        elif result != "stopped":
            if result in ("verify_failure", "read_error"):
                self._bad[s] = (p.epoch, self._source_id(s))
            self._event(result, s, e)
            p.advance(k)

    def _source_id(self, i: int) -> tuple[Any, ...]:
        """The identity of shard ``i``'s originals (shard and index): device, inode, size,
        mtime and ctime of each (``None``: cannot stat it); any write or replacement changes it."""
        entry = self.cache.manifest.shards[i]
        out: list[Any] = []
        for rel in (entry.path, entry.index):
            if rel is None:
                continue
            try:
                st = os.stat(resolve_in(self.cache.root, rel))
            except OSError:
                out.append(None)
                continue
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
        return tuple(out)

    def _known_bad(self, i: int) -> bool:
        """Whether shard ``i``'s originals failed a copy in the epoch planned now and are
        unchanged since: copying them again would read the whole shard to fail the same way.
        (A repaired or replaced original, or the next epoch, is tried again.)"""
        epoch, ident = self._bad[i]
        if epoch == self.planner.epoch and ident == self._source_id(i):
            return True
        del self._bad[i]
        return False

    def _shrink(self, new: int, why: str) -> None:
        p = self.planner
        old, p.budget = p.budget, new
        self._count("budget_shrinks")
        self._gauges()
        self._event("shrink", -1, int(p.epoch or 0), budget=new)
        if not self._warned:
            self._warned = True
            log.warning("node cache %s: %s; staging budget cut from %d to %d bytes; readers "
                        "read the other shards from the shared filesystem (free space there, or "
                        "set a smaller budget)", self.cache.dir, why, old, new)

    # --- copies --------------------------------------------------------------------------
    def _copy(self, i: int) -> str:
        """Copy shard ``i`` (index first) and publish it: ok | verify_failure | read_error |
        full | write_error | stopped."""
        cache = self.cache
        entry = cache.manifest.shards[i]
        files: list[tuple[str, str, str | None, int | None]] = []
        if entry.index is not None:
            files.append((resolve_in(cache.root, entry.index), resolve_in(cache.data_dir,
                          entry.index), entry.index_digest or None, self._index_sizes.get(i)))
        files.append((resolve_in(cache.root, entry.path), cache.path(i), entry.digest,
                      entry.bytes))
        temps: list[tuple[str, str]] = []
        try:
            for _, dst, _, _ in files:
                os.makedirs(os.path.dirname(dst), exist_ok=True)
            for src, dst, digest, size in files:
                tmp = tmp_name(dst)
                temps.append((tmp, dst))
                result = self._copy_file(src, tmp, digest, size)
                if result == "verify_failure":
                    self._count("verify_failures")
                    log.warning("node cache: %s does not match its manifest digest; not staged "
                                "(the original is corrupt: run `shardio verify`)", src)
                if result != "ok":
                    return result
            for tmp, dst in temps:  # the shard last: its name is what makes the copy visible
                os.replace(tmp, dst)
            for d in {os.path.dirname(dst) for _, dst in temps}:
                fsync_dir(d)
            temps = []
            return "ok"
        except OSError as exc:
            if exc.errno in _FULL:
                return "full"
            log.warning("node cache: writing the copy of %s failed (%s)", entry.path, exc)
            return "write_error"
        finally:
            for tmp, _ in temps:
                _unlink(tmp)

    def _copy_file(self, src: str, tmp: str, digest: str | None, size: int | None) -> str:
        try:
            fd_in = os.open(src, os.O_RDONLY)
        except OSError as exc:
            self._count("read_errors")
            log.warning("node cache: cannot read %s (%s); not staged", src, exc)
            return "read_error"
        try:
            _advise(fd_in, os.POSIX_FADV_SEQUENTIAL)
            fd_out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                if size:
                    try:  # ENOSPC before reading a byte of the original
                        os.posix_fallocate(fd_out, 0, size)
                    except OSError as exc:
                        if exc.errno in _FULL:
                            raise
                h = new_digest(self.cache.manifest.digest)
                view, total = memoryview(self._buf), 0
                while True:
                    if self.stopped():
                        return "stopped"
                    try:
                        n = os.readv(fd_in, [self._buf])
                    except OSError as exc:
                        self._count("read_errors")
                        log.warning("node cache: reading %s failed (%s); not staged", src, exc)
                        return "read_error"
                    if not n:
                        break
                    self._count("bytes_staged", n)
                    if _inject.ACTIVE:
                        _inject.delay(src, n)
                    if self.bucket is not None:
                        self.bucket.take(n)
                    h.update(view[:n])
                    written = 0
                    while written < n:
                        written += os.write(fd_out, view[written:n])
                    total += n
                os.fsync(fd_out)
            finally:
                os.close(fd_out)
            _advise(fd_in, os.POSIX_FADV_DONTNEED)  # the node reads the copy from now on
        finally:
            os.close(fd_in)
        if (size is not None and total != size) or (digest and h.hexdigest() != digest):
            return "verify_failure"
        return "ok"

    def _verify_copy(self, i: int) -> bool:
        entry = self.cache.manifest.shards[i]
        checks = [(self.cache.path(i), entry.digest, entry.bytes)]
        index = self.cache.index_path(i)
        if index is not None and entry.index_digest:
            checks.append((index, entry.index_digest, None))
        for path, digest, size in checks:
            try:
                found, n = file_digest(path, self.cache.manifest.digest)
            except OSError:
                return False
            if found != digest or (size is not None and n != size):
                return False
        return True


def _advise(fd: int, advice: int) -> None:
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    except OSError:  # advice only
        pass


_INHERITED: list[Any] = []


def _release_inherited_fds(keep: set[int]) -> None:
    """Point every inherited descriptor but ``keep`` at /dev/null.

    Closing them would free their numbers for our own files while parent objects (log handlers,
    mmaps, pipes' Connection objects) still think they own them and could write into a copy;
    dup2 over them releases the pipes, sockets and files all the same."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        fds = [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:  # pragma: no cover - no procfs
        fds = list(range(1024))
    for fd in fds:
        if fd != devnull and fd not in keep:
            try:
                os.dup2(devnull, fd, inheritable=False)
            except OSError:
                pass
    os.close(devnull)


class Stager:
    """The node's stager: elected by a file lock, run in a forked process or synchronously.

    Args:
        cache: the node cache.
        schedule: epoch -> this node's schedule for that epoch (:func:`shardio.order.node_schedule`
            or any object with ``shards``, ``first``, ``last`` arrays sorted by ``first``).
        options: staging options (``cache_dir`` is the cache's; the rest applies here).
    """

    def __init__(self, cache: NodeCache, schedule: Callable[[int], Any] | Mapping[int, Any],
                 options: StageOptions | None = None) -> None:
        self.cache = cache
        self.schedule = _schedule_of(schedule)
        self.options = options or StageOptions()
        self.lock_path = os.path.join(cache.dir, ".stager.lock")
        self._pid: int | None = None
        self._owner = 0
        self._status: int | None = None
        self._forked = 0.0  # time.monotonic() of the last fork
        self._first = 0  # the epoch the stager process this object started plans from at least
        self._verified: dict[int, int] = {}

    @property
    def pid(self) -> int | None:
        """The stager process this object started (in this process), if any."""
        return self._pid if self._owner == os.getpid() else None

    def _try_lock(self) -> int | None:
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise _staging_error(exc, self.lock_path, "open") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return fd

    def holder(self) -> int:
        """The pid written by the process holding (or that last held) the lock; 0 if none."""
        try:
            with open(self.lock_path, "rb") as f:
                return int(f.read().strip() or 0)
        except (OSError, ValueError):
            return 0

    def start(self, epoch: int = 0, *, last_epoch: int | None = None) -> bool:
        """Become the node's stager if nobody is: fork a stager process and return ``True``;
        ``False`` when another process holds the lock.  Cheap to call from every rank and
        worker (one ``open`` + ``flock`` for a loser) and again at every epoch: if the stager
        died, the next caller takes over.

        The stager plans from ``epoch`` (or the readers' frontier), follows the readers through
        the epochs, and exits after ``last_epoch`` once the readers have passed it or gone
        (``None``: runs until :meth:`stop`, or until this process dies: ``PR_SET_PDEATHSIG``).
        Call it from a process that lives as long as the training, in its main thread.
        An ``epoch`` before the one the running stager (started here) was given replaces it:
        it never plans an epoch before its first (readers that went back, a rollback to an
        earlier checkpoint, would be read directly while it stages epochs to come).
        """
        if self.pid is not None and self.join(0) is None:
            if int(epoch) < self._first:
                self.stop(timeout=2.0)
            elif not self._stuck_in_fork():
                return True
            else:
                log.warning("stager process %d was still inside fork %g s after it (see "
                            "shardio.config.START_TIMEOUT); replacing it", self.pid,
                            START_TIMEOUT)
                self.stop(timeout=0.0)
        self._pid = None
        fd = self._try_lock()
        if fd is None:
            return False
        parent = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            os.close(fd)
            raise
        if pid == 0:  # pragma: no cover - runs in the child, which never returns
            self._child(fd, parent, _Epochs(None, int(epoch), last_epoch))
        os.close(fd)  # the child's descriptor keeps the lock
        self._pid, self._owner, self._status = pid, parent, None
        self._forked, self._first = time.monotonic(), int(epoch)
        return True

    def _stuck_in_fork(self) -> bool:
        """The stager this object forked has not written its pid ``START_TIMEOUT`` after it: it
        is stuck inside fork ("Stuck start" in :mod:`shardio.pool`), holding the node's lock
        while it stages nothing.  (Nor in the node file, where it stores it as it begins: a
        cache filesystem too full for the lock file's few bytes refuses it there only.)"""
        return (self.holder() != self._pid
                and _load_u64(self.cache._mm, _OFF_PID) != self._pid
                and time.monotonic() - self._forked > START_TIMEOUT)

    def _child(self, fd: int, parent: int, epochs: _Epochs) -> None:  # pragma: no cover
        code = 1
        try:
            set_pdeathsig(signal.SIGTERM)
            if os.getppid() != parent:
                os._exit(0)
            gc.freeze()  # objects of the parent are never collected (and never close anything)
            stop = [False]
            signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__(0, True))
            for sig in (signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2):
                signal.signal(sig, signal.SIG_IGN)
            try:
                signal.set_wakeup_fd(-1)
            except ValueError:
                pass
            _INHERITED.extend((sys.stdin, sys.stdout, sys.stderr))
            _release_inherited_fds({1, 2, fd})
            if faulthandler.is_enabled():
                faulthandler.enable(file=2)
            self._write_pid(fd)
            cache = NodeCache(self.cache.cache_dir, self.cache.root, self.cache.manifest)
            _Runner(cache, self.schedule, self.options, self._verified,
                    lambda: stop[0]).run(epochs, self.options.lookahead, wait=True)
            code = 0
        except BaseException:  # noqa: BLE001 - the child reports and exits, never returns
            try:
                os.write(2, traceback.format_exc().encode(errors="replace"))
            except OSError:
                pass
        finally:
            os._exit(code)

    @staticmethod
    def _write_pid(fd: int) -> None:
        """Record this process in the lock file, for :meth:`holder`'s message only: a cache
        filesystem too full for these few bytes still stages (the budget shrinks and warns)."""
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            log.debug("node cache: cannot record the stager's pid in its lock file: %s", exc)

    def join(self, timeout: float | None = None) -> int | None:
        """Wait for the stager process this object started; its exit status (negative: killed
        by that signal) or ``None`` while it still runs after ``timeout`` seconds."""
        pid = self.pid
        if pid is None:
            return self._status
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                got, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                got, status = pid, 0
            if got == pid:
                self._status = os.waitstatus_to_exitcode(status)
                self._pid = None
                return self._status
            if deadline is not None and time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the stager process this object started: SIGTERM (it finishes or abandons the
        current block and removes its temp file), then SIGKILL after ``timeout`` seconds."""
        pid = self.pid
        if pid is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
            if self.join(wait) is not None:
                return

    def stage(self, epochs: Iterable[int], *, wait_for_readers: bool = False) -> dict[str, int]:
        """Stage ``epochs`` in this process (job prologs, ``shardio stage``, tests).

        Without ``wait_for_readers`` it copies what fits now, in order of use over all the
        given epochs, and returns; with it, it follows the readers (``lookahead`` epochs ahead)
        until they have passed the last of ``epochs`` or gone after reaching it.

        Returns:
            The node counters afterwards.

        Raises:
            StagingError: another process is staging this dataset on this node.
        """
        listed = tuple(sorted({int(e) for e in epochs}))
        if not listed:
            raise UsageError("stage() needs at least one epoch")
        fd = self._try_lock()
        if fd is None:
            raise StagingError(f"another stager (pid {self.holder()}) is staging {self.cache.dir}"
                               " on this node; wait for it, or stop it")
        try:
            self._write_pid(fd)
            lookahead = self.options.lookahead if wait_for_readers else len(listed)
            _Runner(self.cache, self.schedule, self.options, self._verified,
                    lambda: False).run(_Epochs(listed, listed[0], listed[-1]), lookahead,
                                       wait_for_readers)
        finally:
            os.close(fd)
        return self.cache.counters()
