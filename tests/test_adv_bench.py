"""Adversarial tests of the storage bench, the loader bench and the data-wait accounting."""

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


def test_loader_bench_counts_the_last_steps_compute(ds: Path, cli) -> None:
    """The loader credits a step's compute only when the next batch is asked for, which the
    bench's last timed step never did: compute per step was (steps-1)/steps of the step time,
    and with --steps 1 about 0, so the wait fraction was ~100% whatever the workers did."""
    rc, out, err = cli("bench", "loader", ds, "--workers", "1", "--steps", "1",
                       "--step-time", "0.2", "--batch-size", "8", "--json")
    assert rc == 0, err
    (x,) = json.loads(out)["runs"]
    assert x["steps"] == 1
    assert x["compute_per_step_s"] >= 0.2
    rc, out, err = cli("bench", "loader", ds, "--workers", "1", "--steps", "2",
                       "--step-time", "0.1", "--batch-size", "8", "--json")
    assert rc == 0, err
    (x,) = json.loads(out)["runs"]
    assert x["compute_per_step_s"] >= 0.1  # (was ~0.05: one step of two)
