"""Adversarial tests of the built-in decoders, the zstd codec, the manifest and ``inspect``."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import shardio
from shardio.errors import DecodeError, UsageError


def _pack(src: Path, out: Path, **options: object) -> Path:
    shardio.pack(src, out, samples_per_shard=4, fsync=False, progress=False, **options)
    return out


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=True)
    return buf.getvalue()


def test_an_object_npy_needs_allow_pickle_and_decodes_with_it(tmp_path: Path) -> None:
    """An .npy of object dtype (a valid file; numpy pickles its items) was a DecodeError saying
    the source was malformed and to repack, with allow_pickle=True as well: the user's trust was
    not honoured and the message named no real fix."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.npy").write_bytes(_npy(np.array([1, "two", None], dtype=object)))
    (src / "b.npy").write_bytes(_npy(np.arange(3)))
    (src / "c.npy").write_bytes(b"\x93NUMPY\x01\x00")  # cut inside its header: malformed
    ds = _pack(src, tmp_path / "ds")
    with pytest.raises(UsageError, match=r"sample 'a': field 'npy' .*allow_pickle=True"):
        shardio.ShardDataset(ds, decode=True)[0]
    np.testing.assert_array_equal(shardio.ShardDataset(ds, decode=True)[1]["npy"], np.arange(3))
    got = shardio.ShardDataset(ds, decode=True, allow_pickle=True)[0]["npy"]
    assert got.dtype == object and got.tolist() == [1, "two", None]
    for allow in (False, True):
        with pytest.raises(DecodeError, match=r"sample 'c' field 'npy' does not decode"):
            shardio.ShardDataset(ds, decode=True, allow_pickle=allow)[2]
