"""ShardDataset / ShardLoader with a node-local cache: staged copies are read instead of the
originals, the order and samples do not change, and each epoch reads the shared store at most once."""

from __future__ import annotations

import faulthandler
import time
from pathlib import Path

import pytest

import shardio
from shardio import Manifest, PackOptions, pack
from shardio.formats import load_index
from tools.faults import flip_bits


@pytest.fixture(autouse=True)
def _deadline():
    faulthandler.dump_traceback_later(120, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def shared(image_tree: Path, tmp_path: Path) -> Path:
    root = tmp_path / "shared" / "ds"
    pack(image_tree, root, PackOptions(samples_per_shard=7, label_from_dir=True, fsync=False))
    return root


def dataset_bytes(root: Path) -> int:
    m = Manifest.load(root)
    return m.total_bytes + sum((root / e.index).stat().st_size for e in m.shards if e.index)


def keys(ds) -> list[str]:
    return [s["__key__"] for s in ds]


def delta(before: dict, after: dict, name: str) -> int:
    return after["repair"][name] - before["repair"][name]


def test_prolog_staging_then_no_shared_reads(shared: Path, tmp_path: Path) -> None:
    cache = tmp_path / "nvme"
    cache.mkdir()
    reference = keys(shardio.ShardDataset(shared, seed=3))
    ds = shardio.ShardDataset(shared, seed=3, cache_dir=str(cache), cache_reserve=0)
    counters = ds.stage([0])
    n = len(Manifest.load(shared).shards)
    assert counters["shards_staged"] == n
    assert counters["bytes_staged"] == dataset_bytes(shared)  # shards and their index files
    before = ds.io_stats()
    assert keys(ds) == reference
    after = ds.io_stats()
    assert delta(before, after, "bytes_original") == 0
    assert delta(before, after, "bytes_cache") > 0
    if ds._stager is not None:
        ds._stager.stop()


def test_live_stager_follows_the_epochs(shared: Path, tmp_path: Path) -> None:
    cache = tmp_path / "nvme"
    cache.mkdir()
    m = Manifest.load(shared)
    ds = shardio.ShardDataset(shared, seed=1, batch_size=4, cache_dir=str(cache), cache_reserve=0)
    plain = shardio.ShardDataset(shared, seed=1, batch_size=4)
    try:
        for epoch in range(3):
            ds.set_epoch(epoch)
            plain.set_epoch(epoch)
            if epoch == 2:  # the whole dataset fits: by now everything is (being) staged
                deadline = time.monotonic() + 60
                while ds.cache.counters()["shards_staged"] < len(m.shards):
                    assert time.monotonic() < deadline, ds.cache.counters()
                    time.sleep(0.05)
            before = ds.io_stats()
            assert keys(ds) == keys(plain)
            after = ds.io_stats()
            if epoch == 2:
                assert delta(before, after, "bytes_original") == 0
        end = ds.io_stats()
        assert end["stage"]["shards_staged"] == len(m.shards)  # each copied once
        # Direct reads (epochs 0-1, of shards not staged yet) plus the one copy of each shard:
        # never more than one pass over the dataset per epoch.
        shared_bytes = end["repair"]["bytes_original"] + end["stage"]["bytes_staged"]
        assert shared_bytes <= 3 * dataset_bytes(shared)
    finally:
        ds._stager.stop()


def test_loader_reads_staged_copies(shared: Path, tmp_path: Path) -> None:
    cache = tmp_path / "nvme"
    cache.mkdir()
    ds = shardio.ShardDataset(shared, seed=2, cache_dir=str(cache), cache_reserve=0)
    ds.stage([0])
    def collate(b):
        return [s["__key__"] for s in b]

    with shardio.ShardLoader(shardio.ShardDataset(shared, seed=2), batch_size=8, num_workers=2,
                             collate_fn=collate) as plain:
        reference = [k for b in plain for k in b]
    with shardio.ShardLoader(ds, batch_size=8, num_workers=2, collate_fn=collate) as ld:
        got = [k for b in ld for k in b]
        stats = ld.stats()
    ds._stager.stop()
    assert got == reference
    assert stats["repair"]["bytes_original"] == 0 and stats["repair"]["bytes_cache"] > 0
    assert stats["stage"]["shards_staged"] == len(Manifest.load(shared).shards)


def test_corrupt_cached_copy_falls_back_and_is_discarded(shared: Path, tmp_path: Path) -> None:
    cache = tmp_path / "nvme"
    cache.mkdir()
    ds = shardio.ShardDataset(shared, shuffle=False, cache_dir=str(cache), cache_reserve=0,
                              stage_lookahead=0)
    ds.stage([0])
    copy = ds.cache.path(1)
    index = load_index("tar", copy)
    jpg = [r for r in range(len(index.f_name)) if index.field_names[index.f_name[r]] == "jpg"][0]
    flip_bits(copy, offset=int(index.f_offset[jpg]) + 100)  # inside a JPEG payload
    reference = keys(shardio.ShardDataset(shared, shuffle=False))
    assert keys(ds) == reference
    c = ds.io_stats()["repair"]
    assert c["checksum_mismatch"] == 1 and c["cache_discarded"] == 1
    assert c["bytes_original"] > 0
    assert ds.cache.lookup(1, wait=0) is None  # the bad copy is gone; the stager recopies it
    if ds._stager is not None:
        ds._stager.stop()


def test_stage_command_for_job_prologs(shared: Path, tmp_path: Path, cli) -> None:
    cache = tmp_path / "nvme"
    cache.mkdir()
    rc, out, err = cli("stage", shared, "--cache", cache, "--epochs", "0..1", "--reserve", "0",
                       "--seed", "5", "--batch-size", "4")
    assert rc == 0, err
    n = len(Manifest.load(shared).shards)
    assert f"copied {n} shard(s)" in out
    rc, out, err = cli("stage", shared, "--cache", cache, "--epochs", "1", "--reserve", "0")
    assert rc == 0 and "copied 0 shard(s)" in out  # already there (and re-verified)
    # the training job picks the staged copies up: nothing is read from the shared store
    ds = shardio.ShardDataset(shared, seed=5, batch_size=4, cache_dir=str(cache),
                              cache_reserve=0)
    before = ds.io_stats()
    assert len(keys(ds)) == Manifest.load(shared).num_samples
    assert delta(before, ds.io_stats(), "bytes_original") == 0
    ds._stager.stop()
    rc, _out, err = cli("stage", shared, "--cache", cache, "--epochs", "2..1")
    assert rc == 2 and "E <= F" in err


def test_stager_stops_when_its_dataset_is_collected(shared: Path, tmp_path: Path) -> None:
    """The stager a dataset forked ends with the dataset, not only with the process (a
    notebook making many datasets kept one stager polling per dataset)."""
    import gc

    import psutil

    (tmp_path / "nvme").mkdir()
    ds = shardio.ShardDataset(shared, cache_dir=str(tmp_path / "nvme"), cache_reserve=0)
    keys(ds)
    pid = ds._stager.pid
    assert pid is not None and psutil.pid_exists(pid)
    del ds
    gc.collect()
    deadline = time.monotonic() + 15
    while psutil.pid_exists(pid):  # stop() reaps it: no zombie either
        assert time.monotonic() < deadline, "the stager outlived its dataset"
        time.sleep(0.05)


def test_a_copy_dropped_between_lookup_and_open_is_not_a_fault(
        shared: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stager evicts a staged copy (unpublishes it, then unlinks it) just after the reader's
    ladder named it: the open fails, and the reader goes on to the original without counting a
    missing copy, a failover or a discard (nothing was wrong with any copy)."""
    from shardio import nodecache

    cache = tmp_path / "nvme"
    cache.mkdir()
    # (No prefetch hints: they open shards ahead through a path that never counts faults.)
    ds = shardio.ShardDataset(shared, shuffle=False, cache_dir=str(cache), cache_reserve=0,
                              stage_lookahead=0, prefetch_shards=False)
    ds.stage([0])
    if ds._stager is not None:
        ds._stager.stop()
    ladder = ds.reader.ladder
    real = ladder.copies

    def copies_then_evict(i: int, sample=None):  # type: ignore[no-untyped-def]
        out = real(i, sample)
        if i == 1 and out[0].kind == "cache":  # what the stager's drop does, in its order
            nodecache._store_u32(ds.cache._mm, nodecache._OFF_STATE + 4 * i,
                                 int(nodecache.ShardState.REMOTE))
            Path(ds.cache.path(1)).unlink()
            Path(ds.cache.index_path(1)).unlink(missing_ok=True)
        return out

    monkeypatch.setattr(ladder, "copies", copies_then_evict)
    before = ds.io_stats()
    assert keys(ds) == keys(shardio.ShardDataset(shared, shuffle=False))
    after = ds.io_stats()
    for name in ("missing", "failovers", "cache_discarded", "index_corrupt", "io_error"):
        assert delta(before, after, name) == 0, name
    assert delta(before, after, "bytes_original") > 0  # shard 1, from the original


def test_a_copy_restaged_after_a_failed_rehash_is_not_read_through_an_old_descriptor(
        shared: Path, tmp_path: Path) -> None:
    """verify=False: the stager re-hashes reused copies, drops a bad one and copies the shard
    again.  The reader had the bad copy open since the last epoch and kept reading the
    unlinked file through that descriptor: corrupt bytes reached the model."""
    cache = tmp_path / "nvme"
    cache.mkdir()
    reference = {s["__key__"]: bytes(s["jpg"])
                 for s in shardio.ShardDataset(shared, shuffle=False)}
    ds = shardio.ShardDataset(shared, shuffle=False, verify=False, cache_dir=str(cache),
                              cache_reserve=0, stage_lookahead=0, prefetch_shards=False)
    ds.stage([0])  # the prolog: every shard staged (this process; no stager forked yet)
    reader = ds.reader
    shard = 1
    first = int(reader.offsets[shard])
    ids = list(range(first, int(reader.offsets[shard + 1])))
    assert [bytes(s["jpg"]) for s in reader.read_ids(ids)] == [
        reference[k] for k in keys_of(shared, ids)]
    assert reader._readers[shard][0].kind == "cache"  # held open, as after an epoch
    copy = ds.cache.path(shard)
    index = load_index("tar", copy)
    jpg = [r for r in range(len(index.f_name)) if index.field_names[index.f_name[r]] == "jpg"][0]
    flip_bits(copy, offset=int(index.f_offset[jpg]) + 100)  # bit rot on the node's disk
    counters = ds.stage([1])  # re-hashes what epoch 1 reuses: drops the copy, stages it again
    assert counters["reverify_failures"] == 1
    got = {s["__key__"]: bytes(s["jpg"]) for s in reader.read_ids(ids)}
    assert got == {k: reference[k] for k in got} and len(got) == len(ids)
    assert reader._readers[shard][0].kind == "cache"  # the new copy
    if ds._stager is not None:
        ds._stager.stop()


def keys_of(root: Path, ids: list[int]) -> list[str]:
    everything = keys(shardio.ShardDataset(root, shuffle=False))
    return [everything[i] for i in ids]


def test_a_reader_that_stops_takes_its_report_back(shared: Path, tmp_path: Path) -> None:
    """A process that peeked at one sample (then trained with DataLoader workers) left its
    report at epoch 0, position 0 for good: the stager's frontier stayed there, so it never
    planned (nor re-hashed copies for) a later epoch."""
    (tmp_path / "nvme").mkdir()
    ds = shardio.ShardDataset(shared, seed=3, batch_size=4, cache_dir=str(tmp_path / "nvme"),
                              cache_reserve=0)
    it = iter(ds)
    next(it)
    assert ds.cache.frontier() == (0, 0)
    del it  # the generator closes: its report goes
    assert ds.cache.frontier() is None
    assert not any(Path(ds.cache.progress_dir).iterdir())
    assert len(keys(ds)) == Manifest.load(shared).num_samples  # a later epoch reports again
    assert ds.cache.frontier() is None  # and takes it back at its end
    ds._stager.stop()


def test_a_cache_disk_full_at_the_start_reads_directly(shared: Path, small_tmpfs: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """A node-local disk already full when the job starts (an earlier job's leftovers) made
    ShardDataset(...) raise StagingError; a full disk means reading without staging."""
    with open(small_tmpfs / "leftover", "wb") as f:
        with pytest.raises(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
    with caplog.at_level("WARNING", logger="shardio.dataset"):
        ds = shardio.ShardDataset(shared, cache_dir=str(small_tmpfs), cache_reserve=0)
    assert ds.cache is None and "reading without staging" in caplog.text
    assert len(keys(ds)) == Manifest.load(shared).num_samples
    with pytest.raises(shardio.errors.StagingError):  # a wrong directory is still an error
        shardio.ShardDataset(shared, cache_dir=str(small_tmpfs / "missing"), cache_reserve=0)


def test_zero_sizes_as_strings_mean_none() -> None:
    """cache_reserve="0" / cache_budget="0" were refused ("size must be positive") although
    StageOptions and `shardio stage --reserve 0` take them."""
    o = shardio.ReadOptions(cache_reserve="0", cache_budget="0")
    assert (o.cache_reserve, o.cache_budget) == (0, 0)
