"""``shardio bench loader``: structure of the report and the recommendation (never the speeds)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardio import PackOptions, pack


@pytest.fixture
def ds(image_tree: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    pack(image_tree, out, PackOptions(samples_per_shard=10, label_from_dir=True, fsync=False))
    return out


def test_loader_bench_reports_each_worker_count(ds: Path, cli) -> None:
    rc, out, err = cli("bench", "loader", ds, "--workers", "1,2", "--steps", "6",
                       "--step-time", "0.005", "--batch-size", "8", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert [x["workers"] for x in r["runs"]] == [1, 2]
    for x in r["runs"]:
        assert x["steps"] == 6
        assert 0 <= x["wait_fraction"] <= 1 and x["samples_per_s"] > 0
        assert x["compute_per_step_s"] >= 0.004  # the simulated step is counted as compute
        assert {"read", "decode", "collate"} <= set(x["stage_per_batch_s"])
    ok = [x["workers"] for x in r["runs"] if x["wait_fraction"] < r["target_wait_fraction"]]
    assert r["recommended_workers"] == (ok[0] if ok else None)
    assert r["advice"]


def test_loader_bench_table_and_bad_usage(ds: Path, cli) -> None:
    rc, out, _err = cli("bench", "loader", ds, "--workers", "1", "--steps", "3",
                        "--step-time", "0", "--batch-size", "4", "--decode", "--target", "1.0")
    assert rc == 0
    assert "recommendation: 1 worker(s)" in out and "wait %" in out
    rc, _out, err = cli("bench", "loader", ds, "--workers", "one")
    assert rc == 2 and "--workers" in err
    # NaN and inf passed the `step_time < 0` check and crashed in time.sleep with a traceback.
    for arg in (["--step-time", "nan"], ["--step-time", "inf"], ["--target", "nan"],
                ["--target", "-1"]):
        rc, _out, err = cli("bench", "loader", ds, "--workers", "1", "--steps", "2", *arg)
        assert rc == 2 and "--step-time" in err, (arg, err)
    root = ds.parent
    rc, _out, err = cli("bench", "storage", root, "--time-limit", "inf")
    assert rc == 2 and "--time-limit" in err


def test_loader_bench_pins_workers_and_sets_prefetch(ds: Path, cli) -> None:
    """--cpus and --prefetch-factor reach the loaders (the report records them; pinning itself
    is tested in test_loader.py); bad values are usage errors."""
    import os

    cpu = sorted(os.sched_getaffinity(0))[-1]
    rc, out, err = cli("bench", "loader", ds, "--workers", "1", "--steps", "3",
                       "--step-time", "0", "--batch-size", "4", "--cpus", f"{cpu}-{cpu}",
                       "--prefetch-factor", "3", "--json")
    assert rc == 0, err
    r = json.loads(out)
    assert r["pinned_cpus"] == [cpu] and r["prefetch_factor"] == 3
    for bad in (["--cpus", "x"], ["--cpus", "3-1"], ["--prefetch-factor", "0"]):
        rc, _out, err = cli("bench", "loader", ds, "--workers", "1", *bad)
        assert rc == 2 and (bad[0] in err or "prefetch_factor" in err), (bad, err)
