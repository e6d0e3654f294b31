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

Node-affine order (:class:`NodeAffineOrder`): the same contract (a global order, a pure function
of the manifest, ``seed`` and ``epoch``, split by ``RankPlan``), plus two parameters, the
canonical node count C and the slice size U, chosen so that the slice of each step that
``RankPlan`` gives one node's ranks comes from the few shards dealt to that node this epoch.  It
is what a node-local stager needs: with :class:`EpochOrder` at 1,000 nodes every node reads about
one sample per shard it touches.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
# numpy 2 imports numpy.random on first use: here, once, not in every forked DataLoader worker.
import numpy.random

from .errors import UsageError

__all__ = ["REMAINDER", "EpochOrder", "NodeAffineOrder", "NodeSchedule", "RankPlan",
           "node_schedule"]

REMAINDER = ("pad", "drop")


def _words(seed: int) -> tuple[int, int, int]:
    """A seed of any size and sign as non-negative 32-bit words for ``SeedSequence``."""
    s = int(seed)
    sign, s = (1, -s) if s < 0 else (0, s)
    return sign, s & 0xFFFFFFFF, s >> 32


def _shard_permutation(counts: np.ndarray, seed: int, epoch: int, shuffle: bool
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts as int64, sample offsets per shard, the epoch's shard permutation): the first
    step of every order, the same generator for all of them."""
    counts = np.asarray(counts, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    if shuffle:
        perm = np.random.default_rng([*_words(seed), epoch, 0x5EED]).permutation(len(counts))
    else:
        perm = np.arange(len(counts))
    return counts, offsets, perm


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
        counts, self.offsets, perm = _shard_permutation(self.counts, self.seed, self.epoch,
                                                        self.shuffle)
        self.counts = counts
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


@dataclass
class NodeAffineOrder:
    """A global epoch order in which each node's share of every step comes from its own shards.

    Like :class:`EpochOrder` this is the order of the whole epoch (global sample ids per epoch
    position), split across ranks by :class:`RankPlan` and resumed from a cursor the same way;
    every sample is at exactly one position.  It is a pure function of ``(counts, seed, epoch,
    canonical_nodes, slice_size, canonical_ranks, remainder, shuffle, shuffle_block)`` and of
    nothing else about the job.  The idea is MosaicML Streaming's *canonical nodes*: each epoch
    the shards are dealt into C groups and a node reads only its group(s), so a node-local stager
    copies about 1/C of the dataset per epoch instead of touching nearly every shard for about
    one sample each (with :class:`EpochOrder` at 1,000 nodes).

    Order
        1. Permute the shards with the generator :class:`EpochOrder` uses (same ``seed`` and
           ``epoch``); the *dealing stream* is the samples in permuted-shard order.
        2. Cut the dealing stream into C contiguous *groups*, group ``g`` exactly ``G_g``
           samples (below).  A shard straddling a cut is split at the sample (its first samples
           end group ``g``, the rest begin ``g+1``), so at most C-1 shards belong to two groups
           and every group has exactly the size the layout needs: no group runs out early.
        3. Cut each group into shuffle blocks of whole pieces (a piece: the part of a shard in
           the group) whose first sample falls in the same multiple of ``shuffle_block`` from
           the group start, and permute each block as :class:`EpochOrder` does.  The group's
           *stream* is its blocks in turn.
        4. Interleave the streams in *slots*.  With M samples, ``J = M // (C*U)`` full rounds
           come first (U = ``slice_size``): round ``j``, slot ``g``, epoch positions
           ``[j*C*U + g*U, +U)``, is the next U samples of group ``g``'s stream.  The last
           ``rem = M - J*C*U`` positions are cut as RankPlan cuts a last step over ``C*q``
           ranks (q = ``canonical_ranks``): ``b = ceil(rem/(C*q))`` (``"pad"``) or
           ``floor(rem/(C*q))`` (``"drop"``), part ``g`` = ``[g*q*b, (g+1)*q*b)`` clipped to
           ``rem`` (with ``"drop"`` the last part also takes the ``rem mod C*q`` positions
           RankPlan drops), and part ``g`` is the rest of group ``g``'s stream.
           So ``G_g = J*U + |part g|``.
        With C = 1 the order is *identical* to :class:`EpochOrder`'s with the same ``seed``,
        ``epoch``, ``shuffle`` and ``shuffle_block``, whatever the other parameters.

    In other words the order is what a *canonical job* of C nodes x q ranks, global batch C*U,
    reads when canonical node ``g`` reads only group ``g``.  A physical job of R ranks, L per
    node, N = R/L nodes, batch B, is local when it has that job's steps and last step:
    ``R*B == C*U`` and ``R == C*q`` or, more generally, the node count divides C or is a
    multiple of it with ``q = R/C`` (:meth:`for_job` sets U and q so), and the same remainder:
        - ``C == N`` (the normal case, ``U = L*B``, ``q = L``): node ``n`` reads group ``n``;
        - ``C == k*N`` (``U = L*B/k``, ``q = L/k``): node ``n`` reads U samples from each of
          its groups ``n*k ... n*k+k-1`` every step (its slice concatenates k streams);
        - ``N == k*C`` (``q = k*L``): k nodes share each group and read disjoint samples of it,
          but each stages (part of) the group's shards: fewer canonical nodes, more copies.
    The only cross-node reads are then RankPlan's padding (``"pad"`` re-reads the first
    ``pad < R`` positions of the remaining order in the last step, samples of groups 0, 1, ...).
    With another q or remainder only the last step (under C*U samples) is read across nodes;
    with another C*U the order stays correct and only staging degrades.  ``U = L*B`` with
    ``C = k*N`` also works, with node ``n`` owning the groups ``g % N == n`` one step each in
    turn, but its last round spans k steps and is read across nodes.

    Resume.  A job resumed with another topology reads the rest of the same order through
    RankPlan: every remaining sample exactly once, as for EpochOrder.  It keeps locality when
    its R*B, R and remainder match the order's C*U, C*q and remainder (e.g. half the nodes with
    twice the ranks each, node ``n`` then reading groups ``2n`` and ``2n+1``; with twice the
    batch instead, only its last step is read across nodes).  Keep C, U, q and the remainder
    with the checkpoint and construct the order from them, not from the new job.

    Trade-offs.  A rank's batch is a run of one group's stream: it is drawn from 1/C of the
    dataset (about S/C of the S shards), not all of it.  The global batch spans every group and
    the shard-to-group deal is redrawn every epoch, but with one class per shard a batch holds
    only the classes of its group's shards, so the batch label entropy drops when S/C is small
    against the number of classes (``tests/test_order_nodes.py`` reports the figure).  Every
    shard of a group is first read near the start of the epoch (a group under one shuffle block
    is one uniform permutation): a stager copies its whole group at once, or ahead of time,
    since the deal of epoch ``e+1`` is known during epoch ``e``; a smaller ``shuffle_block``
    spreads the copies over the epoch at the cost of shuffle quality.  Memory: per-shard and
    per-group arrays plus the blocks a process reads (a rank or stager: its own groups').

    Args:
        counts: samples per shard, in manifest order.
        seed: user seed.
        epoch: epoch number.
        canonical_nodes: C, the number of groups, >= 1.
        slice_size: U, samples of a group per slot of a full round, >= 1.
        canonical_ranks: q, ranks per canonical node for the last round's cut, >= 1.
        remainder: ``"pad"`` or ``"drop"``, the RankPlan remainder the last round is cut for.
        shuffle: permute (else manifest order dealt into groups and interleaved).
        shuffle_block: samples per shuffle block inside a group.

    Raises:
        UsageError: a parameter below 1 or an unknown remainder.
    """

    counts: np.ndarray
    seed: int = 0
    epoch: int = 0
    canonical_nodes: int = 1
    slice_size: int = 1
    canonical_ranks: int = 1
    remainder: str = "pad"
    shuffle: bool = True
    shuffle_block: int = 1 << 18
    _cache: dict[int, np.ndarray] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("canonical_nodes", "slice_size", "canonical_ranks", "shuffle_block"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.remainder not in REMAINDER:
            raise UsageError(f"remainder must be one of {REMAINDER}, got {self.remainder!r}")
        counts, self.offsets, perm = _shard_permutation(self.counts, self.seed, self.epoch,
                                                        self.shuffle)
        self.counts = counts
        self._perm = perm
        cum = np.concatenate([[0], np.cumsum(counts[perm])]).astype(np.int64)
        self._cum = cum  # dealing-stream position of each permuted shard's first sample
        self._shift = self.offsets[perm] - cum[:-1]  # sample id = dealing position + shift
        m, c, u = int(cum[-1]), self.canonical_nodes, self.slice_size
        self.rounds = m // (c * u)
        rem = m - self.rounds * c * u
        q = self.canonical_ranks
        b = -(-rem // (c * q)) if self.remainder == "pad" else rem // (c * q)
        self._tail = np.minimum(np.arange(c + 1, dtype=np.int64) * q * b, rem)  # part starts
        self._tail[-1] = rem
        sizes = self.rounds * u + np.diff(self._tail)
        self.group_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        # Pieces: the dealing stream cut at every shard start and every group start.
        cuts = np.union1d(cum, self.group_start)
        cuts = cuts[cuts < m]
        g = np.searchsorted(self.group_start, cuts, side="right") - 1
        blk = (cuts - self.group_start[g]) // self.shuffle_block
        new = np.ones(len(cuts), dtype=bool)
        new[1:] = (np.diff(g) != 0) | (np.diff(blk) != 0)
        self.block_bounds = np.concatenate([cuts[new], [m]]).astype(np.int64)
        self.block_group = g[new]

    @classmethod
    def for_job(cls, counts: np.ndarray, *, world_size: int, local_world_size: int,
                batch_size: int, canonical_nodes: int | None = None, remainder: str = "pad",
                seed: int = 0, epoch: int = 0, shuffle: bool = True,
                shuffle_block: int = 1 << 18) -> NodeAffineOrder:
        """The order whose canonical job is this job: C defaults to the node count,
        ``U = world_size * batch_size / C`` and ``q = world_size / C`` (1 when C does not
        divide the world size: then only the last step is read across nodes).

        Raises:
            UsageError: nodes of unequal size, a C that is neither a multiple nor a divisor of
                the node count, or a global batch that C does not divide.
        """
        if world_size < 1 or local_world_size < 1 or batch_size < 1:
            raise UsageError("world_size, local_world_size and batch_size must be >= 1, got "
                             f"{world_size}, {local_world_size}, {batch_size}")
        if world_size % local_world_size:
            raise UsageError(f"world_size {world_size} is not a multiple of local_world_size "
                             f"{local_world_size}: nodes of unequal size cannot own one group "
                             "each; use EpochOrder")
        nodes = world_size // local_world_size
        c = nodes if canonical_nodes is None else canonical_nodes
        if c < 1 or (c % nodes and nodes % c):
            raise UsageError(f"canonical_nodes {c} must be a multiple or a divisor of the node "
                             f"count {nodes}; pass canonical_nodes={nodes}")
        if (world_size * batch_size) % c:
            raise UsageError(f"global batch {world_size * batch_size} is not a multiple of "
                             f"canonical_nodes {c}; pass canonical_nodes={nodes} or a batch "
                             f"size that makes world_size * batch_size a multiple of {c}")
        q = world_size // c if world_size % c == 0 else 1
        return cls(counts, seed=seed, epoch=epoch, canonical_nodes=c,
                   slice_size=world_size * batch_size // c, canonical_ranks=q,
                   remainder=remainder, shuffle=shuffle, shuffle_block=shuffle_block)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_blocks(self) -> int:
        """Shuffle blocks over all groups."""
        return len(self.block_bounds) - 1

    @property
    def group_sizes(self) -> np.ndarray:
        """Samples of each group (``G_g``)."""
        return np.diff(self.group_start)

    def group_shards(self, group: int) -> np.ndarray:
        """Manifest indexes of the shards group ``group`` reads, in dealing order (a shard split
        between two groups is listed by both)."""
        lo, hi = self.group_start[group], self.group_start[group + 1]
        a = int(np.searchsorted(self._cum, lo, side="right")) - 1
        b = int(np.searchsorted(self._cum, hi, side="left"))
        shards = self._perm[a:b] if hi > lo else self._perm[:0]
        return shards[self.counts[shards] > 0].astype(np.int64)

    def block(self, k: int) -> np.ndarray:
        """Sample ids of block ``k`` (of all groups') in its group's stream order (the last two
        blocks are cached: a reader moves through its own group's blocks)."""
        ids = self._cache.get(k)
        if ids is not None:
            return ids
        d = np.arange(self.block_bounds[k], self.block_bounds[k + 1], dtype=np.int64)
        ids = d + self._shift[np.searchsorted(self._cum, d, side="right") - 1]
        if self.shuffle:
            rng = np.random.default_rng([*_words(self.seed), self.epoch, k, 0xB10C])
            ids = ids[rng.permutation(len(ids))]
        if len(self._cache) >= 2:
            del self._cache[next(iter(self._cache))]
        self._cache[k] = ids
        return ids

    def block_positions(self, k: int) -> np.ndarray:
        """Epoch positions of block ``k``'s samples, aligned with :meth:`block` (increasing)."""
        g = int(self.block_group[k])
        s = np.arange(self.block_bounds[k], self.block_bounds[k + 1],
                      dtype=np.int64) - self.group_start[g]
        c, u, j = self.canonical_nodes, self.slice_size, self.rounds
        return np.where(s < j * u, (s // u) * c * u + g * u + s % u,
                        j * c * u + self._tail[g] + s - j * u)

    def _locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(group, dealing-stream position)`` of each epoch position."""
        p = np.asarray(positions, dtype=np.int64)
        if p.size and (int(p.min()) < 0 or int(p.max()) >= len(self)):
            raise UsageError(f"epoch positions must lie in [0, {len(self)}), got "
                             f"[{int(p.min())}, {int(p.max())}]")
        c, u, j = self.canonical_nodes, self.slice_size, self.rounds
        body = j * c * u
        g, s = np.empty_like(p), np.empty_like(p)
        head = p < body
        ph = p[head]
        g[head], s[head] = (ph // u) % c, (ph // (c * u)) * u + ph % u
        q = p[~head] - body
        gt = np.searchsorted(self._tail, q, side="right") - 1
        g[~head], s[~head] = gt, j * u + q - self._tail[gt]
        return g, self.group_start[g] + s

    def groups_at(self, positions: np.ndarray) -> np.ndarray:
        """The group whose stream supplies each epoch position."""
        return self._locate(positions)[0]

    def ids_at(self, positions: np.ndarray) -> np.ndarray:
        """Global sample ids at epoch positions (any order, each in ``[0, len(self))``), looked
        up block by block in the blocks they fall in.

        Raises:
            UsageError: a position outside the epoch.
        """
        _, d = self._locate(positions)
        out = np.empty(len(d), np.int64)
        if not len(d):
            return out
        k = np.searchsorted(self.block_bounds, d, side="right") - 1
        idx = np.argsort(k, kind="stable")
        ks = k[idx]
        cuts = np.flatnonzero(np.diff(ks)) + 1
        bounds = np.concatenate([[0], cuts, [len(ks)]]).tolist()
        for lo, hi in itertools.pairwise(bounds):
            b, sel = int(ks[lo]), idx[lo:hi]
            out[sel] = self.block(b)[d[sel] - self.block_bounds[b]]
        return out

    def samples(self, start: int, stop: int) -> np.ndarray:
        """Global sample ids at epoch positions ``[start, stop)``."""
        return self.ids_at(np.arange(start, stop, dtype=np.int64))


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


def node_schedule(order: EpochOrder | NodeAffineOrder, *, world_size: int = 1,
                  local_world_size: int = 1, node: int = 0, batch_size: int = 1,
                  remainder: str = "pad") -> NodeSchedule:
    """The shards node ``node`` reads in ``order``'s epoch and when (see :class:`NodeSchedule`).

    The node's ranks are ``node * local_world_size ...`` (consecutive, as torchrun and Slurm
    number them), so at each step the node reads one contiguous slice of the epoch order.
    Memory is a few int64 per sample the node reads plus one shuffle block: sample ids are
    looked up block by block, in the blocks the node reads, never over the whole epoch (for a
    :class:`NodeAffineOrder` on a matching job, the blocks of the node's own groups).
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
    ids = (order.ids_at(positions) if isinstance(order, NodeAffineOrder)
           else _ids_by_block(order, positions))
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
    for lo, hi in itertools.pairwise(bounds):
        b = int(blocks[lo])
        ids[k[lo:hi]] = order.block(b)[pos[lo:hi] - order.block_start[b]]
    return ids
