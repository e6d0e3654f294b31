"""Node-local staging under adversarial conditions: corrupt originals, killed processes, readers
that come and go faster than the stager looks.  Real files and real processes throughout; every
wait has a deadline and stager processes are stopped in ``finally``.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardio
from shardio.manifest import Manifest
from shardio.stage import NodeCache, StageOptions, Stager
from shardio.topology import Topology
from tests.conftest import flip_bit, mounted_tmpfs
from tests.test_stage import (  # noqa: F401  (dataset, stagers: fixtures)
    FAST,
    copy_ok,
    dataset,
    schedule,
    sizes_of,
    stagers,
    wait_until,
)

pytestmark = pytest.mark.timeout(60)




def _copy_dataset(dataset: Path, tmp_path: Path) -> tuple[Path, Manifest]:
    root = tmp_path / "ds"
    shutil.copytree(dataset, root)
    (tmp_path / "cache").mkdir()
    return root, Manifest.load(root)


def _journal(cache: NodeCache, shard: int) -> list[tuple[str, int]]:
    return [(r["event"], r["epoch"]) for r in cache.journal() if r["shard"] == shard]


# --- a corrupt original ------------------------------------------------------------------------
def test_a_corrupt_original_is_read_once_not_once_per_use(dataset: Path, tmp_path: Path) -> None:
    """Staging three epochs ahead read a corrupt original in full for each of its uses (three
    reads, three warnings, verify_failures 3) although it fails the same way every time; with a
    live stager that was two full reads per epoch (lookahead, then again after the re-plan)."""
    root, m = _copy_dataset(dataset, tmp_path)
    bad = 3
    flip_bit(root / m.shards[bad].path, 1000)
    cache = NodeCache(tmp_path / "cache", root, m)
    counters = Stager(cache, schedule(m), StageOptions(journal=True, **FAST)).stage([0, 1, 2])
    sizes = sizes_of(root, m)
    assert counters["verify_failures"] == 1
    assert counters["shards_staged"] == len(m.shards) - 1
    assert counters["bytes_staged"] == sum(sizes)  # every original read once, the bad one too
    assert _journal(cache, bad) == [("verify_failure", 0), ("known_bad", 1), ("known_bad", 2)]
    assert cache.lookup(bad, wait=0) is None and not os.path.exists(cache.path(bad))


def test_a_repaired_original_is_staged_at_its_next_use(dataset: Path, tmp_path: Path,
                                                        stagers: list[Stager]) -> None:
    """What the stager remembers of a bad original ends when the file changes (repaired in
    place: same inode and size), not at the end of the epoch."""
    root, m = _copy_dataset(dataset, tmp_path)
    sched = schedule(m)
    bad = int(sched(0).shards[0])  # the first copy of the walk: the rest leaves time to repair
    flip_bit(root / m.shards[bad].path, 1000)
    cache = NodeCache(tmp_path / "cache", root, m)
    st = Stager(cache, sched, StageOptions(journal=True, bandwidth=250_000, lookahead=1,
                                           reserve="1MiB", poll_interval=0.01))
    stagers.append(st)
    assert st.start(0, last_epoch=1)
    wait_until(lambda: ("verify_failure", 0) in _journal(cache, bad), "the failed copy", cache)
    flip_bit(root / m.shards[bad].path, 1000)  # repaired in place
    wait_until(lambda: ("stage", 1) in _journal(cache, bad), "the repaired shard staged", cache)
    assert _journal(cache, bad) == [("verify_failure", 0), ("stage", 1)]
    assert copy_ok(cache, bad)


# --- the stager's exit after its last epoch ----------------------------------------------------
def test_the_stager_exits_when_readers_passed_its_last_epoch_unseen(
        dataset: Path, tmp_path: Path, stagers: list[Stager]) -> None:
    """``start(last_epoch=1)``: readers that read epoch 1 and left between two looks of the
    stager (a busy or descheduled stager: a long copy, a loaded node) were never seen in it, and
    the stager waited for them for good (``join()`` hung; tests/test_stage.py's four-rank test
    timed out on a loaded 2-core machine)."""
    m = Manifest.load(dataset)
    n = sum(s.samples for s in m.shards)
    cache = NodeCache(tmp_path, dataset, m)
    st = Stager(cache, schedule(m), StageOptions(**FAST))
    stagers.append(st)
    assert st.start(0, last_epoch=1)
    wait_until(lambda: cache.status()["idle"] and cache.status()["idle_at"] is None,
               "the stager to stage everything before any report", cache)
    pid = st.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # it looks at the readers again only after they are gone
    try:
        for e in (0, 1):
            for pos in range(0, n, 4):
                cache.report(e, pos)
        cache.close()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert st.join(10) == 0


# --- the node-affine order and the stager --------------------------------------------------------
def _rank_keys(root: Path, rank: int, cache_dir: Path | None, datasets: list[Any]) -> list[str]:
    """What rank ``rank`` of 4 (two nodes of two ranks) reads in epoch 0 through a ShardLoader
    of batch 4 over a dataset left at ReadOptions.batch_size=1, set_epoch() first."""
    topo = Topology(rank=rank, world_size=4, local_rank=rank % 2, local_world_size=2)
    kw: dict[str, Any] = {} if cache_dir is None else {"cache_dir": str(cache_dir),
                                                       "cache_reserve": 0}
    ds = shardio.ShardDataset(root, seed=5, order="node", topology=topo, **kw)
    datasets.append(ds)
    loader = shardio.ShardLoader(ds, batch_size=4, num_workers=0,
                                 collate_fn=lambda b: [s["__key__"] for s in b])
    loader.set_epoch(0)
    if cache_dir is not None and ds._stager.pid is not None:  # this rank runs the node's stager
        wait_until(lambda: ds.cache.status()["idle"], "the stager to plan and stage", ds.cache)
    return [k for batch in loader for k in batch]


def test_the_stager_does_not_fix_the_node_order_with_another_batch_size(
        dataset: Path, tmp_path: Path) -> None:
    """The stager (forked at set_epoch(), sharing the dataset's shared array) computed its
    schedule with ReadOptions.batch_size and so settled the node-affine order's parameters
    (C, U, q) with it, on the stager's rank only; the ShardLoader's batch size settled them on
    the other ranks.  The ranks split different orders: of 60 samples, some were delivered
    twice in the epoch and others never."""
    datasets: list[Any] = []
    try:
        (tmp_path / "c0").mkdir()
        (tmp_path / "c1").mkdir()
        staged = [_rank_keys(dataset, r, tmp_path / f"c{r // 2}", datasets) for r in range(4)]
        plain = [_rank_keys(dataset, r, None, datasets) for r in range(4)]
        assert staged == plain
        assert {d._node_order for d in datasets} == {datasets[-1]._node_order}
    finally:
        for d in datasets:
            if d._stager is not None:
                d._stager.stop()


def test_the_stager_follows_the_loaders_batch_size_after_set_epoch(dataset: Path,
                                                                  tmp_path: Path) -> None:
    """set_epoch() before the ShardLoader's first iteration (the usual loop) made the node's
    stager with ReadOptions.batch_size (1); the loader's own batch size (8) did not replace it,
    so on a job of several nodes it staged the shards of another slicing of the epoch: here
    shards 9 and 10, which node 0 reads in epoch 1, were never staged (read from the shared
    filesystem), while shards it does not read were."""
    topo = Topology(rank=0, world_size=4, local_rank=0, local_world_size=1)  # 4 nodes
    ds = shardio.ShardDataset(dataset, seed=3, topology=topo, cache_dir=str(tmp_path),
                              cache_reserve=0)
    try:
        loader = shardio.ShardLoader(ds, batch_size=8, num_workers=0,
                                     collate_fn=lambda b: [s["__key__"] for s in b])
        loader.set_epoch(0)
        wait_until(lambda: ds.cache.status()["idle"], "the stager made by set_epoch", ds.cache)
        assert sum(1 for _ in loader) == 2  # 15 samples per rank, batches of 8
        wait_until(lambda: ds.cache.status()["idle"], "the stager to plan epochs 0-1", ds.cache)
        needed = set(ds.schedule(1, 8).shards.tolist())
        assert {9, 10} <= needed - set(ds.schedule(0, 1).shards.tolist()) - set(
            ds.schedule(1, 1).shards.tolist())  # (what the test is about: see the docstring)
        assert {i for i in needed if ds.cache.lookup(i, wait=0) is None} == set()
    finally:
        if ds._stager is not None:
            ds._stager.stop()


# --- epochs planned ------------------------------------------------------------------------------
def test_readers_that_go_back_to_an_earlier_epoch_are_staged_for(
        dataset: Path, tmp_path: Path, stagers: list[Stager]) -> None:
    """A stager started at epoch 2 plans no epoch before 2 (its floor, against stale reports),
    and a later start(0) (set_epoch(0) after a rollback to an earlier checkpoint) found it
    running and left it so: while the readers read epoch 0 it staged epochs 2-3 (within a
    budget of a few shards, evicting for them) and nothing of epoch 0."""
    m = Manifest.load(dataset)
    cache = NodeCache(tmp_path, dataset, m)
    st = Stager(cache, schedule(m), StageOptions(budget="150KB", journal=True, **FAST))
    stagers.append(st)
    assert st.start(2)
    wait_until(lambda: cache.status()["idle"], "epochs 2-3 planned", cache)
    assert {r["epoch"] for r in cache.journal() if r["event"] == "stage"} == {2}
    assert st.start(0)
    for pos in (0, 8, 16):
        cache.report(0, pos)
        wait_until(lambda pos=pos: cache.status()["idle_at"] == (0, pos), "epoch 0", cache)
    assert any(r["event"] == "stage" and r["epoch"] == 0 for r in cache.journal())
    cache.close()


# --- a full cache filesystem ---------------------------------------------------------------------
def test_a_stager_on_a_full_cache_filesystem_is_not_taken_for_one_stuck_in_fork(
        dataset: Path, small_tmpfs: Path, stagers: list[Stager],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A stager records its pid in the lock file, which a full cache filesystem refuses (it
    carries on: the write is informational); start() then took the healthy stager for one stuck
    inside fork once START_TIMEOUT had passed, SIGKILLed it (mid-copy) and forked another, at
    every epoch, with a warning that blamed CPython."""
    import shardio.stage

    monkeypatch.setattr(shardio.stage, "START_TIMEOUT", 0.5)
    m = Manifest.load(dataset)
    cache = NodeCache(small_tmpfs, dataset, m)
    with open(small_tmpfs / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        while True:
            f.write(b"\0" * 65536)
    st = Stager(cache, schedule(m), StageOptions(reserve=0, poll_interval=0.01))
    stagers.append(st)
    assert st.start(0)
    first = st.pid
    wait_until(lambda: cache.status()["pid"] == first, "the stager", cache)
    time.sleep(0.7)
    with caplog.at_level("WARNING", logger="shardio.stage"):
        assert st.start(1)
    assert st.pid == first
    assert not any("inside fork" in r.getMessage() for r in caplog.records)


def test_an_index_file_missing_for_a_while_is_staged_once_back(
        dataset: Path, tmp_path: Path, stagers: list[Stager]) -> None:
    """The stager took the size of a shard's index file when it first planned the shard, and
    kept 0 when the file could not be stat'ed (gone for a moment: being restored or rewritten,
    a transient error of the shared filesystem).  Every later copy then compared the whole
    index with 0 bytes and failed as a corrupt original ("run `shardio verify`") for as long as
    the stager ran, though the file was back and good."""
    root, m = _copy_dataset(dataset, tmp_path)
    sched = schedule(m)
    gone = int(sched(0).shards[0])  # the first copy of the walk: the rest leaves time to restore
    index = root / str(m.shards[gone].index)
    os.rename(index, tmp_path / "away")
    cache = NodeCache(tmp_path / "cache", root, m)
    st = Stager(cache, sched, StageOptions(journal=True, bandwidth=250_000, lookahead=1,
                                           reserve="1MiB", poll_interval=0.01))
    stagers.append(st)
    assert st.start(0)
    wait_until(lambda: ("read_error", 0) in _journal(cache, gone), "the failed copy", cache)
    os.rename(tmp_path / "away", index)
    wait_until(lambda: any(e == 1 for _, e in _journal(cache, gone)), "its epoch-1 use", cache)
    assert _journal(cache, gone) == [("read_error", 0), ("stage", 1)]
    assert copy_ok(cache, gone) and cache.counters()["verify_failures"] == 0


@pytest.fixture
def few_inodes_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real tmpfs of 2 MiB and 64 inodes, unmounted after the test; skipped where mounting is
    not permitted."""
    yield from mounted_tmpfs(tmp_path / "mnt", "size=2m,nr_inodes=64")


def test_a_cache_filesystem_full_when_staging_starts_reads_directly(
        dataset: Path, few_inodes_tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The cache filesystem filled up (here its inodes: a files quota does the same) between
    making the dataset and the first set_epoch(), which creates the stager's lock file:
    set_epoch() and every iteration raised StagingError, where a full disk means reading
    directly (as when it is full when the dataset is made, or fills up later)."""
    ds = shardio.ShardDataset(dataset, seed=1, cache_dir=str(few_inodes_tmpfs), cache_reserve=0)
    try:
        with pytest.raises(OSError):
            for i in range(100):
                (few_inodes_tmpfs / f"f{i}").touch()
        with caplog.at_level("WARNING", logger="shardio.dataset"):
            ds.set_epoch(0)
            assert len(list(ds)) == Manifest.load(dataset).num_samples
        assert "reading without staging" in caplog.text
    finally:
        if ds._stager is not None:
            ds._stager.stop()


# --- progress reports --------------------------------------------------------------------------
def test_two_datasets_over_the_same_data_in_one_process_report_apart(
        dataset: Path, tmp_path: Path) -> None:
    """Both NodeCaches of one process wrote .progress/<pid>: a second ShardDataset over the same
    data (an evaluation pass in the training process, a deep copy) replaced the training
    reader's file, then removed it when its pass ended, and the stager saw no reader for the
    rest of the training epoch (it copied shards already read and skipped none in use)."""
    train = shardio.ShardDataset(dataset, seed=1, batch_size=4, cache_dir=str(tmp_path),
                                 cache_reserve=0)
    other = shardio.ShardDataset(dataset, shuffle=False, batch_size=4, cache_dir=str(tmp_path),
                                 cache_reserve=0)
    try:
        train.set_epoch(3)
        it = iter(train)
        next(it)
        assert train.cache.frontier() == (3, 0)
        it2 = iter(other)
        next(it2)
        assert train.cache.frontier() == (0, 0)  # the slowest of the two readers
        assert len(list(it2)) == Manifest.load(dataset).num_samples - 1
        for _ in range(4):
            next(it)
        assert train.cache.frontier() == (3, 4)
        it.close()
        assert train.cache.frontier() is None
        assert os.listdir(train.cache.progress_dir) == []
    finally:
        for d in (train, other):
            if d._stager is not None:
                d._stager.stop()
