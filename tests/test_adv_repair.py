"""Adversarial checks of self-repair and the HDF5 format: each test pins a bug found and fixed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import shardio
from shardio import Manifest, PackOptions, pack
from shardio.errors import UnrepairableError
from shardio.reader import DatasetReader
from tests.test_repair import data, flip_sample  # noqa: F401  (data: the fixture)
from tools.faults import corrupt_dataset, flip_bits


def repair_counts(ds: shardio.ShardDataset) -> dict[str, int]:
    return {k: v for k, v in ds.reader.counters.snapshot().items()
            if v and not k.startswith("bytes") and k not in ("opens", "stats")}


@pytest.mark.parametrize("shuffle", [False, True])
def test_skip_counts_a_lost_shard_once_not_per_sample(data, shuffle: bool) -> None:
    """A shard missing from every copy under on_corrupt="skip" is one event per copy and one
    give-up; each of its samples is one skip.  (Each sample tried every copy again: 2 faults,
    a failover and an `unrepairable` per sample, and two warnings logged per sample.)"""
    root, replica, clean = data
    corrupt_dataset(str(root), [4], "truncate", seed=1)
    corrupt_dataset(str(replica), [4], "delete")
    lost = Manifest.load(root).shards[4].samples
    ds = shardio.ShardDataset(root, shuffle=shuffle, seed=2, replicas=[str(replica)],
                              on_corrupt="skip")
    got = [s["__key__"] for s in ds]
    assert len(got) == len(clean) and len(set(got)) == len(clean) - lost
    assert repair_counts(ds) == {"truncated": 1, "missing": 1, "failovers": 1,
                                 "unrepairable": 1, "skipped_samples": lost}
    # Random access to a sample of the lost shard still names the copies tried.
    with pytest.raises(UnrepairableError, match="truncated.*missing"):
        ds.reader[int(ds.reader.offsets[4]) + 2]


def test_skip_does_not_count_a_missing_original_again_per_skipped_sample(data) -> None:
    """The original missing, the replica bad at two samples: each bad sample is skipped, and
    the missing original is one fault (it was tried again after each give-up and counted
    again)."""
    root, replica, clean = data
    corrupt_dataset(str(root), [3], "delete")
    flip_sample(replica, 3, 2)
    flip_sample(replica, 3, 6)
    ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(replica)], on_corrupt="skip")
    got = [(s["__key__"], s["jpg"]) for s in ds]
    assert set(got) <= set(clean) and len(set(got)) == len(clean) - 2
    c = repair_counts(ds)
    assert (c["missing"], c["checksum_mismatch"], c["unrepairable"], c["skipped_samples"]) \
        == (1, 2, 2, 2)


@pytest.fixture
def h5data(mixed_tree: Path, tmp_path: Path) -> tuple[Path, Path, list[dict]]:
    """An HDF5 dataset (zstd with a dictionary, a 0-byte field), a replica, its clean samples."""
    root = tmp_path / "h5"
    pack(mixed_tree, root, PackOptions(format="hdf5", samples_per_shard=10, compress="zstd",
                                       zstd_dict=True, fsync=False))
    replica = tmp_path / "h5replica"
    shutil.copytree(root, replica)
    with DatasetReader(root) as r:
        clean = list(r)
    return root, replica, clean


def test_hdf5_attribute_not_utf8_fails_over_to_the_replica(h5data) -> None:
    """A bit flipped in the text of an HDF5 shard's ``shardio_meta`` attribute makes it invalid
    UTF-8, which h5py hands out with surrogate escapes: hashing it for ``index_digest`` raised a
    bare UnicodeEncodeError out of the read (no failover, not a shardio error)."""
    root, replica, clean = h5data
    path = root / Manifest.load(root).shards[1].path
    data = bytearray(path.read_bytes())
    at = data.find(b'{"job_shard"')
    assert at > 0
    data[at + 3] ^= 0x80
    path.write_bytes(bytes(data))
    with DatasetReader(root, replicas=[str(replica)]) as r:
        assert list(r) == clean
        c = r.counters.snapshot()
    assert (c["index_corrupt"], c["failovers"], c["unrepairable"]) == (1, 1, 0)


_POLLER = """
import os, sys, time
path, stop, ready = sys.argv[1:4]
open(ready, "w").close()
gone = looks = 0
while not os.path.exists(stop):
    looks += 1
    if not os.path.exists(path):
        gone += 1
print(looks, gone)
"""


def test_quarantine_never_leaves_the_shard_missing(tmp_path: Path) -> None:
    """While a bad original is quarantined and restored from a good copy, the shard is at its
    path all along: another reader of the dataset (another job's, with no replica) must never
    find it missing.  (It was moved into .quarantine first and copied back only afterwards: a
    reader in between failed with ShardNotFoundError.)  Two quarantines within one second keep
    both bad copies (the second overwrote the first)."""
    import subprocess
    import sys
    import time

    from shardio.repair import RepairCounters, restore_original
    from tests.conftest import pack_bin_dataset

    root = pack_bin_dataset(tmp_path, 24, lambda i: bytes([i]) * (1 << 20), 1, 24, lambda i: False)
    replica = tmp_path / "replica"
    shutil.copytree(root, replica)
    m = Manifest.load(root)
    entry = m.shards[0]
    original = root / entry.path
    stop, ready = tmp_path / "stop", tmp_path / "ready"
    counters = RepairCounters()
    for round_ in range(2):
        flip_bits(original, 1000 + round_)
        stop.unlink(missing_ok=True)
        ready.unlink(missing_ok=True)
        poller = subprocess.Popen([sys.executable, "-c", _POLLER, str(original), str(stop),
                                   str(ready)], stdout=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 20
            while not ready.exists():
                assert time.monotonic() < deadline, "the poller did not start"
                time.sleep(0.01)
            assert restore_original(str(root), entry, str(replica / entry.path), counters, m)
        finally:
            stop.touch()
            out, _ = poller.communicate(timeout=20)
        looks, gone = map(int, out.split())
        assert looks > 0 and gone == 0
    assert (counters.get("quarantined"), counters.get("originals_restored")) == (2, 2)
    assert len(list((root / ".quarantine").iterdir())) == 2
    with DatasetReader(root) as r:
        assert len(list(r)) == 24


@pytest.mark.parametrize("replica_too", [False, True])
def test_zero_copy_loader_counts_a_fault_once(data, replica_too: bool) -> None:
    """ShardLoader(zero_copy=True) sizes each batch's ring claim (DatasetReader.read_bytes)
    before reading it; sizing opened the shards down the repair ladder, so a shard with no good
    copy had its faults and its give-up counted (and logged) twice, once by the sizing and once
    by the read."""
    from shardio.errors import WorkerError

    root, replica, clean = data
    corrupt_dataset(str(root), [2], "delete")
    if replica_too:
        corrupt_dataset(str(replica), [2], "delete")
    ds = shardio.ShardDataset(root, shuffle=False, batch_size=4, replicas=[str(replica)],
                              zero_copy=True)
    with shardio.ShardLoader(ds, batch_size=4, num_workers=1) as ld:
        if replica_too:
            with pytest.raises(WorkerError, match="UnrepairableError"):
                for _ in ld:
                    pass
        else:
            got = [(k, bytes(j)) for b in ld for k, j in zip(b["__key__"], b["jpg"])]
            assert got == clean
        c = {k: v for k, v in ld.stats()["repair"].items() if v and k in (
            "missing", "failovers", "unrepairable")}
    assert c == ({"missing": 2, "failovers": 1, "unrepairable": 1} if replica_too
                 else {"missing": 1, "failovers": 1})


@pytest.mark.parametrize("replica_too", [False, True])
def test_a_worker_corrupt_error_reaches_main_as_itself(data, replica_too: bool) -> None:
    """Under on_corrupt="raise" a ShardLoader worker's ChecksumMismatchError (one copy) or
    UnrepairableError (every copy bad) is the WorkerError's ``__cause__``, with its attributes,
    as documented.  (Neither unpickled: their __init__ takes the shard, key, ... rather than
    the message, so the cause arrived as a RuntimeError and ``except ShardCorruptError`` on
    it missed.)"""
    import pickle

    from shardio.errors import ChecksumMismatchError, ShardCorruptError, WorkerError

    root, replica, _clean = data
    flip_sample(root, 1, 4)
    if replica_too:
        flip_sample(replica, 1, 4)
    ds = shardio.ShardDataset(root, shuffle=False, batch_size=4,
                              replicas=[str(replica)] if replica_too else [])
    with shardio.ShardLoader(ds, batch_size=4, num_workers=1) as ld:
        with pytest.raises(WorkerError) as err:
            for _ in ld:
                pass
    cause = err.value.__cause__
    assert isinstance(cause, ShardCorruptError)
    if replica_too:
        assert isinstance(cause, UnrepairableError) and len(cause.attempts) == 2
    else:
        assert isinstance(cause, ChecksumMismatchError)
        assert cause.field == "jpg" and cause.key and cause.shard.endswith(".tar")
    again = pickle.loads(pickle.dumps(cause))
    assert type(again) is type(cause) and str(again) == str(cause)
    assert again.__dict__ == cause.__dict__


def test_no_failover_is_counted_when_no_copy_is_left_for_the_sample(data) -> None:
    """Sample 2 of shard 3 bad in the original, the replica's shard missing: one failover
    (original -> replica), not two.  (A copy that failed to open was checked for copies left
    for the whole shard, not for the sample being read: the original, bad for that sample,
    counted as a copy to fail over to, and the log said "trying the next copy" before the
    give-up.)"""
    root, replica, clean = data
    flip_sample(root, 3, 2)
    corrupt_dataset(str(replica), [3], "delete")
    ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(replica)], on_corrupt="skip")
    got = [(s["__key__"], s["jpg"]) for s in ds]
    assert set(got) <= set(clean) and len(set(got)) == len(clean) - 1
    assert repair_counts(ds) == {"checksum_mismatch": 1, "missing": 1, "failovers": 1,
                                 "unrepairable": 1, "skipped_samples": 1}


def test_two_damaged_shards_of_one_parity_group(image_tree: Path, tmp_path: Path) -> None:
    """Parity 3+1 with two shards of one group damaged (one bad sample each): parity cannot
    rebuild either, so each bad sample is skipped, every other sample delivered, and each
    damaged shard counts one fault, one failover (to parity) and one parity failure."""
    pytest.importorskip("zfec")
    root = tmp_path / "ds"
    pack(image_tree, root, PackOptions(samples_per_shard=9, label_from_dir=True, fsync=False,
                                       parity="3+1"))
    with DatasetReader(root) as r:
        clean = [(s["__key__"], s["jpg"]) for s in r]
    flip_sample(root, 0, 3)
    flip_sample(root, 1, 5)
    ds = shardio.ShardDataset(root, shuffle=False, on_corrupt="skip")
    got = [(s["__key__"], s["jpg"]) for s in ds]
    assert set(got) <= set(clean) and len(set(got)) == len(clean) - 2
    assert repair_counts(ds) == {"checksum_mismatch": 2, "failovers": 2, "parity_failed": 2,
                                 "unrepairable": 2, "skipped_samples": 2}


def test_offline_repair_uses_parity_after_the_replicas(image_tree: Path, tmp_path: Path) -> None:
    """Shards 0 and 1 of a 3+1 parity group lost; the replica has shard 1 only.  Restoring
    shard 1 from the replica leaves one loss in the group, which parity rebuilds: both are
    repaired.  (Shards were repaired in manifest order, each trying parity right away: shard 0
    found two losses in its group and stayed unrepaired.)"""
    pytest.importorskip("zfec")
    from shardio.repair import repair_dataset
    from shardio.verify import verify_dataset

    root, replica = tmp_path / "ds", tmp_path / "replica"
    pack(image_tree, root, PackOptions(samples_per_shard=9, label_from_dir=True, fsync=False,
                                       parity="3+1"))
    shutil.copytree(root, replica)
    corrupt_dataset(str(root), [0, 1], "delete")
    corrupt_dataset(str(replica), [0], "delete")
    report = repair_dataset(str(root), replicas=[str(replica)])
    assert report.ok and report.unrepaired == []
    assert sorted(report.repaired) == [("shard-000000.tar", "parity"),
                                       ("shard-000001.tar", f"replica {replica}")]
    assert verify_dataset(str(root)) == []


def test_eio_reading_an_hdf5_index_is_an_io_error(h5data, tmp_path: Path) -> None:
    """A real EIO (strace fails the first ``pread64`` of the shard, h5py reading its
    superblock) is counted as ``io_error`` and the replica serves the shard.  (Every h5py
    OSError was taken for damaged metadata: counted as ``index_corrupt``.)"""
    import textwrap

    from tests.conftest import run_with_eio

    root, replica, clean = h5data
    script = tmp_path / "read.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        from shardio.reader import DatasetReader
        r = DatasetReader({str(root)!r}, replicas=[{str(replica)!r}])
        keys = [s["__key__"] for s in r]
        print(json.dumps({{"n": len(keys), "counters": r.counters.snapshot()}}))
    """))
    out = run_with_eio(script, root / Manifest.load(root).shards[2].path, "pread64", when=1)
    assert out["n"] == len(clean)
    c = out["counters"]
    assert (c["io_error"], c["index_corrupt"], c["failovers"]) == (1, 0, 1)


@pytest.mark.parametrize("replica_too", [False, True])
def test_dataloader_worker_corrupt_error_is_a_shard_corrupt_error(data, replica_too: bool) -> None:
    """torch's DataLoader re-raises a worker's exception as ``type(exc)(message)``; neither
    ChecksumMismatchError nor UnrepairableError took a message alone, so torch raised a plain
    RuntimeError and the documented ``except ShardCorruptError`` missed it."""
    from torch.utils.data import DataLoader

    from shardio.errors import ChecksumMismatchError, ShardCorruptError

    root, replica, _clean = data
    flip_sample(root, 1, 4)
    if replica_too:
        corrupt_dataset(str(replica), [1], "delete")
    ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(replica)] if replica_too else [])
    with pytest.raises(ShardCorruptError, match="Caught .*Error in DataLoader worker") as err:
        list(DataLoader(ds, batch_size=None, num_workers=1, timeout=60))
    assert type(err.value) is (UnrepairableError if replica_too else ChecksumMismatchError)
