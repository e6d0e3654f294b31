"""Batch reads of single samples (``shardio._sampleio.read_many``, the fast path of
``DatasetReader.read_ids`` into an arena) deliver what the per-sample reads deliver, in the
same order, and fail, repair and count the same way.

Real components only: datasets packed by ``shardio.pack``, the C extension, arenas of real
memory; the per-sample path (``_read_many`` switched off) is the reference.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardio
from shardio import reader as reader_mod
from shardio import sharedbytes as sb
from shardio.errors import ChecksumMismatchError, UnrepairableError
from shardio.reader import DatasetReader
from tests.conftest import flip_bit, pack_bin_dataset

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(reader_mod._read_many is None, reason="shardio._sampleio not built"),
]

N = 120


def _payload(i: int) -> bytes:
    """Sizes from 0 bytes to 12 KB: fields both below and above the arena's ``min_bytes``."""
    size = 0 if i % 17 == 0 else (i * 1013) % 12_000
    return bytes((i * 13 + k * 5) & 0xFF for k in range(size))


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_bin_dataset(tmp_path_factory.mktemp("rm"), N, _payload, classes=4,
                            samples_per_shard=13, text=lambda i: i % 3 != 0)


class _Counting:
    """Stands in for ``reader._read_many``: counts calls and the samples they delivered."""

    def __init__(self) -> None:
        self.calls = 0
        self.samples = 0
        self.real = reader_mod._read_many

    def __call__(self, *args: Any) -> tuple[int, int]:
        out = args[-1]
        before = len(out)
        got = self.real(*args)
        self.calls += 1
        self.samples += len(out) - before
        return got


def _keys(root: Path) -> list[str]:
    """Every key in global id order (the order of the shards, then of each index)."""
    with shardio.open_dataset(root) as ds:
        return [k for i in range(ds.num_shards) for k in ds.shard(i).index.keys()]


def _payload_of(key: str) -> bytes:
    return _payload(int(key[-3:]))


def _damaged_copy(ds_path: Path, root: Path, shard: int, sample: int
                  ) -> tuple[int, str, list[tuple[int, int]]]:
    """Copy the dataset to ``root`` and flip a bit in the first field of ``sample`` of
    ``shard``; ``(its global id, its key, the shard's sample spans)``."""
    shutil.copytree(ds_path, root)
    with shardio.open_dataset(root) as ds:
        sr = ds.shard(shard)
        row = int(sr.index.sample_start[sample])
        flip_bit(sr.path, int(sr.index.f_offset[row]) + 1, 4)
        return (int(ds.offsets[shard]) + sample, sr.index.key(sample),
                [sr.index.span(i) for i in range(len(sr))])


def _plain(sample: dict[str, Any]) -> dict[str, Any]:
    return {k: (v if isinstance(v, (bytes, str)) else bytes(v)) for k, v in sample.items()}


def _open(root: Path, chunk_bytes: int, **kw: Any) -> DatasetReader:
    r = DatasetReader(root, **kw)
    r.set_arena(sb.Arena(chunk_bytes=chunk_bytes, shared=False))
    return r


def _ids(seed: int) -> np.ndarray:
    """A shuffled order with some runs of consecutive ids (read whole, not by read_many)."""
    ids = np.random.default_rng(seed).permutation(N)
    pos = int(np.flatnonzero(ids < N - 3)[0])
    first = int(ids[pos])
    ids = np.delete(ids, np.flatnonzero(np.isin(ids, [first + 1, first + 2])))
    return np.insert(ids, pos + 1, [first + 1, first + 2])


def _read(r: DatasetReader, ids: np.ndarray, batch: int) -> Iterator[dict[str, Any]]:
    for k in range(0, len(ids), batch):
        r.arena.rewind()
        yield from (_plain(s) for s in r.read_ids(ids[k:k + batch]))


@pytest.mark.parametrize("chunk_bytes", [64 << 10, 4 << 20])
def test_same_samples_as_the_per_sample_reads(ds_path: Path, chunk_bytes: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Across shards, runs and chunk changes (64 KiB chunks: the room runs out every few
    samples), in order, field for field; and read_many did deliver most of them."""
    ids = _ids(0)
    monkeypatch.setattr(reader_mod, "_read_many", None)
    with _open(ds_path, chunk_bytes) as r:
        want = list(_read(r, ids, 40))
        want_bytes = r.counters.get("bytes_original")
    monkeypatch.undo()
    counting = _Counting()
    monkeypatch.setattr(reader_mod, "_read_many", counting)
    with _open(ds_path, chunk_bytes) as r:
        got = list(_read(r, ids, 40))
        assert r.counters.get("bytes_original") == want_bytes  # every byte read counted once
    assert [s["__key__"] for s in got] == [s["__key__"] for s in want]
    assert got == want
    assert len(got) == len(ids)
    # The first batch opens the shards (per sample); then read_many takes the single samples.
    assert counting.samples > len(ids) // 2, (counting.calls, counting.samples)


def test_fields_are_views_of_the_arena_chunk(ds_path: Path) -> None:
    """Large fields come out as views of the arena's chunk (zero copy), small ones as bytes,
    exactly as ShardReader.get_into cuts them."""
    with _open(ds_path, 4 << 20) as r:
        list(r.read_ids(np.arange(0, N, 13)))  # opens every shard
        r.arena.rewind()
        samples = list(r.read_ids(np.array([5, 40, 77, 101, 3])))
    big = [s["bin"] for s in samples if len(s["bin"]) >= sb.MIN_BYTES]
    small = [s["bin"] for s in samples if len(s["bin"]) < sb.MIN_BYTES]
    assert big and all(type(v) is np.ndarray and v.base is not None for v in big)
    assert all(type(v) is bytes for v in small)
    keys = _keys(ds_path)
    assert [bytes(s["bin"]) for s in samples] == [_payload_of(keys[i])
                                                   for i in (5, 40, 77, 101, 3)]


def test_a_flipped_bit_raises_the_per_sample_error(ds_path: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A checksum mismatch in the middle of a batch read_many takes: the same typed error as
    the per-sample read, and every sample before it was delivered intact."""
    root = tmp_path / "ds"
    bad, bad_key, _spans = _damaged_copy(ds_path, root, 3, 5)
    assert len(_payload_of(bad_key)) > 1
    keys = _keys(root)
    ids = np.array([0, 20, 50, 90, 30, bad, 60, 10])

    def first_error(use_c: bool) -> tuple[list[str], str]:
        if not use_c:
            monkeypatch.setattr(reader_mod, "_read_many", None)
        keys: list[str] = []
        with _open(root, 4 << 20) as r:
            list(r.read_ids(np.arange(0, N, 13)))  # opens every shard
            r.arena.rewind()
            with pytest.raises((ChecksumMismatchError, UnrepairableError)) as ei:
                for s in r.read_ids(ids):
                    keys.append(s["__key__"])
                    assert bytes(s["bin"]) == _payload_of(s["__key__"])
            assert r.counters.get("checksum_mismatch") == 1
        monkeypatch.undo()
        return keys, str(ei.value)

    c_keys, c_error = first_error(True)
    py_keys, py_error = first_error(False)
    assert c_keys == py_keys == [keys[i] for i in [0, 20, 50, 90, 30]]
    assert c_error == py_error and bad_key in c_error


def test_repair_moves_the_rest_of_the_batch_to_the_good_copy(
        ds_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a failover in the middle of a batch, the later samples of that shard are read
    from the replica and counted as its bytes, as the per-sample reads do: never through the
    descriptor of the copy that was dropped (which the replica's open may have been given)."""
    root = tmp_path / "ds"
    bad, _key, spans = _damaged_copy(ds_path, root, 2, 1)
    base = bad - 1
    # Shard 2's bad sample, then three more of it (not runs), between other shards' samples.
    ids = np.array([0, base + 1, 60, base + 4, 100, base + 7, 33, base + 10])
    keys = _keys(root)

    def read(use_c: bool) -> dict[str, int]:
        counting = _Counting()
        monkeypatch.setattr(reader_mod, "_read_many", counting if use_c else None)
        with _open(root, 4 << 20, replicas=[str(ds_path)]) as r:
            list(r.read_ids(np.arange(0, N, 13)))  # opens every shard
            r.arena.rewind()
            before = r.counters.snapshot()
            got = [_plain(s) for s in r.read_ids(ids)]
            after = r.counters.snapshot()
        monkeypatch.undo()
        assert [s["__key__"] for s in got] == [keys[i] for i in ids]
        assert [bytes(s["bin"]) for s in got] == [_payload_of(keys[i]) for i in ids]
        if use_c:
            assert counting.samples >= 6  # all but the bad sample (and its retry)
        return {k: after[k] - before[k] for k in after}

    c, py = read(True), read(False)
    assert c == py
    assert c["checksum_mismatch"] == 1 and c["failovers"] == 1
    later = sum(hi - lo for lo, hi in (spans[4], spans[7], spans[10]))
    assert c["bytes_replica"] >= later + spans[1][1] - spans[1][0]


def test_read_many_rejects_bad_arguments(ds_path: Path) -> None:
    from shardio._sampleio import read_many

    buf = bytearray(4096)
    view = np.frombuffer(buf, np.uint8)
    one = np.zeros(1, np.int64)
    with pytest.raises(TypeError, match="readers"):
        read_many(((1, 2, None, None),), one, one, 0, 1, buf, view, 0, 64, [])
    with pytest.raises(ValueError, match="end"):
        read_many((), one, one, 0, 2, buf, view, 0, 64, [])
    with shardio.open_dataset(ds_path) as ds:
        sr = ds.shard(0)
        sr._views()
        fd = os.open(sr.path, os.O_RDONLY)
        try:
            readers = ((sr._cidx, fd, None, None),)
            with pytest.raises(IndexError, match="slot"):
                read_many(readers, np.array([1]), one, 0, 1, buf, view, 0, 64, [])
            out: list[Any] = []
            # No room for the sample: nothing read, nothing used.
            assert read_many(readers, one, one, 0, 1, buf[:10], view, 0, 64, out) == (0, 0)
            assert out == []
            k, used = read_many(readers, one, one, 0, 1, buf, view, 0, 64, out)
            assert (k, len(out)) == (1, 1) and used % 64 == 0 and used >= sum(
                hi - lo for lo, hi in [sr.index.span(0)])
        finally:
            os.close(fd)
