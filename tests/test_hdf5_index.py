"""An HDF5 shard's in-shard index checks itself: ``index_digest`` plus structural checks on load.

Per-field checksums cover stored bytes only.  A bit flipped in any ``/index`` array, or an edited
index attribute, must raise ``IndexCorruptError`` (a fault the repair ladder fails over on), never
deliver a wrong key or field or escape as an untyped error; a shard written before
``index_digest`` existed still reads, and its index still has to hold together.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest

import shardio
from shardio import Manifest
from shardio.errors import IndexCorruptError
from shardio.formats.hdf5 import load_hdf5_index
from tests.conftest import flip_bit
from tests.test_formats import pack_into, read_all

SHARD = 2  # mixed_tree (40 samples) at 7 per shard: shard-000002.h5 holds samples 14..20
ARRAYS = ("key_blob", "key_offsets", "sample_start", "f_name", "f_flags", "f_offset", "f_length",
          "f_raw_length", "f_checksum")


@pytest.fixture
def ds(mixed_tree: Path, tmp_path: Path) -> Path:
    """HDF5 shards with zstd, so ``f_flags`` holds both compressed and raw fields."""
    out = tmp_path / "ds"
    pack_into(mixed_tree, out, "hdf5", samples_per_shard=7, compress="zstd")
    with h5py.File(shard(out), "r") as f:
        assert set(f["index"]["f_flags"][()].tolist()) == {0, 1}
    return out


def shard(root: Path, k: int = SHARD) -> Path:
    return root / f"shard-{k:06d}.h5"


def element_offset(path: Path, name: str, row: int) -> int:
    """File offset of element ``row`` of ``/index/<name>``."""
    with h5py.File(path, "r") as f:
        d = f["index"][name]
        return int(d.id.get_offset()) + row * d.dtype.itemsize


def drop_digest(path: Path) -> None:
    """Make ``path`` look like a shard written before ``index_digest`` existed (and its manifest
    entry like one of that time: no ``index_digest`` for an HDF5 shard)."""
    with h5py.File(path, "r+") as f:
        if "index_digest" in f.attrs:
            del f.attrs["index_digest"]
    m = Manifest.load(path.parent)
    shards = [replace(e, index_digest="") if e.path == path.name else e for e in m.shards]
    replace(m, shards=shards).save(str(path.parent))


@pytest.mark.parametrize("name", ARRAYS)
def test_flipped_bit_in_an_index_array_is_index_corruption(ds: Path, name: str) -> None:
    path = shard(ds)
    flip_bit(path, element_offset(path, name, 1), bit=0)
    with pytest.raises(IndexCorruptError, match=f"{path}.*index_digest mismatch.*good copy"):
        load_hdf5_index(str(path))
    with shardio.open_dataset(ds) as reader:
        assert reader[0]["__key__"]
        with pytest.raises(IndexCorruptError, match=path.name):
            reader[7 * SHARD]
    problems = [p for p in shardio.verify_dataset(ds) if p.path == path.name]
    assert [p.what.split(":")[0] for p in problems] == ["shard digest mismatch",
                                                        "unreadable index"]
    assert "index_digest mismatch" in problems[1].what


@pytest.mark.parametrize("attr", ["field_names", "checksum", "shardio_meta"])
def test_edited_index_attribute_is_index_corruption(ds: Path, attr: str) -> None:
    path = shard(ds)
    with h5py.File(path, "r+") as f:
        if attr == "field_names":  # the fields of every sample would swap names
            names = [n.decode() if isinstance(n, bytes) else n for n in f.attrs[attr]]
            f.attrs[attr] = np.array(names[::-1], dtype=h5py.string_dtype())
        elif attr == "checksum":
            f.attrs[attr] = "crc32"
        else:
            f.attrs[attr] = json.dumps({"edited": True})
    with pytest.raises(IndexCorruptError, match="index_digest mismatch"):
        load_hdf5_index(str(path))


def test_corrupt_index_fails_over_to_a_replica(ds: Path, tmp_path: Path) -> None:
    """The faults that before gave a wrong key, a mis-assembled sample and an IndexError."""
    replica = tmp_path / "replica"
    shutil.copytree(ds, replica)
    reference = list(shardio.ShardDataset(replica, seed=3))
    for k, name, bit in ((1, "key_blob", 0), (3, "f_name", 7), (4, "sample_start", 0)):
        flip_bit(shard(ds, k), element_offset(shard(ds, k), name, 1), bit=bit)
    dataset = shardio.ShardDataset(ds, seed=3, replicas=[str(replica)])
    assert list(dataset) == reference  # same samples, same order, none corrupt
    c = dataset.reader.counters.snapshot()
    assert c["index_corrupt"] == 3 and c["failovers"] == 3


def test_shard_without_index_digest_still_reads(ds: Path) -> None:
    before = read_all(ds)
    for path in sorted(ds.glob("*.h5")):
        drop_digest(path)
    assert read_all(ds) == before


Edit = Callable[[dict[str, np.ndarray], int], tuple[int, int]]
# array, edit giving (row, new value) from the index arrays and the field-name count, message
STRUCTURE = [
    pytest.param("f_name", lambda a, n: (0, n), "names no field", id="unknown-name"),
    pytest.param("f_flags", lambda a, n: (0, 6), "unknown f_flags", id="unknown-flags"),
    pytest.param("sample_start", lambda a, n: (1, int(a["sample_start"][2]) + 1),
                 "sample_start are not increasing", id="sample-start-decreasing"),
    pytest.param("key_offsets",
                 lambda a, n: (len(a["key_offsets"]) - 1, int(a["key_offsets"][-1]) + 1),
                 "key_offsets are not increasing from 0 to", id="key-offsets-past-blob"),
    pytest.param("key_blob", lambda a, n: (0, 0xFF), "not UTF-8", id="key-not-utf8"),
    pytest.param("f_offset", lambda a, n: (len(a["f_offset"]) - 1, 1 << 40), "inside the",
                 id="offset-past-payload"),
    pytest.param("f_length", lambda a, n: (0, 1 << 40), "inside the", id="length-past-payload"),
    pytest.param("f_raw_length",
                 lambda a, n: (int(np.flatnonzero(a["f_flags"] == 0)[0]), 1 << 40),
                 "raw length does not fit its flags", id="raw-length-of-raw-field"),
    pytest.param("f_flags", lambda a, n: (int(np.flatnonzero(a["f_flags"] == 0)[0]), 1),
                 "raw length does not fit its flags", id="raw-field-marked-compressed"),
    pytest.param("f_flags", lambda a, n: (int(np.flatnonzero(a["f_flags"] == 1)[0]), 0),
                 "raw length does not fit its flags", id="compressed-field-marked-raw"),
]


@pytest.mark.parametrize(("name", "edit", "message"), STRUCTURE)
def test_shard_without_index_digest_is_checked_for_structure(
        ds: Path, name: str, edit: Edit, message: str) -> None:
    path = shard(ds)
    drop_digest(path)
    with h5py.File(path, "r+") as f:
        g = f["index"]
        arrays: dict[str, Any] = {k: g[k][()] for k in ARRAYS}
        row, value = edit(arrays, len(f.attrs["field_names"]))
        arrays[name][row] = value
        g[name][...] = arrays[name]
    with pytest.raises(IndexCorruptError, match=f"{path}.*{message}.*good copy"):
        load_hdf5_index(str(path))
    with shardio.open_dataset(ds) as reader, pytest.raises(IndexCorruptError):
        reader[7 * SHARD]


def test_key_offset_inside_a_utf8_character_is_index_corruption(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(4):
        (src / f"é{i:02d}.txt").write_text(f"sample {i}")  # key 0 is b"\xc3\xa900"
    pack_into(src, tmp_path / "ds", "hdf5", samples_per_shard=4)
    path = shard(tmp_path / "ds", 0)
    drop_digest(path)
    with h5py.File(path, "r+") as f:
        assert f["index"]["key_offsets"][1] == 4
        f["index"]["key_offsets"][1] = 5  # key 1 would start with the second byte of "é"
    with pytest.raises(IndexCorruptError, match="cut a UTF-8 character"):
        load_hdf5_index(str(path))
