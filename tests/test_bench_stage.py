"""Smoke test of ``benchmarks/bench_stage.py --quick``: the JSON it prints and the accounting
(never the speeds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_run_reports_every_contender_and_epoch(tmp_path: Path) -> None:
    out = tmp_path / "lines.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_stage.py"), "--quick", "--files", "400",
         "--workdir", str(tmp_path), "--json-out", str(out), "--latency", "0.001"],
        capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert proc.returncode == 0, proc.stderr
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
    assert "staged/local" in proc.stderr
    assert not any(p.name.startswith("shardio-bench-stage-") for p in tmp_path.iterdir())
