"""The node-affine epoch order (``shardio.order.NodeAffineOrder``), checked against its docstring.

A permutation of every sample per epoch, a pure function of its parameters (C = 1 is exactly
EpochOrder); with a job whose steps are its canonical job's, each node reads its own group's
shards (all but RankPlan's padding); a resumed job with another topology still reads the rest
exactly once; node_schedule works on it unchanged and is far shorter than on EpochOrder; and the
shuffle-quality figure on a class-sorted dataset.  ``tools/plan_scale.py --order node`` is
checked for consistency here too (its own test file pins the default order's figures).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardio.errors import UsageError
from shardio.order import (
    EpochOrder,
    NodeAffineOrder,
    NodeSchedule,
    RankPlan,
    node_schedule,
)
from tools import plan_scale


def full(order: EpochOrder | NodeAffineOrder) -> np.ndarray:
    return order.samples(0, len(order))


def shard_of(order: NodeAffineOrder, ids: np.ndarray) -> np.ndarray:
    return np.searchsorted(order.offsets, ids, side="right") - 1


def node_positions(n: int, world: int, local: int, node: int, batch: int, remainder: str,
                   cursor: int = 0) -> np.ndarray:
    """Epoch positions node ``node``'s ranks read, from RankPlan itself (padding wraps to the
    cursor), in step order."""
    out = []
    plans = [RankPlan(n - cursor, world, r, batch, remainder)
             for r in range(node * local, min(world, (node + 1) * local))]
    for t in range(plans[0].num_batches if plans else 0):
        for plan in plans:
            a, b = plan.batch_range(t)
            out.append(cursor + np.arange(a, b) % (n - cursor))
    return np.concatenate(out) if out else np.zeros(0, np.int64)


# --- the permutation and its structure ---------------------------------------------------------
@settings(max_examples=250, deadline=None)
@given(counts=st.lists(st.integers(0, 30), min_size=0, max_size=25), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 9), c=st.integers(1, 7), u=st.integers(1, 9), q=st.integers(1, 4),
       remainder=st.sampled_from(["pad", "drop"]), shuffle=st.booleans(),
       block=st.integers(1, 90), cut=st.tuples(st.floats(0, 1), st.floats(0, 1)))
def test_every_sample_once_per_epoch(counts, seed, epoch, c, u, q, remainder, shuffle, block, cut):
    counts = np.array(counts, dtype=np.int64)
    order = NodeAffineOrder(counts, seed=seed, epoch=epoch, canonical_nodes=c, slice_size=u,
                            canonical_ranks=q, remainder=remainder, shuffle=shuffle,
                            shuffle_block=block)
    n = int(counts.sum())
    ids = full(order)
    assert len(order) == n and ids.dtype == np.int64
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))
    a, b = sorted(int(x * n) for x in cut)
    np.testing.assert_array_equal(order.samples(a, b), ids[a:b])
    perm = np.random.default_rng(seed).permutation(n)
    np.testing.assert_array_equal(order.ids_at(perm), ids[perm])
    # Groups: sizes add up, each position's sample lies in a shard of its group.
    assert int(order.group_sizes.sum()) == n and len(order.group_sizes) == c
    groups = order.groups_at(np.arange(n))
    for g in range(c):
        mine = shard_of(order, ids[groups == g])
        assert set(mine.tolist()) == set(order.group_shards(g).tolist())
        assert np.bincount(groups, minlength=c)[g] == order.group_sizes[g]
    # Blocks: their positions tile the epoch, aligned with their ids; at most one block of
    # shuffle_block + a shard in memory per group read.
    if order.num_blocks:
        pos = np.concatenate([order.block_positions(k) for k in range(order.num_blocks)])
        np.testing.assert_array_equal(np.sort(pos), np.arange(n))
        for k in range(order.num_blocks):
            np.testing.assert_array_equal(ids[order.block_positions(k)], order.block(k))
            assert len(order.block(k)) <= block + max(int(counts.max()) - 1, 0)
    assert len(order._cache) <= 2
    # C == 1 is EpochOrder exactly.
    one = NodeAffineOrder(counts, seed=seed, epoch=epoch, canonical_nodes=1, slice_size=u,
                          canonical_ranks=q, remainder=remainder, shuffle=shuffle,
                          shuffle_block=block)
    np.testing.assert_array_equal(full(one), full(EpochOrder(counts, seed=seed, epoch=epoch,
                                                             shuffle=shuffle,
                                                             shuffle_block=block)))


def test_deterministic_and_epochs_differ() -> None:
    counts = np.random.default_rng(1).integers(20, 41, 120)
    kw = {"canonical_nodes": 6, "slice_size": 16, "canonical_ranks": 2}
    base = full(NodeAffineOrder(counts, seed=3, epoch=2, **kw))
    np.testing.assert_array_equal(full(NodeAffineOrder(counts.copy(), seed=3, epoch=2, **kw)),
                                  base)
    others = [NodeAffineOrder(counts, seed=3, epoch=3, **kw),
              NodeAffineOrder(counts, seed=4, epoch=2, **kw),
              NodeAffineOrder(counts, seed=3, epoch=0, **kw)]
    for other in others:
        assert not np.array_equal(full(other), base)
        np.testing.assert_array_equal(np.sort(full(other)), np.arange(int(counts.sum())))
    # The deal itself changes with the epoch: group 0 gets other shards.
    a = NodeAffineOrder(counts, seed=3, epoch=2, **kw).group_shards(0)
    b = NodeAffineOrder(counts, seed=3, epoch=3, **kw).group_shards(0)
    assert set(a.tolist()) != set(b.tolist())


def test_shuffle_false_deals_manifest_order() -> None:
    counts = np.array([5, 0, 7, 3, 11, 1, 9, 4])
    order = NodeAffineOrder(counts, shuffle=False, canonical_nodes=2, slice_size=4)
    ids = full(order)
    np.testing.assert_array_equal(np.sort(ids), np.arange(40))
    g = order.groups_at(np.arange(40))
    np.testing.assert_array_equal(ids[g == 0], np.arange(20))  # group 0: the first half
    np.testing.assert_array_equal(ids[g == 1], np.arange(20, 40))


def test_bad_arguments() -> None:
    counts = np.full(10, 5)
    for bad in ({"canonical_nodes": 0}, {"slice_size": 0}, {"canonical_ranks": 0},
                {"shuffle_block": 0}, {"remainder": "wrap"}):
        with pytest.raises(UsageError):
            NodeAffineOrder(counts, **bad)
    with pytest.raises(UsageError, match="local_world_size"):
        NodeAffineOrder.for_job(counts, world_size=6, local_world_size=4, batch_size=2)
    with pytest.raises(UsageError, match="canonical_nodes=4"):
        NodeAffineOrder.for_job(counts, world_size=16, local_world_size=4, batch_size=2,
                                canonical_nodes=6)
    with pytest.raises(UsageError, match="global batch"):
        NodeAffineOrder.for_job(counts, world_size=4, local_world_size=1, batch_size=3,
                                canonical_nodes=8)
    with pytest.raises(UsageError, match="positions"):
        NodeAffineOrder(counts).ids_at(np.array([50]))
    o = NodeAffineOrder.for_job(counts, world_size=16, local_world_size=4, batch_size=2,
                                canonical_nodes=8)
    assert (o.canonical_nodes, o.slice_size, o.canonical_ranks) == (8, 4, 2)


# --- locality ----------------------------------------------------------------------------------
def locality(order: NodeAffineOrder, *, world: int, local: int, batch: int, remainder: str,
             groups_of: dict[int, list[int]], cursor: int = 0) -> tuple[float, int, int]:
    """(worst node's fraction of reads from its own groups' shards, cross-node sample reads,
    samples read twice)."""
    n = len(order)
    worst, cross, reads = 1.0, 0, []
    for node, groups in groups_of.items():
        pos = node_positions(n, world, local, node, batch, remainder, cursor)
        own_shards = np.concatenate([order.group_shards(g) for g in groups])
        ids = order.ids_at(pos)
        own = np.isin(shard_of(order, ids), own_shards)
        worst = min(worst, float(own.mean()))
        cross += int((~np.isin(order.groups_at(pos), groups)).sum())
        reads.append(ids)
    counts = np.bincount(np.concatenate(reads), minlength=n)
    return worst, cross, int((counts[cursor:] > 1).sum())


@pytest.mark.parametrize("samples,remainder", [(0, "pad"), (37, "pad"), (37, "drop"),
                                               (-5, "pad")])
def test_each_node_reads_its_own_group(samples: int, remainder: str) -> None:
    """C == N: every read of a node but RankPlan's padding comes from its own group."""
    nodes, local, batch = 16, 4, 8
    world = nodes * local
    counts = np.random.default_rng(2).integers(40, 61, 400)
    counts[0] += samples  # make the epoch length uneven against R*B and R
    order = NodeAffineOrder.for_job(counts, world_size=world, local_world_size=local,
                                    batch_size=batch, remainder=remainder, seed=7, epoch=1)
    assert (order.canonical_nodes, order.slice_size, order.canonical_ranks) == (16, 32, 4)
    n = len(order)
    pad = (-n) % world if remainder == "pad" else 0
    worst, cross, twice = locality(order, world=world, local=local, batch=batch,
                                   remainder=remainder,
                                   groups_of={v: [v] for v in range(nodes)})
    print(f"\nC=N={nodes}, M={n}, {remainder}: worst node-local fraction {worst:.4f}, "
          f"cross-node reads {cross} (padding {pad})")
    assert worst >= 0.95
    assert cross <= pad and twice == pad


def test_twice_as_many_canonical_nodes() -> None:
    """C = 2N: node n reads groups 2n and 2n+1 (for_job: U = L*B/2); the alternating layout
    (U = L*B, node n owns g % N == n) is local but for its last round."""
    nodes, local, batch = 8, 4, 8
    world = nodes * local
    counts = np.random.default_rng(3).integers(40, 61, 300)
    counts[0] += 11
    order = NodeAffineOrder.for_job(counts, world_size=world, local_world_size=local,
                                    batch_size=batch, canonical_nodes=2 * nodes)
    assert (order.slice_size, order.canonical_ranks) == (local * batch // 2, local // 2)
    pad = (-len(order)) % world
    worst, cross, _ = locality(order, world=world, local=local, batch=batch, remainder="pad",
                               groups_of={v: [2 * v, 2 * v + 1] for v in range(nodes)})
    assert worst >= 0.95 and cross <= pad
    alt = NodeAffineOrder(counts, canonical_nodes=2 * nodes, slice_size=local * batch)
    worst_alt, cross_alt, _ = locality(alt, world=world, local=local, batch=batch,
                                       remainder="pad",
                                       groups_of={v: [v, v + nodes] for v in range(nodes)})
    print(f"\nC=2N: worst node-local {worst:.4f} (cross {cross}); alternating layout "
          f"{worst_alt:.4f} (cross {cross_alt})")
    assert worst_alt >= 0.9 and cross_alt <= 2 * world * batch + pad


@pytest.mark.parametrize("new_world,new_local,new_batch,remainder,local_again", [
    (32, 8, 8, "pad", True),   # half the nodes, twice the ranks each: same C*U and q
    (16, 4, 16, "pad", False),  # half the nodes, twice the batch: same C*U, other q
    (12, 3, 5, "drop", False),  # anything else: correct, not local
    (7, 1, 3, "pad", False),
])
def test_resume_with_another_topology(new_world, new_local, new_batch, remainder, local_again):
    """The rest of the epoch after k steps of one job, re-split by RankPlan for another job,
    covers every remaining sample exactly once (plus padding, minus dropped)."""
    nodes, local, batch = 8, 4, 8
    world = nodes * local
    counts = np.random.default_rng(4).integers(40, 61, 200)
    counts[0] += 3
    order = NodeAffineOrder.for_job(counts, world_size=world, local_world_size=local,
                                    batch_size=batch, seed=9, epoch=4)
    n = len(order)
    done = RankPlan(n, world, 0, batch).consumed(11)
    first = order.samples(0, done)
    rest = n - done
    reads = [first]
    for r in range(new_world):
        plan = RankPlan(rest, new_world, r, new_batch, remainder)
        for t in range(plan.num_batches):
            a, b = plan.batch_range(t)
            reads.append(order.ids_at(done + np.arange(a, b) % rest))
    hits = np.bincount(np.concatenate(reads), minlength=n)
    pad = (-rest) % new_world if remainder == "pad" else 0
    drop = rest % new_world if remainder == "drop" else 0
    assert hits.sum() == n + pad - drop and hits.max() <= 2
    assert (hits == 2).sum() == pad and (hits == 0).sum() == drop
    new_nodes = new_world // new_local
    if local_again:
        k = nodes // new_nodes
        worst, cross, _ = locality(
            order, world=new_world, local=new_local, batch=new_batch, remainder=remainder,
            groups_of={v: list(range(v * k, (v + 1) * k)) for v in range(new_nodes)},
            cursor=done)
        assert worst >= 0.95 and cross <= pad


# --- node_schedule -----------------------------------------------------------------------------
def reference_schedule(order: NodeAffineOrder, *, world_size: int, local_world_size: int,
                       node: int, batch_size: int, remainder: str) -> NodeSchedule:
    """Shards and first/last step position per shard, from RankPlan and the whole epoch."""
    n = len(order)
    ids = full(order)
    seen: dict[int, tuple[int, int]] = {}
    for r in range(node * local_world_size, min(world_size, (node + 1) * local_world_size)):
        plan = RankPlan(n, world_size, r, batch_size, remainder)
        for t in range(plan.num_batches):
            a, b = plan.batch_range(t)
            for s in shard_of(order, ids[np.arange(a, b) % n]).tolist():
                now = t * world_size * batch_size
                f, l = seen.get(s, (now, now))
                seen[s] = (min(f, now), max(l, now))
    items = sorted(seen.items(), key=lambda kv: (kv[1][0], kv[0]))
    table = np.array([(k, f, l) for k, (f, l) in items], dtype=np.int64).reshape(-1, 3)
    shards, first, last = table.T
    return NodeSchedule(order.epoch, shards, first, last)


@settings(max_examples=80, deadline=None)
@given(counts=st.lists(st.integers(0, 25), min_size=1, max_size=20), seed=st.integers(0, 999),
       c=st.integers(1, 5), u=st.integers(1, 8), block=st.integers(1, 60),
       world=st.integers(1, 10), local=st.integers(1, 4), batch=st.integers(1, 6),
       remainder=st.sampled_from(["pad", "drop"]), node=st.integers(0, 9))
def test_node_schedule_works_unchanged(counts, seed, c, u, block, world, local, batch, remainder,
                                       node):
    order = NodeAffineOrder(np.array(counts), seed=seed, canonical_nodes=c, slice_size=u,
                            shuffle_block=block)
    kw = {"world_size": world, "local_world_size": local, "node": node, "batch_size": batch,
          "remainder": remainder}
    got, want = node_schedule(order, **kw), reference_schedule(order, **kw)
    assert sorted(zip(got.shards.tolist(), got.first.tolist(), got.last.tolist())) == \
        sorted(zip(want.shards.tolist(), want.first.tolist(), want.last.tolist()))
    assert list(got.first) == sorted(got.first)


def test_node_schedule_is_far_shorter_than_with_epoch_order() -> None:
    nodes, local, batch = 32, 4, 16
    world = nodes * local
    counts = np.random.default_rng(5).integers(150, 251, 1600)  # ~320k samples, 1,600 shards
    kw = {"world_size": world, "local_world_size": local, "batch_size": batch}
    node_order = NodeAffineOrder.for_job(counts, **kw, seed=1)
    epoch_order = EpochOrder(counts, seed=1)
    affine = [len(node_schedule(node_order, node=v, **kw)) for v in range(0, nodes, 5)]
    global_ = [len(node_schedule(epoch_order, node=v, **kw)) for v in range(0, nodes, 5)]
    ratio = np.mean(affine) / np.mean(global_)
    print(f"\nshards per node: node-affine {np.mean(affine):.1f}, EpochOrder "
          f"{np.mean(global_):.1f} (ratio {ratio:.3f}; ideal {len(counts) / nodes:.0f})")
    assert ratio < 0.1
    for v in range(nodes):  # its group's shards (two shared with neighbours), and padding's
        sched = set(node_schedule(node_order, node=v, **kw).shards.tolist())
        own = set(node_order.group_shards(v).tolist())
        assert own <= sched and len(sched - own) <= (-len(node_order)) % world


# --- shuffle quality ---------------------------------------------------------------------------
CLASSES, PER_CLASS, PER_SHARD, BATCH = 100, 1000, 100, 256


def batch_entropy(labels: np.ndarray, batch: int = BATCH) -> float:
    """Mean label entropy (nats) over the full batches of a label sequence."""
    out = []
    for i in range(0, len(labels) - batch + 1, batch):
        _, c = np.unique(labels[i: i + batch], return_counts=True)
        q = c / c.sum()
        out.append(float(-(q * np.log(q)).sum()))
    return float(np.mean(out))


def test_shuffle_quality_on_a_class_sorted_dataset() -> None:
    """100 classes x 1,000 samples packed in class order into shards of 100 (one class each):
    the batches of 256 that the ranks of a 4-node job read (C = 4, one rank per node, so a
    batch is one slot of one group) against a uniform permutation's."""
    truth = np.repeat(np.arange(CLASSES), PER_CLASS)
    counts = np.full(CLASSES * PER_CLASS // PER_SHARD, PER_SHARD)
    rng = np.random.default_rng(123)
    random_h = float(np.mean([batch_entropy(rng.permutation(truth)) for _ in range(5)]))
    figures = {}
    for c in (1, 4, 16):
        hs = [batch_entropy(truth[full(NodeAffineOrder.for_job(
            counts, world_size=c, local_world_size=1, batch_size=BATCH, seed=s))])
            for s in range(3)]
        figures[c] = float(np.mean(hs))
    print(f"\nmean per-batch label entropy (nats), batch {BATCH}, {CLASSES} classes x "
          f"{PER_CLASS}, shards of {PER_SHARD}: uniform {random_h:.3f}; " +
          ", ".join(f"C={c} {h:.3f} ({h / random_h:.3f})" for c, h in figures.items()))
    assert figures[1] >= 0.99 * random_h
    assert figures[4] >= 0.9 * random_h
    assert figures[16] > batch_entropy(truth) + 2.0  # far from class order even at S/C = 62


# --- tools/plan_scale.py --order node ----------------------------------------------------------
def test_plan_scale_node_order_is_consistent_and_stages_less() -> None:
    cfg = plan_scale.Config.small(order="node", repeats=1)
    groups = {g["group"]: g for g in plan_scale.run(cfg)}
    summary = groups["summary"]
    assert summary["consistent"] and all(summary["checks"].values())
    st_, loc = groups["staging"], groups["staging"]["locality"]
    assert (loc["canonical_nodes"], loc["slice_size"]) == (cfg.nodes,
                                                            cfg.world * cfg.batch_size // cfg.nodes)
    assert loc["cross_node_reads"] == 0 and loc["foreign_shard_copies"] == 0
    assert st_["shards_per_node"]["max"] <= cfg.shards / cfg.nodes + 2
    base = {g["group"]: g for g in plan_scale.run(plan_scale.Config.small(repeats=1))}
    assert "locality" not in base["staging"]
    assert st_["shared_fs_shard_reads"] * 5 < base["staging"]["shared_fs_shard_reads"]
    # An uneven epoch: padding is the only cross-node read, and the exact pass still agrees.
    cfg = plan_scale.Config.small(order="node", samples=20_005, repeats=1)
    groups = {g["group"]: g for g in plan_scale.run(cfg)}
    assert groups["summary"]["consistent"]
    assert groups["staging"]["locality"]["cross_node_reads"] == groups["partition"]["padding"]
    assert plan_scale.main(["--small", "--order", "node", "--canonical-nodes", "3"]) == 2


def test_at_scale_a_node_reads_its_group_not_the_epoch() -> None:
    """1,000 nodes x 8 ranks on 10M samples in 40,000 shards: building the order, one node's
    schedule and one rank's epoch of ids stay at a few MB (tracemalloc peak; numpy reports its
    buffers to it), not the epoch's 80 MB of ids."""
    import tracemalloc

    counts = np.random.default_rng(0).integers(200, 301, 40_000)
    kw = {"world_size": 8000, "local_world_size": 8, "batch_size": 32}
    tracemalloc.start()
    try:
        order = NodeAffineOrder.for_job(counts, **kw)
        sched = node_schedule(order, node=500, **kw)
        plan = RankPlan(len(order), 8000, 4003, 32)
        ids = [order.ids_at(np.arange(*plan.batch_range(t)) % len(order))
               for t in range(plan.num_batches)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20e6, peak
    assert set(order.group_shards(500).tolist()) <= set(sched.shards.tolist())
    assert len(sched) <= len(order.group_shards(500)) + 8 * 32  # + at most a padding share
    assert np.isin(shard_of(order, np.concatenate(ids)), sched.shards).all()
