"""A sample over 2 GiB: one ``read`` returns at most ~2 GiB (Linux: 2 GiB less a page), so every
read of a file or a span loops past that cap.  Before, ``shardio pack`` wrote such a file cut at
2,147,479,552 bytes, with the checksum of the cut bytes, and ``verify`` called it clean.

Real files: a sparse 2.2 GB source file (no disk blocks; reading it yields zeros), packed by the
C loop (serially and with reader threads) and by the Python code, then verified and read back
with and without an arena.  Each pass holds ~2.2 GB in memory and writes a 2.2 GB shard, one at a
time.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import shardio
import shardio.formats.tar as tar_format
from shardio import sharedbytes as sb
from shardio._fsutil import BIG_READ
from shardio._packpool import Task
from shardio._scan import scan_source
from shardio.codec import Codec
from shardio.packer import _pack_shard

pytestmark = pytest.mark.timeout(600)

BIG = 2_200_000_000  # over the ~2 GiB one read returns


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("big") / "src"
    (root / "a").mkdir(parents=True)
    with open(root / "a" / "x.bin", "wb") as f:
        f.truncate(BIG)  # sparse: zeros, no blocks
    (root / "a" / "y.txt").write_bytes(b"small")
    return root


def _check(out: Path) -> None:
    """The shard holds the whole file, verify finds it clean, and both read paths return it."""
    with shardio.open_dataset(out) as ds:
        shard = ds.shard(0)
        i = shard.index.keys().index("a/x")
        row = int(shard.index.sample_start[i])
        assert int(shard.index.f_length[row]) == BIG
        assert os.path.getsize(shard.path) > BIG
    assert shardio.verify_dataset(out) == []
    with shardio.open_dataset(out) as ds:
        data = ds[i]["bin"]
        assert len(data) == BIG and not any(data[:: 1 << 20])
        del data
        ds.set_arena(sb.Arena(chunk_bytes=64 << 20, shared=False))
        view = ds[i]["bin"]  # read into the arena (preadv)
        assert type(view) is np.ndarray and view.nbytes == BIG and not view[:: 1 << 20].any()
        del view
    shutil.rmtree(out)


@pytest.fixture(scope="module")
def digest(src: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The C loop's pack, checked whole (:func:`_check`): its shard digest, for the others."""
    out = tmp_path_factory.mktemp("c") / "out"
    shardio.pack(src, out, shard_size="4GB", fsync=False, progress=False)
    got = shardio.Manifest.load(out).shards[0].digest
    _check(out)
    return got


def test_the_c_loop_packs_the_whole_file(digest: str) -> None:
    assert BIG > 2**31 - 4096 and BIG_READ <= 2**31 - 4096 and digest


def test_the_python_code_packs_the_whole_file(src: Path, tmp_path: Path, digest: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tar_format, "_fill", None)
    shardio.pack(src, tmp_path / "out", shard_size="4GB", fsync=False, progress=False)
    assert shardio.Manifest.load(tmp_path / "out").shards[0].digest == digest


def test_the_c_loops_reader_threads_pack_the_whole_file(src: Path, tmp_path: Path,
                                                        digest: str) -> None:
    samples = scan_source(str(src), str(tmp_path / "out"), files_from=None,
                          label_from_dir=False, on_error="raise").samples
    assert len(samples) == 2  # (the threads take a batch of more than one sample)
    (tmp_path / "out").mkdir()
    _n, written, _skipped = _pack_shard(
        Task(0, str(tmp_path / "out" / "shard-000000.tar"), samples, "fp", 4), "tar", Codec(),
        "xxh3_64", False, "raise")
    assert written.digest == digest  # the same shard, byte for byte
