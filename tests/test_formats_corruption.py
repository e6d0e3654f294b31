"""Damage a packed dataset in every way storage does, and check shardio notices.

``shardio verify`` must exit 1 and print one line per problem naming path (and key, offset,
expected, found where they apply), exit 0 on a clean dataset and 2 on a usage error; the reader
must raise the typed error for each kind of damage.  ``CorruptionTests`` runs for both formats;
damage that only one format can suffer (a tar header, an ``.idx`` file, HDF5 metadata) follows.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import h5py
import pytest
import xxhash

import shardio
from shardio.checksum import file_digest, hex64, sample_checksum_fn
from shardio.codec import FLAG_ZSTD
from shardio.errors import (
    ChecksumMismatchError,
    IndexCorruptError,
    ManifestCorruptError,
    ManifestVersionError,
    ShardCorruptError,
    ShardNotFoundError,
    ShardTruncatedError,
    UnsafePathError,
)
from shardio.formats import ShardIndex
from tests.conftest import flip_bit, truncate
from tests.test_formats import pack_into, read_all, rewrite_manifest, source_samples
from tests.test_formats import text_tree  # noqa: F401  (fixture)

CLI = Callable[..., tuple[int, str, str]]
SHARDS = 6  # mixed_tree (40 samples) at 7 per shard


def run_verify(cli: CLI, root: Path, workers: int = 1) -> tuple[int, list[str]]:
    """``shardio verify``; checks the output is one line per problem and returns the lines."""
    rc, out, err = cli("verify", root, "--workers", workers)
    lines = out.splitlines()
    if rc == 0:
        assert lines == [] and err.strip() == "ok"
    else:
        assert rc == 1, err
        assert err.strip() == f"{len(lines)} problem(s) found"
        assert lines == [str(p) for p in shardio.verify_dataset(root)]
    return rc, lines


@pytest.mark.parametrize("target", ["missing", "file"])
def test_verify_without_a_dataset_directory_is_a_usage_error(target: str, cli: CLI,
                                                             tmp_path: Path) -> None:
    path = tmp_path / "no-such-dir"
    if target == "file":
        path = tmp_path / "manifest.json"
        path.write_text("{}")
    rc, out, err = cli("verify", path)
    assert rc == 2
    assert out == "" and f"{path} is not a directory" in err


def field_location(root: Path, shard: int, min_length: int = 1) -> dict[str, Any]:
    """Shard path, sample key, field and absolute offset of the first field of ``shard`` with
    at least ``min_length`` stored bytes, plus the sample's global index."""
    with shardio.open_dataset(root) as reader:
        idx: ShardIndex = reader.shard_index(shard)
        for i in range(len(idx)):
            for r in idx.rows(i):
                if int(idx.f_length[r]) >= min_length:
                    return {
                        "rel": reader.manifest.shards[shard].path,
                        "path": reader.shard_path(shard),
                        "key": idx.key(i), "field": idx.field_names[int(idx.f_name[r])],
                        "offset": int(idx.f_offset[r]), "length": int(idx.f_length[r]),
                        "checksum": hex64(idx.f_checksum[r]),
                        "global": int(reader.offsets[shard]) + i, "local": i,
                    }
    raise AssertionError("no such field")


class CorruptionTests:
    """Damage common to every shard format; subclasses set ``fmt``."""

    fmt: str

    @pytest.fixture
    def ds(self, mixed_tree: Path, tmp_path: Path) -> Path:
        out = tmp_path / "ds"
        manifest = pack_into(mixed_tree, out, self.fmt, samples_per_shard=7)
        assert len(manifest.shards) == SHARDS
        return out

    def shard_rel(self, k: int) -> str:
        return f"shard-{k:06d}" + (".tar" if self.fmt == "tar" else ".h5")

    # clean / usage ------------------------------------------------------------------------
    @pytest.mark.parametrize("workers", [1, 2])
    def test_clean_dataset_verifies_with_exit_0(self, workers: int, cli: CLI, ds: Path) -> None:
        assert run_verify(cli, ds, workers) == (0, [])
        assert shardio.verify_dataset(ds) == []

    # a flipped bit in a field -------------------------------------------------------------
    @pytest.mark.parametrize("where", ["first_byte", "last_byte"])
    def test_flipped_payload_bit(self, where: str, cli: CLI, ds: Path, mixed_tree: Path) -> None:
        loc = field_location(ds, shard=2, min_length=8)
        at = loc["offset"] + (0 if where == "first_byte" else loc["length"] - 1)
        flip_bit(loc["path"], at, bit=5)
        found = hex64(sample_checksum_fn()(
            Path(loc["path"]).read_bytes()[loc["offset"]:loc["offset"] + loc["length"]]))

        rc, lines = run_verify(cli, ds, workers=2)
        assert rc == 1
        rel = loc["rel"]
        assert (f"{rel}: checksum mismatch key={loc['key']!r} field={loc['field']!r} "
                f"offset={loc['offset']} expected={loc['checksum']} found={found}") in lines
        assert any(line.startswith(f"{rel}: shard digest mismatch expected=") for line in lines)
        assert all(line.startswith(f"{rel}: ") for line in lines), lines
        assert len(lines) == 2

        with shardio.open_dataset(ds) as reader:
            with pytest.raises(ChecksumMismatchError) as ei:
                reader[loc["global"]]
            err = ei.value
            assert (err.shard, err.key, err.field, err.offset) == (
                loc["path"], loc["key"], loc["field"], loc["offset"])
            assert (err.expected, err.found) == (loc["checksum"], found)
            assert str(loc["offset"]) in str(err) and loc["key"] in str(err)
            with pytest.raises(ChecksumMismatchError):
                list(reader.iter_shard(2))
            assert reader[0]["__key__"] == "part0/sub/s0000"  # other shards still read
        original = source_samples(mixed_tree)[loc["key"]][loc["field"]]
        with shardio.open_dataset(ds, verify=False) as unchecked:  # what verification prevents
            damaged = unchecked[loc["global"]][loc["field"]]
        assert damaged != original and len(damaged) == len(original)

    # truncation ---------------------------------------------------------------------------
    @pytest.mark.parametrize("cut", ["half", "one_byte_short", "inside_field"])
    def test_truncated_shard(self, cut: str, cli: CLI, ds: Path) -> None:
        loc = field_location(ds, shard=1, min_length=8)
        size = os.path.getsize(loc["path"])
        new = {"half": size // 2, "one_byte_short": size - 1,
               "inside_field": loc["offset"] + loc["length"] // 2}[cut]
        truncate(loc["path"], new)

        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert f"{loc['rel']}: truncated expected={size} bytes found={new} bytes" in lines
        assert all(line.startswith(loc["rel"]) for line in lines), lines

        with shardio.open_dataset(ds) as reader:
            with pytest.raises(ShardTruncatedError) as ei:
                reader[loc["global"]]
            assert loc["path"] in str(ei.value)
            assert isinstance(ei.value, ShardCorruptError)
            assert reader[0] is not None

    def test_truncated_under_a_live_reader(self, ds: Path) -> None:
        """The descriptor is already open, so the cut shows up as a short ``pread``."""
        loc = field_location(ds, shard=3, min_length=8)
        with shardio.open_dataset(ds) as reader:
            start = reader.shard_index(3).span(loc["local"])[0]
            assert reader[int(reader.offsets[3])]  # opens the shard's descriptor
            truncate(loc["path"], loc["offset"] + 1)
            with pytest.raises(ShardTruncatedError, match=f"short read at offset {start} "):
                reader[loc["global"]]

    # missing / extra files ----------------------------------------------------------------
    def test_missing_shard(self, cli: CLI, ds: Path) -> None:
        rel = self.shard_rel(4)
        os.unlink(ds / rel)
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert lines == [f"{rel}: missing shard (listed in the manifest, not on disk)"]
        with shardio.open_dataset(ds) as reader:
            with pytest.raises(ShardNotFoundError, match=rel) as ei:
                reader[int(reader.offsets[4])]
            assert isinstance(ei.value, FileNotFoundError)
            assert len(list(reader.iter_shard(3))) == 7

    def test_extra_shard_file(self, cli: CLI, ds: Path) -> None:
        suffix = ".tar" if self.fmt == "tar" else ".h5"
        shutil.copy(ds / self.shard_rel(0), ds / f"stray{suffix}")
        (ds / "nested").mkdir()
        shutil.copy(ds / self.shard_rel(1), ds / "nested" / f"shard-000099{suffix}")
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert sorted(lines) == sorted([
            f"nested/shard-000099{suffix}: extra shard file not listed in the manifest",
            f"stray{suffix}: extra shard file not listed in the manifest",
        ])
        assert len(read_all(ds)) == 40  # extra files do not change what the reader sees

    # manifest -----------------------------------------------------------------------------
    @pytest.mark.parametrize("edit", ["num_samples", "shard_samples", "shard_digest", "stats",
                                      "created_by"])
    def test_edited_manifest(self, edit: str, cli: CLI, ds: Path) -> None:
        def change(d: dict[str, Any]) -> None:
            if edit == "num_samples":
                d["num_samples"] += 1
            elif edit == "shard_samples":
                d["shards"][1]["samples"] -= 1
            elif edit == "shard_digest":
                d["shards"][2]["digest"] = "0" * 32
            elif edit == "stats":
                d["stats"]["files_in"] += 1
            else:
                d["created_by"] = "someone else"

        rewrite_manifest(ds, change, redigest=False)
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert lines[0].startswith("manifest.json: manifest edited or damaged")
        assert "expected=" in lines[0] and "found=" in lines[0]
        with pytest.raises(ManifestCorruptError, match="digest"):
            shardio.open_dataset(ds)

    def test_manifest_that_is_not_json(self, cli: CLI, ds: Path) -> None:
        path = ds / "manifest.json"
        path.write_bytes(path.read_bytes()[:-40])
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert len(lines) == 1 and lines[0].startswith("manifest.json: unusable manifest:")
        assert "not valid JSON" in lines[0]
        with pytest.raises(ManifestCorruptError):
            shardio.open_dataset(ds)

    def test_damaged_zstd_dictionary(self, cli: CLI, text_tree: Path,  # noqa: F811
                                     tmp_path: Path) -> None:
        out = tmp_path / "dict"
        pack_into(text_tree, out, self.fmt, samples_per_shard=80, compress="zstd",
                  zstd_dict=True)
        flip_bit(out / "zstd.dict", os.path.getsize(out / "zstd.dict") // 2)
        rc, lines = run_verify(cli, out)
        assert rc == 1
        assert lines[0].startswith("zstd.dict: dictionary digest mismatch expected=")
        assert len(lines) == 1  # the shards themselves are intact
        with pytest.raises(ManifestCorruptError, match="zstd dictionary"):
            shardio.open_dataset(out)

    @pytest.mark.parametrize("verify", [True, False])
    def test_damaged_zstd_field_is_a_checksum_mismatch(self, verify: bool, text_tree: Path,  # noqa: F811
                                                       tmp_path: Path) -> None:
        """A compressed field whose stored bytes were damaged (its zstd frame header here, so
        it does not decompress) is a ChecksumMismatchError with verify=False too: the read
        checks the bytes when they fail to decode, rather than raising the zstd error (or
        blaming the dataset's compression settings)."""
        out = tmp_path / "zstd"
        pack_into(text_tree, out, self.fmt, samples_per_shard=80, compress="zstd")
        with shardio.open_dataset(out) as reader:
            idx: ShardIndex = reader.shard_index(1)
            rows = [(i, r) for i in range(len(idx)) for r in idx.rows(i)
                    if int(idx.f_flags[r]) & FLAG_ZSTD]
            assert rows, "no field was stored compressed"
            i, r = rows[len(rows) // 2]
            path, offset = reader.shard_path(1), int(idx.f_offset[r])
            key, field = idx.key(i), idx.field_names[int(idx.f_name[r])]
            at, expected = int(reader.offsets[1]) + i, hex64(idx.f_checksum[r])
        flip_bit(path, offset, bit=3)  # the first byte of the zstd magic number
        with shardio.open_dataset(out, verify=verify) as reader:
            with pytest.raises(ChecksumMismatchError) as ei:
                reader[at]
            err = ei.value
            assert (err.shard, err.key, err.field, err.offset) == (path, key, field, offset)
            assert err.expected == expected and err.found != expected
            assert reader[int(reader.offsets[2])]["__key__"]  # other shards still read

    @pytest.mark.parametrize("edit", ["shard_samples", "shard_bytes", "shard_digest"])
    def test_edited_manifest_with_forged_digest(self, edit: str, cli: CLI, ds: Path) -> None:
        """Even with its own digest recomputed, an edit disagrees with the shards themselves."""
        key = {"shard_samples": "samples", "shard_bytes": "bytes", "shard_digest": "digest"}[edit]
        original = json.loads((ds / "manifest.json").read_bytes())["shards"][1][key]

        def change(d: dict[str, Any]) -> None:
            s = d["shards"][1]
            s[key] = "f" * 32 if key == "digest" else s[key] + 1

        rewrite_manifest(ds, change, redigest=True)
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        if key == "samples":  # num_samples, left as it was, is no longer the shards' sum
            total = [line for line in lines if line.startswith("manifest.json: num_samples")]
            assert len(total) == 1, lines
            lines = [line for line in lines if line not in total]
        assert lines and all(line.startswith(f"{self.shard_rel(1)}: ") for line in lines), lines
        if key == "samples":
            want = (f"sample count differs from the manifest expected={original + 1} "
                    f"found={original}")
        elif key == "bytes":
            want = f"truncated expected={original + 1} bytes found={original} bytes"
        else:
            want = "shard digest mismatch expected=" + "f" * 32
        assert any(want in line for line in lines), lines
        if key == "samples":
            with shardio.open_dataset(ds) as reader:
                with pytest.raises(ManifestCorruptError, match="run `shardio verify`"):
                    reader[7]

    def test_newer_manifest_version(self, cli: CLI, ds: Path) -> None:
        rewrite_manifest(ds, lambda d: d.update(version=99), redigest=True)
        with pytest.raises(ManifestVersionError, match="version 99"):
            shardio.open_dataset(ds)
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert len(lines) == 1 and lines[0].startswith("manifest.json: unusable manifest:")

    @pytest.mark.parametrize("bad", ["../outside.bin", "a/../../outside.bin", "/etc/hostname",
                                     "index:../outside.idx"])
    def test_unsafe_shard_path(self, bad: str, cli: CLI, ds: Path) -> None:
        field, value = bad.split(":", 1) if bad.startswith("index:") else ("path", bad)
        rewrite_manifest(ds, lambda d: d["shards"][0].update({field: value}), redigest=True)
        with pytest.raises(UnsafePathError):
            shardio.open_dataset(ds)
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert len(lines) == 1 and "unusable manifest" in lines[0] and value in lines[0]


class TestTarCorruption(CorruptionTests):
    fmt = "tar"

    def padded_field(self, ds: Path, shard: int) -> dict[str, Any]:
        """``field_location`` of the first field of ``shard`` whose data does not end on a block
        boundary (so zero padding follows it)."""
        with shardio.open_dataset(ds) as reader:
            idx: ShardIndex = reader.shard_index(shard)
            for i in range(len(idx)):
                for r in idx.rows(i):
                    if i and int(idx.f_length[r]) % 512:
                        return {"rel": reader.manifest.shards[shard].path,
                                "path": reader.shard_path(shard), "key": idx.key(i),
                                "field": idx.field_names[int(idx.f_name[r])],
                                "offset": int(idx.f_offset[r]), "length": int(idx.f_length[r])}
        raise AssertionError("no such field")

    # A flipped bit where no field checksum looks: only the shard digest covered it, and verify
    # said "shard digest mismatch" and no more, while GNU tar and WebDataset misread the member.
    @pytest.mark.parametrize("where", ["name", "size", "checksum"])
    def test_flipped_bit_in_tar_header(self, where: str, cli: CLI, ds: Path) -> None:
        loc = self.padded_field(ds, shard=2)
        rel, header = loc["rel"], loc["offset"] - 512
        digest_before = shardio.Manifest.load(str(ds)).shards[2].digest
        before = Path(loc["path"]).read_bytes()[header:header + 512]
        at = header + {"name": 3, "size": 124 + 9, "checksum": 148 + 3}[where]
        flip_bit(loc["path"], at, bit=1)
        after = Path(loc["path"]).read_bytes()[header:header + 512]
        expected, found = {
            "name": (repr(f"{loc['key']}.{loc['field']}"),
                     repr(after[:100].rstrip(b"\0").decode())),
            "size": (f"{loc['length']} bytes", f"{int(after[124:135], 8)} bytes"),
            "checksum": (f"{int(before[148:154], 8):06o} (the block's byte sum)",
                         repr(after[148:156])),
        }[where]
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert lines == [
            (f"{rel}: shard digest mismatch expected={digest_before} "
             f"found={file_digest(loc['path'])[0]}"),
            (f"{rel}: damaged tar header ({where}) key={loc['key']!r} field={loc['field']!r} "
             f"offset={header} expected={expected} found={found}")]

    @pytest.mark.parametrize("where", ["first", "last"])
    def test_flipped_bit_in_tar_padding(self, where: str, cli: CLI, ds: Path) -> None:
        loc = self.padded_field(ds, shard=3)
        end = loc["offset"] + loc["length"]
        at = end if where == "first" else end + -end % 512 - 1
        flip_bit(loc["path"], at, bit=6)
        rc, lines = run_verify(cli, ds)
        assert rc == 1 and len(lines) == 2 and "shard digest mismatch" in lines[0]
        assert lines[1] == (f"{loc['rel']}: non-zero bytes in the tar padding after the field "
                            f"key={loc['key']!r} field={loc['field']!r} offset={at} "
                            "expected=zero bytes found=1 non-zero byte(s)")

    @pytest.mark.parametrize("workers", [1, 2])
    @pytest.mark.parametrize("where", ["first", "last"])
    def test_flipped_bit_in_tar_end_blocks(self, where: str, workers: int, cli: CLI,
                                           ds: Path) -> None:
        rel = self.shard_rel(4)
        size = os.path.getsize(ds / rel)
        at = size - 1024 if where == "first" else size - 1
        flip_bit(ds / rel, at, bit=0)
        rc, lines = run_verify(cli, ds, workers)
        assert rc == 1 and len(lines) == 2 and "shard digest mismatch" in lines[0]
        assert lines[1] == (f"{rel}: non-zero bytes in the tar end-of-archive blocks "
                            f"offset={at} expected=zero bytes found=1 non-zero byte(s)")

    def test_damaged_header_and_field_each_one_line(self, cli: CLI, ds: Path) -> None:
        """Damage in a header and in a field's data of one shard: a line for each, no more."""
        loc = self.padded_field(ds, shard=1)
        flip_bit(loc["path"], loc["offset"] - 512 + 124 + 10, bit=0)  # the size field
        flip_bit(loc["path"], loc["offset"], bit=0)
        rc, lines = run_verify(cli, ds)
        assert rc == 1 and len(lines) == 3, lines
        assert lines[1].startswith(f"{loc['rel']}: checksum mismatch key={loc['key']!r}")
        assert lines[2].startswith(f"{loc['rel']}: damaged tar header (size) key={loc['key']!r} "
                                   f"field={loc['field']!r} offset={loc['offset'] - 512} ")

    def test_flipped_bit_in_index_file(self, cli: CLI, ds: Path) -> None:
        rel = self.shard_rel(2) + ".idx"
        flip_bit(ds / rel, os.path.getsize(ds / rel) // 2, bit=0)
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert lines[0].startswith(f"{rel}: index digest mismatch expected=")
        assert lines[1].startswith(f"{rel}: unreadable index:") and "checksum mismatch" in lines[1]
        assert len(lines) == 2
        with shardio.open_dataset(ds) as reader:
            with pytest.raises(IndexCorruptError, match="shardio index"):
                reader[14]

    def test_missing_index_file(self, cli: CLI, ds: Path) -> None:
        rel = self.shard_rel(5) + ".idx"
        os.unlink(ds / rel)
        rc, lines = run_verify(cli, ds)
        assert (rc, lines) == (1, [f"{rel}: missing index"])
        with shardio.open_dataset(ds) as reader:
            with pytest.raises(ShardNotFoundError, match="shardio index"):
                reader[39]

    def test_index_from_a_newer_shardio(self, ds: Path) -> None:
        """A well-formed ``.idx`` whose format version is newer is refused, not misread."""
        path = ds / (self.shard_rel(1) + ".idx")
        data = bytearray(path.read_bytes())
        struct.pack_into("<I", data, 8, 99)
        struct.pack_into("<Q", data, len(data) - 16, xxhash.xxh3_64_intdigest(bytes(data[:-16])))
        path.write_bytes(bytes(data))
        with shardio.open_dataset(ds) as reader:
            assert reader[0]
            with pytest.raises(ManifestVersionError, match="format version 99"):
                reader[7]

    def test_truncated_at_member_boundary(self, cli: CLI, ds: Path) -> None:
        """GNU tar accepts a tar cut between members; the recorded size is what catches it."""
        rel = self.shard_rel(1)
        path = ds / rel
        size = os.path.getsize(path)
        with tarfile.open(path) as tf:
            members = tf.getmembers()
        cut_after = members[len(members) // 2]
        boundary = cut_after.offset_data + -(-cut_after.size // 512) * 512
        truncate(path, boundary)

        proc = subprocess.run(["tar", "-tf", str(path)], capture_output=True, text=True,
                              check=False, timeout=30)
        assert proc.returncode == 0 and proc.stderr == ""
        assert proc.stdout.splitlines() == [m.name for m in members[: len(members) // 2 + 1]]

        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert f"{rel}: truncated expected={size} bytes found={boundary} bytes" in lines
        assert any(" truncated key=" in line for line in lines)  # the fields past the cut
        with shardio.open_dataset(ds) as reader:
            with pytest.raises(ShardTruncatedError):
                reader[7]


class TestHdf5Corruption(CorruptionTests):
    fmt = "hdf5"

    def test_flipped_bit_in_hdf5_superblock(self, cli: CLI, ds: Path) -> None:
        rel = self.shard_rel(3)
        flip_bit(ds / rel, 2, bit=0)  # the HDF5 signature
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert lines[0].startswith(f"{rel}: shard digest mismatch expected=")
        assert lines[1].startswith(f"{rel}: unreadable index:")
        with shardio.open_dataset(ds) as reader:
            with pytest.raises(IndexCorruptError, match=rel):
                reader[21]

    def test_shard_from_a_newer_shardio(self, ds: Path, tmp_path: Path) -> None:
        """In a dataset whose (sealed) manifest this shardio reads, a shard claiming a newer
        layout is damaged (one flipped bit of the attribute did it): a fault the reader meets
        with another copy.  It was a ManifestVersionError ("upgrade shardio") that no
        replica or on_corrupt="skip" could get past."""
        replica = tmp_path / "replica"
        shutil.copytree(ds, replica)
        with h5py.File(ds / self.shard_rel(1), "r+") as f:
            f.attrs["shardio_version"] = 99
        with shardio.open_dataset(ds) as reader:
            assert reader[0]
            with pytest.raises(IndexCorruptError, match="version 99.*damaged"):
                reader[7]
        with shardio.open_dataset(ds, replicas=[str(replica)]) as reader:
            assert reader[7] == shardio.open_dataset(replica)[7]
            assert reader.counters.snapshot()["index_corrupt"] == 1

    def test_flipped_bit_in_hdf5_index_dataset(self, cli: CLI, ds: Path) -> None:
        rel = self.shard_rel(4)
        with h5py.File(ds / rel, "r") as f:
            at = f["index"]["f_checksum"].id.get_offset()
        flip_bit(ds / rel, at, bit=7)  # the stored checksum of the shard's first field
        rc, lines = run_verify(cli, ds)
        assert rc == 1
        assert lines[0].startswith(f"{rel}: shard digest mismatch")
        # The index checks itself (index_digest), as a tar shard's .idx does.
        assert lines[1].startswith(f"{rel}: unreadable index:")
        assert "index_digest mismatch" in lines[1]
        assert len(lines) == 2
        with shardio.open_dataset(ds) as reader:
            with pytest.raises(IndexCorruptError, match=rel):
                reader[28]
