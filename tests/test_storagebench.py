"""``shardio bench storage`` (shardio.storagebench) on real filesystems with a tiny budget: the
result's shape, cleanup after a normal run, SIGINT and SIGTERM, a full disk (free-space check and
a real ENOSPC mid-run), O_DIRECT refused (ramfs), per-OST figures on the fake Lustre."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import shardio.lustre
from shardio import storagebench as sb
from shardio.errors import UsageError
from tests.conftest import default_sigint
from tests.fake_lfs import EXT4_MAGIC, LL_SUPER_MAGIC, FakeProbe

ROOT = Path(__file__).resolve().parent.parent
TINY = ["--budget", "8MiB", "--time-limit", "3", "--io-sizes", "64KiB,1MiB", "--threads", "1,2"]
TINY_KW: dict[str, Any] = {"budget_bytes": "8MiB", "time_limit_s": 3,
                           "io_sizes": ("64KiB", "1MiB"), "threads": (1, 2)}
CHILD = "import sys, tests.test_storagebench as t; sys.exit(t.cli(*sys.argv[1:]))"


def leftovers(path: Path) -> list[str]:
    return [p.name for p in path.iterdir() if p.name.startswith(sb.TEMP_PREFIX)]


def cli(*argv: str, progress: sb.Progress | None = None) -> int:
    p = argparse.ArgumentParser()
    sb.add_arguments(p)
    return sb.run_cli(p.parse_args(list(argv)), progress=progress)


def mount(where: Path, fstype: str, options: str | None) -> Path:
    where.mkdir()
    cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(where)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a {fstype}: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a {fstype}: {proc.stderr.strip()}")
    return where


def umount(where: Path) -> None:
    if subprocess.run(["umount", str(where)], capture_output=True, timeout=30,
                      check=False).returncode:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30, check=False)


@pytest.fixture
def tmpfs_16m(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs: room for the minimum budget, small enough to fill in a moment."""
    mnt = mount(tmp_path / "t16", "tmpfs", "size=16m")
    try:
        yield mnt
    finally:
        umount(mnt)


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """ramfs refuses O_DIRECT (tmpfs accepts it since Linux 6.6) and reports no size."""
    mnt = mount(tmp_path / "ram", "ramfs", None)
    try:
        yield mnt
    finally:
        umount(mnt)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int, str, dict[str, Any]]:
    """One real run of ``--json`` on a local directory: (dir, rc, stdout, parsed result)."""
    d = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-c", CHILD, str(d), *TINY, "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    return d, proc.returncode, proc.stdout, json.loads(proc.stdout)


def test_result_has_every_section_with_positive_figures(tiny_run: Any) -> None:
    _, rc, out, r = tiny_run
    assert rc == 0 and r["error"] is None
    assert json.loads(json.dumps(r)) == r and out.count("\n") == 1  # one JSON object
    for key in ("path", "fs", "config", "seq_write", "seq_read", "random_read", "metadata",
                "streams", "lustre_osts", "cache_dir", "recommendations", "notes",
                "bytes_written", "elapsed_s", "error"):
        assert key in r, key
    assert 0 < r["bytes_written"] <= 8 << 20
    assert r["elapsed_s"] < 3 + 2
    assert {e["io_size"] for e in r["seq_write"]} == {64 << 10, 1 << 20}
    assert {e["mode"] for e in r["seq_read"]} >= {"page_cache"}
    for e in r["seq_write"] + r["seq_read"] + r["streams"]:
        assert e["bytes"] > 0 and e["seconds"] > 0 and e["mb_per_s"] > 0
    assert {(e["io_size"], e["threads"]) for e in r["random_read"]} == {
        (4096, 1), (4096, 2), (65536, 1), (65536, 2)}
    for e in r["random_read"]:
        assert e["ops"] > 0 and e["iops"] > 0
        p = e["latency_us"]
        assert 0 < p["p50"] <= p["p99"] <= p["p99_9"]
    m = r["metadata"]
    assert 0 < m["files"] <= sb.MAX_META_FILES
    for op in ("create", "stat", "open_close", "unlink"):
        assert m[f"{op}_per_s"] > 0
    assert [e["threads"] for e in r["streams"]] == [1, 2]
    recs = r["recommendations"]
    for key in ("shard_size", "stripe", "workers", "staging_depth"):
        assert recs[key]["reason"], key
    assert recs["shard_size"]["value"] in [1 << k for k in range(26, 33)]
    assert recs["workers"]["value"] in (1, 2)
    assert recs["stripe"]["value"] is None and "not Lustre" in recs["stripe"]["reason"]
    assert any("DONTNEED" in n for n in r["notes"]) and any("fsync" in n for n in r["notes"])
    assert r["lustre_osts"] is None


def test_report_prints_every_table(tiny_run: Any) -> None:
    text = sb.format_report(tiny_run[3])
    for head in ("sequential MB/s", "random reads", "P99.9 us", "metadata", "parallel streams",
                 "recommendations", "shard_size", "workers", "staging_depth", "notes"):
        assert head in text, head


def test_nothing_left_after_a_run(tiny_run: Any) -> None:
    d = tiny_run[0]
    assert leftovers(d) == [] and list(d.iterdir()) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_run_removes_its_directory(tmp_path: Path, sig: int) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), "--budget", "64MiB",
         "--time-limit", "60", "--io-sizes", "64KiB,1MiB", "--threads", "1,2"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 20
        while not leftovers(tmp_path):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the bench never created its directory"
            time.sleep(0.01)
        time.sleep(0.2)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=90)  # a deadline against hangs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted" in err and "Traceback" not in err
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["path", "cache"])
def test_ctrl_c_as_a_temp_dir_is_made_removes_it(tmp_path: Path, where: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that landed as a temp directory was made left it behind, and the bench said
    "temporary files removed": ``mkdtemp`` gives the name only once the directory exists, and
    a signal taken by another thread is not held off by this thread's mask (a CI run of this
    test met that).  The name is now kept before the directory is made.  Here the interrupt
    comes right after the directory exists, before anything returns."""
    data, cache = tmp_path / "d", tmp_path / "cache"
    data.mkdir()
    cache.mkdir()
    real = os.mkdir

    def mkdir(path: Any, *a: Any, **kw: Any) -> None:
        real(path, *a, **kw)
        parent = os.path.dirname(os.fspath(path))
        if parent == str(data if where == "path" else cache) and os.path.basename(
                os.fspath(path)).startswith(sb.TEMP_PREFIX):
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C now

    monkeypatch.setattr(os, "mkdir", mkdir)
    assert cli(str(data), "--budget", "4MiB", "--time-limit", "5", "--io-sizes", "64KiB",
               "--threads", "1", "--no-direct", "--cache-dir", str(cache)) == 130
    assert leftovers(cache) == [] and leftovers(data) == []


def test_budget_over_free_space_names_budget(small_tmpfs: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="--budget"):
        sb.run_storage_bench(small_tmpfs, **{**TINY_KW, "budget_bytes": "64MiB"})
    assert cli(str(small_tmpfs), *TINY, "--budget", "64MiB") == 2
    assert "--budget" in capsys.readouterr().err
    assert list(small_tmpfs.iterdir()) == []


def test_disk_filling_up_mid_run_is_reported(tmpfs_16m: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    """Another writer takes the space after the free-space check: the bench's writes hit a real
    ENOSPC, the run stops with an error line, exit code 1, and its files are gone."""
    filled = []

    def fill(phase: str, message: str) -> None:
        if filled:
            return
        with open(tmpfs_16m / "other-job", "wb") as f:
            try:
                while True:
                    f.write(b"x" * 65536)
                    f.flush()
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                filled.append(phase)

    rc = cli(str(tmpfs_16m), *TINY, "--json", progress=fill)
    cap = capsys.readouterr()
    assert filled == ["seq_write"]
    assert rc == 1, cap.err
    r = json.loads(cap.out)
    assert r["error"].startswith("disk full") and "--budget" in r["error"]
    assert "disk full" in cap.err and "Traceback" not in cap.err
    assert "error: disk full" in sb.format_report(r)
    assert sorted(p.name for p in tmpfs_16m.iterdir()) == ["other-job"]


def test_inodes_running_out_while_files_are_created_keeps_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Another job takes the free inodes after the bench sized its metadata phase by statvfs
    (as a quota statvfs does not see would): the creates meet a real ENOSPC, the metadata
    figures cover the files made, a note says why, and the run goes on (it ended as "disk full
    ... pass a smaller --budget", exit 1, the metadata figures lost)."""
    mnt = mount(tmp_path / "few", "tmpfs", "size=16m,nr_inodes=400")
    try:
        taken = []

        def take_inodes(phase: str, message: str) -> None:
            if phase != "metadata" or taken:
                return
            for i in range(100_000):
                try:
                    (mnt / f"other-{i}").touch()
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
            taken.append(i)
            for p in sorted(mnt.glob("other-*"))[:5]:  # a few left for the bench
                p.unlink()

        rc = cli(str(mnt), *TINY, "--json", progress=take_inodes)
        cap = capsys.readouterr()
        assert taken and rc == 0, cap.err
        r = json.loads(cap.out)
        assert r["error"] is None
        meta = r["metadata"]
        assert 1 <= meta["files"] <= 5 and meta["stopped_early"]
        assert meta["create_per_s"] > 0 and meta["unlink_per_s"] > 0
        assert any("creating files stopped after" in n for n in r["notes"]), r["notes"]
        assert r["streams"], "the phases after the metadata one still ran"
        assert not [p for p in mnt.iterdir() if not p.name.startswith("other-")]
    finally:
        umount(mnt)


def test_o_direct_refused_is_noted(ramfs: Path) -> None:
    r = sb.run_storage_bench(ramfs, **{**TINY_KW, "time_limit_s": 1})
    assert r["error"] is None and r["config"]["direct_used"] is False
    assert any("O_DIRECT refused" in n for n in r["notes"])
    assert {e["mode"] for e in r["seq_read"]} == {"page_cache"}
    assert {e["mode"] for e in r["random_read"] + r["streams"]} == {"page_cache"}
    assert any("in memory" in n for n in r["notes"])  # ramfs is reported as tmpfs kind
    assert "read direct" in sb.format_report(r)
    assert list(ramfs.iterdir()) == []


def fake_lustre(monkeypatch: pytest.MonkeyPatch, root: Path, cls: type = FakeProbe) -> FakeProbe:
    probe = cls({"/": EXT4_MAGIC, os.path.realpath(root): LL_SUPER_MAGIC}, "", n_osts=4)
    monkeypatch.setattr(shardio.lustre, "FsProbe", lambda: probe)
    return probe


def test_lustre_measures_each_ost(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-OST figures on the fake Lustre, and the node-local cache compared for staging."""
    root, cache = tmp_path / "lustre", tmp_path / "nvme"
    root.mkdir()
    cache.mkdir()
    probe = fake_lustre(monkeypatch, root)
    r = sb.run_storage_bench(root, **{**TINY_KW, "time_limit_s": 2}, cache_dir=str(cache))
    assert r["fs"]["kind"] == "lustre" and r["error"] is None
    lo = r["lustre_osts"]
    assert [e["ost"] for e in lo["osts"]] == [0, 1, 2, 3]
    assert all(e["bytes"] > 0 and e["write_mb_per_s"] > 0 and e["read_mb_per_s"] > 0
               for e in lo["osts"])
    assert any("OST 4" in n for n in lo["notes"])  # no fifth OST: the probe stops there
    assert probe.calls.count("open_delay_create") == 5
    stripe = r["recommendations"]["stripe"]
    assert stripe["value"] == {"stripe_count": 1, "stripe_size": 4 << 20} and stripe["reason"]
    assert r["cache_dir"]["read_mb_per_s"] > 0 and r["cache_dir"]["kind"] == "local"
    assert str(cache) in r["recommendations"]["staging_depth"]["reason"]
    assert "Lustre OSTs" in sb.format_report(r) and "cache dir" in sb.format_report(r)
    assert list(root.iterdir()) == [] and list(cache.iterdir()) == []


class _PinRefused(FakeProbe):
    def fsetxattr(self, fd: int, name: str, value: bytes) -> None:
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))


def test_lustre_pin_failure_is_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "lustre"
    root.mkdir()
    fake_lustre(monkeypatch, root, _PinRefused)
    r = sb.run_storage_bench(root, **{**TINY_KW, "time_limit_s": 1})
    assert r["error"] is None and r["lustre_osts"]["osts"] == []
    assert any("pinning" in n for n in r["lustre_osts"]["notes"])
    assert list(root.iterdir()) == []


def _figures(open_us: float, read_mbps: float, streams: dict[int, float]) -> dict[str, Any]:
    return {"fs": {"kind": "lustre", "fstype": "lustre", "shared": True},
            "seq_read": [{"io_size": 1 << 20, "mode": "direct", "mb_per_s": read_mbps}],
            "metadata": {"open_close_latency_us": {"p50": open_us}},
            "streams": [{"threads": t, "mb_per_s": v} for t, v in streams.items()],
            "lustre_osts": {"osts": [{"ost": k} for k in range(8)]}, "cache_dir": None}


def test_recommendations_follow_the_figures() -> None:
    # 1 ms open at 1000 MB/s: >= 100 MB -> 128 MiB, one stripe; 4 streams reach 90% of 8's.
    rec = sb.recommend(_figures(1000, 1000, {1: 500, 2: 900, 4: 1850, 8: 2000}))
    assert rec["shard_size"]["value"] == 128 << 20
    assert rec["stripe"]["value"]["stripe_count"] == 1
    assert rec["workers"]["value"] == 4
    assert rec["staging_depth"]["value"] == 0 and "--cache-dir" in rec["staging_depth"]["reason"]
    # 20 ms open at 2000 MB/s: >= 4 GB -> capped at 4 GiB, striped over 4 OSTs.
    big = sb.recommend(_figures(20000, 2000, {1: 2000}))
    assert big["shard_size"]["value"] == 4 << 30
    assert big["stripe"]["value"]["stripe_count"] == 4
    # fast local open: the 64 MiB floor; a cache 3x faster than the store: stage one epoch.
    fig = _figures(5, 1000, {1: 1000})
    fig["cache_dir"] = {"path": "/nvme", "read_mb_per_s": 3000}
    small = sb.recommend(fig)
    assert small["shard_size"]["value"] == 64 << 20 and "floor" in small["shard_size"]["reason"]
    assert small["staging_depth"]["value"] == 1


def test_exhausted_time_limit_still_reports_every_section(tmp_path: Path) -> None:
    """Each phase does at least one iteration, however little time is left, and says it stopped."""
    r = sb.run_storage_bench(tmp_path, **{**TINY_KW, "time_limit_s": 0.001})
    assert r["error"] is None
    assert r["seq_write"] and r["seq_read"] and r["random_read"] and r["streams"]
    assert all(e["ops"] > 0 for e in r["random_read"]) and r["metadata"]["files"] >= 1
    assert any("stopped early" in n for n in r["notes"])
    assert list(tmp_path.iterdir()) == []


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--budget"):
        sb.run_storage_bench(tmp_path, **{**TINY_KW, "budget_bytes": "1MiB"})
    with pytest.raises(UsageError, match="4 KiB"):
        sb.run_storage_bench(tmp_path, **{**TINY_KW, "io_sizes": (1000,)})
    assert cli(str(tmp_path), *TINY, "--threads", "1,x") == 2
    assert cli(str(tmp_path / "missing"), *TINY) == 2
    assert list(tmp_path.iterdir()) == []


def test_shardio_bench_storage_command(tmp_path, cli) -> None:
    import json as _json

    rc, out, err = cli("bench", "storage", tmp_path, "--budget", "4MiB", "--time-limit", "2",
                       "--io-sizes", "64KiB", "--threads", "1", "--json")
    assert rc == 0, err
    result = _json.loads(out)
    assert result["recommendations"]["shard_size"]["reason"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".shardio-bench-")]
