"""Single-producer single-consumer ring of variable-size messages in shared memory.

One process produces (``reserve`` → fill → ``commit``, or ``send``), one consumes (``recv`` →
use ``msg.view`` in place → ``release``).  The data path takes no lock and makes no system call
unless a side must sleep; cursors are published with release/acquire atomics (``shardio._atomics``)
that hold on x86-64 and aarch64.

Backing file
    ``<directory>/shardio-<creator pid>-<16 hex digits>``, mode 0600, created with ``O_EXCL``,
    sized with ``ftruncate`` and pre-allocated (``posix_fallocate``: a full ``/dev/shm`` fails at
    creation, not as a SIGBUS mid-run; with ``create(reserve=False)`` the process the descriptor
    is handed to does it, ``from_fd(reserve=True)``), then mapped ``MAP_SHARED``.  The directory
    defaults to ``/dev/shm``; any file-backed directory works.

Header (little-endian; every shared word on its own 64-byte cache line)::

    offset size field             written by                  meaning
    0      8    magic             creator, once (last)        b"SHRDRING"
    8      4    version           creator, once               1
    12     4    header_bytes      creator, once               512 = offset of the data area
    16     8    capacity          creator, once               data area bytes, a multiple of 64
    24     8    creator_pid       creator, once               informational (the name carries it)
    64     8    head              producer, release store     stream bytes ever committed
    128    8    tail              consumer, release store     stream bytes ever released
    192    4    closed            either side, seq_cst        0 open, 1 closed (never reset)
    256    4    data_seq          producer, +1 per publish    futex word the consumer sleeps on
    320    4    space_seq         consumer, +1 per tail move  futex word the producer sleeps on
    384    4    producer_waiting  producer                    nonzero while it may sleep on
                                                              space_seq: 1 + the space_seq it
                                                              read (mod 2**31)
    448    4    consumer_waiting  consumer                    1 while it may sleep on data_seq
    512    cap  data area

Records
    ``head`` and ``tail`` are positions in an endless byte stream (multiples of 64); stream
    position ``p`` lives at data offset ``p % capacity``.  ``head - tail`` bytes are in use.
    A record is an 8-byte length word (u64) padded to 64 bytes, then the payload, padded to a
    multiple of 64, so every payload starts 64-byte aligned and can hold aligned arrays in place::

        +0   u64 payload length L   (SKIP = 2**64-1: nothing here; continue at data offset 0)
        +64  payload (L bytes), zero or more padding bytes up to a multiple of 64

    A record never wraps.  When it does not fit before the end of the data area, the producer
    waits until that remainder is free, writes SKIP there, publishes it, and puts the record at
    offset 0.  A payload of more than ``capacity - 64`` bytes can never fit: MessageTooLargeError.

Protocol
    Producer: ``reserve`` waits until ``capacity - (head - tail)`` covers the record and returns
    a writable view of the payload; ``commit`` writes the length word, release-stores ``head``,
    increments ``data_seq`` and, only if ``consumer_waiting`` is set, ``futex_wake(data_seq)``.
    Consumer: ``recv`` acquire-loads ``head`` and reads the record at its private read position.
    Received messages may be released in any order; ``tail`` advances only over the contiguous
    released prefix (SKIP regions count as released).  After ``tail`` moves the consumer
    increments ``space_seq`` and wakes the producer only if ``producer_waiting`` is set.
    A message the consumer must keep for good would stop ``tail`` for good: ``detach`` takes
    it out of the ring instead (its pages become private copies, at the same addresses, in the
    consumer's mapping; the consumer maps the ring afresh; the message counts as released).

How a blocked side sleeps and wakes (consumer shown; the producer mirrors it on space_seq)::

    seq = load(data_seq); store(consumer_waiting, 1); fence()
    if head moved or closed: store(consumer_waiting, 0) and proceed
    [recv(until_full=True) only] if the producer waits for space the consumer has not given
        since: store(consumer_waiting, 0); RingFullError
    futex_wait(data_seq, seq, timeout); store(consumer_waiting, 0); loop

    The publisher stores ``head``, bumps ``data_seq``, fences, then reads ``consumer_waiting``.
    With a seq_cst fence on each side, either the sleeper's re-check sees the new ``head`` or the
    publisher sees the flag and wakes it; and because ``seq`` was read before the re-check, a bump
    that lands before the sleeper reaches the kernel makes ``futex_wait`` return at once.  So no
    wake-up is lost and nobody spins.  The futex is the shared (not PRIVATE) kind: the word lives
    in a mapping shared between processes.

    A producer about to sleep for space also nudges a waiting consumer (bump ``data_seq``, wake
    it), so that a consumer that holds what the producer waits for can be told so:
    ``recv(until_full=True)`` stops with RingFullError, rather than sleeping on, once nothing is
    there to receive and the producer waits for space (the same Dekker pairing of flag, fence
    and check as above: the producer sees ``consumer_waiting`` and nudges, or the consumer sees
    ``producer_waiting``).  So the two sides cannot both sleep, each waiting for the other,
    with no one told.  A producer that only looks (``reserve(timeout=0)``) neither sets the
    flag nor nudges: it is not about to sleep.  ``producer_waiting`` holds 1 + the
    ``space_seq`` the producer read before
    its last look at ``tail`` (31 bits), and the consumer only counts it while ``space_seq``
    still has that value: right after a release the producer is still asleep with the flag set,
    and is about to find the room it was given.  A worker pool uses this to move batches the
    training loop keeps out of the ring only when they are in the way (``Ring.detach``).

Closing
    ``close()`` on either side sets ``closed``, bumps both seq words and wakes every sleeper.  The
    consumer still receives everything committed before the close, then gets RingClosedError; the
    producer gets RingClosedError at once.

Message lifetime
    A received message's payload is not overwritten until it is released.  Arrays made with
    ``Ring.array(msg)`` are tracked (``release`` refuses while one is alive); ``msg.view`` and
    arrays made from it directly are not.  ``close()`` never unmaps by force: the mapping lives
    until the last message view or array pointing into it is gone.

Who unlinks
    The creator's ``close()`` (in the creating process) or anyone's ``unlink()``.  With
    ``Ring.create(..., unlink_now=True)`` the name is removed right after mapping: fork-inherited
    children share the mapping and nothing can be left behind, even after SIGKILL; a process
    forked before the ring existed gets it as a file descriptor over a Unix socket
    (``create(..., keep_fd=True)``, ``SCM_RIGHTS``, :meth:`Ring.from_fd`).  Named rings
    (for ``Ring.attach`` from spawned processes) whose creator died, and the file of a creator
    killed inside :meth:`Ring.create`, are removed by :func:`sweep_stale` (:mod:`shardio.shmspace`),
    which a worker pool runs once per directory before its first rings.  The memory itself is
    freed when the last process unmaps it.

The ring does not watch its peer: a caller that must notice a dead peer passes a timeout and checks
the peer between waits.  A ``Ring`` object is used by one thread; a forked child that takes over
the producer role calls :meth:`Ring.become_producer` first.
"""

from __future__ import annotations

import errno
import mmap
import operator
import os
import secrets
import struct
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from ._atomics import fence as _fence
from ._atomics import fetch_add_u32 as _fetch_add_u32
from ._atomics import futex_wait as _futex_wait
from ._atomics import futex_wake as _futex_wake
from ._atomics import load_u32 as _load_u32
from ._atomics import load_u64 as _load_u64
from ._atomics import privatize as _privatize
from ._atomics import store_u32 as _store_u32
from ._atomics import store_u64 as _store_u64
from .config import MIN_RING_BYTES
from .errors import (
    MessageInUseError,
    MessageTooLargeError,
    RingClosedError,
    RingCorruptError,
    RingFullError,
    RingNotFoundError,
    RingTimeoutError,
    ShmSpaceError,
    UsageError,
)
from .shmspace import (
    DEFAULT_SHM_DIR,
    _fmt_bytes,
    check_shm_space,
    sweep_stale,
)

__all__ = ["DEFAULT_SHM_DIR", "Message", "Ring", "check_shm_space", "sweep_stale"]

_MAGIC = b"SHRDRING"
_VERSION = 1
_HEADER_BYTES = 512
_ALIGN = 64
_RECORD_HEADER = 64
_SKIP = 0xFFFF_FFFF_FFFF_FFFF
_MIN_CAPACITY = MIN_RING_BYTES

_OFF_HEAD = 64
_OFF_TAIL = 128
_OFF_CLOSED = 192
_OFF_DATA_SEQ = 256
_OFF_SPACE_SEQ = 320
_OFF_PRODUCER_WAITING = 384
_OFF_CONSUMER_WAITING = 448

_FIXED = struct.Struct("<8sIIQQ")  # magic, version, header_bytes, capacity, creator_pid
_U64 = struct.Struct("<Q")
_WAKE_ALL = 2**31 - 1
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14
_SEQ_MASK = 2**31 - 1  # producer_waiting holds 1 + space_seq & _SEQ_MASK (never 0)


def _record_size(nbytes: int) -> int:
    return _RECORD_HEADER + ((nbytes + _ALIGN - 1) & ~(_ALIGN - 1))


def _deadline(timeout: float | None) -> float | None:
    if timeout is None:
        return None
    if not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise UsageError(f"timeout must be a number of seconds >= 0 or None, got {timeout!r}")
    return time.monotonic() + timeout


class Message:
    """One received message; valid until :meth:`Ring.release`.

    Attributes:
        view: read-only memoryview of the payload, in place in the shared mapping (no copy).
            Do not use it after the message is released: the producer reuses the space.
        start: stream position of the record (see the module docstring).
        end: stream position just past the record; ``tail`` reaches it once this message and all
            earlier ones are released.
        nbytes: payload length.
        detached: moved out of the ring by :meth:`Ring.detach` (its bytes are private to this
            process, where they were; releasing it does nothing).
    """

    __slots__ = ("view", "start", "end", "nbytes", "_arrays", "detached", "_mm")

    def __init__(self, view: memoryview, start: int, end: int, mm: Any = None) -> None:
        self.view = view
        self.start = start
        self.end = end
        self.nbytes = len(view)
        self._arrays: list[weakref.ref[np.ndarray]] | None = None
        self.detached = False
        # The mapping it was received through: every view of it is made from this one, and
        # Ring.detach makes its pages private there.
        self._mm = mm

    @property
    def in_use(self) -> bool:
        """An array from :meth:`Ring.array` (or one viewing it) still exists."""
        return self._arrays is not None and any(ref() is not None for ref in self._arrays)

    def __repr__(self) -> str:
        return f"Message(start={self.start}, end={self.end}, nbytes={self.nbytes})"


class Ring:
    """SPSC ring of variable-size messages in a shared mapping (layout: module docstring).

    Make one with :meth:`create` or :meth:`attach`, not with the constructor.  Either process
    may produce or consume, but at any time exactly one produces and one consumes.

    Attributes:
        path: the backing file's path (already unlinked when created with ``unlink_now=True``).
        capacity: bytes in the data area; the largest payload is ``capacity - 64``.
    """

    def __init__(self, mm: mmap.mmap, path: str, capacity: int, creator_pid: int | None) -> None:
        self._mm: mmap.mmap | None = mm
        self.path = path
        self.capacity = capacity
        self._creator_pid = creator_pid
        self._unlinked = False
        self.fd: int | None = None  # see Ring.create(keep_fd=True)
        self._rw = memoryview(mm)
        self._ro = self._rw.toreadonly()
        # producer side
        self._head = 0
        self._tail_seen = 0
        self._pending: tuple[int, int, int, memoryview] | None = None
        # consumer side
        self._rpos = 0
        self._tail = 0
        self._head_seen = 0
        self._order: deque[list[Any]] = deque()  # [end, released] per record, in stream order
        self._held: dict[int, tuple[Message, list[Any]]] = {}
        self._held_bytes = 0
        self._retired: list[weakref.ref[mmap.mmap]] = []  # mappings detach() replaced
        self._sync_cursors()

    def _sync_cursors(self) -> None:
        mm = self._mm
        self._head = _load_u64(mm, _OFF_HEAD)
        self._tail_seen = self._tail = self._rpos = _load_u64(mm, _OFF_TAIL)
        self._head_seen = self._rpos

    # --- construction ----------------------------------------------------------------------
    @classmethod
    def create(cls, capacity: int, *, directory: str | os.PathLike[str] | None = None,
               unlink_now: bool = False, keep_fd: bool = False, reserve: bool = True,
               space_checked: bool = False) -> Ring:
        """Create a ring whose data area holds ``capacity`` bytes (rounded up to 64).

        Args:
            capacity: data area size in bytes, at least 128; a payload can be up to
                ``capacity - 64`` bytes.
            directory: where the backing file goes (default ``/dev/shm``).
            unlink_now: unlink the file right after mapping it.  Only this process and the
                children it forks can then use the ring, and nothing is left behind.
            keep_fd: keep the file descriptor open as ``ring.fd`` (close-on-exec), to hand
                the ring to a process that was not forked from this one after its creation
                (``SCM_RIGHTS``; the receiver maps it with :meth:`from_fd`).  The caller
                closes it with :meth:`close_fd`.
            reserve: allocate the memory now (``posix_fallocate``), so that a full directory
                fails here rather than as a SIGBUS mid-run.  Only with ``keep_fd``, False
                leaves that to the receiver (``Ring.from_fd(fd, reserve=True)``), off this
                process's path.
            space_checked: the caller has just run ``check_shm_space`` for this ring (with
                the others it is making); skip the check here (~0.2 ms: ``statvfs``, the
                mount table and the memory cgroup's files).

        Raises:
            UsageError: capacity is not an integer >= 128, or the directory is missing or not
                writable.
            ShmSpaceError: the directory or the memory cgroup cannot hold the ring.
        """
        size = cls.file_bytes(capacity)
        if not (reserve or keep_fd):
            raise UsageError("Ring.create(reserve=False) needs keep_fd=True: the receiver of "
                             "the descriptor reserves the memory")
        capacity = size - _HEADER_BYTES
        directory = DEFAULT_SHM_DIR if directory is None else os.fspath(directory)
        if not space_checked:
            check_shm_space(size, directory)
        path = os.path.join(directory, f"shardio-{os.getpid()}-{secrets.token_hex(8)}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            err = _create_error(exc, path, size, directory)
            if err is exc:
                raise
            raise err from exc
        try:
            os.ftruncate(fd, size)
            if reserve:
                _reserve(fd, size)
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException as exc:
            _unlink_quietly(path)
            os.close(fd)
            err = _create_error(exc, path, size, directory) if isinstance(exc, OSError) else exc
            if err is exc:
                raise
            raise err from exc
        if not keep_fd:
            os.close(fd)
        _FIXED.pack_into(mm, 0, b"\0" * 8, _VERSION, _HEADER_BYTES, capacity, os.getpid())
        mm[0:8] = _MAGIC  # last: attach() rejects a half-initialised header
        ring = cls(mm, path, capacity, os.getpid())
        if keep_fd:
            ring.fd = fd
        if unlink_now:
            ring.unlink()
        return ring

    @staticmethod
    def file_bytes(capacity: int) -> int:
        """Bytes of memory a ring of ``capacity`` takes (its header included): what
        ``check_shm_space`` must find room for.

        Raises:
            UsageError: capacity is not an integer >= 128.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < _MIN_CAPACITY:
            raise UsageError(f"ring capacity must be an integer >= {_MIN_CAPACITY} bytes, "
                             f"got {capacity!r}")
        return _HEADER_BYTES + ((capacity + _ALIGN - 1) & ~(_ALIGN - 1))

    def close_fd(self) -> None:
        """Close the descriptor kept by ``Ring.create(..., keep_fd=True)`` (idempotent)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    @classmethod
    def from_fd(cls, fd: int, *, reserve: bool = False, directory: str | None = None) -> Ring:
        """Map the ring behind ``fd`` (received from its creator, see ``keep_fd``); the caller
        still owns ``fd`` and may close it at once.  ``reserve``: allocate its memory first
        (for a ring created with ``reserve=False``); ``directory`` names where it lives in
        the error.

        Raises:
            ShmSpaceError: ``reserve`` and the directory or the memory cgroup cannot hold it.
            RingCorruptError: the file is not a shardio ring of this version.
        """
        path = f"<ring fd {fd} of pid {os.getpid()}>"
        if reserve:
            _reserve_checked(fd, path, directory or DEFAULT_SHM_DIR)
        return cls._map(fd, path)

    def populate(self) -> bool:
        """Map every page of the ring into this process now, writable (``MADV_POPULATE_WRITE``,
        Linux 5.14+), rather than one fault per page on first touch: ~0.8 us a page against
        ~2.1 us here (a producer writes every page in its first pass round the ring).  Best
        effort: False where the kernel cannot (older kernel, pages not allocated)."""
        mm = self._open()
        try:
            mm.madvise(_MADV_POPULATE_WRITE, 0, len(mm))
        except (OSError, ValueError):
            return False
        return True

    def reserve_pages(self) -> None:
        """Allocate the memory of a ring created with ``reserve=False``, through the descriptor
        ``keep_fd`` kept (pages already allocated stay as they are: a second call costs a walk
        of the file, well under a millisecond for tens of MiB).

        Raises:
            UsageError: this ring keeps no descriptor (``keep_fd``).
            ShmSpaceError: the directory or the memory cgroup cannot hold it.
        """
        if self.fd is None:
            raise UsageError("Ring.reserve_pages() needs the descriptor Ring.create(keep_fd=True) "
                             "keeps")
        _reserve_checked(self.fd, self.path, os.path.dirname(self.path) or DEFAULT_SHM_DIR)

    @classmethod
    def attach(cls, path: str | os.PathLike[str]) -> Ring:
        """Map an existing ring by path (for processes that were not forked from its creator).

        Raises:
            RingNotFoundError: the file is gone (unlinked by its creator or swept as stale).
            RingCorruptError: the file is not a shardio ring of this version.
        """
        path = os.fspath(path)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError as exc:
            raise RingNotFoundError(
                f"ring {path} does not exist: its creator closed or unlinked it (or created it "
                "with unlink_now=True), or sweep_stale() removed it after the creator died"
            ) from exc
        try:
            return cls._map(fd, path)
        finally:
            os.close(fd)

    @classmethod
    def _map(cls, fd: int, path: str) -> Ring:
        size = os.fstat(fd).st_size
        if size < _HEADER_BYTES + _MIN_CAPACITY:
            raise RingCorruptError(f"{path} is {size} bytes, too small to be a shardio ring")
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        magic, version, header_bytes, capacity, _pid = _FIXED.unpack_from(mm, 0)
        problem = None
        if magic != _MAGIC:
            problem = f"bad magic {magic!r}: not a shardio ring (or not initialised yet)"
        elif version != _VERSION:
            problem = f"ring format version {version}, this shardio reads {_VERSION}"
        elif header_bytes != _HEADER_BYTES or capacity % _ALIGN or header_bytes + capacity != size:
            problem = f"header says {header_bytes}+{capacity} bytes but the file has {size}"
        if problem is not None:
            mm.close()
            raise RingCorruptError(f"{path}: {problem}; create the ring again with Ring.create()")
        return cls(mm, path, capacity, None)

    def __reduce__(self) -> tuple[Any, ...]:
        if self._unlinked:
            raise UsageError(f"ring {self.path} has no name any more (unlink_now=True or "
                             "unlink()); only forked children can share it: use the fork context")
        return (Ring.attach, (self.path,))

    # --- state -------------------------------------------------------------------------------
    @property
    def max_message(self) -> int:
        """Largest payload this ring can carry."""
        return self.capacity - _RECORD_HEADER

    @property
    def closed(self) -> bool:
        """True once either side closed the ring (or this object was closed)."""
        return self._mm is None or bool(_load_u32(self._mm, _OFF_CLOSED))

    @property
    def head(self) -> int:
        """Shared ``head``: stream bytes committed so far."""
        return _load_u64(self._open(), _OFF_HEAD)

    @property
    def tail(self) -> int:
        """Shared ``tail``: stream bytes released so far."""
        return _load_u64(self._open(), _OFF_TAIL)

    def held(self) -> int:
        """Number of messages received and not yet released."""
        return len(self._held)

    def held_bytes(self) -> int:
        """Payload bytes of the messages received and not yet released."""
        return self._held_bytes

    def _open(self) -> mmap.mmap:
        if self._mm is None:
            raise RingClosedError(f"ring {self.path} was closed by this process")
        return self._mm

    def _name(self) -> str:
        return os.path.basename(self.path)

    # --- producer ----------------------------------------------------------------------------
    def become_producer(self) -> None:
        """Take over the producer role in this process (a forked child, a restarted worker).

        Reloads the producer's cursor from shared memory and forgets an inherited reservation.
        """
        self._open()
        self._pending = None
        self._head = _load_u64(self._mm, _OFF_HEAD)
        self._tail_seen = _load_u64(self._mm, _OFF_TAIL)

    def reset_producer(self) -> None:
        """Clear what a dead producer may have left set, before starting another producer."""
        _store_u32(self._open(), _OFF_PRODUCER_WAITING, 0)
        self.become_producer()

    def reserve(self, nbytes: int, timeout: float | None = None) -> memoryview:
        """Reserve room for one message; return a writable view of exactly ``nbytes`` bytes.

        The view starts 64-byte aligned.  Fill it, then :meth:`commit` (or :meth:`abort`).
        Blocks (sleeping, no spinning) while the ring is too full.

        Raises:
            MessageTooLargeError: ``nbytes`` can never fit; the message names the capacity to use.
            RingClosedError: the ring was closed.
            RingTimeoutError: no room within ``timeout`` seconds.
            UsageError: a reservation is already pending, or ``nbytes`` is negative.
        """
        mm = self._open()
        if self._pending is not None:
            raise UsageError("reserve() called again before commit(); commit() or abort() the "
                             "pending reservation first")
        nbytes = operator.index(nbytes)
        if nbytes < 0:
            raise UsageError(f"nbytes must be >= 0, got {nbytes}")
        size = _record_size(nbytes)
        cap = self.capacity
        if size > cap:
            raise MessageTooLargeError(
                f"message of {nbytes} bytes exceeds ring capacity {_fmt_bytes(cap)} (at most "
                f"{cap - _RECORD_HEADER} bytes per message); "
                f"create the ring with capacity>={size} (ring_bytes) or send smaller messages "
                "(reduce batch_size)")
        if _load_u32(mm, _OFF_CLOSED):
            raise self._closed_for_send()
        deadline = _deadline(timeout)
        head = self._head
        off = head % cap
        room = cap - off
        if size > room:
            # Mark the tail end of the data area as skipped and start over at offset 0.
            self._wait_space(room, deadline, timeout)
            _U64.pack_into(mm, _HEADER_BYTES + off, _SKIP)
            self._publish(head + room)
            head += room
            off = 0
        self._wait_space(size, deadline, timeout)
        start = _HEADER_BYTES + off + _RECORD_HEADER
        view = self._rw[start:start + nbytes]
        self._pending = (head, size, nbytes, view)
        return view

    def commit(self, nbytes: int | None = None) -> None:
        """Publish the reserved message to the consumer: its first ``nbytes`` bytes (default:
        all that was reserved; the rest of the reservation goes back to the producer).

        Do not write through the reserved view (or arrays made from it) after this.

        Raises:
            RingClosedError: the ring was closed meanwhile; the message is dropped.
            UsageError: nothing is reserved, or ``nbytes`` is more than was reserved.
        """
        mm = self._open()
        if self._pending is None:
            raise UsageError("commit() without a pending reserve()")
        head, size, reserved, _view = self._pending
        if nbytes is not None:
            nbytes = operator.index(nbytes)
            if not 0 <= nbytes <= reserved:
                raise UsageError(f"commit({nbytes}) of a reservation of {reserved} bytes")
            size = _record_size(nbytes)
        else:
            nbytes = reserved
        self._pending = None
        if _load_u32(mm, _OFF_CLOSED):
            raise self._closed_for_send()
        _U64.pack_into(mm, _HEADER_BYTES + head % self.capacity, nbytes)
        self._publish(head + size)

    def reserved_at(self) -> tuple[mmap.mmap, int]:
        """Producer side: the mapping the pending reservation's view was made from, and the
        view's offset in it (for :meth:`keep_written`).

        Raises:
            UsageError: nothing is reserved.
        """
        if self._pending is None:
            raise UsageError("reserved_at() without a pending reserve()")
        head, _size, _n, _view = self._pending
        mm = self._mm
        assert mm is not None
        return mm, _HEADER_BYTES + head % self.capacity + _RECORD_HEADER

    def keep_written(self, spans: Sequence[tuple[mmap.mmap, int, int]]) -> int:
        """Producer side: bytes this process wrote into the ring, and that something in this
        process still views, keep their contents after the ring goes round.

        For a producer whose messages were built around memory it handed to other code (a
        worker that reads samples straight into its reservation): should that code keep a
        view, the producer's later messages would write over it.  Here the pages holding each
        span ``(mapping, offset, nbytes)`` (``mapping`` and ``offset`` as :meth:`reserved_at`
        gave them) become private copies at the same addresses in this process (as
        :meth:`detach` does for a consumer); the consumer's pages are not touched.  When a
        mapping is the ring's current one, this process maps the ring afresh for every later
        message.  Call it before :meth:`commit` of a message whose own bytes are in a span
        (its bytes are then final) and with no other reservation pending.

        Returns:
            Bytes copied (whole pages).

        Raises:
            UsageError: the ring keeps no descriptor (``keep_fd``), or a span is outside it.
            OSError: the kernel refused the mapping or the page swap (ENOMEM: too many
                mappings, ``vm.max_map_count``).
        """
        mm = self._open()
        if self.fd is None:
            raise UsageError("Ring.keep_written() maps the ring again: it needs the ring's "
                             "descriptor (Ring.create(keep_fd=True), or Ring.fd set from from_fd)")
        fresh = None
        if any(m is mm for m, _off, _n in spans):
            fresh = mmap.mmap(self.fd, len(mm), mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        copied = 0
        try:
            for m, off, n in spans:
                if not _HEADER_BYTES <= off <= off + n <= len(m):
                    raise UsageError(f"span ({off}, {n}) is not inside the ring's data area")
                if n:
                    copied += _privatize(m, off, n)
        finally:
            if fresh is not None:
                self._retired.append(weakref.ref(mm))
                self._mm = fresh
                self._rw = memoryview(fresh)
                self._ro = self._rw.toreadonly()
                if self._pending is not None:
                    head, size, n, _view = self._pending
                    start = _HEADER_BYTES + head % self.capacity + _RECORD_HEADER
                    self._pending = (head, size, n, self._rw[start:start + n])
        return copied

    def abort(self) -> None:
        """Drop the pending reservation (if any); nothing is published."""
        self._pending = None

    def send(self, data: Any, timeout: float | None = None) -> None:
        """Copy one bytes-like object (C-contiguous) into the ring as a message.

        Raises:
            MessageTooLargeError, RingClosedError, RingTimeoutError: as :meth:`reserve`.
            UsageError: ``data`` is not a C-contiguous bytes-like object.
        """
        try:
            src = memoryview(data).cast("B")
        except TypeError as exc:
            raise UsageError(f"send() needs a C-contiguous bytes-like object, got "
                             f"{type(data).__name__}: {exc}") from exc
        with src:
            view = self.reserve(src.nbytes, timeout)
            try:
                view[:] = src
            except BaseException:
                self.abort()
                raise
            self.commit()

    def _publish(self, head: int) -> None:
        mm = self._mm
        self._head = head
        _store_u64(mm, _OFF_HEAD, head)
        _fetch_add_u32(mm, _OFF_DATA_SEQ, 1)
        _fence()
        if _load_u32(mm, _OFF_CONSUMER_WAITING):
            _futex_wake(mm, _OFF_DATA_SEQ, 1)

    def _wait_space(self, need: int, deadline: float | None, timeout: float | None) -> None:
        cap = self.capacity
        if cap - (self._head - self._tail_seen) >= need:
            return
        mm = self._mm
        self._tail_seen = _load_u64(mm, _OFF_TAIL)
        if cap - (self._head - self._tail_seen) >= need:
            return
        if timeout is not None and timeout <= 0:
            # A look, not a wait: the consumer is not told (see *How a blocked side sleeps*).
            raise self._full(need, timeout)
        while True:
            seq = _load_u32(mm, _OFF_SPACE_SEQ)
            _store_u32(mm, _OFF_PRODUCER_WAITING, 1 + (seq & _SEQ_MASK))
            _fence()
            try:
                if _load_u32(mm, _OFF_CLOSED):
                    raise self._closed_for_send()
                self._tail_seen = _load_u64(mm, _OFF_TAIL)
                if cap - (self._head - self._tail_seen) >= need:
                    return
                if _load_u32(mm, _OFF_CONSUMER_WAITING):  # see *How a blocked side sleeps*
                    _fetch_add_u32(mm, _OFF_DATA_SEQ, 1)
                    _futex_wake(mm, _OFF_DATA_SEQ, 1)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise self._full(need, timeout)
                _futex_wait(mm, _OFF_SPACE_SEQ, seq, remaining)
            finally:
                _store_u32(mm, _OFF_PRODUCER_WAITING, 0)

    def _full(self, need: int, timeout: float | None) -> RingTimeoutError:
        used = self._head - self._tail_seen
        return RingTimeoutError(
            f"ring {self._name()} stayed full for {timeout:g} s ({used} of {self.capacity} "
            f"bytes in use, {need} needed): the consumer is not releasing messages; "
            "release() them, or pass a larger timeout or capacity (ring_bytes)")

    def _closed_for_send(self) -> RingClosedError:
        return RingClosedError(f"ring {self._name()} is closed: the consumer stopped (or either "
                               "side called close()); stop sending")

    # --- consumer ----------------------------------------------------------------------------
    def recv(self, timeout: float | None = None, *, until_full: bool = False) -> Message:
        """Receive the next message, zero-copy; keep it until :meth:`release`.

        ``timeout=None`` waits forever, ``0`` only takes what is already there.  With
        ``until_full=True`` it also stops waiting once the producer waits for space (RingFullError):
        what it waits for is held here, and only this side can give it back.

        Raises:
            RingClosedError: the ring is closed and every committed message was received.
            RingTimeoutError: nothing arrived within ``timeout`` seconds.
            RingFullError: (``until_full=True``) nothing to receive, and the producer waits for
                room.
            RingCorruptError: the record at the read position is malformed.
        """
        mm = self._open()
        cap = self.capacity
        deadline: float | None = None
        while True:
            rpos = self._rpos
            if rpos == self._head_seen:
                self._head_seen = _load_u64(mm, _OFF_HEAD)
                if rpos == self._head_seen:
                    if deadline is None:
                        deadline = _deadline(timeout)
                    self._wait_data(deadline, timeout, until_full)
            off = rpos % cap
            (length,) = _U64.unpack_from(mm, _HEADER_BYTES + off)
            if length == _SKIP:
                end = rpos + cap - off
                self._rpos = end
                self._order.append([end, True])
                self._advance()
                continue
            size = _RECORD_HEADER + ((length + _ALIGN - 1) & ~(_ALIGN - 1))
            end = rpos + size
            if off + size > cap or end > self._head_seen:
                raise RingCorruptError(
                    f"ring {self._name()}: record at stream position {rpos} claims {length} bytes, "
                    f"past the committed data (head {self._head_seen}, capacity {cap}); the "
                    "producer wrote outside its reservation or the file was modified")
            self._rpos = end
            start = _HEADER_BYTES + off + _RECORD_HEADER
            msg = Message(self._ro[start:start + length], rpos, end, mm)
            entry = [end, False]
            self._order.append(entry)
            self._held[rpos] = (msg, entry)
            self._held_bytes += length
            return msg

    def release(self, msg: Message) -> None:
        """Give a received message's space back to the producer; any order is allowed.

        After this the producer may overwrite the payload.  Arrays made with :meth:`array` (and
        everything viewing them) must be gone by then, which is checked; ``msg.view`` itself and
        arrays made from it directly are not tracked: stop using them.  (Views are never
        released by force, so memory stays mapped while anything points into it.)

        After :meth:`close` this does nothing.

        Raises:
            MessageInUseError: an array from :meth:`array`, or one viewing it, still exists; the
                message stays held.
            UsageError: ``msg`` is not held by this ring (already released, or from another ring).
        """
        if self._mm is None or msg.detached:  # closed here, or out of the ring already
            return
        item = self._held.get(msg.start)
        if item is None or item[0] is not msg:
            raise UsageError(f"{msg!r} is not held by ring {self._name()}: released twice, or "
                             "received from another ring")
        if msg.in_use:
            raise MessageInUseError(
                f"{msg!r} of ring {self._name()} is still viewed by arrays from ring.array(msg) "
                "(or arrays/tensors made from them); delete them, or copy the data out, before "
                "release(): the producer would overwrite them")
        del self._held[msg.start]
        self._held_bytes -= msg.nbytes
        item[1][1] = True
        self._advance()

    def array(self, msg: Message, *, writable: bool = False) -> np.ndarray:
        """The payload of ``msg`` as a uint8 numpy array (zero-copy).

        Read-only by default; ``writable=True`` maps the same bytes writable (the consumer owns
        them until release, and torch wants writable arrays to build tensors without a warning).
        The array pins the message: :meth:`release` raises MessageInUseError while it, or any
        array or tensor viewing it, exists.
        """
        if msg.detached:
            raise UsageError(f"{msg!r} was detached from ring {self._name()}: use the arrays "
                             "made before")
        self._open()
        if writable:
            start = _HEADER_BYTES + msg.start % self.capacity + _RECORD_HEADER
            arr = np.frombuffer(msg._mm, dtype=np.uint8, count=msg.nbytes, offset=start)
        else:
            arr = np.frombuffer(msg.view, dtype=np.uint8)
        if msg._arrays is None:
            msg._arrays = []
        msg._arrays.append(weakref.ref(arr))
        return arr

    def held_messages(self) -> list[Message]:
        """The messages received and not yet released, oldest first."""
        return [item[0] for item in self._held.values()]

    def retired_mappings(self) -> int:
        """Mappings of the ring that :meth:`detach` replaced and that something still views
        (each a few kernel mappings: ``vm.max_map_count`` bounds them per process)."""
        self._retired = [ref for ref in self._retired if ref() is not None]
        return len(self._retired)

    @property
    def read_position(self) -> int:
        """Consumer side: stream position just past the last message received."""
        return self._rpos

    def detach(self, msgs: list[Message],
               ranges: list[list[tuple[int, int]] | None] | None = None) -> int:
        """Take held messages out of the ring, leaving everything that views them intact.

        For a consumer that must keep some messages indefinitely (a training loop that keeps
        a batch): a held message stops the ring's ``tail`` where it is, so once the producer has
        gone round to it, the ring is full for good.  Here the pages holding each message, in
        this process's mapping, become private copies at the same addresses (see
        ``privatize`` in ``shardio/_atomics.c``), so arrays, tensors and memoryviews of it go on
        reading the same bytes; and the messages' space goes back to the producer, as by
        :meth:`release`.  Every view of a message is made from the mapping it was received
        through, and the pages are made private there.  When that is the ring's current mapping,
        this process maps the ring afresh (through the descriptor kept by ``keep_fd``) for every
        later message; the old mapping lives while anything views it.  The private pages may
        hold parts of neighbouring records: only of ones already received (their bytes are
        final), since later ones are read through the fresh mapping.  It costs a copy of the
        pages holding each message (or its ``ranges``).  Writes to such a message by other
        threads of this process while this runs may be lost.

        Args:
            msgs: held messages.
            ranges: per message, the ``(offset, nbytes)`` spans of its payload that anything
                still views (None: all of it).  Only their pages are copied; the rest of the
                message is given back to the producer like the rest, so must not be read again.

        Returns:
            Bytes copied.

        Raises:
            UsageError: a message is not held by this ring, or the ring keeps no descriptor.
            OSError: the kernel refused the mapping or the page swap (ENOMEM: too many
                mappings, ``vm.max_map_count``); the messages before the one it failed on are
                detached, the others still held.
        """
        mm = self._open()
        if self.fd is None:
            raise UsageError("Ring.detach() maps the ring again: create it with keep_fd=True")
        for msg in msgs:
            item = self._held.get(msg.start)
            if item is None or item[0] is not msg:
                raise UsageError(f"{msg!r} is not held by ring {self._name()}")
        if not msgs:
            return 0
        fresh = None
        if any(msg._mm is mm for msg in msgs):
            fresh = mmap.mmap(self.fd, len(mm), mmap.MAP_SHARED,
                              mmap.PROT_READ | mmap.PROT_WRITE)
        copied = 0
        done: list[Message] = []
        try:
            for k, msg in enumerate(msgs):
                base = _HEADER_BYTES + msg.start % self.capacity + _RECORD_HEADER
                spans = ranges[k] if ranges is not None else None
                for off, n in [(0, msg.nbytes)] if spans is None else spans:
                    if not 0 <= off <= off + n <= msg.nbytes:
                        raise UsageError(f"span ({off}, {n}) is not inside {msg!r}")
                    if n:
                        copied += _privatize(msg._mm, base + off, n)
                done.append(msg)
        finally:  # a failure (OSError) leaves the messages after it held, as they were
            if fresh is not None:
                # Every later access goes through the fresh mapping: the current one may have
                # private pages now.
                self._retired.append(weakref.ref(mm))
                self._mm = fresh
                self._rw = memoryview(fresh)
                self._ro = self._rw.toreadonly()
            for msg in done:
                _msg, entry = self._held.pop(msg.start)
                self._held_bytes -= msg.nbytes
                entry[1] = True
                msg.detached = True
            self._advance()
        return copied

    def _advance(self) -> None:
        order = self._order
        tail = self._tail
        while order and order[0][1]:
            tail = order.popleft()[0]
        if tail != self._tail:
            mm = self._mm
            self._tail = tail
            _store_u64(mm, _OFF_TAIL, tail)
            _fetch_add_u32(mm, _OFF_SPACE_SEQ, 1)
            _fence()
            if _load_u32(mm, _OFF_PRODUCER_WAITING):
                _futex_wake(mm, _OFF_SPACE_SEQ, 1)

    @property
    def producer_waiting(self) -> bool:
        """The producer waits for space (or is about to) that this side has not given back
        since it looked (see the module docstring)."""
        return self._producer_short(self._open())

    @staticmethod
    def _producer_short(mm: Any) -> bool:
        flag = _load_u32(mm, _OFF_PRODUCER_WAITING)
        return flag != 0 and flag - 1 == _load_u32(mm, _OFF_SPACE_SEQ) & _SEQ_MASK

    def _wait_data(self, deadline: float | None, timeout: float | None,
                   until_full: bool = False) -> None:
        mm = self._mm
        while True:
            seq = _load_u32(mm, _OFF_DATA_SEQ)
            _store_u32(mm, _OFF_CONSUMER_WAITING, 1)
            _fence()
            try:
                self._head_seen = _load_u64(mm, _OFF_HEAD)
                if self._head_seen != self._rpos:
                    return
                if _load_u32(mm, _OFF_CLOSED):
                    raise RingClosedError(
                        f"ring {self._name()} is closed and every message was received: the "
                        "producer finished (or either side called close())")
                if until_full and self._producer_short(mm):
                    raise RingFullError(
                        f"ring {self._name()}: nothing to receive and the producer waits for "
                        f"space ({self._held_bytes} payload bytes held here): release or detach "
                        "held messages")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise RingTimeoutError(
                        f"no message on ring {self._name()} within {timeout:g} s: the producer "
                        "is slow, stalled or dead; check it, or pass a larger timeout")
                _futex_wait(mm, _OFF_DATA_SEQ, seq, remaining)
            finally:
                _store_u32(mm, _OFF_CONSUMER_WAITING, 0)

    # --- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the ring for both sides, wake any sleeper, and unmap it here.

        The peer keeps its mapping: a consumer drains what was committed, then gets
        RingClosedError.  In the creating process this also unlinks the file.  Idempotent.
        The mapping is not torn down by force: messages and arrays still viewing it keep it
        valid, and it is unmapped when the last of them is gone.
        """
        self.close_fd()
        mm = self._mm
        if mm is None:
            return
        _store_u32(mm, _OFF_CLOSED, 1)
        _fetch_add_u32(mm, _OFF_DATA_SEQ, 1)
        _fetch_add_u32(mm, _OFF_SPACE_SEQ, 1)
        _futex_wake(mm, _OFF_DATA_SEQ, _WAKE_ALL)
        _futex_wake(mm, _OFF_SPACE_SEQ, _WAKE_ALL)
        self.abort()
        # Drop references rather than mm.close(): np.ndarray(buffer=...) and similar keep a
        # pointer without a buffer export, and an explicit munmap would leave them dangling.
        self._mm = None
        self._rw = self._ro = None  # type: ignore[assignment]
        self._held.clear()
        self._order.clear()
        self._held_bytes = 0
        if self._creator_pid == os.getpid():
            self.unlink()

    def unlink(self) -> None:
        """Remove the backing file's name (idempotent); mappings stay valid."""
        if not self._unlinked:
            self._unlinked = True
            _unlink_quietly(self.path)

    @property
    def unlinked(self) -> bool:
        """True once this object unlinked the backing file."""
        return self._unlinked

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._mm is None else f"head={self._head} rpos={self._rpos}"
        return f"<Ring {self.path} capacity={self.capacity} {state}>"


def _reserve(fd: int, size: int) -> None:
    """Allocate the file's pages now (where the file system can)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _reserve_checked(fd: int, path: str, directory: str) -> None:
    """:func:`_reserve` the whole file behind ``fd``, failures as :func:`_create_error` types
    them."""
    size = os.fstat(fd).st_size
    try:
        _reserve(fd, size)
    except OSError as exc:
        err = _create_error(exc, path, size, directory)
        if err is exc:
            raise
        raise err from exc


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _create_error(exc: OSError, path: str, size: int, directory: str) -> Exception:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
        return ShmSpaceError(
            f"cannot allocate a ring of {_fmt_bytes(size)} in {directory}: {exc.strerror}; lower "
            "ring_bytes/num_workers or pass shm_dir=<a file-backed directory>")
    if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS):
        return UsageError(f"cannot create ring file {path}: {exc.strerror}; pass "
                          "shm_dir=<an existing writable directory>")
    return exc
