"""Smoke test of ``benchmarks/bench_kept.py --quick``: the JSON it prints and the counts that
show which path each contender took (never the speeds)."""

from __future__ import annotations

import json

import pytest

from tests._quickruns import Run


@pytest.mark.timeout(900)
@pytest.mark.quick_run("kept")
def test_quick_run_reports_every_contender(quick_run: Run) -> None:
    tmp_path = quick_run.dir
    out = tmp_path / "lines.json"
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    rows, summary = {r["contender"]: r for r in lines[:-1]}, lines[-1]
    assert set(rows) == {"none", "kept", "kept_without_detach", "previous", "labels",
                         "labels_dataloader"}
    assert all(r["files"] == 1500 and r["median_epoch_seconds"] > 0 for r in rows.values())
    assert rows["none"]["detached"] == 0 and rows["none"]["copied_out"] == 0
    assert rows["kept"]["detached"] == 1 and rows["kept"]["copied_out"] == 0
    # Without detach the kept batch stops its ring: that worker's batches take the pipe.
    assert rows["kept_without_detach"]["detached"] == 0
    assert rows["kept_without_detach"]["copied_out"] > 0
    assert rows["labels"]["detached"] > 0  # the labels of each batch moved out, not copied
    # Holding the previous batch a step longer moves nothing while the rings have room.
    assert rows["previous"]["detached"] == rows["previous"]["copied_out"] == 0
    assert rows["labels_dataloader"]["copied_out"] == rows["labels_dataloader"]["detached"] == 0
    assert summary["kept_vs_none"] > 0 and summary["kept_without_detach_vs_none"] > 0
    assert summary["previous_vs_none"] > 0
    assert "labels_uss_growth_mb" in summary and "labels_dataloader_uss_growth_mb" in summary
    assert "kept/none" in quick_run.stderr
    assert not any(p.name.startswith("shardio-bench-kept-") for p in tmp_path.iterdir())
