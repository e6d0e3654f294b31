"""``shardio pack`` end to end: the CLI, resume after a real kill, every bad input, compression.

Everything here runs the real thing: the CLI in-process or as a ``python -m shardio`` child,
real signals (SIGKILL, SIGINT), a real tmpfs for ENOSPC, a real privilege drop for unreadable
files.  Every child process has a timeout and its output is printed, so a failure shows it.
"""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

import shardio
from shardio.errors import (
    BrokenSymlinkError,
    DuplicateKeyError,
    EmptySourceError,
    ManifestCorruptError,
    ManifestVersionError,
    NonUtf8NameError,
    OutputInsideSourceError,
    OutputNotEmptyError,
    SampleTooLargeError,
    ShardioError,
    SourceError,
    StorageFullError,
    SymlinkLoopError,
    UnreadableFileError,
    UsageError,
)
from shardio.manifest import Manifest, _body_digest
from tests.conftest import default_sigint

ROOT = Path(__file__).resolve().parent.parent
TMP_MARK = ".shardio-tmp"
CHILD_TIMEOUT = 120

Cli = Callable[..., tuple[int, str, str]]


# --- helpers ---------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("COLUMNS", None)
    return env


def _show(cmd: list[str], rc: int | None, out: str | bytes | None, err: str | bytes | None) -> str:
    """Print a child's command line and output (pytest shows it when the test fails)."""
    text = f"$ {' '.join(cmd)}\nrc={rc}\n--- stdout ---\n{out or ''}\n--- stderr ---\n{err or ''}"
    print(text)
    return text


def run_child(args: list[str], timeout: float = CHILD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run ``python ARGS`` with pipes and a timeout; the output is printed either way."""
    cmd = [sys.executable, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                              env=_env())
    except subprocess.TimeoutExpired as exc:
        _show(cmd, None, exc.stdout, exc.stderr)
        raise
    _show(cmd, proc.returncode, proc.stdout, proc.stderr)
    return proc


def run_shardio(*args: object, timeout: float = CHILD_TIMEOUT) -> subprocess.CompletedProcess[str]:
    return run_child(["-m", "shardio", *map(str, args)], timeout)


def temp_files(root: str | os.PathLike[str]) -> list[str]:
    """Every path under ``root`` whose name marks it as a shardio temp file."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        found += [os.path.join(dirpath, n) for n in dirnames + filenames if TMP_MARK in n]
    return found


def assert_nothing_published(out: Path, *also_clean: Path) -> None:
    """No manifest (the commit marker) and no temp file anywhere the pack touched."""
    assert not (out / "manifest.json").exists(), sorted(os.listdir(out))
    for d in (out, *also_clean):
        if d.exists():
            assert temp_files(d) == []


def file_bytes(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.is_file()}


def source_samples(src: Path, only: set[str] | None = None) -> dict[str, dict[str, bytes]]:
    """What a pack of ``src`` must contain, derived independently (WebDataset key rule)."""
    samples: dict[str, dict[str, bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(src):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if name.startswith("."):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), src).replace(os.sep, "/")
            d, base = os.path.split(rel)
            stem, ext = base.split(".", 1)
            key = f"{d}/{stem}" if d else stem
            if only is None or key in only:
                samples.setdefault(key, {})[ext] = Path(dirpath, name).read_bytes()
    return samples


def read_back(out: Path) -> dict[str, dict[str, bytes]]:
    with shardio.open_dataset(out) as ds:
        return {s["__key__"]: {k: bytes(v) for k, v in s.items() if k != "__key__"} for s in ds}


def shard_names(out: Path) -> list[str]:
    return sorted(n for n in os.listdir(out) if re.fullmatch(r"shard-\d{6}\.(tar|h5)", n))


def write_files(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    return root


def random_tree(root: Path, n: int, lo: int, hi: int, dirs: int = 4, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    return write_files(root, {f"d{i % dirs}/f{i:05d}.bin": rng.randbytes(rng.randint(lo, hi))
                              for i in range(n)})


# --- 1. CLI basics ---------------------------------------------------------------------------


def test_pack_verify_inspect(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    rc, stdout, err = cli("pack", image_tree, out, "--samples-per-shard", 16, "--label-from-dir")
    assert rc == 0, err
    m = Manifest.load(str(out))
    assert (m.num_samples, len(m.shards)) == (60, 4)
    # The summary states files, shards, compression ratio and the metadata-operation saving.
    assert "packed 60 samples (" in stdout and "; 60 files)" in stdout
    assert "into 4 tar shards" in stdout
    assert re.search(r"compression ratio 1\.00x", stdout), stdout
    small, shards = m.stats["metadata_ops_small_files"], m.stats["metadata_ops_shards"]
    assert (small, shards) == (120, 16)
    assert f"metadata operations per epoch {small} -> {shards} (8x fewer)" in stdout
    assert f"manifest: {out / 'manifest.json'}" in stdout
    # One 1-file sample: 2 operations then (open, read), 4 now (two files): not "0x fewer".
    one = write_files(tmp_path / "one", {"x.txt": b"1"})
    rc, stdout, err = cli("pack", one, tmp_path / "one_out")
    assert rc == 0, err
    assert "metadata operations per epoch 2 -> 4 (no fewer: " in stdout, stdout
    assert temp_files(out) == [] and sorted(os.listdir(out)) == sorted(
        ["manifest.json"] + [f"shard-{i:06d}.tar{x}" for i in range(4) for x in ("", ".idx")])

    rc, _, err = cli("verify", out)
    assert rc == 0 and "ok" in err

    rc, text, _ = cli("inspect", out)
    assert rc == 0
    assert re.search(r"samples\s+60", text) and "3 classes: class_000, class_001, class_002" in text
    assert "shard-000003.tar" in text
    rc, text, _ = cli("inspect", out, "--json")
    assert rc == 0
    d = json.loads(text)
    assert d["shards"] == 4 and d["samples"] == 60 and d["shard_format"] == "tar"
    assert d["fields"] == {"cls": 60, "jpg": 60}
    assert d["labels"] == ["class_000", "class_001", "class_002"]
    assert d["compression"] is None and d["compression_ratio"] == 1.0
    assert [s["samples"] for s in d["shard_list"]] == [16, 16, 16, 12]

    # The shards hold exactly the source bytes plus a label per class folder.
    got = read_back(out)
    want = source_samples(image_tree)
    assert set(got) == set(want)
    for key, fields in want.items():
        assert got[key]["jpg"] == fields["jpg"]
        assert got[key]["cls"] == str(int(key.split("/")[0][-3:])).encode()

    # GNU-tar-compatible: the stdlib tar reader sees the same members.
    with tarfile.open(out / "shard-000000.tar") as tf:
        names = tf.getnames()
    assert len(names) == 32 and names[0].endswith(".cls") and names[1].endswith(".jpg")


@pytest.mark.parametrize("command", [["inspect"], ["verify"], ["bench", "loader"]])
def test_a_file_given_as_the_dataset_is_a_typed_error(cli: Cli, tmp_path: Path,
                                                      command: list[str]) -> None:
    stray = tmp_path / "notadir"
    stray.write_text("x")
    rc, _, err = cli(*command, stray)
    assert rc in (1, 2) and "Traceback" not in err, err
    assert "not a" in err and "directory" in err


def test_inspect_without_pack_stats(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    """The pack summary in a manifest is informational: without it `inspect` still prints
    (the compression ratio as unknown) instead of a TypeError traceback."""
    out = tmp_path / "ds"
    rc, _, err = cli("pack", image_tree, out, "--samples-per-shard", 16, "--compress", "zstd")
    assert rc == 0, err
    m = Manifest.load(str(out))
    m.stats = {}
    m.save(str(out))
    rc, text, err = cli("inspect", out)
    assert rc == 0, err
    assert "ratio unknown" in text


def test_pack_json_summary_and_mixed_fields(cli: Cli, mixed_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    rc, stdout, err = cli("pack", mixed_tree, out, "--samples-per-shard", 8, "--json")
    assert rc == 0, err
    st = json.loads(stdout)
    assert st["files_in"] == 40 + 40 + 20 + 8 and st["samples"] == 40 and st["shards"] == 5
    assert st["skipped"] == {}
    assert {"compression_ratio", "metadata_ops_small_files", "metadata_ops_shards",
            "seconds"} <= set(st)
    assert Manifest.load(str(out)).fields == {"empty.bin": 8, "json": 40, "npy": 20, "txt": 40}
    assert read_back(out) == source_samples(mixed_tree)


def test_files_from(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    files = sorted(p for p in image_tree.rglob("*.jpg"))
    # A line starting with "#" is a path too (no comments, as tar -T): find's output packs whole.
    hashed = image_tree / ("#" + files[0].name)
    files[0].rename(hashed)
    files[0] = hashed
    rel = [str(p.relative_to(image_tree)) for p in files[:10]]
    absolute = [str(p) for p in files[10:15]]
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join(rel) + "\n\n" + "\n".join(absolute) + "\n")
    assert lst.read_text().startswith("#")
    out = tmp_path / "ds"
    rc, _, err = cli("pack", image_tree, out, "--files-from", lst)
    assert rc == 0, err
    keys = {str(p.relative_to(image_tree).with_suffix("")) for p in files[:15]}
    assert len(keys) == 15 and read_back(out) == source_samples(image_tree, keys)

    outside = tmp_path / "elsewhere.jpg"
    outside.write_bytes(b"x")
    lst.write_text(rel[0] + "\n" + str(outside) + "\n")
    out2 = tmp_path / "ds2"
    rc, _, err = cli("pack", image_tree, out2, "--files-from", lst)
    assert rc == 2
    assert "outside SRC" in err and "elsewhere.jpg" in err
    assert not out2.exists()
    lst.write_text(rel[0] + "\n../elsewhere.jpg\n")
    rc, _, err = cli("pack", image_tree, out2, "--files-from", lst)
    assert rc == 2 and "outside SRC" in err


def test_samples_per_shard_limit(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    rc, _, err = cli("pack", image_tree, out, "--samples-per-shard", 7)
    assert rc == 0, err
    m = Manifest.load(str(out))
    assert [s.samples for s in m.shards] == [7] * 8 + [4]
    assert shard_names(out) == [s.path for s in m.shards]


@pytest.mark.parametrize("limit, names, extra", [
    ("40KB", "images", []),
    ("64KiB", "images", ["--label-from-dir"]),
    ("100000", "images", []),
    # Long and non-ASCII member names cost a pax header each, which the limit must count too.
    ("20KB", "long", []),
    ("20KB", "long", ["--compress", "zstd"]),
    ("20KB", "unicode", []),
    # HDF5: the file's metadata (~10 KB) and its index count too.
    ("40KB", "images", ["--format", "hdf5"]),
    ("64KiB", "images", ["--format", "hdf5", "--label-from-dir"]),
    ("20KB", "unicode", ["--format", "hdf5"]),
])
def test_shard_size_limit(cli: Cli, image_tree: Path, tmp_path: Path, limit: str, names: str,
                          extra: list[str]) -> None:
    from shardio._fsutil import parse_size

    src = image_tree
    if names == "long":
        src = random_tree(tmp_path / "long", 30, 1000, 3000, dirs=1)
        os.rename(src / "d0", src / ("d" * 90))
    elif names == "unicode":
        src = write_files(tmp_path / "uni", {
            f"caf\u00e9/\u00e9t\u00e9_{i:02d}.txt": b"x" * (700 + 97 * i) for i in range(30)})
    out = tmp_path / "ds"
    rc, _, err = cli("pack", src, out, "--shard-size", limit, *extra)
    assert rc == 0, err
    m = Manifest.load(str(out))
    cap = parse_size(limit)
    sizes = [os.path.getsize(out / s.path) for s in m.shards]
    assert sizes == [s.bytes for s in m.shards]
    assert max(sizes) <= cap, f"a shard exceeds --shard-size {limit}: {sizes}"
    # The limit is what splits the data: without it everything fits in one shard.
    assert len(sizes) > 1 and sum(sizes) > cap
    assert read_back(out).keys() == source_samples(src).keys()


def test_format_hdf5(cli: Cli, mixed_tree: Path, tmp_path: Path) -> None:
    import h5py

    out = tmp_path / "ds"
    rc, _, err = cli("pack", mixed_tree, out, "--format", "hdf5", "--samples-per-shard", 16)
    assert rc == 0, err
    assert sorted(os.listdir(out)) == ["manifest.json", "shard-000000.h5", "shard-000001.h5",
                                       "shard-000002.h5"]
    rc, _, err = cli("verify", out)
    assert rc == 0, err
    rc, text, _ = cli("inspect", out, "--json")
    d = json.loads(text)
    assert d["shard_format"] == "hdf5" and d["samples"] == 40 and d["shards"] == 3
    assert read_back(out) == source_samples(mixed_tree)
    with h5py.File(out / "shard-000000.h5", "r") as f:  # plain h5py opens it
        assert "payload" in f and "index" in f


@pytest.mark.parametrize("args, needle", [
    (["--shard-size", "banana"], "invalid size"),
    (["--shard-size", "0"], "must be positive"),
    (["--shard-size", "1.5"], "a number of bytes is whole"),  # (was 1 byte)
    (["--samples-per-shard", "0"], "samples_per_shard must be an integer >= 1"),
    (["--workers", "0"], "workers must be"),
    (["--compress", "lz4"], "invalid --compress"),
    (["--compress", "zstd:99"], "choose 1 to 22"),
    (["--zstd-dict"], "--compress zstd"),
    (["--overwrite", "--resume"], "contradict"),
    (["--checksum", "md5"], "md5"),
    (["--prefix", ".hidden"], "prefix"),
])
def test_usage_errors_exit_2(cli: Cli, image_tree: Path, tmp_path: Path, args: list[str],
                             needle: str) -> None:
    out = tmp_path / "ds"
    rc, stdout, err = cli("pack", image_tree, out, *args)
    assert rc == 2, (stdout, err)
    assert err.startswith("shardio pack: error: ") and needle in err, err
    assert not out.exists()


def test_argparse_errors_exit_2(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    for args in (["pack", image_tree, tmp_path / "o", "--format", "zip"], ["pack"], ["frobnicate"]):
        with pytest.raises(SystemExit) as ei:
            cli(*args)
        assert ei.value.code == 2


def test_src_not_a_directory(cli: Cli, tmp_path: Path) -> None:
    rc, _, err = cli("pack", tmp_path / "missing", tmp_path / "out")
    assert rc == 2 and "is not a directory" in err


def test_progress_quiet_without_terminal(image_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    proc = run_shardio("pack", image_tree, out, "--samples-per-shard", 10)
    assert proc.returncode == 0
    assert proc.stderr == ""  # stderr is a pipe: no progress bar, no carriage returns
    assert proc.stdout.startswith("packed 60 samples")
    # The bar does exist and goes to stderr when asked for, so the silence above is meaningful.
    proc = run_shardio("pack", image_tree, tmp_path / "ds2", "--samples-per-shard", 10,
                       "--progress")
    assert proc.returncode == 0
    assert "packing 60 files" in proc.stderr


def test_label_ids_follow_imagefolder(tmp_path: Path) -> None:
    # Every class folder gets an id in sorted order, an empty one included, as torchvision's
    # ImageFolder numbers them ("a" < "a-b" although "a-b/..." keys sort before "a/..." keys).
    src = write_files(tmp_path / "src", {"a/x.txt": b"1", "a-b/y.txt": b"2", "c/z.txt": b"3"})
    (src / "b_empty").mkdir()
    m = shardio.pack(src, tmp_path / "ds", label_from_dir=True)
    assert m.labels == {"field": "cls", "names": ["a", "a-b", "b_empty", "c"]}
    got = {k: int(v["cls"]) for k, v in read_back(tmp_path / "ds").items()}
    assert got == {"a/x": 0, "a-b/y": 1, "c/z": 3}


# --- 2. resume -------------------------------------------------------------------------------

# Big enough that the pack writes ~1500 shards of about a millisecond each, so a signal sent once
# the first 20 are published lands while it is still running.  --no-fsync: a killed process loses
# nothing from the page cache, and fsync would make the run hostage to other disk traffic.
RESUME_FILES, RESUME_PER_SHARD = 6000, 2


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_tree(tmp_path_factory.mktemp("big") / "src", RESUME_FILES, 200, 2500, dirs=8)


def _pack_cmd(src: Path, out: Path, *extra: str) -> list[str]:
    return ["-m", "shardio", "pack", str(src), str(out), "--samples-per-shard",
            str(RESUME_PER_SHARD), "--workers", "1", "--no-fsync", *extra]


@pytest.fixture(scope="module")
def clean_pack(big_tree: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "ds"
    proc = run_child(_pack_cmd(big_tree, out))
    assert proc.returncode == 0
    return out


def _published_indexes(out: Path) -> list[str]:
    try:
        return [n for n in os.listdir(out) if re.fullmatch(r"shard-\d{6}\.tar\.idx", n)]
    except FileNotFoundError:
        return []


def _interrupt(cmd_args: list[str], out: Path, sig: int, min_shards: int = 20,
               deadline: float = 60.0) -> tuple[int, str, str]:
    """Start a pack, wait until ``min_shards`` shards are published, send ``sig``, reap it."""
    cmd = [sys.executable, *cmd_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=_env(), preexec_fn=default_sigint)
    stdout, err, reaped = "", "", False
    try:
        end = time.monotonic() + deadline
        while len(_published_indexes(out)) < min_shards:
            if proc.poll() is not None:
                pytest.fail("the pack ended before it could be interrupted; grow RESUME_FILES")
            if time.monotonic() > end:
                pytest.fail(f"no {min_shards} shards published within {deadline}s")
            time.sleep(0.001)
        proc.send_signal(sig)
        stdout, err = proc.communicate(timeout=60)
        reaped = True
    finally:
        if not reaped:
            if proc.poll() is None:
                proc.kill()
            stdout, err = proc.communicate(timeout=30)
        _show(cmd, proc.returncode, stdout, err)
    return proc.returncode, stdout, err


def _assert_no_partial_shard(out: Path) -> dict[str, tuple[int, int]]:
    """After a kill: no manifest, and every shard under its final name is whole.

    Returns ``{name: (inode, mtime_ns)}`` of the shards (and indexes) that are fully published.
    """
    from shardio.checksum import file_digest
    from shardio.formats import load_index

    names = os.listdir(out)
    assert "manifest.json" not in names
    finished: dict[str, tuple[int, int]] = {}
    for n in names:
        if TMP_MARK in n or n == ".shardio-pack.json":
            continue
        assert re.fullmatch(r"shard-\d{6}\.tar(\.idx)?", n), f"unexpected file {n} in {names}"
        path = out / n
        if n.endswith(".idx"):
            shard = path.with_suffix("")
            assert shard.exists(), f"index {n} published before its shard"
            meta = load_index("tar", str(shard)).meta
            assert (meta["shard_digest"], meta["shard_bytes"]) == \
                (file_digest(str(shard))[0], shard.stat().st_size), f"{shard.name} is partial"
            for p in (shard, path):
                st = p.stat()
                finished[p.name] = (st.st_ino, st.st_mtime_ns)
        else:
            # A shard whose index was not renamed yet must still be a whole tar.
            data = path.read_bytes()
            assert len(data) % 512 == 0 and data.endswith(bytes(1024)), f"{n} is partial"
            with tarfile.open(path) as tf:
                assert tf.getmembers()
    return finished


def test_resume_after_sigkill(big_tree: Path, clean_pack: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    rc, _, _ = _interrupt(_pack_cmd(big_tree, out), out, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    finished = _assert_no_partial_shard(out)
    assert len(finished) >= 2 * 20
    # Leftovers a kill can leave whatever instant it hit: a temp file, and a finished shard that
    # was damaged afterwards (it must be redone, not trusted).
    (out / f".shard-000001.tar{TMP_MARK}-12345").write_bytes(b"half a shard")
    damaged = "shard-000002.tar"
    with open(out / damaged, "r+b") as f:
        f.seek(700)
        byte = f.read(1)
        f.seek(700)
        f.write(bytes([byte[0] ^ 1]))
    del finished[damaged], finished[damaged + ".idx"]  # both are redone

    proc = run_child(_pack_cmd(big_tree, out))
    assert proc.returncode == 0
    assert temp_files(out) == []
    assert run_shardio("verify", out).returncode == 0
    assert file_bytes(out) == file_bytes(clean_pack)
    # Shards finished before the kill were kept, not rewritten.
    for name, ident in finished.items():
        st = (out / name).stat()
        assert (st.st_ino, st.st_mtime_ns) == ident, f"{name} was rewritten on resume"


def test_killed_pack_leaves_no_worker_behind(big_tree: Path, clean_pack: Path,
                                             tmp_path: Path) -> None:
    out = tmp_path / "ds"
    rc, _, _ = _interrupt(_pack_cmd(big_tree, out, "--workers", "2"), out, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    # _interrupt's communicate() returned, so every worker has closed the stdout and stderr it
    # inherited: each was killed with its parent (PR_SET_PDEATHSIG), in the middle of its
    # shard (whose temp file the rerun sweeps).
    _assert_no_partial_shard(out)
    proc = run_child(_pack_cmd(big_tree, out, "--workers", "2"))
    assert proc.returncode == 0
    assert temp_files(out) == []
    assert file_bytes(out) == file_bytes(clean_pack)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_pack_workers_die_with_their_parent(tmp_path: Path) -> None:
    """A pack killed with SIGKILL (the OOM killer, kill -9) and rerun at once with other
    options: its workers finished the shards in hand and published them over the rerun's
    dataset (verify failed after a clean rerun).  They die with the parent now."""
    src = write_files(tmp_path / "src", {f"a/f{i:03d}.bin": os.urandom(2000) for i in range(48)})
    out = tmp_path / "ds"
    env = {**_env(), "SHARDIO_SLOW_READS": f"{src}:1GB:0.05"}  # ~0.2 s a shard
    cmd = [sys.executable, "-m", "shardio", "pack", str(src), str(out), "--samples-per-shard",
           "4", "--workers", "2", "--no-fsync"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 60
        while not _published_indexes(out):
            assert proc.poll() is None and time.monotonic() < deadline, "no shard published"
            time.sleep(0.002)
        workers = psutil.Process(proc.pid).children()
        assert len(workers) == 2
        before = sorted(_published_indexes(out))
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    # Gone, or a zombie its new parent has not reaped yet (is_running compares start times
    # too: a reused pid is not the worker).  SIGKILL is delivered at once, but asynchronously.
    end = time.monotonic() + 10
    while alive := [p for p in workers if _running(p)]:
        assert time.monotonic() < end, f"pack workers outlived their parent: {alive}"
        time.sleep(0.01)
    time.sleep(0.5)  # a worker still alive would publish its shard in hand within ~0.2 s
    assert sorted(_published_indexes(out)) == before


def test_resume_after_sigint(big_tree: Path, clean_pack: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    finished: dict[str, tuple[int, int]] = {}
    # Ctrl-C three times at different points (the later ones interrupt a resuming run): each must
    # exit 130 and clean up its temp files, wherever in a shard's write the signal lands.
    for min_shards in (20, 300, 600):
        rc, _, err = _interrupt(_pack_cmd(big_tree, out), out, signal.SIGINT, min_shards)
        assert rc == 130
        assert "interrupted; rerun the same command to resume" in err
        assert "Traceback" not in err
        assert temp_files(out) == []
        now = _assert_no_partial_shard(out)
        assert {n: now.get(n) for n in finished} == finished, "a finished shard was redone"
        finished = now

    # The unfinished run belongs to this exact job: another command may neither resume it nor
    # write over it without --overwrite.
    proc = run_child(_pack_cmd(big_tree, out, "--resume", "--compress", "zstd"))
    assert proc.returncode == 2 and "no unfinished run of a pack with these options" in proc.stderr
    proc = run_child(["-m", "shardio", "pack", str(big_tree), str(out)])
    assert proc.returncode == 2 and "--overwrite" in proc.stderr

    proc = run_child(_pack_cmd(big_tree, out, "--resume"))
    assert proc.returncode == 0
    assert temp_files(out) == []
    assert file_bytes(out) == file_bytes(clean_pack)
    for name, ident in finished.items():
        st = (out / name).stat()
        assert (st.st_ino, st.st_mtime_ns) == ident, f"{name} was rewritten on resume"


@pytest.mark.parametrize("workers", [1, 2])
def test_scan_error_after_published_shards_resumes(tmp_path: Path, workers: int) -> None:
    # A fresh pack writes while it scans, so a bad file in the last folder is met after the
    # first shards are out: no manifest, and the rerun after the fix keeps those shards.
    src = random_tree(tmp_path / "src", 80, 100, 900, dirs=4)
    os.symlink("missing.bin", src / "d3" / "zz.bin")
    out = tmp_path / "out"
    expect_error(src, out, BrokenSymlinkError, ["zz.bin", "--on-error skip"],
                 samples_per_shard=4, workers=workers, fsync=False)
    finished = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()
                if p.name.endswith(".idx")}
    assert len(finished) >= 10  # d0..d2 hold 60 of the 80 files: 15 shards were planned
    (src / "d3" / "zz.bin").unlink()
    shardio.pack(src, out, samples_per_shard=4, workers=workers, fsync=False)
    for name, ident in finished.items():
        st = (out / name).stat()
        assert (st.st_ino, st.st_mtime_ns) == ident, f"{name} was rewritten on resume"
    clean = tmp_path / "clean"
    shardio.pack(src, clean, samples_per_shard=4, fsync=False)
    assert file_bytes(out) == file_bytes(clean)


def test_rerun_completed_pack_is_noop(image_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    m1 = shardio.pack(image_tree, out, samples_per_shard=8)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    m2 = shardio.pack(image_tree, out, samples_per_shard=8, workers=2)  # workers do not matter
    assert m2.to_dict() == m1.to_dict() == Manifest.load(str(out)).to_dict()
    after = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.iterdir()}
    assert after == before


def test_different_job_needs_overwrite(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "ds"
    shardio.pack(image_tree, out, samples_per_shard=10)
    (out / "notes.txt").write_text("mine")
    before = file_bytes(out)
    with pytest.raises(OutputNotEmptyError) as ei:
        shardio.pack(image_tree, out, samples_per_shard=6)
    assert isinstance(ei.value, UsageError) and "--overwrite" in str(ei.value)
    assert file_bytes(out) == before
    rc, _, err = cli("pack", image_tree, out, "--samples-per-shard", 6)
    assert rc == 2 and "--overwrite" in err and "OUT" in err
    assert file_bytes(out) == before

    rc, _, err = cli("pack", image_tree, out, "--samples-per-shard", 6, "--overwrite")
    assert rc == 0, err
    m = Manifest.load(str(out))
    assert len(m.shards) == 10 and shard_names(out) == [s.path for s in m.shards]
    assert (out / "notes.txt").read_text() == "mine"  # only shardio's own files are replaced
    assert cli("verify", out)[0] == 0


def test_resume_without_unfinished_run(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    rc, _, err = cli("pack", image_tree, tmp_path / "fresh", "--resume")
    assert rc == 2 and "--resume" in err and "no unfinished run" in err
    assert not (tmp_path / "fresh" / "manifest.json").exists()
    # A finished pack of another job is not an unfinished run of this one.
    out = tmp_path / "done"
    shardio.pack(image_tree, out, samples_per_shard=10)
    before = file_bytes(out)
    rc, _, err = cli("pack", image_tree, out, "--samples-per-shard", 5, "--resume")
    assert rc == 2 and "no unfinished run" in err
    assert file_bytes(out) == before


# --- 3. bad inputs ---------------------------------------------------------------------------


def expect_error(src: Path, out: Path, cls: type[BaseException], fix: list[str],
                 **kwargs: Any) -> BaseException:
    """``pack`` raises ``cls`` whose message names the fix, and publishes nothing."""
    with pytest.raises(cls) as ei:
        shardio.pack(src, out, **kwargs)
    msg = str(ei.value)
    for word in fix:
        assert word in msg, f"{word!r} not in error message {msg!r}"
    assert isinstance(ei.value, ShardioError)
    if out.exists():
        assert_nothing_published(out)
    assert temp_files(src) == []
    return ei.value


def expect_skip(src: Path, out: Path, kind: str, samples: int, **kwargs: Any) -> Manifest:
    m = shardio.pack(src, out, on_error="skip", **kwargs)
    assert m.stats["skipped"] == {kind: 1}
    assert m.num_samples == samples == len(read_back(out))
    assert Manifest.load(str(out)).stats["skipped"] == {kind: 1}
    assert temp_files(out) == []
    return m


def small_tree(root: Path, n: int = 6) -> Path:
    return write_files(root, {f"a/s{i}.txt": f"sample {i}".encode() for i in range(n)})


_UNREADABLE_CHILD = r"""
import json, os, sys
from shardio.errors import UnreadableFileError
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
import shardio.formats.tar  # import as root: python and the venv need not be readable by nobody
from shardio.packer import pack

with ProcessPoolExecutor(2, mp_context=get_context("fork")) as ex:  # loads the pool's modules
    list(ex.map(abs, [1, 2]))

src, outs, bad = sys.argv[1:4]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
res = {"uid": os.getuid()}
try:
    open(bad, "rb").close()
    res["bad_readable"] = True
except PermissionError:
    res["bad_readable"] = False
for workers in (1, 2):
    try:
        pack(src, os.path.join(outs, f"raise{workers}"), samples_per_shard=2, workers=workers)
        res[f"raise{workers}"] = None
    except Exception as exc:
        res[f"raise{workers}"] = [type(exc).__name__, str(exc),
                                  isinstance(exc, UnreadableFileError), isinstance(exc, OSError)]
m = pack(src, os.path.join(outs, "skip"), samples_per_shard=2, on_error="skip")
res["skip"] = [m.stats["skipped"], m.num_samples]
print(json.dumps(res))
"""


def test_unreadable_file(world_tmp: Path, tmp_path: Path) -> None:
    if os.geteuid() != 0:
        # Not root: a plain chmod blocks reads, so test in-process.
        src = small_tree(tmp_path / "src")
        bad = src / "a" / "s3.txt"
        os.chmod(bad, 0)
        try:
            if os.access(bad, os.R_OK):
                pytest.skip("chmod 000 does not block reads here")
            expect_error(src, tmp_path / "out", UnreadableFileError,
                         ["s3.txt", "permissions", "--on-error skip"], samples_per_shard=2)
            expect_skip(src, tmp_path / "skip", "unreadable", 5, samples_per_shard=2)
        finally:
            os.chmod(bad, 0o644)
        return
    # Root reads everything, so the pack runs in a child that drops to nobody (65534).
    src = small_tree(world_tmp / "src")
    bad = src / "a" / "s3.txt"
    os.chmod(bad, 0)
    outs = world_tmp / "outs"
    outs.mkdir()
    os.chmod(outs, 0o777)
    proc = run_child(["-c", _UNREADABLE_CHILD, str(src), str(outs), str(bad)], timeout=60)
    assert proc.returncode == 0
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["uid"] == 65534 and res["bad_readable"] is False
    for workers in (1, 2):
        name, msg, typed, is_oserror = res[f"raise{workers}"]
        assert (name, typed, is_oserror) == ("UnreadableFileError", True, True)
        assert "s3.txt" in msg and "permissions" in msg and "--on-error skip" in msg
        assert_nothing_published(outs / f"raise{workers}")
    assert res["skip"] == [{"unreadable": 1}, 5]
    assert sorted(read_back(outs / "skip")) == [f"a/s{i}" for i in (0, 1, 2, 4, 5)]
    assert temp_files(outs) == []


def test_broken_symlink(tmp_path: Path) -> None:
    src = small_tree(tmp_path / "src")
    os.symlink("gone.txt", src / "a" / "link.txt")
    exc = expect_error(src, tmp_path / "out", BrokenSymlinkError,
                       ["link.txt", "gone.txt", "fix or remove the link", "--on-error skip"])
    assert isinstance(exc, OSError)
    expect_skip(src, tmp_path / "skip", "broken_symlink", 6)


@pytest.mark.parametrize("kind", ["dir_to_ancestor", "self_link"])
def test_symlink_loop(tmp_path: Path, kind: str) -> None:
    src = small_tree(tmp_path / "src")
    if kind == "dir_to_ancestor":
        os.symlink("..", src / "a" / "up")  # src/a/up -> src: walking it never ends
    else:
        os.symlink("me.txt", src / "a" / "me.txt")
    exc = expect_error(src, tmp_path / "out", SymlinkLoopError, ["a/", "--on-error skip"])
    assert isinstance(exc, OSError)
    expect_skip(src, tmp_path / "skip", "symlink_loop", 6)


def test_empty_source(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / ".hidden.txt").write_text("ignored")
    expect_error(src, tmp_path / "out", EmptySourceError, [str(src), "point SRC at"])
    # Skipping every file leaves nothing: still an error, and it says what was skipped.
    os.symlink("gone.txt", src / "sub" / "x.txt")
    expect_error(src, tmp_path / "out", EmptySourceError, ["broken_symlink"], on_error="skip")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_sample_larger_than_shard(tmp_path: Path) -> None:
    src = small_tree(tmp_path / "src")
    (src / "a" / "huge.bin").write_bytes(os.urandom(200_000))
    exc = expect_error(src, tmp_path / "out", SampleTooLargeError,
                       ["a/huge", "--shard-size", "at least"], shard_size="100KB")
    assert isinstance(exc, SourceError)
    expect_skip(src, tmp_path / "skip", "too_large", 6, shard_size="100KB")
    # Skipping them all leaves nothing to pack, whichever path plans (streaming or scan first).
    huge = write_files(tmp_path / "huge", {f"a/x{i}.bin": os.urandom(200_000) for i in range(2)})
    for out in (tmp_path / "none", tmp_path / "full"):
        if out.name == "full":
            write_files(out, {"notes.txt": b"mine"})
        expect_error(huge, out, EmptySourceError, ["every sample", "--shard-size"],
                     shard_size="100KB", on_error="skip", overwrite=True)


@pytest.mark.parametrize("second", ["a/s1.txt", "./a/s1.txt", "a/../a/s1.txt", "ABS"])
def test_duplicate_keys(tmp_path: Path, second: str) -> None:
    src = small_tree(tmp_path / "src")
    if second == "ABS":
        second = str(src / "a" / "s1.txt")
    lst = tmp_path / "list.txt"
    lst.write_text("a/s0.txt\na/s1.txt\na/s2.txt\n" + second + "\n")
    expect_error(src, tmp_path / "out", DuplicateKeyError, ["'a/s1'", "'txt'", "--on-error skip"],
                 files_from=lst)
    expect_skip(src, tmp_path / "skip", "duplicate_key", 3, files_from=lst)


def test_duplicate_field_from_label(tmp_path: Path) -> None:
    src = small_tree(tmp_path / "src")
    (src / "a" / "s0.cls").write_text("7")  # --label-from-dir would overwrite it
    expect_error(src, tmp_path / "out", DuplicateKeyError, ["'a/s0'", "cls"], label_from_dir=True)
    expect_skip(src, tmp_path / "skip", "duplicate_key", 5, label_from_dir=True)


@pytest.mark.parametrize("files_from", [False, True])
def test_fields_that_differ_only_by_case(tmp_path: Path, files_from: bool) -> None:
    """WebDataset lowercases field names and refuses a sample that then has one twice: such a
    sample is a DuplicateKeyError (it was packed, and the tar unreadable by WebDataset)."""
    src = small_tree(tmp_path / "src")
    (src / "a" / "s1.TXT").write_text("upper")
    (src / "a" / "s2.CLS").write_text("7")  # read by WebDataset as the label field
    lst = tmp_path / "list.txt"

    def listed() -> Path:  # the list of what is in the tree now
        lst.write_text("".join(f"{p.relative_to(src)}\n" for p in sorted(src.rglob("*.*"))))
        return lst

    kw = {"files_from": listed()} if files_from else {}
    expect_error(src, tmp_path / "out", DuplicateKeyError, ["'a/s1'", "'TXT'", "'txt'",
                                                           "differ only by case"], **kw)
    expect_error(src, tmp_path / "out2", DuplicateKeyError, ["'a/s1'", "differ only by case"],
                 label_from_dir=True, **kw)
    (src / "a" / "s1.TXT").unlink()
    kw = {"files_from": listed()} if files_from else {}
    expect_error(src, tmp_path / "out3", DuplicateKeyError, ["'a/s2'", "'CLS'", "label"],
                 label_from_dir=True, **kw)
    expect_skip(src, tmp_path / "skip", "duplicate_key", 5, label_from_dir=True, **kw)


def _listing(src: Path, lst: Path) -> Path:
    """A --files-from list of every file in ``src`` (hidden ones included)."""
    lst.write_text("".join(f"{p.relative_to(src)}\n" for p in sorted(src.rglob("*"))
                           if p.is_file()))
    return lst


@pytest.mark.parametrize("files_from", [False, True])
@pytest.mark.parametrize("name,cls,kind,words", [  # the first two spoil sample a/s1
    ("a/s1.__key__", DuplicateKeyError, "duplicate_key", ["'a/s1'", "'__key__'", "WebDataset"]),
    ("a/s1.__URL__", DuplicateKeyError, "duplicate_key", ["'a/s1'", "'__url__'", "WebDataset"]),
    ("__a.b__", SourceError, "reserved_name", ["'__a'", "WebDataset skips"]),
    ("__meta__/x.txt", SourceError, "reserved_name", ["'__meta__/x'", "WebDataset skips"]),
])
def test_names_webdataset_would_not_read_as_packed(tmp_path: Path, files_from: bool, name: str,
                                                   cls: type[Exception], kind: str,
                                                   words: list[str]) -> None:
    """A field named like WebDataset's own ``__key__``/``__url__`` (it refuses the tar; the
    sample's key was replaced by the file's bytes) and a member name it skips as metadata
    (shardio read a sample WebDataset never yields) are refused, or skipped and counted."""
    src = small_tree(tmp_path / "src")
    write_files(src, {name: b"odd"})
    kw = {"files_from": _listing(src, tmp_path / "list.txt")} if files_from else {}
    expect_error(src, tmp_path / "out", cls, [*words, "--on-error skip"], **kw)
    expect_skip(src, tmp_path / "skip", kind, 5 if name.startswith("a/s1") else 6, **kw)
    assert all(set(s) == {"txt"} for s in read_back(tmp_path / "skip").values())


@pytest.mark.parametrize("files_from", [False, True])
def test_field_names_are_lowercased_as_webdataset_reads_them(tmp_path: Path,
                                                              files_from: bool) -> None:
    """``x.JPG`` is field ``jpg`` (shardio's reader said ``JPG``, WebDataset ``jpg``, and an
    index of the same tar ``jpg``), fields sorted by their lowercased names."""
    import webdataset as wds

    src = write_files(tmp_path / "src", {"a/x.JPG": b"J", "a/x.Txt": b"T", "a/y.b": b"B",
                                         "a/y.A": b"A"})
    kw = {"files_from": _listing(src, tmp_path / "list.txt")} if files_from else {}
    out = tmp_path / "out"
    m = shardio.pack(src, out, **kw)
    assert m.fields == {"jpg": 1, "txt": 1, "a": 1, "b": 1}
    got = read_back(out)
    assert got == {"a/x": {"jpg": b"J", "txt": b"T"}, "a/y": {"a": b"A", "b": b"B"}}
    tars = [str(out / s.path) for s in m.shards]
    ref = {s["__key__"]: {k: bytes(v) for k, v in s.items() if not k.startswith("__")}
           for s in wds.WebDataset(tars, shardshuffle=False, empty_check=False)}
    assert ref == got
    names = subprocess.run(["tar", "-tf", tars[0]], capture_output=True, text=True, check=True,
                           timeout=30).stdout.split()
    assert names == ["a/x.jpg", "a/x.txt", "a/y.a", "a/y.b"]


@pytest.mark.parametrize("files_from", [False, True])
def test_a_field_and_its_zst_name_clash_only_when_compressing(tmp_path: Path,
                                                              files_from: bool) -> None:
    """With ``--compress zstd`` field ``txt`` is the member ``x.txt.zst``: beside a field
    ``txt.zst`` the tar held two members of one name (tar -x kept one, WebDataset refused)."""
    src = small_tree(tmp_path / "src")
    write_files(src, {"a/s1.txt.zst": b"already compressed, or not"})
    kw = {"files_from": _listing(src, tmp_path / "list.txt")} if files_from else {}
    expect_error(src, tmp_path / "out", DuplicateKeyError,
                 ["'a/s1'", "'txt.zst'", "--compress", "--on-error skip"], compress="zstd", **kw)
    expect_skip(src, tmp_path / "skip", "duplicate_key", 5, compress="zstd", **kw)
    m = shardio.pack(src, tmp_path / "plain", **kw)
    assert m.num_samples == 6 and read_back(tmp_path / "plain")["a/s1"]["txt.zst"].startswith(
        b"already")


@pytest.mark.parametrize("files_from", [False, True])
def test_a_fifo_in_the_source_is_an_error_not_a_silent_drop(tmp_path: Path,
                                                             files_from: bool) -> None:
    src = small_tree(tmp_path / "src")
    os.mkfifo(src / "a" / "pipe.txt")
    kw = {}
    if files_from:
        lst = _listing(src, tmp_path / "list.txt")
        lst.write_text(lst.read_text() + "a/pipe.txt\n")
        kw = {"files_from": lst}
    expect_error(src, tmp_path / "out", UnreadableFileError,
                 ["pipe.txt", "FIFO", "not a regular file", "--on-error skip"], **kw)
    expect_skip(src, tmp_path / "skip", "not_regular", 6, **kw)


def test_files_from_refuses_the_empty_key(tmp_path: Path) -> None:
    """A listed ``.hidden.txt`` at the top of SRC became the sample with the empty key, which
    WebDataset drops.  Other listed hidden files are packed, as WebDataset reads them."""
    src = small_tree(tmp_path / "src")
    write_files(src, {".hidden.txt": b"h", "a/.dot.txt": b"d", ".git/x.txt": b"g"})
    lst = _listing(src, tmp_path / "list.txt")
    expect_error(src, tmp_path / "out", SourceError, [".hidden.txt", "empty key",
                                                      "--on-error skip"], files_from=lst)
    expect_skip(src, tmp_path / "skip", "empty_key", 8, files_from=lst)
    got = read_back(tmp_path / "skip")
    assert got["a/"] == {"dot.txt": b"d"} and got[".git/x"] == {"txt": b"g"}


@pytest.mark.parametrize("where", ["file", "dir"])
def test_non_utf8_name(tmp_path: Path, where: str) -> None:
    src = small_tree(tmp_path / "src")
    base = os.fsencode(src / "a")
    if where == "file":
        bad = os.path.join(base, b"bad\xff.txt")
    else:
        os.mkdir(os.path.join(base, b"dir\xfe"))
        bad = os.path.join(base, b"dir\xfe", b"x.txt")
    with open(bad, "wb") as f:
        f.write(b"payload")
    expect_error(src, tmp_path / "out", NonUtf8NameError, ["not valid UTF-8", "rename",
                                                           "--on-error skip"])
    expect_skip(src, tmp_path / "skip", "non_utf8_name", 6)


@pytest.mark.parametrize("where", ["inside", "same", "via_link"])
def test_output_inside_source(tmp_path: Path, where: str) -> None:
    src = small_tree(tmp_path / "src")
    out = {"inside": src / "a" / "out", "same": src, "via_link": tmp_path / "link" / "out"}[where]
    if where == "via_link":
        os.symlink(src / "a", tmp_path / "link")
    before = sorted(p.name for p in src.rglob("*"))
    exc = expect_error(src, out, OutputInsideSourceError, ["inside SRC", "outside SRC"])
    assert isinstance(exc, UsageError) and isinstance(exc, ValueError)
    assert sorted(p.name for p in src.rglob("*")) == before  # OUT not even created


def test_output_not_empty(cli: Cli, tmp_path: Path) -> None:
    src = small_tree(tmp_path / "src")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.dat").write_bytes(b"keep me")
    expect_error(src, out, OutputNotEmptyError, ["not empty", "--overwrite"])
    assert os.listdir(out) == ["precious.dat"]
    rc, _, err = cli("pack", src, out)
    assert rc == 2 and "--overwrite" in err
    assert os.listdir(out) == ["precious.dat"]


@pytest.mark.parametrize("workers", [1, 2])
def test_disk_full(small_tmpfs: Path, tmp_path: Path, workers: int) -> None:
    src = random_tree(tmp_path / "src", 40, 90_000, 110_000)  # ~4 MB into 2 MiB
    out = small_tmpfs / "ds"
    exc = expect_error(src, out, StorageFullError, ["free space", "nothing was published"],
                       samples_per_shard=4, workers=workers)
    assert isinstance(exc, OSError) and exc.errno == errno.ENOSPC
    assert temp_files(small_tmpfs) == []


def test_manifest_from_newer_version(cli: Cli, tmp_path: Path) -> None:
    src = small_tree(tmp_path / "src")
    out = tmp_path / "out"
    shardio.pack(src, out)
    path = out / "manifest.json"
    data = json.loads(path.read_text())
    data["version"] = 99
    data["a_field_from_the_future"] = {"x": 1}
    path.write_text(json.dumps(data))  # a version that fails the digest: damage, not newness
    with pytest.raises(ManifestCorruptError, match="fails its own digest.*version 99"):
        Manifest.load(str(out))
    data["manifest_digest"] = _body_digest(data)  # sealed, as every shardio seals its manifest
    path.write_text(json.dumps(data))
    with pytest.raises(ManifestVersionError) as ei:
        Manifest.load(str(out))
    assert "version 99" in str(ei.value) and "upgrade shardio" in str(ei.value)
    with pytest.raises(ManifestVersionError):
        shardio.open_dataset(out)
    rc, _, err = cli("inspect", out)
    assert rc == 1 and "ManifestVersionError" in err and "pip install -U shardio" in err


# --- 4. compression --------------------------------------------------------------------------


def _ratio(summary: str) -> float:
    m = re.search(r"compression ratio (\d+\.\d+)x", summary)
    assert m, summary
    return float(m.group(1))


def test_compress_zstd(cli: Cli, tmp_path: Path) -> None:
    src = write_files(tmp_path / "src", {
        f"t/doc{i:03d}.txt": (f"line {i}: the quick brown fox jumps over the lazy dog\n" * 40)
        .encode() for i in range(60)})
    (src / "t" / "doc000.empty").write_bytes(b"")
    out = tmp_path / "ds"
    rc, stdout, err = cli("pack", src, out, "--compress", "zstd:5", "--samples-per-shard", 25)
    assert rc == 0, err
    m = Manifest.load(str(out))
    assert m.compression == {"codec": "zstd", "level": 5, "dictionary": None,
                             "dictionary_digest": None}
    assert m.stats["compression_ratio"] > 5 and _ratio(stdout) > 5
    assert m.stats["stored_bytes"] < m.stats["raw_bytes"] / 5
    assert cli("verify", out)[0] == 0
    assert read_back(out) == source_samples(src)
    rc, text, _ = cli("inspect", out)
    assert "compression zstd:5 (ratio" in text


def test_zstd_dictionary(cli: Cli, tmp_path: Path) -> None:
    import random

    from shardio.checksum import digest_bytes

    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]
    src = write_files(tmp_path / "src", {f"r{i:04d}.json": json.dumps({
        "id": i, "user": f"user_{rng.randint(0, 50)}", "tags": rng.sample(words, 3),
        "caption": " ".join(rng.choice(words) for _ in range(8)), "score": round(rng.random(), 3),
        "source": f"https://example.org/images/{i:06d}.jpg"}, indent=1).encode()
        for i in range(300)})
    plain, with_dict = tmp_path / "plain", tmp_path / "dict"
    rc, out_plain, err = cli("pack", src, plain, "--compress", "zstd")
    assert rc == 0, err
    rc, out_dict, err = cli("pack", src, with_dict, "--compress", "zstd", "--zstd-dict",
                            "--samples-per-shard", 100)
    assert rc == 0, err
    m = Manifest.load(str(with_dict))
    dictionary = (with_dict / "zstd.dict").read_bytes()
    assert m.compression == {"codec": "zstd", "level": 3, "dictionary": "zstd.dict",
                             "dictionary_digest": digest_bytes(dictionary)}
    # The dictionary is what makes small JSON records shrink.
    assert _ratio(out_dict) > _ratio(out_plain) > 1
    assert cli("verify", with_dict)[0] == 0
    assert read_back(with_dict) == source_samples(src)
    assert "+ dictionary" in cli("inspect", with_dict)[1]
    # Rerunning reuses the stored dictionary and changes nothing.
    before = file_bytes(with_dict)
    rc, _, err = cli("pack", src, with_dict, "--compress", "zstd", "--zstd-dict",
                     "--samples-per-shard", 100)
    assert rc == 0, err
    assert file_bytes(with_dict) == before


_SWAP_AFTER_SCAN = r"""
import os, sys
import shardio, shardio.packer as pk
from shardio.errors import UnreadableFileError
src, out, how, fmt, workers, on_error = sys.argv[1:7]
victim = os.path.join(src, "a", "s3.txt")
scan = pk.scan_source
def scan_then_swap(*a, **k):
    got = scan(*a, **k)
    os.unlink(victim)
    if how == "fifo":
        os.mkfifo(victim)
    return got
pk.scan_source = scan_then_swap
try:
    m = shardio.pack(src, out, files_from=os.path.join(src, "..", "list.txt"), format=fmt,
                     workers=int(workers), samples_per_shard=2, on_error=on_error)
    print("PACKED", m.num_samples, m.stats["skipped"])
except UnreadableFileError as exc:
    print("ERROR", exc)
"""


@pytest.mark.parametrize("fmt, workers", [("tar", 1), ("tar", 2), ("hdf5", 1)])
@pytest.mark.parametrize("how", ["fifo", "gone"])
def test_a_file_replaced_or_removed_after_the_scan(tmp_path: Path, fmt: str, workers: int,
                                                   how: str) -> None:
    """A file the scan saw as regular, replaced by a FIFO before its read, hung the pack for
    ever (its open waited for a writer); one removed was blamed on its permissions."""
    src = small_tree(tmp_path / "src")
    _listing(src, tmp_path / "list.txt")  # (a listed source is scanned before any read)
    script = tmp_path / "swap.py"
    script.write_text(_SWAP_AFTER_SCAN)
    for on_error in ("raise", "skip"):
        out = tmp_path / f"out-{on_error}"
        r = subprocess.run([sys.executable, str(script), str(src), str(out), how, fmt,
                            str(workers), on_error], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        if how == "fifo":
            os.unlink(src / "a" / "s3.txt")
        small_tree(tmp_path / "src")  # s3.txt back for the next run
        if on_error == "raise":
            assert r.stdout.startswith("ERROR") and "s3.txt" in r.stdout, r.stdout
            assert "changed since the scan" in r.stdout and "permissions" not in r.stdout
            assert ("not a regular file" if how == "fifo" else "No such file") in r.stdout
            assert not (out / "manifest.json").exists()
        else:
            assert r.stdout.split(maxsplit=2)[:2] == ["PACKED", "5"], r.stdout
            assert "'unreadable': 1" in r.stdout


def test_overwrite_with_another_prefix_removes_the_earlier_pack(tmp_path: Path) -> None:
    """``--overwrite --prefix train`` left the earlier pack's ``shard-*`` files beside the new
    ones (verify: extra shards); the user's own tars that ``shardio index`` listed stay."""
    src = small_tree(tmp_path / "src")
    out = tmp_path / "out"
    shardio.pack(src, out, samples_per_shard=2, parity="2+1")
    shardio.pack(src, out, samples_per_shard=3, prefix="train", overwrite=True)
    assert sorted(os.listdir(out)) == ["manifest.json", "train-000000.tar",
                                       "train-000000.tar.idx", "train-000001.tar",
                                       "train-000001.tar.idx"]
    assert shardio.verify_dataset(out) == []
    # An unfinished run of another prefix: its state file names the prefix.
    (out / "train-000000.tar").unlink()
    (out / "manifest.json").unlink()
    (out / ".shardio-pack.json").write_text(json.dumps({"job": "x", "options": "y",
                                                        "prefix": "train"}))
    shardio.pack(src, out, samples_per_shard=6, prefix="all", overwrite=True)
    assert sorted(os.listdir(out)) == ["all-000000.tar", "all-000000.tar.idx", "manifest.json"]
    # Tars indexed in place are the user's: an overwrite by a pack keeps them.
    user = tmp_path / "user"
    user.mkdir()
    with tarfile.open(user / "mine.tar", "w") as tf:
        tf.add(src / "a" / "s0.txt", arcname="k0.txt")
    rc = subprocess.run([sys.executable, "-m", "shardio", "index", str(user / "mine.tar")],
                        capture_output=True, text=True, timeout=120)
    assert rc.returncode == 0, rc.stderr
    shardio.pack(src, user, samples_per_shard=6, overwrite=True)
    assert (user / "mine.tar").exists() and (user / "shard-000000.tar").exists()


def test_a_rerun_writes_the_lost_shards_of_a_finished_pack(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A finished pack with a shard deleted since reported "packed ... into 2 shards" on a rerun
    and left the dataset broken; now the rerun writes what is missing, like a resume."""
    src = small_tree(tmp_path / "src")
    out = tmp_path / "out"
    shardio.pack(src, out, samples_per_shard=3)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    stamps = {n: os.stat(out / n).st_mtime_ns for n in before}
    shardio.pack(src, out, samples_per_shard=3, resume=True)  # finished: nothing to do
    assert {n: os.stat(out / n).st_mtime_ns for n in before} == stamps
    (out / "shard-000001.tar").unlink()
    with open(out / "shard-000000.tar", "r+b") as f:  # and one cut short
        f.truncate(1024)
    with caplog.at_level("WARNING", logger="shardio.pack"):
        shardio.pack(src, out, samples_per_shard=3)
    assert "shard-000000.tar, shard-000001.tar, which are missing" in caplog.text
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    assert shardio.verify_dataset(out) == []


@pytest.mark.parametrize("kw", [{"samples_per_shard": "3"}, {"samples_per_shard": True},
                                {"samples_per_shard": 2.5}, {"workers": True}])
def test_pack_options_of_the_wrong_type_are_usage_errors(tmp_path: Path,
                                                         kw: dict[str, Any]) -> None:
    src = small_tree(tmp_path / "src")
    with pytest.raises(UsageError, match="must be an integer >= 1"):
        shardio.pack(src, tmp_path / "out", **{"shard_size": "1MB", **kw})
    assert not (tmp_path / "out").exists()


def test_pack_workers_wait_on_descriptors_past_select_limit() -> None:
    """``--workers 600`` failed with "filedescriptor out of range in select()": the pool's
    pipes were numbered past 1024."""
    import resource

    from shardio._packpool import _wait_readable

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"the hard limit on descriptors is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    r, w = os.pipe()
    high = 1100
    try:
        os.dup2(r, high)
        os.write(w, b"x")
        _wait_readable([high])  # returns: the byte is there
        assert os.read(high, 1) == b"x"
    finally:
        for fd in (r, w, high):
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
