"""The C loop of a pack (shardio/_tarpack.c) writes exactly what the Python code writes.

``TarWriter.add_files`` reads runs of samples in C and hands back any it does not handle (pax
names, non-ASCII, unreadable or grown files); ``TarWriter.add`` is the reference.  HDF5 shards use
the same loop without tar headers (``Hdf5Writer.add_files``; ``Hdf5Writer.add`` the reference).
Every test packs the same input both ways and compares the output byte for byte, and checks that
the C loop did take part (so a fallback everywhere cannot pass for equality).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardio
import shardio.formats.hdf5 as hdf5_format
import shardio.formats.tar as tar_format
from shardio._scan import Sample
from shardio.codec import Codec
from shardio.formats.tar import TarWriter, load_tar_index
from tests.test_pack import file_bytes, read_back, write_files

pytestmark = pytest.mark.skipif(tar_format._fill is None, reason="shardio._tarpack not built")


class _Counting:
    """Wraps ``_tarpack.fill``: counts the samples it wrote; with ``threads``, every call reads
    its files in that many threads (as a pack of a slow source does)."""

    def __init__(self, fill: Any, threads: int = 0) -> None:
        self.fill = fill
        self.samples = 0
        self.threads = threads

    def __call__(self, samples: list[Any], start: int, *args: Any) -> Any:
        if self.threads:
            args = (*args[:9], self.threads, *args[10:])
        result = self.fill(samples, start, *args)
        self.samples += result[0] - start
        return result


_WRITERS = {"tar": tar_format, "hdf5": hdf5_format}


def _pack_both(src: Path, out: Path, monkeypatch: pytest.MonkeyPatch, threads: int = 0,
               **options: Any) -> tuple[dict[str, bytes], int]:
    """Pack ``src`` with the C loop (its files read in ``threads`` threads, when given) and with
    the Python code; return the output files (the same both ways, asserted) and how many
    samples the C loop wrote."""
    writer = _WRITERS[options.get("format", "tar")]
    counting = _Counting(writer._fill, threads)
    monkeypatch.setattr(writer, "_fill", counting)
    shardio.pack(src, out / "c", progress=False, **options)
    monkeypatch.setattr(writer, "_fill", None)
    shardio.pack(src, out / "py", progress=False, **options)
    monkeypatch.setattr(writer, "_fill", counting.fill)
    c, py = file_bytes(out / "c"), file_bytes(out / "py")
    assert sorted(c) == sorted(py)
    for name in py:
        assert c[name] == py[name], f"{name} differs between the C loop and the Python code"
    return c, counting.samples


@pytest.fixture
def small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 KiB batches: many buffer turns per shard, and samples bigger than a buffer."""
    monkeypatch.setattr(tar_format, "_FLUSH", 8192)
    monkeypatch.setattr(hdf5_format, "_FILL", 8192)


def _varied_tree(root: Path) -> Path:
    """Class folders; plain names, long names (pax), non-ASCII names, several fields per sample
    (sorting before and after the ``cls`` label), empty files, sizes across block boundaries."""
    files: dict[str, bytes] = {}
    for c, cls in enumerate(["cat", "dog", "zé"]):
        for i in range(40):
            stem = f"s{i:03d}" + ("L" * 120 if i % 13 == 5 else "") + ("é" if i % 11 == 3 else "")
            size = [0, 1, 511, 512, 513, 1024, 3000, 20000][(i + c) % 8]
            files[f"{cls}/{stem}.jpg"] = os.urandom(size)
            if i % 3 == 0:
                files[f"{cls}/{stem}.aaa"] = b"before the label"
            if i % 4 == 0:
                files[f"{cls}/{stem}.txt"] = f"caption {i}".encode()
    # "<key>.a" fits a ustar name (100 bytes) and "<key>.cls" does not: the label needs pax.
    files["cat/" + "k" * 93 + ".a"] = b"short field name"
    return write_files(root, files)


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
@pytest.mark.parametrize("label", [True, False])
@pytest.mark.parametrize("workers", [1, 2])
def test_same_bytes_as_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              small_batches: None, label: bool, workers: int, fmt: str) -> None:
    src = _varied_tree(tmp_path / "src")
    _files, in_c = _pack_both(src, tmp_path / "out", monkeypatch, label_from_dir=label,
                             samples_per_shard=17, workers=workers, format=fmt)
    if workers == 1:  # forked workers count in their own copy of the wrapper
        # The plain samples went through C; non-ASCII keys did not, nor, in a tar shard, pax
        # names (with a label, the sample whose "<key>.cls" is too long for ustar too).  HDF5
        # has no member names: long ones go through C.
        expected = {("tar", True): 66, ("tar", False): 67, ("hdf5", True): 73,
                    ("hdf5", False): 73}
        assert in_c == expected[fmt, label]
    assert read_back(tmp_path / "out" / "c") == read_back(tmp_path / "out" / "py")


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
@pytest.mark.parametrize("label", [True, False])
def test_threaded_reads_write_the_same_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             small_batches: None, label: bool, fmt: str) -> None:
    """The C loop's reader threads (a slow source) lay every member where the serial loop
    does: empty files, sizes across block boundaries, several fields and the label."""
    src = _varied_tree(tmp_path / "src")
    _files, in_c = _pack_both(src, tmp_path / "out", monkeypatch, threads=4,
                             label_from_dir=label, samples_per_shard=17, format=fmt)
    assert in_c > 60


def test_threaded_reads_run_at_once(tmp_path: Path) -> None:
    """With a simulated 0.1 s a sample, 8 samples take 0.8 s in one thread and about 0.1 s in 8:
    the C loop's threads read at the same time (and sleep each sample's delay)."""
    from array import array

    samples = []
    for k in range(8):
        (tmp_path / f"f{k}.bin").write_bytes(bytes([k]) * 3000)
        samples.append(_sample(tmp_path / f"f{k}.bin"))
    delays = array("d", [0.1] * 8)
    took = {}
    for threads in (8, 1):
        w = TarWriter(str(tmp_path / f"t{threads}.tar"), Codec(), "xxh3_64", fsync=False)
        t = time.perf_counter()
        assert w.add_files(samples, 0, "cls", threads, delays) == 8
        took[threads] = time.perf_counter() - t
        w.close()
    assert took[1] >= 0.8  # each sample's delay slept
    assert took[8] < 0.5, took  # at once (0.1 s and thread starts; 0.8 s one after another)
    assert (tmp_path / "t8.tar").read_bytes() == (tmp_path / "t1.tar").read_bytes()
    w = TarWriter(str(tmp_path / "t100.tar"), Codec(), "xxh3_64", fsync=False)
    assert w.add_files(samples, 0, "cls", 100) == 8  # --scan-threads 100: 64 at most, no error
    w.close()
    assert (tmp_path / "t100.tar").read_bytes() == (tmp_path / "t1.tar").read_bytes()
    with pytest.raises(ValueError, match="threads"):
        TarWriter(str(tmp_path / "x.tar"), Codec(), "xxh3_64").add_files(samples, 0, "cls", 0)
    with pytest.raises(ValueError, match="delays"):
        TarWriter(str(tmp_path / "y.tar"), Codec(), "xxh3_64").add_files(
            samples, 0, "cls", 2, array("d", [0.0]))


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_sample_larger_than_a_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     fmt: str) -> None:
    # Bigger than a batch buffer (3 MiB; HDF5: the room left in the payload buffer): it gets a
    # bytes object of its own.
    src = write_files(tmp_path / "src", {
        "a/x.bin": os.urandom(100), "a/y.bin": os.urandom(4 << 20), "a/z.bin": os.urandom(7),
    })
    _files, in_c = _pack_both(src, tmp_path / "out", monkeypatch, shard_size="64MB", format=fmt)
    assert in_c == 3
    assert read_back(tmp_path / "out" / "c")["a/y"]["bin"] == (src / "a/y.bin").read_bytes()


_NAME = st.text(alphabet="abcxyz_-é0", min_size=1, max_size=8)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(tree=st.dictionaries(
    st.tuples(st.sampled_from(["c1", "c2"]), _NAME, st.sampled_from(["jpg", "txt", "a", "zz"])),
    st.integers(0, 3000), min_size=1, max_size=30),
    label=st.booleans(), per_shard=st.integers(1, 9), fmt=st.sampled_from(["tar", "hdf5"]))
def test_same_bytes_as_python_any_tree(tmp_path_factory: pytest.TempPathFactory,
                                       monkeypatch: pytest.MonkeyPatch,
                                       tree: dict[tuple[str, str, str], int], label: bool,
                                       per_shard: int, fmt: str) -> None:
    root = tmp_path_factory.mktemp("t")
    monkeypatch.setattr(tar_format, "_FLUSH", 4096)
    monkeypatch.setattr(hdf5_format, "_FILL", 4096)
    src = write_files(root / "src", {f"{d}/{stem}.{ext}": os.urandom(n)
                                     for (d, stem, ext), n in tree.items()})
    _pack_both(src, root / "out", monkeypatch, label_from_dir=label, samples_per_shard=per_shard,
               format=fmt)


# --- what the C loop hands back ------------------------------------------------------------


def _sample(path: Path, size: int | None = None, key: str | None = None) -> Sample:
    st_ = path.stat()
    return Sample(key or path.stem, [("bin", str(path), st_.st_size if size is None else size,
                                      st_.st_mtime_ns)], 1)


def _write(samples: list[Sample], out: Path, use_c: bool, threads: int = 1) -> Iterator[int]:
    """Write ``samples`` to shard ``out`` as packer._pack_shard does; yield where add_files
    (reading in ``threads`` threads) stopped each time."""
    w = TarWriter(str(out), Codec(), "xxh3_64", fsync=False)
    i = 0
    while i < len(samples):
        if use_c:
            i = w.add_files(samples, i, "cls", threads)
            yield i
            if i >= len(samples):
                break
        s = samples[i]
        i += 1
        fields = []
        if not all(os.path.exists(path) for _n, path, _s, _m in s.files):
            continue  # skipped, as --on-error skip does
        for name, path, size, _m in s.files:
            with open(path, "rb") as f:
                fields.append((name, f.read()))
        fields.append(("cls", b"1"))
        fields.sort()
        w.add(s.key, fields)
    w.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_hands_back_grown_and_unreadable_files(tmp_path: Path, threads: int) -> None:
    d = tmp_path / "d"
    d.mkdir()
    for k in range(6):
        (d / f"f{k}.bin").write_bytes(bytes([k]) * (1000 + k))
    samples = [_sample(d / f"f{k}.bin") for k in range(6)]
    samples[2] = _sample(d / "f2.bin", size=500)  # grew since the scan: 1002 bytes now
    samples[5] = Sample("f5", [("bin", str(d / "missing.bin"), 7, 0)], 1)
    os.chmod(d / "f4.bin", 0)
    unreadable = os.geteuid() != 0  # root reads it anyway: then only f2 and f5 are handed back
    stops = list(_write(samples, tmp_path / "c.tar", use_c=True, threads=threads))
    assert stops == ([2, 4, 5] if unreadable else [2, 5])  # (f5 then skipped: the last)
    os.chmod(d / "f4.bin", 0o644)
    list(_write(samples, tmp_path / "py.tar", use_c=False))
    assert (tmp_path / "c.tar").read_bytes() == (tmp_path / "py.tar").read_bytes()
    assert (tmp_path / "c.tar.idx").read_bytes() == (tmp_path / "py.tar.idx").read_bytes()
    index = load_tar_index(str(tmp_path / "c.tar"))
    assert len(index) == 5


@pytest.mark.parametrize("threads", [1, 2])
def test_shrunk_file_is_written_at_its_new_size(tmp_path: Path, threads: int) -> None:
    (tmp_path / "a.bin").write_bytes(b"x" * 700)
    (tmp_path / "b.bin").write_bytes(b"y" * 30)
    # The scan saw 5000 bytes of a.bin.  The serial loop writes it at its new size; the reader
    # threads laid the batch out from the scan's sizes and hand it to the Python code.
    samples = [_sample(tmp_path / "a.bin", size=5000), _sample(tmp_path / "b.bin")]
    assert list(_write(samples, tmp_path / "c.tar", use_c=True, threads=threads)) == (
        [2] if threads == 1 else [0, 2])
    list(_write(samples, tmp_path / "py.tar", use_c=False))
    assert (tmp_path / "c.tar").read_bytes() == (tmp_path / "py.tar").read_bytes()
    assert (tmp_path / "c.tar.idx").read_bytes() == (tmp_path / "py.tar.idx").read_bytes()


def test_unreadable_sample_registers_no_field_name(tmp_path: Path) -> None:
    # A sample the C loop gives up on must not leave its field name in the index's name table:
    # the Python code may skip it (--on-error skip), and then the name never appears.
    (tmp_path / "ok.bin").write_bytes(b"1")
    w = TarWriter(str(tmp_path / "s.tar"), Codec(), "xxh3_64", fsync=False)
    bad = Sample("bad", [("odd", str(tmp_path / "missing.bin"), 3, 0)], None)
    good = Sample("ok", [("bin", str(tmp_path / "ok.bin"), 1, 0)], None)
    assert w.add_files([good, bad], 0, "cls") == 1
    assert list(w._index._names) == ["bin"]
    w.abort()
    assert not (tmp_path / "s.tar").exists()


def test_buffers_are_pooled_and_released(tmp_path: Path) -> None:
    src = write_files(tmp_path / "src", {f"a/{i}.bin": os.urandom(5000) for i in range(30)})
    seen: list[int] = []
    real = tar_format._take_buffers

    def take() -> list[bytearray]:
        got = real()
        seen.append(id(got))
        return got

    import unittest.mock

    with unittest.mock.patch.object(tar_format, "_take_buffers", take):
        shardio.pack(src, tmp_path / "out", samples_per_shard=5, progress=False)
    assert len(seen) == 6 and len(set(seen)) == 1  # one set of buffers served every shard
    assert tar_format._SPARE_BUFFERS == []  # and was let go at the end of the pack
