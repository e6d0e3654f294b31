"""Erasure-coded parity (shardio.parity): write K+M parity, lose shards, rebuild them exactly."""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("zfec")

from shardio import Manifest, PackOptions, pack, verify_dataset
from shardio.errors import MissingDependencyError, ParityError, UsageError
from shardio.parity import (
    group_of,
    parse_parity,
    rebuild_shard,
    verify_parity,
    write_parity,
)
from tools.faults import flip_bits


def _pack(src: Path, out: Path, fmt: str = "tar") -> Manifest:
    # 60 samples, 9 per shard: 7 shards of differing sizes (the last one smaller).
    return pack(src, out, PackOptions(samples_per_shard=9, format=fmt, fsync=False))


def _with_parity(root: Path, k: int = 4, m: int = 2, chunk: int = 1 << 20) -> Manifest:
    manifest = Manifest.load(root)
    manifest.parity = write_parity(str(root), manifest, k, m, chunk=chunk, fsync=False)
    manifest.save(str(root))
    return Manifest.load(root)


@pytest.fixture
def dataset(image_tree: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    _pack(image_tree, out)
    return out


def _shard(root: Path, manifest: Manifest, i: int) -> Path:
    return root / manifest.shards[i].path


def _snapshot(root: Path, manifest: Manifest) -> dict[int, bytes]:
    return {i: _shard(root, manifest, i).read_bytes() for i in range(len(manifest.shards))}


def _repair(root: Path, manifest: Manifest, shards: list[int], **kw: object) -> None:
    for i in shards:
        path = str(_shard(root, manifest, i))
        assert rebuild_shard(str(root), manifest, i, path, **kw) == path  # type: ignore[arg-type]


@pytest.mark.parametrize("spec, expected", [("4+2", (4, 2)), (" 8 + 3 ", (8, 3)),
                                            ("1+1", (1, 1)), ("250+6", (250, 6))])
def test_parse_parity(spec: str, expected: tuple[int, int]) -> None:
    assert parse_parity(spec) == expected


@pytest.mark.parametrize("spec", ["4", "4+", "+2", "a+b", "4-2", "4+0", "0+2", "250+7", ""])
def test_parse_parity_rejects(spec: str) -> None:
    with pytest.raises(UsageError, match=r"K\+M"):
        parse_parity(spec)


def test_write_parity_layout_and_manifest(dataset: Path) -> None:
    manifest = _with_parity(dataset)  # Manifest.load is strict: the digest covers the section
    parity = manifest.parity
    assert parity is not None
    assert (parity["scheme"], parity["k"], parity["m"], parity["chunk"]) == ("zfec-rs", 4, 2,
                                                                             1 << 20)
    assert [g["shards"] for g in parity["groups"]] == [[0, 1, 2, 3], [4, 5, 6]]
    for number, group in enumerate(parity["groups"]):
        assert group["size"] == max(manifest.shards[i].bytes for i in group["shards"])
        assert group["files"] == [f"parity/g{number:06d}.p0", f"parity/g{number:06d}.p1"]
        for rel, size in zip(group["files"], group["bytes"]):
            assert os.path.getsize(dataset / rel) == size == group["size"]
    assert group_of(parity, 5) == (1, parity["groups"][1])
    assert verify_parity(str(dataset), manifest) == []
    assert verify_dataset(dataset) == []  # parity files are not taken for stray shards
    assert not [n for n in os.listdir(dataset / "parity") if "tmp" in n]


def test_rebuild_deleted_shard(dataset: Path, tmp_path: Path) -> None:
    manifest = _with_parity(dataset)
    before = _snapshot(dataset, manifest)
    os.unlink(_shard(dataset, manifest, 1))
    dest = tmp_path / "rebuilt.tar"
    assert rebuild_shard(str(dataset), manifest, 1, str(dest)) == str(dest)
    assert dest.read_bytes() == before[1]
    shutil.copy(dest, _shard(dataset, manifest, 1))
    assert verify_dataset(dataset) == []


def test_rebuild_two_flipped_shards_of_one_group(dataset: Path) -> None:
    manifest = _with_parity(dataset)
    before = _snapshot(dataset, manifest)
    flip_bits(_shard(dataset, manifest, 0), 5000, bits=3)
    flip_bits(_shard(dataset, manifest, 2), seed=7)
    assert verify_dataset(dataset)
    _repair(dataset, manifest, [0, 2])  # the damage is found by the shard digests
    assert _snapshot(dataset, manifest) == before
    assert verify_dataset(dataset) == []


def test_bad_marks_intact_shards_as_lost(dataset: Path, tmp_path: Path) -> None:
    manifest = _with_parity(dataset)
    with pytest.raises(ParityError, match="3 of its 6 blocks are lost"):
        rebuild_shard(str(dataset), manifest, 0, str(tmp_path / "x"), bad=[1, 2])
    rebuild_shard(str(dataset), manifest, 0, str(tmp_path / "x"), bad=[1])
    assert (tmp_path / "x").read_bytes() == _shard(dataset, manifest, 0).read_bytes()


def test_three_lost_in_a_4_plus_2_group_cannot_be_rebuilt(dataset: Path, tmp_path: Path) -> None:
    manifest = _with_parity(dataset)
    for i in (0, 1, 3):
        os.unlink(_shard(dataset, manifest, i))
    with pytest.raises(ParityError, match="at most 2 per group") as err:
        rebuild_shard(str(dataset), manifest, 0, str(tmp_path / "x"))
    assert "shard-000001.tar" in str(err.value)
    assert not (tmp_path / "x").exists()


def test_corrupt_parity_file_counts_as_lost(dataset: Path, tmp_path: Path) -> None:
    manifest = _with_parity(dataset)
    before = _snapshot(dataset, manifest)
    flip_bits(dataset / "parity/g000000.p0", 100)
    problems = verify_parity(str(dataset), manifest)
    assert [p for p, _ in problems] == ["parity/g000000.p0"]
    assert "digest mismatch" in problems[0][1]
    os.unlink(_shard(dataset, manifest, 3))
    _repair(dataset, manifest, [3])  # one shard lost + one parity file bad: still within M=2
    assert _shard(dataset, manifest, 3).read_bytes() == before[3]
    os.unlink(_shard(dataset, manifest, 2))
    os.unlink(_shard(dataset, manifest, 3))
    with pytest.raises(ParityError, match="parity/g000000.p0"):
        rebuild_shard(str(dataset), manifest, 3, str(tmp_path / "x"))


def test_missing_parity_file_reported(dataset: Path) -> None:
    manifest = _with_parity(dataset)
    os.unlink(dataset / "parity/g000001.p1")
    assert verify_parity(str(dataset), manifest) == [("parity/g000001.p1",
                                                      "missing parity file")]


def test_last_smaller_group(dataset: Path) -> None:
    manifest = _with_parity(dataset)
    assert manifest.parity is not None and len(manifest.parity["groups"][-1]["shards"]) == 3
    before = _snapshot(dataset, manifest)
    os.unlink(_shard(dataset, manifest, 6))  # the smallest shard: zero padding is cut off
    flip_bits(_shard(dataset, manifest, 4), seed=3, bits=2)
    _repair(dataset, manifest, [4, 6])
    assert _snapshot(dataset, manifest) == before
    assert verify_dataset(dataset) == []


@pytest.mark.parametrize("chunk, override", [(4096, None), (5000, 777), (1 << 24, 3000)])
def test_stripe_sizes(dataset: Path, chunk: int, override: int | None) -> None:
    # Several stripes with a short last one, one stripe larger than any shard, and a decode
    # stripe different from the encode stripe (the code works byte by byte).
    manifest = _with_parity(dataset, chunk=chunk)
    before = _snapshot(dataset, manifest)
    os.unlink(_shard(dataset, manifest, 1))
    os.unlink(_shard(dataset, manifest, 5))
    flip_bits(_shard(dataset, manifest, 2), seed=1)
    _repair(dataset, manifest, [1, 2, 5], chunk_override=override)
    assert _snapshot(dataset, manifest) == before


def test_k1_is_replication(dataset: Path) -> None:
    manifest = _with_parity(dataset, k=1, m=1)
    assert manifest.parity is not None and len(manifest.parity["groups"]) == 7
    before = _snapshot(dataset, manifest)
    assert (dataset / "parity/g000002.p0").read_bytes() == before[2]
    for i in range(7):
        os.unlink(_shard(dataset, manifest, i))
    _repair(dataset, manifest, list(range(7)))
    assert _snapshot(dataset, manifest) == before
    assert verify_dataset(dataset) == []


def test_hdf5_dataset(image_tree: Path, tmp_path: Path) -> None:
    root = tmp_path / "h5"
    _pack(image_tree, root, fmt="hdf5")
    manifest = _with_parity(root, k=3, m=2)
    before = _snapshot(root, manifest)
    os.unlink(_shard(root, manifest, 3))
    flip_bits(_shard(root, manifest, 4), seed=2)
    _repair(root, manifest, [3, 4])
    assert _snapshot(root, manifest) == before
    assert verify_dataset(root) == []


def test_rebuild_checks_the_result_before_publishing(dataset: Path, tmp_path: Path) -> None:
    manifest = _with_parity(dataset)
    wrong = dataclasses.replace(manifest.shards[0], digest="0" * 32)
    manifest.shards[0] = wrong
    with pytest.raises(ParityError, match="fails the manifest digest"):
        rebuild_shard(str(dataset), manifest, 0, str(tmp_path / "x"))
    assert sorted(os.listdir(tmp_path)) == ["ds", "src"]  # no x, no temp file


def test_write_parity_refuses_a_corrupt_shard(dataset: Path) -> None:
    manifest = Manifest.load(dataset)
    flip_bits(_shard(dataset, manifest, 2), seed=5)
    with pytest.raises(ParityError, match="shard-000002.tar: digest does not match"):
        write_parity(str(dataset), manifest, 4, 2, fsync=False)
    assert os.listdir(dataset / "parity") == []  # nothing published, no temp file left


def test_errors_without_parity(dataset: Path, tmp_path: Path) -> None:
    manifest = Manifest.load(dataset)
    with pytest.raises(ParityError, match="--parity K"):
        rebuild_shard(str(dataset), manifest, 0, str(tmp_path / "x"))
    assert verify_parity(str(dataset), manifest) == []
    manifest = _with_parity(dataset)
    assert manifest.parity is not None
    with pytest.raises(ParityError, match="no parity group"):
        group_of(manifest.parity, 7)
    with pytest.raises(UsageError):
        write_parity(str(dataset), manifest, 4, 0)
    with pytest.raises(UsageError):
        write_parity(str(dataset), manifest, 4, 2, chunk=0)


def test_missing_zfec_names_the_install(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zfec", None)  # makes `import zfec` raise ImportError
    with pytest.raises(MissingDependencyError, match="pip install zfec"):
        write_parity(str(dataset), Manifest.load(dataset), 4, 2)
