"""Node-local staging (shardio.stage): real files, real processes, real ENOSPC on a small tmpfs.

Every multi-process test has a deadline: children dump their stacks and exit before the test's
own timeout, waits in the test fail with the node's state after a bounded time, and stager
processes are stopped in ``finally``.
"""

from __future__ import annotations

import faulthandler
import itertools
import logging
import math
import multiprocessing as mp
import os
import random
import select
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardio
from shardio._fsutil import TMP_MARK
from shardio.checksum import file_digest
from shardio.errors import StagingError, UsageError
from shardio.manifest import Manifest
from shardio.order import EpochOrder, RankPlan, node_schedule
from shardio.stage import (
    NodeCache,
    StageOptions,
    Stager,
    belady_plan,
    find_cache_dir,
    simulate,
)
from tests.conftest import flip_bit
from tools.make_dataset import make_images

pytestmark = pytest.mark.timeout(60)

CTX = mp.get_context("fork")
CHILD_DEADLINE = 40  # a hung child dumps its stack and exits before the test's own deadline
BATCH = 4
SHUFFLE_BLOCK = 8  # two shards per shuffle block: each shard is read over a few steps only
FAST = {"reserve": "1MiB", "poll_interval": 0.01}


# --- fixtures and helpers ------------------------------------------------------------------
@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """60 JPEGs (5-12 KB) in 15 tar shards of 4 samples (34-47 KB each, with .idx files)."""
    base = tmp_path_factory.mktemp("stage")
    make_images(str(base / "src"), files=60, classes=3, min_kb=5, max_kb=12, seed=1, pool=12)
    shardio.pack(base / "src", base / "ds", samples_per_shard=4, label_from_dir=True,
                 fsync=False, progress=False)
    return base / "ds"


def load(root: Path) -> Manifest:
    return Manifest.load(root)


def schedule(manifest: Manifest, *, world: int = 1, local: int = 1, batch: int = BATCH,
             seed: int = 7) -> Callable[[int], Any]:
    counts = np.array([s.samples for s in manifest.shards])

    def sched(e: int) -> Any:
        order = EpochOrder(counts, seed=seed, epoch=e, shuffle_block=SHUFFLE_BLOCK)
        return node_schedule(order, world_size=world, local_world_size=local, batch_size=batch)

    return sched


def sizes_of(root: Path, manifest: Manifest) -> list[int]:
    """Bytes the stager accounts per shard: shard + index file."""
    return [s.bytes + (os.path.getsize(root / s.index) if s.index else 0)
            for s in manifest.shards]


def data_bytes(cache: NodeCache) -> int:
    total = 0
    for d, _, files in os.walk(cache.data_dir):
        for name in files:
            try:
                total += os.stat(os.path.join(d, name)).st_size
            except FileNotFoundError:
                pass
    return total


def temps(cache: NodeCache) -> list[str]:
    return [os.path.join(d, n) for d, _, files in os.walk(cache.dir) for n in files
            if TMP_MARK in n]


def copy_ok(cache: NodeCache, i: int) -> bool:
    entry = cache.manifest.shards[i]
    index = cache.index_path(i)
    return (file_digest(cache.path(i))[0] == entry.digest
            and (index is None or file_digest(index)[0] == entry.index_digest))


def wait_until(pred: Callable[[], bool], what: str, cache: NodeCache | None = None,
               timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            faulthandler.dump_traceback(all_threads=True)
            state = "" if cache is None else f"; status {cache.status()}, {cache.counters()}"
            pytest.fail(f"timed out after {timeout} s waiting for {what}{state}")
        time.sleep(0.002)


def gone(pid: int) -> bool:
    """The process has exited (a zombie awaiting its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except FileNotFoundError:
        return True
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] in (b"Z", b"X")


def _child_main(target: Callable[..., None], args: tuple[Any, ...]) -> None:
    faulthandler.dump_traceback_later(CHILD_DEADLINE, exit=True, file=sys.__stderr__)
    target(*args)


def fork(target: Callable[..., None], *args: Any) -> Any:
    proc = CTX.Process(target=_child_main, args=(target, args), daemon=True)
    proc.start()
    return proc


def join(proc: Any, timeout: float = 30.0) -> int:
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"child {proc.pid} did not finish within {timeout} s (killed)")
    return int(proc.exitcode)


def events(cache: NodeCache, kinds: tuple[str, ...] = ("stage", "evict", "skip", "bypass",
                                                       "reverify")) -> list[tuple[str, int, int]]:
    return [(r["event"], r["shard"], r["epoch"]) for r in cache.journal() if r["event"] in kinds]


@pytest.fixture
def stagers() -> Iterator[list[Stager]]:
    """Stagers started by a test; stopped (SIGTERM, then SIGKILL) whatever happens."""
    started: list[Stager] = []
    yield started
    for st in started:
        st.stop(timeout=5)


# --- synchronous staging ---------------------------------------------------------------------
def test_stage_copies_every_shard_verified_in_order_of_use(dataset: Path, tmp_path: Path,
                                                           ) -> None:
    m = load(dataset)
    sched = schedule(m)
    cache = NodeCache(tmp_path, dataset, m)
    st = Stager(cache, sched, StageOptions(journal=True, **FAST))
    counters = st.stage([0])
    n, total = len(m.shards), sum(sizes_of(dataset, m))
    assert counters["shards_staged"] == n
    assert counters["bytes_staged"] == total  # shared-FS bytes read: each shard + index once
    assert counters["cached_bytes"] == total == data_bytes(cache)
    for i in range(n):
        path = cache.lookup(i)
        assert path == os.path.join(cache.data_dir, m.shards[i].path)
        assert copy_ok(cache, i)
        assert os.path.exists(str(cache.index_path(i)))  # tar shards carry an .idx beside them
    assert temps(cache) == []
    # in the order the node reads them
    assert [s for _, s, _ in events(cache)] == sched(0).shards.tolist()
    # a second pass (this object, and a new stager as after a restart) copies nothing
    assert st.stage([0])["bytes_staged"] == total
    again = Stager(NodeCache(tmp_path, dataset, m), sched, StageOptions(**FAST)).stage([0])
    assert again["shards_staged"] == n and again["bytes_staged"] == total
    assert again["reverified"] == n  # a new stager re-verifies copies it did not make itself
    cache.discard(4, "test")  # with no stager running: gone at once, staged again next time
    assert cache.lookup(4) is None and not os.path.exists(cache.path(4))
    assert cache.counters()["discarded"] == 1
    assert st.stage([0])["shards_staged"] == n + 1 and copy_ok(cache, 4)
    other = CTX.Queue()
    stagers = [Stager(cache, sched, StageOptions(bandwidth=50_000, **FAST))]
    try:  # a synchronous stage() refuses to run beside the node's stager
        assert stagers[0].start(0)
        wait_until(lambda: cache.status()["pid"] != 0, "the stager", cache)
        with pytest.raises(StagingError, match="another stager"):
            Stager(cache, sched).stage([0])
    finally:
        stagers[0].stop()
    del other


def test_corrupt_original_is_not_published(dataset: Path, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    shutil.copytree(dataset, root)
    m = load(root)
    flip_bit(root / m.shards[3].path, 1000)  # inside the first member's payload
    flip_bit(root / str(m.shards[5].index), 20)
    (tmp_path / "cache").mkdir()
    cache = NodeCache(tmp_path / "cache", root, m)
    counters = Stager(cache, schedule(m), StageOptions(journal=True, **FAST)).stage([0])
    assert counters["verify_failures"] == 2
    assert counters["shards_staged"] == len(m.shards) - 2
    for bad in (3, 5):
        assert cache.lookup(bad) is None
        assert not os.path.exists(cache.path(bad)) and not os.path.exists(str(cache.index_path(bad)))
    assert all(copy_ok(cache, i) for i in range(len(m.shards)) if i not in (3, 5))
    assert temps(cache) == []
    assert sorted(r["shard"] for r in cache.journal() if r["event"] == "verify_failure") == [3, 5]


def test_bandwidth_cap_is_a_lower_bound_on_time(dataset: Path, tmp_path: Path) -> None:
    m = load(dataset)
    total, cap = sum(sizes_of(dataset, m)), 1_000_000
    cache = NodeCache(tmp_path, dataset, m)
    t0 = time.monotonic()
    Stager(cache, schedule(m), StageOptions(bandwidth=cap, **FAST)).stage([0])
    elapsed = time.monotonic() - t0
    floor = (total - cap * 0.1) / cap  # the bucket starts with 0.1 s worth of tokens
    print(f"\nstaged {total} B with a cap of {cap} B/s in {elapsed:.2f} s (floor {floor:.2f} s)")
    assert elapsed >= 0.8 * floor


@pytest.mark.parametrize("cause", ["enospc", "reserve"])
def test_full_cache_shrinks_the_budget_and_warns_once(dataset: Path, small_tmpfs: Path,
                                                      caplog: pytest.LogCaptureFixture,
                                                      cause: str) -> None:
    m = load(dataset)
    cache = NodeCache(small_tmpfs, dataset, m)
    st = os.statvfs(small_tmpfs)
    free = st.f_bavail * st.f_frsize
    room = 250_000
    if cause == "enospc":  # fill the disk; no reserve check: the copy itself hits ENOSPC
        with open(small_tmpfs / "filler", "wb") as f:
            f.write(b"\0" * (free - room))
        options = StageOptions(budget="100MB", reserve=0, journal=True)
    else:
        options = StageOptions(budget="100MB", reserve=free - room, journal=True)
    with caplog.at_level(logging.WARNING, logger="shardio.stage"):
        counters = Stager(cache, schedule(m), options).stage([0])
    warnings = [r for r in caplog.records if r.name == "shardio.stage"]
    assert len(warnings) == 1 and "budget cut" in warnings[0].getMessage()
    assert counters["budget_shrinks"] == 1
    assert counters["enospc"] == (1 if cause == "enospc" else 0)
    staged = [i for i in range(len(m.shards)) if cache.lookup(i) is not None]
    assert 0 < len(staged) < len(m.shards)
    assert counters["shards_staged"] == len(staged)
    assert counters["cached_bytes"] == data_bytes(cache)
    if cause == "enospc":  # cut to what is in use
        assert counters["budget"] == counters["cached_bytes"]
    else:  # cut to what is in use plus the room left above the reserve (less than one shard)
        assert 0 <= counters["budget"] - counters["cached_bytes"] < max(sizes_of(dataset, m))
    assert all(copy_ok(cache, i) for i in staged)
    for i in set(range(len(m.shards))) - set(staged):  # the rest: read directly, nothing left
        assert not os.path.exists(cache.path(i))
    assert temps(cache) == []


# --- Belady ----------------------------------------------------------------------------------
def test_belady_plan_basics() -> None:
    cached = {1: 10, 2: 10, 3: 10}
    nu = {1: 5, 2: math.inf, 3: 9}
    assert belady_plan(cached, 40, nu, 10, 7) == []  # fits
    assert belady_plan(cached, 30, nu, 10, 7) == [2]  # farthest (never again) first
    assert belady_plan(cached, 30, nu, 20, 7) == [2, 3]
    assert belady_plan(cached, 30, nu, 20, 9.5) is None  # only 2 is needed after it: not enough
    assert belady_plan(cached, 30, nu, 10, math.inf) is None  # never needed again: bypass
    assert belady_plan(cached, 30, nu, 31, 1) is None  # larger than the budget


def _classic_misses(seq: list[int], sizes: dict[int, int], budget: int) -> int:
    """Reads of a demand cache run by belady_plan: on a miss the item is read, then kept or not."""
    cache: dict[int, int] = {}
    misses = 0
    for t, x in enumerate(seq):
        if x in cache:
            continue
        misses += 1

        def nxt(j: int, t: int = t) -> float:
            return next((u for u in range(t + 1, len(seq)) if seq[u] == j), math.inf)

        victims = belady_plan(cache, budget, {j: nxt(j) for j in cache}, sizes[x], nxt(x))
        if victims is None:
            continue
        for v in victims:
            del cache[v]
        assert sum(cache.values()) + sizes[x] <= budget
        cache[x] = sizes[x]
    return misses


def _optimal_misses(seq: list[int], sizes: dict[int, int], budget: int) -> int:
    """Brute force over every keep/evict decision (dynamic programming over cache contents)."""
    states = {frozenset(): 0}
    for x in seq:
        new: dict[frozenset[int], int] = {}

        def put(s: frozenset[int], c: int, new: dict[frozenset[int], int] = new) -> None:
            if new.get(s, 1 << 30) > c:
                new[s] = c

        for s, c in states.items():
            if x in s:
                put(s, c)
                continue
            put(s, c + 1)  # read it, do not keep it
            items = sorted(s)
            for r in range(len(items) + 1):
                for keep in itertools.combinations(items, r):
                    if sum(sizes[j] for j in keep) + sizes[x] <= budget:
                        put(frozenset(keep) | {x}, c + 1)
        states = new
    return min(states.values())


def test_belady_plan_is_optimal_against_brute_force() -> None:
    rng = random.Random(1234)
    gaps = []
    for case in range(300):
        items = rng.randint(3, 6)
        seq = [rng.randrange(items) for _ in range(rng.randint(6, 14))]
        if case < 200:  # equal sizes: Belady's MIN with bypass is optimal
            sizes, budget = dict.fromkeys(range(items), 1), rng.randint(1, 3)
            assert _classic_misses(seq, sizes, budget) == _optimal_misses(seq, sizes, budget), (
                seq, budget)
        else:  # unequal sizes (NP-hard in general): feasible, and close
            sizes = {j: rng.randint(1, 3) for j in range(items)}
            budget = rng.randint(2, 6)
            gaps.append(_classic_misses(seq, sizes, budget) - _optimal_misses(seq, sizes, budget))
    assert min(gaps) >= 0
    print(f"\nunequal sizes: optimal in {gaps.count(0)}/{len(gaps)} cases, worst +{max(gaps)}")


def _sampler(cache_dir: str, root: str, stop: Any, out: Any) -> None:
    cache = NodeCache(cache_dir, root, Manifest.load(root))
    peak = samples = 0
    while not stop.is_set():
        peak = max(peak, data_bytes(cache))
        samples += 1
        time.sleep(0.001)
    out.put((peak, samples))


def test_budget_is_kept_and_evictions_follow_belady(dataset: Path, tmp_path: Path,
                                                    stagers: list[Stager]) -> None:
    """One reader in lockstep with the stager over 3 epochs, a third of the dataset fits: the
    stager's journal is exactly :func:`simulate`'s, the cache never exceeds the budget."""
    m = load(dataset)
    sched, sizes = schedule(m), sizes_of(dataset, m)
    budget = sum(sizes) // 3
    steps = range(0, sum(s.samples for s in m.shards), BATCH)
    expected = simulate(sched, sizes, budget, epochs=range(3), lookahead=1,
                        steps=lambda e: steps)
    kinds = {k for k, _, _ in expected}
    assert {"stage", "evict", "bypass", "reverify"} <= kinds  # the case exercises the policy

    cache = NodeCache(tmp_path, dataset, m)
    stop, out = CTX.Event(), CTX.Queue()
    sampler = fork(_sampler, str(tmp_path), str(dataset), stop, out)
    st = Stager(cache, sched, StageOptions(budget=budget, journal=True, **FAST))
    stagers.append(st)
    assert st.start(0, last_epoch=2)
    hits = misses = 0
    wait_until(lambda: cache.status()["idle"] and cache.status()["idle_at"] is None,
               "the stager to finish staging before any report", cache)
    for e in range(3):
        for pos in steps:
            cache.report(e, pos)
            wait_until(lambda e=e, pos=pos: cache.status()["idle_at"] == (e, pos),
                       f"the stager at {(e, pos)}", cache)
            assert data_bytes(cache) <= budget
            for k in np.flatnonzero((sched(e).first <= pos) & (sched(e).last >= pos)):
                if cache.lookup(int(sched(e).shards[k])) is None:
                    misses += 1
                else:
                    hits += 1
    cache.close()
    assert st.join(10) == 0  # readers gone after the last epoch: the stager exits by itself
    stop.set()
    peak, samples = out.get(timeout=10)
    assert join(sampler) == 0
    assert events(cache) == expected
    assert peak <= budget and samples > 10
    counters = cache.counters()
    assert counters["evictions"] == sum(k == "evict" for k, _, _ in expected) > 0
    assert counters["cached_bytes"] <= budget
    assert temps(cache) == []
    print(f"\nbudget {budget} of {sum(sizes)} B: {counters['shards_staged']} copies, "
          f"{counters['evictions']} evictions, {counters['bypassed']} bypassed, "
          f"{hits} cached / {misses} direct shard-steps, peak {peak} B over {samples} samples")


def test_trim_to_a_smaller_budget_spares_shards_being_read(dataset: Path, tmp_path: Path) -> None:
    """A stager that starts over its budget (a prolog staged everything) while a reader is in
    mid-epoch: the trim keeps the shards being read and evicts the others farthest next use
    first, the shards the readers have finished (not needed again) before any other."""
    m = load(dataset)
    sched, sizes = schedule(m), sizes_of(dataset, m)
    cache = NodeCache(tmp_path, dataset, m)
    Stager(cache, sched, StageOptions(**FAST)).stage([0])
    s0, pos = sched(0), 32
    cache.report(0, pos)
    accesses = [(int(s), int(f), int(last)) for s, f, last in zip(s0.shards, s0.first, s0.last)]
    in_use = {s for s, f, last in accesses if f <= pos <= last}
    next_use = {s: (f if f > pos else math.inf) for s, f, last in accesses if s not in in_use}
    assert in_use and math.inf in next_use.values()  # the case has shards read and finished
    budget = sum(sizes) // 4
    expected, over = [], sum(sizes) - budget
    for s in sorted(next_use, key=lambda s: (-next_use[s], -sizes[s], s)):
        if over <= 0:
            break
        expected.append(s)
        over -= sizes[s]
    Stager(NodeCache(tmp_path, dataset, m), sched,
           StageOptions(budget=budget, journal=True, **FAST)).stage([0])
    assert [s for _, s, _ in events(cache, ("evict",))] == expected
    assert all(cache.lookup(s, wait=0) is not None for s in in_use)
    assert cache.counters()["cached_bytes"] <= budget
    cache.close()


# --- processes of one node -------------------------------------------------------------------
RANKS, RANK_BATCH, EPOCHS = 4, 2, 3


def _rank_main(rank: int, cache_dir: str, root: str, barrier: Any, out: Any) -> None:
    m = Manifest.load(root)
    counts = np.array([s.samples for s in m.shards])
    n = int(counts.sum())
    cache = NodeCache(cache_dir, root, m)
    sched = schedule(m, world=RANKS, local=RANKS, batch=RANK_BATCH)
    st = Stager(cache, sched, StageOptions(budget="64MB", journal=True, **FAST))
    won = st.start(0, last_epoch=EPOCHS - 1)
    barrier.wait(20)
    local, direct = [], []
    for e in range(EPOCHS):
        if e == 1:  # "after the first staging": from here on the shared FS is not read at all
            deadline = time.monotonic() + 20
            while cache.counters()["shards_staged"] < len(m.shards):
                assert time.monotonic() < deadline, cache.counters()
                time.sleep(0.005)
            barrier.wait(20)
        order = EpochOrder(counts, seed=7, epoch=e, shuffle_block=SHUFFLE_BLOCK)
        ids = order.samples(0, n)
        plan = RankPlan(n, RANKS, rank, RANK_BATCH)
        opened: set[int] = set()
        for t in range(plan.num_batches):
            cache.report(e, t * RANKS * RANK_BATCH)
            lo, hi = plan.batch_range(t)
            for i in np.searchsorted(order.offsets, ids[np.arange(lo, hi) % n], "right") - 1:
                i = int(i)
                if i in opened:
                    continue
                opened.add(i)
                path = cache.lookup(i, wait=5.0)
                if path is None:
                    assert file_digest(os.path.join(root, m.shards[i].path))[0]
                    direct.append((e, i))
                else:
                    assert file_digest(path)[0] == m.shards[i].digest
                    local.append((e, i))
            barrier.wait(20)
    cache.close()
    barrier.wait(20)
    out.put((rank, won, local, direct, st.join(60) if won else None))


def test_ranks_of_a_node_share_one_stager(dataset: Path, tmp_path: Path) -> None:
    m = load(dataset)
    barrier, out = CTX.Barrier(RANKS), CTX.Queue()
    procs = [fork(_rank_main, r, str(tmp_path), str(dataset), barrier, out)
             for r in range(RANKS)]
    results = sorted(out.get(timeout=120) for _ in procs)
    assert [join(p) for p in procs] == [0] * RANKS
    winners = [r for r, won, *_ in results if won]
    assert len(winners) == 1  # exactly one stager on the node
    assert results[winners[0]][4] == 0  # it exited by itself once the readers were done
    cache = NodeCache(tmp_path, dataset, m)
    counters = cache.counters()
    n = len(m.shards)
    assert counters["shards_staged"] == n  # each shard copied once for the node
    assert counters["bytes_staged"] == sum(sizes_of(dataset, m))
    direct = {(e, i) for _, _, _, d, _ in results for e, i in d}
    assert {e for e, _ in direct} <= {0}  # after the first staging the shared FS is not read
    staged = {(e, s) for k, s, e in events(cache) if k == "stage"}
    assert not staged & direct  # a shard read directly in an epoch is not also staged for it
    assert counters["skipped_in_use"] == len({(s, e) for k, s, e in events(cache) if k == "skip"})
    local = sum(len(lc) for _, _, lc, _, _ in results)
    print(f"\n{RANKS} ranks x {EPOCHS} epochs: {local} local opens, {len(direct)} direct "
          f"(epoch 0, before the stager got there), counters {counters}")


def _try_start(cache_dir: str, root: str, out: Any) -> None:
    m = Manifest.load(root)
    out.put(Stager(NodeCache(cache_dir, root, m), schedule(m)).start(0))


def test_killed_stager_releases_the_lock_and_another_takes_over(
        dataset: Path, tmp_path: Path, stagers: list[Stager]) -> None:
    m = load(dataset)
    cache = NodeCache(tmp_path, dataset, m)
    slow = Stager(cache, schedule(m), StageOptions(bandwidth=100_000, **FAST))
    stagers.append(slow)
    assert slow.start(0)
    assert slow.pid is not None
    wait_until(lambda: bool(temps(cache)), "a copy in progress", cache)
    out = CTX.Queue()
    assert join(fork(_try_start, str(tmp_path), str(dataset), out)) == 0
    assert out.get(timeout=5) is False  # another process loses the election
    assert not Stager(cache, schedule(m)).start(0)  # so does another opener in this one
    os.kill(slow.pid, signal.SIGKILL)
    assert slow.join(5) == -signal.SIGKILL
    assert temps(cache)  # killed mid-copy: its temp file is left behind ...
    before = cache.counters()["shards_staged"]
    taker = Stager(cache, schedule(m), StageOptions(**FAST))
    stagers.append(taker)
    assert taker.start(0)  # ... the lock is free again
    wait_until(lambda: cache.counters()["shards_staged"] == len(m.shards), "the new stager",
               cache)
    assert cache.status()["pid"] == taker.pid
    assert before < len(m.shards)
    assert temps(cache) == []  # ... and swept by the next stager
    assert all(copy_ok(cache, i) for i in range(len(m.shards)))
    taker.stop()
    assert taker.join(0) == 0 and cache.status()["pid"] == 0


def test_stager_stuck_inside_fork_is_replaced_at_the_next_start(
        dataset: Path, tmp_path: Path, stagers: list[Stager], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A stager that never reaches its own code (CPython < 3.11.10 can leave a forked child stuck
    on an interpreter lock, python/cpython#112275) holds the node's lock and stages nothing;
    the next start() after START_TIMEOUT kills it and forks one that works."""
    import shardio.stage

    real = Stager._child
    marker = tmp_path / "stuck"

    def first_one_stuck(self: Stager, *args: Any) -> None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            real(self, *args)
        time.sleep(600)  # never writes its pid, like a child stuck in PyOS_AfterFork_Child
        os._exit(0)

    monkeypatch.setattr(Stager, "_child", first_one_stuck)
    monkeypatch.setattr(shardio.stage, "START_TIMEOUT", 0.5)
    m = load(dataset)
    cache = NodeCache(tmp_path, dataset, m)
    st = Stager(cache, schedule(m), StageOptions(**FAST))
    stagers.append(st)
    assert st.start(0)
    stuck = st.pid
    assert st.start(0) and st.pid == stuck  # within START_TIMEOUT: left alone
    time.sleep(0.7)
    assert cache.counters()["shards_staged"] == 0
    with caplog.at_level(logging.WARNING, logger="shardio.stage"):
        assert st.start(0)
    assert st.pid not in (None, stuck)
    assert any("still inside fork" in r.getMessage() for r in caplog.records)
    wait_until(lambda: cache.counters()["shards_staged"] == len(m.shards), "the new stager",
               cache)
    assert cache.status()["pid"] == st.pid
    with pytest.raises(ProcessLookupError):
        os.kill(stuck, 0)  # killed and reaped


def test_corrupt_copy_is_caught_on_reuse_and_discard_restages(
        dataset: Path, tmp_path: Path, stagers: list[Stager]) -> None:
    m = load(dataset)
    sched = schedule(m)
    n, steps = len(m.shards), range(0, sum(s.samples for s in m.shards), BATCH)
    cache = NodeCache(tmp_path, dataset, m)
    st = Stager(cache, sched, StageOptions(journal=True, **FAST))
    stagers.append(st)
    assert st.start(0, last_epoch=1)
    wait_until(lambda: cache.status()["idle"] and cache.status()["idle_at"] is None,
               "the stager to stage everything before any report", cache)
    for pos in steps:
        cache.report(0, pos)
        wait_until(lambda pos=pos: cache.status()["idle_at"] == (0, pos), "epoch 0", cache)
    assert cache.counters()["shards_staged"] == n
    later = [int(s) for s, f in zip(sched(1).shards, sched(1).first) if f > 0]
    bad, dropped = later[0], later[1]
    flip_bit(cache.path(bad), 700)
    cache.report(1, 0)  # the stager re-plans for epoch 1: re-verifies what epoch 1 uses
    wait_until(lambda: cache.status()["idle_at"] == (1, 0), "epoch 1 planned", cache)
    counters = cache.counters()
    assert counters["reverify_failures"] == 1
    assert counters["reverified"] == len(later) - 1
    assert counters["shards_staged"] == n + 1 and copy_ok(cache, bad)
    journal = [(r["event"], r["shard"], r["epoch"]) for r in cache.journal()]
    assert journal.index(("corrupt_copy", bad, 1)) < journal.index(("stage", bad, 1))
    cache.discard(dropped, "test")  # as the repair ladder does with a bad copy
    wait_until(lambda: cache.counters()["shards_staged"] == n + 2,
               "the discarded copy staged again", cache)
    assert cache.counters()["discarded"] == 1
    assert cache.lookup(dropped) is not None and copy_ok(cache, dropped)
    journal = [(r["event"], r["shard"], r["epoch"]) for r in cache.journal()]
    assert journal.index(("discard", dropped, 1)) < journal.index(("stage", dropped, 1))
    cache.close()
    assert st.join(10) == 0


# --- progress reports, options ---------------------------------------------------------------
def _report_and_die(cache: NodeCache, epoch: int, pos: int, ready: Any) -> None:
    cache.report(epoch, pos)  # the parent's object, inherited: this process gets its own file
    ready.set()
    time.sleep(30)


def test_frontier_is_the_slowest_live_reader(dataset: Path, tmp_path: Path) -> None:
    m = load(dataset)
    cache = NodeCache(tmp_path, dataset, m)
    assert cache.frontier() is None
    cache.report(1, 40)
    ready = CTX.Event()
    child = fork(_report_and_die, cache, 0, 12, ready)
    assert ready.wait(10)
    assert cache.frontier() == (0, 12)
    assert sorted(os.listdir(cache.progress_dir)) == sorted([str(os.getpid()), str(child.pid)])
    child.kill()
    join(child)
    # As if it had died between writing a progress file and renaming it (a later epoch's).
    Path(cache.progress_dir, f".{child.pid}.shardio-tmp-{child.pid}").write_bytes(b"x")
    assert cache.frontier() == (1, 40)  # a dead reader no longer holds the frontier back ...
    assert os.listdir(cache.progress_dir) == [str(os.getpid())]  # ... its files are removed
    cache.report(2, 0)
    assert cache.frontier() == (2, 0)
    cache.close()
    assert cache.frontier() is None and os.listdir(cache.progress_dir) == []
    with pytest.raises(UsageError):
        cache.report(-1, 0)


def test_a_progress_file_whose_pid_was_reused_is_stale(dataset: Path, tmp_path: Path) -> None:
    """A reader killed at epoch 7 leaves its progress file; when its pid belongs to another
    live process later (pid reuse, per-job pid namespaces), the file must not pass for a live
    reader's: its frontier held every epoch before 7 back (10 of 103 shards staged)."""
    import struct
    import subprocess

    from shardio import nodecache

    cache = NodeCache(tmp_path, dataset, load(dataset))
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        progress = Path(cache.progress_dir, str(other.pid))
        word = nodecache.time_key(7, 0) + 1
        for start, alive in ((nodecache._start_time(other.pid) + 1, False),
                             (nodecache._start_time(other.pid), True)):
            progress.write_bytes(struct.pack("<8sQQ", nodecache._PROGRESS_MAGIC, word, start)
                                 .ljust(nodecache._PROGRESS_BYTES, b"\0"))
            assert (cache.frontier() == (7, 0)) is alive
            assert progress.exists() is alive
    finally:
        other.kill()
        other.wait()
    cache.close()


def test_find_cache_dir_order(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    fb = (str(tmp_path / "missing"), str(c))
    assert find_cache_dir({"SHARDIO_CACHE_DIR": str(a), "SLURM_TMPDIR": str(b)},
                          fallbacks=fb) == str(a)
    assert find_cache_dir({"SHARDIO_CACHE_DIR": str(tmp_path / "nope"), "SLURM_TMPDIR": str(b)},
                          fallbacks=fb) == str(b)
    assert find_cache_dir({"TMPDIR": str(a)}, fallbacks=fb) == str(a)
    assert find_cache_dir({"TMPDIR": "/tmp"}, fallbacks=fb) == str(c)  # plain /tmp comes last
    assert find_cache_dir({}, fallbacks=fb) == str(c)
    assert find_cache_dir({}, fallbacks=(str(tmp_path / "missing"),)) is None
    os.chmod(a, 0o500)
    try:
        if not os.access(a, os.W_OK):  # root writes anywhere
            assert find_cache_dir({"SHARDIO_CACHE_DIR": str(a)}, fallbacks=fb) == str(c)
    finally:
        os.chmod(a, 0o700)


def test_options_and_cache_errors(dataset: Path, tmp_path: Path) -> None:
    opts = StageOptions(budget="10MB", reserve=0, bandwidth="1MiB")
    assert (opts.budget, opts.reserve, opts.bandwidth) == (10_000_000, 0, 1 << 20)
    assert StageOptions().reserve == 1 << 30
    with pytest.raises(UsageError):
        StageOptions(lookahead=-1)
    with pytest.raises(UsageError):
        StageOptions(budget="lots")
    m = load(dataset)
    with pytest.raises(StagingError, match="does not exist"):
        NodeCache(tmp_path / "missing", dataset, m)
    assert NodeCache.from_options(dataset, m, StageOptions()) is None
    cache = NodeCache.from_options(dataset, m, StageOptions(cache_dir="auto"),
                                   env={"SHARDIO_CACHE_DIR": str(tmp_path)})
    assert cache is not None and cache.dir.startswith(str(tmp_path))
    assert os.path.basename(cache.dir).startswith("shardio-") and len(cache.dir.split("-")[-1]) == 16
    with pytest.raises(UsageError):
        Stager(cache, schedule(m)).stage([])


def _start_then_hang(cache_dir: str, root: str, w: int, out: Any) -> None:
    m = Manifest.load(root)
    st = Stager(NodeCache(cache_dir, root, m), schedule(m), StageOptions(**FAST))
    won = st.start(0)
    os.close(w)  # from here only a stager that kept its inherited copy holds the pipe open
    out.put((won, st.pid))
    time.sleep(60)


def test_stager_keeps_no_inherited_fds_and_dies_with_its_parent(dataset: Path,
                                                                tmp_path: Path) -> None:
    m = load(dataset)
    r, w = os.pipe()
    out = CTX.Queue()
    parent = fork(_start_then_hang, str(tmp_path), str(dataset), w, out)
    os.close(w)
    won, stager = out.get(timeout=10)
    assert won and stager
    try:
        assert select.select([r], [], [], 10)[0] and os.read(r, 1) == b""  # EOF: nobody holds w
        cache = NodeCache(tmp_path, dataset, m)
        wait_until(lambda: cache.status()["pid"] == stager, "the stager", cache)
        parent.kill()  # SIGKILL: no cleanup in the parent; PR_SET_PDEATHSIG ends the stager
        join(parent)
        wait_until(lambda: gone(stager), "the orphaned stager to exit", cache)
        taker = Stager(cache, schedule(m), StageOptions(**FAST))
        wait_until(lambda: taker.start(0), "the lock to be free", cache)  # it went with it
        taker.stop()
    finally:
        os.close(r)
        if parent.is_alive():
            parent.kill()


def test_a_use_is_counted_once_whatever_is_decided_for_it(dataset: Path, tmp_path: Path) -> None:
    """A use bypassed while the stager planned ahead, then begun by the readers before it came
    back to it, was counted as both ``bypassed`` and ``skipped_in_use`` (48 of 120 uses in a
    3-epoch run with a small budget): the node counters said more uses than there were."""
    from shardio.stage import _Runner

    m = load(dataset)
    cache = NodeCache(tmp_path, dataset, m)
    runner = _Runner(cache, schedule(m), StageOptions(**FAST), {}, lambda: False)
    for name in ("bypassed", "skipped_in_use", "bypassed"):
        runner._count_use(name, 3, 1)
    runner._count_use("skipped_in_use", 3, 2)  # another use of the shard
    c = cache.counters()
    assert (c["bypassed"], c["skipped_in_use"]) == (1, 1)
    runner.reporters.close()
    cache.close()
