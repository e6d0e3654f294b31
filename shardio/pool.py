"""Persistent worker processes that produce batches straight into shared-memory rings.

Protocol
    Each worker owns one SPSC :class:`~shardio.ring.Ring` (worker produces, main consumes), one
    control socket (main → worker, commands only) and one spill pipe (worker → main, used only
    when the ring cannot take a message, see *Spill*).  Commands are tuples tagged with
    :class:`Cmd`, pickled behind an 8-byte little-endian length:

    * ``(Cmd.EPOCH, generation, spec, runs, quiet)``: ignore the signals ``quiet`` (see
      :attr:`WorkerPool.ignore_signals`), then call ``job.begin(spec)`` and, for each step of
      ``runs`` (``range`` objects, in order), ``job.produce(step)`` and write the resulting
      message into the ring.  A worker skips a command whose generation is already stale
      (after ignoring its signals).
    * ``(Cmd.RING, capacity, directory)``, sent with the ring's file descriptor
      (``SCM_RIGHTS``): allocate its pages and map it as this worker's ring (see *Ring sizing*).
    * ``(Cmd.STOP,)``: exit.

    The control channel is a Unix stream socket pair (so that it can carry a descriptor); the
    spill pipe is a ``multiprocessing`` pipe.

    Main never blocks on a control socket: the one party that can unblock a worker that is not
    reading it (blocked on its spill pipe until main reads, or stuck in ``fork``) is main.  Steps
    travel as arithmetic runs (a worker's share of an epoch is ``range(first, n, W)``, what a
    restarted worker redoes is a suffix of it), so a command is a few hundred bytes however long
    the epoch; and main's end is non-blocking: whatever the socket does not take at once (a huge
    ``spec``, a step list with no runs) waits in an outbox that main flushes while it waits for
    batches.

    Messages carry the step number and the generation (``_tree`` header); main drops messages of
    an older generation, and a worker abandons an epoch as soon as the shared generation counter
    moves on (checked before every step and while it waits for ring space), so breaking out of an
    epoch costs at most one batch.

    Global step ``t`` of an epoch is produced by worker ``(t - first) % W``; main consumes steps in
    order, so batches arrive in the deterministic order the dataset contract defines.

Spill
    Ring space comes back only in stream order (``tail`` moves over the released prefix), so a
    batch the training loop keeps pins its ring: keep enough of them and the worker finds the
    ring full while main waits for the very batch the worker cannot write.  To break that
    deadlock main publishes, in the shared array ``want``, the step it is waiting for from each
    worker.  A worker whose ring stays full for ``poll_interval`` while main wants the step it
    holds sends that message through its spill pipe instead (a copy), and from then on spills
    without waiting whenever the ring is full and main wants the step, until the ring takes a
    message again.  Main waits on the pipe while a worker spills and on the ring otherwise, and
    looks at the other channel after every wait; steps keep their order because main stashes a
    message that overtook an earlier one through the other channel.  A worker whose message
    takes the ring again after a spill (in that epoch or a later one) says so through the pipe
    (16 bytes, ``b"RINGBACK"``), after committing it: main, waiting on the pipe, turns to the
    ring at once rather than after ``poll_interval``, a wait that would let the worker, blocked
    in turn on the ring that main fills meanwhile, time out and spill a batch main could have
    made room for.  Error messages too large for the ring always go through the pipe.

    Before it comes to that, main is told: it waits on a ring with ``recv(until_full=True)``,
    which stops as soon as the worker waits for space (the worker nudges a waiting main, see
    :mod:`shardio.ring`), and main calls :attr:`WorkerPool.make_room` with that ring (the
    loader's: it moves batches the loop keeps out of the ring, ``Ring.detach``).  If that gives
    nothing back, main waits as above until the next message (so it never spins), and the
    spill breaks the deadlock; a batch spilled for want of room (not one larger than the ring)
    also makes main call ``make_room``, so that the next batch can take the ring again.

Ring sizing
    With an explicit size, the rings exist before the workers are forked, and each inherits its
    own.  With a size computed from the first batch (``PoolOptions.ring_bytes`` a function of
    its bytes, the loader's ``"auto"``), the workers are forked at once, without rings: a
    worker whose batch is ready and that has no ring yet sends a 16-byte size report
    (``b"RINGSIZE"`` + u64 bytes) through its spill pipe and waits for a command.  The first
    report that main reads (that of the worker producing the epoch's first step) sizes every
    ring: main checks the space, creates them (unlinked at once), and sends each worker a
    ``Cmd.RING`` with its ring's descriptor; a report arriving after that is ignored.  So the
    rings are sized from a real batch, made by a worker (the user's code never runs in main),
    and created while the other workers are already producing.  A worker that gets another
    command while it waits drops its batch and obeys it.  Main keeps each ring's descriptor
    while the pool lives (with an explicit size too: ``Ring.detach`` maps the ring again
    through it): a worker restarted after the rings exist inherits its ring through ``fork``,
    descriptor included, and allocates its pages itself (a no-op if the worker it replaces had
    done it, or if main had; not if that one died before).  A worker that cannot allocate them
    (ENOSPC: ``/dev/shm`` filled up after main's check) sends a
    :data:`~shardio._tree.KIND_RING_SPACE` message (a ``ShmSpaceError``) through its pipe and
    goes on without a ring; main never drops that message, whatever its epoch, and closes the
    pool and raises it.  A ``ShmSpaceError`` raised by user code is an ordinary worker error.

Reading into the ring
    A job may build a batch in ring memory from the start (the loader's ``zero_copy`` reads:
    samples are read straight into the message, and the collated batch points at them rather
    than copying them).  A job with a ``bind_output`` method is given :meth:`_Output.claim`
    once per worker process: ``claim(nbytes)`` reserves that much of the ring without waiting
    (None when the ring has no room now, has no ring yet, is spilling, or after the worker
    found the job's user code keeping views of a sent message), and the plan the job returns
    carries the :class:`Claim`.  ``deliver`` then writes the rest of the message around what is
    there and commits only the bytes the message takes.  A plan with no array in the claimed
    area is written from the start of the reservation over it (or, larger than the
    reservation, the reservation is dropped and the batch goes the usual way).  Before a
    message with an area is sent, the worker checks that nothing else in it still views the
    area (a user transform that kept a field): if something does, those pages are made private
    in the worker (``Ring.keep_written``), so the view keeps its bytes while the ring goes
    round, and the worker claims no more (warned once).

Failure handling
    A worker exception travels back as a :data:`~shardio._tree.KIND_ERROR` message and is raised
    in main as :class:`~shardio.errors.WorkerError` with the worker's traceback.  A worker that dies
    (SIGKILL, segfault) is noticed within ``poll_interval`` seconds while main waits on it (or when
    the next epoch starts); committed messages still in its ring or pipe stay valid, and a fresh
    worker (same ring) redoes the steps that were never committed.  After ``max_restarts`` deaths,
    :class:`WorkerCrashedError`.  If main dies, so do the workers, and the rings (unlinked at
    creation) vanish with the last mapping: workers forked by the main thread get
    ``PR_SET_PDEATHSIG``, and every worker watches its parent pid while it waits for a command or
    for ring space (the signal fires when the forking *thread* exits, so a worker forked by any
    other thread, say one that iterates each epoch in the background, must not have it).  A
    worker closes the inherited main ends of every pipe, so that closing the pool (main's ends)
    unblocks a worker stuck on one.  A copy of the pool in another process forked from main
    (one that drops its copy of a loader, or whose interpreter exits) closes only that
    process's descriptors when it is closed: the workers, rings and generation counter stay
    main's (``ShardLoader`` starts new workers for a child that iterates its copy).

Stuck start
    On CPython without the fix for python/cpython#112275 (before 3.12 and 3.11.10), a
    process forked while another of the parent's threads held the runtime's thread-state lock
    stops for good inside ``fork``, before any of its own code runs.  A training process's C++
    threads (gloo, NCCL, autograd) take that lock when they enter Python, so now and then a
    forked worker would hang the loader.  Each worker writes its pid into the shared array
    ``started`` first thing; one that main waits on and has not done so ``start_timeout``
    seconds after its fork is killed and restarted like a dead worker (and counted in
    ``restarts``).

Generations
    Each :meth:`WorkerPool.run` starts a new generation and abandons the previous one: an older
    ``run`` iterator resumed after that raises :class:`~shardio.errors.UsageError` instead of
    waiting for batches that will never come.

Closing without waiting
    ``close(wait=False)`` (a non-persistent ``ShardLoader`` at the end of each iteration) does
    everything ``close()`` does but wait for the workers to be gone: they have their STOP, their
    pipes are closed and their rings unlinked, and the kernel's teardown of each process (~12 ms
    here for a worker forked from a process holding torch: its copied page tables) goes on
    while the training loop does.  No thread waits on them (one that starts or ends while main
    forks can leave the child stuck in fork, see *Stuck start*): multiprocessing reaps those
    that exited whenever it starts a process, and :func:`reap_exiting` (at every pool's start,
    and waiting from ``ShardLoader.close()``, so that after an explicit close nothing of the
    loader is left) terminates, then kills, one still there ``join_timeout`` seconds after
    the close, as ``close()`` would.

Worker states: STARTING → IDLE ⇄ PRODUCING → STOPPED | DEAD (→ restarted as a new STARTING).
"""

from __future__ import annotations

import array
import ctypes
import gc
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import select
import signal
import socket
import struct
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from ._fsutil import set_pdeathsig
from ._tree import (
    KIND_BATCH,
    KIND_ERROR,
    KIND_RING_SPACE,
    Plan,
    error_message,
    read_error,
    read_header,
    write_times,
)
from .config import START_TIMEOUT
from .errors import (
    RingClosedError,
    RingFullError,
    RingTimeoutError,
    ShmSpaceError,
    UsageError,
    WorkerCrashedError,
    WorkerError,
    WorkerTimeoutError,
)
from .ring import DEFAULT_SHM_DIR, Message, Ring, check_shm_space, sweep_stale
from .topology import check_cpus

__all__ = ["BatchJob", "Cmd", "PoolOptions", "Sent", "SpilledMessage", "WorkerPool"]

log = logging.getLogger("shardio.pool")

# How often a spilling worker whose ring is full looks whether main now wants its step.
_SPILL_SLICE = 0.01

_CLOSED_MESSAGE = "the worker pool is closed; create a new loader"

# Ring directories this process has swept for files of dead creators (once each).
_SWEPT: set[str] = set()


def _sweep_once(directory: str | None) -> None:
    """Before the first pool of this process puts rings in ``directory``: remove ring files
    whose creator is gone.  Rings are unlinked right after they are mapped, so only a creator
    killed inside ``Ring.create`` (or a named ring's creator) leaves one; nothing else would ever
    free that memory."""
    key = os.path.realpath(directory or DEFAULT_SHM_DIR)
    if key in _SWEPT:
        return
    _SWEPT.add(key)
    try:
        removed = sweep_stale(key)
    except OSError as exc:  # not listable: the ring creation reports the directory properly
        log.debug("ring sweep of %s skipped: %s", key, exc)
        return
    if removed:
        log.info("removed %d ring file(s) left by dead processes: %s", len(removed),
                 ", ".join(removed))


class Cmd(IntEnum):
    EPOCH = 1
    STOP = 2
    RING = 3


_SIZE_REPORT = struct.Struct("<8sQ")  # see *Ring sizing*; shorter than any message header
_SIZE_MAGIC = b"RINGSIZE"
_BACK_MAGIC = b"RINGBACK"  # see *Spill*: a worker's messages take the ring again
_EOF = object()  # _recv_spilled: the worker's end of the spill pipe is gone
_MAX_FDS = 4  # descriptors one read of the control socket can take (one per RING command)
_GONE = ("gone",)  # _Output.await_ring: main is gone
_NO_RING = ("no ring",)  # _Output.await_ring: its memory could not be allocated (reported)


class BatchJob(Protocol):
    """What a worker runs; built in main and inherited by ``fork``.

    Optional hooks, called once in each worker process (a restarted one too) before its first
    command: ``bind_output(claim)`` (see *Reading into the ring*) and ``bind_worker(index,
    num_workers)``, which worker of how many this process is.
    """

    def begin(self, spec: Any) -> None: ...

    def produce(self, step: int) -> tuple[Plan, list[float]]: ...


@dataclass(frozen=True, kw_only=True)
class PoolOptions:
    """Worker pool settings (see :class:`~shardio.loader.ShardLoader`)."""

    num_workers: int = 2
    # Bytes per ring, or a function giving them from the first batch's bytes (see *Ring sizing*).
    ring_bytes: int | Callable[[int], int] = 128 << 20
    shm_dir: str | None = None
    cpus: tuple[int, ...] | None = None
    poll_interval: float = 0.2
    max_restarts: int = 3
    join_timeout: float = 5.0
    start_timeout: float = START_TIMEOUT
    # Seconds main waits for one batch before WorkerTimeoutError (0: for ever); checked every
    # poll_interval.
    timeout: float = 0.0
    # Signals the workers ignore besides SIGINT, SIGUSR1 and SIGUSR2 (the first value of
    # WorkerPool.ignore_signals).
    ignore_signals: tuple[int, ...] = ()


class SpilledMessage:
    """A message that came through a worker's spill pipe: private (writable) memory of main,
    not part of any ring, so nothing to release.

    Attributes:
        view: writable memoryview of the message bytes.
    """

    __slots__ = ("view",)

    def __init__(self, data: bytes) -> None:
        self.view = memoryview(bytearray(data))


class Sent(IntEnum):
    """Outcome of a worker's attempt to deliver one message."""

    DELIVERED = 1  # in the ring or the spill pipe
    ABANDONED = 2  # the epoch moved on (new generation): drop the rest of it
    CLOSED = 3  # the pool closed the ring or the pipe: exit


def _runs(steps: Iterable[int]) -> list[range]:
    """``steps`` (in order) as maximal arithmetic runs."""
    if isinstance(steps, range):
        return [steps] if steps else []
    runs: list[range] = []
    for s in steps:
        if runs:
            r = runs[-1]
            if len(r) == 1 and s != r.start:
                runs[-1] = range(r.start, s + (s - r.start), s - r.start)
                continue
            if len(r) > 1 and s == r[-1] + r.step:
                runs[-1] = range(r.start, s + r.step, r.step)
                continue
        runs.append(range(s, s + 1))
    return runs


class _Todo:
    """The steps one worker still owes in this epoch, in order, kept as arithmetic runs so that
    they travel in a few bytes (see *Protocol*); main pops them as batches arrive."""

    __slots__ = ("_at", "_runs")

    def __init__(self, steps: Iterable[int]) -> None:
        self._runs = _runs(steps)
        self._at = 0  # runs before it are done; runs[_at] may have been trimmed at the front

    def first(self) -> int:
        return self._runs[self._at][0]

    def pop(self) -> None:
        r = self._runs[self._at]
        if len(r) > 1:
            self._runs[self._at] = r[1:]
        else:
            self._at += 1

    def runs(self) -> list[range]:
        return self._runs[self._at:]

    def __iter__(self) -> Iterator[int]:
        return itertools.chain.from_iterable(self.runs())

    def __contains__(self, step: object) -> bool:
        return any(step in r for r in self._runs[self._at:])


def _frame(cmd: tuple[Any, ...]) -> memoryview:
    body = pickle.dumps(cmd, pickle.HIGHEST_PROTOCOL)
    return memoryview(len(body).to_bytes(8, "little") + body)


class _Control:
    """Worker end of the control socket: commands, and the descriptors that come with them."""

    def __init__(self, fd: int, parent: int, poll: float) -> None:
        self.sock = socket.socket(fileno=fd)
        self.sock.settimeout(None)  # blocking reads after poll, whatever setdefaulttimeout says
        self.parent, self.poll = parent, poll
        self.waiter = select.poll()  # not select.select: a training process may have fds > 1024
        self.waiter.register(fd, select.POLLIN)
        self.fds: deque[int] = deque()  # received, not yet claimed by their command

    def _read_exact(self, n: int) -> bytes | None:
        """``n`` bytes, or None once main is gone (EOF, or a new parent: another process may
        still hold main's end, a fork of main for one)."""
        buf = bytearray()
        while len(buf) < n:
            if not self.waiter.poll(self.poll * 1000):
                if os.getppid() != self.parent:
                    return None
                continue
            try:
                chunk, fds, _flags, _addr = socket.recv_fds(self.sock, n - len(buf), _MAX_FDS)
            except OSError:
                return None
            self.fds.extend(fds)
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    def read(self) -> Any:
        """The next command (see *Protocol*), or None once main is gone.  A ``Cmd.RING``
        comes back as ``(Cmd.RING, fd, directory)``; the caller owns ``fd``."""
        head = self._read_exact(8)
        if head is None:
            return None
        body = self._read_exact(int.from_bytes(head, "little"))
        if body is None:
            return None
        cmd = pickle.loads(body)
        if cmd[0] == Cmd.RING:
            return (Cmd.RING, self.fds.popleft(), cmd[2])
        return cmd


def _send_with_fd(sock_fd: int, data: memoryview, fd: int | None) -> int:
    """Write the start of ``data`` to a Unix socket with ``fd`` attached (``SCM_RIGHTS``)."""
    sock = socket.socket(fileno=sock_fd)
    try:
        sock.setblocking(False)  # as the descriptor already is: never wait (see *Protocol*)
        return sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", [fd]))])
    finally:
        sock.detach()  # the descriptor stays the pool's


# glibc gives the top of the heap back to the kernel whenever more than M_TRIM_THRESHOLD
# (128 KiB) of it is free, and serves allocations of M_MMAP_THRESHOLD (128 KiB) and more with
# fresh mmaps, raising both thresholds as large blocks are freed, up to 32 and 64 MiB.  A worker
# frees a whole batch of samples at once, so with the starting values every batch handed
# megabytes back and faulted them in again: ~1,100 page faults per raw batch of 256 samples of
# 22 KB, and reading a sample took 20 µs instead of 7.5.  Workers start at the values glibc's
# own tuning ends at.  (Either option set by hand turns that tuning off, hence both.)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM_THRESHOLD = 64 << 20
_MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)


def keep_freed_heap() -> bool:
    """In a worker process: keep up to 64 MiB of freed heap for the next batch (glibc only; see
    the comment above).  True if the settings took."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
                and mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))


class _Output:
    """Worker side of one worker's ring and spill pipe (see *Spill* in the module docstring)."""

    def __init__(self, ring: Ring | None, data: Any, gen: Any, want: Any, index: int,
                 poll: float, parent: int) -> None:
        self.ring, self.data, self.gen, self.want = ring, data, gen, want
        self.index, self.poll, self.parent = index, poll, parent
        self.spilling = False
        self.reported = False  # a size report went out (see *Ring sizing*)
        self.claims = True  # see *Reading into the ring*

    def attach(self, fd: int, directory: str | None) -> bool:
        """Take the ring main sent (``Cmd.RING``) as this worker's; a second one is ignored.
        False if its memory cannot be allocated (reported to main, see *Ring sizing*)."""
        try:
            if self.ring is None:
                # Main left the allocation of its pages to this worker (see *Ring sizing*).
                try:
                    ring = Ring.from_fd(fd, reserve=True, directory=directory)
                except ShmSpaceError as exc:
                    self.report_space(exc)
                    return False
                ring.fd, fd = fd, -1  # kept: Ring.keep_written maps the ring again through it
                self.adopt(ring)
            return True
        finally:
            if fd >= 0:
                os.close(fd)

    def inherit(self, ring: Ring) -> None:
        """Take the ring inherited through fork (a restart): allocate its pages first where
        main kept its descriptor (see *Ring sizing*)."""
        try:
            if ring.fd is not None:
                ring.reserve_pages()
        except ShmSpaceError as exc:
            ring.close_fd()  # this process's copy of main's descriptor
            self.report_space(exc)
            return
        # The descriptor stays open here: Ring.keep_written maps the ring again through it.
        self.adopt(ring)

    def adopt(self, ring: Ring) -> None:
        ring.become_producer()
        # Its pages mapped in one go: the first pass round the ring would fault on every one.
        ring.populate()
        self.ring = ring

    def report_space(self, exc: ShmSpaceError) -> None:
        """Tell main this worker has no ring and never will: a KIND_RING_SPACE message, which
        main raises whatever epoch it is in (see *Ring sizing*).  It never asks for one again."""
        self.reported = True
        plan = error_message(exc, traceback.format_exc())
        self._spill(plan, -1, [], self.gen.value, KIND_RING_SPACE)

    def await_ring(self, control: _Control, nbytes: int) -> Any:
        """Report a ready batch of ``nbytes`` (once) and wait for the ring: None once it is
        attached, else the command that came instead (None for main gone: ``_GONE``)."""
        if not self.reported:
            self.reported = True
            try:
                self.data.send_bytes(_SIZE_REPORT.pack(_SIZE_MAGIC, nbytes))
            except OSError:  # main closed its end: the pool is closing
                return _GONE
        cmd = control.read()
        if cmd is None:
            return _GONE
        if cmd[0] != Cmd.RING:
            return cmd
        return None if self.attach(cmd[1], cmd[2]) else _NO_RING

    def claim(self, nbytes: int) -> Claim | None:
        """Reserve ``nbytes`` of the ring now, for a job to build its next message in (see
        *Reading into the ring*); None when that cannot be done without waiting."""
        ring = self.ring
        if ring is None or self.spilling or not self.claims or nbytes > ring.max_message:
            return None
        try:
            buf = ring.reserve(nbytes, timeout=0.0)
        except (RingTimeoutError, RingClosedError):
            return None
        mm, offset = ring.reserved_at()
        return Claim(buf, mm, offset, self)

    def _deliver_claimed(self, plan: Plan, claim: Claim, step: int, times: list[float],
                         generation: int, kind: int) -> Sent | None:
        """Send a message built in ``claim`` (see *Reading into the ring*); None when the
        claim was dropped and the message must go the usual way."""
        ring = self.ring
        assert ring is not None
        buf, claim.buf = claim.buf, None
        if self.gen.value != generation:
            ring.abort()
            return Sent.ABANDONED
        nbytes = plan.nbytes
        if not plan.area_end:  # nothing of the batch lies in the area: written over it
            if claim.viewed():
                self._keep(claim)
                ring.abort()
                return None
            if nbytes > len(buf):
                ring.abort()
                return None
        try:
            _write(plan, buf, step, times, kind, generation)
        except BaseException:
            ring.abort()
            raise
        del buf
        plan.fills = []  # (a fill may view the area)
        if plan.area_end and claim.viewed():
            self._keep(claim)
        try:
            ring.commit(nbytes)
        except RingClosedError:
            return Sent.CLOSED
        return self._delivered()

    def _keep(self, claim: Claim) -> None:
        """Something in this worker still views ``claim``'s area: make its pages private here
        and claim no more (see *Reading into the ring*)."""
        assert self.ring is not None
        start, used = claim.area
        self.ring.keep_written([(claim.mm, claim.offset + start, used)])
        self.claims = False
        log.warning("worker %d: the dataset's transform or collate_fn kept a view of a sample "
                    "field after its batch was made; this worker now reads samples into its own "
                    "memory and copies them into the ring (slower). Copy what must outlive the "
                    "batch (bytes(field), np.array(field))", self.index)

    def deliver(self, plan: Plan, step: int, times: list[float], generation: int,
                kind: int = KIND_BATCH) -> Sent:
        """Write one message to the ring (or the spill pipe).

        A message larger than the ring can ever hold (an unusually large batch) goes through
        the spill pipe (one copy) instead of failing.
        """
        claim, plan.claim = plan.claim, None
        if claim is not None:
            sent = self._deliver_claimed(plan, claim, step, times, generation, kind)
            if sent is not None:
                return sent
        nbytes = plan.nbytes
        if self.ring is None or nbytes > self.ring.max_message:  # no ring: only errors get here
            return self._spill(plan, step, times, generation, kind)
        first = True
        while True:
            if self.gen.value != generation:
                return Sent.ABANDONED
            if self.spilling:
                timeout = 0.0 if first else _SPILL_SLICE
            else:
                timeout = self.poll
            first = False
            try:
                buf = self.ring.reserve(nbytes, timeout=timeout)
            except RingTimeoutError:
                if os.getppid() != self.parent:  # main is gone: nobody will ever free space
                    return Sent.CLOSED
                # Full ring: spill only if main is blocked on exactly this message (a deadlock
                # otherwise); if main is merely busy, it will release space: keep waiting.
                if self.want[self.index] == step and self.gen.value == generation:
                    self.spilling = True
                    return self._spill(plan, step, times, generation, kind)
                continue
            except RingClosedError:
                return Sent.CLOSED
            try:
                _write(plan, buf, step, times, kind, generation)
            except BaseException:
                self.ring.abort()
                raise
            del buf
            try:
                self.ring.commit()
            except RingClosedError:
                return Sent.CLOSED
            return self._delivered()

    def _delivered(self) -> Sent:
        """A message went into the ring: after a spill, main (waiting on the pipe) is told."""
        if self.spilling:
            self.spilling = False
            try:
                self.data.send_bytes(_SIZE_REPORT.pack(_BACK_MAGIC, 0))
            except OSError:  # main closed its end: the pool is closing
                return Sent.CLOSED
        return Sent.DELIVERED

    def _spill(self, plan: Plan, step: int, times: list[float], generation: int,
               kind: int) -> Sent:
        buf = bytearray(plan.nbytes)
        _write(plan, memoryview(buf), step, times, kind, generation)
        try:
            self.data.send_bytes(buf)
        except OSError:  # main closed its end: the pool is closing
            return Sent.CLOSED
        return Sent.DELIVERED


class Claim:
    """Ring memory reserved for a message before it is built (see *Reading into the ring*):
    ``buf`` the writable reservation, at ``offset`` of mapping ``mm``; the job that builds in it
    sets ``area`` (``(start, nbytes)`` in ``buf`` of what it put there) and ``watch`` (a weak
    reference to the object every view of the area holds)."""

    __slots__ = ("area", "buf", "mm", "offset", "out", "watch")

    def __init__(self, buf: memoryview, mm: Any, offset: int, out: _Output) -> None:
        self.buf: memoryview | None = buf
        self.mm, self.offset, self.out = mm, offset, out
        self.area = (0, 0)
        self.watch: Callable[[], Any] | None = None

    def viewed(self) -> bool:
        """Whether anything still views the area."""
        return self.watch is not None and self.watch() is not None and self.area[1] > 0

    def abort(self) -> None:
        """Give the reservation back unused (nothing must use the area after this)."""
        self.buf = None
        ring = self.out.ring
        if ring is not None:
            ring.abort()

    def drop(self) -> None:
        """Give the reservation back unused, once the job let go of everything that views the
        area (a view kept by user code keeps its bytes: see *Reading into the ring*)."""
        if self.viewed():
            self.out._keep(self)
        self.abort()


def _write(plan: Plan, buf: memoryview, step: int, times: list[float], kind: int,
           generation: int) -> None:
    """Write the message and record the write stage (batch messages carry stage seconds)."""
    t0 = time.perf_counter()
    plan.write(buf, step, times, kind=kind, generation=generation)
    if times:
        done = list(times)
        done[4] = time.perf_counter() - t0
        done[5] += done[4]
        write_times(buf, done)


def _ignore_signals(signums: Iterable[int]) -> None:
    """In a worker: ignore ``signums`` (one that cannot be ignored here is logged)."""
    for sig in signums:
        try:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError) as exc:
            log.warning("worker: cannot ignore signal %s: %s", sig, exc)


def _worker_main(job: BatchJob, ring: Ring | None, ctl: int, data: Any, gen: Any, want: Any,
                 started: Any, index: int, cpus: Sequence[int] | None, parent: int,
                 poll: float, main_ends: Sequence[Any], pdeathsig: bool,
                 num_workers: int, quiet: Sequence[int] = ()) -> None:
    started[index] = os.getpid()  # out of fork: see "Stuck start" in the module docstring
    if pdeathsig:  # forked by main's main thread (see "Failure handling")
        set_pdeathsig(signal.SIGKILL)
    if os.getppid() != parent:  # main died before prctl took effect
        os._exit(1)
    # Main's ends of the pipes (this worker's and its siblings') came along with fork; a copy held
    # here would keep a pipe open after main closes it, and a send on it could then block forever.
    for c in main_ends:
        if isinstance(c, int):  # a control socket's end, or a sibling's ring descriptor
            os.close(c)
        else:
            c.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is main's to handle
    # So are the batch system's warnings (Slurm --signal=USR1@120 reaches every process of the
    # step; their default action would kill the worker), and whatever signals the owner handles
    # in main (ShardLoader.save_on_signal's): a handler inherited through fork would run here.
    _ignore_signals((signal.SIGUSR1, signal.SIGUSR2, *quiet))
    # The cyclic GC would otherwise traverse every object inherited from main (~10^5 in a torch
    # process): ~0.1 s per full collection, and a write to each object's header, so a copy of
    # every page of main's heap.  Frozen, they are never traversed (nor collected) here.
    gc.freeze()
    keep_freed_heap()
    if cpus:
        try:
            os.sched_setaffinity(0, {cpus[index % len(cpus)]})
        except OSError as exc:
            log.warning("worker %d: cannot pin to CPU %s: %s", index, cpus[index % len(cpus)], exc)
    control = _Control(ctl, parent, poll)
    out = _Output(None, data, gen, want, index, poll, parent)
    if ring is not None:
        out.inherit(ring)
    bind = getattr(job, "bind_output", None)
    if bind is not None:
        bind(out.claim)  # see *Reading into the ring*
    bind = getattr(job, "bind_worker", None)
    if bind is not None:
        bind(index, num_workers)  # which worker this process is (the job's begin() runs later)
    try:
        cmd = None
        while True:
            if cmd is None:
                cmd = control.read()
            if cmd is None or cmd[0] == Cmd.STOP:
                return
            if cmd[0] == Cmd.RING:  # came while idle (its epoch was abandoned)
                out.attach(cmd[1], cmd[2])
                cmd = None
                continue
            _, generation, spec, runs, quiet = cmd
            cmd = None
            _ignore_signals(quiet)  # (signals main handles since this worker started)
            if gen.value != generation:  # superseded before it started: not worth a begin()
                continue
            step = runs[0][0] if runs else -1
            try:
                job.begin(spec)
                for step in itertools.chain.from_iterable(runs):
                    if gen.value != generation:
                        break
                    plan, times = job.produce(step)
                    if out.ring is None:
                        cmd = out.await_ring(control, max(plan.nbytes, plan.size_hint))
                        if cmd is _GONE:
                            return
                        if cmd is _NO_RING:  # reported: main closes the pool
                            cmd = None
                            break
                        if cmd is not None:  # a newer command: this batch is not wanted any more
                            break
                    sent = out.deliver(plan, step, times, generation)
                    # Written: let the batch go now, not when the next one is made, so a
                    # worker's heap holds one batch, not two (and its first two batches reuse
                    # one set of pages).
                    plan = None
                    if sent == Sent.CLOSED:
                        return
                    if sent == Sent.ABANDONED:
                        break
            except BaseException as exc:  # noqa: BLE001 - everything goes back to main
                if out.ring is not None:
                    out.ring.abort()
                plan = error_message(exc, traceback.format_exc())
                if out.deliver(plan, step, [], generation, kind=KIND_ERROR) == Sent.CLOSED:
                    return
    finally:
        # (closed here, not left to the process's exit: an unclosed socket is a
        # ResourceWarning per worker per epoch where warnings show, as under pytest)
        control.sock.close()


@dataclass
class _Worker:
    index: int
    ring: Ring | None  # None until sized (see *Ring sizing*)
    proc: Any = None
    ctl: int | None = None  # control socket, main's (sending, non-blocking) end
    data: Any = None  # spill pipe, main's (receiving) end
    # Command bytes the control socket has not taken yet; the first may be partly written.
    outbox: deque[memoryview] = field(default_factory=deque)
    partial: bool = False  # the first outbox entry is partly written
    # The outbox's Cmd.RING frame, until its first byte (which carries ring.fd) is written.
    ring_frame: memoryview | None = None
    restarts: int = 0
    spawned: float = 0.0  # time.monotonic() of the fork
    spilling: bool = False  # the last message came through the spill pipe
    # make_room gave nothing back while the worker waits for space: wait without until_full
    # until the next message (see *Spill*).
    full: bool = False
    # Messages of the current epoch received ahead of the step main waits for, by step.
    early: dict[int, tuple[Ring | None, Any]] = field(default_factory=dict)


class WorkerPool:
    """``num_workers`` persistent processes, one ring each.

    Args:
        job: the batch producer, inherited by the forked workers.
        options: :class:`PoolOptions`.

    Raises:
        ShmSpaceError: the rings do not fit in the shared-memory directory or the cgroup limit.
    """

    def __init__(self, job: BatchJob, options: PoolOptions) -> None:
        self.job = job
        self.options = options
        self._ctx = mp.get_context("fork")
        self._gen = self._ctx.RawValue("q", 0)
        self._want = self._ctx.RawArray("q", [-1] * options.num_workers)
        # Each worker writes its pid here first thing (``_worker_main``).
        self._started = self._ctx.RawArray("q", [0] * options.num_workers)
        self._workers: list[_Worker] = []
        self._closed = False
        self.owner = os.getpid()  # a forked child's copy of the pool is not its to close
        # The thread inside close(), from its start (None: none); see run().
        self._closing: int | None = None
        self._failing = False  # closed by run() itself, to raise its own error
        # Workers a close(wait=False) did not wait for (see *Closing without waiting*).
        self.exiting: list[Any] = []
        self.restarts = 0
        # Signals the workers ignore (besides SIGINT, SIGUSR1, SIGUSR2): the owner may change
        # it between runs; new workers get it at their start, running ones with the next epoch.
        self.ignore_signals: tuple[int, ...] = tuple(options.ignore_signals)
        # Called with a ring whose worker waits for space while main waits for its next
        # message; True if it gave space back (see *Spill*).
        self.make_room: Callable[[Ring], bool] | None = None

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        o = self.options
        check_cpus(o.cpus)  # (a worker could not pin itself: found here, not in each worker)
        reap_exiting()  # (workers of pools closed without waiting: see *Closing without waiting*)
        _sweep_once(o.shm_dir)
        sized = not callable(o.ring_bytes)
        if sized:
            check_shm_space(Ring.file_bytes(o.ring_bytes) * o.num_workers, o.shm_dir)
        try:
            for i in range(o.num_workers):
                ring = None
                if sized:
                    ring = Ring.create(o.ring_bytes, directory=o.shm_dir, unlink_now=True,
                                       keep_fd=True, space_checked=True)
                w = _Worker(i, ring)
                self._workers.append(w)
                self._spawn(w)
        except BaseException:
            self.close()
            raise

    def _size_rings(self, first: _Worker, nbytes: int) -> None:
        """Worker ``first``'s batch is ``nbytes``: create every ring and send each to its worker
        (see *Ring sizing*); nothing if they exist.  A failure closes the pool."""
        if first.ring is not None:
            return
        size = self.options.ring_bytes(nbytes)  # type: ignore[operator]
        directory = self.options.shm_dir
        try:
            check_shm_space(Ring.file_bytes(size) * len(self._workers), directory)
            # Each ring goes out as soon as it exists: its worker maps it while main makes the
            # next one.  The worker main waits on first.
            for w in sorted(self._workers, key=lambda x: x is not first):
                w.ring = Ring.create(size, directory=directory, unlink_now=True, keep_fd=True,
                                     reserve=False, space_checked=True)
                w.ring_frame = _frame((Cmd.RING, w.ring.capacity, directory))
                self._post(w, w.ring_frame)
        except BaseException:
            self._failing = True
            self.close()
            raise

    def _spawn(self, w: _Worker) -> None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ctl_send, ctl_recv = a.detach(), b.detach()  # plain descriptors, closed explicitly
        os.set_blocking(ctl_send, False)  # see *Protocol*: main never blocks on it
        # A restart: the new worker inherits the ring, and main's descriptor of it, through
        # fork (see *Ring sizing*).
        w.ring_frame = None
        data_recv, data_send = self._ctx.Pipe(duplex=False)
        main_ends = [ctl_send, data_recv] + [
            c for x in self._workers if x is not w
            for c in (x.ctl, x.data, x.ring.fd if x.ring is not None else None) if c is not None
        ]
        # PR_SET_PDEATHSIG fires when the forking thread exits: only the main thread lives as
        # long as the process.
        pdeathsig = threading.current_thread() is threading.main_thread()
        proc = self._ctx.Process(
            target=_worker_main, name=f"shardio-worker-{w.index}", daemon=True,
            args=(self.job, w.ring, ctl_recv, data_send, self._gen, self._want, self._started,
                  w.index, self.options.cpus, os.getpid(), self.options.poll_interval, main_ends,
                  pdeathsig, self.options.num_workers, self.ignore_signals),
        )
        self._started[w.index] = 0
        w.spawned = time.monotonic()
        try:
            proc.start()
        except BaseException:
            os.close(ctl_send)
            data_recv.close()
            raise
        finally:
            os.close(ctl_recv)
            data_send.close()
        w.proc, w.ctl, w.data = proc, ctl_send, data_recv
        w.spilling = w.full = False
        w.outbox.clear()
        w.partial = False

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    # --- epochs ------------------------------------------------------------------------------
    def run(self, spec: Any, steps: Sequence[int]
            ) -> Iterator[tuple[int, Ring | None, Message | SpilledMessage]]:
        """Produce ``steps`` (in order); yield ``(step, ring, message)`` for each.

        The caller releases every ring message with ``ring.release(message)`` once done with it;
        a :class:`SpilledMessage` (``ring`` None) is private memory and needs no release.

        Raises:
            WorkerError: a worker raised (``__cause__`` is its exception).
            WorkerCrashedError: a worker died more than ``max_restarts`` times.
            WorkerTimeoutError: a step took longer than ``PoolOptions.timeout`` to arrive.
            UsageError: a newer ``run`` started while this one was suspended.
            ShmSpaceError: rings sized from the first batch do not fit (the pool is closed).
        """
        if self._closed:
            raise WorkerError(_CLOSED_MESSAGE)
        self._gen.value += 1
        generation = self._gen.value
        W = len(self._workers)
        todos = [_Todo(steps[i::W]) for i in range(W)]
        for w, todo in zip(self._workers, todos):
            self._drop_early(w)
            self._want[w.index] = -1
            w.full = False
            if w.partial:  # the worker is reading that command: finish it, drop the rest
                while len(w.outbox) > 1:
                    w.outbox.pop()
            else:  # never started: the worker need not see a stale command at all
                w.outbox.clear()
            if w.ring_frame is not None and all(f is not w.ring_frame for f in w.outbox):
                w.outbox.append(w.ring_frame)  # not a command of the old epoch: still owed
            if w.proc.exitcode is not None:  # died while idle
                self._restart(w, generation, spec, todo)
            elif not self._post(w, (Cmd.EPOCH, generation, spec, todo.runs(),
                                    self.ignore_signals)):
                self._restart(w, generation, spec, todo)  # its end is gone: it is dying
        for k, step in enumerate(steps):
            w, todo = self._workers[k % W], todos[k % W]
            try:
                ring, msg = self._next(w, generation, spec, todo)
            except Exception as exc:
                if self._closing is None or self._failing or (
                        isinstance(exc, WorkerError) and exc.args == (_CLOSED_MESSAGE,)):
                    raise
                # close() from another thread, or from a signal handler, pulled the rings and
                # pipes from under the wait (a RingClosedError, or worse, a half-torn-down
                # ring): say what happened.
                raise WorkerError(_CLOSED_MESSAGE) from exc
            todo.pop()
            yield step, ring, msg

    def _post(self, w: _Worker, cmd: tuple[Any, ...] | memoryview) -> bool:
        """Queue ``cmd`` (or an encoded frame) for ``w`` and write what its control socket
        takes now, without blocking (see *Protocol*).  False if the worker's end is gone."""
        w.outbox.append(cmd if isinstance(cmd, memoryview) else _frame(cmd))
        return self._flush(w)

    def _flush(self, w: _Worker) -> bool:
        while w.outbox:
            try:
                if w.ctl is None:  # its restart failed half-way
                    raise BrokenPipeError
                if w.outbox[0] is w.ring_frame and w.ring is not None:
                    n = _send_with_fd(w.ctl, w.outbox[0], w.ring.fd)
                    w.ring_frame = None  # main keeps its descriptor (see *Ring sizing*)
                else:
                    n = os.write(w.ctl, w.outbox[0])
            except BlockingIOError:  # full: the worker is not reading now
                return True
            except OSError:  # EPIPE: it exited (a restart follows when main waits on it)
                w.outbox.clear()
                w.partial = False
                return False
            if n < len(w.outbox[0]):
                w.outbox[0] = w.outbox[0][n:]
                w.partial = True
            else:
                w.outbox.popleft()
                w.partial = False
        return True

    def _drop_early(self, w: _Worker) -> None:
        for ring, msg in w.early.values():
            if ring is not None:
                ring.release(msg)
        w.early.clear()

    def _receive(self, w: _Worker) -> tuple[Ring | None, Any] | None:
        """One message from either channel of ``w``, or None after ``poll_interval`` (or
        after a size report, see *Ring sizing*)."""
        poll = self.options.poll_interval
        if w.spilling or w.ring is None:
            if w.data.poll(poll):
                got = self._recv_spilled(w)
                return None if got is _EOF else got  # type: ignore[return-value]
            if w.ring is None:
                return None
            try:
                msg = w.ring.recv(timeout=0)
            except RingTimeoutError:
                return None
        else:
            try:
                msg = w.ring.recv(timeout=poll,
                                  until_full=self.make_room is not None and not w.full)
            except RingFullError:  # its worker waits for space that main holds
                w.full = not self.make_room(w.ring)  # type: ignore[misc]
                return None
            except RingTimeoutError:
                got = self._recv_spilled(w) if w.data.poll(0) else None
                return None if got is _EOF else got  # type: ignore[return-value]
        w.spilling = w.full = False
        return w.ring, msg

    def _recv_spilled(self, w: _Worker) -> tuple[Ring | None, Any] | object | None:
        """A message from the spill pipe; None for a size report or a ``RINGBACK`` (handled
        here), ``_EOF`` when the worker's end is gone (it died, maybe mid-send: treated like a
        timeout)."""
        try:
            data = w.data.recv_bytes()
        except (EOFError, OSError):
            return _EOF
        if len(data) == _SIZE_REPORT.size and data.startswith(_SIZE_MAGIC):
            self._size_rings(w, _SIZE_REPORT.unpack(data)[1])
            return None
        if len(data) == _SIZE_REPORT.size and data.startswith(_BACK_MAGIC):
            w.spilling = False  # its next messages are in the ring (see *Spill*)
            return None
        w.spilling = True
        if (w.ring is not None and self.make_room is not None
                and len(data) <= w.ring.max_message):
            self.make_room(w.ring)  # the ring was full: the next batch may take it again
        return None, SpilledMessage(data)

    @staticmethod
    def _discard(ring: Ring | None, msg: Any) -> None:
        if ring is not None:
            ring.release(msg)

    def _next(self, w: _Worker, generation: int, spec: Any, todo: _Todo
              ) -> tuple[Ring | None, Any]:
        want = todo.first()
        self._check_current(generation)  # before touching `want` or `early`: not ours any more
        self._want[w.index] = want
        timeout = self.options.timeout
        deadline = time.monotonic() + timeout if timeout > 0 else None
        try:
            while True:
                self._check_current(generation)
                for x in self._workers:
                    if x.outbox:
                        self._flush(x)
                got = w.early.pop(want, None)
                if got is None:
                    got = self._receive(w)
                if got is None:
                    if w.proc.exitcode is not None:
                        self._restart(w, generation, spec, todo)
                    elif self._stuck_starting(w):
                        self._restart(w, generation, spec, todo, reason=(
                            f"was still inside fork {self.options.start_timeout:g} s after it "
                            "(a lock another thread held at the fork; see shardio.pool, "
                            "'Stuck start')"))
                    elif deadline is not None and time.monotonic() >= deadline:
                        # It hangs: stopped now, so that closing the pool does not wait
                        # join_timeout for it first (the error came that much late).
                        w.proc.kill()
                        raise WorkerTimeoutError(
                            f"worker {w.index} (pid {w.proc.pid}) did not deliver step {want} "
                            f"within {timeout:g} s: a transform or collate_fn that hangs or "
                            "takes that long (py-spy dump --pid shows where), or storage that "
                            "stalls; raise ShardLoader(timeout=...) if batches are that slow")
                    continue
                ring, msg = got
                kind, step, _times, gen = read_header(msg.view)
                if kind == KIND_RING_SPACE:
                    self._ring_space(ring, msg)
                if gen != generation & 0xFFFFFFFF:
                    self._discard(ring, msg)
                    continue
                if step != want and step in todo:  # overtook `want` through the other channel
                    w.early[step] = got
                    continue
                if kind == KIND_ERROR:
                    exc, tb = read_error(msg.view)
                    self._discard(ring, msg)
                    raise WorkerError(
                        f"worker {w.index} raised {type(exc).__name__}: {exc}\n"
                        f"--- worker traceback ---\n{tb}"
                    ) from exc
                if step != want:
                    self._discard(ring, msg)
                    raise WorkerError(f"worker {w.index} sent step {step}, expected {want}")
                return got
        finally:
            self._want[w.index] = -1

    def _ring_space(self, ring: Ring | None, msg: Any) -> None:
        """A worker could not allocate its ring (see *Ring sizing*): close, raise its error."""
        exc, _tb = read_error(msg.view)
        self._discard(ring, msg)
        self._failing = True
        self.close()
        raise exc

    def _check_current(self, generation: int) -> None:
        if self._closed or self._closing is not None:
            raise WorkerError(_CLOSED_MESSAGE)
        if self._gen.value != generation:
            # Its batches are dropped as stale and the workers have moved on: it would wait
            # forever (and discard the newer iterator's batches while at it).
            raise UsageError("this iterator was superseded by a newer iter(loader) (each one "
                             "starts a new epoch on the same workers); iterate one at a time")

    def _stuck_starting(self, w: _Worker) -> bool:
        """``w`` has not reached its own code ``start_timeout`` seconds after its fork."""
        return (self._started[w.index] != w.proc.pid
                and time.monotonic() - w.spawned > self.options.start_timeout)

    def _restart(self, w: _Worker, generation: int, spec: Any, todo: _Todo,
                 reason: str | None = None) -> None:
        code = w.proc.exitcode
        if code is None:  # alive but unreachable: make sure it is gone before replacing it
            w.proc.kill()
            w.proc.join(1.0)
            code = w.proc.exitcode
        what = reason or f"died ({_describe_exit(code)})"
        w.restarts += 1
        self.restarts += 1
        if w.restarts > self.options.max_restarts:
            if reason:
                hint = ("use a CPython with the fix for python/cpython#112275 (3.12+, "
                        "3.11.10+), or a larger start_timeout if workers start slowly here")
            else:
                hint = ("look for out-of-memory kills (dmesg) or crashes in native "
                        "decode/transform code")
            raise WorkerCrashedError(
                f"worker {w.index} {what}, {w.restarts} times; giving up after "
                f"max_restarts={self.options.max_restarts}: {hint}"
            )
        log.warning("worker %d %s; restarting it and redoing its unfinished batches",
                    w.index, what)
        # Whatever it committed (ring) or sent whole (pipe) is still valid: keep it, redo the rest.
        wanted = set(todo)
        while True:
            got: Any = None
            if w.ring is not None:
                try:
                    got = (w.ring, w.ring.recv(timeout=0))
                except RingTimeoutError:
                    pass
            if got is None:
                if not w.data.poll(0):
                    break
                got = self._recv_spilled(w)
                if got is _EOF:
                    break
                if got is None:  # a size report or a RINGBACK
                    continue
            ring, msg = got
            kind, step, _t, gen = read_header(msg.view)
            if kind == KIND_RING_SPACE:
                self._ring_space(ring, msg)
            if gen == generation & 0xFFFFFFFF and step in wanted and step not in w.early:
                w.early[step] = got
            else:
                self._discard(ring, msg)
        redo = _runs(s for s in todo if s not in w.early)  # a suffix of todo: one run, mostly
        if w.ctl is not None:
            os.close(w.ctl)
            w.ctl = None
        w.data.close()
        w.proc.join(0)
        if w.ring is not None:
            w.ring.reset_producer()
        self._spawn(w)
        # (failing, it is noticed like a death)
        self._post(w, (Cmd.EPOCH, generation, spec, redo, self.ignore_signals))

    def close(self, wait: bool = True) -> None:
        """Stop workers (join → terminate → kill, bounded) and release the rings.

        ``wait=False``: the workers are told to stop and their pipes and rings let go of, but
        nothing waits for their exits here (see *Closing without waiting*): :attr:`exiting`
        lists them, :func:`reap_exiting` reaps them.

        Interrupted (Ctrl-C while it waits for the workers), it kills the workers that are
        left and reaps them before the exception goes on; what it did not do yet (the rings)
        a later ``close()``, or the pool's collection, does."""
        if self._closed:
            return
        if os.getpid() != self.owner:
            self._let_go()
            return
        self._closing = threading.get_ident()
        self._gen.value += 1
        try:
            self._stop_workers(wait)
        except BaseException:
            for w in self._workers:
                if w.proc is not None and w.proc.is_alive():
                    w.proc.kill()
            for w in self._workers:
                if w.proc is not None:
                    w.proc.join(1.0)  # SIGKILL is prompt: reaped, not left a zombie
            raise
        for w in self._workers:
            w.early.clear()
            w.outbox.clear()
            w.ring_frame = None
            if w.ring is not None:
                w.ring.unlink()
        self._closed = True

    def _let_go(self) -> None:
        """close() in a process forked from the owner (its copy of a loader dropped, or its
        interpreter exiting): the workers, rings and generation counter are the owner's, still
        in use there.  Only this process's copies of the descriptors are closed; nothing is
        posted, nothing shared is marked closed, no worker is stopped or waited for."""
        self._closed = True
        for w in self._workers:
            if w.ctl is not None:
                os.close(w.ctl)
                w.ctl = None
            if w.data is not None:
                w.data.close()
            if w.ring is not None:
                w.ring.close_fd()
            w.early.clear()
            w.outbox.clear()
            w.ring_frame = None

    def _stop_workers(self, wait: bool = True) -> None:
        for w in self._workers:
            if w.ctl is not None:
                self._post(w, (Cmd.STOP,))
                # A worker that did not get STOP (its socket full) reads EOF after what it got.
                os.close(w.ctl)
                w.ctl = None
            if w.ring is not None:
                w.ring.close()
            if w.data is not None:
                w.data.close()  # a worker blocked on a spill send gets EPIPE
        deadline = time.monotonic() + self.options.join_timeout
        procs = [w.proc for w in self._workers if w.proc is not None]
        if not wait:
            self.exiting = procs
            _EXITING.extend((proc, deadline) for proc in procs)
            return
        for proc in procs:
            _finish(proc, deadline)

    def __del__(self) -> None:
        if threading is not None and not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass


def _finish(proc: Any, deadline: float) -> None:
    """Wait for a worker told to stop until ``deadline`` (``time.monotonic()``), then terminate
    it, then kill it (a second each), and reap it."""
    proc.join(max(0.0, deadline - time.monotonic()))
    if proc.is_alive():
        proc.terminate()
        proc.join(1.0)
    if proc.is_alive():
        proc.kill()
        proc.join(1.0)


# Workers of pools closed with wait=False, with the time.monotonic() by which each must be gone
# (see *Closing without waiting*).  No thread waits on them: a thread that starts or ends
# while main forks can leave the child stuck in fork on CPython before 3.11.10 (see *Stuck
# start*).  multiprocessing reaps those that exited whenever a process starts; reap_exiting
# enforces the deadlines.
_EXITING: list[tuple[Any, float]] = []
# A forked child did not start them: not its to wait for (nor can it).
os.register_at_fork(after_in_child=_EXITING.clear)


def still_exiting(proc: Any) -> bool:
    """Whether ``proc``, a worker ``close(wait=False)`` left, was not reaped yet (after
    :func:`reap_exiting` reaps one, its process object is closed)."""
    return any(p is proc for p, _ in _EXITING)


def reap_exiting(wait: bool = False, procs: Iterable[Any] | None = None) -> None:
    """Reap the workers ``close(wait=False)`` left (``procs``, or all): with ``wait``, wait for
    each until its deadline, then terminate, then kill it; without, only those that exited, and
    those past their deadline the same way."""
    chosen = None if procs is None else {id(p) for p in procs}
    for entry in list(_EXITING):
        proc, deadline = entry
        if chosen is not None and id(proc) not in chosen:
            continue
        if wait or proc.exitcode is not None or time.monotonic() >= deadline:
            _finish(proc, deadline)
            if entry in _EXITING:
                _EXITING.remove(entry)
            try:
                proc.close()  # its sentinel descriptor now, not when the object is collected
            except ValueError:  # pragma: no cover - SIGKILL did not end it within a second
                pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
