"""``tools/plan_scale.py --small``: its figures checked for consistency (never its speed) against
RankPlan, EpochOrder and node_schedule recomputed here, and ``node_schedule`` (which goes block
by block) checked against the epoch-wide computation it replaced."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardio.order import EpochOrder, NodeSchedule, RankPlan, node_schedule
from tools import plan_scale
from tools.plan_scale import Config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "plan_scale.py"
GROUPS = ["config", "manifest", "rank_plan", "node_schedule", "partition", "staging", "ost",
          "metadata", "summary"]


# --- node_schedule against the epoch-wide reference --------------------------------------------
def reference_node_schedule(order: EpochOrder, *, world_size: int, local_world_size: int,
                            node: int, batch_size: int, remainder: str) -> NodeSchedule:
    """The implementation node_schedule had before it went block by block: the ids of every
    position the node reads, looked up in the whole epoch's order."""
    n = len(order)
    plan = RankPlan(n, world_size, 0, batch_size, remainder)
    empty = np.zeros(0, np.int64)
    if plan.num_batches == 0 or n == 0:
        return NodeSchedule(order.epoch, empty, empty, empty)
    t = np.arange(plan.num_batches, dtype=np.int64)
    b = np.minimum(batch_size, plan.per_rank - t * batch_size)
    step_pos = t * world_size * batch_size
    ranks = max(0, min(local_world_size, world_size - node * local_world_size))
    start, length = step_pos + node * local_world_size * b, ranks * b
    total = int(length.sum())
    if total == 0:
        return NodeSchedule(order.epoch, empty, empty, empty)
    rep_start = np.repeat(start - np.concatenate([[0], np.cumsum(length)[:-1]]), length)
    positions = (np.arange(total, dtype=np.int64) + rep_start) % n
    times = np.repeat(step_pos, length)
    shard_of = np.searchsorted(order.offsets, order.samples(0, n)[positions], side="right") - 1
    k = np.argsort(shard_of, kind="stable")
    s_sorted, t_sorted = shard_of[k], times[k]
    cut = np.flatnonzero(np.diff(s_sorted)) + 1
    lo, hi = np.concatenate([[0], cut]), np.concatenate([cut, [len(s_sorted)]]) - 1
    shards, first, last = s_sorted[lo], t_sorted[lo], t_sorted[hi]
    by_first = np.argsort(first, kind="stable")
    return NodeSchedule(order.epoch, shards[by_first], first[by_first], last[by_first])


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=0, max_size=25), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 9), shuffle=st.booleans(), block=st.integers(1, 90),
       world=st.integers(1, 12), local=st.integers(1, 5), batch=st.integers(1, 9),
       remainder=st.sampled_from(["pad", "drop"]), node=st.integers(0, 12))
def test_node_schedule_equals_the_epoch_wide_reference(counts, seed, epoch, shuffle, block, world,
                                                       local, batch, remainder, node):
    order = EpochOrder(np.array(counts, dtype=np.int64), seed=seed, epoch=epoch,
                       shuffle=shuffle, shuffle_block=block)
    kw = {"world_size": world, "local_world_size": local, "node": node, "batch_size": batch,
          "remainder": remainder}
    got, want = node_schedule(order, **kw), reference_node_schedule(order, **kw)
    assert got.epoch == want.epoch and got.bytes_per_step == want.bytes_per_step
    for name in ("shards", "first", "last"):
        np.testing.assert_array_equal(getattr(got, name), getattr(want, name))
        assert getattr(got, name).dtype == np.int64


def test_node_schedule_at_scale_reads_blocks_not_the_epoch() -> None:
    """A 1,000-node job on 10M samples: the node's schedule costs a few MB, not the epoch's
    80 MB of ids (tracemalloc peak; numpy reports its buffers to it)."""
    import tracemalloc

    counts = np.random.default_rng(0).integers(200, 301, 40_000)
    order = EpochOrder(counts, seed=0)
    tracemalloc.start()
    try:
        sched = node_schedule(order, world_size=8000, local_world_size=8, node=500, batch_size=32)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(sched) == len(np.unique(sched.shards)) > 0
    assert peak < 40e6, peak


# --- the script's figures ------------------------------------------------------------------------
def figures(cfg: Config) -> dict[str, dict[str, Any]]:
    groups = plan_scale.run(cfg)
    assert [g["group"] for g in groups] == GROUPS
    return {g["group"]: g for g in groups}


@pytest.mark.parametrize("changes", [{}, {"samples": 20_005}, {"samples": 20_005,
                                                                 "remainder": "drop"},
                                     {"ost_layout": "random", "batch_size": 7, "workers": 3}])
def test_small_figures_agree_with_a_recomputation(changes: dict[str, Any]) -> None:
    cfg = Config.small(**changes)
    f = figures(cfg)
    man = plan_scale.synthetic_manifest(cfg)
    assert int(man.counts.sum()) == cfg.samples and man.counts.min() >= 1
    order = EpochOrder(man.counts, seed=cfg.seed, epoch=cfg.epoch,
                       shuffle_block=cfg.shuffle_block)
    n, world, s = len(order), cfg.world, cfg.shards
    ids = order.samples(0, n)

    # Partition, from RankPlan itself: each rank's batches, each sample once (+pad / -drop).
    reads: Counter[int] = Counter()
    rank_worker_shards: set[tuple[int, int, int]] = set()
    per_rank = []
    for r in range(world):
        plan = RankPlan(n, world, r, cfg.batch_size, cfg.remainder)
        got = 0
        for w in range(cfg.workers):
            for t in plan.worker_steps(w, cfg.workers):
                a, b = plan.batch_range(t)
                batch = ids[np.arange(a, b) % n]
                got += len(batch)
                reads.update(batch.tolist())
                sh = np.searchsorted(order.offsets, batch, side="right") - 1
                rank_worker_shards |= {(r, w, int(x)) for x in sh}
        per_rank.append(got)
    part = f["partition"]
    assert part["sum_over_ranks"] == part["reads"] == sum(per_rank) == world * part["per_rank"]
    assert set(per_rank) == {part["per_rank"]}
    pad = (-n) % world if cfg.remainder == "pad" else 0
    drop = n % world if cfg.remainder == "drop" else 0
    assert (part["padding"], part["dropped"]) == (pad, drop)
    assert sum(reads.values()) == n + pad - drop
    assert Counter(reads.values()) == Counter({1: n - pad - drop, 2: pad} if pad else
                                              {1: n - drop})
    assert part["samples_read_once"] == n - pad - drop and part["samples_read_twice"] == pad
    assert part["samples_not_read"] == drop and part["rule_matches_rank_plan"]
    assert changes or (pad, drop) == (0, 0)

    # Staging: every node sampled here; no duplicates; bytes from the manifest's sizes.
    st_ = f["staging"]
    assert st_["sampled_nodes"] == list(range(cfg.nodes))
    assert st_["duplicate_shards_in_schedules"] == 0 and st_["max_reads_per_shard_per_node"] == 1
    assert st_["sampled_equals_exact"]
    scheds = [node_schedule(order, world_size=world, local_world_size=cfg.ranks_per_node,
                            node=v, batch_size=cfg.batch_size, remainder=cfg.remainder)
              for v in range(cfg.nodes)]
    for v, sched in enumerate(scheds):
        d = st_["per_node_sampled"][str(v)]
        assert d["bytes"] == d["exact_bytes"] == int(man.sizes[sched.shards].sum())
        assert d["shards"] == d["exact_shards"] == len(sched) == len(set(sched.shards.tolist()))
    all_shards = np.concatenate([x.shards for x in scheds])
    assert st_["shared_fs_shard_reads"] == len(all_shards)
    assert st_["shared_fs_bytes"] == int(man.sizes[all_shards].sum())
    assert st_["dataset_bytes"] == int(man.sizes.sum()) and st_["dataset_shards"] == s
    assert st_["read_amplification"] == pytest.approx(st_["shared_fs_bytes"] / st_["dataset_bytes"])

    # OSTs: the epoch's bytes per OST add up to the shared-filesystem bytes.
    ost = f["ost"]
    per_ost = np.bincount(man.osts[all_shards], man.sizes[all_shards], cfg.osts)
    assert ost["epoch_bytes_sum"] == st_["shared_fs_bytes"]
    assert ost["epoch_max_over_mean"] == pytest.approx(per_ost.max() / per_ost.mean())
    assert ost["inflight"]["nodes"] >= 1

    # Metadata: the formulas in the module docstring.
    md = f["metadata"]
    assert md["small_files"] == 2 * part["reads"]
    assert md["shardio_with_staging"] == 3 * st_["shared_fs_shard_reads"]
    assert md["shardio_without_staging"] == 3 * len(rank_worker_shards)

    summary = f["summary"]
    assert summary["consistent"] and all(summary["checks"].values())
    assert {t["status"] for t in summary["targets"].values()} <= {"PASS", "MISS"}


def test_manifest_layouts() -> None:
    rr = plan_scale.synthetic_manifest(Config.small())
    assert np.all(np.diff(rr.osts) % 10 == 1)  # round-robin in manifest order
    assert np.bincount(rr.osts, minlength=10).tolist() == [20] * 10
    rnd = plan_scale.synthetic_manifest(Config.small(ost_layout="random"))
    assert rnd.osts.min() >= 0 and rnd.osts.max() < 10
    again = plan_scale.synthetic_manifest(Config.small(ost_layout="random"))
    np.testing.assert_array_equal(rnd.osts, again.osts)  # seeded


def test_cli_prints_json_lines_and_a_summary(tmp_path: Path) -> None:
    out = tmp_path / "plan.jsonl"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--small", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path, check=False)
    assert proc.returncode == 0, proc.stderr
    json_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    text = [ln for ln in proc.stdout.splitlines() if ln.startswith("# ")]
    assert [json.loads(ln)["group"] for ln in json_lines] == GROUPS
    assert out.read_text().splitlines() == json_lines
    assert any(ln.startswith(("# PASS", "# MISS")) for ln in text)
    assert not any(ln.startswith("# FAIL") for ln in text)


def test_cli_usage_errors_exit_2() -> None:
    with pytest.raises(SystemExit) as exc:
        plan_scale.main(["--small", "--rank", "99"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        plan_scale.main(["--small", "--samples", "10"])
    assert exc.value.code == 2
