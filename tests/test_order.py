"""The epoch order and its partition (``shardio.order``), checked against the contract in its
module docstring and DESIGN.md §3 "Order and partitioning".

``EpochOrder``: a permutation of every sample id, a pure function of (counts, seed, epoch),
manifest order without shuffle, memory bounded by shuffle blocks.  ``RankPlan``: equal shares and
batch counts on every rank, every position of the remaining order covered exactly once (plus
``pad`` repeats, or minus ``drop``ped samples, fewer than R either way), whole-batch worker split,
and the prefix property that makes resume exact.  The shuffle-quality figure packs a real,
class-sorted dataset and reads it back through ``ShardDataset``.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shardio
from shardio.errors import UsageError
from shardio.order import EpochOrder, RankPlan


def full(order: EpochOrder) -> np.ndarray:
    return order.samples(0, len(order))


def block_sizes(order: EpochOrder) -> np.ndarray:
    return np.diff(order.block_start)


# --- EpochOrder ------------------------------------------------------------------------------
_COUNTS = st.lists(st.integers(0, 40), min_size=0, max_size=30)


@settings(max_examples=150, deadline=None)
@given(counts=_COUNTS, seed=st.integers(0, 2**31), epoch=st.integers(0, 50),
       shuffle=st.booleans(), block=st.integers(1, 120),
       cut=st.tuples(st.floats(0, 1), st.floats(0, 1)))
def test_epoch_order_is_a_permutation_and_slices_agree(counts, seed, epoch, shuffle, block, cut):
    order = EpochOrder(np.array(counts, dtype=np.int64), seed=seed, epoch=epoch, shuffle=shuffle,
                       shuffle_block=block)
    n = sum(counts)
    assert len(order) == n
    ids = full(order)
    assert ids.dtype == np.int64
    np.testing.assert_array_equal(np.sort(ids), np.arange(n))
    # Any window of the epoch is the same slice of the full order (what readers ask for).
    a, b = sorted(int(c * n) for c in cut)
    np.testing.assert_array_equal(order.samples(a, b), ids[a:b])
    # Blocks are made of whole shards and together hold every sample once.
    assert sorted(int(s) for blk in order.block_shards for s in blk) == list(range(len(counts)))
    assert int(order.block_start[-1]) == n
    if not shuffle:
        np.testing.assert_array_equal(ids, np.arange(n))


def test_epoch_order_is_deterministic_per_seed_and_epoch() -> None:
    counts = np.full(50, 20)
    base = full(EpochOrder(counts, seed=3, epoch=2))
    # A fresh object (what every rank and worker builds for itself) gives the same order.
    np.testing.assert_array_equal(full(EpochOrder(counts.copy(), seed=3, epoch=2)), base)
    others = [full(EpochOrder(counts, seed=3, epoch=3)), full(EpochOrder(counts, seed=4, epoch=2)),
              full(EpochOrder(counts, seed=3, epoch=0))]
    for other in others:
        assert not np.array_equal(other, base)
        np.testing.assert_array_equal(np.sort(other), np.arange(1000))
    # Also with small blocks, where shard order and in-block order both depend on (seed, epoch).
    small = [full(EpochOrder(counts, seed=s, epoch=e, shuffle_block=64))
             for s, e in ((0, 0), (0, 1), (1, 0))]
    assert len({a.tobytes() for a in small}) == 3
    np.testing.assert_array_equal(small[0], full(EpochOrder(counts, seed=0, epoch=0,
                                                            shuffle_block=64)))


def test_shuffle_false_is_manifest_order_for_any_seed_and_epoch() -> None:
    counts = np.array([5, 0, 7, 3, 11, 1])
    for seed, epoch in ((0, 0), (9, 4)):
        for block in (1, 4, 1 << 18):
            order = EpochOrder(counts, seed=seed, epoch=epoch, shuffle=False, shuffle_block=block)
            np.testing.assert_array_equal(full(order), np.arange(27))


@pytest.mark.parametrize("shuffle", [True, False])
def test_shuffle_blocks_bound_memory(shuffle: bool) -> None:
    """The docstring: memory is bounded by one block, never an array over the whole dataset."""
    counts = np.full(400, 10)  # 4000 samples in shards of 10
    order = EpochOrder(counts, seed=1, epoch=0, shuffle=shuffle, shuffle_block=100)
    sizes = block_sizes(order)
    # Shards start at multiples of 10, so a block of 100 holds exactly 10 shards.
    assert len(sizes) == 40
    assert set(sizes.tolist()) == {100}
    # The order object itself holds per-shard arrays only (plus the one cached block).
    for name, value in vars(order).items():
        if isinstance(value, np.ndarray):
            assert value.size <= len(counts) + 1, name
    seen = 0
    for b in range(len(sizes)):
        ids = order.block(b)
        assert len(ids) == 100
        seen += len(ids)
        # A block holds whole shards: its ids are exactly those of its shards.
        expect = np.concatenate([np.arange(s * 10, s * 10 + 10) for s in order.block_shards[b]])
        np.testing.assert_array_equal(np.sort(ids), np.sort(expect))
    assert seen == 4000

    # Uneven shards: a block never exceeds shuffle_block + (largest shard - 1).
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 37, size=300)
    for sb in (1, 16, 50, 200):
        order = EpochOrder(counts, seed=2, epoch=1, shuffle=shuffle, shuffle_block=sb)
        sizes = block_sizes(order)
        assert sizes.max() <= sb + counts.max() - 1
        assert len(sizes) >= counts.sum() // (sb + counts.max())


def test_small_dataset_is_one_uniform_block() -> None:
    """At most ``shuffle_block`` samples: a uniform permutation, not a shard-by-shard order."""
    counts = np.array([5, 5, 5, 5])
    first = Counter()
    for seed in range(4000):
        order = EpochOrder(counts, seed=seed, epoch=0, shuffle_block=20)
        assert len(order.block_shards) == 1
        first[int(order.samples(0, 1)[0])] += 1
    # Each of the 20 ids comes first ~200 times; 6 sigma bounds.
    assert set(first) == set(range(20))
    sigma = math.sqrt(4000 * (1 / 20) * (19 / 20))
    assert all(abs(c - 200) < 6 * sigma for c in first.values()), first


def test_epoch_order_rejects_bad_block() -> None:
    with pytest.raises(UsageError, match="shuffle_block"):
        EpochOrder(np.array([3]), shuffle_block=0)


# --- RankPlan --------------------------------------------------------------------------------
def rank_positions(plan: RankPlan) -> list[list[int]]:
    """Per step, the remaining-order positions this rank's batch covers."""
    return [list(range(*plan.batch_range(t))) for t in range(plan.num_batches)]


def plans(m: int, r: int, b: int, remainder: str) -> list[RankPlan]:
    return [RankPlan(m, r, rank, b, remainder) for rank in range(r)]


@settings(max_examples=400, deadline=None)
@given(m=st.integers(0, 400), r=st.integers(1, 9), b=st.integers(1, 40),
       remainder=st.sampled_from(["pad", "drop"]), w=st.integers(1, 5))
def test_rank_plan_partition(m: int, r: int, b: int, remainder: str, w: int) -> None:
    ranks = plans(m, r, b, remainder)
    # Every rank: the same number of samples and batches (no DDP collective can hang).
    assert len({p.per_rank for p in ranks}) == 1
    assert len({p.num_batches for p in ranks}) == 1
    per_rank, nb = ranks[0].per_rank, ranks[0].num_batches
    if m == 0:
        assert per_rank == nb == 0
    expect_per_rank = -(-m // r) if remainder == "pad" else m // r
    assert per_rank == expect_per_rank
    assert nb == -(-per_rank // b)

    covered: Counter[int] = Counter()
    for p in ranks:
        steps = rank_positions(p)
        sizes = [len(s) for s in steps]
        # Whole batches of B except possibly the last one.
        assert sum(sizes) == per_rank
        assert all(sz == b for sz in sizes[:-1]) and all(0 < sz <= b for sz in sizes)
        covered.update(x for step in steps for x in step)
        # Workers serve whole steps, each step by exactly one worker, in round-robin order.
        served = [t for wk in range(w) for t in p.worker_steps(wk, w)]
        assert sorted(served) == list(range(nb))
        for wk in range(w):
            assert list(p.worker_steps(wk, w)) == list(range(wk, nb, w))

    # The union over ranks and steps is the contiguous range [0, R * per_rank), each once.
    assert all(c == 1 for c in covered.values())
    assert sorted(covered) == list(range(r * per_rank))
    if remainder == "pad":
        # Wrapped padding: positions >= M repeat the start of the order; fewer than R of them.
        wrapped = Counter(x % m for x in covered) if m else Counter()
        assert set(wrapped) == set(range(m))
        extra = sum(wrapped.values()) - m
        assert 0 <= extra < r
        assert extra == (-m) % r
    else:
        dropped = m - len(covered)
        assert 0 <= dropped < r
        assert dropped == m % r
        assert all(x < m for x in covered)

    # Prefix property: after k steps on every rank, the delivered positions are exactly
    # [0, consumed(k)) = [0, k*R*B); after the last step, all M are consumed.
    for k in range(nb + 1):
        got = {x for p in ranks for step in rank_positions(p)[:k] for x in step}
        consumed = ranks[0].consumed(k)
        assert len({p.consumed(k) for p in ranks}) == 1
        if k == 0:
            assert consumed == 0 and not got
        elif k < nb:
            assert consumed == k * r * b
            assert got == set(range(consumed))
        else:  # the last step: the whole remaining order is consumed (padding/drop included)
            assert consumed == m
            assert got == covered.keys()
    assert ranks[0].consumed(nb + 3) == ranks[0].consumed(nb)


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_rank_plan_examples(remainder: str) -> None:
    # 10 samples on 3 ranks, batch 2.
    p = plans(10, 3, 2, remainder)
    if remainder == "pad":
        assert p[0].per_rank == 4 and p[0].num_batches == 2
        assert [p[r].batch_range(0) for r in range(3)] == [(0, 2), (2, 4), (4, 6)]
        assert [p[r].batch_range(1) for r in range(3)] == [(6, 8), (8, 10), (10, 12)]
    else:
        assert p[0].per_rank == 3 and p[0].num_batches == 2
        assert [p[r].batch_range(1) for r in range(3)] == [(6, 7), (7, 8), (8, 9)]
    # More ranks than samples.
    q = plans(2, 5, 4, remainder)
    assert {x.per_rank for x in q} == ({1} if remainder == "pad" else {0})


def test_rank_plan_rejects_bad_arguments() -> None:
    with pytest.raises(UsageError, match="remainder"):
        RankPlan(10, 2, 0, 2, "wrap")
    with pytest.raises(UsageError, match="batch_size"):
        RankPlan(10, 2, 0, 0)


# --- shuffle quality on a real, class-sorted dataset -----------------------------------------
CLASSES, PER_CLASS, BATCH = 100, 30, 256


@pytest.fixture(scope="module")
def class_sorted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """100 classes x 30 tiny samples, packed in class order into shards of 10 (one class each)."""
    base = tmp_path_factory.mktemp("classes")
    src, out = base / "src", base / "ds"
    for c in range(CLASSES):
        d = src / f"class_{c:03d}"
        d.mkdir(parents=True)
        for i in range(PER_CLASS):
            (d / f"s{i:03d}.txt").write_text(f"{c}/{i}")
    shardio.pack(src, out, label_from_dir=True, samples_per_shard=10, fsync=False,
                 progress=False)
    return out


def batch_entropy(labels: np.ndarray, batch: int = BATCH) -> float:
    """Mean label entropy (nats) over the full batches of a label sequence."""
    out = []
    for i in range(0, len(labels) - batch + 1, batch):
        _, c = np.unique(labels[i : i + batch], return_counts=True)
        q = c / c.sum()
        out.append(float(-(q * np.log(q)).sum()))
    return float(np.mean(out))


def delivered_labels(root: Path, **options: object) -> np.ndarray:
    from torch.utils.data import DataLoader

    ds = shardio.ShardDataset(root, decode=True, batch_size=BATCH, **options)
    labels = [int(x) for b in DataLoader(ds, batch_size=BATCH) for x in b["cls"]]
    assert len(labels) == CLASSES * PER_CLASS
    return np.array(labels)


def test_shuffle_quality_matches_a_random_permutation(class_sorted: Path) -> None:
    truth = np.repeat(np.arange(CLASSES), PER_CLASS)
    manifest_order = delivered_labels(class_sorted, shuffle=False)
    np.testing.assert_array_equal(manifest_order, truth)  # the source really is class-sorted
    rng = np.random.default_rng(123)
    random_h = float(np.mean([batch_entropy(rng.permutation(truth)) for _ in range(20)]))
    default_h = float(np.mean([batch_entropy(delivered_labels(class_sorted, seed=s))
                               for s in range(3)]))
    block_h = float(np.mean([batch_entropy(delivered_labels(class_sorted, seed=s,
                                                            shuffle_block=300))
                             for s in range(3)]))
    sorted_h = batch_entropy(truth)
    print(f"\nmean per-batch label entropy (nats), batch {BATCH}, {CLASSES} classes x {PER_CLASS}:"
          f"\n  uniform random permutation     {random_h:.3f}"
          f"\n  ShardDataset defaults          {default_h:.3f} ({default_h / random_h:.3f} of random)"
          f"\n  ShardDataset shuffle_block=300 {block_h:.3f} ({block_h / random_h:.3f} of random)"
          f"\n  no shuffle (class order)       {sorted_h:.3f} ({sorted_h / random_h:.3f} of random)")
    assert default_h >= 0.95 * random_h
    # A block of 300 samples (30 single-class shards out of 300) is a bounded shuffle: worse
    # than uniform, far better than class order.
    assert block_h > 0.5 * random_h
    assert block_h > sorted_h + 1.0


def test_epoch_order_matches_dataset_delivery(class_sorted: Path) -> None:
    """ShardDataset delivers exactly EpochOrder's sequence (single process, no padding)."""
    ds = shardio.ShardDataset(class_sorted, seed=5, shuffle_block=128)
    ds.set_epoch(2)
    keys = [s["__key__"] for s in ds]
    manifest_keys = [s["__key__"] for s in ds.reader]
    order = EpochOrder(np.diff(ds.reader.offsets), seed=5, epoch=2, shuffle_block=128)
    assert keys == [manifest_keys[i] for i in full(order)]
    assert os.path.isdir(ds.path)


@pytest.mark.parametrize("world,local,batch", [(4, 2, 3), (6, 2, 2), (3, 3, 4), (5, 2, 1), (1, 1, 8)])
def test_node_schedule_matches_the_rank_plans_of_its_ranks(world, local, batch):
    from shardio.order import node_schedule

    counts = np.array([10, 7, 13, 5, 9, 11, 6, 8])
    order = EpochOrder(counts, seed=1, epoch=2, shuffle_block=30)
    n = len(order)
    ids = order.samples(0, n)
    covered = set()
    for node in range(-(-world // local)):
        sched = node_schedule(order, world_size=world, local_world_size=local, node=node,
                              batch_size=batch)
        expect: dict[int, tuple[int, int]] = {}
        for r in range(node * local, min(world, (node + 1) * local)):
            plan = RankPlan(n, world, r, batch)
            for t in range(plan.num_batches):
                a, b = plan.batch_range(t)
                for pos in range(a, b):
                    s = int(np.searchsorted(order.offsets, ids[pos % n], side="right") - 1)
                    f, l = expect.get(s, (t * world * batch,) * 2)
                    expect[s] = (min(f, t * world * batch), max(l, t * world * batch))
        got = {int(s): (int(f), int(l)) for s, f, l in zip(sched.shards, sched.first, sched.last)}
        assert got == expect
        assert list(sched.first) == sorted(sched.first)
        covered |= set(got)
    assert covered == set(range(len(counts)))
