"""Smoke test of ``benchmarks/bench_stage.py --quick``: the JSON it prints and the accounting
(never the speeds)."""

from __future__ import annotations

import json

import pytest

from tests._quickruns import Run


@pytest.mark.timeout(900)
@pytest.mark.quick_run("stage")
def test_quick_run_reports_every_contender_and_epoch(quick_run: Run) -> None:
    tmp_path = quick_run.dir
    out = tmp_path / "lines.json"
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    rows, summary = lines[:-1], lines[-1]
    assert {(r["contender"], r["epoch"]) for r in rows} == {
        (c, e) for c in ("local", "shared", "staged") for e in (0, 1)}
    assert all(r["samples"] == 400 for r in rows)
    by = {(r["contender"], r["epoch"]): r for r in rows}
    assert by["local", 0]["shared_bytes_direct"] == 0  # local disk is not the shared store
    assert by["shared", 1]["shared_bytes_staged"] == 0 < by["shared", 1]["shared_bytes_direct"]
    assert summary["at_most_one_pass_per_epoch"] is True
    assert len(summary["staged_vs_local_from_epoch_2"]) == 1
    assert "staged/local" in quick_run.stderr
    assert not any(p.name.startswith("shardio-bench-stage-") for p in tmp_path.iterdir())
