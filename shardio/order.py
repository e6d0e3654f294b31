"""Deterministic epoch order and its partition across ranks and workers.

Order (a pure function of the shard sample counts, ``seed``, ``epoch``)
    1. Permute the shards with a generator seeded by ``(seed, epoch)``.
    2. Cut the permuted shard list into *shuffle blocks*: consecutive shards whose first sample
       falls in the same multiple of ``shuffle_block`` samples.
    3. Inside each block, permute all of its samples (generator seeded by
       ``(seed, epoch, block)``).
    The epoch order is the concatenation of the blocks.  Memory is bounded by one block: a
    reader needs the permutation of its current block and the indexes of that block's shards,
    never an array over the whole dataset.  When the dataset has at most ``shuffle_block``
    samples this is a uniform random permutation.  With ``shuffle=False`` the order is the
    manifest order.

Partition (``RankPlan``), over the part of the epoch not yet delivered (``cursor`` onwards, M
samples).  Every rank gets ``per_rank`` samples, cut into batches of ``batch_size``; global step
``t`` takes the contiguous range ``[t*R*B, t*R*B + R*b_t)`` of the remaining order (``b_t`` the
step's batch size), rank ``r`` the ``r``-th slice of it, and data-loader worker ``w`` of ``W``
serves the steps ``t = w, w+W, ...`` (torch's DataLoader round-robins over workers in exactly
this order).  Hence after ``k`` steps on every rank the delivered samples are exactly the prefix
``[cursor, cursor + k*R*B)`` of the epoch order, whatever R and W were, which makes resume exact
and lets a resumed job use any other world size, worker count or batch size.

Remainder when M is not a multiple of R: ``"pad"`` (default, like torch's DistributedSampler)
repeats samples from the start of the remaining order so every rank gets ``ceil(M/R)``;
``"drop"`` gives every rank ``floor(M/R)`` and leaves the last ``M mod R`` out.  Either way every
rank yields the same number of samples and batches, so no DDP collective hangs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import UsageError

__all__ = ["REMAINDER", "EpochOrder", "NodeSchedule", "RankPlan", "node_schedule"]

REMAINDER = ("pad", "drop")


def _words(seed: int) -> tuple[int, int, int]:
    """A seed of any size and sign as non-negative 32-bit words for ``SeedSequence``."""
    s = int(seed)
    sign, s = (1, -s) if s < 0 else (0, s)
    return sign, s & 0xFFFFFFFF, s >> 32


@dataclass
class EpochOrder:
    """The global sample order of one epoch (global sample ids in manifest order).

    Args:
        counts: samples per shard, in manifest order.
        seed: user seed.
        epoch: epoch number.
        shuffle: permute (else manifest order).
        shuffle_block: samples per shuffle block (memory bound of the shuffle).
    """

    counts: np.ndarray
    seed: int = 0
    epoch: int = 0
    shuffle: bool = True
    shuffle_block: int = 1 << 18
    _cache: tuple[int, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.shuffle_block < 1:
            raise UsageError(f"shuffle_block must be >= 1, got {self.shuffle_block}")
        counts = np.asarray(self.counts, dtype=np.int64)
        self.counts = counts
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        if self.shuffle:
            rng = np.random.default_rng([*_words(self.seed), self.epoch, 0x5EED])
            perm = rng.permutation(len(counts))
        else:
            perm = np.arange(len(counts))
        starts = np.concatenate([[0], np.cumsum(counts[perm])[:-1]]) if len(counts) else counts
        # Blocks also without shuffle (same manifest order), so memory stays bounded by one block.
        block_of = starts // self.shuffle_block
        cuts = np.flatnonzero(np.diff(block_of)) + 1
        self.block_shards = np.split(perm, cuts) if len(perm) else []
        sizes = np.array([counts[b].sum() for b in self.block_shards], dtype=np.int64)
        self.block_start = np.concatenate([[0], np.cumsum(sizes)])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def block(self, b: int) -> np.ndarray:
        """Global sample ids of block ``b`` in epoch order (the last block is cached)."""
        if self._cache is not None and self._cache[0] == b:
            return self._cache[1]
        shards = self.block_shards[b]
        ids = np.concatenate(
            [np.arange(self.offsets[s], self.offsets[s + 1], dtype=np.int64) for s in shards]
        ) if len(shards) else np.zeros(0, np.int64)
        if self.shuffle:
            rng = np.random.default_rng([*_words(self.seed), self.epoch, b, 0xB10C])
            ids = ids[rng.permutation(len(ids))]
        self._cache = (b, ids)
        return ids

    def samples(self, start: int, stop: int) -> np.ndarray:
        """Global sample ids at epoch positions ``[start, stop)``."""
        out = []
        b = int(np.searchsorted(self.block_start, start, side="right")) - 1
        while start < stop:
            lo, hi = int(self.block_start[b]), int(self.block_start[b + 1])
            take = min(stop, hi)
            out.append(self.block(b)[start - lo : take - lo])
            start = take
            b += 1
        return np.concatenate(out) if out else np.zeros(0, np.int64)


@dataclass(frozen=True)
class RankPlan:
    """This rank's share of the remaining epoch, in batches; see the module docstring.

    Args:
        remaining: samples of the epoch not yet delivered (M).
        world_size, rank: the job topology.
        batch_size: samples per batch (must match the DataLoader's batch size).
        remainder: ``"pad"`` or ``"drop"``.
    """

    remaining: int
    world_size: int = 1
    rank: int = 0
    batch_size: int = 1
    remainder: str = "pad"

    def __post_init__(self) -> None:
        if self.remainder not in REMAINDER:
            raise UsageError(f"remainder must be one of {REMAINDER}, got {self.remainder!r}")
        if self.batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {self.batch_size}")

    @property
    def per_rank(self) -> int:
        m, r = self.remaining, self.world_size
        if m <= 0:
            return 0
        return -(-m // r) if self.remainder == "pad" else m // r

    @property
    def num_batches(self) -> int:
        return -(-self.per_rank // self.batch_size)

    def batch_range(self, t: int) -> tuple[int, int]:
        """``(start, stop)`` of step ``t``'s batch for this rank, in remaining-order positions
        (positions >= ``remaining`` are padding and wrap around)."""
        b = min(self.batch_size, self.per_rank - t * self.batch_size)
        start = t * self.world_size * self.batch_size + self.rank * b
        return start, start + b

    def worker_steps(self, worker: int, num_workers: int) -> range:
        """Steps served by data-loader worker ``worker`` of ``num_workers``."""
        return range(worker, self.num_batches, num_workers)

    def consumed(self, batches: int) -> int:
        """Samples of the remaining order delivered once every rank has taken ``batches``."""
        batches = min(batches, self.num_batches)
        if batches <= 0:
            return 0
        if batches < self.num_batches:
            return batches * self.world_size * self.batch_size
        return self.remaining


@dataclass(frozen=True)
class NodeSchedule:
    """When one node reads each shard in one epoch: the input of the node-local stager.

    Time is the epoch position of a step's first sample (``t * R * B`` for step ``t``), the
    same for every rank and worker of the job at that step, so readers can report progress as
    one number and the stager can compare it across processes.  ``shards[k]`` is read by this
    node from step position ``first[k]`` to ``last[k]`` inclusive; sorted by ``first``.
    """

    epoch: int
    shards: np.ndarray
    first: np.ndarray
    last: np.ndarray
    bytes_per_step: int = 0

    def __len__(self) -> int:
        return len(self.shards)


def node_schedule(order: EpochOrder, *, world_size: int = 1, local_world_size: int = 1,
                  node: int = 0, batch_size: int = 1, remainder: str = "pad") -> NodeSchedule:
    """The shards node ``node`` reads in ``order``'s epoch and when (see :class:`NodeSchedule`).

    The node's ranks are ``node * local_world_size ...`` (consecutive, as torchrun and Slurm
    number them), so at each step the node reads one contiguous slice of the epoch order.
    Memory is a few int64 per sample the node reads plus one shuffle block: sample ids are
    looked up block by block, in the blocks the node reads, never over the whole epoch.
    """
    n = len(order)
    plan = RankPlan(n, world_size, 0, batch_size, remainder)
    steps = plan.num_batches
    if steps == 0 or n == 0:
        empty = np.zeros(0, np.int64)
        return NodeSchedule(order.epoch, empty, empty, empty)
    t = np.arange(steps, dtype=np.int64)
    b = np.minimum(batch_size, plan.per_rank - t * batch_size)
    step_pos = t * world_size * batch_size
    first_rank = node * local_world_size
    ranks = max(0, min(local_world_size, world_size - first_rank))
    start = step_pos + first_rank * b
    length = ranks * b
    total = int(length.sum())
    if total == 0:
        empty = np.zeros(0, np.int64)
        return NodeSchedule(order.epoch, empty, empty, empty)
    # positions = concatenation of arange(start[t], start[t] + length[t]) without a Python loop
    rep_start = np.repeat(start - np.concatenate([[0], np.cumsum(length)[:-1]]), length)
    positions = (np.arange(total, dtype=np.int64) + rep_start) % n
    times = np.repeat(step_pos, length)
    ids = _ids_by_block(order, positions)
    shard_of = np.searchsorted(order.offsets, ids, side="right") - 1
    # first/last time per shard
    k = np.argsort(shard_of, kind="stable")
    s_sorted, t_sorted = shard_of[k], times[k]
    cut = np.flatnonzero(np.diff(s_sorted)) + 1
    lo = np.concatenate([[0], cut])
    hi = np.concatenate([cut, [len(s_sorted)]]) - 1
    shards, first, last = s_sorted[lo], t_sorted[lo], t_sorted[hi]
    by_first = np.argsort(first, kind="stable")
    return NodeSchedule(order.epoch, shards[by_first], first[by_first], last[by_first])


def _ids_by_block(order: EpochOrder, positions: np.ndarray) -> np.ndarray:
    """``order.samples(0, len(order))[positions]`` for positions in ``[0, len(order))``, built
    one shuffle block at a time (only the blocks the positions fall in)."""
    ids = np.empty(len(positions), np.int64)
    k = np.argsort(positions, kind="stable")
    pos = positions[k]
    blocks = np.searchsorted(order.block_start, pos, side="right") - 1
    cuts = np.flatnonzero(np.diff(blocks)) + 1
    bounds = np.concatenate([[0], cuts, [len(pos)]]).tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        b = int(blocks[lo])
        ids[k[lo:hi]] = order.block(b)[pos[lo:hi] - order.block_start[b]]
    return ids
