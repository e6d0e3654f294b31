"""Smoke test of ``benchmarks/bench_loader.py --quick``: the JSON structure it prints (never the
speeds), and the transfer-section helpers."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tests._quickruns import Run  # noqa: E402

TRANSFER = {f"transfer_{t}_{ld}" for t in ("pages", "none") for ld in ("shardloader", "dataloader")}
E2E = {f"{m}_{ld}" for m in ("raw", "decode")
       for ld in ("shardloader", "shardio_dataloader", "smallfiles", "wds_batched",
                  "wds_dataloader")}
NAMES = TRANSFER | E2E | {"decode_ceiling", "decode_shardloader_steady"}
NUMBERS = ("seconds", "median_seconds", "samples_per_s", "median_samples_per_s", "batches_per_s",
           "median_batches_per_s", "main_cpu_seconds", "worker_cpu_seconds",
           "sampler_cpu_seconds", "main_cpu_ms_per_batch", "worker_cpu_ms_per_batch",
           "min_cpu_ms_per_batch", "min_cpu_us_per_sample", "peak_pss_mb", "peak_rss_sum_mb",
           "baseline_pss_mb", "peak_shmem_rise_mb", "max_load_1min", "mb_per_s")
TARGETS = {"transfer_ge_3x_dataloader", "raw_ge_5x_smallfiles", "decode_ge_95pct_ceiling",
           "pss_below_smallfiles"}


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.quick_run("loader")
def test_quick_run_prints_contender_and_summary_lines(quick_run: Run) -> None:
    tmp_path = quick_run.dir
    json_out = tmp_path / "bench.jsonl"
    proc = quick_run
    lines = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert json_out.read_text().splitlines() == proc.stdout.splitlines()
    assert all(ln["bench"] == "loader" for ln in lines)
    assert [ln["kind"] for ln in lines] == ["contender"] * (len(lines) - 1) + ["summary"]
    summary = lines[-1]
    # Peer loaders run only where the peers environment imports them (`make peers`).
    from benchmarks._common import PEERS, usable

    peers = {f"{m}_{k}" for m in ("raw", "decode") for k in ("litdata", "mosaic")
             if usable(summary["peers"][PEERS[k][1]])}
    contenders = {ln["name"]: ln for ln in lines[:-1]}
    assert set(contenders) == NAMES | peers
    for name in peers:
        assert contenders[name]["section"] == "e2e" and contenders[name]["samples"] == 400

    for name, c in contenders.items():
        runs = 2 if name in ("decode_ceiling", "decode_shardloader_steady") else 1
        assert c["files"] == 400 and c["runs"] == runs and len(c["all_seconds"]) == runs, name
        assert c["batch_size"] == 256 and c["num_workers"] == 2 and isinstance(c["loader"], str)
        assert c["samples"] == 400, name  # every contender delivered the whole dataset
        for key in NUMBERS:
            assert _number(c[key]), (name, key)
        assert c["peak_pss_mb"] > 0 and c["baseline_pss_mb"] > 0, name
    for name in TRANSFER:
        c = contenders[name]
        assert c["section"] == "transfer" and c["touch"] in ("pages", "none")
        assert c["batches"] == 2 and c["batch_mb"] == pytest.approx(256 * 3 * 64 * 64 / 1e6,
                                                                     abs=0.1)
        assert _number(c["first_epoch_seconds"]) and _number(c["first_epoch_batches_per_s"])
    for name in E2E:
        c = contenders[name]
        assert c["section"] == "e2e" and c["mode"] in ("raw", "decode") and c["batches"] == 2
    payloads = {contenders[n]["payload_bytes"] for n in E2E | peers | {"decode_ceiling"}}
    assert len(payloads) == 1 and payloads.pop() > 0  # the same bytes everywhere
    ceiling = contenders["decode_ceiling"]
    assert ceiling["section"] == "ceiling" and ceiling["processes_used"] == 2
    steady = contenders["decode_shardloader_steady"]
    assert steady["section"] == "steady" and steady["batches"] == 2
    assert steady["payload_bytes"] == contenders["decode_shardloader"]["payload_bytes"]

    assert summary["kind"] == "summary" and summary["files"] == 400 and summary["repeat"] == 1
    # The decode pair gets extra rounds of its own; each round's ratio is reported.
    assert summary["decode_repeat"] == 2 and len(summary["decode_vs_ceiling_per_round"]) == 2
    ceiling, steady = contenders["decode_ceiling"], contenders["decode_shardloader_steady"]
    assert all(c["runs"] == 2 for c in (ceiling, steady))
    assert summary["ratios"]["decode_shardloader_vs_ceiling_paired_median"] == pytest.approx(
        sum(c / s for c, s in zip(ceiling["all_seconds"], steady["all_seconds"])) / 2, abs=2e-3)
    assert summary["side"] == 64 and (summary["ring_bytes"] == "auto" or summary["ring_bytes"] > 0)
    assert set(summary["batches_per_s"]) == TRANSFER
    assert set(summary["samples_per_s"]) == E2E | peers | {"decode_ceiling",
                                                           "decode_shardloader_steady"}
    assert set(summary["peak_pss_mb"]) == NAMES | peers
    assert set(summary["webdataset_setup"]) == {"raw", "decode"}
    assert set(summary["webdataset_setup"].values()) <= {"wds_batched", "wds_dataloader"}
    for key, v in summary["ratios"].items():
        # A CPU ratio is None where a --quick run's few batches read 0 clock ticks.
        assert (isinstance(v, float) and v > 0) or (v is None and "_cpu_" in key), key
    for key in ("transfer_shardloader_vs_dataloader", "raw_shardloader_vs_smallfiles",
                "decode_shardloader_vs_ceiling", "decode_shardloader_with_start_vs_ceiling",
                "raw_pss_shardloader_vs_smallfiles"):
        assert key in summary["ratios"]
    assert set(summary["targets"]) == TARGETS
    assert all(isinstance(v, bool) for v in summary["targets"].values())
    assert len(summary["loadavg_end"]) == 3
    assert "contender" in proc.stderr and "targets:" in proc.stderr  # the human-readable table
    assert not any((tmp_path / "work").iterdir())  # the work directory is removed without --keep


def test_fixed_item_and_page_touch() -> None:
    """The transfer transform ignores its sample; the consumer reads one byte per 4 KiB page."""
    import torch

    from benchmarks.bench_loader import PAGE, FixedItem, touch_pages

    item = FixedItem(224)
    a, b = item({"jpg": b"x"}), item(None)
    assert a is b and a.shape == (3, 224, 224) and a.dtype == torch.uint8
    batch = torch.stack([a] * 4)
    assert touch_pages(batch) == 7 * -(-batch.numel() // PAGE)
