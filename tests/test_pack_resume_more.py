"""Resume corners of ``shardio pack``: what a rerun keeps, counts, checks and cleans up.

* a kept shard still counts the files ``--on-error skip`` left out of it, so the resumed
  manifest is the uninterrupted one (a real SIGKILL, a real privilege drop for the unreadable
  file), and a rerun with ``on_error="raise"`` does not keep such a shard;
* a kept HDF5 shard is checked against the whole-file digest recorded when it was written;
* a rerun after the input shrank deletes the shards beyond its plan;
* the temp files of a run killed while it wrote ``--parity`` are removed (a real SIGKILL);
* the rerun with ``--on-error skip`` that a bad-input error suggests resumes the stopped run.

Every child process has a timeout and its output is printed (``run_child``).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

import shardio
from shardio.errors import BrokenSymlinkError
from shardio.manifest import Manifest
from shardio.verify import verify_dataset
from tests.test_pack import file_bytes, run_child, temp_files, write_files

_XATTR = "user.shardio.digest"

# A pack in a child process: argv is SRC OUT KILL OPTIONS-JSON.  KILL is "none", "shard:N" (the
# child SIGKILLs itself as it starts writing shard N, so shards 0..N-1 are published) or
# "parity" (it SIGKILLs itself while the first parity group is written, its temp files open).
# As root it drops to nobody (65534) first, so a chmod 000 file is unreadable.
_CHILD = r"""
import json, os, signal, sys

import shardio
import shardio.formats.hdf5  # import as root: python and the venv need not be readable by nobody
from shardio import packer, parity
from shardio.errors import ShardioError

shardio.formats.hdf5._h5py()
try:
    import zfec  # noqa: F401
except ImportError:
    pass
src, out, kill, options = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
if os.geteuid() == 0:
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


if kill.startswith("shard:"):
    real_shard = packer._pack_shard

    def write_shard(task, *args):
        if task.number == int(kill[6:]):
            die()
        return real_shard(task, *args)

    packer._pack_shard = write_shard
elif kill == "parity":
    parity._pread_padded = lambda *args: die()
try:
    m = shardio.pack(src, out, **options)
except ShardioError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
else:
    print(json.dumps({"manifest": m.to_dict()}))
"""


def _child_pack(src: Path, out: Path, kill: str = "none", **options: Any) -> dict[str, Any]:
    """Run ``_CHILD``; its result, or ``{"killed": True}`` when it SIGKILLed itself."""
    proc = run_child(["-c", _CHILD, str(src), str(out), kill, json.dumps(options)], timeout=90)
    if kill != "none":
        assert proc.returncode == -signal.SIGKILL
        return {"killed": True}
    assert proc.returncode == 0
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _identities(out: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    return {n: ((out / n).stat().st_ino, (out / n).stat().st_mtime_ns) for n in names}


def _tree(root: Path, n: int = 12) -> Path:
    return write_files(root, {f"a/s{i:03d}.txt": f"sample {i}\n".encode() * (20 + i)
                              for i in range(n)})


def _unreadable_tree(world_tmp: Path) -> Path:
    """12 samples, 2 per shard; ``a/s002`` (in shard 1) cannot be read by the pack's user."""
    src = _tree(world_tmp / "src")
    bad = src / "a" / "s002.txt"
    os.chmod(bad, 0)
    if os.geteuid() != 0 and os.access(bad, os.R_OK):
        pytest.skip("chmod 000 does not block reads here")
    return src


# --- 1. kept shards count the files they skipped ----------------------------------------------


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_resumed_skip_counts_match_an_uninterrupted_pack(world_tmp: Path, fmt: str) -> None:
    src = _unreadable_tree(world_tmp)
    opts = {"format": fmt, "samples_per_shard": 2, "on_error": "skip", "fsync": False}
    clean = _child_pack(src, world_tmp / "clean", **opts)["manifest"]
    assert clean["stats"]["skipped"] == {"unreadable": 1}

    out = world_tmp / "out"
    _child_pack(src, out, "shard:4", **opts)  # shards 0..3 published, shard 1 skipped s002
    suffix = ".tar" if fmt == "tar" else ".h5"
    finished = [f"shard-{n:06d}{suffix}" for n in range(4)]
    assert not (out / "manifest.json").exists()
    before = _identities(out, finished)

    resumed = _child_pack(src, out, **opts)["manifest"]
    assert _identities(out, finished) == before, "a finished shard was rewritten"
    assert resumed["stats"]["skipped"] == {"unreadable": 1}
    assert resumed == clean
    assert file_bytes(out) == file_bytes(world_tmp / "clean")


def test_raise_rerun_does_not_keep_a_shard_that_skipped_files(world_tmp: Path) -> None:
    # on_error is not in the job fingerprint, so this rerun resumes the skip run; but a shard
    # that left a file out is not what a raise run writes: it is redone, and the file raises.
    src = _unreadable_tree(world_tmp)
    opts: dict[str, Any] = {"samples_per_shard": 2, "fsync": False}
    out = world_tmp / "out"
    _child_pack(src, out, "shard:4", on_error="skip", **opts)
    res = _child_pack(src, out, on_error="raise", **opts)
    assert res.get("error") == "UnreadableFileError" and "s002.txt" in res["message"]
    assert not (out / "manifest.json").exists()

    skip = _child_pack(src, out, on_error="skip", **opts)["manifest"]
    clean = _child_pack(src, world_tmp / "clean", on_error="skip", **opts)["manifest"]
    assert skip == clean and skip["stats"]["skipped"] == {"unreadable": 1}
    # Complete now, with a skip: a raise rerun may not pass it off as its own.
    res = _child_pack(src, out, on_error="raise", **opts)
    assert res.get("error") == "OutputNotEmptyError"
    assert "--on-error skip" in res["message"] and "--overwrite" in res["message"]
    assert json.loads((out / "manifest.json").read_text()) == clean


# --- 2. kept HDF5 shards are checked against their recorded digest ----------------------------


def _stopped_by_late_symlink(src: Path, out: Path, **options: Any) -> list[str]:
    """Pack ``src`` with a broken symlink that sorts last: the streaming pack publishes its
    first shards, then stops with no manifest.  Returns the shard files it published."""
    (src / "z").mkdir()
    os.symlink("gone.txt", src / "z" / "late.txt")
    with pytest.raises(BrokenSymlinkError):
        shardio.pack(src, out, **options)
    assert not (out / "manifest.json").exists()
    return sorted(n for n in os.listdir(out) if n.startswith("shard-") and not n.endswith(".idx"))


def test_hdf5_resume_checks_kept_shards_against_their_recorded_digest(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.write_bytes(b"")
    try:
        os.setxattr(probe, "user.probe", b"1")
    except OSError as exc:
        pytest.skip(f"no user xattrs on {tmp_path}: {exc}")
    src = _tree(tmp_path / "src")
    out = tmp_path / "out"
    opts = {"format": "hdf5", "samples_per_shard": 2, "fsync": False}
    published = _stopped_by_late_symlink(src, out, **opts)
    assert published == [f"shard-{n:06d}.h5" for n in range(5)]
    for name in published:
        algorithm, _digest, size = os.getxattr(out / name, _XATTR).decode().split(":")
        assert (algorithm, int(size)) == ("xxh3_128", (out / name).stat().st_size)

    # 0: a byte appended, outside anything the in-shard index covers (h5py still opens it);
    # 1: its recorded digest is gone, as on a filesystem without user xattrs;
    # 2: the record is garbage;  3: a bit flipped in /index/key_blob;  4: intact, kept.
    with open(out / published[0], "ab") as f:
        f.write(b"\0")
    os.removexattr(out / published[1], _XATTR)
    os.setxattr(out / published[2], _XATTR, b"xxh3_128:not-a-digest")
    data = bytearray((out / published[3]).read_bytes())
    at = data.find(b"a/s006a/s007")
    assert at >= 0
    data[at + 11] ^= 0x01
    (out / published[3]).write_bytes(bytes(data))
    before = _identities(out, published)

    (src / "z" / "late.txt").unlink()
    shardio.pack(src, out, **opts)
    after = _identities(out, published)
    assert [after[n] != before[n] for n in published] == [True] * 4 + [False]
    assert verify_dataset(out) == []
    clean = tmp_path / "clean"
    shardio.pack(src, clean, **opts)
    assert file_bytes(out) == file_bytes(clean)


# --- 3. a rerun after the input shrank --------------------------------------------------------


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_resume_after_the_input_shrank_deletes_shards_beyond_the_plan(tmp_path: Path,
                                                                      fmt: str) -> None:
    src = _tree(tmp_path / "src")
    out = tmp_path / "out"
    opts = {"format": fmt, "samples_per_shard": 2, "fsync": False}
    assert len(_stopped_by_late_symlink(src, out, **opts)) == 5
    (out / "shard-000007.tar.orig").write_bytes(b"not shardio's")  # not a name it writes
    (src / "z" / "late.txt").unlink()
    for i in range(6, 12):
        (src / "a" / f"s{i:03d}.txt").unlink()

    m = shardio.pack(src, out, **opts)
    assert len(m.shards) == 3
    assert verify_dataset(out) == []
    clean = tmp_path / "clean"
    shardio.pack(src, clean, **opts)
    got = file_bytes(out)
    assert got.pop("shard-000007.tar.orig") == b"not shardio's"
    assert got == file_bytes(clean)


@pytest.mark.parametrize("resume", [False, True])
def test_a_stopped_pack_resumes_after_an_input_file_changed(world_tmp: Path, resume: bool) -> None:
    """A pack that had scanned its whole input (here from a file list) and was killed, then one
    file changed: the rerun (plain, or the --resume that FileChangedError recommends) refused
    OUT ("holds no unfinished run of this job") and only --overwrite, rewriting every shard,
    went on.  Now the shards whose files did not change are kept and the others redone."""
    src = _tree(world_tmp / "src")
    lst = world_tmp / "list.txt"
    lst.write_text("".join(f"a/s{i:03d}.txt\n" for i in range(12)))
    out = world_tmp / "out"
    opts = {"samples_per_shard": 2, "fsync": False, "files_from": str(lst)}
    assert _child_pack(src, out, kill="shard:4", **opts) == {"killed": True}
    before = _identities(out, [f"shard-{n:06d}.tar" for n in range(4)])
    with open(src / "a" / "s003.txt", "ab") as f:  # a file of shard 1
        f.write(b"changed\n")

    m = shardio.pack(src, out, resume=resume, **opts)
    after = _identities(out, list(before))
    assert [n for n in before if after[n] == before[n]] == [
        "shard-000000.tar", "shard-000002.tar", "shard-000003.tar"]
    assert verify_dataset(out) == []
    clean = world_tmp / "clean"
    assert m.to_dict() == shardio.pack(src, clean, **opts).to_dict()
    assert file_bytes(out) == file_bytes(clean)


# --- 4. a run killed while writing parity -----------------------------------------------------


def test_parity_temp_files_of_a_killed_run_are_removed(world_tmp: Path) -> None:
    pytest.importorskip("zfec")
    src = _tree(world_tmp / "src")
    out = world_tmp / "out"
    opts = {"samples_per_shard": 2, "parity": "2+1", "fsync": False}
    _child_pack(src, out, "parity", **opts)
    assert not (out / "manifest.json").exists()
    left = temp_files(out / "parity")
    assert left, "the kill should have left the parity writer's temp files"

    m = _child_pack(src, out, **opts)["manifest"]
    assert temp_files(out) == []
    assert verify_dataset(out) == []
    clean = _child_pack(src, world_tmp / "clean", **opts)["manifest"]
    assert m == clean
    assert file_bytes(out / "parity") == file_bytes(world_tmp / "clean" / "parity")


# --- 5. on_error is not part of the job -------------------------------------------------------


@pytest.mark.parametrize("resume", [False, True])
def test_rerun_with_on_error_skip_resumes_the_stopped_run(tmp_path: Path, resume: bool) -> None:
    # The error says "or pass --on-error skip": doing so keeps what the stopped run published.
    src = _tree(tmp_path / "src")
    out = tmp_path / "out"
    published = _stopped_by_late_symlink(src, out, samples_per_shard=2, fsync=False)
    assert len(published) == 5
    before = _identities(out, published)

    m = shardio.pack(src, out, samples_per_shard=2, fsync=False, on_error="skip", resume=resume)
    assert _identities(out, published) == before, "a finished shard was rewritten"
    assert m.stats["skipped"] == {"broken_symlink": 1}
    clean = tmp_path / "clean"
    fresh = shardio.pack(src, clean, samples_per_shard=2, fsync=False, on_error="skip")
    assert m.to_dict() == fresh.to_dict()
    assert file_bytes(out) == file_bytes(clean)


def test_completed_pack_and_the_other_on_error_policy(tmp_path: Path) -> None:
    # A raise pack rerun with skip is the same job, already complete: nothing is rewritten.
    src = _tree(tmp_path / "src", 6)
    out = tmp_path / "out"
    m = shardio.pack(src, out, samples_per_shard=2)
    before = _identities(out, os.listdir(out))
    again = shardio.pack(src, out, samples_per_shard=2, on_error="skip")
    assert again.to_dict() == m.to_dict()
    assert _identities(out, os.listdir(out)) == before

    # A skip pack that left a file out of the scan: a raise rerun stops at that file.
    os.symlink("gone.txt", src / "a" / "zz.txt")
    out2 = tmp_path / "out2"
    skipped = shardio.pack(src, out2, samples_per_shard=2, on_error="skip")
    assert skipped.stats["skipped"] == {"broken_symlink": 1}
    with pytest.raises(BrokenSymlinkError):
        shardio.pack(src, out2, samples_per_shard=2)
    assert Manifest.load(str(out2)).to_dict() == skipped.to_dict()


def test_shard_names_the_packer_owns() -> None:
    """One matcher decides which files are shards of a prefix, for --overwrite and for the
    stale-shard sweep alike (--overwrite once missed shards numbered 1,000,000 and up)."""
    from shardio.packstate import _ours, _shard_number

    assert _shard_number("shard-000001.tar", "shard") == 1
    assert _shard_number("shard-1234567.tar.idx", "shard") == 1234567
    assert _shard_number("shard-000002.h5", "shard") == 2
    for other in ("shard-0000001.tar", "shard-000007.tar.orig", "shard-12.tar", "x-000001.tar"):
        assert _shard_number(other, "shard") is None
    assert _ours("shard-1234567.tar", "shard") and not _ours("notes.txt", "shard")
