"""``WorkerPool`` never hangs on its own control traffic, and generations and threads behave.

Checked against DESIGN.md §3 "Concurrency" ("never a hang") and the protocol in
``shardio/pool.py`` (*Protocol*, *Stuck start*, *Generations*, *Failure handling*):

* starting an epoch never blocks main, however long the epoch (a 60,000-step epoch, or a step
  list with no arithmetic runs at all), while a worker is blocked on its spill pipe or stuck
  inside ``fork``: only main can unblock either;
* an iterator superseded by a newer one raises ``UsageError`` instead of waiting forever, and
  leaves the newer one intact;
* workers forked by a thread that then exits live on (``PR_SET_PDEATHSIG`` fires on the forking
  *thread*), and still go away when main dies.

Every test has a deadline: pytest-timeout dumps every thread's stack when it hits it, and the
tests that could block main inside a system call also run under :func:`deadline`, which dumps
the stacks and kills the pool's workers (that unblocks main) so the test fails instead of hanging.
"""

from __future__ import annotations

import faulthandler
import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

import shardio.pool
from shardio import ShardDataset, ShardLoader
from shardio._tree import plan_tree, read_tree
from shardio.errors import UsageError
from shardio.pool import PoolOptions, WorkerPool
from tests.test_dataset import pack_text
from tests.test_loader import wait_gone

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
RING = 1 << 20
BIG = 2 << 20  # larger than RING: always goes through the spill pipe
FAST = {"poll_interval": 0.05}


# --- helpers ---------------------------------------------------------------------------------
def platform_libc() -> str:
    import platform

    return platform.libc_ver()[0]


def live_children() -> list[int]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


def our_rings() -> set[str]:
    pat = re.compile(rf"shardio-{os.getpid()}-[0-9a-f]{{16}}")
    return {n for n in os.listdir(SHM) if pat.fullmatch(n)}


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    """No ring file in /dev/shm and no live worker process survives a test."""
    rings, procs = our_rings(), set(live_children())
    yield
    assert our_rings() - rings == set(), "shared memory left behind in /dev/shm"
    assert wait_gone([p for p in live_children() if p not in procs], 5.0) == [], \
        "worker processes left alive"


@contextmanager
def deadline(seconds: float, pool: WorkerPool) -> Iterator[None]:
    """Fail (not hang) if the block takes over ``seconds``: dump every thread's stack and
    SIGKILL the pool's workers, which unblocks a main stuck on one of their pipes."""
    done, expired = threading.Event(), threading.Event()

    def watch() -> None:
        if done.wait(seconds):
            return
        expired.set()
        print(f"--- deadline of {seconds} s hit; stacks:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for pid in pool.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
    assert not expired.is_set(), f"blocked for over {seconds} s (a hang)"


class BigStepJob:
    """Batches of 64 bytes filled with ``step % 256``; step ``big`` is larger than the ring."""

    def __init__(self, big: int) -> None:
        self.big = big

    def begin(self, spec: Any) -> None:
        pass

    def produce(self, step: int) -> tuple[Any, list[float]]:
        n = BIG if step == self.big else 64
        return plan_tree({"x": np.full(n, step % 256, np.uint8)}), [0.0] * 6


def value(ring: Any, msg: Any) -> tuple[int, int]:
    """(length, fill byte) of a message of :class:`BigStepJob`; releases it."""
    x = read_tree(np.frombuffer(msg.view, np.uint8))["x"]
    out = (len(x), int(x[0]))
    del x
    if ring is not None:
        ring.release(msg)
    return out


@pytest.fixture
def make_pool() -> Iterator[Callable[..., WorkerPool]]:
    made: list[WorkerPool] = []

    def make(job: Any, **options: Any) -> WorkerPool:
        options = {"num_workers": 1, "ring_bytes": RING, **FAST, **options}
        pool = WorkerPool(job, PoolOptions(**options))
        made.append(pool)
        pool.start()
        return pool

    yield make
    for pool in made:
        pool.close()


def wait_blocked_in_spill(pool: WorkerPool, index: int = 0) -> None:
    """Until worker ``index`` has begun its send of a message larger than the ring (it then
    blocks in it until main reads: the pipe holds 64 KiB)."""
    assert pool._workers[index].data.poll(10), "the worker never began its spill"


def abandon_while_spilling(pool: WorkerPool, steps: Any) -> None:
    """Take the first batch of an epoch whose second batch is larger than the ring, then break
    out: the worker is left blocked sending that batch through its spill pipe."""
    it = pool.run({}, steps)
    _step, ring, msg = next(it)
    value(ring, msg)
    it.close()
    wait_blocked_in_spill(pool)


class ThirdOfRingJob:
    """Batches of 300 KiB filled with ``step % 256``: a 1 MiB ring holds 3 of them."""

    def begin(self, spec: Any) -> None:
        pass

    def produce(self, step: int) -> tuple[Any, list[float]]:
        return plan_tree({"x": np.full(300 << 10, step % 256, np.uint8)}), [0.0] * 6


def test_main_is_told_when_its_worker_waits_for_room_that_main_holds(
        make_pool: Callable[..., WorkerPool]) -> None:
    """Main keeps every batch it receives, so the worker's ring fills and the worker waits for
    room only main can give back.  Main is told, and calls make_room with the worker's ring:
    - when make_room gives nothing back, main waits (make_room a few times, not in a loop) until
      the worker sends its batches through the spill pipe, in order;
    - when make_room releases what main holds, every batch of the epoch comes through the ring.
    """
    # A worker told to wait spills once main has not made room within poll_interval: 0.05 s
    # was short enough for a busy 2-core machine to miss now and then (batch 3 spilled).
    poll = 2.0
    pool = make_pool(ThirdOfRingJob(), poll_interval=poll)
    calls: list[Any] = []
    held: list[tuple[Any, Any]] = []

    def refuse(ring: Any) -> bool:
        calls.append(ring)
        return False

    pool.make_room = refuse
    with deadline(30, pool):
        got = []
        for step, ring, msg in pool.run({}, range(8)):
            x = read_tree(np.frombuffer(msg.view, np.uint8))["x"]
            got.append((step, int(x[0]), ring is not None))
            del x
            if ring is not None:
                held.append((ring, msg))  # never released: the ring fills up
    assert [g[:2] for g in got] == [(k, k) for k in range(8)]
    assert [g[2] for g in got[:3]] == [True] * 3 and not any(g[2] for g in got[3:])
    assert calls and all(r is pool._workers[0].ring for r in calls)
    assert len(calls) <= 2 * len(got), f"make_room called {len(calls)} times: a spin"
    while held:
        r, m = held.pop()
        r.release(m)

    def release_held(ring: Any) -> bool:
        calls.append(ring)
        while held:
            r, m = held.pop()
            r.release(m)
        return True

    pool.make_room = release_held
    calls.clear()
    # The worker spilled last; its first batch of this epoch takes the ring again, and it says
    # so: main must not sit on the pipe for poll_interval meanwhile.  (It did: the worker, soon
    # blocked on the ring main let fill up, then timed out as main made room, and spilled.)
    t0 = time.monotonic()
    with deadline(30, pool):
        got = []
        for step, ring, msg in pool.run({}, range(8)):
            got.append((step, ring is not None))
            if ring is not None:
                held.append((ring, msg))
    took = time.monotonic() - t0
    assert got == [(k, True) for k in range(8)], got
    assert took < poll / 2, f"{took:.2f} s for 8 small batches: main waited out poll_interval"
    assert calls  # the ring filled up, and main made room each time
    for r, m in held:
        r.release(m)


def test_a_batch_larger_than_the_ring_is_no_reason_to_make_room(
        make_pool: Callable[..., WorkerPool]) -> None:
    """A batch that can never fit goes through the pipe whatever main holds: make_room (which
    may copy kept batches out of the ring) is not called for it."""
    pool = make_pool(BigStepJob(big=2))
    calls: list[Any] = []
    pool.make_room = lambda ring: bool(calls.append(ring))
    with deadline(30, pool):
        got = [value(ring, msg) for _step, ring, msg in pool.run({}, range(5))]
    assert got == [(64, 0), (64, 1), (BIG, 2), (64, 3), (64, 4)]
    assert calls == []


class FreedJob:
    """Each batch says whether the worker had let go of the one before when it began this one
    (a weak reference to that batch's array, dead or alive)."""

    def __init__(self) -> None:
        self.last: Any = None

    def begin(self, spec: Any) -> None:
        pass

    def produce(self, step: int) -> tuple[Any, list[float]]:
        import weakref

        freed = self.last is None or self.last() is None
        x = np.full(1 << 16, 1 if freed else 0, np.uint8)
        self.last = weakref.ref(x)
        return plan_tree({"x": x}), [0.0] * 6


def test_a_worker_lets_go_of_a_batch_once_it_is_written(
        make_pool: Callable[..., WorkerPool]) -> None:
    """A worker's heap holds the batch it is making, not the one before as well: the one before
    is gone (written into the ring) when the next begins."""
    pool = make_pool(FreedJob())
    with deadline(30, pool):
        freed = []
        for _step, ring, msg in pool.run({}, range(6)):
            x = read_tree(np.frombuffer(msg.view, np.uint8))["x"]
            freed.append(int(x[0]))
            del x
            if ring is not None:
                ring.release(msg)
    assert freed == [1] * 6


# --- A: an epoch command never blocks main ---------------------------------------------------
def test_long_epoch_starts_while_the_worker_is_blocked_in_a_spill(
        make_pool: Callable[..., WorkerPool]) -> None:
    """60,000 steps (1.9M samples at batch 32): the step list pickles to ~200 KB, over the
    64 KiB pipe buffer; a blocking send of it waited for a worker that waited for main."""
    steps = range(60_000)
    pool = make_pool(BigStepJob(big=1))
    abandon_while_spilling(pool, steps)
    with deadline(10, pool):
        it = pool.run({}, steps)
        got = [(step, value(ring, msg)) for step, ring, msg in (next(it) for _ in range(3))]
        it.close()
    assert got == [(0, (64, 0)), (1, (BIG, 1)), (2, (64, 2))]
    assert pool.restarts == 0


def test_step_list_without_runs_still_never_blocks(make_pool: Callable[..., WorkerPool]) -> None:
    """A shuffled step list has no arithmetic runs to compress: its command (~400 KB) goes out
    in pieces while main waits, and the whole epoch still arrives, in order, exactly once."""
    steps = list(range(30_000))
    random.Random(7).shuffle(steps)
    pool = make_pool(BigStepJob(big=steps[1]))
    abandon_while_spilling(pool, steps)
    with deadline(20, pool):
        got = [(step, value(ring, msg)) for step, ring, msg in pool.run({}, steps)]
    assert [s for s, _ in got] == steps
    assert all(v == (BIG if s == steps[1] else 64, s % 256) for s, v in got)
    assert pool.restarts == 0


def test_epoch_commands_stay_small() -> None:
    """A worker's share of a long epoch, and what a restart redoes, travel in a few bytes."""
    frame, todo_of = shardio.pool._frame, shardio.pool._Todo
    share = todo_of(range(1_000_000)[3::8])
    assert len(frame((shardio.pool.Cmd.EPOCH, 1, {}, share.runs()))) < 200
    for _ in range(5000):
        share.pop()
    redo = shardio.pool._runs(s for s in share if s % 7)  # gaps: a run per gap
    assert list(shardio.pool._runs(iter(list(share)))[0]) == list(share)
    assert [s for r in redo for s in r] == [s for s in share if s % 7]
    assert shardio.pool._runs([5, 3, 1, 1, 2]) == [range(5, -1, -2), range(1, 3)]


# --- B: the stuck-start guard is reached -----------------------------------------------------
def test_worker_stuck_in_fork_is_replaced_in_a_long_epoch(
        make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard runs while main waits for a batch; main used to block before that, sending the
    long epoch's command to the worker that never reads it."""
    real, stuck = shardio.pool._worker_main, [True]

    def first_one_stuck(*args: Any) -> None:
        if stuck[0]:
            time.sleep(600)  # never reaches _worker_main, like a child stuck in fork
        real(*args)

    monkeypatch.setattr(shardio.pool, "_worker_main", first_one_stuck)
    pool = make_pool(BigStepJob(big=-1), start_timeout=1.0)
    stuck[0] = False  # its replacement starts normally
    with deadline(10, pool):
        it = pool.run({}, range(60_000))
        step, ring, msg = next(it)
        assert (step, value(ring, msg)) == (0, (64, 0))
        it.close()
    assert pool.restarts == 1


def test_ring_owed_to_a_worker_not_reading_yet_survives_a_new_epoch(
        make_pool: Callable[..., WorkerPool], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rings sized from the first batch (see *Ring sizing*): worker 1 starts reading its
    control socket late, so its share of a shuffled 60,000-step epoch (~200 KB) fills the
    socket and its ``Cmd.RING`` waits behind that in main's outbox; a new epoch starts before
    either went out.  The ring is not a command of the old epoch: it stays owed, the worker
    takes it while idle (its old epoch is stale by then), and serves the new epoch through it,
    in full.  Lost, the worker would wait for a ring main thinks it sent: a hang."""
    real = shardio.pool._worker_main

    def late_reader(*args: Any) -> None:
        if args[7] == 1:  # worker index 1
            time.sleep(1.0)
        real(*args)

    monkeypatch.setattr(shardio.pool, "_worker_main", late_reader)
    pool = make_pool(BigStepJob(big=-1), num_workers=2, ring_bytes=lambda nbytes: RING)
    steps = list(range(60_000))
    random.Random(3).shuffle(steps)
    with deadline(20, pool):
        it = pool.run({}, steps)
        step, ring, msg = next(it)
        assert (step, value(ring, msg)) == (steps[0], (64, steps[0] % 256))
        it.close()
        w1 = pool._workers[1]
        assert w1.partial and any(f is w1.ring_frame for f in w1.outbox)  # the case at hand
        got = [(step, ring is not None, value(ring, msg))
               for step, ring, msg in pool.run({}, range(40))]
    assert [s for s, _, _ in got] == list(range(40))
    assert all(v == (64, s % 256) for s, _, v in got)
    assert all(via_ring for _, via_ring, _ in got[1::2])  # worker 1's, through its ring
    assert pool.restarts == 0


# --- C: a superseded iterator ----------------------------------------------------------------
def test_superseded_run_raises_and_leaves_the_newer_one_intact(
        make_pool: Callable[..., WorkerPool]) -> None:
    pool = make_pool(BigStepJob(big=-1), num_workers=2)
    it1 = pool.run({}, range(20))
    assert value(*next(it1)[1:]) == (64, 0)
    it2 = pool.run({}, range(20))
    assert next(it2)[0] == 0
    with pytest.raises(UsageError, match="superseded by a newer iter"):
        next(it1)
    rest = [(step, value(ring, msg)) for step, ring, msg in it2]
    assert rest == [(s, (64, s)) for s in range(1, 20)]
    assert pool.restarts == 0


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_text(tmp_path_factory.mktemp("text"), 61, 5)


def keys(samples: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in samples]


def test_loader_iterator_superseded_by_a_newer_one_raises(text: Path) -> None:
    with ShardLoader(ShardDataset(text, seed=3), 4, num_workers=2, collate_fn=keys,
                     **FAST) as loader:
        whole = list(loader)
        it1 = iter(loader)
        assert next(it1) == whole[0]
        it2 = iter(loader)
        first = next(it2)
        with pytest.raises(UsageError, match="iterate one at a time"):
            next(it1)
        assert [first, *it2] == whole


# --- D: workers forked by a thread -----------------------------------------------------------
def in_a_thread(fn: Callable[[], Any]) -> Any:
    """``fn()`` run by a thread that exits when it returns (a per-epoch prefetch thread)."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(20)
    assert not t.is_alive() and out, "the thread failed or hung"
    return out[0]


def test_workers_outlive_the_thread_that_forked_them(text: Path) -> None:
    """``PR_SET_PDEATHSIG`` fires when the forking thread exits: each epoch's thread used to take
    the workers with it, until ``max_restarts`` turned that into WorkerCrashedError."""
    with ShardLoader(ShardDataset(text, seed=3), 4, num_workers=2, collate_fn=keys,
                     max_restarts=1, **FAST) as loader:
        pids = None
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert len(in_a_thread(lambda: list(loader))) == 16
            time.sleep(0.3)  # a SIGKILL at the thread's exit would have landed by now
            assert loader._pool is not None
            assert pids is None or loader._pool.pids() == pids
            pids = loader._pool.pids()
            assert wait_gone(pids, 0) == pids
        assert loader.stats()["restarts"] == 0


MAIN_DIES = textwrap.dedent("""
    import faulthandler, os, signal, sys, threading, time
    faulthandler.dump_traceback_later(25, exit=True)
    sys.path.insert(0, sys.argv[1])
    import numpy as np
    from shardio._tree import plan_tree
    from shardio.pool import PoolOptions, WorkerPool

    class Job:
        def begin(self, spec): pass
        def produce(self, step):
            return plan_tree({"x": np.zeros(200_000, np.uint8)}), [0.0] * 6

    pools = []
    def start():  # forked by a thread: no PR_SET_PDEATHSIG
        for _ in range(2):
            pool = WorkerPool(Job(), PoolOptions(num_workers=1, ring_bytes=1 << 20,
                                                 poll_interval=0.05))
            pool.start()
            pools.append(pool)
    t = threading.Thread(target=start)
    t.start(); t.join()
    idle, busy = pools
    it = busy.run({}, range(100))
    next(it)  # the worker fills its ring and waits for space that never comes
    time.sleep(0.3)
    holder = os.fork()  # holds main's ends of the control pipes: no EOF when main dies
    if holder == 0:
        time.sleep(60)
        os._exit(0)
    print(*idle.pids(), *busy.pids(), holder, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_workers_forked_by_a_thread_exit_when_main_dies(tmp_path: Path) -> None:
    """Without ``PR_SET_PDEATHSIG`` a worker watches its parent itself: waiting for a command
    (another fork of main still holding the pipe, so no EOF) and waiting for ring space."""
    script, out, err = tmp_path / "main_dies.py", tmp_path / "out", tmp_path / "err"
    script.write_text(MAIN_DIES)
    with out.open("w") as stdout, err.open("w") as stderr:  # files: its children keep a pipe open
        proc = subprocess.Popen([sys.executable, str(script), str(ROOT)], stdout=stdout,
                                stderr=stderr)
    assert proc.wait(timeout=25) == -signal.SIGKILL, err.read_text()
    *workers, holder = (int(x) for x in out.read_text().split())
    alive = wait_gone(workers, 5.0)
    for pid in (*alive, holder):  # orphans: nobody else would ever end them
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert len(workers) == 2
    assert alive == [], "workers outlived main"


# --- memory allocator ----------------------------------------------------------------------------
_FAULTS = textwrap.dedent("""
    import resource, sys
    import shardio.pool
    if sys.argv[1] == "keep":
        assert shardio.pool.keep_freed_heap()
    batch = [bytes([i % 256]) * 22_000 for i in range(256)]
    del batch
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        batch = [bytes([i % 256]) * 22_000 for i in range(256)]
        del batch
    print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20)
""")


def _faults_per_round(mode: str) -> float:
    """In a fresh interpreter (glibc's thresholds at their starting values, as in a worker
    forked from a process that never freed a large block): allocate a batch of 256 samples of
    22 KB and free it, 20 times; minor page faults per round after the first."""
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True,
                         timeout=60, cwd=ROOT, check=True)
    return float(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform_libc() != "glibc",
                    reason="glibc's allocator settings")
def test_workers_keep_freed_heap_for_the_next_batch() -> None:
    """A worker frees each batch of samples at once: with glibc's starting thresholds the
    5.6 MB went back to the kernel each time and came back as ~1,400 page faults per batch;
    keep_freed_heap (which every worker calls) makes it reuse them."""
    assert _faults_per_round("default") > 500  # the problem exists here
    assert _faults_per_round("keep") < 20


def test_a_full_control_socket_never_makes_main_wait_even_with_a_default_timeout() -> None:
    """Main's end of a control socket is non-blocking (see *Protocol*): handing a ring over
    a full socket raises BlockingIOError at once (the frame waits in the outbox), even when
    the training script set socket.setdefaulttimeout, which would otherwise turn the send into
    a wait of up to that timeout and then a TimeoutError."""
    import socket

    a, b = socket.socketpair()
    main_end = a.detach()
    os.set_blocking(main_end, False)
    old = socket.getdefaulttimeout()
    r, w = os.pipe()
    try:
        while True:  # fill the socket: the worker is not reading
            try:
                os.write(main_end, b"\0" * 65536)
            except BlockingIOError:
                break
        socket.setdefaulttimeout(5.0)
        with pytest.raises(BlockingIOError):
            shardio.pool._send_with_fd(main_end, memoryview(b"frame"), r)
    finally:
        socket.setdefaulttimeout(old)
        os.close(main_end)
        b.close()
        os.close(r)
        os.close(w)


# --- closing without waiting (see shardio.pool, "Closing without waiting") --------------------


def _state(pid: int) -> str:
    try:
        return str(psutil.Process(pid).status())
    except psutil.NoSuchProcess:
        return "gone"


def _sigstop(pids: list[int]) -> None:
    """SIGSTOP ``pids`` and wait until each is stopped (delivery is asynchronous)."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    t_end = time.monotonic() + 10
    while any(_state(pid) != psutil.STATUS_STOPPED for pid in pids):
        assert time.monotonic() < t_end, [_state(pid) for pid in pids]
        time.sleep(0.01)


@contextmanager
def _killed_at_the_end(pids: list[int]) -> Iterator[None]:
    """A failed test leaves no stopped worker behind."""
    try:
        yield
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_close_without_waiting_leaves_the_exits_to_the_reaper(
        make_pool: Callable[..., WorkerPool]) -> None:
    """close(wait=False) lets go of pipes and rings and returns while the workers still exist
    (here stopped with SIGSTOP, so they cannot exit by themselves); reap_exiting(wait=True)
    then ends them at their deadline: SIGTERM does not end a stopped process, SIGKILL does."""
    pool = make_pool(BigStepJob(big=-1), num_workers=2, join_timeout=0.5)
    with deadline(20, pool), ExitStack() as stack:
        got = [value(ring, msg) for _step, ring, msg in pool.run({}, range(4))]
        assert got == [(64, s) for s in range(4)]
        pids = pool.pids()
        _sigstop(pids)
        stack.enter_context(_killed_at_the_end(pids))
        pool.close(wait=False)
        assert [p.pid for p in pool.exiting] == pids
        # Returned without them: both still there (stopped), their ends closed by main.
        assert all(_state(pid) == psutil.STATUS_STOPPED for pid in pids)
        shardio.pool.reap_exiting()  # not waiting: before their deadline it leaves them be
        assert all(_state(pid) == psutil.STATUS_STOPPED for pid in pids)
        shardio.pool.reap_exiting(wait=True, procs=pool.exiting)
        assert [_state(pid) for pid in pids] == ["gone", "gone"]
        assert not any(shardio.pool.still_exiting(p) for p in pool.exiting)
        assert not [p for p, _ in shardio.pool._EXITING if p.pid in pids]


def test_a_pool_start_reaps_workers_past_their_deadline(
        make_pool: Callable[..., WorkerPool]) -> None:
    """A worker left by close(wait=False) that never exits is killed by the next pool's start
    once its deadline has passed (no thread watches it)."""
    pool = make_pool(BigStepJob(big=-1), num_workers=1, join_timeout=0.2)
    with deadline(20, pool), ExitStack() as stack:
        assert [value(r, m) for _s, r, m in pool.run({}, range(2))] == [(64, 0), (64, 1)]
        (pid,) = pool.pids()
        _sigstop([pid])
        stack.enter_context(_killed_at_the_end([pid]))
        pool.close(wait=False)
        time.sleep(0.3)  # past its deadline
        assert _state(pid) == psutil.STATUS_STOPPED
        other = make_pool(BigStepJob(big=-1))  # its start reaps
        assert _state(pid) == "gone"
        assert not [p for p, _ in shardio.pool._EXITING if p.pid == pid]
        assert [value(r, m) for _s, r, m in other.run({}, range(2))] == [(64, 0), (64, 1)]


def test_a_loader_that_does_not_persist_stops_its_workers_without_waiting(
        tmp_path: Path) -> None:
    """persistent_workers=False: the iteration's end stops the workers without waiting for
    their exit (they are still there when it returns, stopped here by SIGSTOP from inside the
    last step), the next iteration runs on new ones, and close() leaves nothing: the stopped
    workers are killed at their deadline."""
    src = pack_text(tmp_path, 24, 6)
    loader = ShardLoader(ShardDataset(src, batch_size=4), 4, num_workers=2,
                         persistent_workers=False, **FAST)
    t = threading.Timer(60, lambda: [os.kill(p, signal.SIGKILL) for p in loader._pool.pids()]
                        if loader._pool else None)
    t.start()
    first: list[int] = []
    try:
        n = 0
        for _batch in loader:
            n += 1
            if n == 6:  # the last batch: both workers delivered everything
                first = loader._pool.pids()
                _sigstop(first)
        assert n == 6 and len(first) == 2
        assert all(_state(pid) == psutil.STATUS_STOPPED for pid in first)
        assert sorted(p.pid for p in loader._exiting) == sorted(first)
        assert sum(1 for _ in loader) == 6  # new workers
        loader.close()  # waits: join_timeout (5 s), SIGTERM (pending), SIGKILL
        assert [_state(pid) for pid in first] == ["gone", "gone"]
        assert loader._exiting == []
        assert not [p for p, _ in shardio.pool._EXITING if p.pid in first]
    finally:
        t.cancel()
        with _killed_at_the_end(first):
            loader.close()
