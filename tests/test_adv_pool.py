"""Adversarial checks of the worker pool, its rings and how ShardLoader drives them.

Every test has a deadline (pytest-timeout, and bounded joins/waits inside): none may hang.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import pytest

from shardio import ShardDataset, ShardLoader
from shardio.config import LoaderOptions
from shardio.errors import UsageError, WorkerError
from shardio.topology import pinnable_cpus
from tests.test_dataset import pack_text
from tests.test_pool_robust import _no_leftovers, live_children  # noqa: F401  (a fixture)

pytestmark = pytest.mark.timeout(60)



@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 samples (txt + cls, raw) in 8 shards."""
    return pack_text(tmp_path_factory.mktemp("text"), 40, 5)


def _slow(sample: Any) -> Any:
    time.sleep(0.5)
    return sample


def test_close_from_another_thread_ends_a_waiting_iteration_with_a_typed_error(
        text: Path) -> None:
    """close() from another thread while the loop waits for a batch: the wait ends with the
    pool's WorkerError ("the worker pool is closed"), not the ring's RingClosedError saying
    the producer finished, nor a TypeError from a ring torn down under the read."""
    ds = ShardDataset(text, transform=_slow)
    loader = ShardLoader(ds, batch_size=2, num_workers=2, ring_bytes=1 << 20,
                         poll_interval=0.05)
    try:
        it = iter(loader)
        next(it)
        closer = threading.Thread(target=lambda: (time.sleep(0.2), loader.close()))
        closer.start()
        t0 = time.monotonic()
        with pytest.raises(WorkerError, match="worker pool is closed"):
            for _ in it:
                pass
        assert time.monotonic() - t0 < 10
        closer.join(20)
        assert not closer.is_alive()
    finally:
        loader.close()


@pytest.mark.parametrize("cpus", [["a"], [-1], 5, [True], [0.5], []])
def test_cpus_that_are_not_cpu_numbers_are_refused_at_construction(text: Path, cpus: Any) -> None:
    """Before: ["a"] was a ValueError, 5 a TypeError, [True] and [0.5] pinned to CPU 1 and 0
    silently, and [-1] made every worker die in sched_setaffinity until WorkerCrashedError
    blamed out-of-memory kills."""
    with pytest.raises(UsageError, match="cpus"):
        ShardLoader(ShardDataset(text), batch_size=4, num_workers=1, cpus=cpus)


def test_a_cpu_this_process_cannot_use_is_refused_before_any_worker(text: Path) -> None:
    """Before: each worker logged 'cannot pin' and ran unpinned; now the first iteration says
    which CPUs there are, and starts nothing."""
    missing = max(pinnable_cpus() or {0}) + 1000
    loader = ShardLoader(ShardDataset(text), batch_size=4, num_workers=1, cpus=[missing])
    before = set(live_children())
    with pytest.raises(UsageError, match=f"CPU {missing} is not available"):
        next(iter(loader))
    assert set(live_children()) - before == set()
    loader.close()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_workers_may_be_pinned_outside_mains_own_affinity(text: Path) -> None:
    """A training process pinned to one core may still put its workers on the others of its
    cpuset: the check does not confuse main's affinity mask with the CPUs there are."""
    mine = os.sched_getaffinity(0)
    first, other = sorted(mine)[:2]
    os.sched_setaffinity(0, {first})
    try:
        with ShardLoader(ShardDataset(text), batch_size=4, num_workers=1,
                         cpus=[other]) as loader:
            it = iter(loader)
            next(it)
            pid = loader._pool.pids()[0]  # type: ignore[union-attr]
            assert os.sched_getaffinity(pid) == {other}
            for _ in it:
                pass
    finally:
        os.sched_setaffinity(0, mine)


def _forked(body: Any, timeout: float = 30.0) -> int:
    """Run ``body()`` in a raw ``os.fork()`` child that ends with ``os._exit`` (its return
    value, 1 on an exception, or 3 on a timeout); the child is killed at the deadline."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            signal.alarm(int(timeout))
            code = int(body())
        except BaseException:  # noqa: BLE001 - reported through the exit code
            traceback.print_exc()
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout + 5
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return 3


def _reference_and_loader(text: Path) -> tuple[list[str], ShardLoader]:
    """The epoch's keys read in-process, and a 2-worker loader of the same epoch."""
    ds = ShardDataset(text)
    ref = [b["__key__"] for b in ShardLoader(ds, batch_size=2, num_workers=0)]
    return ref, ShardLoader(ds, batch_size=2, num_workers=2, ring_bytes=1 << 20,
                            poll_interval=0.05)


def test_a_forked_child_dropping_its_copy_of_the_loader_leaves_the_parents_workers_alone(
        text: Path) -> None:
    """A process forked while a loader runs (a fork that writes a checkpoint in the
    background, say) that drops its copy of the loader: before, its close() (from __del__)
    posted STOP to the parent's workers, marked the parent's rings closed and bumped the
    shared generation counter, so the parent's workers exited and its iteration ended with
    'this iterator was superseded by a newer iter(loader)'."""
    ref, loader = _reference_and_loader(text)
    try:
        it = iter(loader)
        got = [next(it)["__key__"]]
        pids = loader._pool.pids()  # type: ignore[union-attr]

        def drop() -> int:
            nonlocal loader, it
            del it, loader  # the child's copies: collected, so closed, here
            gc.collect()
            return 0

        assert _forked(drop) == 0
        got += [b["__key__"] for b in it]
        assert got == ref
        assert loader._pool.pids() == pids  # type: ignore[union-attr]
        assert loader.stats()["restarts"] == 0
    finally:
        loader.close()


def test_a_forked_child_iterating_its_copy_of_the_loader_starts_its_own_workers(
        text: Path) -> None:
    """Before, the child's iteration drove the parent's workers (and they, its rings)."""
    ref, loader = _reference_and_loader(text)
    try:
        it = iter(loader)
        got = [next(it)["__key__"]]
        parent_workers = set(loader._pool.pids())  # type: ignore[union-attr]

        def iterate() -> int:
            keys = [b["__key__"] for b in ShardLoader.__iter__(loader)]
            mine = set(loader._pool.pids())  # type: ignore[union-attr]
            loader.close()
            return 0 if keys == ref and not mine & parent_workers else 2

        assert _forked(iterate) == 0
        got += [b["__key__"] for b in it]
        assert got == ref
        assert loader.stats()["restarts"] == 0
    finally:
        loader.close()


@pytest.mark.parametrize(("option", "value"), [
    ("max_restarts", "3"), ("max_restarts", 2.5), ("max_restarts", True),
    ("poll_interval", "0.1"), ("poll_interval", float("nan")), ("poll_interval", float("inf")),
    ("start_timeout", "x"), ("max_held_fraction", "0.5"),
])
def test_pool_options_of_the_wrong_kind_are_a_usage_error(option: str, value: Any) -> None:
    """Before: strings were a bare TypeError from a comparison, 2.5 and True restarts were
    taken, and poll_interval=nan or inf was refused only once an iteration had started its
    workers (nan a UsageError from the ring, inf a bare ValueError from futex_wait)."""
    with pytest.raises(UsageError, match=option):
        LoaderOptions(**{option: value})


def test_close_from_a_signal_handler_ends_a_waiting_iteration_with_a_typed_error(
        text: Path) -> None:
    """The same from a signal handler (a SIGTERM handler that cleans up), which runs in the
    waiting thread itself: before, RingClosedError saying the producer had finished."""
    ds = ShardDataset(text, transform=_slow)
    loader = ShardLoader(ds, batch_size=2, num_workers=2, ring_bytes=1 << 20,
                         poll_interval=0.05)
    old = signal.signal(signal.SIGALRM, lambda *_: loader.close())
    try:
        it = iter(loader)
        next(it)
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(WorkerError, match="worker pool is closed"):
            for _ in it:
                pass
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        loader.close()
