"""Self-repair (shardio.repair): faults in originals and copies, the ladder, counters, offline repair.

Every test reads the whole epoch and compares it with a clean reference read: zero corrupt or
missing samples delivered, the same samples in the same order, and the counters say what happened.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import numpy as np
import pytest

import shardio
from shardio import Manifest, PackOptions, pack
from shardio.errors import (
    ChecksumMismatchError,
    ManifestCorruptError,
    ShardNotFoundError,
    UnrepairableError,
)
from shardio.reader import DatasetReader
from shardio.verify import verify_dataset
from tests.conftest import run_with_eio
from tools.faults import corrupt_dataset, flip_bits

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def data(image_tree: Path, tmp_path: Path) -> tuple[Path, Path, list[tuple[str, bytes]]]:
    """A packed dataset (7 tar shards), a byte-identical replica, and its clean sample list."""
    root = tmp_path / "ds"
    pack(image_tree, root, PackOptions(samples_per_shard=9, label_from_dir=True, fsync=False))
    replica = tmp_path / "replica"
    shutil.copytree(root, replica)
    with DatasetReader(root) as r:
        clean = [(s["__key__"], s["jpg"]) for s in r]
    return root, replica, clean


def epoch(ds: shardio.ShardDataset) -> list[tuple[str, bytes]]:
    return [(s["__key__"], s["jpg"]) for s in ds]


def by_key(samples: list[tuple[str, bytes]]) -> dict[str, bytes]:
    return dict(samples)


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_bad_original_is_read_from_the_replica(data, how: str) -> None:
    root, replica, clean = data
    corrupt_dataset(str(root), [2, 5], how, seed=3)
    reference = epoch(shardio.ShardDataset(replica, seed=4))
    ds = shardio.ShardDataset(root, seed=4, replicas=[str(replica)])
    assert epoch(ds) == reference  # same samples, same order, nothing corrupt
    c = ds.reader.counters.snapshot()
    kind = {"flip": "checksum_mismatch", "truncate": "truncated", "delete": "missing"}[how]
    assert c[kind] == 2 and c["failovers"] == 2
    assert c["bytes_replica"] > 0 and c["originals_restored"] == 0
    assert verify_dataset(str(root))  # without quarantine the original stays as it was


def test_quarantine_restores_the_original(data) -> None:
    root, replica, clean = data
    corrupt_dataset(str(root), [1], "flip", seed=1)
    ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(replica)], quarantine=True)
    assert by_key(epoch(ds)) == by_key(clean)
    c = ds.reader.counters.snapshot()
    assert c["checksum_mismatch"] == 1 and c["quarantined"] == 1
    assert c["originals_restored"] == 1
    assert verify_dataset(str(root)) == []
    quarantined = list((root / ".quarantine").iterdir())
    assert len(quarantined) == 1 and quarantined[0].name.startswith("shard-000001.tar.")


def test_no_good_copy_raises_or_skips(data) -> None:
    root, replica, clean = data
    corrupt_dataset(str(root), [3], "flip", seed=2)
    corrupt_dataset(str(replica), [3], "flip", seed=2)  # the same sample, bad in both copies
    ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(replica)])
    with pytest.raises(UnrepairableError, match="no good copy left.*replica") as err:
        epoch(ds)
    assert isinstance(err.value.__cause__, ChecksumMismatchError)
    assert len(err.value.attempts) == 2

    ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(replica)], on_corrupt="skip")
    got = epoch(ds)
    assert len(got) == len(clean)  # the batch stays full: a repeat takes the bad sample's place
    assert len(set(got)) == len(clean) - 1 and set(got) <= set(clean)  # exactly the bad one out
    assert ds.reader.counters.get("skipped_samples") == 1


def flip_sample(root: Path, shard: int, sample: int) -> None:
    """Flip one bit in the middle of the ``jpg`` field of ``sample`` of ``shard``."""
    with DatasetReader(root) as r:
        index = r.shard_index(shard)
    row = next(j for j in index.rows(sample) if index.field_names[int(index.f_name[j])] == "jpg")
    offset = int(index.f_offset[row]) + int(index.f_length[row]) // 2
    flip_bits(root / Manifest.load(root).shards[shard].path, offset)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("on_corrupt", ["raise", "skip"])
def test_samples_bad_in_different_copies_are_all_delivered(data, shuffle: bool,
                                                           on_corrupt: str) -> None:
    """Sample 2 of shard 3 is bad in the original, sample 6 in the replica: every sample still
    has a good copy, so the epoch is whole.  (Before, the original, once bad for sample 2, was
    not tried again for sample 6: an UnrepairableError, or a skipped sample.)"""
    root, replica, clean = data
    reference = epoch(shardio.ShardDataset(replica, seed=5, shuffle=shuffle))
    flip_sample(root, 3, 2)
    flip_sample(replica, 3, 6)
    ds = shardio.ShardDataset(root, seed=5, shuffle=shuffle, replicas=[str(replica)],
                              on_corrupt=on_corrupt)
    assert epoch(ds) == reference
    c = ds.reader.counters.snapshot()
    assert c["unrepairable"] == 0 and c["skipped_samples"] == 0
    assert 1 <= c["checksum_mismatch"] <= 2  # the replica's bad sample is met only if read there
    assert epoch(ds) == reference  # again, with both copies' bad samples known


def test_a_replica_of_another_version_is_never_served(image_tree: Path, tmp_path: Path) -> None:
    """A replica packed from other bytes under the same keys is self-consistent (its fields
    match its own index's checksums), but its index is not the manifest's: when the original
    cannot serve, the reader must not deliver that other version."""
    root, other = tmp_path / "ds", tmp_path / "other"
    opts = PackOptions(samples_per_shard=9, label_from_dir=True, fsync=False)
    pack(image_tree, root, opts)
    changed = tmp_path / "changed"
    shutil.copytree(image_tree, changed)
    for f in sorted(changed.rglob("*.jpg")):
        f.write_bytes(f.read_bytes() + b"v2")  # same keys, same counts, other bytes
    pack(changed, other, opts)
    idx = root / (Manifest.load(root).shards[2].path + ".idx")
    idx.unlink()  # the original cannot serve shard 2: the ladder goes to the replica
    ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(other)])
    with pytest.raises(UnrepairableError, match="no good copy left") as err:
        epoch(ds)
    assert "index_corrupt" in str(err.value)
    assert "does not match the manifest" in str(err.value.__cause__)
    ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(other)], on_corrupt="skip")
    with DatasetReader(other) as r:
        theirs = {s["__key__"]: s["jpg"] for s in r}
    got = epoch(ds)
    assert all(theirs[key] != jpg for key, jpg in got)  # not one sample of the other version
    assert ds.reader.counters.get("skipped_samples") == 9


@pytest.mark.parametrize("shuffle", [False, True])
def test_lost_shard_is_skipped_and_counted_once_per_event(data, shuffle: bool) -> None:
    """A shard gone from both copies, under on_corrupt="skip": every order skips exactly its
    samples and counts each event once (a shuffled epoch reads single samples, whose retry
    once raised UnrepairableError, or re-read the failed copy and counted its fault twice;
    each sample then tried both copies again, counting two faults and a give-up per sample)."""
    root, replica, clean = data
    corrupt_dataset(str(root), [2], "delete")
    corrupt_dataset(str(replica), [2], "delete")
    lost = Manifest.load(str(root)).shards[2].samples
    ds = shardio.ShardDataset(root, shuffle=shuffle, seed=5, replicas=[str(replica)],
                              on_corrupt="skip")
    got = epoch(ds)
    assert len(got) == len(clean) and set(got) <= set(clean)  # repeats fill the batches
    assert len(set(got)) == len(clean) - lost
    c = ds.reader.counters.snapshot()
    # The original and the replica found missing once (one failover, from the original to
    # the replica: none after the last copy), the shard given up once, each sample skipped.
    assert (c["missing"], c["failovers"], c["unrepairable"]) == (2, 1, 1)
    assert c["skipped_samples"] == lost


@pytest.mark.parametrize("loader", ["dataloader", "shardloader"])
def test_skip_keeps_every_rank_at_the_same_full_batches(data, loader: str) -> None:
    """Two ranks, one of them meeting a lost shard under on_corrupt="skip": both yield the
    same number of full batches (the short rank once yielded a batch less: a DDP hang), and
    the resume position after k batches is the same as without the loss."""
    from torch.utils.data import DataLoader

    root, replica, _clean = data
    corrupt_dataset(str(root), [1], "delete")

    def run(where: Path, rank: int) -> tuple[list[list[str]], int]:
        ds = shardio.ShardDataset(where, batch_size=4, shuffle=False, on_corrupt="skip",
                                  topology=shardio.Topology(rank=rank, world_size=2))
        keys = lambda b: [s["__key__"] for s in b]  # noqa: E731
        if loader == "dataloader":
            batches = list(DataLoader(ds, batch_size=4, collate_fn=keys))
        else:
            with shardio.ShardLoader(ds, batch_size=4, num_workers=2, collate_fn=keys) as ld:
                batches = list(ld)
        return batches, ds.io_stats()["repair"]["skipped_samples"]

    lost = 0
    for rank in range(2):
        clean, _ = run(replica, rank)
        got, skipped = run(root, rank)
        assert [len(b) for b in got] == [len(b) for b in clean]  # same batches, all full
        lost += skipped
    assert lost == Manifest.load(str(root)).shards[1].samples


def test_skip_fills_a_first_batch_lost_entirely(data) -> None:
    """With nothing read yet, the stand-in is the dataset's first readable sample (found
    without counting faults); with nothing readable at all, a typed error, not a short
    batch."""
    root, _replica, clean = data
    corrupt_dataset(str(root), [0], "delete")
    ds = shardio.ShardDataset(root, batch_size=4, shuffle=False, on_corrupt="skip")
    got = epoch(ds)
    lost = Manifest.load(str(root)).shards[0].samples
    assert len(got) == len(clean) and got[:lost] == [clean[lost]] * lost
    assert ds.io_stats()["repair"]["skipped_samples"] == lost
    corrupt_dataset(str(root), range(1, len(Manifest.load(str(root)).shards)), "delete")
    ds = shardio.ShardDataset(root, batch_size=4, shuffle=False, on_corrupt="skip")
    with pytest.raises(UnrepairableError, match="no readable sample left"):
        epoch(ds)


def test_single_copy_keeps_the_typed_error(data) -> None:
    root, _replica, _clean = data
    corrupt_dataset(str(root), [0], "delete")
    with pytest.raises(ShardNotFoundError, match="missing"):
        epoch(shardio.ShardDataset(root, shuffle=False))


def test_parity_rebuilds_a_lost_shard_while_reading(image_tree: Path, tmp_path: Path) -> None:
    pytest.importorskip("zfec")
    root = tmp_path / "ds"
    pack(image_tree, root, PackOptions(samples_per_shard=9, fsync=False, parity="3+1"))
    assert Manifest.load(root).parity["k"] == 3
    with DatasetReader(root) as r:
        clean = [(s["__key__"], s["jpg"]) for s in r]
    corrupt_dataset(str(root), [4], "delete")
    corrupt_dataset(str(root), [1], "flip", seed=5)
    ds = shardio.ShardDataset(root, shuffle=False)
    assert epoch(ds) == clean
    c = ds.reader.counters.snapshot()
    assert c["parity_rebuilt"] == 2 and c["missing"] == 1 and c["checksum_mismatch"] == 1


def _lost_with_its_index(image_tree: Path, tmp_path: Path,
                         shard: int) -> tuple[Path, list[tuple[str, bytes]]]:
    """A dataset packed with parity 3+1 whose tar ``shard`` was lost with its ``.idx``, read
    once (which rebuilds both); and its clean sample list."""
    pytest.importorskip("zfec")
    root = tmp_path / "ds"
    pack(image_tree, root, PackOptions(samples_per_shard=9, fsync=False, parity="3+1"))
    with DatasetReader(root) as r:
        clean = [(s["__key__"], s["jpg"]) for s in r]
    for name in (f"shard-{shard:06d}.tar", f"shard-{shard:06d}.tar.idx"):
        os.unlink(root / name)
    assert epoch(shardio.ShardDataset(root, shuffle=False)) == clean
    return root, clean


def test_parity_serves_and_repairs_a_shard_lost_with_its_index(image_tree: Path, cli,
                                                               tmp_path: Path) -> None:
    """Parity covers the shard files, not the ``.idx`` beside a tar: a shard lost together with
    its index gets one read from the rebuilt (verified) shard.  Its digest is not the
    manifest's (the packer's index also records the pack job), yet it must serve reads, let
    ``verify --repair`` finish the repair (it restored the tar, left no index and said "pack
    with --parity"), and verify clean."""
    root, clean = _lost_with_its_index(image_tree, tmp_path, 4)
    rc, out, err = cli("verify", root, "--repair")
    assert rc == 0, out + err
    assert "repaired shard-000004.tar from parity" in out
    assert verify_dataset(str(root)) == []
    assert epoch(shardio.ShardDataset(root, shuffle=False)) == clean
    # A copied-in index of another shard is still refused: the check is not switched off.
    os.replace(root / "shard-000003.tar.idx", root / "shard-000004.tar.idx")
    assert any("index" in p.what for p in verify_dataset(str(root)))


@pytest.mark.parametrize("zstd_dict", [False, True])
def test_parity_rebuilds_the_index_of_a_compressed_shard(tmp_path: Path, cli,
                                                         zstd_dict: bool) -> None:
    """With ``--compress zstd`` field F of a sample is the member ``key.F.zst``: the index read
    from a rebuilt shard took it for a raw field ``F.zst`` and served its compressed bytes, and
    ``verify`` said ok.  A member that is itself a field ``F.zst`` (stored raw: it does not
    shrink) stays that field."""
    pytest.importorskip("zfec")
    src = tmp_path / "src"
    rng = np.random.default_rng(3)
    for i in range(24):
        d = src / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"s{i:04d}.txt").write_text(f"sample {i:04d} " * 40)
        if i % 2:
            (d / f"s{i:04d}.bin.zst").write_bytes(rng.bytes(300))  # incompressible: raw
    root = tmp_path / "ds"
    pack(src, root, PackOptions(samples_per_shard=4, compress="zstd", zstd_dict=zstd_dict,
                                fsync=False, parity="3+1"))
    assert set(Manifest.load(root).fields) == {"txt", "bin.zst"}
    with DatasetReader(root) as r:
        clean = [{k: bytes(v) if k != "__key__" else v for k, v in s.items()} for s in r]
    assert all(c["txt"].startswith(b"sample ") for c in clean)
    assert sorted(len(c.get("bin.zst", b"")) for c in clean) == [0] * 12 + [300] * 12
    for name in ("shard-000001.tar", "shard-000001.tar.idx"):
        os.unlink(root / name)
    with DatasetReader(root) as r:
        assert [{k: bytes(v) if k != "__key__" else v for k, v in s.items()} for s in r] == clean
    rc, out, err = cli("verify", root, "--repair")
    assert rc == 0, out + err
    assert verify_dataset(str(root)) == []
    with DatasetReader(root) as r:
        assert [{k: bytes(v) if k != "__key__" else v for k, v in s.items()} for s in r] == clean


def test_a_damaged_zstd_dictionary_is_read_from_a_replica_and_repaired(tmp_path: Path,
                                                                      cli) -> None:
    """The dictionary is a file of the dataset like a shard: a damaged one is read from a
    replica (the dataset was unreadable: ManifestCorruptError) and restored by `repair`
    (which said "0 damaged")."""
    src = tmp_path / "src"
    _text_tree(src, "v1")
    root, replica = tmp_path / "ds", tmp_path / "replica"
    pack(src, root, PackOptions(samples_per_shard=6, compress="zstd", zstd_dict=True,
                                fsync=False))
    shutil.copytree(root, replica)
    with DatasetReader(root) as r:
        clean = [(s["__key__"], s["txt"]) for s in r]
    rel = Manifest.load(root).compression["dictionary"]
    flip_bits(root / rel, offset=(root / rel).stat().st_size // 2)
    with pytest.raises(ManifestCorruptError, match="zstd dictionary.*--replica"):
        DatasetReader(root)
    with DatasetReader(root, replicas=[str(replica)]) as r:
        assert [(s["__key__"], s["txt"]) for s in r] == clean
    rc, out, err = cli("repair", root, "--replica", replica)
    assert rc == 0, out + err
    assert f"repaired {rel} from replica" in out
    assert verify_dataset(str(root)) == []


def _text_tree(src: Path, version: str) -> None:
    for i in range(24):
        d = src / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"s{i:04d}.txt").write_text(f"{version} sample {i:04d}")


def test_parity_never_serves_a_stale_rebuilt_copy(tmp_path: Path) -> None:
    """A copy rebuilt for an earlier dataset packed to the same directory is rebuilt again,
    not served: before, it was reused unchecked and its own index passed every checksum."""
    pytest.importorskip("zfec")
    src, root = tmp_path / "src", tmp_path / "ds"
    opts = dict(samples_per_shard=4, fsync=False, parity="2+1")
    _text_tree(src, "OLD")
    pack(src, root, PackOptions(**opts))
    corrupt_dataset(str(root), [2], "delete")
    with DatasetReader(root) as r:
        assert len(list(r)) == 24 and r.counters.get("parity_rebuilt") == 1
    _text_tree(src, "NEW")
    pack(src, root, PackOptions(overwrite=True, **opts))
    corrupt_dataset(str(root), [2], "delete")
    for _ in range(2):  # rebuilt once, then the good copy is reused
        with DatasetReader(root) as r:
            texts = [s["txt"].decode() for s in r]
        assert len(texts) == 24 and all(t.startswith("NEW") for t in texts)
    assert r.counters.get("parity_rebuilt") == 0


def test_parity_rebuilds_from_a_read_only_dataset(tmp_path: Path) -> None:
    """A shared dataset directory is usually read-only: the rebuilt copy goes to a per-user
    temp directory instead (before: a raw OSError from makedirs ended the read)."""
    pytest.importorskip("zfec")
    src, root, ro = tmp_path / "src", tmp_path / "ds", tmp_path / "ro"
    _text_tree(src, "V")
    pack(src, root, PackOptions(samples_per_shard=4, fsync=False, parity="2+1"))
    corrupt_dataset(str(root), [2], "flip", seed=1)
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(root), str(ro)], capture_output=True).returncode:
        pytest.skip("needs bind mounts (root in a privileged container)")
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        with DatasetReader(ro) as r:
            texts = [s["txt"].decode() for s in r]
            base = r.ladder._rebuilt_base()
        assert len(texts) == 24 and r.counters.get("parity_rebuilt") == 1
        assert not base.startswith(str(ro)) and os.path.isfile(
            os.path.join(base, Manifest.load(str(root)).shards[2].path))
        shutil.rmtree(base)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


def test_loader_workers_repair_and_count(data) -> None:
    root, replica, clean = data
    corrupt_dataset(str(root), [0, 4], "flip", seed=7)
    reference = epoch(shardio.ShardDataset(replica, seed=1))
    ds = shardio.ShardDataset(root, seed=1, replicas=[str(replica)])
    with shardio.ShardLoader(ds, batch_size=8, num_workers=2,
                             collate_fn=lambda b: [(s["__key__"], s["jpg"]) for s in b]) as ld:
        got = [s for batch in ld for s in batch]
        stats = ld.stats()
    assert got == reference
    assert stats["repair"]["checksum_mismatch"] == 2  # counted in the workers, seen in main
    assert stats["repair"]["bytes_original"] > 0


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_dataloader_workers_count_in_the_parent(data, context: str) -> None:
    """Events handled in DataLoader workers reach the parent's io_stats() whatever the start
    method (forkserver, advised for multi-rank jobs, once left the parent at zero)."""
    from torch.utils.data import DataLoader

    root, replica, _clean = data
    corrupt_dataset(str(root), [0, 4], "flip", seed=7)
    ds = shardio.ShardDataset(root, seed=1, replicas=[str(replica)])
    loader = DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context=context)
    assert len(list(loader)) == len(ds)
    c = ds.io_stats()["repair"]
    assert c["checksum_mismatch"] == 2 and c["failovers"] == 2 and c["bytes_replica"] > 0


def test_eio_injected_with_strace_fails_over(data, tmp_path: Path) -> None:
    """A real EIO from the kernel's point of view of the process: strace makes the first
    ``pread64`` fail; the reader moves to the replica and still delivers every sample."""
    root, replica, clean = data
    script = tmp_path / "read.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {str(ROOT)!r})
        from shardio.reader import DatasetReader
        r = DatasetReader({str(root)!r}, replicas=[{str(replica)!r}])
        keys = [s["__key__"] for s in r]
        print(json.dumps({{"n": len(keys), "counters": r.counters.snapshot()}}))
    """))
    target = root / Manifest.load(root).shards[2].path  # -P: only syscalls on this file
    out = run_with_eio(script, target, "pread64", when=1)
    assert out["n"] == len(clean)
    assert out["counters"]["io_error"] == 1 and out["counters"]["failovers"] == 1


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_offline_repair_from_replica(data, cli, how: str) -> None:
    root, replica, _clean = data
    corrupt_dataset(str(root), [0, 6], how, seed=9)
    rc, out, _err = cli("verify", root)
    assert rc == 1
    rc, out, err = cli("repair", root, "--replica", replica)
    assert rc == 0, out + err
    assert out.count("repaired shard-") == 2
    assert verify_dataset(str(root)) == []


def test_verify_repair_uses_parity(image_tree: Path, tmp_path: Path, cli) -> None:
    pytest.importorskip("zfec")
    root = tmp_path / "ds"
    rc, out, err = cli("pack", image_tree, root, "--samples-per-shard", "9", "--parity", "4+2",
                       "--no-fsync")
    assert rc == 0, err
    assert "parity 4+2" in out
    flip_bits(str(root / "shard-000002.tar"), offset=700)
    os.unlink(root / "shard-000003.tar")
    rc, out, err = cli("verify", root, "--repair")
    assert rc == 0, out + err
    assert "repaired shard-000002.tar from parity" in out
    assert "repaired shard-000003.tar from parity" in out
    assert verify_dataset(str(root)) == []


def test_verify_repair_exits_1_on_problems_it_does_not_fix(data, cli) -> None:
    """verify --repair restores damaged shards, but a problem outside them (here an extra
    shard file) still fails the command (it exited 0 once the shards were repaired)."""
    root, replica, _clean = data
    corrupt_dataset(str(root), [2], "flip", seed=1)
    (root / "shard-000099.tar").write_bytes(b"stray")
    rc, out, err = cli("verify", root, "--repair", "--replica", replica)
    assert rc == 1, out + err
    assert "repaired shard-000002.tar from" in out and "repair does not fix" in err
    assert [p.what for p in verify_dataset(str(root))] == [
        "extra shard file not listed in the manifest"]


def test_unrepairable_offline_exits_1(data, cli) -> None:
    root, _replica, _clean = data
    corrupt_dataset(str(root), [2], "delete")
    rc, out, _err = cli("repair", root)
    assert rc == 1
    assert "NOT repaired shard-000002.tar" in out


@pytest.mark.parametrize("how", ["truncate", "delete"])
def test_quarantine_restores_an_original_that_fails_to_open(data, how: str) -> None:
    root, replica, clean = data
    corrupt_dataset(str(root), [4], how)
    ds = shardio.ShardDataset(root, seed=2, replicas=[str(replica)], quarantine=True)
    assert sorted(epoch(ds)) == sorted(clean)
    c = ds.reader.counters.snapshot()
    assert c["originals_restored"] == 1
    assert verify_dataset(str(root)) == []


def test_a_shard_gone_after_it_was_opened_is_missing_not_an_io_error(data) -> None:
    """Deleted after its index was loaded but before its descriptor opened (prefetch, an
    evicted reader, a fork): counted as io_error, as "[Errno None] ... is missing"."""
    root, replica, clean = data
    with DatasetReader(root, replicas=[str(replica)]) as r:
        r.shard(0)  # opened: index loaded, no descriptor yet
        os.unlink(root / "shard-000000.tar")
        got = list(r.iter_shard(0))
        c = r.counters.snapshot()
    assert [(s["__key__"], s["jpg"]) for s in got] == clean[:9]
    assert (c["missing"], c["io_error"]) == (1, 0)
    shutil.copy(replica / "shard-000000.tar", root / "shard-000000.tar")
    with DatasetReader(root) as r:
        r.shard(0)
        os.unlink(root / "shard-000000.tar")
        with pytest.raises(ShardNotFoundError, match="missing"):
            list(r.iter_shard(0))


def test_repair_mends_an_index_when_the_replicas_is_bad_too(data, cli) -> None:
    """The original shard and its .idx damaged, the replica's shard good but its .idx damaged
    too: repair restored the shard, kept the bad index and still said "repaired" (exit 0);
    verify then failed and reads of the shard were unrepairable.  The index is now read from
    the restored shard."""
    root, replica, clean = data
    flip_bits(str(root / "shard-000000.tar"), offset=2000)
    for base in (root, replica):
        flip_bits(str(base / "shard-000000.tar.idx"), offset=40)
    rc, out, err = cli("repair", root, "--replica", replica)
    assert rc == 0, out + err
    assert "repaired shard-000000.tar from replica" in out
    assert verify_dataset(str(root)) == []
    assert epoch(shardio.ShardDataset(root, shuffle=False)) == clean


def test_repair_reads_a_lost_index_from_its_good_shard(data, cli) -> None:
    """Only a tar's .idx lost, no replica, no parity: `verify --repair` and `repair` said
    "NOT repaired ... no good copy" although the shard beside it was whole."""
    root, _replica, clean = data
    os.unlink(root / "shard-000003.tar.idx")
    rc, out, err = cli("verify", root, "--repair")
    assert rc == 0, out + err
    assert "repaired shard-000003.tar from an index read from the shard itself" in out
    assert verify_dataset(str(root)) == []
    assert epoch(shardio.ShardDataset(root, shuffle=False)) == clean


def test_quarantine_mends_an_original_whose_index_alone_is_bad(data) -> None:
    """quarantine=True never restored an original whose shard was fine but whose .idx was
    damaged: every process failed over to the replica and counted index_corrupt again."""
    root, replica, clean = data
    flip_bits(str(root / "shard-000002.tar.idx"), offset=40)
    for run in range(2):
        ds = shardio.ShardDataset(root, shuffle=False, replicas=[str(replica)], quarantine=True)
        assert epoch(ds) == clean
        c = ds.reader.counters.snapshot()
        assert (c["index_corrupt"], c["originals_restored"]) == ((1, 1) if run == 0 else (0, 0))
    assert verify_dataset(str(root)) == []


def test_a_damaged_index_of_a_rebuilt_shard_is_made_again(image_tree: Path,
                                                           tmp_path: Path) -> None:
    """A shard lost with its index is rebuilt from parity (with an index read from it); one
    bit flipped later in that rebuilt .idx made the shard unrepairable for good: the index
    beside a good rebuilt shard was never made again."""
    root, clean = _lost_with_its_index(image_tree, tmp_path, 1)
    rebuilt = next(root.rglob(".shardio-rebuilt/shard-000001.tar.idx"))
    flip_bits(str(rebuilt), offset=40)
    assert epoch(shardio.ShardDataset(root, shuffle=False)) == clean


def test_unrepairable_errors_give_advice_that_fits(image_tree: Path, tmp_path: Path) -> None:
    """A dataset packed with parity was told to "pack with --parity" (and its failed rebuild was
    counted as an io_error); random access under
    on_corrupt="skip" listed no copy ("all copies: skipped") and advised setting the
    on_corrupt="skip" it had."""
    pytest.importorskip("zfec")
    root = tmp_path / "ds"
    pack(image_tree, root, PackOptions(samples_per_shard=9, fsync=False, parity="3+1"))
    os.unlink(root / "shard-000001.tar")
    parity = sorted((root / "parity").iterdir())[0]
    os.unlink(parity)  # more of the group lost than parity covers
    with DatasetReader(root) as r:
        with pytest.raises(UnrepairableError) as err:
            list(r.iter_shard(1))
        c = r.counters.snapshot()
    # (the failed rebuild was counted as an io_error: nothing failed to read)
    assert (c["missing"], c["parity_failed"], c["io_error"]) == (1, 1, 0)
    assert "pack with --parity" not in str(err.value)
    assert "more of its parity group is lost" in str(err.value)
    with DatasetReader(root, on_corrupt="skip") as r, pytest.raises(UnrepairableError) as err:
        r[9]
    text = str(err.value)
    assert "original" in text and "missing" in text and "set on_corrupt='skip'" not in text
