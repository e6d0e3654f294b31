"""Multi-node pack: ``shardio pack --part I/N`` in concurrent processes, then ``shardio merge``.

The contract under test: the parts of one job, run as separate processes into one OUT, then
merged, leave OUT byte for byte what a single-process ``shardio pack`` of the same input and
options leaves (shards, indexes, dictionary, parity and the manifest), for any N; merge refuses
every incomplete or inconsistent set of parts with a typed error that names the fix; a part
killed mid-way resumes, keeping the shards it had finished.  Every child process has a timeout
and its output is printed, so a failure shows it.
"""

from __future__ import annotations

import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

import shardio
from shardio import parts
from shardio.errors import (
    ManifestError,
    ManifestNotFoundError,
    OutputNotEmptyError,
    ShardCorruptError,
    ShardNotFoundError,
    UsageError,
)
from shardio.manifest import Manifest
from shardio.parts import PartResult, split_plan
from tests.test_pack import ROOT, _env, _show, random_tree, temp_files, write_files

Cli = Callable[..., tuple[int, str, str]]
CHILD_TIMEOUT = 60
SINGLE_ARGS = ["--samples-per-shard", "7", "--label-from-dir"]
# The same options in-process (the CLI drops its 256MB shard size when --samples-per-shard is
# given; the library keeps it, and the shard size is part of the job).
KW = {"samples_per_shard": 7, "label_from_dir": True, "shard_size": None}


# --- helpers ---------------------------------------------------------------------------------


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (hidden ones too), by relative path."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def identities(root: Path, names: list[str]) -> dict[str, tuple[int, int]]:
    return {n: ((root / n).stat().st_ino, (root / n).stat().st_mtime_ns) for n in names}


def part_cmd(src: Path, out: Path, part: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "shardio", "pack", str(src), str(out), *args, "--part", part]


def run_parts(src: Path, out: Path, n: int, args: list[str],
              envs: list[dict[str, str]] | None = None, auto: bool = False,
              only: tuple[int, ...] | None = None) -> list[str]:
    """Run the parts (all ``n``, or ``only`` these) as concurrent processes into ``out``;
    returns their stdouts."""
    procs = []
    for i in only if only is not None else range(n):
        env = {**_env(), **(envs[i] if envs else {})}
        cmd = part_cmd(src, out, "auto" if auto else f"{i}/{n}", args)
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                            text=True, cwd=ROOT, env=env)))
    outs = []
    try:
        for cmd, p in procs:
            stdout, err = p.communicate(timeout=CHILD_TIMEOUT)
            _show(cmd, p.returncode, stdout, err)
            assert p.returncode == 0, err
            outs.append(stdout)
    finally:
        for _cmd, p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate(timeout=30)
    return outs


def single_pack(cli: Cli, src: Path, out: Path, args: list[str]) -> dict[str, bytes]:
    rc, _, err = cli("pack", src, out, *args)
    assert rc == 0, err
    return tree_bytes(out)


def part_files(out: Path) -> list[str]:
    """The part records (``.shardio-part-*``) and part state files (``.shardio-pack-*``)."""
    return sorted(n for n in os.listdir(out) if n.startswith((".shardio-part-", ".shardio-pack")))


def json_tree(root: Path) -> Path:
    """Small similar JSON records: what a zstd dictionary is for."""
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]
    return write_files(root, {f"r{i % 4}/{i:04d}.json": json.dumps({
        "id": i, "user": f"user_{rng.randint(0, 50)}", "tags": rng.sample(words, 3),
        "caption": " ".join(rng.choice(words) for _ in range(8))}, indent=1).encode()
        for i in range(240)})


@pytest.fixture
def three_parts(image_tree: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``image_tree`` packed as 3 parts (in-process, one after another), not merged yet."""
    out = tmp_path / "parts"
    for i in range(3):
        r = shardio.pack(image_tree, out, **KW, part=(i, 3))
        assert isinstance(r, PartResult) and r.record and not r.merged
    return image_tree, out



# --- 1. merged parts == single-process pack ------------------------------------------------


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("case", ["tar", "hdf5", "zstd-dict-parity"])
def test_parts_merge_to_the_single_pack(cli: Cli, image_tree: Path, mixed_tree: Path,
                                        tmp_path: Path, case: str, n: int) -> None:
    src, args = {
        "tar": (image_tree, SINGLE_ARGS),
        "hdf5": (mixed_tree, ["--format", "hdf5", "--samples-per-shard", "6"]),
        "zstd-dict-parity": (json_tree(tmp_path / "json"),
                             ["--compress", "zstd", "--zstd-dict", "--shard-size", "60KB",
                              "--parity", "2+1"]),
    }[case]
    want = single_pack(cli, src, tmp_path / "single", args)
    out = tmp_path / "out"
    if n == 1:
        rc, stdout, err = cli("pack", src, out, *args, "--part", "0/1")
        assert rc == 0, err
        outs = [stdout]
    else:
        outs = run_parts(src, out, n, args)
    for i, stdout in enumerate(outs):
        assert re.search(rf"^part {i}/{n}: wrote shards \d+\.\.\d+ of \d+ ", stdout, re.MULTILINE), stdout
        assert f"run: shardio merge {out}" in stdout
    assert not (out / "manifest.json").exists()  # a part never publishes the manifest
    assert part_files(out) == [f".shardio-{kind}-{i:04d}-of-{n:04d}.json"
                               for kind in ("pack", "part") for i in range(n)]
    rc, stdout, err = cli("merge", out)
    assert rc == 0, err
    assert f"manifest: {out / 'manifest.json'}" in stdout
    assert tree_bytes(out) == want  # every file, the manifest included; no part files left
    assert cli("verify", out)[0] == 0


def test_overwrite_parts_never_keep_a_shard_compressed_with_another_dictionary(
        cli: Cli, tmp_path: Path) -> None:
    """A --zstd-dict dataset, its input partly changed, repacked as parts with --overwrite:
    each part keeps the other job's shards whose samples did not change (their owner decides),
    but the job trains a new dictionary, so those shards no longer decoded (merge and the parts
    exited 0, verify found "Dictionary mismatch").  A shard's fingerprint now covers the
    dictionary."""
    rng = random.Random(0)
    src = write_files(tmp_path / "src", {
        f"c{i % 3}/s{i:04d}.txt": (f"hello world {i} " * rng.randint(5, 60)).encode()
        for i in range(200)})
    args = ["--compress", "zstd", "--zstd-dict", "--shard-size", "16KB"]
    out = tmp_path / "out"
    single_pack(cli, src, out, args)
    dictionary = (out / "zstd.dict").read_bytes()
    for i in range(150, 200):  # the last quarter of the samples changes
        (src / f"c{i % 3}" / f"s{i:04d}.txt").write_text(" ".join(
            rng.choice(["zebra", "quartz", "vortex", "glyph"]) for _ in range(200)))
    want = single_pack(cli, src, tmp_path / "fresh", args)
    for i in range(3):
        rc, _out, err = cli("pack", src, out, *args, "--overwrite", "--part", f"{i}/3")
        assert rc == 0, err
    rc, _out, err = cli("merge", out)
    assert rc == 0, err
    assert (out / "zstd.dict").read_bytes() != dictionary  # (the case at hand)
    assert cli("verify", out)[0] == 0
    assert tree_bytes(out) == want


def test_parts_with_files_from_and_skips(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    # Every part reads the same list; the scan's skip counts reach the merged manifest once.
    os.symlink("gone.jpg", image_tree / "class_000" / "broken.jpg")
    files = sorted(str(p.relative_to(image_tree)) for p in image_tree.rglob("img*.jpg"))[5:50]
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join([*files, "class_000/broken.jpg"]) + "\n")
    args = ["--files-from", lst, "--samples-per-shard", "4", "--on-error", "skip"]
    for i in range(2):
        rc, _, err = cli("pack", image_tree, tmp_path / "out", *args, "--part", f"{i}/2")
        assert rc == 0, err
    m = shardio.merge(tmp_path / "out")
    assert m.stats["skipped"] == {"broken_symlink": 1} and m.num_samples == 45
    assert tree_bytes(tmp_path / "out") == single_pack(cli, image_tree, tmp_path / "single", args)


def test_part_auto_from_slurm_variables(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    want = single_pack(cli, image_tree, tmp_path / "single", SINGLE_ARGS)
    out = tmp_path / "out"
    envs = [{"SLURM_PROCID": str(i), "SLURM_NTASKS": "3"} for i in range(3)]
    outs = run_parts(image_tree, out, 3, SINGLE_ARGS, envs=envs, auto=True)
    assert [o.split(":")[0] for o in outs] == ["part 0/3", "part 1/3", "part 2/3"]
    assert part_files(out) == [f".shardio-{kind}-{i:04d}-of-0003.json"
                               for kind in ("pack", "part") for i in range(3)]
    assert shardio.merge(out).to_json() == (tmp_path / "single" / "manifest.json").read_bytes()
    assert tree_bytes(out) == want


def test_part_auto_from_torchrun_variables(image_tree: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    r = shardio.pack(image_tree, tmp_path / "out", samples_per_shard=7, part="auto")
    assert isinstance(r, PartResult) and (r.part, r.parts) == (1, 2)
    assert r.shards == [f"shard-{i:06d}.tar" for i in range(r.first, r.stop)]


@pytest.mark.parametrize("env,want", [
    # mpirun inside a Slurm allocation: the batch step's SLURM_* reach every rank (each then
    # packed the whole job as part 0/1)
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "SLURM_PROCID": "0",
      "SLURM_NTASKS": "1"}, (2, 4)),
    # local ranks choose no part (this was "invalid topology: local rank 3 of 2")
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "3", "SLURM_LOCALID": "3",
      "SLURM_NTASKS_PER_NODE": "2"}, (1, 3)),
    ({"RANK": "1", "WORLD_SIZE": ""}, "WORLD_SIZE='' is not a number"),  # was a ValueError
    ({"RANK": "3", "WORLD_SIZE": "2"}, "rank 3 of world size 2"),
])
def test_part_auto_reads_the_launchers_rank(image_tree: Path, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            env: dict[str, str], want: Any) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID",
                 "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE",
                 "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if isinstance(want, str):
        with pytest.raises(UsageError, match=re.escape(want)):
            shardio.pack(image_tree, tmp_path / "out", samples_per_shard=7, part="auto")
        return
    r = shardio.pack(image_tree, tmp_path / "out", samples_per_shard=7, part="auto")
    assert isinstance(r, PartResult) and (r.part, r.parts) == want


# --- 2. merge refuses what is not one whole job ----------------------------------------------


def test_merge_missing_part_names_it_and_its_command(cli: Cli, image_tree: Path,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "out"
    for i in (0, 2):
        shardio.pack(image_tree, out, **KW, part=(i, 3))
    with pytest.raises(ManifestNotFoundError) as ei:
        shardio.merge(out)
    msg = str(ei.value)
    assert "part(s) 1 of 3 have not finished" in msg and ".shardio-part-0001-of-0003.json" in msg
    assert not (out / "manifest.json").exists()
    rc, _, err = cli("merge", out)
    assert rc == 1 and "ManifestNotFoundError" in err
    # The command in the message is the one to run: it packs the missing part of the same job.
    cmd = re.search(r"shardio pack .*?--part 1/3", msg)
    assert cmd, msg
    rc, _, err = cli(*shlex.split(cmd.group(0))[1:])
    assert rc == 0, err
    shardio.merge(out)
    assert tree_bytes(out) == single_pack(cli, image_tree, tmp_path / "single", SINGLE_ARGS)


def test_a_merge_killed_while_removing_the_records_can_be_finished(
        three_parts: tuple[Path, Path], tmp_path: Path) -> None:
    """Killed after publishing the manifest and removing one part record: every merge then
    asked for the missing part ("part(s) 0 of 3 have not finished"), and the rerun of that part
    said the job was merged and wrote no record, so the job could never be merged again."""
    _src, out = three_parts
    records = {p.name: p.read_bytes() for p in out.glob(".shardio-part-*")}
    m = shardio.merge(out)
    for name in sorted(records)[1:]:  # the record of part 0 was removed first
        (out / name).write_bytes(records[name])
    again = shardio.merge(out)
    assert again.to_dict() == m.to_dict()
    assert not list(out.glob(".shardio-part-*"))


def test_merge_refuses_duplicated_part(three_parts: tuple[Path, Path]) -> None:
    _src, out = three_parts
    shutil.copy(out / ".shardio-part-0000-of-0003.json", out / ".shardio-part-0001-of-0003.json")
    with pytest.raises(ManifestError) as ei:
        shardio.merge(out)
    msg = str(ei.value)
    assert "all claim to be part 0 of 3" in msg
    assert ".shardio-part-0000-of-0003.json" in msg and ".shardio-part-0001-of-0003.json" in msg
    assert not (out / "manifest.json").exists()


def test_merge_refuses_part_of_another_job(three_parts: tuple[Path, Path],
                                           tmp_path: Path) -> None:
    src, out = three_parts
    other = tmp_path / "other"
    shardio.pack(src, other, samples_per_shard=6, label_from_dir=True, part=(2, 3))
    shutil.copy(other / ".shardio-part-0002-of-0003.json", out / ".shardio-part-0002-of-0003.json")
    with pytest.raises(ManifestError) as ei:
        shardio.merge(out)
    msg = str(ei.value)
    assert "different pack jobs" in msg
    # The odd record out is named first.
    assert msg.index(".shardio-part-0002-of-0003.json") < msg.index(".shardio-part-0000")
    assert not (out / "manifest.json").exists()
    # A part of another job cannot even start in this OUT without --overwrite.
    with pytest.raises(OutputNotEmptyError):
        shardio.pack(src, out, samples_per_shard=6, label_from_dir=True, part=(2, 3))


def test_merge_refuses_parts_of_different_n(three_parts: tuple[Path, Path]) -> None:
    src, out = three_parts
    # Same job, another N: accepted by pack (its shards are already there), refused by merge.
    r = shardio.pack(src, out, **KW, part=(0, 2))
    assert isinstance(r, PartResult) and r.kept == r.stop - r.first > 0
    with pytest.raises(ManifestError) as ei:
        shardio.merge(out)
    assert "disagree on the number of parts" in str(ei.value)
    assert ".shardio-part-0000-of-0002.json" in str(ei.value)


def test_merge_refuses_gap_in_shard_ranges(three_parts: tuple[Path, Path]) -> None:
    _src, out = three_parts
    path = out / ".shardio-part-0001-of-0003.json"
    doc = json.loads(path.read_text())
    del doc["record_digest"]
    doc["first"] += 1
    doc["shards"] = doc["shards"][1:]
    path.write_bytes(parts._record_bytes(doc))  # a consistent, signed, but wrong record
    with pytest.raises(ManifestError, match=r"part 1 of 3 .* \(a gap\)"):
        shardio.merge(out)
    path.write_text(path.read_text().replace('"first": ', '"first": 1'))  # edited by hand
    with pytest.raises(ManifestError, match="fails its own digest"):
        shardio.merge(out)


def test_merge_refuses_missing_or_damaged_shard(cli: Cli, three_parts: tuple[Path, Path],
                                                tmp_path: Path) -> None:
    src, out = three_parts
    doc = json.loads((out / ".shardio-part-0001-of-0003.json").read_text())
    victim = doc["shards"][0]["path"]
    os.unlink(out / victim)
    with pytest.raises(ShardNotFoundError) as ei:
        shardio.merge(out)
    msg = str(ei.value)
    assert victim in msg and "part 1 of 3" in msg and "--part 1/3" in msg and "is missing" in msg
    rc, _, err = cli("merge", out)
    assert rc == 1 and "ShardNotFoundError" in err
    shardio.pack(src, out, **KW, part=(1, 3))

    # A shard damaged after its part finished: the size check, then the --verify digest check.
    other = doc["shards"][1]["path"]
    with open(out / other, "r+b") as f:
        f.seek(600)
        b = f.read(1)
        f.seek(600)
        f.write(bytes([b[0] ^ 1]))
    rc, _, err = cli("merge", out, "--verify")
    assert rc == 1 and "ShardCorruptError" in err and other in err
    with open(out / other, "ab") as f:
        f.write(b"x")
    with pytest.raises(ShardCorruptError, match="bytes, but part 1 of 3 wrote"):
        shardio.merge(out)
    assert not (out / "manifest.json").exists()
    shardio.pack(src, out, **KW, part=(1, 3))
    assert cli("merge", out, "--verify")[0] == 0
    assert tree_bytes(out) == single_pack(cli, src, tmp_path / "single", SINGLE_ARGS)


def test_merge_without_parts_and_merge_again(cli: Cli, three_parts: tuple[Path, Path],
                                             tmp_path: Path) -> None:
    src, out = three_parts
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ManifestNotFoundError, match="holds no part records and no manifest"):
        shardio.merge(empty)
    rc, _, err = cli("merge", tmp_path / "missing")
    assert rc == 2 and "is not a directory" in err

    m = shardio.merge(out)
    before = identities(out, os.listdir(out))
    assert shardio.merge(out).to_json() == m.to_json()  # a no-op
    # A part rerun after the merge finds the job merged and changes nothing.
    r = shardio.pack(src, out, **KW, part=(1, 3))
    assert isinstance(r, PartResult) and r.merged and r.record is None
    rc, stdout, _ = cli("pack", src, out, *SINGLE_ARGS, "--part", "2/3")
    assert rc == 0 and "already merged" in stdout
    assert identities(out, os.listdir(out)) == before


# --- 3. a killed part resumes; concurrent parts and --overwrite -------------------------------

KILL_FILES, KILL_PER_SHARD = 1800, 2
KILL_ARGS = ["--samples-per-shard", str(KILL_PER_SHARD), "--no-fsync"]


def test_killed_part_resumes_keeping_finished_shards(cli: Cli, tmp_path: Path) -> None:
    src = random_tree(tmp_path / "src", KILL_FILES, 200, 2500, dirs=8)
    out = tmp_path / "out"
    out.mkdir()
    cmd = part_cmd(src, out, "1/3", KILL_ARGS)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env=_env())
    try:
        end = time.monotonic() + CHILD_TIMEOUT
        while len([n for n in os.listdir(out) if n.endswith(".idx")]) < 20:
            if proc.poll() is not None:
                pytest.fail("part 1 ended before it could be killed; grow KILL_FILES")
            if time.monotonic() > end:
                pytest.fail("part 1 published no 20 shards in time")
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        _show(cmd, proc.wait(timeout=30), *proc.communicate(timeout=30))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    finished = [n for n in os.listdir(out) if n.endswith(".idx")]
    finished += [n[: -len(".idx")] for n in finished]
    kept = identities(out, finished)

    run_parts(src, out, 3, KILL_ARGS, only=(0, 2))
    with pytest.raises(ManifestNotFoundError) as ei:  # merge before every part finished
        shardio.merge(out)
    assert "part(s) 1 of 3 have not finished" in str(ei.value) and "started" in str(ei.value)

    rc, stdout, err = cli("pack", src, out, *KILL_ARGS, "--part", "1/3")
    assert rc == 0, err
    m = re.search(r"kept (\d+) finished earlier", stdout)
    assert m and int(m.group(1)) >= 20, stdout
    assert identities(out, finished) == kept  # not rewritten
    assert temp_files(out) == []
    shardio.merge(out)
    assert tree_bytes(out) == single_pack(cli, src, tmp_path / "single", KILL_ARGS)


def test_overwrite_replaces_another_job_but_not_this_jobs_parts(
        cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shardio.pack(image_tree, out, samples_per_shard=5)  # another job: 12 shards, 3 beyond ours
    (out / "notes.txt").write_text("mine")
    before = tree_bytes(out)
    rc, _, err = cli("pack", image_tree, out, *SINGLE_ARGS, "--part", "0/3")
    assert rc == 2 and "not empty" in err and "manifest.json" in err and "--overwrite" in err
    assert tree_bytes(out) == before

    # Three concurrent parts, all with --overwrite, as `srun shardio pack ... --overwrite` starts.
    run_parts(image_tree, out, 3, [*SINGLE_ARGS, "--overwrite"])
    assert not (out / "manifest.json").exists() and not (out / "shard-000011.tar").exists()
    # Rerunning one part with --overwrite leaves the other parts' finished work alone.
    others = [n for n in os.listdir(out) if n != "notes.txt" and "-0000-of-0003" not in n]
    ident = identities(out, others)
    rc, _, err = cli("pack", image_tree, out, *SINGLE_ARGS, "--part", "0/3", "--overwrite")
    assert rc == 0, err
    assert identities(out, others) == ident
    shardio.merge(out)
    got = tree_bytes(out)
    assert got.pop("notes.txt") == b"mine"  # only shardio's own files are replaced
    assert got == single_pack(cli, image_tree, tmp_path / "single", SINGLE_ARGS)


# --- 4. the split between parts ---------------------------------------------------------------


def test_split_plan_is_contiguous_and_balanced() -> None:
    rng = random.Random(7)
    for _ in range(300):
        sizes = [rng.randint(0 if rng.random() < 0.1 else 1, 1000)
                 for _ in range(rng.randint(0, 40))]
        parts = rng.randint(1, 8)
        split = split_plan(sizes, parts)
        assert len(split) == parts and split[0][0] == 0 and split[-1][1] == len(sizes)
        assert all(a[1] == b[0] and a[0] <= a[1] for a, b in pairwise(split))
        assert split == split_plan(list(sizes), parts)  # a pure function
        total, biggest = sum(sizes), max(sizes, default=0)
        for a, b in split:
            assert abs(sum(sizes[a:b]) - total / parts) <= biggest, (sizes, parts, split)


def test_parts_balance_by_bytes(cli: Cli, tmp_path: Path) -> None:
    # Skewed sizes: one directory of big files, many of small ones.
    src = random_tree(tmp_path / "src", 120, 200, 3000, dirs=6, seed=2)
    random_tree(src / "big", 20, 20_000, 30_000, dirs=1, seed=3)
    out = tmp_path / "out"
    results = [shardio.pack(src, out, shard_size="40KB", part=(i, 3)) for i in range(3)]
    assert all(isinstance(r, PartResult) for r in results)
    total = sum(r.planned_bytes for r in results)  # type: ignore[union-attr]
    for r in results:
        assert abs(r.planned_bytes - total / 3) <= 40_000, [x.planned_bytes for x in results]  # type: ignore[union-attr]
    shardio.merge(out)
    assert tree_bytes(out) == single_pack(cli, src, tmp_path / "single", ["--shard-size", "40KB"])


def test_more_parts_than_shards(cli: Cli, image_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    results = [shardio.pack(image_tree, out, samples_per_shard=20, shard_size=None,
                            part=(i, 5)) for i in range(5)]
    assert sum(r.stop - r.first for r in results) == 3  # type: ignore[union-attr]
    rc, stdout, _ = cli("pack", image_tree, out, "--samples-per-shard", "20", "--part", "4/5")
    assert rc == 0
    assert "no shards to write" in stdout or "wrote shards" in stdout
    shardio.merge(out)
    assert tree_bytes(out) == single_pack(cli, image_tree, tmp_path / "single",
                                          ["--samples-per-shard", "20"])


@pytest.mark.parametrize("part", ["3/3", "1/0", "0/0", "x", "1/2/3"])
def test_bad_part_is_a_usage_error(cli: Cli, image_tree: Path, tmp_path: Path,
                                   part: str) -> None:
    rc, _, err = cli("pack", image_tree, tmp_path / "out", "--part", part)
    assert rc == 2 and "invalid part" in err and "I/N" in err
    assert not (tmp_path / "out").exists()


def test_part_option_values() -> None:
    from shardio.config import PackOptions
    from shardio.errors import UsageError

    assert PackOptions(part="2/5").part == (2, 5) and PackOptions(part=(0, 1)).part == (0, 1)
    assert PackOptions(part="auto").part == "auto"
    assert "part" not in PackOptions(part="2/5").output_key()  # not in the job fingerprint
    for bad in [(-1, 2), (2, 2), (True, 2), "auto:3"]:
        with pytest.raises(UsageError, match="invalid part"):
            PackOptions(part=bad)  # type: ignore[arg-type]


def test_merge_result_is_a_manifest(three_parts: tuple[Path, Path]) -> None:
    _src, out = three_parts
    m = shardio.merge(out)
    assert isinstance(m, Manifest) and Manifest.load(str(out)).to_json() == m.to_json()
    assert m.num_samples == 60 and part_files(out) == []


def test_parts_of_another_format_over_a_merged_job(cli: Cli, image_tree: Path,
                                                   tmp_path: Path) -> None:
    """Parts repacking OUT as HDF5 with --overwrite (after a tar job): the tar shards inside the
    new plan were left beside the .h5 ones (no part of the new job writes their names), and
    verify listed them as extra files.  The result is the single pack's."""
    out, ref = tmp_path / "out", tmp_path / "ref"
    for i in range(2):
        assert isinstance(shardio.pack(image_tree, out, **KW, part=(i, 2)), PartResult)
    shardio.merge(out)
    assert any(n.endswith(".tar") for n in os.listdir(out))
    for i in range(2):
        shardio.pack(image_tree, out, **KW, format="hdf5", overwrite=True, part=(i, 2))
    shardio.merge(out)
    expected = single_pack(cli, image_tree, ref, [*SINGLE_ARGS, "--format", "hdf5"])
    assert tree_bytes(out) == expected
    assert shardio.verify_dataset(str(out)) == []


def test_parts_with_two_spellings_of_one_compression_merge(image_tree: Path,
                                                          tmp_path: Path) -> None:
    """``zstd`` and ``zstd:3`` are one setting (``none`` and no compression too): parts launched
    with either spelling are one job, merged to the dataset a single pack makes."""
    out, single = tmp_path / "out", tmp_path / "single"
    shardio.pack(image_tree, out, **KW, compress="zstd", part=(0, 2))
    shardio.pack(image_tree, out, **KW, compress="zstd:3", part=(1, 2))
    merged = parts.merge(out)
    shardio.pack(image_tree, single, **KW, compress="zstd")
    assert tree_bytes(out) == tree_bytes(single)
    assert merged.num_samples == Manifest.load(single).num_samples
    none = tmp_path / "none"
    shardio.pack(image_tree, none, **KW, compress="none", part=(0, 2))
    shardio.pack(image_tree, none, **KW, part=(1, 2))
    parts.merge(none)
    shardio.pack(image_tree, tmp_path / "l5", **KW, compress="zstd:5", part=(0, 2))
    with pytest.raises(OutputNotEmptyError, match="no run of this job"):  # another level
        shardio.pack(image_tree, tmp_path / "l5", **KW, compress="zstd", part=(1, 2))
