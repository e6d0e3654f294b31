"""Plan an epoch at scale: the cost of shardio's order and partition for a large job, and the
shared-filesystem traffic that the resulting staging schedules cause.

``python tools/plan_scale.py`` simulates 1,000 nodes x 8 ranks x 8 data-loader workers on a
synthetic 10-million-sample, 40,000-shard manifest over 100 Lustre OSTs, without touching any
file; ``--small`` is a tiny configuration for the test suite.  It prints one JSON line per
figure group, then a readable summary (lines starting with ``#``) with each target and
PASS/MISS.  Exit status: 0 when every consistency check holds (targets may MISS), 1 when one
fails, 2 for a usage error.

The synthetic manifest (seeded by ``--seed``): samples per shard ``mean * U(1-s, 1+s)`` scaled to
sum to exactly ``--samples`` (largest remainders), ``s = --spread``; bytes per shard
``--shard-mb`` MB (10^6) on average, proportional to the samples times ``U(0.9, 1.1)``; one
stripe per shard (``PackOptions.stripe_count=1``), on the OST that Lustre's round-robin
allocator gives shard ``i`` when files are created in manifest order (``(k + i) mod --osts``,
``k`` seeded), or a seeded uniform OST (``--ost-layout random``, what the weighted QoS
allocator tends to when OSTs are unevenly full).

``--order node`` plans with :class:`~shardio.order.NodeAffineOrder` instead of EpochOrder,
made by ``NodeAffineOrder.for_job`` for the simulated job: C = ``--canonical-nodes`` (default the
node count), U = R*B/C, q = R/C, the job's remainder.  Its blocks are per group; a shard split
between two groups lies in two blocks, so the exact pass merges (node, shard) and
(rank-worker, shard) pairs over blocks before counting them, and ``staging`` gains ``locality``:
per (node, group) reads, a group's *home* the node that reads most of it, cross-node reads
(reads outside the reader's home groups: padding, or the last step when the job is not the
order's canonical job) and the shards each node stages outside its home groups' shards.  The
default ``--window-step`` is then 0, where a node first reads nearly all of its group.

Figure groups
    ``rank_plan``: wall time and peak memory on ONE rank (``--rank``) to build the
        :class:`~shardio.order.EpochOrder` and the sample ids of every batch the rank reads in
        the epoch (a :class:`~shardio.order.RankPlan` and ``EpochOrder.samples`` per step).
        ``node_schedule``: the same for the staging schedule of that rank's node (EpochOrder
        plus :func:`~shardio.order.node_schedule`).  Time: median of ``--repeats`` runs, plus
        the first.  Memory: the *tracemalloc* peak of one more run (every Python and numpy
        allocation made during the call; numpy reports its buffers to tracemalloc), not RSS,
        which counts the interpreter and earlier allocations too.  Targets: < 1 s, < 100 MB.
    ``partition`` (exact): every epoch position is given to a rank by the RankPlan rule (step
        ``t = p // (R*B)``, rank ``(p - t*R*B) // b_t``, ``b_t`` the step's batch size; only the
        last step is partial) and mapped to a sample (``p mod M``: padding wraps); every rank's
        count must be ``per_rank``; every sample read once, plus ``pad`` repeats or minus
        ``drop``ped ones.  The rule is cross-checked against ``RankPlan.batch_range`` for the
        ranks of the sampled nodes.
    ``staging``: what each node stages per epoch: the shards of its schedule, each copied once
        (the stager copies a scheduled shard once), and their bytes.  *Exact* for every node
        from one vectorised pass over the epoch, one shuffle block at a time (a shard lies in
        exactly one block, so the (node, shard) pairs of different blocks are distinct);
        *sampled*: ``node_schedule`` itself for ``--nodes-sampled`` nodes spread over the job,
        checked for duplicate shards and compared pair by pair (shard, first, last) with the
        exact pass.  Shared-filesystem reads per epoch = the sum over nodes of their shards,
        against the dataset's shard count.
    ``ost``: bytes read per OST over the epoch (every (node, shard) pair staged), max/mean,
        target <= 1.2.  Also, per step window, the bytes of the copies all nodes start in that
        step (a stager copies a shard before its first use; the step is when that use begins),
        max/mean over OSTs.  In a step every node reads the same ~one shuffle block, so a
        window's load follows how that block's shards happen to fall on OSTs: reordering inside
        a node cannot change it.  What reordering can change is the copies in flight at one
        instant: ``--inflight`` copies per node, nodes in lockstep, each node working through
        the shards it first reads in step ``--window-step`` in schedule order, and the same with
        each ``--prefetch-window`` of that queue reordered by
        :func:`~shardio.lustre.spread_by_ost` (width ``--inflight``, as the reader's read-ahead
        does) so one node's copies in flight sit on distinct OSTs, and, for comparison, with
        each node's queue for the step permuted by a node-seeded generator.  Reported: max/mean
        OST count of concurrent copies, averaged over the rounds in which every node still
        copies (and the worst round).  Schedule order within a step is by shard id, the same on
        every node, so nodes in lockstep copy the same few shards at once: the hot spot is
        shards, not a node's own OST choice, and ``spread_by_ost`` inside a node barely moves
        it; a per-node order of the step's shards does.
    ``metadata``: metadata operations per epoch.  Small files: 2 per sample read, open + stat
        (close, a third MDS RPC on Lustre, is not counted, so the baseline is if anything low).
        shardio: 3 per shard copy a process opens, as ``DatasetReader._open_copy`` does (stat of
        the shard, open to load its index, open of the shard); the stager's copy costs the same
        (open of the index, open of the shard, stat of the index once).  With staging only the
        stager touches the shared filesystem: 3 x (node, shard) pairs.  Without staging every
        data-loader worker of every rank opens the shards its steps touch: 3 x (rank-worker,
        shard) pairs, exact, a lower bound (the reader keeps at most ``max_open_shards`` shards
        open and reopens one needed again after eviction).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shardio.lustre import spread_by_ost  # noqa: E402
from shardio.order import EpochOrder, NodeAffineOrder, RankPlan, node_schedule  # noqa: E402

OPS_SMALL_FILE = 2  # open + stat per sample
OPS_SHARD_OPEN = 3  # stat + index open + shard open per shard copy opened
TARGET_SECONDS, TARGET_MB, TARGET_OST = 1.0, 100.0, 1.2
ORDERS = ("epoch", "node")
Order = EpochOrder | NodeAffineOrder


@dataclass(frozen=True, kw_only=True)
class Config:
    """One simulated job and dataset (see the module docstring and ``--help``)."""

    nodes: int = 1000
    ranks_per_node: int = 8
    workers: int = 8
    samples: int = 10_000_000
    shards: int = 40_000
    osts: int = 100
    batch_size: int = 32
    seed: int = 0
    epoch: int = 0
    shuffle_block: int = 1 << 18
    remainder: str = "pad"
    shard_mb: float = 256.0
    spread: float = 0.2
    ost_layout: str = "round-robin"
    rank: int = 0
    nodes_sampled: int = 16
    inflight: int = 4
    prefetch_window: int = 16
    window_step: int | None = None
    repeats: int = 3
    order: str = "epoch"
    canonical_nodes: int | None = None

    @classmethod
    def small(cls, **changes: Any) -> Config:
        """8 nodes x 2 ranks x 2 workers, 20,000 samples in 200 shards on 10 OSTs, 5 blocks."""
        base = cls(nodes=8, ranks_per_node=2, workers=2, samples=20_000, shards=200, osts=10,
                   shuffle_block=4096, nodes_sampled=8, inflight=2, prefetch_window=4)
        return replace(base, **changes)

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "workers", "shards", "osts", "batch_size",
                     "shuffle_block", "inflight", "prefetch_window", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.samples < self.shards:
            raise ValueError(f"samples ({self.samples}) must be >= shards ({self.shards})")
        if not 0 <= self.spread < 1:
            raise ValueError(f"spread must be in [0, 1), got {self.spread}")
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")
        if self.canonical_nodes is not None and self.canonical_nodes < 1:
            raise ValueError(f"canonical_nodes must be >= 1, got {self.canonical_nodes}")
        if self.ost_layout not in ("round-robin", "random"):
            raise ValueError(f"ost_layout must be round-robin or random, got {self.ost_layout}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank}")

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class Manifest:
    """The synthetic manifest: samples, bytes and OST of each shard, in manifest order."""

    counts: np.ndarray
    sizes: np.ndarray
    osts: np.ndarray


def synthetic_manifest(cfg: Config) -> Manifest:
    rng = np.random.default_rng([cfg.seed, 0x5CA1E])
    s = cfg.shards
    weight = rng.uniform(1 - cfg.spread, 1 + cfg.spread, s)
    exact = weight / weight.sum() * cfg.samples
    counts = np.floor(exact).astype(np.int64)
    short = cfg.samples - int(counts.sum())  # 0 <= short < s: largest remainders get one more
    counts[np.argsort(counts - exact, kind="stable")[:short]] += 1
    per_sample = cfg.shard_mb * 1e6 * s / cfg.samples
    sizes = np.rint(counts * per_sample * rng.uniform(0.9, 1.1, s)).astype(np.int64)
    if cfg.ost_layout == "round-robin":
        osts = (int(rng.integers(cfg.osts)) + np.arange(s)) % cfg.osts
    else:
        osts = rng.integers(cfg.osts, size=s)
    return Manifest(counts, sizes, osts.astype(np.int64))


def make_order(cfg: Config, counts: np.ndarray) -> Order:
    """The epoch order ``--order`` names; ``node``: ``NodeAffineOrder.for_job`` (C =
    ``--canonical-nodes``, default the node count, U = R*B/C, q = R/C, this remainder)."""
    if cfg.order == "epoch":
        return EpochOrder(counts, seed=cfg.seed, epoch=cfg.epoch,
                          shuffle_block=cfg.shuffle_block)
    return NodeAffineOrder.for_job(counts, world_size=cfg.world,
                                   local_world_size=cfg.ranks_per_node,
                                   batch_size=cfg.batch_size, canonical_nodes=cfg.canonical_nodes,
                                   remainder=cfg.remainder, seed=cfg.seed, epoch=cfg.epoch,
                                   shuffle_block=cfg.shuffle_block)


def blocks(order: Order) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
    """``(group, epoch positions, sample ids)`` of each shuffle block, positions increasing;
    together every position once.  EpochOrder has one group, 0."""
    if isinstance(order, EpochOrder):
        for b in range(len(order.block_shards)):
            lo, hi = int(order.block_start[b]), int(order.block_start[b + 1])
            yield 0, np.arange(lo, hi, dtype=np.int64), order.block(b)
    else:
        for k in range(order.num_blocks):
            yield int(order.block_group[k]), order.block_positions(k), order.block(k)


def num_blocks(order: Order) -> int:
    return len(order.block_shards) if isinstance(order, EpochOrder) else order.num_blocks


def make_plan(cfg: Config, n: int, rank: int = 0) -> RankPlan:
    return RankPlan(n, cfg.world, rank, cfg.batch_size, cfg.remainder)


# --- one rank's planning, timed ----------------------------------------------------------------
def ids_at(order: Order, start: int, stop: int) -> np.ndarray:
    """Sample ids at remaining-order positions ``[start, stop)`` (padding wraps modulo M)."""
    n = len(order)
    positions = np.arange(start, stop, dtype=np.int64) % n
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    runs = np.split(positions, breaks) if len(positions) else []
    return np.concatenate([order.samples(int(r[0]), int(r[-1]) + 1) for r in runs]) \
        if runs else positions


def plan_rank(cfg: Config, counts: np.ndarray) -> list[np.ndarray]:
    """What one rank computes per epoch: the order and the ids of each of its batches."""
    order = make_order(cfg, counts)
    plan = make_plan(cfg, len(order), cfg.rank)
    return [ids_at(order, *plan.batch_range(t)) for t in range(plan.num_batches)]


def plan_node(cfg: Config, counts: np.ndarray, node: int) -> Any:
    """What a node's stager computes per epoch: the order and the node's schedule."""
    return node_schedule(make_order(cfg, counts), world_size=cfg.world,
                         local_world_size=cfg.ranks_per_node, node=node,
                         batch_size=cfg.batch_size, remainder=cfg.remainder)


def measure(fn: Callable[[], Any], repeats: int) -> tuple[dict[str, float], Any]:
    """Wall time (median of ``repeats`` untraced runs, and the first) and tracemalloc peak."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
        del out
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        out = fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return {"seconds": statistics.median(times), "seconds_first": times[0],
            "peak_mb": peak / 1e6, "memory": "tracemalloc peak"}, out


# --- the exact pass over the epoch -------------------------------------------------------------
def rank_of(cfg: Config, plan: RankPlan, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(rank, step)`` reading each remaining-order position ``p < R * per_rank``."""
    rb = cfg.world * cfg.batch_size
    step = p // rb  # every step but the last is full, so steps start at multiples of R*B
    bt = np.minimum(cfg.batch_size, plan.per_rank - step * cfg.batch_size)
    return (p - step * rb) // bt, step


def _pairs(key: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct keys with the first and last step each occurs at (``step`` nondecreasing)."""
    k = np.argsort(key, kind="stable")
    ks, st = key[k], step[k]
    cut = np.flatnonzero(np.diff(ks)) + 1
    lo = np.concatenate([[0], cut]).astype(np.int64)
    hi = np.concatenate([cut, [len(ks)]]).astype(np.int64) - 1
    return ks[lo], st[lo], st[hi]


def epoch_pass(cfg: Config, man: Manifest, order: Order, keep: set[int],
               window_step: int) -> dict[str, Any]:
    """Every position of the epoch, one shuffle block at a time; see the module docstring."""
    n, s, o, w = len(order), cfg.shards, cfg.osts, cfg.workers
    plan = make_plan(cfg, n)
    total, steps = cfg.world * plan.per_rank, plan.num_batches
    # EpochOrder's blocks hold whole shards; NodeAffineOrder splits a shard between two groups,
    # so its (node, shard) and (rank-worker, shard) pairs are merged over blocks at the end.
    disjoint = isinstance(order, EpochOrder)
    groups = order.canonical_nodes if isinstance(order, NodeAffineOrder) else 1
    acc = {"node_shards": np.zeros(cfg.nodes, np.int64),
           "node_bytes": np.zeros(cfg.nodes, np.int64),
           "rank_reads": np.zeros(cfg.world, np.int64), "ost_bytes": np.zeros(o, np.int64),
           "step_ost_bytes": np.zeros(steps * o, np.int64), "hits": np.zeros(n, np.int32),
           "node_group_reads": np.zeros(cfg.nodes * groups, np.int64),
           "rw_pairs": 0, "kept": [], "window": []}
    rw_keys: list[np.ndarray] = []
    pairs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    keep_arr = np.array(sorted(keep), dtype=np.int64)
    for group, pos, ids in blocks(order):
        # positions reading this block: pos + j*n for each wrap j, below total (pad wraps)
        runs = [(pos[:np.searchsorted(pos, total - j * n)] + j * n)
                for j in range(-(-total // n)) if n]
        runs = [r for r in runs if len(r)]
        if not runs:
            continue
        read = []
        for p in runs:  # each run reads distinct samples: fancy-index increments are exact
            read.append(ids[:len(p)])
            acc["hits"][read[-1]] += 1
        p = np.concatenate(runs)
        shard = np.searchsorted(order.offsets, np.concatenate(read), side="right") - 1
        rank, step = rank_of(cfg, plan, p)
        node = rank // cfg.ranks_per_node
        acc["rank_reads"] += np.bincount(rank, minlength=cfg.world)
        acc["node_group_reads"] += np.bincount(node * groups + group,
                                               minlength=cfg.nodes * groups)
        rw = np.unique((rank * w + step % w) * s + shard)
        key, first, last = _pairs(node * s + shard, step)
        if disjoint:
            acc["rw_pairs"] += len(rw)
            _add_pairs(cfg, man, acc, key, first, last, keep_arr, window_step)
        else:
            rw_keys.append(rw)
            pairs.append((key, first, last))
    if not disjoint:
        acc["rw_pairs"] = len(np.unique(np.concatenate(rw_keys))) if rw_keys else 0
        if pairs:
            key, first, last = (np.concatenate(x) for x in zip(*pairs))
            k = np.lexsort((first, key))
            key, first, last = key[k], first[k], last[k]
            lo = np.flatnonzero(np.concatenate([[True], np.diff(key) != 0]))
            key, first, last = key[lo], first[lo], np.maximum.reduceat(last, lo)
            _add_pairs(cfg, man, acc, key, first, last, keep_arr, window_step)
            acc["node_foreign_shards"] = foreign_shards(cfg, order, acc, key)
    for name, cols in (("kept", 4), ("window", 2)):
        acc[name] = np.concatenate(acc[name]) if acc[name] else np.zeros((0, cols), np.int64)
    acc["step_ost_bytes"] = acc["step_ost_bytes"].reshape(steps, o)
    acc["node_group_reads"] = acc["node_group_reads"].reshape(cfg.nodes, groups)
    acc.update(plan=plan, total=total, steps=steps)
    return acc


def foreign_shards(cfg: Config, order: NodeAffineOrder, acc: dict[str, Any],
                   key: np.ndarray) -> np.ndarray:
    """Per node, the shards it stages outside its home groups (a group's home: the node that
    reads most of its samples) from the distinct (node, shard) ``key``s of the epoch."""
    s, groups = cfg.shards, order.canonical_nodes
    home = acc["node_group_reads"].reshape(cfg.nodes, groups).argmax(axis=0)
    home_keys = np.concatenate([home[g] * s + order.group_shards(g) for g in range(groups)])
    foreign = ~np.isin(key, home_keys)
    return np.bincount(key[foreign] // s, minlength=cfg.nodes)


def _add_pairs(cfg: Config, man: Manifest, acc: dict[str, Any], key: np.ndarray,
               first: np.ndarray, last: np.ndarray, keep_arr: np.ndarray,
               window_step: int) -> None:
    """Account distinct (node, shard) staging pairs (``key = node * shards + shard``) read from
    step ``first`` to ``last``."""
    s, o = cfg.shards, cfg.osts
    steps = len(acc["step_ost_bytes"]) // o
    node, sh = key // s, key % s
    size, ost = man.sizes[sh], man.osts[sh]
    acc["node_shards"] += np.bincount(node, minlength=cfg.nodes)
    acc["node_bytes"] += np.rint(np.bincount(node, size, cfg.nodes)).astype(np.int64)
    acc["ost_bytes"] += np.rint(np.bincount(ost, size, o)).astype(np.int64)
    acc["step_ost_bytes"] += np.rint(np.bincount(first * o + ost, size, steps * o)).astype(
        np.int64)
    m = np.isin(node, keep_arr)
    acc["kept"].append(np.stack([node[m], sh[m], first[m], last[m]], axis=1))
    m = first == window_step
    acc["window"].append(np.stack([node[m], sh[m]], axis=1))


# --- figure groups -----------------------------------------------------------------------------
def partition_figures(cfg: Config, acc: dict[str, Any], ranks: Sequence[int]) -> dict[str, Any]:
    plan, n, total, hits = acc["plan"], len(acc["hits"]), acc["total"], acc["hits"]
    agree = True
    for r in ranks:  # the vectorised rule against RankPlan itself
        rp = make_plan(cfg, n, r)
        for t in range(rp.num_batches):
            a, b = rp.batch_range(t)
            got_rank, got_step = rank_of(cfg, plan, np.arange(a, b, dtype=np.int64))
            agree &= bool(np.all(got_rank == r) and np.all(got_step == t))
    per_hit = np.bincount(hits, minlength=3)
    return {"group": "partition", "method": "exact", "samples": n, "ranks": cfg.world,
            "per_rank": plan.per_rank, "batches_per_rank": plan.num_batches,
            "reads": total, "sum_over_ranks": int(acc["rank_reads"].sum()),
            "every_rank_per_rank": bool(np.all(acc["rank_reads"] == plan.per_rank)),
            "samples_read_once": int(per_hit[1]), "samples_read_twice": int(per_hit[2]),
            "samples_read_more": int(per_hit[3:].sum()), "samples_not_read": int(per_hit[0]),
            "padding": total - n if cfg.remainder == "pad" else 0,
            "dropped": n - total if cfg.remainder == "drop" else 0,
            "ranks_cross_checked": len(ranks), "rule_matches_rank_plan": agree}


def sampled_nodes(cfg: Config) -> list[int]:
    k = min(cfg.nodes_sampled, cfg.nodes)
    return sorted({int(x) for x in np.linspace(0, cfg.nodes - 1, k).round()})


def staging_figures(cfg: Config, man: Manifest, order: Order, acc: dict[str, Any],
                    nodes: Sequence[int]) -> dict[str, Any]:
    rb = cfg.world * cfg.batch_size
    kept = acc["kept"]
    per_node, max_reads, agree, dups = {}, 0, True, 0
    t0 = time.perf_counter()
    for v in nodes:
        sched = node_schedule(order, world_size=cfg.world, local_world_size=cfg.ranks_per_node,
                              node=v, batch_size=cfg.batch_size, remainder=cfg.remainder)
        _, reads = np.unique(sched.shards, return_counts=True)
        max_reads = max(max_reads, int(reads.max()) if len(reads) else 0)
        dups += int((reads > 1).sum())
        mine = kept[kept[:, 0] == v]
        mine = mine[np.argsort(mine[:, 1])]
        k = np.argsort(sched.shards)
        agree &= bool(np.array_equal(sched.shards[k], mine[:, 1])
                      and np.array_equal(sched.first[k], mine[:, 2] * rb)
                      and np.array_equal(sched.last[k], mine[:, 3] * rb)
                      and np.all(np.diff(sched.first) >= 0))
        per_node[v] = {"shards": len(sched), "bytes": int(man.sizes[sched.shards].sum()),
                       "exact_shards": int(acc["node_shards"][v]),
                       "exact_bytes": int(acc["node_bytes"][v])}
    sampled_s = time.perf_counter() - t0
    nb, ns = acc["node_bytes"], acc["node_shards"]
    reads, dataset = int(ns.sum()), int(man.sizes.sum())
    fs_bytes = int(nb.sum())
    node_samples = acc["plan"].per_rank * cfg.ranks_per_node
    return {"group": "staging", "exact": "all nodes (vectorised pass)",
            "sampled": f"node_schedule for {len(nodes)} nodes", "sampled_nodes": list(nodes),
            "sampled_seconds": sampled_s,
            "per_node_sampled": {str(v): d for v, d in per_node.items()},
            "sampled_equals_exact": agree and all(d["bytes"] == d["exact_bytes"] and
                                                  d["shards"] == d["exact_shards"]
                                                  for d in per_node.values()),
            "duplicate_shards_in_schedules": dups, "max_reads_per_shard_per_node": max_reads,
            "shards_per_node": _spread(ns), "bytes_per_node": _spread(nb),
            "samples_per_node": node_samples,
            "samples_per_staged_shard": node_samples / max(float(ns.mean()), 1e-9),
            "shared_fs_shard_reads": reads, "dataset_shards": cfg.shards,
            "shared_fs_bytes": fs_bytes, "dataset_bytes": dataset,
            "read_amplification": fs_bytes / dataset,
            **({"locality": locality_figures(order, acc)}
               if isinstance(order, NodeAffineOrder) else {})}


def locality_figures(order: NodeAffineOrder, acc: dict[str, Any]) -> dict[str, Any]:
    """Reads of each node outside its home groups (those it reads most of): exact."""
    ngr = acc["node_group_reads"]
    home = ngr.argmax(axis=0)
    local = np.bincount(home, ngr[home, np.arange(ngr.shape[1])], ngr.shape[0])
    reads = ngr.sum(axis=1)
    cross = reads - local.astype(np.int64)
    frac = np.divide(local, reads, out=np.ones(len(reads)), where=reads > 0)
    return {"canonical_nodes": order.canonical_nodes, "slice_size": order.slice_size,
            "group_samples": _spread(order.group_sizes),
            "cross_node_reads": int(cross.sum()),
            "cross_node_read_fraction": float(cross.sum() / max(int(reads.sum()), 1)),
            "cross_node_reads_per_node": _spread(cross),
            "min_node_local_fraction": float(frac.min()),
            "nodes_with_cross_reads": int((cross > 0).sum()),
            "foreign_shards_per_node": _spread(acc["node_foreign_shards"]),
            "foreign_shard_copies": int(acc["node_foreign_shards"].sum())}


def _spread(x: np.ndarray) -> dict[str, float]:
    return {"min": int(x.min()), "mean": float(x.mean()), "max": int(x.max())}


def _ratio(x: np.ndarray) -> float:
    mean = float(np.mean(x))
    return float(np.max(x)) / mean if mean > 0 else 0.0


def inflight_spread(cfg: Config, man: Manifest, window: np.ndarray) -> dict[str, float]:
    """Max/mean OST count of the copies in flight, in schedule order and spread by OST."""
    k, o = cfg.inflight, cfg.osts
    ost = man.osts.tolist()
    queues: dict[int, list[int]] = {}
    for v, sh in window[np.lexsort((window[:, 1], window[:, 0]))].tolist():
        queues.setdefault(v, []).append(sh)  # node_schedule order: first, then shard id
    spread, shuffled = {}, {}
    for v, q in queues.items():
        out: list[int] = []
        for i in range(0, len(q), cfg.prefetch_window):
            out += spread_by_ost(q[i:i + cfg.prefetch_window], ost.__getitem__, k)
        spread[v] = out
        shuffled[v] = [q[i] for i in np.random.default_rng([cfg.seed, v]).permutation(len(q))]
    rounds = min((len(q) for q in queues.values()), default=0) // k
    result: dict[str, float] = {"nodes": len(queues), "rounds_all_nodes_active": rounds}
    for name, qs in (("schedule_order", queues), ("spread_by_ost", spread),
                     ("node_shuffled", shuffled)):
        ratios = []
        for j in range(rounds):
            load = np.bincount([ost[sh] for q in qs.values() for sh in q[j * k:(j + 1) * k]],
                               minlength=o)
            ratios.append(_ratio(load))
        result[f"{name}_mean_max_over_mean"] = float(np.mean(ratios)) if ratios else 0.0
        result[f"{name}_worst_max_over_mean"] = float(np.max(ratios)) if ratios else 0.0
    return result


def ost_figures(cfg: Config, man: Manifest, acc: dict[str, Any], window_step: int
                ) -> dict[str, Any]:
    sob = acc["step_ost_bytes"]
    live = sob[sob.sum(axis=1) > 0]
    per_step = np.array([_ratio(row) for row in live]) if len(live) else np.zeros(1)
    return {"group": "ost", "osts": cfg.osts, "layout": cfg.ost_layout,
            "dataset_bytes_per_ost_max_over_mean": _ratio(np.bincount(man.osts, man.sizes,
                                                                      cfg.osts)),
            "epoch_bytes_per_ost": _spread(acc["ost_bytes"]),
            "epoch_bytes_sum": int(acc["ost_bytes"].sum()),
            "epoch_max_over_mean": _ratio(acc["ost_bytes"]),
            "step_window_max_over_mean": {"median": float(np.median(per_step)),
                                          "max": float(per_step.max()),
                                          "at_window_step": _ratio(sob[window_step])},
            "window_step": window_step, "inflight_per_node": cfg.inflight,
            "prefetch_window": cfg.prefetch_window,
            "inflight": inflight_spread(cfg, man, acc["window"])}


def metadata_figures(cfg: Config, acc: dict[str, Any]) -> dict[str, Any]:
    small = OPS_SMALL_FILE * acc["total"]
    staged = OPS_SHARD_OPEN * int(acc["node_shards"].sum())
    direct = OPS_SHARD_OPEN * int(acc["rw_pairs"])
    return {"group": "metadata",
            "small_files": small, "small_files_formula": "2 (open + stat) x samples read",
            "shardio_with_staging": staged,
            "with_staging_formula": "3 (stat + index open + shard open) x (node, shard) pairs",
            "shardio_without_staging": direct,
            "without_staging_formula": "3 x (rank-worker, shard) pairs (lower bound: LRU reopens)",
            "with_staging_vs_small_files": staged / small if small else 0.0,
            "without_staging_vs_small_files": direct / small if small else 0.0}


# --- driver ------------------------------------------------------------------------------------
def run(cfg: Config) -> list[dict[str, Any]]:
    """Every figure group, in print order; the last one is the summary."""
    t0 = time.perf_counter()
    man = synthetic_manifest(cfg)
    order = make_order(cfg, man.counts)
    plan = make_plan(cfg, len(order))
    window_step = cfg.window_step
    if window_step is None and isinstance(order, NodeAffineOrder):
        window_step = 0  # a node first reads nearly all of its group's shards in step 0
    elif window_step is None:  # the step where the middle shuffle block begins: most first reads
        mid = int(order.block_start[len(order.block_shards) // 2])
        window_step = min(mid // (cfg.world * cfg.batch_size), max(plan.num_batches - 1, 0))
    if not 0 <= window_step < max(plan.num_batches, 1):
        raise ValueError(f"window_step must be in [0, {plan.num_batches}), got {window_step}")
    config = {"group": "config", **asdict(cfg), "world": cfg.world, "window_step": window_step}
    manifest = {"group": "manifest", "samples": len(order), "shards": cfg.shards,
                "samples_per_shard": _spread(man.counts), "bytes_per_shard": _spread(man.sizes),
                "dataset_bytes": int(man.sizes.sum()), "shuffle_blocks": num_blocks(order)}
    node = cfg.rank // cfg.ranks_per_node
    rank_m, batches = measure(lambda: plan_rank(cfg, man.counts), cfg.repeats)
    node_m, sched = measure(lambda: plan_node(cfg, man.counts, node), cfg.repeats)
    rank_shards = np.unique(np.searchsorted(order.offsets, np.concatenate(batches), "right") - 1)
    rank_plan = {"group": "rank_plan", "rank": cfg.rank, **rank_m, "batches": len(batches),
                 "samples": int(sum(len(b) for b in batches)), "shards_touched": len(rank_shards)}
    node_sched = {"group": "node_schedule", "node": node, **node_m, "shards": len(sched),
                  "rank_shards_in_node_schedule": bool(np.isin(rank_shards, sched.shards).all())}
    nodes = sampled_nodes(cfg)
    t1 = time.perf_counter()
    acc = epoch_pass(cfg, man, order, set(nodes), window_step)
    exact_s = time.perf_counter() - t1
    ranks = sorted({cfg.rank, *(v * cfg.ranks_per_node + i for v in nodes
                                for i in range(cfg.ranks_per_node))})
    groups = [config, manifest, rank_plan, node_sched,
              {**partition_figures(cfg, acc, ranks), "exact_pass_seconds": exact_s},
              staging_figures(cfg, man, order, acc, nodes), ost_figures(cfg, man, acc, window_step),
              metadata_figures(cfg, acc)]
    groups.append(summary(groups, time.perf_counter() - t0))
    return groups


def summary(groups: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    g = {x["group"]: x for x in groups}
    rp, ns, part, st, ost, md = (g[k] for k in ("rank_plan", "node_schedule", "partition",
                                                "staging", "ost", "metadata"))

    def target(value: float, limit: float, unit: str) -> dict[str, Any]:
        return {"value": value, "target": f"<= {limit} {unit}".strip(),
                "status": "PASS" if value <= limit else "MISS"}

    targets = {
        "rank_plan_seconds": target(rp["seconds"], TARGET_SECONDS, "s"),
        "rank_plan_peak_mb": target(rp["peak_mb"], TARGET_MB, "MB"),
        "node_schedule_seconds": target(ns["seconds"], TARGET_SECONDS, "s"),
        "node_schedule_peak_mb": target(ns["peak_mb"], TARGET_MB, "MB"),
        "ost_epoch_max_over_mean": target(ost["epoch_max_over_mean"], TARGET_OST, ""),
        "metadata_with_staging_vs_small_files": target(md["with_staging_vs_small_files"], 1.0,
                                                       "x"),
    }
    pad, drop = part["padding"], part["dropped"]
    checks = {
        "sum_over_ranks_equals_reads": part["sum_over_ranks"] == part["reads"],
        "every_rank_same_share": part["every_rank_per_rank"],
        "rank_rule_matches_rank_plan": part["rule_matches_rank_plan"],
        "every_sample_once_plus_pad_minus_drop": (
            part["samples_not_read"] == drop and part["samples_read_more"] == 0
            and part["samples_read_twice"] == pad
            and part["samples_read_once"] == part["samples"] - pad - drop),
        "no_duplicate_shards_per_node": st["duplicate_shards_in_schedules"] == 0,
        "sampled_nodes_equal_exact": st["sampled_equals_exact"],
        "ost_bytes_sum_equals_shared_fs_bytes": ost["epoch_bytes_sum"] == st["shared_fs_bytes"],
        "rank_shards_in_node_schedule": ns["rank_shards_in_node_schedule"],
    }
    return {"group": "summary", "targets": targets, "checks": checks,
            "consistent": all(checks.values()), "seconds": seconds}


def readable(groups: list[dict[str, Any]]) -> str:
    g = {x["group"]: x for x in groups}
    c, st, ost, md, s = g["config"], g["staging"], g["ost"], g["metadata"], g["summary"]
    tb = 1e12
    lines = [
        (f"{c['nodes']} nodes x {c['ranks_per_node']} ranks x {c['workers']} workers, "
         f"{c['samples']:,} samples in {c['shards']:,} shards on {c['osts']} OSTs, "
         f"batch {c['batch_size']}, shuffle block {c['shuffle_block']:,}, order {c['order']}"),
        (f"one rank: {g['rank_plan']['seconds']:.3f} s, {g['rank_plan']['peak_mb']:.1f} MB "
         f"(tracemalloc peak); node schedule: {g['node_schedule']['seconds']:.3f} s, "
         f"{g['node_schedule']['peak_mb']:.1f} MB"),
        (f"per node per epoch: {st['shards_per_node']['mean']:,.0f} shards "
         f"({st['bytes_per_node']['mean'] / tb:.3f} TB) staged for {st['samples_per_node']:,} "
         f"samples ({st['samples_per_staged_shard']:.2f} samples per staged shard)"),
        (f"shared FS per epoch: {st['shared_fs_shard_reads']:,} shard reads "
         f"({st['shared_fs_bytes'] / tb:.1f} TB) for {st['dataset_shards']:,} shards "
         f"({st['dataset_bytes'] / tb:.2f} TB): {st['read_amplification']:.1f}x the dataset"),
        (f"OST bytes max/mean: epoch {ost['epoch_max_over_mean']:.3f}, step windows median "
         f"{ost['step_window_max_over_mean']['median']:.2f} max "
         f"{ost['step_window_max_over_mean']['max']:.2f}; copies in flight "
         f"{ost['inflight']['schedule_order_mean_max_over_mean']:.2f} in schedule order, "
         f"{ost['inflight']['spread_by_ost_mean_max_over_mean']:.2f} with spread_by_ost, "
         f"{ost['inflight']['node_shuffled_mean_max_over_mean']:.2f} shuffled per node"),
        (f"metadata ops per epoch: small files {md['small_files']:,}, shardio with staging "
         f"{md['shardio_with_staging']:,} ({md['with_staging_vs_small_files']:.2f}x), without "
         f"{md['shardio_without_staging']:,} ({md['without_staging_vs_small_files']:.2f}x)"),
    ]
    if "locality" in st:
        lc = st["locality"]
        lines.insert(4, (
            f"node order: C={lc['canonical_nodes']}, U={lc['slice_size']}; cross-node reads "
            f"{lc['cross_node_reads']:,} ({lc['cross_node_read_fraction']:.2%}) on "
            f"{lc['nodes_with_cross_reads']} nodes, min node-local "
            f"{lc['min_node_local_fraction']:.3f}; shards staged outside home groups: "
            f"{lc['foreign_shard_copies']:,} (max {lc['foreign_shards_per_node']['max']} "
            "per node)"))
    for name, t in s["targets"].items():
        lines.append(f"{t['status']:4}  {name} = {t['value']:.3f} (target {t['target']})")
    for name, ok in s["checks"].items():
        lines.append(f"{'ok' if ok else 'FAIL':4}  {name}")
    return "".join(f"# {ln}\n" for ln in lines)


def parse_args(argv: Sequence[str] | None) -> tuple[Config, str | None]:
    p = argparse.ArgumentParser(prog="plan_scale.py", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny configuration (test suite)")
    base = Config()
    for f in ("nodes", "ranks_per_node", "workers", "samples", "shards", "osts", "batch_size",
              "seed", "epoch", "shuffle_block", "rank", "nodes_sampled", "inflight",
              "prefetch_window", "window_step", "repeats"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=None,
                       help=f"default {getattr(base, f)}")
    p.add_argument("--shard-mb", type=float, default=None, help=f"default {base.shard_mb}")
    p.add_argument("--spread", type=float, default=None, help=f"default {base.spread}")
    p.add_argument("--remainder", choices=("pad", "drop"), default=None)
    p.add_argument("--ost-layout", choices=("round-robin", "random"), default=None)
    p.add_argument("--order", choices=ORDERS, default=None,
                   help="epoch: EpochOrder (default); node: NodeAffineOrder for this job")
    p.add_argument("--canonical-nodes", type=int, default=None,
                   help="C of --order node (default the node count); U = ranks*batch/C")
    p.add_argument("--json-out", default=None, metavar="PATH", help="also write the JSON lines")
    a = p.parse_args(argv)
    changes = {k: v for k, v in vars(a).items() if k not in ("small", "json_out") and v is not None}
    try:
        cfg = Config.small(**changes) if a.small else Config(**changes)
    except ValueError as exc:
        p.error(str(exc))
    return cfg, a.json_out


def main(argv: Sequence[str] | None = None) -> int:
    cfg, json_out = parse_args(argv)
    try:
        groups = run(cfg)
    except ValueError as exc:
        print(f"plan_scale.py: {exc}", file=sys.stderr)
        return 2
    text = "".join(json.dumps(x) + "\n" for x in groups)
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            f.write(text)
    sys.stdout.write(text + readable(groups))
    sys.stdout.flush()
    return 0 if groups[-1]["consistent"] else 1


if __name__ == "__main__":
    sys.exit(main())
