"""One-preadv sample reads (shardio/_sampleio.c) give what the Python reader gives, and fail the
same way: ``ShardReader.get`` takes the C path and falls back to ``_decode`` on anything off."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import shardio
from shardio.errors import ChecksumMismatchError, ShardTruncatedError
from shardio.formats import ShardReader, base
from tests.conftest import flip_bit, run_with_eio, truncate
from tests.test_formats import pack_into
from tests.test_pack import write_files

pytestmark = pytest.mark.skipif(base._SampleIndex is None, reason="shardio._sampleio not built")


class _Counting:
    """Stands in for a reader's C index: counts the samples ``get`` returned (not None)."""

    def __init__(self, cidx: Any) -> None:
        self.cidx = cidx
        self.hits = 0
        self.misses = 0

    def cut(self, *args: Any) -> Any:
        return self.cidx.cut(*args)

    def get(self, fd: int, i: int, check: Any, on_read: Any = None) -> Any:
        sample = self.cidx.get(fd, i, check, on_read)
        if sample is None:
            self.misses += 1
        else:
            self.hits += 1
        return sample


def _tree(root: Path) -> Path:
    files: dict[str, bytes] = {}
    for i in range(40):
        files[f"c{i % 3}/s{i:03d}.jpg"] = os.urandom([0, 1, 700, 5000, 70_000][i % 5])
        if i % 2:
            files[f"c{i % 3}/s{i:03d}.txt"] = f"text {i} ".encode() * (i * 30)
        if i % 7 == 0:
            files[f"c{i % 3}/s{i:03d}.json"] = b'{"i": %d}' % i
    files["c0/" + "L" * 150 + ".jpg"] = b"a pax-named member"
    return write_files(root, files)


def _readers(out: Path) -> list[ShardReader]:
    with shardio.open_dataset(out) as ds:
        return [ds.shard(k) for k in range(len(ds.manifest.shards))]


def _python_get(reader: ShardReader, i: int) -> dict[str, Any]:
    lo, hi = reader.index.span(i)
    return reader._decode_py(i, lo, reader.read_span(lo, hi))


def _cut_get(reader: ShardReader, i: int) -> dict[str, Any]:
    """Sample ``i`` read in Python, cut by C (``Index.cut``, what a run of samples takes)."""
    lo, hi = reader.index.span(i)
    return reader._decode(i, lo, reader.read_span(lo, hi))


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
@pytest.mark.parametrize("compress", [None, "zstd"])
def test_same_samples_as_python(tmp_path: Path, fmt: str, compress: str | None) -> None:
    out = tmp_path / "ds"
    pack_into(_tree(tmp_path / "src"), out, fmt, label_from_dir=True, samples_per_shard=9,
              compress=compress)
    hits = 0
    for reader in _readers(out):
        reader._views()
        counting = _Counting(reader._cidx)
        reader._cidx = counting
        for i in range(len(reader)):
            got = reader.get(i)
            want = _python_get(reader, i)
            assert list(got) == list(want)  # same fields, same order
            assert got == want and all(type(v) is bytes for k, v in got.items() if k != "__key__")
            cut = _cut_get(reader, i)
            assert list(cut) == list(want) and cut == want
        hits += counting.hits
        assert counting.hits + counting.misses == len(reader)
    if compress is None:
        assert hits == 41  # every sample went through C
    else:
        assert hits > 0  # samples whose fields zstd left stored as is; the others in Python


def test_flipped_bit_raises_through_python(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    pack_into(_tree(tmp_path / "src"), out, "tar", samples_per_shard=100)
    reader = _readers(out)[0]
    keys = reader.index.keys()
    i = keys.index("c0/s003")  # s003.jpg: 5000 bytes
    row = int(reader.index.sample_start[i])
    assert reader.index.f_length[row] == 5000
    flip_bit(reader.path, int(reader.index.f_offset[row]) + 100, 2)
    with pytest.raises(ChecksumMismatchError) as ei:
        reader.get(i)
    assert "c0/s003" in str(ei.value)
    with pytest.raises(ChecksumMismatchError) as py:
        _python_get(reader, i)
    assert str(ei.value) == str(py.value)  # the same report as the Python read's
    with pytest.raises(ChecksumMismatchError) as cut:
        _cut_get(reader, i)
    assert str(cut.value) == str(py.value)  # Index.cut hands it to the Python code too
    assert reader.get(i + 1) == _python_get(reader, i + 1)  # its neighbours still read
    reader.verify = False  # and without checks, both paths give the damaged bytes
    assert reader.get(i) == _python_get(reader, i)


def test_truncated_shard_raises_through_python(tmp_path: Path) -> None:
    out = tmp_path / "ds"
    pack_into(_tree(tmp_path / "src"), out, "tar", samples_per_shard=100)
    reader = _readers(out)[0]
    assert reader.get(0) is not None  # the descriptor is open
    i = 33
    lo, _hi = reader.index.span(i)
    truncate(reader.path, lo + 10)
    with pytest.raises(ShardTruncatedError, match=f"short read at offset {lo} "):
        reader.get(i)


def test_index_rejects_arrays_of_the_wrong_width() -> None:
    import numpy as np

    u8 = np.zeros(2, dtype=np.uint64)
    with pytest.raises(TypeError, match="f_name"):
        base._SampleIndex(b"", u8, u8, np.zeros(1, np.uint32), np.zeros(1, np.uint8),
                          np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.zeros(1, np.uint64),
                          np.zeros(1, np.int64), np.zeros(1, np.int64), ("a",))
    with pytest.raises(ValueError, match="inconsistent"):
        base._SampleIndex(b"", u8, u8, np.zeros(2, np.uint16), np.zeros(1, np.uint8),
                          np.zeros(1, np.uint64), np.zeros(1, np.uint64), np.zeros(1, np.uint64),
                          np.zeros(1, np.int64), np.zeros(1, np.int64), ("a",))


def test_eio_is_raised_counted_and_failed_over(tmp_path: Path) -> None:
    """A real EIO on the C read's preadv (strace injects it, once): the reader counts it and
    moves to the replica, as it does for the Python read's pread; no sample is lost."""
    import shutil
    import textwrap

    root, replica = tmp_path / "ds", tmp_path / "replica"
    pack_into(_tree(tmp_path / "src"), root, "tar", samples_per_shard=100)
    shutil.copytree(root, replica)
    script = tmp_path / "read.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        import numpy as np
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from shardio.reader import DatasetReader
        r = DatasetReader({str(root)!r}, replicas=[{str(replica)!r}])
        ids = np.array([3, 1, 7, 5, 0, 9, 2, 8, 6, 4] * 2)  # one at a time: ShardReader.get
        keys = [s["__key__"] for s in r.read_ids(ids)]
        print(json.dumps({{"keys": keys, "counters": r.counters.snapshot()}}))
    """))
    # The shard's first read goes through Python (pread64); the second is the C path's preadv.
    out = run_with_eio(script, root / "shard-000000.tar", "preadv", when=2)
    with shardio.open_dataset(root) as ds:
        want = [ds.shard(0).index.key(k) for k in [3, 1, 7, 5, 0, 9, 2, 8, 6, 4] * 2]
    assert out["keys"] == want
    assert out["counters"]["io_error"] == 1 and out["counters"]["failovers"] == 1
