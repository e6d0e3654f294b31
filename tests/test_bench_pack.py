"""Smoke test of ``benchmarks/bench_pack.py --quick``: the JSON it prints, never the speeds."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks._common import PEERS, usable  # noqa: E402
from tests._quickruns import Run  # noqa: E402


CONTENDERS = {
    "tar", "shardio_tar_w1_fsync", "shardio_tar_w1_nofsync", "shardio_tar_w2_fsync",
    "shardio_tar_w2_nofsync", "shardio_hdf5_w1_nofsync", "shardio_hdf5_w2_nofsync",
    "webdataset_shardwriter", "shardio_tar_w1_slowfs_1thread", "shardio_tar_w1_slowfs_auto",
}
NUMBERS = ("seconds", "files_per_s", "mb_per_s", "median_seconds", "median_files_per_s",
           "median_mb_per_s", "cpu_seconds")
RATIOS = ("shardio_w1_vs_tar", "shardio_w1_vs_webdataset", "w2_vs_w1", "shardio_w1_fsync_vs_tar",
          "hdf5_w1_vs_tar", "hdf5_w2_vs_w1", "slowfs_auto_vs_1thread")
PEER_WRITERS = {"mosaic_mdswriter": "mosaic", "litdata_optimize": "litdata"}
TARGETS = ("shardio_w1_ge_tar", "shardio_ge_2x_webdataset", "w2_ge_1_6x_w1")


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.quick_run("pack")
def test_quick_run_prints_contender_lines_then_summary(quick_run: Run) -> None:
    tmp_path = quick_run.dir
    json_out = tmp_path / "bench.jsonl"
    proc = quick_run
    lines = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert json_out.read_text().splitlines() == proc.stdout.splitlines()
    *contenders, summary = lines
    # The peers' writers run only where the peers environment imports them (`make peers`).
    peers = {name for name, kind in PEER_WRITERS.items()
             if usable(summary["peers"][PEERS[kind][1]])}
    expected = CONTENDERS | peers

    assert [c["kind"] for c in contenders] == ["contender"] * len(expected)
    assert {c["contender"] for c in contenders} == expected
    for c in contenders:
        assert c["bench"] == "pack"
        assert c["files"] == 600 and c["payload_bytes"] > 0
        assert c["runs"] == 1 and len(c["all_seconds"]) == 1
        for key in NUMBERS:
            assert isinstance(c[key], (int, float)) and c[key] >= 0, (c["contender"], key)
        assert c["peak_rss_mb"] is None or c["peak_rss_mb"] > 0
        assert c["output_bytes"] >= c["payload_bytes"]
        assert isinstance(c["fsync"], bool) and c["workers"] in (1, 2)

    assert summary["kind"] == "summary" and summary["files"] == 600
    assert set(summary["files_per_s"]) == expected
    for key in (*RATIOS, *(f"shardio_w1_vs_{name}" for name in peers)):
        assert isinstance(summary["ratios"][key], float) and summary["ratios"][key] > 0, key
    assert set(summary["targets"]) == set(TARGETS)
    assert all(isinstance(v, bool) for v in summary["targets"].values())
    assert "contender" in proc.stderr and "targets:" in proc.stderr  # the human-readable table
    assert not any((tmp_path / "work").iterdir())  # the work directory is removed without --keep
