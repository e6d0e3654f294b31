"""``shardio verify`` and ``shardio index`` on damage the format tests do not reach: hand-edited
manifest values of the wrong type, a manifest cut by its final newline, parity files, HDF5
metadata whose damage crashes or hangs the HDF5 library, and tar member names that are not UTF-8.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import shardio
from shardio.errors import (
    IndexCorruptError,
    ManifestCorruptError,
    NonUtf8NameError,
    NotATarError,
    UnsafePathError,
)
from shardio.indexer import index_tars
from tests.conftest import flip_bit, truncate
from tests.test_formats import pack_into, rewrite_manifest

CLI = Callable[..., tuple[int, str, str]]
REPO = Path(__file__).resolve().parents[1]
EDITED = "manifest.json: manifest edited or damaged (its digest does not match its content)"


def run_verify(cli: CLI, root: Path, workers: int = 1) -> tuple[int, list[str]]:
    """``shardio verify`` in-process; the output must be one line per problem."""
    rc, out, err = cli("verify", root, "--workers", workers)
    lines = out.splitlines()
    assert rc == (1 if lines else 0), err
    assert err.strip() == (f"{len(lines)} problem(s) found" if lines else "ok")
    return rc, lines


def verify_subprocess(root: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``shardio verify`` in a child, for damage that could crash or hang the process."""
    return subprocess.run([sys.executable, "-m", "shardio", "verify", str(root), "--workers", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture
def small_tree(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"s{i}.txt").write_text(f"abc{i} " * (10 + i))
    return src


# --- defect: `shardio index` on a tar whose member names are not UTF-8 --------------------------

def latin1_tar(path: Path) -> None:
    """A tar as GNU tar writes it from latin-1 file names (ustar, raw bytes)."""
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT, encoding="latin-1") as tf:
        for name, data in (("README", b"no extension: skipped, like WebDataset does"),
                           ("caf\xe9-readme", b"skipped too, whatever its name"),
                           ("a.txt", b"hello"), ("caf\xe9.txt", b"world")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))


@pytest.mark.parametrize("workers", [1, 2])
def test_index_of_a_tar_with_a_non_utf8_member_is_a_typed_error(workers: int,
                                                                 tmp_path: Path) -> None:
    tar = tmp_path / "wds-000000.tar"
    latin1_tar(tar)
    other = tmp_path / "wds-000001.tar"
    with tarfile.open(other, "w", format=tarfile.USTAR_FORMAT) as tf:
        info = tarfile.TarInfo("b.txt")
        tf.addfile(info, io.BytesIO(b""))
    with pytest.raises(NonUtf8NameError) as ei:
        index_tars([tar, other], workers=workers)
    assert isinstance(ei.value, UnicodeError)
    msg = str(ei.value)
    assert str(tar) in msg and repr(b"caf\xe9.txt") in msg and "UTF-8" in msg and "convmv" in msg
    assert not (tmp_path / "manifest.json").exists()
    assert not (tmp_path / "wds-000000.tar.idx").exists()


def test_index_cli_reports_the_non_utf8_member(cli: CLI, tmp_path: Path) -> None:
    tar = tmp_path / "wds-000000.tar"
    latin1_tar(tar)
    rc, out, err = cli("index", tar)
    assert rc == 1 and out == ""
    assert err.startswith("shardio index: NonUtf8NameError: ") and "caf\\xe9.txt" in err
    assert "Traceback" not in err


# --- defect: hand-edited manifest values of the wrong type ---------------------------------------

EDITS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "compression_string": (lambda d: d.update(compression="zstd"), "compression"),
    "bytes_string": (lambda d: d["shards"][0].update(bytes="1"), "shards[0].bytes"),
    "samples_bool": (lambda d: d["shards"][1].update(samples=True), "shards[1].samples"),
    "negative_bytes": (lambda d: d["shards"][0].update(bytes=-5), "shards[0].bytes"),
    "digest_number": (lambda d: d["shards"][2].update(digest=7), "shards[2].digest"),
    "dictionary_number": (lambda d: d.update(compression={"dictionary": 7}),
                          "compression.dictionary"),
    "level_string": (lambda d: d.update(compression={"codec": "zstd", "level": "3"}),
                     "compression.level"),
    "fields_string": (lambda d: d["fields"].update(txt="6"), "fields.txt"),
    "labels_names": (lambda d: d.update(labels={"field": "cls", "names": [1, 2]}),
                     "labels.names[0]"),
    "shards_object": (lambda d: d.update(shards={"0": {}}), "shards"),
    "parity_list": (lambda d: d.update(parity=[1]), "parity"),
    "job_number": (lambda d: d.update(job=12), "job"),
    # Past int64: the readers' offsets overflowed (OverflowError, "__len__() should return >= 0").
    "samples_huge": (lambda d: d["shards"][0].update(samples=2**63 - 1), "shards[0].samples"),
    "bytes_huge": (lambda d: d["shards"][1].update(bytes=10**30), "shards[1].bytes"),
    # Settings no pack writes: decoding built a compressor and raised ValueError/OverflowError.
    "codec_unknown": (lambda d: d.update(compression={"codec": "lz4", "level": 3}),
                      "compression"),
    "level_99": (lambda d: d.update(compression={"codec": "zstd", "level": 99}), "compression"),
}


@pytest.mark.parametrize("redigest", [False, True], ids=["edited", "forged_digest"])
@pytest.mark.parametrize("edit", sorted(EDITS))
def test_manifest_value_of_the_wrong_type(edit: str, redigest: bool, cli: CLI,
                                          small_tree: Path, tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    pack_into(small_tree, ds, "tar", samples_per_shard=2)
    change, field = EDITS[edit]
    rewrite_manifest(ds, change, redigest=redigest)
    rc, lines = run_verify(cli, ds)
    assert rc == 1
    unusable = [line for line in lines if line.startswith("manifest.json: unusable manifest: ")]
    assert len(unusable) == 1 and f": {field} is " in unusable[0], lines
    if redigest:
        assert lines == unusable
    else:
        assert lines[0].startswith(EDITED + " expected=") and lines[1:] == unusable
    with pytest.raises(ManifestCorruptError, match=r"digest" if not redigest else field.replace(
            "[", r"\[").replace("]", r"\]") + " is "):
        shardio.Manifest.load(ds)
    with pytest.raises(ManifestCorruptError, match=r"edited or damaged"):
        shardio.Manifest.load(ds, strict=False)


def test_manifest_dictionary_path_outside_the_dataset(cli: CLI, small_tree: Path,
                                                      tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    pack_into(small_tree, ds, "tar", samples_per_shard=2)
    rewrite_manifest(ds, lambda d: d.update(compression={"codec": "zstd", "level": 3,
                                                         "dictionary": "../zstd.dict",
                                                         "dictionary_digest": "0"}),
                     redigest=True)
    rc, lines = run_verify(cli, ds)
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith("manifest.json: unusable manifest: ") and "'..'" in lines[0]


@pytest.mark.parametrize("where", ["shard", "dictionary"])
@pytest.mark.parametrize("bad", ["a\x00.tar", "\ud800.tar"], ids=["nul", "surrogate"])
def test_manifest_path_that_names_no_file(where: str, bad: str, cli: CLI, small_tree: Path,
                                          tmp_path: Path) -> None:
    """A NUL or a lone surrogate in a path (digest recomputed): verify printed one line and died
    of a UnicodeEncodeError traceback, readers raised ValueError/UnicodeEncodeError."""
    ds = tmp_path / "ds"
    pack_into(small_tree, ds, "tar", samples_per_shard=2)
    edit = ((lambda d: d["shards"][0].update(path=bad)) if where == "shard" else
            (lambda d: d.update(compression={"codec": "zstd", "level": 3, "dictionary": bad,
                                             "dictionary_digest": "0"})))
    rewrite_manifest(ds, edit, redigest=True)
    rc, lines = run_verify(cli, ds)
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("manifest.json: unusable manifest: ") and "NUL" in lines[0]
    with pytest.raises(UnsafePathError, match="NUL or is not valid UTF-8"):
        shardio.open_dataset(ds)
    rc, _out, err = cli("inspect", ds)
    assert rc == 1 and "UnsafePathError" in err and "Traceback" not in err


@pytest.mark.parametrize("edit", ["no_compression", "no_dictionary"])
def test_compression_settings_that_are_not_the_packs(edit: str, cli: CLI,
                                                     tmp_path: Path) -> None:
    """Compression settings edited (digest recomputed) so that the shards' zstd fields do not
    decode: every checksum passes, verify said ok, and readers raised zstandard.ZstdError."""
    src, ds = tmp_path / "many", tmp_path / "ds"
    src.mkdir()
    for i in range(120):
        (src / f"s{i:03d}.txt").write_text(f"sample {i} of a dataset of text " * (3 + i % 7))
    shardio.pack(src, ds, samples_per_shard=40, fsync=False, progress=False, compress="zstd",
                 zstd_dict=True)
    change = {"no_compression": lambda d: d.update(compression=None),
              "no_dictionary": lambda d: d.update(compression={"codec": "zstd", "level": 3})}
    rewrite_manifest(ds, change[edit], redigest=True)
    rc, lines = run_verify(cli, ds)
    assert rc == 1 and len(lines) == 3, lines
    what = ("names no zstd codec" if edit == "no_compression" else
            "compressed field does not decode")
    assert all(line.startswith("shard-00000") and what in line for line in lines), lines
    with pytest.raises(ManifestCorruptError, match="does not decode"):
        [s["txt"] for s in shardio.open_dataset(ds)]


def test_inspect_of_odd_informative_stats(cli: CLI, small_tree: Path, tmp_path: Path) -> None:
    """The pack's stats are informative (verify accepts any): inspect died of a traceback on
    a compression_ratio that is not a number or a skipped count that is not a mapping."""
    ds = tmp_path / "ds"
    pack_into(small_tree, ds, "tar", samples_per_shard=2)
    rewrite_manifest(ds, lambda d: d["stats"].update(compression_ratio="x", skipped=[1]),
                     redigest=True)
    rc, out, err = cli("inspect", ds)
    assert rc == 0 and "Traceback" not in err and "ratio unknown" not in out, out + err
    rc, out, err = cli("inspect", ds, "--json")
    assert rc == 0 and json.loads(out)["compression_ratio"] is None


def test_self_consistent_but_impossible_tar_index(cli: CLI, small_tree: Path,
                                                  tmp_path: Path) -> None:
    """A .idx rewritten with a valid checksum and index_digest, but keys cut past the key blob
    or a field name that does not exist: verify said ok and readers returned wrong keys or
    raised IndexError.  The structure checks HDF5 indexes had now hold for tar ones too."""
    import numpy as np

    from shardio.checksum import digest_bytes
    from shardio.formats.base import ShardIndex

    for name, value in (("key_offsets", 10**9), ("f_name", 999)):
        ds = tmp_path / name
        pack_into(small_tree, ds, "tar", samples_per_shard=2)
        ipath = ds / "shard-000000.tar.idx"
        idx = ShardIndex.from_bytes(ipath.read_bytes())
        arrays = {k: np.array(v) for k, v in idx.arrays().items()}
        arrays[name][1 if name == "key_offsets" else 0] = value
        data = ShardIndex(field_names=idx.field_names, checksum=idx.checksum,
                          key_blob=idx.key_blob, meta=idx.meta, **arrays).to_bytes()
        ipath.write_bytes(data)
        rewrite_manifest(ds, lambda d: d["shards"][0].update(index_digest=digest_bytes(data)),
                         redigest=True)
        rc, lines = run_verify(cli, ds)
        assert rc == 1 and any("unreadable index" in line for line in lines), lines
        with pytest.raises(IndexCorruptError, match="is corrupt"):
            shardio.open_dataset(ds)[0]


# --- defect: a damaged HDF5 shard crashes, hangs or breaks verify --------------------------------

# One flipped bit in the HDF5 metadata of shard-000000.h5 packed from ``small_tree``: offsets and
# what plain h5py does on them (found by sweeping every bit of this deterministic shard).
HDF5_FLIPS = {"segfault": (1257, 3), "hang": (2073, 0), "attribute_error": (1320, 0)}


@pytest.fixture
def h5_ds(small_tree: Path, tmp_path: Path) -> Path:
    ds = tmp_path / "h5"
    pack_into(small_tree, ds, "hdf5", samples_per_shard=3)
    return ds


@pytest.mark.parametrize("case", sorted(HDF5_FLIPS))
def test_damaged_hdf5_metadata_is_reported_not_a_crash(case: str, h5_ds: Path) -> None:
    offset, bit = HDF5_FLIPS[case]
    shard = h5_ds / "shard-000000.h5"
    digest = shardio.Manifest.load(h5_ds).shards[0].digest
    flip_bit(shard, offset, bit)
    done = verify_subprocess(h5_ds)
    assert done.returncode == 1, (done.returncode, done.stdout, done.stderr[-2000:])
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"shard-000000.h5: shard digest mismatch expected={digest} ")
    assert all(line.startswith("shard-000000.h5: ") for line in lines), lines
    assert done.stderr.strip().endswith(f"{len(lines)} problem(s) found")
    assert "Traceback" not in done.stderr


def test_load_hdf5_index_turns_any_h5py_error_into_index_corruption(h5_ds: Path) -> None:
    shard = h5_ds / "shard-000000.h5"
    flip_bit(shard, *HDF5_FLIPS["attribute_error"])
    code = ("import sys\n"
            "from shardio.errors import IndexCorruptError\n"
            "from shardio.formats.hdf5 import load_hdf5_index\n"
            "try:\n"
            "    load_hdf5_index(sys.argv[1])\n"
            "except IndexCorruptError as exc:\n"
            "    print('IndexCorruptError', exc)\n")
    done = subprocess.run([sys.executable, "-c", code, str(shard)], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"IndexCorruptError cannot read the index of HDF5 shard {shard}")
    assert "restore it" in done.stdout


def test_hdf5_index_digest_in_the_manifest_is_verified(h5_ds: Path, cli: CLI) -> None:
    """Only tar indexes had their manifest index_digest checked by verify: an HDF5 shard's
    edited one passed, and every reader then refused the shard."""
    rewrite_manifest(h5_ds, lambda d: d["shards"][0].update(index_digest="0" * 16),
                     redigest=True)
    rc, lines = run_verify(cli, h5_ds)
    assert rc == 1 and len(lines) == 1 and lines[0].startswith(
        "shard-000000.h5: index digest mismatch expected=0000000000000000"), lines


def test_a_chunked_hdf5_payload_is_refused_not_read_at_offset_0(h5_ds: Path) -> None:
    """The README's layout with /payload rewritten in chunks (h5repack -l CHUNK=...) has no file
    offset: the reader read fields from offset 0 (the HDF5 superblock, with verify=False)."""
    import h5py

    from shardio.checksum import file_digest

    shard = h5_ds / "shard-000000.h5"
    with h5py.File(shard, "r") as f:
        attrs, payload = dict(f.attrs), f["payload"][()]
        index = {k: f["index"][k][()] for k in f["index"]}
    shard.unlink()
    with h5py.File(shard, "w") as f:
        f.attrs.update(attrs)
        f.create_dataset("payload", data=payload, chunks=(64,))
        g = f.create_group("index")
        for k, v in index.items():
            g.create_dataset(k, data=v)
    digest, size = file_digest(str(shard))
    rewrite_manifest(h5_ds, lambda d: d["shards"][0].update(digest=digest, bytes=size),
                     redigest=True)
    for verify in (True, False):
        with pytest.raises(IndexCorruptError, match="not one contiguous byte array"):
            shardio.open_dataset(h5_ds, verify=verify)[0]


def test_isolated_index_load(h5_ds: Path) -> None:
    from shardio.verify import _load_index_isolated

    shard = str(h5_ds / "shard-000000.h5")
    with shardio.open_dataset(h5_ds) as reader:
        sound = reader.shard_index(0)
    index = _load_index_isolated("hdf5", shard)
    assert not isinstance(index, str) and index.keys() == sound.keys()
    flip_bit(shard, *HDF5_FLIPS["hang"])
    why = _load_index_isolated("hdf5", shard, timeout=3)
    assert isinstance(why, str) and "did not finish within 3 s" in why and shard in why
    flip_bit(shard, *HDF5_FLIPS["hang"])
    flip_bit(shard, *HDF5_FLIPS["segfault"])
    why = _load_index_isolated("hdf5", shard)
    assert isinstance(why, str) and "crashed (SIGSEGV)" in why


def test_damaged_hdf5_payload_is_still_located_by_key(h5_ds: Path, cli: CLI) -> None:
    """Parsing in a child keeps verify's per-field findings for a damaged shard."""
    with shardio.open_dataset(h5_ds) as reader:
        index = reader.shard_index(1)
        key, off = index.key(2), int(index.f_offset[int(index.sample_start[2])])
    flip_bit(h5_ds / "shard-000001.h5", off, 2)
    rc, lines = run_verify(cli, h5_ds)
    assert rc == 1 and len(lines) == 2
    assert lines[0].startswith("shard-000001.h5: shard digest mismatch expected=")
    assert lines[1].startswith(f"shard-000001.h5: checksum mismatch key={key!r} ")


# --- defect: verify ignored parity files ---------------------------------------------------------

@pytest.fixture
def parity_ds(tmp_path: Path) -> Path:
    pytest.importorskip("zfec")
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"s{i}.bin").write_bytes(bytes([i]) * (1000 + 500 * i))
    ds = tmp_path / "par"
    pack_into(src, ds, "tar", samples_per_shard=2, parity="2+1")
    assert sorted(os.listdir(ds / "parity")) == ["g000000.p0", "g000001.p0"]
    return ds


def parity_entry(ds: Path, rel: str) -> tuple[int, str]:
    for group in shardio.Manifest.load(ds).parity["groups"]:
        for f, digest, size in zip(group["files"], group["digests"], group["bytes"]):
            if f == rel:
                return size, digest
    raise AssertionError(rel)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "grow", "extra"])
def test_verify_checks_parity_files(damage: str, workers: int, cli: CLI, parity_ds: Path) -> None:
    assert run_verify(cli, parity_ds, workers) == (0, [])
    rel = "parity/g000001.p0"
    path = parity_ds / rel
    size, digest = parity_entry(parity_ds, rel)
    if damage == "flip":
        flip_bit(path, size // 2, 4)
    elif damage == "truncate":
        truncate(path, size - 1)
    elif damage == "delete":
        path.unlink()
    elif damage == "grow":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:
        shutil.copy(path, parity_ds / "parity" / "g000002.p0")
    rc, lines = run_verify(cli, parity_ds, workers)
    assert rc == 1
    if damage == "delete":
        assert lines == [f"{rel}: missing parity file (listed in the manifest, not on disk)"]
    elif damage == "extra":
        assert lines == ["parity/g000002.p0: extra parity file not listed in the manifest"]
    else:
        assert lines[-1].startswith(f"{rel}: parity digest mismatch expected={digest} found=")
        if damage != "flip":
            what = "truncated" if damage == "truncate" else "size differs"
            new = size - 1 if damage == "truncate" else size + 1
            assert lines[:-1] == [f"{rel}: {what} expected={size} bytes found={new} bytes"]
        else:
            assert len(lines) == 1
    assert [str(p) for p in shardio.verify_dataset(parity_ds, workers=workers)] == lines


def test_malformed_parity_section_is_a_problem(cli: CLI, parity_ds: Path) -> None:
    rewrite_manifest(parity_ds, lambda d: d["parity"]["groups"][0].pop("digests"), redigest=True)
    rc, lines = run_verify(cli, parity_ds)
    assert rc == 1 and len(lines) == 1
    assert lines[0].startswith("manifest.json: malformed parity section (KeyError('digests')")


# --- defect: a manifest cut by its final newline ------------------------------------------------

@pytest.mark.parametrize("change", ["cut_newline", "reformatted", "trailing_space"])
def test_manifest_must_be_byte_for_byte_what_shardio_wrote(change: str, cli: CLI,
                                                            small_tree: Path,
                                                            tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    manifest = pack_into(small_tree, ds, "tar", samples_per_shard=2)
    path = ds / "manifest.json"
    raw = path.read_bytes()
    assert raw == manifest.to_json() and raw.endswith(b"}\n")
    if change == "cut_newline":
        path.write_bytes(raw[:-1])
    elif change == "reformatted":
        path.write_text(json.dumps(json.loads(raw), indent=2, sort_keys=True) + "\n")
    else:
        path.write_bytes(raw + b" ")
    assert shardio.Manifest.load(ds).to_json() == raw  # the content itself is intact
    rc, lines = run_verify(cli, ds)
    assert rc == 1
    assert lines == [("manifest.json: manifest file is not byte for byte what shardio wrote "
                      "(cut or reformatted; its content is intact): restore it from a good copy")]
    path.write_bytes(raw)
    assert run_verify(cli, ds) == (0, [])


def test_isolated_load_reports_the_childs_index_error(h5_ds: Path) -> None:
    """An index error raised in the child comes back as its message."""
    import h5py

    from shardio.verify import _load_index_isolated

    shard = h5_ds / "shard-000000.h5"
    with h5py.File(shard, "r+") as f:
        f.attrs["checksum"] = "crc32"  # fails index_digest
    why = _load_index_isolated("hdf5", str(shard))
    assert isinstance(why, str) and "index_digest mismatch" in why
    with pytest.raises(IndexCorruptError, match="index_digest mismatch"):
        shardio.formats.load_index("hdf5", str(shard))


# --- defect: a FIFO where a shard should be hung verify; --workers 0 was accepted ---------------
def test_a_fifo_in_place_of_a_shard_is_a_problem_not_a_hang(cli: CLI, small_tree: Path,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "ds"
    shardio.pack(small_tree, out, samples_per_shard=2, fsync=False, progress=False)
    shard = out / "shard-000001.tar"
    shard.unlink()
    os.mkfifo(shard)
    proc = verify_subprocess(out, timeout=60)  # opening the FIFO waited for a writer for ever
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines() == ["shard-000001.tar: read error (not a regular file)"]
    for workers in ("0", "-1"):
        rc, _out, err = cli("verify", out, "--workers", workers)
        assert rc == 2 and "--workers must be >= 1" in err


@pytest.mark.parametrize("which", ["manifest.json", "zstd.dict", "shard-000001.tar.idx"])
def test_a_fifo_in_place_of_a_dataset_file_is_an_error_not_a_hang(which: str, cli: CLI,
                                                                  small_tree: Path,
                                                                  tmp_path: Path) -> None:
    """Only shard files were opened so that a FIFO could not block: one in place of the
    manifest or the zstd dictionary hung verify, inspect and the readers, one in place of an
    index the readers (each open waited for a writer for ever)."""
    src, out = tmp_path / "many", tmp_path / "ds"
    src.mkdir()
    for i in range(200):
        (src / f"s{i:03d}.txt").write_text(f"sample {i} of a dataset of text " * (3 + i % 7))
    shardio.pack(src, out, samples_per_shard=50, fsync=False, progress=False,
                 compress="zstd", zstd_dict=True)
    (out / which).unlink()
    os.mkfifo(out / which)
    proc = verify_subprocess(out, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "not a regular file" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    if which == "manifest.json":
        rc, _out, err = cli("inspect", out)
        assert rc == 1 and "not a regular file" in err
    read = ("import shardio, sys; ds = shardio.open_dataset(sys.argv[1]); "
            "[bytes(s['txt']) for s in ds]")
    child = subprocess.run([sys.executable, "-c", read, str(out)], cwd=REPO, capture_output=True,
                           text=True, timeout=60, check=False)
    assert child.returncode == 1, child.stderr
    assert "shardio.errors." in child.stderr and "not a regular file" in child.stderr, (
        child.stderr)


@pytest.mark.parametrize("edit", ["num_samples", "num_samples_string", "shard_twice"])
def test_manifest_totals_that_contradict_its_shards(edit: str, cli: CLI, small_tree: Path,
                                                    tmp_path: Path) -> None:
    """Edited and its digest recomputed, a manifest whose num_samples is not the sum of its
    shards' (a problem line), or that lists a shard twice (unusable), passed verify."""
    ds = tmp_path / "ds"
    pack_into(small_tree, ds, "tar", samples_per_shard=2)
    change = {"num_samples": lambda d: d.update(num_samples=999),
              "num_samples_string": lambda d: d.update(num_samples="6"),
              "shard_twice": lambda d: d["shards"].append(dict(d["shards"][0]))}[edit]
    rewrite_manifest(ds, change, redigest=True)
    rc, lines = run_verify(cli, ds)
    assert rc == 1 and len(lines) == 1, lines
    if edit == "shard_twice":
        assert "unusable manifest" in lines[0] and "more than once" in lines[0]
        with pytest.raises(ManifestCorruptError):
            shardio.Manifest.load(ds)
    else:
        assert lines[0].startswith("manifest.json: num_samples is not the sum") and (
            "expected=6" in lines[0])


def _small_tar(path: Path, n: int = 10) -> list[int]:
    """A ustar tar of ``n`` one-field samples; the offsets of their headers."""
    offsets = []
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tf:
        for i in range(n):
            data = f"sample {i}".encode()
            ti = tarfile.TarInfo(f"k{i:02d}.txt")
            ti.size = len(data)
            offsets.append(tf.offset)
            tf.addfile(ti, io.BytesIO(data))
    return offsets


def test_index_refuses_a_tar_with_members_past_a_damaged_header(cli: CLI, tmp_path: Path) -> None:
    """tarfile reads a header it cannot parse (after the first) as the end of the archive: a
    flipped bit in member 3's header indexed 3 of 10 samples, exit 0, and verify said ok."""
    tar = tmp_path / "x.tar"
    offsets = _small_tar(tar)
    flip_bit(tar, offsets[3] + 1)
    rc, _, err = cli("index", tar)
    assert rc == 1 and "NotATarError" in err and f"offset {offsets[3]}" in err, err
    assert not (tmp_path / "manifest.json").exists() and not (tmp_path / "x.tar.idx").exists()
    # A second archive appended: tar (without --ignore-zeros) and WebDataset stop before it.
    good, more = tmp_path / "good" / "a.tar", tmp_path / "b.tar"
    good.parent.mkdir()
    _small_tar(good, 2)
    _small_tar(more, 2)
    clean = good.read_bytes()
    assert index_tars([good]).num_samples == 2  # (zeros to the end: the usual tar)
    with open(good, "ab") as f:
        f.write(more.read_bytes())
    with pytest.raises(NotATarError, match="second archive appended"):
        index_tars([good], overwrite=True)
    assert good.read_bytes()[:len(clean)] == clean


def test_index_never_writes_an_index_over_a_tar_it_was_given(cli: CLI, tmp_path: Path) -> None:
    """``shardio index a.tar a.tar.idx`` replaced the user's tar ``a.tar.idx`` by a.tar's
    index."""
    a, b = tmp_path / "a.tar", tmp_path / "a.tar.idx"
    _small_tar(a, 2)
    _small_tar(b, 3)
    before = b.read_bytes()
    rc, _, err = cli("index", a, b)
    assert rc == 2 and "a.tar.idx is one of the tars given" in err, err
    assert b.read_bytes() == before and not (tmp_path / "manifest.json").exists()


def test_index_tar_names_and_places(cli: CLI, tmp_path: Path) -> None:
    """A tar given twice through a symlink was indexed twice (its samples served twice); a
    directory named ``..v2`` inside the root was "outside the dataset"."""
    a = tmp_path / "a.tar"
    _small_tar(a, 2)
    os.symlink(a, tmp_path / "b.tar")
    rc, _, err = cli("index", a, tmp_path / "b.tar")
    assert rc == 2 and "listed twice" in err, err
    inner = tmp_path / "..v2"
    inner.mkdir()
    _small_tar(inner / "c.tar", 2)
    rc, out, err = cli("index", inner / "c.tar", a, "--root", tmp_path)
    assert rc == 0, err
    assert [s.path for s in shardio.Manifest.load(tmp_path).shards] == ["..v2/c.tar", "a.tar"]


def test_index_refuses_the_shards_of_a_dataset_above(cli: CLI, tmp_path: Path) -> None:
    """Indexing ``R/sub/a.tar`` of the dataset ``R`` again (another checksum, no --overwrite)
    rewrote its ``.idx``, and ``verify R`` then found an index digest mismatch."""
    sub = tmp_path / "R" / "sub"
    sub.mkdir(parents=True)
    _small_tar(sub / "a.tar", 3)
    assert cli("index", sub / "a.tar", "--root", tmp_path / "R")[0] == 0
    idx = (sub / "a.tar.idx").read_bytes()
    rc, _, err = cli("index", sub / "a.tar", "--checksum", "crc32")
    assert rc == 2 and "is a shard of the dataset" in err and "--overwrite" in err, err
    assert (sub / "a.tar.idx").read_bytes() == idx and not (sub / "manifest.json").exists()
    assert run_verify(cli, tmp_path / "R")[0] == 0
    assert index_tars([sub / "a.tar"], overwrite=True).checksum == "xxh3_64"
    # A manifest.json above that is not shardio's, or a dataset above that does not list the
    # tar, claims nothing.
    (tmp_path / "manifest.json").write_text('{"name": "some other tool"}')
    (sub / "x").mkdir()
    _small_tar(sub / "x" / "new.tar", 1)
    rc, _, err = cli("index", sub / "x" / "new.tar")
    assert rc == 0, err


def test_manifests_that_resealed_edits_make_impossible(cli: CLI, small_tree: Path,
                                                       tmp_path: Path) -> None:
    """With the digest recomputed: a shard listed twice as ``X`` and ``./X`` (its samples
    served twice), an unknown checksum algorithm: both were "ok"."""
    for edit, words in [
        (lambda d: d["shards"].append(dict(d["shards"][0], path="./" + d["shards"][0]["path"])),
         "more than once"),
        (lambda d: d["checksum"].update(sample="md5"), "checksum.sample is 'md5'"),
        (lambda d: d["checksum"].update(shard="sha1"), "checksum.shard is 'sha1'"),
    ]:
        ds = tmp_path / f"ds{len(os.listdir(tmp_path))}"
        pack_into(small_tree, ds, "tar", samples_per_shard=3)
        rewrite_manifest(ds, edit, redigest=True)
        rc, lines = run_verify(cli, ds)
        assert rc == 1 and any("unusable manifest" in x and words in x for x in lines), lines
        with pytest.raises(ManifestCorruptError, match=words.replace(".", r"\.")):
            shardio.Manifest.load(ds)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000,
                                  '{"format": "shardio", "version": ' + "9" * 5000 + "}"])
def test_a_manifest_json_cannot_parse_is_corrupt_not_a_traceback(text: str, cli: CLI,
                                                                small_tree: Path,
                                                                tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    pack_into(small_tree, ds, "tar", samples_per_shard=3)
    (ds / "manifest.json").write_text(text)
    with pytest.raises(ManifestCorruptError, match="not valid JSON"):
        shardio.Manifest.load(ds)
    rc, lines = run_verify(cli, ds)
    assert rc == 1 and "unusable manifest" in lines[-1] and "not valid JSON" in lines[-1]


def test_a_problem_with_a_newline_in_its_path_is_one_line(cli: CLI, tmp_path: Path) -> None:
    tar = tmp_path / "part\nA.tar"
    _small_tar(tar, 2)
    assert cli("index", tar)[0] == 0
    flip_bit(tar, 512)
    rc, lines = run_verify(cli, tmp_path)
    assert rc == 1 and len(lines) == 2, lines
    assert all(x.startswith("'part\\nA.tar': ") for x in lines), lines


# --- defect: damage in tar headers, padding and end blocks named no key nor offset --------------
# (The same damage in shards shardio packed: tests/test_formats_corruption.py TestTarCorruption.)

def other_tools_tars(tool: str, root: Path) -> list[Path]:
    """Tars as other tools write them, in ``root``: webdataset's ShardWriter (a pax header with
    a fractional mtime before every member), or GNU tar in its gnu or posix format (directory
    members, members without an extension and ``__x__`` ones, which the index skips, a
    ``././@LongLink`` record or pax ``path`` for a long name, an upper-case extension, padding of
    the end to a 10 KiB record)."""
    import webdataset as wds

    root.mkdir()
    if tool == "webdataset":
        with wds.ShardWriter(str(root / "part-%04d.tar"), maxcount=5, verbose=0) as sink:
            for i in range(8):
                sink.write({"__key__": f"sample{i:04d}", "txt": f"caption {i}".encode(),
                            "cls": str(i % 3).encode(), "bin": bytes(range(i % 7)) * (i * 40)})
        return sorted(root.glob("*.tar"))
    src = root.parent / "src"
    long_dir = src / ("d" * 70) / ("e" * 60)
    long_dir.mkdir(parents=True)
    for i in range(3):
        (src / f"s{i}.txt").write_text(f"caption {i} " * (i + 1))
        (src / f"s{i}.CLS").write_text(str(i))
    (long_dir / "x.json").write_text("{}")
    (src / "README").write_text("no extension: skipped")
    (src / "__meta__").write_text("skipped too")
    tar = root / "all.tar"
    subprocess.run(["tar", f"--format={tool.split('_')[1]}", "--sort=name", "-cf", str(tar),
                    "-C", str(src), "."], check=True, timeout=30)
    return [tar]


TOOLS = ["webdataset", "gnutar_gnu", "gnutar_posix"]


@pytest.mark.parametrize("tool", TOOLS)
def test_tars_of_other_tools_pass_the_tar_structure_check(tool: str, cli: CLI,
                                                          tmp_path: Path) -> None:
    """Verify checks the tar structure of a damaged shard only, by meaning for a tar another
    tool wrote: run on the intact tars, it finds nothing in their pax headers, long names,
    mtimes, skipped members or end records."""
    from shardio.formats import load_index
    from shardio.formats.tarcheck import tar_structure_problems

    tars = other_tools_tars(tool, tmp_path / "ds")
    manifest = index_tars(tars)
    assert run_verify(cli, tmp_path / "ds") == (0, [])
    for tar, entry in zip(tars, manifest.shards, strict=True):
        index = load_index("tar", str(tar))
        assert len(index) and tar_structure_problems(str(tar), index, False, entry.bytes) == []


def member_headers(tar: Path) -> list[tuple[str, int, int]]:
    """``(name, offset of its last header block, data size)`` of each regular member."""
    with tarfile.open(tar) as tf:
        return [(m.name, m.offset_data - 512, m.size) for m in tf.getmembers() if m.isreg()]


@pytest.mark.parametrize("tool", TOOLS)
@pytest.mark.parametrize("where", ["name", "size", "padding", "end"])
def test_damage_in_the_tar_structure_of_another_tools_tar(tool: str, where: str, cli: CLI,
                                                          tmp_path: Path) -> None:
    ds = tmp_path / "ds"
    tars = other_tools_tars(tool, ds)
    index_tars(tars)
    tar = tars[0]
    name, header, size = next(m for m in member_headers(tar) if m[0].endswith(".txt"))
    key = name[:name.index(".", name.rfind("/") + 1)]
    end = header + 512 + size
    at = {"name": header + name.rindex(".") - 1, "size": header + 124 + 10, "padding": end + 1,
          "end": os.path.getsize(tar) - 1}[where]
    flip_bit(tar, at, bit=0)
    rc, lines = run_verify(cli, ds)
    assert rc == 1 and len(lines) == 2 and "shard digest mismatch" in lines[0], lines
    rel = tar.name
    if where in ("name", "size"):
        assert lines[1].startswith(f"{rel}: damaged tar header ({where}, checksum) key={key!r} "
                                   f"field='txt' offset={header} "), lines
    elif where == "padding":
        assert lines[1] == (f"{rel}: non-zero bytes in the tar padding after the field "
                            f"key={key!r} field='txt' offset={at} expected=zero bytes "
                            "found=1 non-zero byte(s)")
    else:
        assert lines[1] == (f"{rel}: non-zero bytes in the tar end-of-archive blocks "
                            f"offset={at} expected=zero bytes found=1 non-zero byte(s)")


def test_tar_structure_of_packed_names_that_need_pax_headers(cli: CLI, tmp_path: Path) -> None:
    """A shardio shard's pax-named members (a long and a non-ASCII key) are checked by meaning:
    the name is the pax ``path`` record, where a flipped bit shows."""
    from shardio.formats import load_index
    from shardio.formats.tarcheck import tar_structure_problems

    src = tmp_path / "src"
    long_key = "d" * 70 + "/" + "e" * 60 + "/x"
    for key in (long_key, "ünï/cödé", "plain"):
        (src / key).parent.mkdir(parents=True, exist_ok=True)
        (src / f"{key}.txt").write_text(key)
    ds = tmp_path / "ds"
    entry = pack_into(src, ds, "tar").shards[0]
    path = str(ds / entry.path)
    index = load_index("tar", path)
    assert tar_structure_problems(path, index, True, entry.bytes) == []
    name, header, _size = member_headers(Path(path))[0]
    assert name == f"{long_key}.txt"
    data = Path(path).read_bytes()
    record = data.index(b"path=" + long_key.encode())  # in the pax header's data block
    flip_bit(path, record + 5 + 10, bit=0)
    rc, lines = run_verify(cli, ds)
    assert rc == 1 and len(lines) == 2, lines
    damaged = long_key[:10] + chr(ord(long_key[10]) ^ 1) + long_key[11:] + ".txt"
    assert lines[1] == (f"{entry.path}: damaged tar header (name) key={long_key!r} field='txt' "
                        f"offset={header} expected={name!r} found={damaged!r}")


@pytest.mark.parametrize("command,resumable", [("verify", False), ("inspect", False),
                                               ("merge", True)])
def test_ctrl_c_says_resume_only_for_commands_that_resume(
        command: str, resumable: bool, tmp_path: Path, cli: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An interrupted verify starts over when rerun: "rerun the same command to resume" was
    printed for every command."""
    import signal

    from shardio import cli as cli_mod

    real = cli_mod._COMMANDS[command]

    def interrupted(args: Any) -> int:
        os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C, as the command starts
        return real(args)

    monkeypatch.setitem(cli_mod._COMMANDS, command, interrupted)
    rc, _, err = cli(command, tmp_path)
    assert rc == 130 and "Traceback" not in err
    assert err.strip().endswith(f"shardio {command}: interrupted"
                                + ("; rerun the same command to resume" if resumable else ""))


def test_the_manifest_path_names_its_dataset(small_tree: Path, tmp_path: Path) -> None:
    """Manifest.load takes the manifest file's path; the readers and verify took it as the
    dataset directory (shards looked for under manifest.json/, every one reported missing)."""
    from shardio import ShardDataset
    from shardio.reader import open_dataset

    ds = tmp_path / "ds"
    pack_into(small_tree, ds, "tar", samples_per_shard=3)
    manifest = ds / "manifest.json"
    assert shardio.verify_dataset(manifest) == []
    with open_dataset(manifest) as r, open_dataset(ds) as want:
        assert r.root == str(ds)
        assert [s["__key__"] for s in r] == [s["__key__"] for s in want]
    assert len(list(ShardDataset(str(manifest)))) == len(list(ShardDataset(str(ds))))


@pytest.mark.parametrize("version", [True, 1.0, "1", 0, None])
def test_a_format_version_that_is_not_a_positive_integer_is_refused(
        small_tree: Path, tmp_path: Path, version: Any) -> None:
    """``"version": true`` was read as version 1 (a bool is an int)."""
    from shardio.errors import ManifestCorruptError
    from shardio.manifest import Manifest

    ds = tmp_path / "ds"
    pack_into(small_tree, ds, "tar", samples_per_shard=3)
    rewrite_manifest(ds, lambda d: d.__setitem__("version", version), redigest=True)
    with pytest.raises(ManifestCorruptError, match="invalid format version"):
        Manifest.load(ds)
