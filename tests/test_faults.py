"""The fault injector (tools/faults.py) does what it says, and `shardio verify` sees each fault."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardio import Manifest, PackOptions, pack, verify_dataset
from tools.faults import corrupt_dataset, delete, flip_bits, main, truncate

SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "faults.py"


@pytest.fixture
def blob(tmp_path: Path) -> Path:
    path = tmp_path / "blob.bin"
    path.write_bytes(bytes(range(256)) * 16)
    os.utime(path, ns=(1_000_000_000, 2_000_000_000))
    return path


def _changed(before: bytes, after: bytes) -> dict[int, int]:
    """Byte offset -> XOR of the old and new byte, for every byte that differs."""
    return {i: a ^ b for i, (a, b) in enumerate(zip(before, after)) if a != b}


def test_flip_bits_at_offset(blob: Path) -> None:
    before = blob.read_bytes()
    assert flip_bits(blob, 10, bits=3) == [10, 11, 12]
    after = blob.read_bytes()
    assert len(after) == len(before)
    diff = _changed(before, after)
    assert sorted(diff) == [10, 11, 12]
    assert all(x.bit_count() == 1 for x in diff.values())  # one bit per byte
    assert os.stat(blob).st_mtime_ns == 2_000_000_000  # silent, like bit rot


def test_flip_bits_random_is_seeded(blob: Path, tmp_path: Path) -> None:
    other = tmp_path / "other.bin"
    other.write_bytes(blob.read_bytes())
    first = flip_bits(blob, bits=5, seed=42)
    assert len(set(first)) == 5 and all(0 <= o < 4096 for o in first)
    assert flip_bits(other, bits=5, seed=42) == first
    assert blob.read_bytes() == other.read_bytes()
    assert flip_bits(other, bits=5, seed=43) != first


def test_flip_bits_within_a_span(blob: Path) -> None:
    before = blob.read_bytes()
    offsets = flip_bits(blob, 100, bits=4, span=10, seed=1)
    assert len(offsets) == 4 and all(100 <= o < 110 for o in offsets)
    assert sorted(_changed(before, blob.read_bytes())) == offsets


@pytest.mark.parametrize("offset, bits", [(4095, 2), (-1, 1), (5000, 1), (0, 0)])
def test_flip_bits_rejects_out_of_range(blob: Path, offset: int, bits: int) -> None:
    before = blob.read_bytes()
    with pytest.raises(ValueError):
        flip_bits(blob, offset, bits=bits)
    assert blob.read_bytes() == before


def test_truncate(blob: Path) -> None:
    assert truncate(blob, to=1000) == 1000
    assert blob.stat().st_size == 1000
    assert truncate(blob, by=1) == 999
    assert blob.read_bytes() == (bytes(range(256)) * 16)[:999]
    for kwargs in ({}, {"to": 1, "by": 1}, {"to": 999}, {"by": 1000}):
        with pytest.raises(ValueError):
            truncate(blob, **kwargs)


def test_delete(blob: Path) -> None:
    delete(blob)
    assert not blob.exists()
    with pytest.raises(FileNotFoundError):
        delete(blob)


def test_cli(blob: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = blob.read_bytes()
    assert main(["flip", str(blob), "--offset", "7", "--bits", "2"]) == 0
    assert sorted(_changed(before, blob.read_bytes())) == [7, 8]
    assert main(["flip", str(blob), "--random", "--seed", "3"]) == 0
    assert main(["truncate", str(blob), "--by", "96"]) == 0
    assert blob.stat().st_size == 4000
    assert main(["truncate", str(blob), "--to", "5000"]) == 2
    assert "cannot truncate" in capsys.readouterr().err
    assert main(["delete", str(blob)]) == 0
    assert main(["delete", str(blob)]) == 2


def test_script_runs_stand_alone(blob: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "truncate", str(blob), "--to", "10"],
                          check=False, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert blob.stat().st_size == 10


@pytest.fixture(params=["tar", "hdf5"])
def dataset(request: pytest.FixtureRequest, image_tree: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    pack(image_tree, out, PackOptions(samples_per_shard=15, format=request.param, fsync=False))
    assert verify_dataset(out) == []
    return out


def test_corrupt_dataset_flip_hits_a_sample_field(dataset: Path) -> None:
    manifest = Manifest.load(dataset)
    size = (dataset / manifest.shards[1].path).stat().st_size
    lines = corrupt_dataset(dataset, [1], "flip", seed=4, bits=2)
    assert len(lines) == 1 and "flipped 2 bit(s)" in lines[0]
    assert (dataset / manifest.shards[1].path).stat().st_size == size
    problems = verify_dataset(dataset)
    whats = {p.what for p in problems}
    assert whats == {"shard digest mismatch", "checksum mismatch"}, problems
    bad = [p for p in problems if p.what == "checksum mismatch"]
    assert len(bad) == 1 and f"sample {bad[0].key!r} field {bad[0].field!r}" in lines[0]
    assert all(p.path == manifest.shards[1].path for p in problems)


def test_corrupt_dataset_truncate(dataset: Path) -> None:
    manifest = Manifest.load(dataset)
    lines = corrupt_dataset(dataset, [0, 2], "truncate", seed=1)
    assert len(lines) == 2 and all("truncated to" in line for line in lines)
    problems = verify_dataset(dataset)
    for i in (0, 2):
        entry = manifest.shards[i]
        assert (dataset / entry.path).stat().st_size < entry.bytes
        assert any(p.path == entry.path and p.what == "truncated" for p in problems), problems
    assert {p.path for p in problems} <= {manifest.shards[0].path, manifest.shards[2].path}


def test_corrupt_dataset_delete(dataset: Path) -> None:
    manifest = Manifest.load(dataset)
    assert corrupt_dataset(dataset, [3], "delete") == [f"{manifest.shards[3].path}: deleted"]
    assert not (dataset / manifest.shards[3].path).exists()
    problems = verify_dataset(dataset)
    assert [(p.path, p.what) for p in problems] == [
        (manifest.shards[3].path, "missing shard (listed in the manifest, not on disk)")]


def test_corrupt_dataset_rejects_bad_requests(dataset: Path) -> None:
    with pytest.raises(ValueError, match="how must be"):
        corrupt_dataset(dataset, [0], "melt")
    with pytest.raises(ValueError, match="out of range"):
        corrupt_dataset(dataset, [99], "flip")
    assert verify_dataset(dataset) == []


def test_cli_dataset_command(dataset: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dataset", str(dataset), "0", "--how", "flip", "--seed", "9"]) == 0
    assert "flipped 1 bit(s)" in capsys.readouterr().out
    assert verify_dataset(dataset)
