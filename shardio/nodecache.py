"""The node-local cache of one dataset, as every process on a node sees it: files, shared state,
and the protocol between the readers and the stager (:mod:`shardio.stage` does the staging).

Files under ``<cache_dir>/shardio-<first 16 hex of the manifest digest>/``::

    .stager.lock    flock(LOCK_EX) held by the stager for its lifetime; holds its pid (informational)
    .node           node file (mmap, layout below): stager status, node counters, shard states
    .progress/PID   one per reading process (mmap, 64 bytes): where that process is in the epoch
                    (``PID.K``: another NodeCache of this dataset in the same process, such as
                    a second ShardDataset over the same data: each reader keeps its own)
    .journal        JSON lines, one per stager action (only with ``StageOptions(journal=True)``)
    data/<path>     published copies: shard and ``.idx`` at the manifest's relative paths
    rebuilt/<path>  shards (and ``.idx``) the repair ladder rebuilt from parity
                    (:mod:`shardio.repair`): never the stager's, which neither evicts nor
                    cleans them (a shard path ``data/...`` must not land among its copies)

Node file (little-endian; written by the stager except where noted)::

    offset  size  field         meaning
    0       8     magic         b"SHRDSTG1" (written once by the creator, with the next three)
    8       4     version       1
    12      4     nshards       len(manifest.shards)
    16      4     slots         counter slots (32)
    24      8     stager_pid    pid of the process staging now, 0 when none
    32      8     idle          0 busy; 1 idle, no reader reported; T+2 idle at frontier time T
    40      8     generation    +1 each time a stager takes the lock
    64      8*32  counters      u64, in the order of COUNTERS then GAUGES, then ``removals``
                                (copies taken out of the cache: evicted, failed re-verification,
                                discarded; bumped after the copy is unpublished and unlinked);
                                ``discarded`` and ``removals`` are added to by readers too
                                (atomic fetch-add), every other slot by the stager only;
                                then ``left``: 0, or ``T + 1`` of the furthest report of a
                                reader that withdrew or closed since the stager took the lock
                                (readers store it when larger; the stager zeroes it): readers
                                that read the stager's last epoch between two of its looks
    320     4*N   state         u32 per shard: ShardState (futex word; readers only read it, except
                                discard(), which unlinks the copy, then stores REMOTE)

Progress file ``.progress/PID``: magic b"SHRDPRG1" then one u64 word, 0 (nothing reported) or
``T + 1`` where the time ``T = epoch << 40 | position`` orders (epoch, position) pairs as integers.
It is created complete (temp name, rename), updated in place by a release store (no system call
per report), removed at exit (atexit) or by :meth:`NodeCache.close`; the stager drops files of
dead pids (``/proc/PID`` gone or a zombie).  The *frontier* is the (min, max) over live reporters.

Protocol between readers and the stager
    A reader calls ``report(epoch, position)`` before reading the step that starts at that epoch
    position, then ``lookup(i)`` for each shard of the step it opens: the published copy's path,
    or ``None`` (read the original directly).  ``lookup`` fences, then reads ``state[i]``; when it
    is STAGING it may wait (``wait`` seconds) for the copy instead of reading the original.  The
    stager stores STAGING, fences, then re-reads the frontier, and abandons the copy if a reader
    has begun that shard's interval.  Either the stager sees the reader's report, or the reader
    sees STAGING: with waiting readers a shard is read from the shared filesystem at most once per
    node per use.  ``discard(i)`` (the repair ladder found the copy bad) unlinks the copy, then
    stores REMOTE; the stager notices the state change and copies the shard again for its next
    use.

Shard states (``state[i]``)::

    REMOTE --stager begins a copy--> STAGING --verified, renamed--> LOCAL
    STAGING --digest mismatch / ENOSPC / readers began it--> REMOTE
    LOCAL --evicted, failed re-verification, discard()--> REMOTE
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import mmap
import os
import stat
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from ._atomics import fence as _fence
from ._atomics import fetch_add_u64 as _fetch_add_u64
from ._atomics import futex_wait as _futex_wait
from ._atomics import futex_wake as _futex_wake
from ._atomics import load_u32 as _load_u32
from ._atomics import load_u64 as _load_u64
from ._atomics import store_u32 as _store_u32
from ._atomics import store_u64 as _store_u64
from ._fsutil import TMP_MARK, parse_size, resolve_in, tmp_name
from .errors import CacheNotWritableError, StagingError, UsageError
from .manifest import Manifest
from .stageplan import INF, _split, time_key

__all__ = ["COUNTERS", "DEFAULT_FALLBACKS", "GAUGES", "NodeCache", "ShardState", "StageOptions",
           "find_cache_dir"]

log = logging.getLogger("shardio.nodecache")

COUNTERS = ("shards_staged", "bytes_staged", "evictions", "verify_failures", "read_errors",
            "reverified", "reverify_failures", "discarded", "enospc", "budget_shrinks",
            "skipped_in_use", "bypassed")
"""Node-wide event counters.  ``bytes_staged``: bytes the stager read from the shared filesystem;
``skipped_in_use``: uses (shard, epoch) readers began before the stager got to them (raise the
bandwidth or start staging earlier); ``bypassed``: uses not staged because, by Belady's rule, the
shard is not worth keeping in the budget (read directly)."""
GAUGES = ("cached_bytes", "cached_shards", "budget")
"""Node-wide current values, set by the stager."""

DEFAULT_FALLBACKS = ("/local/scratch", "/scratch/local", "/lscratch", "/tmp")
_ENV_ORDER = ("SHARDIO_CACHE_DIR", "SLURM_TMPDIR", "TMPDIR")

_NODE_MAGIC, _PROGRESS_MAGIC = b"SHRDSTG1", b"SHRDPRG1"
_HEADER = struct.Struct("<8sIII")
_OFF_PID, _OFF_IDLE, _OFF_GEN, _OFF_COUNTERS, _SLOTS = 24, 32, 40, 64, 32
_OFF_STATE = _OFF_COUNTERS + 8 * _SLOTS
_PROGRESS_BYTES = 64
_SLOT = {name: _OFF_COUNTERS + 8 * n for n, name in enumerate(COUNTERS + GAUGES)}
_OFF_REMOVALS = _OFF_COUNTERS + 8 * len(_SLOT)  # see the node file layout (not a counter)
_OFF_LEFT = _OFF_REMOVALS + 8  # see the node file layout
_WAKE_ALL = 1 << 30
_FULL = (errno.ENOSPC, errno.EDQUOT)
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)
_RW = os.W_OK | os.X_OK


class ShardState(IntEnum):
    """``state[i]`` in the node file; see the module docstring."""

    REMOTE = 0
    STAGING = 1
    LOCAL = 2


def _size_or_zero(value: int | str) -> int:
    return 0 if value in (0, "0") else parse_size(value)


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """How the node stager works.

    Args:
        cache_dir: node-local directory; ``"auto"``: :func:`find_cache_dir`; ``None``: no staging.
        budget: bytes this dataset's cache may hold (``None``: free space minus ``reserve``).
        reserve: free space always left on the cache filesystem; ``0`` turns the check off
            (staging then stops at the first ENOSPC/EDQUOT).
        bandwidth: cap on the stager's reads from the shared filesystem, bytes/s (token bucket).
        lookahead: epochs beyond the current one that are planned (and staged when space allows).
        verify_reuse: re-hash a cached copy once in each later epoch that uses it, before that
            use (except in the epoch's first steps: see :mod:`shardio.stage`); ``False`` trusts a copy verified at publication (and, after a stager restart, a
            copy of the right size).
        poll_interval: seconds between looks at the readers' progress while the stager waits.
        journal: append one JSON line per stager action to ``<dir>/.journal`` (diagnosis, tests).
    """

    cache_dir: str | None = None
    budget: int | str | None = None
    reserve: int | str = "1GiB"
    bandwidth: int | str | None = None
    lookahead: int = 1
    verify_reuse: bool = True
    poll_interval: float = 0.05
    journal: bool = False

    def __post_init__(self) -> None:
        if self.budget is not None:
            object.__setattr__(self, "budget", _size_or_zero(self.budget))
        if self.reserve is None:
            raise UsageError("reserve must be a size such as '1GiB' (0 for none), not None")
        object.__setattr__(self, "reserve", _size_or_zero(self.reserve))
        if self.bandwidth is not None:
            object.__setattr__(self, "bandwidth", parse_size(self.bandwidth))
        if not isinstance(self.lookahead, int) or self.lookahead < 0:
            raise UsageError(f"lookahead must be an integer >= 0, got {self.lookahead!r}")
        if isinstance(self.poll_interval, bool) or not isinstance(
                self.poll_interval, (int, float)) or not self.poll_interval > 0:
            raise UsageError(f"poll_interval must be > 0 seconds, got {self.poll_interval!r}")


def find_cache_dir(env: Mapping[str, str] | None = None, *,
                   fallbacks: Sequence[str] = DEFAULT_FALLBACKS) -> str | None:
    """The first existing, writable node-local directory, or ``None``.

    Order: ``$SHARDIO_CACHE_DIR``, ``$SLURM_TMPDIR``, ``$TMPDIR`` (unless it is plain ``/tmp``),
    then ``fallbacks``: ``/local/scratch``, ``/scratch/local``, ``/lscratch``, ``/tmp`` (last:
    often small or in memory; set a ``budget``).

    Args:
        env: environment to read (``None``: ``os.environ``, read at the call).
    """
    env = os.environ if env is None else env
    candidates = [v for var in _ENV_ORDER if (v := env.get(var))
                  and not (var == "TMPDIR" and os.path.normpath(v) == "/tmp")]
    for path in (*candidates, *fallbacks):
        if os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK):
            return os.path.abspath(path)
    return None


_FORKS = [0]
"""Bumped in every forked child, so report() notices a fork without a getpid() system call."""


def _count_fork() -> None:
    _FORKS[0] += 1


def _watch_forks() -> None:
    if _FORKS[0] == 0:
        _FORKS[0] = 1
        os.register_at_fork(after_in_child=_count_fork)


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first, start time at
    index 19); None when there is no such process.  Other OSErrors propagate."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return None
    return stat[stat.rfind(b")") + 2 :].split()


def _pid_alive(pid: int, start: int = 0) -> bool:
    """Whether process ``pid`` runs, and (``start`` given) is the one that started at ``start``
    (:func:`_start_time`): a pid is reused, and a progress file left by a killed reader must not
    pass for a live one's (its old frontier would hold the stager back for good)."""
    try:
        fields = _stat_fields(pid)
    except OSError:
        return True
    if not fields or fields[0] in (b"Z", b"X"):
        return False
    return not start or len(fields) < 20 or int(fields[19]) == start


def _start_time(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22);
    0 when unknown."""
    try:
        fields = _stat_fields(pid)
        return int(fields[19]) if fields and len(fields) > 19 else 0
    except (OSError, ValueError):
        return 0


def _unlink(path: str | None) -> None:
    if path is None:
        return
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_AT_EXIT: set[tuple[str, int]] = set()  # progress files this process removes at exit
_PROGRESS_NAMES: dict[tuple[str, int], int] = {}  # (progress dir, pid) -> NodeCaches named


def _unlink_if_owner(path: str, pid: int) -> None:
    if os.getpid() == pid:  # atexit handlers are inherited by forked children
        _unlink(path)


def _staging_error(exc: OSError, path: str, what: str) -> StagingError:
    why = "the filesystem is full" if exc.errno in _FULL else (exc.strerror or str(exc))
    err = StagingError(f"cannot {what} {path}: {why}; choose another node-local directory "
                       "(StageOptions(cache_dir=...), cache_dir='auto' or $SHARDIO_CACHE_DIR)")
    err.full = exc.errno in _FULL
    return err


def _not_writable(path: str) -> CacheNotWritableError:
    try:
        st = os.stat(path)
        whose = f" (owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
    except OSError:
        whose = ""
    err = CacheNotWritableError(
        f"node cache {path}{whose} is not writable by this user (uid {os.getuid()}): pass a "
        "cache directory of your own (StageOptions(cache_dir=...), ShardDataset(cache_dir=...) "
        "or $SHARDIO_CACHE_DIR), have its owner remove it (it is a cache), or pass "
        "cache_dir='auto', which falls back to a per-user directory")
    err.path = path
    return err


def _user_dir(parent: str) -> str:
    """``<parent>/shardio-user-<uid>``, created private to this user; refused when it is
    anything but a directory this user owns (another user may create the name first in a
    shared ``/tmp``)."""
    path = os.path.join(parent, f"shardio-user-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        if exc.errno in _DENIED:
            raise _not_writable(parent) from exc
        raise _staging_error(exc, path, "create the per-user node cache") from exc
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise _not_writable(path)
    return path


class NodeCache:
    """The node-local cache of one dataset, as every process on the node uses it.

    Args:
        cache_dir: existing node-local directory; the dataset's cache is a subdirectory.
        root: the dataset directory on the shared filesystem (the originals).
        manifest: the dataset's manifest.
        wait: default seconds :meth:`lookup` waits for a copy in progress (0: never wait).

    Raises:
        StagingError: ``cache_dir`` is missing or full.
        CacheNotWritableError: ``cache_dir``, or this dataset's directory in it, may not be
            written by this user (another user's, or read-only).
    """

    def __init__(self, cache_dir: str | os.PathLike[str], root: str | os.PathLike[str],
                 manifest: Manifest, *, wait: float = 10.0) -> None:
        self.cache_dir, self.root, self.manifest = os.fspath(cache_dir), os.fspath(root), manifest
        self.wait = float(wait)
        digest = str(manifest.to_dict()["manifest_digest"])
        self.dir = os.path.join(self.cache_dir, f"shardio-{digest[:16]}")
        self.data_dir = os.path.join(self.dir, "data")
        self.progress_dir = os.path.join(self.dir, ".progress")
        self.rebuilt_dir = os.path.join(self.dir, "rebuilt")
        if not os.path.isdir(self.cache_dir):
            raise StagingError(f"cache_dir {self.cache_dir} does not exist; create it or pass "
                               "another node-local directory (StageOptions(cache_dir=...), "
                               "cache_dir='auto' or $SHARDIO_CACHE_DIR)")
        try:
            os.makedirs(self.progress_dir, exist_ok=True)
            os.makedirs(self.data_dir, exist_ok=True)
        except OSError as exc:
            if exc.errno in _DENIED:
                raise _not_writable(self.dir if os.path.isdir(self.dir)
                                    else self.cache_dir) from exc
            raise _staging_error(exc, self.dir, "create the node cache") from exc
        # (Each one: another user's stager or prolog may have made any of them.)
        for d in (self.dir, self.progress_dir, self.data_dir):
            if not os.access(d, _RW):
                raise _not_writable(d)
        lock = os.path.join(self.dir, ".stager.lock")
        if os.path.exists(lock) and not os.access(lock, os.W_OK):
            raise _not_writable(lock)
        self.n = len(manifest.shards)
        self._mm = self._open_node()
        self._paths: list[str | None] = [None] * self.n
        self._progress: mmap.mmap | None = None
        self._progress_pid = 0
        self._progress_name = ""  # .progress/<name> of this object in process _progress_pid
        self._progress_forks = -1
        self._closed = False
        _watch_forks()

    @classmethod
    def from_options(cls, root: str | os.PathLike[str], manifest: Manifest,
                     options: StageOptions, env: Mapping[str, str] | None = None,
                     ) -> NodeCache | None:
        """The node cache ``options`` ask for, or ``None`` (no ``cache_dir``, or ``"auto"``
        found no usable local directory).

        With ``"auto"``, a dataset cache this user may not write (another user's, such as
        one a root prolog made) is not an error: the cache moves to this user's own
        ``shardio-user-<uid>`` directory beside it, and failing that, to no staging (a warning
        says which).  A ``cache_dir`` named explicitly raises :class:`CacheNotWritableError`.
        """
        where = options.cache_dir
        if where != "auto":
            return None if where is None else cls(where, root, manifest)
        where = find_cache_dir(env)
        if where is None:
            return None
        try:
            return cls(where, root, manifest)
        except CacheNotWritableError as exc:
            shared = exc
        try:
            cache = cls(_user_dir(where), root, manifest)
        except CacheNotWritableError as exc:
            log.warning("cache_dir='auto': node caches %s and %s are not writable by this "
                        "user; reading without staging", shared.path, exc.path)
            return None
        log.warning("cache_dir='auto': node cache %s is not writable by this user; using this "
                    "user's own cache %s instead", shared.path, cache.dir)
        return cache

    # --- the node file -----------------------------------------------------------------------
    def _open_node(self) -> mmap.mmap:
        path = os.path.join(self.dir, ".node")
        size = _OFF_STATE + 4 * self.n
        for _ in range(3):
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                self._create_node(path, size)
                continue
            except OSError as exc:
                if exc.errno in _DENIED:
                    raise _not_writable(path) from exc
                raise _staging_error(exc, path, "open") from exc
            try:
                if os.fstat(fd).st_size < size:
                    raise StagingError(f"{path} is truncated; remove {self.dir} (it is a cache)")
                mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            magic, version, nshards, slots = _HEADER.unpack_from(mm, 0)
            if (magic, version, nshards, slots) != (_NODE_MAGIC, 1, self.n, _SLOTS):
                mm.close()
                raise StagingError(f"{path} is not a node file of this shardio and dataset; "
                                   f"remove {self.dir} (it is a cache)")
            return mm
        raise StagingError(f"cannot create {path}; remove {self.dir} and retry")

    def _create_node(self, path: str, size: int) -> None:
        tmp = tmp_name(path)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:  # zeros written, not a sparse file: a full disk fails here, never as SIGBUS
                os.pwrite(fd, _HEADER.pack(_NODE_MAGIC, 1, self.n, _SLOTS).ljust(size, b"\0"), 0)
                try:
                    os.link(tmp, path)  # publishes a complete file, and never replaces one
                except FileExistsError:
                    pass
            finally:
                os.close(fd)
        except OSError as exc:
            raise _staging_error(exc, path, "create") from exc
        finally:
            _unlink(tmp)

    # --- copies ------------------------------------------------------------------------------
    def path(self, i: int) -> str:
        """Where the copy of shard ``i`` lives (published or not)."""
        p = self._paths[i]
        if p is None:
            p = self._paths[i] = resolve_in(self.data_dir, self.manifest.shards[i].path)
        return p

    def index_path(self, i: int) -> str | None:
        """Where the copy of shard ``i``'s index file lives, or ``None`` (no index file)."""
        rel = self.manifest.shards[i].index
        return None if rel is None else resolve_in(self.data_dir, rel)

    def state(self, i: int) -> ShardState:
        return ShardState(_load_u32(self._mm, _OFF_STATE + 4 * i))

    def published(self, i: int) -> bool:
        """Whether shard ``i``'s copy is published right now (a copy the stager drops is first
        unpublished, then unlinked: a reader whose open of a copy :meth:`lookup` named fails
        while this is False met that drop, not a bad copy)."""
        return self.state(i) == ShardState.LOCAL

    def lookup(self, i: int, wait: float | None = None) -> str | None:
        """The published, verified copy of shard ``i`` (its index copy lies beside it), or ``None``.

        Args:
            wait: seconds to wait when the stager is copying this shard right now (``None``: the
                cache's default); the copy is then used instead of a second read of the original.
        """
        if not 0 <= i < self.n:
            raise IndexError(f"shard {i} out of range (0..{self.n - 1})")
        off = _OFF_STATE + 4 * i
        _fence()  # pairs with the stager's fence: our report() is seen, or STAGING is
        s = _load_u32(self._mm, off)
        if s == ShardState.STAGING:
            budget = self.wait if wait is None else wait
            deadline = time.monotonic() + budget
            while s == ShardState.STAGING and budget > 0 and self._stager_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                _futex_wait(self._mm, off, int(ShardState.STAGING), min(left, 0.5))
                s = _load_u32(self._mm, off)
        return self.path(i) if s == ShardState.LOCAL else None

    def discard(self, i: int, reason: str) -> None:
        """Remove the copy of shard ``i`` (found bad by a reader); the stager copies it again."""
        # Files first, state last: the stager copies the shard again as soon as it sees REMOTE,
        # and an unlink after that would remove the new copy.  (Until then a lookup may name a
        # file already gone: opening it fails, which the repair ladder treats as a missing copy.)
        for p in (self.path(i), self.index_path(i)):
            try:
                _unlink(p)
            except OSError as exc:
                log.warning("node cache: cannot remove %s: %s", p, exc)
        _fetch_add_u64(self._mm, _SLOT["discarded"], 1)
        off = _OFF_STATE + 4 * i
        _store_u32(self._mm, off, int(ShardState.REMOTE))
        self.note_removal()
        _futex_wake(self._mm, off, _WAKE_ALL)
        log.warning("node cache: discarded the copy of shard %s (%s); the stager copies it again",
                    self.manifest.shards[i].path, reason)

    def removals(self) -> int:
        """How many times a copy was taken out of the cache (evicted, failed re-verification,
        discarded) so far: a reader holding copies open checks them again when it changes."""
        return _load_u64(self._mm, _OFF_REMOVALS)

    def note_removal(self) -> None:
        """Count a copy taken out (after it was unpublished and unlinked)."""
        _fetch_add_u64(self._mm, _OFF_REMOVALS, 1)

    # --- progress ----------------------------------------------------------------------------
    def report(self, epoch: int, position: int) -> None:
        """Tell the stager this process now reads the step starting at ``position`` of ``epoch``.

        The first call (per process: forked children get their own file) creates
        ``.progress/<pid>``; later calls are one store into its mapping, no system call.
        """
        word = time_key(epoch, position) + 1
        if self._progress_forks != _FORKS[0]:
            self._open_progress(word)
        elif self._progress is not None:
            _store_u64(self._progress, 8, word)

    def _open_progress(self, word: int) -> None:
        pid = os.getpid()
        if pid != self._progress_pid or not self._progress_name:
            # Its own file per object: two NodeCaches of the dataset in one process (a second
            # ShardDataset over the same data) would replace each other's file, and the first
            # to withdraw would remove the other's report.
            k = _PROGRESS_NAMES.get((self.progress_dir, pid), 0)
            _PROGRESS_NAMES[(self.progress_dir, pid)] = k + 1
            self._progress_name = str(pid) if k == 0 else f"{pid}.{k}"
        self._progress_pid = pid
        self._progress_forks = _FORKS[0]
        self._progress = None
        if self._closed:
            return
        path = os.path.join(self.progress_dir, self._progress_name)
        tmp = tmp_name(path)
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("<8sQQ", _PROGRESS_MAGIC, word, _start_time(pid))
                        .ljust(_PROGRESS_BYTES, b"\0"))
            os.replace(tmp, path)
            fd = os.open(path, os.O_RDWR)
            try:
                self._progress = mmap.mmap(fd, _PROGRESS_BYTES)
            finally:
                os.close(fd)
        except OSError as exc:
            _unlink(tmp)
            log.warning("node cache: cannot create %s (%s); the stager will not see this "
                        "process's progress", path, exc)
            return
        if (path, pid) not in _AT_EXIT:  # (once: a withdrawn report is made again)
            _AT_EXIT.add((path, pid))
            atexit.register(_unlink_if_owner, path, pid)

    def frontier(self) -> tuple[int, int] | None:
        """The smallest ``(epoch, position)`` reported by a live process, or ``None``."""
        reporters = _Reporters(self.progress_dir)
        try:
            span = reporters.poll()
        finally:
            reporters.close()
        return None if span is None else _split(span[0])

    def withdraw(self) -> None:
        """Take back this process's report (it stopped reading for now): remove its progress
        file; the next :meth:`report` makes a new one.  A process that peeked at a sample, or
        read an epoch itself before DataLoader workers took over, would otherwise hold the
        frontier at that old position for the rest of the job."""
        if self._progress_pid == os.getpid() and self._progress is not None:
            self._note_left()
            _unlink(os.path.join(self.progress_dir, self._progress_name))
            self._progress = None
            self._progress_forks = -1  # the next report creates the file again

    def _note_left(self) -> None:
        """Leave this process's last report in the node file's ``left`` slot when it is the
        furthest (a race between two leaving readers may keep the nearer one: they are steps
        apart, and the stager only compares its epoch with its last)."""
        word = _load_u64(self._progress, 8)  # type: ignore[arg-type]
        if word > _load_u64(self._mm, _OFF_LEFT):
            _store_u64(self._mm, _OFF_LEFT, word)

    def close(self) -> None:
        """Stop reporting: remove this process's progress file (lookups keep working).  A process
        that stops reading must call it, or its last report holds the frontier back."""
        if self._progress_pid == os.getpid() and self._progress is not None:
            self._note_left()
            _unlink(os.path.join(self.progress_dir, self._progress_name))
        self._progress = None
        self._closed = True
        self._progress_pid, self._progress_forks = os.getpid(), _FORKS[0]

    # --- node status -------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        """Node-wide counters and gauges (see :data:`COUNTERS`, :data:`GAUGES`)."""
        return {name: _load_u64(self._mm, off) for name, off in _SLOT.items()}

    def _stager_alive(self) -> bool:
        pid = _load_u64(self._mm, _OFF_PID)
        return pid != 0 and _pid_alive(pid)

    def status(self) -> dict[str, Any]:
        """The stager's pid (0: none), whether it is idle, and the frontier it was idle at
        (``None`` when idle with no reader reporting)."""
        pid = _load_u64(self._mm, _OFF_PID)
        if pid and not _pid_alive(pid):
            pid = 0
        idle = _load_u64(self._mm, _OFF_IDLE) if pid else 0
        return {"pid": pid, "idle": idle != 0,
                "idle_at": _split(idle - 2) if idle >= 2 else None,
                "generation": _load_u64(self._mm, _OFF_GEN)}

    def journal(self) -> list[dict[str, Any]]:
        """The stager's journal (``StageOptions(journal=True)``), oldest first."""
        try:
            with open(os.path.join(self.dir, ".journal"), encoding="utf-8") as f:
                return [json.loads(line) for line in f if line.endswith("\n")]
        except FileNotFoundError:
            return []


def _reporter_pid(name: str) -> int | None:
    """The pid of the progress file ``name`` (``PID`` or ``PID.K``); None for other files."""
    pid, dot, k = name.partition(".")
    return int(pid) if pid.isdigit() and (not dot or k.isdigit()) else None


class _Reporters:
    """The stager's view of the progress files (mapped read-only)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.maps: dict[str, mmap.mmap] = {}  # file name (PID or PID.K) -> its mapping
        self._checked = -INF

    def poll(self) -> tuple[int, int] | None:
        """Rescan the directory (new and dead reporters), then ``(min, max)`` reported time."""
        self._scan()
        lo = hi = None
        for m in self.maps.values():
            w = _load_u64(m, 8)
            if w:
                w -= 1
                lo = w if lo is None or w < lo else lo
                hi = w if hi is None or w > hi else hi
        return None if lo is None or hi is None else (lo, hi)

    def _scan(self) -> None:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            names = []
        files = {n: pid for n in names if (pid := _reporter_pid(n)) is not None}
        for name in [n for n in self.maps if n not in files]:
            self.maps.pop(name).close()
        now = time.monotonic()
        check = now - self._checked >= 0.5
        if check:
            self._checked = now
            # A reader killed between writing its file and renaming it leaves the temp file.
            for n in names:
                head, mark, owner = n.rpartition(TMP_MARK + "-")
                if mark and head.startswith(".") and owner.isdigit() and not _pid_alive(
                        int(owner)):
                    _unlink(os.path.join(self.dir, n))
        for name, pid in files.items():
            m = self.maps.get(name)
            if m is None:
                try:
                    with open(os.path.join(self.dir, name), "rb") as f:
                        m = mmap.mmap(f.fileno(), _PROGRESS_BYTES, access=mmap.ACCESS_READ)
                except (OSError, ValueError):
                    continue
                if m[:8] != _PROGRESS_MAGIC:
                    m.close()
                    continue
                self.maps[name] = m
            elif not check:
                continue
            # (The start time at offset 16: 0 in a file written before it was recorded.)
            if not _pid_alive(pid, _load_u64(m, 16)):
                self.maps.pop(name).close()
                _unlink(os.path.join(self.dir, name))

    def close(self) -> None:
        for m in self.maps.values():
            m.close()
        self.maps.clear()
