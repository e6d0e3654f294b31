"""Adversarial checks of multi-node packing (``--part I/N`` + ``merge``) and of the pack summary.

Real packs of real trees (symlinks, FIFOs, files that change under the pack), real part
records; each case was a bug found by trying to break the workflow.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import shardio
from shardio.manifest import Manifest
from tests.test_pack import ROOT, _env, _show, write_files

# --- the summary's files_in ------------------------------------------------------------------


def _awkward_tree(root: Path) -> Path:
    """5 packable files in 4 samples, and one of every kind of entry a pack skips."""
    src = write_files(root, {"a/0.txt": b"zero", "a/1.txt": b"one", "a/1.json": b"{}",
                             "a/2.txt": b"two", "a/3.txt": b"three", "a/noext": b"?"})
    a = src / "a"
    os.symlink("gone.txt", a / "broken.txt")
    os.symlink("loop2.txt", a / "loop1.txt")
    os.symlink("loop1.txt", a / "loop2.txt")
    os.mkfifo(a / "fifo.txt")
    with open(os.fsencode(a) + b"/bad\xff.txt", "wb") as f:
        f.write(b"latin-1")
    # A regular file of size 0 to the scan whose read returns bytes: it "grew" since the
    # scan, so the writer leaves it out (skip kind "changed").
    os.symlink("/proc/self/stat", a / "grows.txt")
    return src


_SKIPPED = {"broken_symlink": 1, "changed": 1, "no_extension": 1, "non_utf8_name": 1,
            "not_regular": 1, "symlink_loop": 2}


@pytest.mark.parametrize("how", ["walk", "scan-first", "files-from", "parts"])
def test_files_in_counts_the_files_packed_whichever_way_they_were_found(
        tmp_path: Path, how: str) -> None:
    """``files_in`` counted the regular files the scan found with a UTF-8 name, so a file
    with no extension (never packed) and a file left out while its shard was written were
    "in", but a broken symlink, a loop, a FIFO or a non-UTF-8 name were not.  It is now the
    files whose bytes are in the shards, the same for a walk, --files-from and parts."""
    src = _awkward_tree(tmp_path / "src")
    out = tmp_path / "out"
    kw: dict[str, object] = {"on_error": "skip", "samples_per_shard": 2}
    if how == "scan-first":
        out.mkdir()
        (out / "manifest.json").write_text("{}")  # --overwrite of a non-empty OUT scans first
        kw["overwrite"] = True
    if how == "files-from":
        lst = tmp_path / "list"
        lst.write_bytes(b"".join(b"a/" + n + b"\n" for n in sorted(os.listdir(os.fsencode(
            src / "a")))))
        kw["files_from"] = lst
    if how == "parts":
        for i in range(2):
            shardio.pack(src, out, **kw, part=(i, 2))
        m = shardio.merge(out)
    else:
        m = shardio.pack(src, out, **kw)
    assert isinstance(m, Manifest)
    assert m.num_samples == 4 and m.fields == {"txt": 4, "json": 1}
    assert m.stats["skipped"] == _SKIPPED
    assert m.stats["files_in"] == 5
    assert m.stats["metadata_ops_small_files"] == 10


def test_files_in_leaves_out_the_label_field(tmp_path: Path) -> None:
    src = write_files(tmp_path / "src", {f"{c}/{i}.{ext}": b"x" for c in "ab" for i in range(3)
                                         for ext in ("txt", "json")})
    m = shardio.pack(src, tmp_path / "out", label_from_dir=True)
    assert isinstance(m, Manifest) and m.fields == {"cls": 6, "json": 6, "txt": 6}
    assert m.stats["files_in"] == 12


# --- merge without --verify: is each shard the one its part recorded? ----------------------


def _same_size_other_job(tmp_path: Path, fmt: str) -> tuple[Path, Path, str]:
    """OUT packed as 2 parts, not merged, and a shard from another job (one file's bytes
    differ, not its size) of the same size copied over one of them, with its index/xattr."""
    files = {f"d/{i:03d}.bin": bytes([i]) * 300 for i in range(12)}
    src = write_files(tmp_path / "src", files)
    other = write_files(tmp_path / "other", {**files, "d/004.bin": b"\xee" * 300})
    out = tmp_path / "out"
    kw = {"samples_per_shard": 3, "format": fmt}
    for i in range(2):
        shardio.pack(src, out, **kw, part=(i, 2))
    shardio.pack(other, tmp_path / "single", **kw)
    name = f"shard-000001.{'tar' if fmt == 'tar' else 'h5'}"
    for n in (name, name + ".idx") if fmt == "tar" else (name,):
        assert (out / n).stat().st_size == (tmp_path / "single" / n).stat().st_size
        shutil.copy2(tmp_path / "single" / n, out / n)  # (copy2 keeps the xattrs)
    return src, out, name


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_merge_refuses_another_jobs_shard_of_the_same_size(tmp_path: Path, fmt: str) -> None:
    """merge without --verify checked only that each shard had its recorded size: another
    job's shard of the same size (a shard "restored" from an older pack) was published under
    this job's digest, and only a later verify or read found the mismatch.  The index (small)
    is now hashed against the part's record, and an HDF5 shard's recorded digest compared."""
    src, out, name = _same_size_other_job(tmp_path, fmt)
    if fmt == "hdf5":
        try:
            os.getxattr(out / name, "user.shardio.digest")
        except OSError:
            pytest.skip("no user xattrs on this filesystem: an HDF5 shard carries no digest")
    with pytest.raises(shardio.errors.ShardCorruptError,
                       match=rf"{name} \(or its index\) is not the shard part 0 of 2 wrote"):
        shardio.merge(out)
    assert not (out / "manifest.json").exists()
    shardio.pack(src, out, samples_per_shard=3, format=fmt, part=(0, 2))  # the fix it names
    shardio.merge(out)
    assert shardio.verify_dataset(str(out)) == []


# --- merges of one OUT at once -----------------------------------------------------------------

MERGE_TIMEOUT = 60


def test_concurrent_merges_of_one_out_all_succeed(tmp_path: Path) -> None:
    """Every rank calling merge (as every rank packs with ``--part auto``): the merges deleted
    each other's parity temp files and parity ("ShardIOError: writing .../parity/g000012.p0:
    No such file or directory", or a FileNotFoundError traceback), and most exited 1 (one
    did in each of 6 tries).  Merges of one OUT now take turns; the later ones find the job
    merged."""
    src = write_files(tmp_path / "src", {f"d{i % 4}/{i:04d}.bin": os.urandom(64 + i % 200)
                                         for i in range(800)})
    out = tmp_path / "out"
    for i in range(2):
        shardio.pack(src, out, samples_per_shard=2, parity="4+1", fsync=False, part=(i, 2))
    cmd = [sys.executable, "-m", "shardio", "merge", str(out), "--json"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=ROOT, env=_env()) for _ in range(5)]
    results = []
    try:
        for p in procs:
            stdout, err = p.communicate(timeout=MERGE_TIMEOUT)
            _show(cmd, p.returncode, stdout, err)
            results.append((p.returncode, stdout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    assert [rc for rc, _ in results] == [0] * 5
    assert len({stdout for _, stdout in results}) == 1  # the same manifest for every merge
    assert shardio.verify_dataset(str(out)) == []
    assert not [n for n in os.listdir(out) if n.startswith(".shardio")]


def test_a_nul_separated_list_is_a_usage_error(tmp_path: Path) -> None:
    """A ``find -print0`` list crashed the pack with "ValueError: embedded null byte" (a
    traceback from os.stat) instead of a usage error naming the fix."""
    src = write_files(tmp_path / "src", {f"a/{i}.txt": b"x" for i in range(3)})
    lst = tmp_path / "list0"
    lst.write_bytes(b"".join(f"./a/{i}.txt".encode() + b"\0" for i in range(3)))
    with pytest.raises(shardio.errors.UsageError, match=r"holds NUL bytes .*find \.\.\. -print"):
        shardio.pack(src, tmp_path / "out", files_from=lst)
    for i in range(2):  # every part scans the list
        with pytest.raises(shardio.errors.UsageError, match="holds NUL bytes"):
            shardio.pack(src, tmp_path / "out", files_from=lst, part=(i, 2))
    assert not (tmp_path / "out" / "manifest.json").exists()


# --- --files-from: a file listed twice ---------------------------------------------------------


def test_a_file_listed_twice_is_named_as_such(tmp_path: Path) -> None:
    """A file listed twice (``a/1.txt`` and ``./a/1.txt``) is a DuplicateKeyError, as
    tests/test_pack.py::test_duplicate_keys pins, but its message said "two files give sample
    'a/1' field 'txt': .../a/1.txt and ..././a/1.txt; rename one": one file, which renaming
    does not help.  It now says the file is listed twice."""
    src = write_files(tmp_path / "src", {f"a/{i}.txt": b"x" for i in range(3)})
    lst = tmp_path / "list"
    lst.write_text("a/0.txt\na/1.txt\na/2.txt\n./a/1.txt\n")
    with pytest.raises(shardio.errors.DuplicateKeyError) as ei:
        shardio.pack(src, tmp_path / "out", files_from=lst)
    msg = str(ei.value)
    assert f"{src}/./a/1.txt is listed twice in --files-from {lst}" in msg
    assert "remove the repeated line" in msg and "rename" not in msg
    # Two files under one name (``c/..`` is elsewhere/ to the kernel, SRC to the key).
    write_files(tmp_path / "elsewhere", {"d/x": b"", "a/0.txt": b"another file"})
    os.symlink(tmp_path / "elsewhere" / "d", src / "c")
    lst.write_text("a/0.txt\nc/../a/0.txt\n")
    with pytest.raises(shardio.errors.DuplicateKeyError, match="two files give sample 'a/0'"):
        shardio.pack(src, tmp_path / "out2", files_from=lst)


# --- --zstd-dict with --on-error skip and an unreadable file -----------------------------------

_DICT_CHILD = r"""
import json, os, sys
import zstandard  # noqa: F401  (imported as root: the venv need not be readable by nobody)
import shardio.codec, shardio.formats.tar  # noqa: F401
from shardio.packer import pack
from shardio.parts import merge

src, outs = sys.argv[1:3]
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
kw = dict(compress="zstd", zstd_dict=True, samples_per_shard=10)
res = {}
try:
    pack(src, os.path.join(outs, "raise"), **kw)
    res["raise"] = None
except Exception as exc:
    res["raise"] = type(exc).__name__
try:
    m = pack(src, os.path.join(outs, "skip"), on_error="skip", **kw)
    res["skip"] = [m.num_samples, m.stats["skipped"]]
    for i in range(2):
        pack(src, os.path.join(outs, "parts"), on_error="skip", part=(i, 2), **kw)
    res["parts"] = merge(os.path.join(outs, "parts")).to_json().decode() == open(
        os.path.join(outs, "skip", "manifest.json")).read()
except Exception as exc:
    res["skip"] = [type(exc).__name__, str(exc)]
print(json.dumps(res))
"""


def test_zstd_dict_training_skips_an_unreadable_file_with_on_error_skip(
        world_tmp: Path) -> None:
    """--compress zstd --zstd-dict --on-error skip with a file the packing user cannot read:
    the dictionary training read every sampled file and raised UnreadableFileError
    ("... Permission denied; fix its permissions or pass --on-error skip", which was passed),
    so the pack (and every part) failed where the writer would have skipped the file."""
    rng = random.Random(0)
    src = write_files(world_tmp / "src", {f"a/{i:03d}.json": json.dumps(
        {"i": i, "w": [rng.choice(["ab", "cd", "ef"]) for _ in range(30)]}).encode()
        for i in range(60)})
    for p in [src, *src.rglob("*")]:
        os.chmod(p, 0o777 if p.is_dir() else 0o644)
    os.chmod(src / "a" / "000.json", 0)
    outs = world_tmp / "outs"
    outs.mkdir()
    os.chmod(outs, 0o777)
    proc = subprocess.run([sys.executable, "-c", _DICT_CHILD, str(src), str(outs)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=_env())
    _show(["python", "-c", "_DICT_CHILD"], proc.returncode, proc.stdout, proc.stderr)
    assert proc.returncode == 0
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    if res["raise"] is None:
        pytest.skip("chmod 000 does not block reads here")
    assert res["raise"] == "UnreadableFileError"
    assert res["skip"] == [59, {"unreadable": 1}]
    assert res["parts"] is True


def test_a_listed_name_starting_with_two_dots_is_inside_src(tmp_path: Path) -> None:
    """--files-from packs listed hidden files, but one under a directory named ``..hid`` (or a
    top-level ``..x.txt``) was refused: "entry '..hid/x.txt' lies outside SRC", because the
    check took every relative path starting with ".." for one that leaves SRC."""
    src = write_files(tmp_path / "src", {"..hid/x.txt": b"1", "..top.d/y.txt": b"2",
                                         "a/z.txt": b"3"})
    lst = tmp_path / "list"
    lst.write_text("..hid/x.txt\n..top.d/y.txt\na/z.txt\n../src/a/z.txt\n")
    with pytest.raises(shardio.errors.DuplicateKeyError, match="is listed twice"):
        shardio.pack(src, tmp_path / "out0", files_from=lst)  # (../src/a/z.txt is a/z.txt)
    lst.write_text("..hid/x.txt\n..top.d/y.txt\na/z.txt\n")
    m = shardio.pack(src, tmp_path / "out", files_from=lst)
    assert isinstance(m, Manifest) and m.num_samples == 3
    reader = shardio.open_dataset(str(tmp_path / "out"))
    assert sorted(reader[i]["__key__"] for i in range(len(reader))) == [
        "..hid/x", "..top.d/y", "a/z"]
    (tmp_path / "outside.txt").write_text("4")
    for entry in ("..", "../outside.txt", str(tmp_path / "outside.txt")):
        lst.write_text(f"a/z.txt\n{entry}\n")
        with pytest.raises(shardio.errors.UsageError, match="lies outside SRC"):
            shardio.pack(src, tmp_path / "out2", files_from=lst)
