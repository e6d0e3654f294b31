"""Shards are read by the real outside tools, and shardio reads what they write.

GNU tar lists our tar shards; ``webdataset.WebDataset`` iterates them; plain ``h5py`` reads our
HDF5 shards through the layout documented in :mod:`shardio.formats.hdf5`; and tars written by
webdataset's own ``ShardWriter`` (and by GNU tar) become a shardio dataset with ``shardio index``
without a byte of them changing.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import webdataset as wds
import zstandard

import shardio
from shardio.codec import FLAG_ZSTD
from tests.test_formats import Fields, pack_into, read_all, source_samples, write_tree
from tests.test_formats import text_tree  # noqa: F401  (fixture)

CLI = Callable[..., tuple[int, str, str]]


def shard_paths(root: Path) -> list[str]:
    manifest = shardio.Manifest.load(str(root))
    return [str(root / s.path) for s in manifest.shards]


def gnu_tar_list(path: str) -> list[str]:
    """Member names as GNU tar prints them (raw UTF-8, no quoting), failing on any tar error."""
    proc = subprocess.run(["tar", "--quoting-style=literal", "-tf", path], capture_output=True,
                          env={**os.environ, "LC_ALL": "C.UTF-8"}, check=False, timeout=30)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    assert proc.stderr == b""
    return proc.stdout.decode("utf-8").splitlines()


def sha256_files(paths: list[str]) -> dict[str, str]:
    return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


def webdataset_samples(urls: list[str]) -> list[tuple[str, Fields]]:
    out = []
    for s in wds.WebDataset(urls, shardshuffle=False):
        out.append((s["__key__"], {k: v for k, v in s.items() if not k.startswith("__")}))
    return out


# --- tar ---------------------------------------------------------------------------------------
def test_gnu_tar_lists_exactly_the_expected_members(mixed_tree: Path, tmp_path: Path) -> None:
    # Add a non-ASCII key and a name longer than ustar's 100 bytes: both need pax headers.
    # Also names right at ustar's 100-byte name field (99, 100, 101 bytes) and dotted directories.
    long_dir = "deep/" + "d" * 60 + "/" + "e" * 50
    edge = {f"edge/{'n' * (size - 9)}": {"txt": b"%d" % size} for size in (99, 100, 101)}
    write_tree(mixed_tree, {"ünï/cödé": {"txt": b"unicode"}, f"{long_dir}/x": {"json": b"{}"},
                            "v1.0/img": {"tar.gz": b"dotted", "json": b""}, **edge})
    out = tmp_path / "out"
    pack_into(mixed_tree, out, "tar", samples_per_shard=8)
    expected_samples = source_samples(mixed_tree)
    expected = [f"{key}.{field}" for key in sorted(expected_samples)
                for field in sorted(expected_samples[key])]
    assert f"{long_dir}/x.json" in expected and "ünï/cödé.txt" in expected
    assert sorted(len(n.encode()) for n in expected if n.startswith("edge/")) == [99, 100, 101]
    assert "v1.0/img.tar.gz" in expected

    listed = []
    paths = shard_paths(out)
    assert len(paths) == 6  # 46 samples, 8 per shard
    for p in paths:
        names = gnu_tar_list(p)
        assert names, p
        listed += names
    assert listed == expected
    assert webdataset_samples(paths) == read_all(out)


def test_webdataset_reads_our_tar_shards(mixed_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack_into(mixed_tree, out, "tar", samples_per_shard=7)
    expected = source_samples(mixed_tree)
    got = webdataset_samples(shard_paths(out))
    assert [k for k, _ in got] == sorted(expected)
    assert dict(got) == expected
    assert got == read_all(out)


def test_compressed_tar_members_are_plain_zstd(text_tree: Path, tmp_path: Path) -> None:
    """With compression a member is ``<key>.<field>.zst`` holding a standard zstd frame."""
    out = tmp_path / "out"
    pack_into(text_tree, out, "tar", samples_per_shard=100, compress="zstd")
    expected = source_samples(text_tree)
    got: dict[str, Fields] = {}
    for key, fields in webdataset_samples(shard_paths(out)):
        got[key] = {}
        for name, data in fields.items():
            if name.endswith(".zst"):
                got[key][name[: -len(".zst")]] = zstandard.ZstdDecompressor().decompress(data)
            else:
                got[key][name] = data
    assert got == expected
    assert any(n.endswith(".zst") for p in shard_paths(out) for n in gnu_tar_list(p))


@pytest.mark.parametrize("via", ["cli", "api"])
def test_index_makes_webdataset_tars_readable(via: str, cli: CLI, tmp_path: Path) -> None:
    wd = tmp_path / "wds"
    wd.mkdir()
    written: list[tuple[str, Fields]] = []
    with wds.ShardWriter(str(wd / "part-%04d.tar"), maxcount=5, verbose=0) as sink:
        for i in range(13):
            fields = {"txt": f"caption {i}".encode(), "cls": str(i % 3).encode(),
                      "bin": bytes(range(i % 7)) * (i * 40)}  # 0-byte for i % 7 == 0
            sink.write({"__key__": f"sample{i:04d}", **fields})
            written.append((f"sample{i:04d}", fields))
    tars = sorted(str(p) for p in wd.glob("*.tar"))
    assert len(tars) == 3
    before = sha256_files(tars)
    assert webdataset_samples(tars) == written  # the reference reading of these tars

    if via == "cli":
        rc, stdout, stderr = cli("index", *tars)
        assert rc == 0, stderr
        assert "indexed 3 tar(s), 13 samples" in stdout
    else:
        manifest = shardio.index_tars(tars)
        assert [s.path for s in manifest.shards] == [Path(t).name for t in tars]

    assert sha256_files(tars) == before, "indexing must not rewrite the tars"
    assert sorted(p.name for p in wd.iterdir()) == sorted(
        [Path(t).name for t in tars] + [Path(t).name + ".idx" for t in tars] + ["manifest.json"])
    assert read_all(wd) == written
    with shardio.open_dataset(wd) as reader:
        assert len(reader) == 13
        assert reader[12] == {"__key__": "sample0012", **written[12][1]}
    manifest = shardio.Manifest.load(str(wd))
    assert manifest.fields == {"txt": 13, "cls": 13, "bin": 13}
    assert [s.samples for s in manifest.shards] == [5, 5, 3]
    assert cli("verify", wd, "--workers", "1")[:2] == (0, "")


@pytest.mark.parametrize("tar_format", ["gnu", "pax"])
def test_index_makes_gnu_tar_archives_readable(tar_format: str, mixed_tree: Path, cli: CLI,
                                               tmp_path: Path) -> None:
    """A tar written by GNU tar itself (directory members, long-name records) indexes like
    webdataset reads it."""
    long_dir = "deep/" + "d" * 70 + "/" + "e" * 60  # > 100 bytes: GNU 'L' record / pax path
    write_tree(mixed_tree, {"ünï/cödé": {"txt": b"unicode"}, f"{long_dir}/x": {"json": b"{}"}})
    ds = tmp_path / "ds"
    ds.mkdir()
    tar = ds / "all.tar"
    subprocess.run(["tar", f"--format={tar_format}", "--sort=name", "-cf", str(tar), "-C",
                    str(mixed_tree), "."], check=True, timeout=30,
                   env={**os.environ, "LC_ALL": "C.UTF-8"})
    before = sha256_files([str(tar)])
    rc, _out, err = cli("index", tar)
    assert rc == 0, err
    assert sha256_files([str(tar)]) == before

    reference = webdataset_samples([str(tar)])
    assert read_all(ds) == reference
    expected = {f"./{k}": v for k, v in source_samples(mixed_tree).items()}
    assert dict(reference) == expected
    assert cli("verify", ds, "--workers", "1")[:2] == (0, "")


def _tar_of(path: Path, members: list[tuple[str, bytes]]) -> None:
    import io
    import tarfile

    with tarfile.open(path, "w") as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


def test_index_groups_members_as_webdataset_does(cli: CLI, tmp_path: Path) -> None:
    """Odd names: an upper-case extension (WebDataset lowercases it), ``__x__`` names (skipped),
    a name whose basename starts with a dot (key ``d/``, as ``pack --files-from`` writes it),
    several dots, a name without an extension (skipped)."""
    ds = tmp_path / "ds"
    ds.mkdir()
    tar = ds / "odd.tar"
    _tar_of(tar, [("a.JPG", b"1"), ("a.Cls", b"2"), ("__meta__", b"m"), ("__dir__/f.txt", b"3"),
                  ("d/.h.txt", b"4"), ("b.x.y.tar.gz", b"5"), ("noext", b"6"), ("c.txt", b"7")])
    rc, _out, err = cli("index", tar)
    assert rc == 0, err
    reference = webdataset_samples([str(tar)])
    assert [k for k, _f in reference] == ["a", "d/", "b", "c"]
    assert read_all(ds) == reference


@pytest.mark.parametrize("case", ["duplicate", "reserved", "sparse"])
def test_index_refuses_what_it_cannot_read_right(case: str, cli: CLI, tmp_path: Path) -> None:
    """A sample with a field twice (WebDataset raises too; shardio kept the second and lost the
    first), a field named ``__key__`` (WebDataset raises; shardio's sample had the member's
    bytes for its key) and a GNU sparse member (shardio read its stored bytes as if whole: the
    next members' headers and data) are typed errors; nothing is published."""
    ds = tmp_path / "ds"
    ds.mkdir()
    tar = ds / "x.tar"
    if case in ("duplicate", "reserved"):
        second = "a.jpg" if case == "duplicate" else "a.__key__"
        _tar_of(tar, [("a.jpg", b"1"), (second, b"2"), ("b.jpg", b"3")])
        with pytest.raises(ValueError, match="duplicate"):
            webdataset_samples([str(tar)])
    else:
        src = tmp_path / "src"
        src.mkdir()
        with open(src / "a.bin", "wb") as f:  # a hole of 1 MiB, then data
            f.seek(1 << 20)
            f.write(b"tail" * 100)
        (src / "b.bin").write_bytes(b"next")
        subprocess.run(["tar", "-S", "--format=gnu", "-cf", str(tar), "-C", str(src), "a.bin",
                        "b.bin"], check=True, timeout=30)
    rc, _out, err = cli("index", tar)
    assert rc == 1
    assert {"duplicate": "DuplicateKeyError" in err and "twice" in err,
            "reserved": "DuplicateKeyError" in err and "'__key__'" in err,
            "sparse": "NotATarError" in err and "sparse" in err}[case], err
    assert sorted(p.name for p in ds.iterdir()) == ["x.tar"]


def test_index_does_not_replace_a_datasets_manifest(text_tree: Path, cli: CLI,
                                                    tmp_path: Path) -> None:
    """``shardio index`` on a shard of a packed dataset replaced its manifest with a one-shard
    one (labels, parity and every other shard gone) and its index with another."""
    out = tmp_path / "ds"
    pack_into(text_tree, out, "tar", samples_per_shard=4)
    before = sha256_files([str(p) for p in sorted(out.iterdir()) if p.is_file()])
    first = sorted(str(p) for p in out.glob("*.tar"))[0]
    rc, _out, err = cli("index", first)
    assert rc == 2 and "OutputNotEmptyError" not in err and "--overwrite" in err
    assert sha256_files(list(before)) == before
    assert cli("verify", out, "--workers", "1")[0] == 0
    rc, _out, err = cli("index", first, "--overwrite")
    assert rc == 0, err
    assert len(shardio.Manifest.load(str(out)).shards) == 1


# --- hdf5 --------------------------------------------------------------------------------------
@pytest.mark.parametrize("compress", [None, "zstd"])
def test_h5py_reads_payload_through_documented_layout(compress: str | None, mixed_tree: Path,
                                                      tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack_into(mixed_tree, out, "hdf5", samples_per_shard=9, compress=compress)
    got: dict[str, Fields] = {}
    compressed = 0
    for path in shard_paths(out):
        with h5py.File(path, "r") as f:
            assert f.attrs["shardio_format"] == "shardio-hdf5"
            assert int(f.attrs["shardio_version"]) == 1
            assert f.attrs["checksum"] == "xxh3_64"
            names = [n.decode() if isinstance(n, bytes) else n for n in f.attrs["field_names"]]
            payload = f["payload"]
            assert payload.dtype == np.uint8 and payload.chunks is None  # contiguous
            ix = {k: f["index"][k][()] for k in f["index"]}
            key_blob = ix["key_blob"].tobytes()
            n = len(ix["key_offsets"]) - 1
            assert len(ix["sample_start"]) == n + 1
            for i in range(n):
                key = key_blob[ix["key_offsets"][i]:ix["key_offsets"][i + 1]].decode()
                fields = got.setdefault(key, {})
                for r in range(ix["sample_start"][i], ix["sample_start"][i + 1]):
                    off, length = int(ix["f_offset"][r]), int(ix["f_length"][r])
                    stored = payload[off:off + length].tobytes()
                    if ix["f_flags"][r] & FLAG_ZSTD:
                        compressed += 1
                        stored = zstandard.ZstdDecompressor().decompress(stored)
                    assert len(stored) == int(ix["f_raw_length"][r])
                    fields[names[int(ix["f_name"][r])]] = stored
    assert got == source_samples(mixed_tree)
    assert list(got) == sorted(got)
    assert (compressed > 0) == (compress is not None)


def test_h5py_sees_only_the_documented_objects(mixed_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    pack_into(mixed_tree, out, "hdf5", samples_per_shard=40)
    (path,) = shard_paths(out)
    with h5py.File(path, "r") as f:
        assert sorted(f) == ["index", "payload"]
        assert sorted(f["index"]) == sorted(
            ["key_blob", "key_offsets", "sample_start", "f_name", "f_flags", "f_offset",
             "f_length", "f_raw_length", "f_checksum"])
        assert json.loads(f.attrs["shardio_meta"])["job_shard"]
        assert int(f["payload"].shape[0]) == sum(
            len(v) for fs in source_samples(mixed_tree).values() for v in fs.values())
