"""Smoke test of ``benchmarks/bench_read.py --quick`` (the JSON it prints, never the speeds), and
checks that every contender is fed the same samples by the same per-sample function."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_read import MEASURED_PEERS, PEERS, usable  # noqa: E402
from tests._quickruns import Run  # noqa: E402

KINDS = {"shardio", "shardio_loader", "smallfiles", "wds_batched", "wds_dataloader"}
MODES = {"raw", "decode"}
NUMBERS = ("seconds", "samples_per_s", "mb_per_s", "median_seconds", "median_samples_per_s",
           "median_mb_per_s", "first_batch_seconds", "peak_pss_mb", "peak_rss_sum_mb",
           "baseline_pss_mb", "setup_seconds", "cpu_seconds", "main_cpu_seconds",
           "worker_cpu_seconds", "min_cpu_us_per_sample", "max_load_1min")
RATIOS = ("raw_shardio_vs_smallfiles", "raw_shardio_vs_webdataset", "decode_shardio_vs_webdataset",
          "decode_shardio_vs_smallfiles", "raw_shardio_vs_webdataset_median",
          "raw_shardio_vs_smallfiles_persistent_workers", "raw_shardio_loader_vs_smallfiles",
          "raw_shardio_loader_vs_webdataset", "decode_shardio_loader_vs_webdataset",
          "decode_shardio_loader_vs_smallfiles", "raw_shardio_loader_vs_shardio",
          "decode_shardio_loader_vs_shardio", "raw_shardio_loader_vs_smallfiles_persistent_workers")
TARGETS = {"raw_shardio_ge_2x_smallfiles", "raw_shardio_ge_4x_webdataset",
           "decode_shardio_ge_1_1x_webdataset", "shardio_rss_growth_lt_5pct",
           "raw_shardio_loader_ge_2x_smallfiles", "raw_shardio_loader_ge_4x_webdataset"}


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.quick_run("read")
def test_quick_run_prints_contender_growth_and_summary_lines(quick_run: Run) -> None:
    tmp_path = quick_run.dir
    json_out = tmp_path / "bench.jsonl"
    proc = quick_run
    lines = [json.loads(ln) for ln in proc.stdout.splitlines()]
    assert json_out.read_text().splitlines() == proc.stdout.splitlines()
    assert all(ln["bench"] == "read" for ln in lines)
    contenders = [ln for ln in lines if ln["kind"] == "contender"]
    growth = [ln for ln in lines if ln["kind"] == "growth"]
    summary = lines[-1]
    # Peer contenders (LitData, MosaicML Streaming) run only where the peers environment exists (`make peers`).
    peers = sorted({c["contender"] for c in contenders} - set(KINDS))
    assert set(peers) <= set(MEASURED_PEERS)
    assert set(peers) == {k for k in MEASURED_PEERS
                          if usable(summary["peers"][PEERS[k][1]])}
    n = len(KINDS) + len(peers)
    assert [ln["kind"] for ln in lines] == (["contender"] * 2 * n + ["growth"] * 6 + ["summary"])

    expected = {(k, m) for k in (*KINDS, *peers) for m in MODES}
    assert {(c["contender"], c["mode"]) for c in contenders} == expected
    # shardio and the reference loaders deliver exactly the same bytes (each sample once); a
    # peer that repeats or drops samples is reported by the summary, not asserted here.
    payloads = {c["payload_bytes"] for c in contenders if c["contender"] in KINDS}
    assert len(payloads) == 1 and payloads.pop() > 0
    assert not (set(summary["payload_mismatch"]) & {f"{k}_{m}" for k in KINDS for m in MODES})
    for c in contenders:
        assert c["files"] == 400 and c["runs"] == 1 and len(c["all_seconds"]) == 1
        assert c["batch_size"] == 256 and c["num_workers"] == 2
        assert c["persistent_workers"] is False and isinstance(c["loader"], str)
        for key in NUMBERS:
            assert _number(c[key]), (c["contender"], c["mode"], key)
        assert c["peak_pss_mb"] > 0 and c["baseline_pss_mb"] > 0

    assert {(g["contender"], g["persistent_workers"]) for g in growth} == {
        (k, p) for k in ("shardio", "shardio_loader", "smallfiles") for p in (False, True)}
    for g in growth:
        assert g["mode"] == "raw" and g["epochs"] == 2
        for key in ("epoch_seconds", "samples_per_s", "tree_rss_mb", "tree_pss_mb", "processes"):
            assert len(g[key]) == 2 and all(_number(v) for v in g[key]), (g["contender"], key)
        # after an epoch, persistent workers are still alive; non-persistent ones have exited
        assert g["processes"] == ([3, 3] if g["persistent_workers"] else [1, 1])
        for key in ("rss_growth_pct", "pss_growth_pct", "rss_trend_pct", "pss_trend_pct"):
            assert isinstance(g[key], (int, float)), key

    assert summary["kind"] == "summary" and summary["files"] == 400
    assert summary["repeat"] == 1 and summary["growth_epochs"] == 2
    assert summary["num_shards"] >= 2  # both webdataset workers need a shard
    assert set(summary["webdataset_setup"]) == MODES
    assert set(summary["webdataset_setup"].values()) <= {"wds_batched", "wds_dataloader"}
    assert set(summary["samples_per_s"]) == {f"{k}_{m}" for k in (*KINDS, *peers) for m in MODES}
    for k in peers:  # ratios against a measured peer, no targets
        assert all(summary["ratios"][f"{m}_shardio_vs_{k}"] > 0 for m in MODES)
    for key in RATIOS:
        assert isinstance(summary["ratios"][key], float) and summary["ratios"][key] > 0, key
    for key in ("shardio_rss_growth_pct", "shardio_loader_rss_growth_pct"):
        assert isinstance(summary["ratios"][key], float), key
    # None where a --quick run's CPU figure read 0 clock ticks.
    assert all(v is None or (isinstance(v, float) and v > 0)
               for v in summary["cpu_ratios"].values())
    assert set(summary["targets"]) == TARGETS
    assert all(isinstance(v, bool) for v in summary["targets"].values())
    assert "contender" in proc.stderr and "targets:" in proc.stderr  # the human-readable table
    assert not any((tmp_path / "work").iterdir())  # the work directory is removed without --keep


def test_contenders_get_the_same_samples_and_transform(image_tree: Path, tmp_path: Path) -> None:
    """shardio and the small-files dataset yield identical (bytes, label) per key, and decode mode
    gives a 64x64 uint8 CHW crop whatever the aspect ratio."""
    import io

    import numpy as np
    import torch
    from PIL import Image

    import shardio
    from benchmarks.bench_read import (
        ImageFolderBytes,
        ShardioItem,
        collate_decode,
        collate_raw,
        decode_item,
        raw_item,
    )

    out = tmp_path / "shards"
    shardio.pack(image_tree, out, label_from_dir=True, shard_size="64MB", fsync=False,
                 progress=False)
    files = ImageFolderBytes(str(image_tree), raw_item)
    by_key = {}
    for (path, _label), item in zip(files.samples, (files[i] for i in range(len(files)))):
        rel = Path(path).relative_to(image_tree).with_suffix("")
        by_key[rel.as_posix()] = item
    reader = shardio.open_dataset(out)
    as_shardio = ShardioItem(raw_item)
    got = {s["__key__"]: as_shardio(s) for s in reader}
    assert got == by_key and len(got) == 60

    data, labels, nbytes = collate_raw(list(got.values())[:5])
    assert isinstance(data, list) and all(isinstance(d, bytes) for d in data)
    assert labels.dtype == torch.int64 and nbytes == sum(len(d) for d in data)

    buf = io.BytesIO()
    Image.fromarray(np.zeros((50, 120, 3), np.uint8)).save(buf, format="JPEG")
    img, label, n = decode_item(buf.getvalue(), 7)
    assert img.shape == (3, 64, 64) and img.dtype == torch.uint8 and img.is_contiguous()
    assert (label, n) == (7, len(buf.getvalue()))
    batch, labels, _ = collate_decode([(img, 1, 3), (img, 2, 4)])
    assert batch.shape == (2, 3, 64, 64) and labels.tolist() == [1, 2]
