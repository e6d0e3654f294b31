"""The shared-memory SPSC ring: a stateful model test, real cross-process stress, wake-ups, cleanup.

Every test has a pytest-timeout deadline (dumping all stacks when hit); every child process is
forked through ``_fork`` which arms faulthandler, so a hung child prints its own stack and exits
instead of hanging the suite.
"""

from __future__ import annotations

import faulthandler
import glob
import mmap
import multiprocessing as mp
import os
import pickle
import random
import signal
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shardio import _atomics
from shardio.errors import (
    MessageInUseError,
    MessageTooLargeError,
    RingClosedError,
    RingCorruptError,
    RingFullError,
    RingNotFoundError,
    RingTimeoutError,
    ShardioError,
    ShmSpaceError,
    UsageError,
)
from shardio.ring import Message, Ring, check_shm_space, sweep_stale

pytestmark = pytest.mark.timeout(60)

CTX = mp.get_context("fork")
CHILD_DEADLINE = 50  # a hung child dumps its stack and exits before the test's own deadline
SHM = "/dev/shm"
_OFF_CONSUMER_WAITING = 448
_OFF_PRODUCER_WAITING = 384

# Pids whose /dev/shm segments this module is responsible for (itself and its children).
OUR_PIDS: set[int] = {os.getpid()}


def _shm_entries() -> set[str]:
    return set(glob.glob(os.path.join(SHM, "shardio-*")))


@pytest.fixture(scope="module", autouse=True)
def no_shm_left_behind() -> Any:
    before = _shm_entries()
    yield
    left = [p for p in _shm_entries() - before
            if int(os.path.basename(p).split("-")[1]) in OUR_PIDS]
    assert not left, f"ring files left in {SHM}: {left}"


def _child_main(target: Callable[..., None], args: tuple[Any, ...]) -> None:
    # sys.__stderr__: under capsys, sys.stderr has no file descriptor for faulthandler.
    faulthandler.dump_traceback_later(CHILD_DEADLINE, exit=True, file=sys.__stderr__)
    target(*args)


def _fork(target: Callable[..., None], *args: Any) -> Any:
    proc = CTX.Process(target=_child_main, args=(target, args), daemon=True)
    proc.start()
    OUR_PIDS.add(proc.pid)
    return proc


def _recv(ring: Ring, proc: Any, timeout: float = 20.0) -> Message:
    """recv() that fails fast, with the child's exit code, when the producing child died."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return ring.recv(timeout=0.5)
        except RingTimeoutError:
            if proc.exitcode is not None and proc.exitcode != 0:
                pytest.fail(f"producer child exited with {proc.exitcode} (its stderr is above)")
            if time.monotonic() > deadline:
                raise


def _join(proc: Any, timeout: float = 30.0) -> int:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"child {proc.pid} did not finish within {timeout} s (killed)")
    return proc.exitcode


def _addr(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


# --- the C atomics ---------------------------------------------------------------------------


def test_atomics_bounds_alignment_and_values() -> None:
    buf = mmap.mmap(-1, 4096)
    _atomics.store_u64(buf, 8, 2**64 - 1)
    assert _atomics.load_u64(buf, 8) == 2**64 - 1
    _atomics.store_u32(buf, 16, 2**32 - 1)
    assert _atomics.fetch_add_u32(buf, 16, 2) == 2**32 - 1
    assert _atomics.load_u32(buf, 16) == 1  # wraps modulo 2**32
    _atomics.fence()
    for bad in (4, 4092, 4096, -8):
        with pytest.raises(ValueError):
            _atomics.load_u64(buf, bad)
    with pytest.raises(ValueError):
        _atomics.store_u32(buf, 2, 0)
    with pytest.raises(OverflowError):
        _atomics.store_u32(buf, 16, 2**32)
    with pytest.raises(BufferError):
        _atomics.store_u64(bytes(16), 0, 1)  # read-only buffer
    t0 = time.monotonic()
    assert _atomics.futex_wait(buf, 16, 1, 0.05) is False  # timed out
    assert time.monotonic() - t0 >= 0.04
    assert _atomics.futex_wait(buf, 16, 7, None) is True  # value differs: EAGAIN, no sleep
    assert _atomics.futex_wake(buf, 16) == 0
    with pytest.raises(ValueError):
        _atomics.futex_wait(buf, 16, 1, -1.0)
    buf.close()


def test_futex_wait_runs_signal_handlers_and_clears_waiting_flag() -> None:
    class Interrupted(Exception):
        pass

    def handler(signum: int, frame: Any) -> None:
        raise Interrupted

    # SIGUSR1 aimed at this thread (SIGALRM belongs to pytest-timeout).
    old = signal.signal(signal.SIGUSR1, handler)
    ring = Ring.create(4096, unlink_now=True)
    timer = threading.Timer(0.2, signal.pthread_kill, (threading.get_ident(), signal.SIGUSR1))
    try:
        timer.start()
        with pytest.raises(Interrupted):
            ring.recv()  # asleep in futex_wait; EINTR must run the handler
        assert _atomics.load_u32(ring._mm, _OFF_CONSUMER_WAITING) == 0
    finally:
        timer.cancel()
        timer.join()
        signal.signal(signal.SIGUSR1, old)
        ring.close()


# --- stateful model --------------------------------------------------------------------------


class RingMachine(RuleBasedStateMachine):
    """Single-threaded producer and consumer against a model of head/tail/skip accounting.

    Sends never block: the model predicts exactly when the ring is too full and the test expects
    RingTimeoutError(timeout=0) then.  Held messages are re-checked when released, so a producer
    overwriting held data shows up as a content mismatch.
    """

    @initialize(capacity=st.sampled_from([128, 192, 320, 640, 1024, 4096]),
                unlink_now=st.booleans(), prefill=st.lists(st.floats(0, 1), max_size=8))
    def setup(self, capacity: int, unlink_now: bool, prefill: list[float]) -> None:
        self.ring = Ring.create(capacity, unlink_now=unlink_now)
        self.cap = capacity
        self.seq = 0
        self.head = 0
        self.tail = 0
        # Stream segments not yet passed by tail: [start, end, kind, released, payload].
        self.segments: deque[list[Any]] = deque()
        self.unread: deque[list[Any]] = deque()  # segments published but not yet received
        self.held: list[tuple[Message, bytes, list[Any]]] = []
        # Hypothesis may switch the send rule off for a whole run (swarm testing): start with
        # some messages so that such runs still exercise recv and out-of-order release.
        for fraction in prefill:
            self._send(int(fraction * (capacity - 64)), via_reserve=False)

    def teardown(self) -> None:
        ring = getattr(self, "ring", None)
        if ring is not None:
            path = ring.path
            ring.close()
            assert not os.path.exists(path)

    def _payload(self, size: int) -> bytes:
        self.seq += 1
        return random.Random(self.seq).randbytes(size)

    def _free(self) -> int:
        return self.cap - (self.head - self.tail)

    def _advance_tail(self) -> None:
        while self.segments and self.segments[0][3]:
            self.tail = self.segments.popleft()[1]

    @rule(data=st.data(), via_reserve=st.booleans())
    def send(self, data: st.DataObject, via_reserve: bool) -> None:
        maxmsg = self.cap - 64
        size = data.draw(st.one_of(
            st.just(0), st.integers(1, min(200, maxmsg)), st.integers(max(0, maxmsg - 130), maxmsg),
            st.integers(0, maxmsg), st.integers(maxmsg + 1, maxmsg + 100)), label="size")
        self._send(size, via_reserve)

    def _send(self, size: int, via_reserve: bool) -> None:
        maxmsg = self.cap - 64
        payload = self._payload(size)
        if size > maxmsg:
            with pytest.raises(MessageTooLargeError, match="capacity"):
                self.ring.send(payload, timeout=0)
            return
        record = 64 + (size + 63) // 64 * 64
        off = self.head % self.cap
        room = self.cap - off
        expect_ok = True
        if record > room:
            if self._free() < room:
                expect_ok = False
            else:  # the skip marker is published even if the record then does not fit
                event("wraparound: skip marker")
                seg = [self.head, self.head + room, "skip", False, None]
                self.segments.append(seg)
                self.unread.append(seg)
                self.head += room
        if expect_ok and self._free() < record:
            expect_ok = False
        if not expect_ok:
            event("ring full: send times out")
            with pytest.raises(RingTimeoutError):
                self.ring.send(payload, timeout=0)
            return
        if via_reserve:
            view = self.ring.reserve(size, timeout=0)
            assert len(view) == size and not view.readonly
            assert _addr(view) % 64 == 0 or size == 0
            view[:] = payload
            del view
            self.ring.commit()
        else:
            self.ring.send(payload, timeout=0)
        seg = [self.head, self.head + record, "msg", False, payload]
        self.segments.append(seg)
        self.unread.append(seg)
        self.head += record

    @rule(count=st.integers(1, 4))
    def recv(self, count: int) -> None:
        for _ in range(count):
            while self.unread and self.unread[0][2] == "skip":
                self.unread.popleft()[3] = True
            if not self.unread:
                with pytest.raises(RingTimeoutError):
                    self.ring.recv(timeout=0)
                self._advance_tail()  # recv consumed trailing skip markers
                return
            seg = self.unread.popleft()
            msg = self.ring.recv(timeout=0)
            self._advance_tail()
            assert (msg.start, msg.end) == (seg[0], seg[1])
            assert msg.view.readonly and bytes(msg.view) == seg[4]
            self.held.append((msg, seg[4], seg))
        if len(self.held) > 1:
            event("several messages held")

    @precondition(lambda self: bool(self.held))
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.one_of(st.just(len(self.held) - 1), st.integers(0, len(self.held) - 1)),
                      label="held index")
        if i:
            event("out-of-order release")
        msg, payload, seg = self.held.pop(i)
        assert bytes(msg.view) == payload, "held message overwritten before release"
        self.ring.release(msg)
        seg[3] = True
        self._advance_tail()

    @invariant()
    def accounting(self) -> None:
        if not hasattr(self, "ring"):
            return
        assert self.ring.held() == len(self.held)
        assert self.ring.held_bytes() == sum(len(p) for _, p, _ in self.held)
        assert self.ring.head == self.head
        assert self.ring.tail == self.tail
        assert 0 <= self.head - self.tail <= self.cap


RingMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=80, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestRingStateful = RingMachine.TestCase


# --- single-process API ----------------------------------------------------------------------


def test_message_too_large_names_capacity_and_max_message_fits() -> None:
    with Ring.create(1 << 16, unlink_now=True) as ring:
        assert ring.max_message == (1 << 16) - 64
        with pytest.raises(MessageTooLargeError, match=r"capacity>=\d+ \(ring_bytes\)") as ei:
            ring.send(bytes(ring.max_message + 1))
        assert isinstance(ei.value, ValueError) and isinstance(ei.value, ShardioError)
        big = os.urandom(ring.max_message)
        ring.send(big, timeout=0)
        msg = ring.recv(timeout=0)
        assert msg.view == big
        ring.release(msg)
        ring.send(big, timeout=0)  # wraps: needs the whole ring again, after a skip
        msg = ring.recv(timeout=0)
        assert msg.view == big and msg.start == 1 << 16
        ring.release(msg)


def test_usage_errors_and_abort() -> None:
    with Ring.create(4096, unlink_now=True) as ring:
        with pytest.raises(UsageError):
            ring.commit()
        ring.reserve(10)
        with pytest.raises(UsageError, match="commit"):
            ring.reserve(10)
        ring.abort()
        with pytest.raises(UsageError):
            ring.reserve(-1)
        with pytest.raises(UsageError):
            ring.recv(timeout=-1)
        with pytest.raises(UsageError):
            ring.send(np.arange(10)[::2])  # not contiguous
        ring.send(b"a")
        msg = ring.recv(timeout=0)
        ring.release(msg)
        with pytest.raises(UsageError, match="released twice"):
            ring.release(msg)
    with pytest.raises(UsageError):
        Ring.create(64)


def test_release_refuses_while_arrays_view_the_payload() -> None:
    with Ring.create(4096, unlink_now=True) as ring:
        ring.send(np.arange(16, dtype=np.float64))
        msg = ring.recv(timeout=0)
        arr = ring.array(msg).view(np.float64)
        assert arr.ctypes.data % 64 == 0 and not arr.flags.writeable
        assert arr.tolist() == list(range(16))
        with pytest.raises(MessageInUseError):
            ring.release(msg)
        assert ring.held() == 1
        del arr
        ring.release(msg)
        assert ring.held() == 0 and ring.tail == ring.head


def test_attach_by_path_pickle_and_bad_files(tmp_path: Path) -> None:
    ring = Ring.create(4096, directory=tmp_path)
    try:
        other = Ring.attach(ring.path)
        ring.send(b"via the file")
        msg = other.recv(timeout=1)
        assert msg.view == b"via the file"
        other.release(msg)
        assert ring.tail == ring.head
        clone = pickle.loads(pickle.dumps(ring))
        assert clone.path == ring.path and clone.capacity == ring.capacity
        clone.close()  # not the creator: closes the ring but does not unlink it
        assert os.path.exists(ring.path) and ring.closed
        other.close()
    finally:
        ring.close()
    assert not os.path.exists(ring.path)
    with pytest.raises(RingNotFoundError, match="does not exist") as ei:
        Ring.attach(ring.path)
    assert isinstance(ei.value, FileNotFoundError)
    junk = tmp_path / "junk"
    junk.write_bytes(b"x" * 4096)
    with pytest.raises(RingCorruptError, match="magic"):
        Ring.attach(junk)
    with Ring.create(4096, unlink_now=True) as anon, pytest.raises(UsageError, match="fork"):
        pickle.dumps(anon)


def test_closed_ring_drains_then_raises_and_refuses_sends(tmp_path: Path) -> None:
    with Ring.create(4096, directory=tmp_path) as ring:
        for i in range(3):
            ring.send(bytes([i]) * 10)
        peer = Ring.attach(ring.path)
        peer.close()  # the other side closes
        assert ring.closed and os.path.exists(ring.path)  # only the creator unlinks
        with pytest.raises(RingClosedError, match="stop sending"):
            ring.send(b"late")
        for i in range(3):
            msg = ring.recv(timeout=0)
            assert msg.view == bytes([i]) * 10
            ring.release(msg)
        with pytest.raises(RingClosedError) as ei:
            ring.recv(timeout=0)
        assert isinstance(ei.value, EOFError)
    assert os.listdir(tmp_path) == []
    with pytest.raises(RingClosedError):
        ring.recv()  # closed locally
    ring.release(msg)  # harmless after close


# --- cross-process ---------------------------------------------------------------------------


def _stress_producer(ring: Ring, sizes: list[int], base: bytes) -> None:
    ring.become_producer()
    mv = memoryview(base)
    for i, n in enumerate(sizes):
        k = (i * 7919) % (len(base) - n + 1)
        if n >= 8 and i % 2:
            view = ring.reserve(n)
            view[:8] = i.to_bytes(8, "little")
            view[8:] = mv[k + 8:k + n]
            del view
            ring.commit()
        else:
            ring.send(mv[k:k + n])
    ring.close()


def test_stress_many_small_and_some_huge_messages_across_processes() -> None:
    rng = random.Random(7)
    sizes = [rng.randint(0, 256) for _ in range(200_000)]
    for i in range(4000, 200_000, 20_000):
        sizes[i] = rng.randint(3 << 20, 8 << 20)  # several MB each, in a 16 MiB ring
    base = rng.randbytes(9 << 20)
    ring = Ring.create(16 << 20, unlink_now=True)
    mv = memoryview(base)
    expected = []
    for i, n in enumerate(sizes):
        k = (i * 7919) % (len(base) - n + 1)
        if n >= 8 and i % 2:
            expected.append(zlib.crc32(mv[k + 8:k + n], zlib.crc32(i.to_bytes(8, "little"))))
        else:
            expected.append(zlib.crc32(mv[k:k + n]))
    proc = _fork(_stress_producer, ring, sizes, base)
    try:
        held: list[tuple[int, Message]] = []
        got = 0
        while True:
            try:
                msg = _recv(ring, proc)
            except RingClosedError:
                break
            i = got
            got += 1
            assert msg.nbytes == sizes[i], f"message {i}: {msg.nbytes} bytes, want {sizes[i]}"
            assert zlib.crc32(msg.view) == expected[i], f"message {i}: checksum mismatch"
            held.append((i, msg))
            # Hold a few and release them out of order; let go of huge ones soon.
            if len(held) > rng.randint(0, 8) or msg.nbytes > 1 << 20:
                for j, m in held:
                    assert zlib.crc32(m.view) == expected[j], f"held message {j} overwritten"
                rng.shuffle(held)
                k = rng.randint(1, len(held))
                for _, m in held[:k]:
                    ring.release(m)
                del held[:k]
        assert got == len(sizes)
        for _, m in held:
            ring.release(m)
        assert ring.tail == ring.head
        assert _join(proc) == 0
    finally:
        proc.kill()
        ring.close()


def _send_after(ring: Ring, delay: float, data: bytes) -> None:
    ring.become_producer()
    time.sleep(delay)
    ring.send(data)


def test_consumer_sleeps_until_producer_sends() -> None:
    with Ring.create(1 << 16, unlink_now=True) as ring:
        proc = _fork(_send_after, ring, 0.5, b"wake up")
        cpu0, t0 = time.process_time(), time.monotonic()
        msg = ring.recv(timeout=20)
        waited, cpu = time.monotonic() - t0, time.process_time() - cpu0
        assert msg.view == b"wake up"
        assert 0.4 <= waited < 10
        assert cpu < 0.1, f"consumer burned {cpu:.3f} s of CPU while waiting {waited:.2f} s"
        assert _atomics.load_u32(ring._mm, _OFF_CONSUMER_WAITING) == 0
        ring.release(msg)
        assert _join(proc) == 0


def _fill_then_block(ring: Ring, conn: Any) -> None:
    ring.become_producer()
    n = 0
    while True:
        try:
            ring.send(b"x" * 1000, timeout=0)
            n += 1
        except RingTimeoutError:
            break
    conn.send(("full", n))
    cpu0, t0 = time.process_time(), time.monotonic()
    ring.send(b"last" * 250, timeout=20)
    conn.send(("sent", time.monotonic() - t0, time.process_time() - cpu0))


def test_populate_maps_every_page_up_front() -> None:
    """Ring.populate (a producer, before its first pass round the ring): afterwards writing
    every page of the ring faults on none of them (here each fault costs ~2 us a page)."""
    import resource

    with Ring.create(4 << 20, unlink_now=True) as ring:
        assert ring.populate()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        view = ring.reserve(ring.max_message)
        for off in range(0, len(view), 4096):
            view[off] = 1
        touched = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        ring.abort()
        assert touched < 64, f"{touched} page faults writing a populated ring of 1024 pages"


def test_producer_sleeps_on_full_ring_until_release() -> None:
    with Ring.create(1 << 14, unlink_now=True) as ring:
        parent, child = CTX.Pipe()
        proc = _fork(_fill_then_block, ring, child)
        assert parent.poll(20)
        tag, n = parent.recv()
        assert tag == "full" and n == (1 << 14) // 1088
        msgs = [ring.recv(timeout=5) for _ in range(n)]
        time.sleep(0.5)
        assert not parent.poll(0), "the producer sent into a full ring"
        ring.release(msgs[3])  # out of order: no space yet, the producer must keep sleeping
        time.sleep(0.2)
        assert not parent.poll(0)
        ring.release(msgs[0])  # the first record is free: tail moves, the producer wakes
        assert parent.poll(20)
        tag, waited, cpu = parent.recv()
        assert tag == "sent" and waited >= 0.6
        assert cpu < 0.1, f"producer burned {cpu:.3f} s of CPU while blocked {waited:.2f} s"
        for m in msgs[1:3] + msgs[4:]:
            ring.release(m)
        assert ring.recv(timeout=5).view == b"last" * 250
        assert _join(proc) == 0


def _overfill_after(ring: Ring, conn: Any, delay: float, count: int) -> None:
    """Send ``count`` messages of 1000 bytes, the last of which does not fit until the consumer
    gives room back, and that one ``delay`` s after the others (the consumer, which holds them
    all, is asleep in recv by then)."""
    ring.become_producer()
    for k in range(count):
        if k == count - 1:
            time.sleep(delay)
        ring.send(bytes([k]) * 1000, timeout=20)
    conn.send("sent")


def test_recv_until_full_stops_when_the_producer_waits_for_space() -> None:
    """The consumer holds every message and waits for the next: with until_full it is told
    (RingFullError), whether the producer was already waiting when it began to wait or came to
    wait while it slept (the producer's nudge), never after its timeout; once it gives room
    back the producer goes on.  Without until_full it waits out its timeout as ever."""
    with Ring.create(1 << 14, unlink_now=True) as ring:
        per_ring = (1 << 14) // 1088  # records of 1000 bytes that fit
        parent, child = CTX.Pipe()
        proc = _fork(_overfill_after, ring, child, 0.0, per_ring + 1)
        held = [ring.recv(timeout=20) for _ in range(per_ring)]
        deadline = time.monotonic() + 20
        while not ring.producer_waiting:  # it waits for the room of message per_ring + 1
            assert time.monotonic() < deadline, "the producer never waited for space"
            time.sleep(0.01)
        with pytest.raises(RingTimeoutError) as plain:
            ring.recv(timeout=0.2)
        assert type(plain.value) is RingTimeoutError
        t0 = time.monotonic()
        with pytest.raises(RingFullError):
            ring.recv(timeout=20, until_full=True)
        assert time.monotonic() - t0 < 5
        ring.release(held.pop(0))
        assert ring.recv(timeout=20, until_full=True).view == bytes([per_ring]) * 1000
        assert parent.poll(20) and parent.recv() == "sent"
        assert _join(proc) == 0

        # The consumer sleeps first; the producer runs out of room 0.5 s later and nudges it.
        for m in held:
            ring.release(m)
        ring.release(ring.held_messages()[0])
        proc = _fork(_overfill_after, ring, child, 0.5, per_ring + 1)
        t0 = time.monotonic()
        held = []
        with pytest.raises(RingFullError):
            while True:
                held.append(ring.recv(timeout=30, until_full=True))
        assert time.monotonic() - t0 < 20, "told only after the timeout: no nudge"
        assert len(held) == per_ring
        for m in held:
            ring.release(m)
        assert ring.recv(timeout=20).view == bytes([per_ring]) * 1000
        assert parent.poll(20) and parent.recv() == "sent"
        assert _join(proc) == 0


def _close_after(ring: Ring, delay: float) -> None:
    time.sleep(delay)
    ring.close()


def test_close_wakes_a_blocked_consumer() -> None:
    with Ring.create(4096, unlink_now=True) as ring:
        proc = _fork(_close_after, ring, 0.3)
        t0 = time.monotonic()
        with pytest.raises(RingClosedError):
            ring.recv()
        assert time.monotonic() - t0 < 10
        assert _join(proc) == 0


def _blocked_send_expect_closed(ring: Ring) -> None:
    ring.become_producer()
    ring.send(bytes(ring.max_message), timeout=0)
    try:
        ring.send(b"no room", timeout=30)
    except RingClosedError:
        os._exit(7)
    os._exit(1)


def test_close_wakes_a_blocked_producer() -> None:
    with Ring.create(4096, unlink_now=True) as ring:
        proc = _fork(_blocked_send_expect_closed, ring)
        while ring.head == 0:
            time.sleep(0.01)
        time.sleep(0.3)
        t0 = time.monotonic()
        ring.close()
        assert _join(proc) == 7
        assert time.monotonic() - t0 < 10


def test_timeouts() -> None:
    with Ring.create(4096, unlink_now=True) as ring:
        t0 = time.monotonic()
        with pytest.raises(RingTimeoutError, match="within 0.2 s") as ei:
            ring.recv(timeout=0.2)
        assert 0.15 <= time.monotonic() - t0 < 5
        assert isinstance(ei.value, TimeoutError)
        ring.send(bytes(ring.max_message))
        t0 = time.monotonic()
        with pytest.raises(RingTimeoutError, match="release"):
            ring.send(b"more", timeout=0.2)
        assert 0.15 <= time.monotonic() - t0 < 5
        assert _atomics.load_u32(ring._mm, _OFF_PRODUCER_WAITING) == 0


def _use_inherited(ring: Ring) -> None:
    ring.become_producer()
    ring.send(b"from the child")


def test_unlink_now_leaves_nothing_and_children_share_the_mapping(tmp_path: Path) -> None:
    for directory in (tmp_path, None):
        before = set(os.listdir(directory or SHM))
        ring = Ring.create(1 << 16, directory=directory, unlink_now=True)
        assert set(os.listdir(directory or SHM)) == before and ring.unlinked
        proc = _fork(_use_inherited, ring)
        assert _recv(ring, proc).view == b"from the child"
        assert _join(proc) == 0
        ring.close()
    assert os.listdir(tmp_path) == []


def _create_and_hang(directory: str, conn: Any) -> None:
    ring = Ring.create(4096, directory=directory)
    conn.send(ring.path)
    time.sleep(60)


def test_sweep_stale_removes_rings_of_killed_creators_only(tmp_path: Path) -> None:
    parent, child = CTX.Pipe()
    proc = _fork(_create_and_hang, str(tmp_path), child)
    assert parent.poll(20)
    dead_path = parent.recv()
    assert os.path.basename(dead_path) == f"shardio-{proc.pid}-{os.path.basename(dead_path)[-16:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)  # reaped: the pid no longer exists
    live = Ring.create(4096, directory=tmp_path)
    unrelated = tmp_path / "shardio-notaring"
    unrelated.write_bytes(b"")
    # A name whose pid is alive but belongs to a process started after the file: pid reuse.
    reused = tmp_path / f"shardio-{os.getpid()}-{'0' * 16}"
    reused.write_bytes(b"")
    day_ago = time.time() - 86400
    os.utime(reused, (day_ago, day_ago))
    try:
        removed = sweep_stale(tmp_path)
        assert sorted(removed) == sorted([dead_path, str(reused)])
        assert os.path.exists(live.path) and unrelated.exists()
        assert sweep_stale(tmp_path) == []
    finally:
        live.close()
    assert sorted(os.listdir(tmp_path)) == ["shardio-notaring"]


def test_check_shm_space(tmp_path: Path) -> None:
    with pytest.raises(ShmSpaceError, match=r"ring_bytes/num_workers.*shm_dir=") as ei:
        check_shm_space(1 << 60)
    assert "/dev/shm" in str(ei.value) and isinstance(ei.value, OSError)
    check_shm_space(1 << 20)
    with pytest.raises(UsageError, match="does not exist"):
        check_shm_space(1, tmp_path / "missing")
    # A fake cgroup v2 tree: 64 MiB limit.  It binds /dev/shm (tmpfs) but not a disk directory.
    fake = tmp_path / "cg"
    fake.mkdir()
    (fake / "memory.max").write_text(f"{64 << 20}\n")
    (fake / "memory.current").write_text(f"{8 << 20}\n")
    (fake / "memory.stat").write_text(f"anon 1\ninactive_file {4 << 20}\nactive_file 0\n")
    with pytest.raises(ShmSpaceError, match=r"cgroup allows only 60 MiB more"):
        check_shm_space(100 << 20, SHM, cgroup_root=str(fake))
    check_shm_space(50 << 20, SHM, cgroup_root=str(fake))
    if os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize > 200 << 20:
        from shardio.shmspace import _fs_type

        if _fs_type(str(tmp_path)) not in ("tmpfs", "ramfs"):
            check_shm_space(100 << 20, tmp_path, cgroup_root=str(fake))
    (fake / "memory.max").write_text("max\n")
    check_shm_space(100 << 20, SHM, cgroup_root=str(fake))
    # cgroup v1 layout.
    v1 = tmp_path / "cg1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(f"{32 << 20}\n")
    (v1 / "memory.usage_in_bytes").write_text("0\n")
    with pytest.raises(ShmSpaceError, match="memory.limit_in_bytes"):
        check_shm_space(40 << 20, SHM, cgroup_root=str(tmp_path / "cg1"))


def test_small_shm_directory_fails_at_create_with_the_fix(small_tmpfs: Path) -> None:
    first = Ring.create(1 << 20, directory=small_tmpfs)  # pre-allocated: really takes 1 MiB
    try:
        with pytest.raises(ShmSpaceError, match=rf"{small_tmpfs} has .* free; lower ring_bytes"):
            Ring.create(1536 << 10, directory=small_tmpfs)
        assert os.listdir(small_tmpfs) == [os.path.basename(first.path)]
    finally:
        first.close()
    assert os.listdir(small_tmpfs) == []


def _throughput_producer(ring: Ring, count: int, size: int) -> None:
    ring.become_producer()
    src = np.frombuffer(os.urandom(size), dtype=np.uint8)
    for _ in range(count):
        view = ring.reserve(size)
        np.frombuffer(view, dtype=np.uint8)[:] = src
        del view
        ring.commit()


def test_throughput_1mib_messages_across_processes(capsys: pytest.CaptureFixture[str]) -> None:
    count, size = 1000, 1 << 20
    results = []
    for mode in ("uses each payload in place", "copies each payload out"):
        with Ring.create(16 << 20, unlink_now=True) as ring:
            t0 = time.perf_counter()
            proc = _fork(_throughput_producer, ring, count, size)
            total = 0
            for _ in range(count):
                msg = _recv(ring, proc)
                if mode == "copies each payload out":
                    total += len(bytes(msg.view))
                else:
                    total += msg.nbytes
                ring.release(msg)
            elapsed = time.perf_counter() - t0
            assert _join(proc) == 0 and total == count * size
        results.append(f"{total / elapsed / 1e6:.0f} MB/s when the consumer {mode}")
    with capsys.disabled():
        print(f"\n[ring throughput] {count} x 1 MiB messages, producer process writes each into "
              f"the ring, consumer in another process: {'; '.join(results)}", file=sys.stderr)


def test_ring_module_has_no_locks() -> None:
    import shardio.ring as ring_module

    src = Path(ring_module.__file__).read_text()
    for forbidden in ("multiprocessing", "threading", "Lock(", "Semaphore", "Condition", "Pipe("):
        assert forbidden not in src, forbidden


def _fd_producer(sock: Any, count: int) -> None:
    """A process forked before the ring existed: receive its descriptor, reserve, produce."""
    import socket

    _msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 1)
    ring = Ring.from_fd(fds[0], reserve=True)
    os.close(fds[0])
    ring.become_producer()
    for i in range(count):
        ring.send(i.to_bytes(4, "little") * (1000 + i), timeout=CHILD_DEADLINE)


def test_ring_handed_over_as_a_descriptor_to_a_process_forked_before_it() -> None:
    """create(keep_fd=True, reserve=False, unlink_now=True): no name on disk, nothing
    allocated yet; the descriptor goes over a Unix socket (SCM_RIGHTS) to a child forked
    earlier, which reserves the pages (from_fd(reserve=True)) and produces; the creator
    consumes every message."""
    import socket

    parent_end, child_end = socket.socketpair()
    proc = CTX.Process(target=_fd_producer, args=(child_end, 50))
    proc.start()
    before = _shm_entries()
    ring = Ring.create(1 << 20, unlink_now=True, keep_fd=True, reserve=False)
    try:
        assert ring.fd is not None and _shm_entries() == before  # unlinked at once
        st_blocks = os.fstat(ring.fd).st_blocks
        socket.send_fds(parent_end, [b"R"], [ring.fd])
        ring.close_fd()
        assert ring.fd is None
        for i in range(50):
            msg = ring.recv(timeout=CHILD_DEADLINE)
            assert bytes(msg.view) == i.to_bytes(4, "little") * (1000 + i)
            ring.release(msg)
        proc.join(CHILD_DEADLINE)
        assert proc.exitcode == 0
        assert st_blocks < 64  # the creator had reserved nothing (the child did)
    finally:
        ring.close()
        parent_end.close()
        child_end.close()


def test_descriptor_handover_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    import shardio.ring

    with pytest.raises(UsageError, match="keep_fd=True"):
        Ring.create(1 << 16, unlink_now=True, reserve=False)
    ring = Ring.create(1 << 16, unlink_now=True, keep_fd=True, reserve=False)
    try:
        def full(fd: int, size: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(shardio.ring, "_reserve", full)
        with pytest.raises(ShmSpaceError, match="shm_dir="):
            Ring.from_fd(ring.fd, reserve=True, directory="/dev/shm")  # type: ignore[arg-type]
        monkeypatch.undo()
        fd = ring.fd
        assert fd is not None
        other = Ring.from_fd(fd, reserve=True)
        assert other.capacity == ring.capacity and os.fstat(fd).st_blocks > 0
        other.close()
    finally:
        ring.close()
    assert ring.fd is None  # close() closes a kept descriptor too


def test_reserve_pages_through_the_kept_descriptor(monkeypatch: pytest.MonkeyPatch) -> None:
    """reserve_pages() allocates a reserve=False ring's memory in place (what a restarted pool
    worker does with the ring it inherits), again at no harm, typed when it does not fit."""
    import errno

    import shardio.ring

    ring = Ring.create(1 << 20, unlink_now=True, keep_fd=True, reserve=False)
    try:
        assert ring.fd is not None
        assert os.fstat(ring.fd).st_blocks < 64
        ring.reserve_pages()
        blocks = os.fstat(ring.fd).st_blocks
        assert blocks * 512 >= (1 << 20)
        ring.reserve_pages()  # already allocated: nothing changes
        assert os.fstat(ring.fd).st_blocks == blocks

        def full(fd: int, size: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(shardio.ring, "_reserve", full)
        with pytest.raises(ShmSpaceError, match=r"in /dev/shm: .*shm_dir="):
            ring.reserve_pages()
        monkeypatch.undo()
        ring.close_fd()
        with pytest.raises(UsageError, match="keep_fd=True"):
            ring.reserve_pages()
    finally:
        ring.close()


def test_file_bytes_and_a_space_check_done_by_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ring.file_bytes is what a ring takes (header + capacity rounded to 64), what a pool
    checks for all its rings at once; create(space_checked=True) then skips its own check."""
    import shardio.ring

    assert Ring.file_bytes(1000) == 512 + 1024 and Ring.file_bytes(1024) == 512 + 1024
    for bad in (100, True, 1.5, "1MB"):
        with pytest.raises(UsageError, match="integer >= 128"):
            Ring.file_bytes(bad)  # type: ignore[arg-type]

    def no_room(nbytes: int, directory: Any = None) -> None:
        raise ShmSpaceError(f"no room for {nbytes}")

    monkeypatch.setattr(shardio.ring, "check_shm_space", no_room)
    with pytest.raises(ShmSpaceError, match=f"no room for {512 + 4096}"):
        Ring.create(4096, unlink_now=True)
    ring = Ring.create(4096, unlink_now=True, space_checked=True)
    try:
        assert ring.capacity == 4096
    finally:
        ring.close()


def test_detach_keeps_a_held_message_intact_and_the_ring_flowing() -> None:
    """A consumer keeps message 0 for good: detach() leaves its arrays, tensors and view
    reading the same bytes while the producer goes round the ring many times over its old
    place, and gives its space back (without it the ring would stay full: the tail stops at the
    oldest held message).  A neighbour received before the detach reads right through both its
    view and a later array(); releasing the detached message does nothing."""
    import torch

    ring = Ring.create(64 << 10, unlink_now=True, keep_fd=True)
    try:
        ring.send(b"A" * 5000)
        ring.send(b"B" * 7000)
        first = ring.recv(timeout=1)
        second = ring.recv(timeout=1)
        arr = ring.array(first, writable=True)
        tensor = torch.from_numpy(arr[100:4100])
        view = first.view
        with pytest.raises(RingTimeoutError):  # the two held messages block a full lap
            for _ in range(20):
                ring.send(b"x" * 9000, timeout=0)
        while True:  # drain what fitted
            try:
                ring.release(ring.recv(timeout=0))
            except RingTimeoutError:
                break
        assert ring.detach([first]) >= 5000
        assert first.detached and ring.held_messages() == [second]
        assert bytes(second.view) == b"B" * 7000
        assert bytes(ring.array(second)) == b"B" * 7000
        ring.release(second)
        for i in range(200):  # ~28 laps of the ring, over first's old place
            payload = bytes([i % 251]) * (3000 + 37 * i)
            ring.send(payload, timeout=1)
            msg = ring.recv(timeout=1)
            assert bytes(msg.view) == payload
            ring.release(msg)
        assert bytes(arr) == b"A" * 5000 and bytes(view) == b"A" * 5000
        assert bool((tensor == ord("A")).all())
        ring.release(first)  # a no-op now
        with pytest.raises(UsageError, match="detached"):
            ring.array(first)
        with pytest.raises(UsageError, match="not held"):
            ring.detach([first])
    finally:
        ring.close()
    plain = Ring.create(1 << 16, unlink_now=True)
    try:
        plain.send(b"y" * 100)
        with pytest.raises(UsageError, match="keep_fd=True"):
            plain.detach([plain.recv(timeout=1)])
    finally:
        plain.close()


def test_detach_works_on_the_mapping_a_message_was_received_through() -> None:
    """After a detach the ring reads through a fresh mapping; a message received before it
    (and its arrays, made later) still lives in the old one, which is where a later detach must
    make its pages private: otherwise the producer's next laps overwrite what it views."""
    ring = Ring.create(64 << 10, unlink_now=True, keep_fd=True)
    try:
        for fill in b"ABC":
            ring.send(bytes([fill]) * 6000)
        a, b = ring.recv(timeout=1), ring.recv(timeout=1)
        arr_b = ring.array(b)
        assert ring.detach([b]) >= 6000  # b's mapping was the current one: the ring remaps
        c = ring.recv(timeout=1)  # through the fresh mapping
        arr_a = ring.array(a, writable=True)  # made after the remap, from a's own mapping
        arr_c = ring.array(c)
        assert ring.detach([a, c]) >= 12000
        assert ring.held_messages() == []
        for i in range(150):  # laps over all three places
            ring.send(bytes([i % 200]) * (2000 + 53 * i), timeout=1)
            ring.release(ring.recv(timeout=1))
        assert bytes(arr_a) == b"A" * 6000 and bytes(a.view) == b"A" * 6000
        assert bytes(arr_b) == b"B" * 6000 and bytes(arr_c) == b"C" * 6000
    finally:
        ring.close()


def test_detach_that_fails_half_way_keeps_the_ring_consistent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The page swap fails on the second of two messages (ENOMEM): the first is detached, the
    second still held (release() then works as usual), and later messages read right."""
    import errno

    import shardio.ring

    real, calls = shardio.ring._privatize, []

    def second_fails(buf: Any, off: int, n: int) -> int:
        calls.append(off)
        if len(calls) == 2:
            raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))
        return int(real(buf, off, n))

    monkeypatch.setattr(shardio.ring, "_privatize", second_fails)
    ring = Ring.create(64 << 10, unlink_now=True, keep_fd=True)
    try:
        ring.send(b"A" * 6000)
        ring.send(b"B" * 6000)
        a, b = ring.recv(timeout=1), ring.recv(timeout=1)
        arr_a = ring.array(a)
        with pytest.raises(OSError, match="Cannot allocate memory"):
            ring.detach([a, b])
        assert a.detached and not b.detached and ring.held_messages() == [b]
        ring.release(b)
        for i in range(60):
            ring.send(bytes([i]) * 5000, timeout=1)
            msg = ring.recv(timeout=1)
            assert bytes(msg.view) == bytes([i]) * 5000
            ring.release(msg)
        assert bytes(arr_a) == b"A" * 6000
    finally:
        ring.close()


def test_detach_of_spans_keeps_only_their_pages() -> None:
    """detach(msgs, ranges): only the pages holding the given spans become private (a loop that
    keeps the labels of a batch keeps a page, not the batch); the rest of the message goes back
    to the producer and is overwritten by its next laps."""
    ring = Ring.create(64 << 10, unlink_now=True, keep_fd=True)
    try:
        ring.send(b"A" * 20000)
        msg = ring.recv(timeout=1)
        arr = ring.array(msg)
        span = (8192 + 100, 50)
        assert ring.detach([msg], [[span]]) <= 2 * 4096
        for i in range(40):
            ring.send(bytes([i + 1]) * 9000, timeout=1)
            ring.release(ring.recv(timeout=1))
        off, n = span
        assert bytes(arr[off:off + n]) == b"A" * n
        assert bytes(arr[:4096]) != b"A" * 4096  # not kept: reused by the producer
        with pytest.raises(UsageError, match="not inside"):
            ring.send(b"B" * 100, timeout=1)
            other = ring.recv(timeout=1)
            ring.detach([other], [[(50, 100)]])
    finally:
        ring.close()


def test_retired_mappings_count_the_old_mappings_still_viewed() -> None:
    """A detach of a message received through the current mapping maps the ring afresh; the old
    mapping counts in retired_mappings() while anything views it, and not after."""
    import gc

    ring = Ring.create(64 << 10, unlink_now=True, keep_fd=True)
    try:
        ring.send(b"A" * 5000)
        msg = ring.recv(timeout=1)
        arr = ring.array(msg)
        assert ring.retired_mappings() == 0
        ring.detach([msg])
        assert ring.retired_mappings() == 1
        del arr, msg
        gc.collect()
        assert ring.retired_mappings() == 0
    finally:
        ring.close()


def test_commit_publishes_only_the_bytes_asked_for() -> None:
    """commit(n) of a larger reservation publishes n bytes; the rest of the reservation goes
    back to the producer (the next message starts right after the record of n bytes)."""
    ring = Ring.create(64 << 10, unlink_now=True)
    try:
        view = ring.reserve(40000, timeout=0)
        view[:10] = b"0123456789"
        with pytest.raises(UsageError, match="reservation of 40000"):
            ring.commit(40001)
        ring.commit(10)
        assert ring.head == 64 + 64  # record header + 10 bytes padded to 64
        msg = ring.recv(timeout=1)
        assert bytes(msg.view) == b"0123456789"
        ring.release(msg)
        for i in range(40):  # round the ring several times: the space came back
            view = ring.reserve(30000, timeout=1)
            view[:5] = bytes([i]) * 5
            ring.commit(5 + i)
            msg = ring.recv(timeout=1)
            assert bytes(msg.view)[:5] == bytes([i]) * 5 and msg.nbytes == 5 + i
            ring.release(msg)
    finally:
        ring.close()


def test_keep_written_keeps_what_the_producer_still_views() -> None:
    """A producer that handed views of its reservation to other code (a worker reading samples
    into it) and finds one still alive after the message is built: keep_written() makes those
    pages private to the producer, so the view keeps its bytes while the ring goes round many
    times, and the consumer receives every message intact.  Without it the view would show
    later messages' bytes."""
    ring = Ring.create(64 << 10, unlink_now=True, keep_fd=True)
    try:
        view = ring.reserve(9000, timeout=0)
        mm, off = ring.reserved_at()
        view[:] = b"K" * 9000
        kept = np.frombuffer(view, dtype=np.uint8)[1000:5000]  # what user code held on to
        assert ring.keep_written([(mm, off, 9000)]) >= 9000
        ring.commit()
        msg = ring.recv(timeout=1)
        assert bytes(msg.view) == b"K" * 9000
        ring.release(msg)
        for i in range(100):  # ~14 laps over the kept message's place
            payload = bytes([i % 251]) * (4000 + 61 * i)
            view = ring.reserve(len(payload), timeout=1)
            view[:] = payload
            ring.commit()
            msg = ring.recv(timeout=1)
            assert bytes(msg.view) == payload
            ring.release(msg)
        assert bytes(kept) == b"K" * 4000
        with pytest.raises(UsageError, match="reserved_at"):
            ring.reserved_at()
    finally:
        ring.close()
    plain = Ring.create(1 << 16, unlink_now=True)
    try:
        plain.reserve(100, timeout=0)
        with pytest.raises(UsageError, match="descriptor"):
            plain.keep_written([(*plain.reserved_at(), 100)])
    finally:
        plain.close()


def test_a_producer_that_only_looks_is_not_waiting() -> None:
    """reserve(timeout=0) on a full ring fails without counting as a producer waiting for
    space: a consumer asking recv(until_full=True) is not told the ring is full (a worker that
    tries to claim room for its next batch must not make main move the batches it keeps)."""
    ring = Ring.create(64 << 10, unlink_now=True)
    try:
        held = []
        while True:
            try:
                ring.send(b"h" * 9000, timeout=0)
            except RingTimeoutError:
                break
            held.append(ring.recv(timeout=1))
        # As if the consumer were asleep in recv(): a waiting producer would bump data_seq
        # (offset 256, see the layout) to nudge it; one that only looks does not.
        mm = ring._open()
        _atomics.store_u32(mm, 448, 1)
        seq = _atomics.load_u32(mm, 256)
        with pytest.raises(RingTimeoutError):
            ring.reserve(9000, timeout=0)
        assert _atomics.load_u32(mm, 256) == seq and not ring.producer_waiting
        with pytest.raises(RingTimeoutError):
            ring.reserve(9000, timeout=0.01)
        assert _atomics.load_u32(mm, 256) != seq  # a real wait nudges
        _atomics.store_u32(mm, 448, 0)
        for msg in held:
            ring.release(msg)
        assert bytes(ring.reserve(9000, timeout=0)[:1]) in (b"h", b"\0")
    finally:
        ring.close()
