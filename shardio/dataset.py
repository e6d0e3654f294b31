"""``ShardDataset``: a drop-in ``torch.utils.data.IterableDataset`` over a shardio dataset.

Order and partition follow :mod:`shardio.order`: the epoch order is a pure function of
(manifest, seed, epoch), split across ranks in equal shares and across DataLoader workers in whole
batches, so that ``state_dict()`` after ``k`` batches names an exact prefix of the epoch and a
resumed job (any world size, worker count or batch size) delivers exactly the rest.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import numbers
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from ._atomics import fetch_add_u64
from .checksum import digest_bytes
from .config import ReadOptions
from .decode import decode_sample
from .errors import StagingError, UnrepairableError, UsageError
from .order import EpochOrder, NodeAffineOrder, NodeSchedule, RankPlan, node_schedule
from .pool import keep_freed_heap
from .reader import DatasetReader
from .topology import Topology

__all__ = ["ShardDataset", "zero_copy_collate"]

STATE_VERSION = 1

log = logging.getLogger("shardio.dataset")


def _detect_topology() -> Topology:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return Topology.for_group(dist.get_rank(), dist.get_world_size())
    return Topology.from_env()


_FROZEN = [0]  # pid of the process that froze what it inherited
# ShardDataset._shared: epoch, cursor, worker iterations, node order C, U, q, then the
# DataLoader-worker rounds (see ShardDataset._worker_cursor): claimed round, its start, its
# finished workers, the start of the round that ended last (-1: none since the position was set).
_SHARED_SLOTS = 10
_CLAIM, _ROUND_START, _ROUND_DONE, _ENDED_START = 6, 7, 8, 9


def _freeze_inherited() -> None:
    """In a DataLoader worker: move the objects inherited from the training process into the
    GC's permanent generation (once per process).  A full collection would otherwise traverse
    them all (~0.1 s in a torch process) and write to each one's header, copying every page of
    the parent's heap into the worker; the allocations of reading trigger one early.  Also keeps
    freed heap for the next samples (:func:`shardio.pool.keep_freed_heap`)."""
    gc.freeze()
    keep_freed_heap()
    _FROZEN[0] = os.getpid()


class ShardDataset(IterableDataset[dict[str, Any]]):
    """Iterate the samples of a shardio dataset, ``{"__key__": str, field: value, ...}``.

    Works under ``torch.utils.data.DataLoader`` with any ``num_workers`` and under
    ``torch.distributed`` (rank and world size from the process group, else from
    ``RANK``/``WORLD_SIZE``, ``SLURM_PROCID``/``SLURM_NTASKS`` ..., or ``topology=``).

    Args:
        path: dataset directory (with ``manifest.json``).
        options: a :class:`~shardio.config.ReadOptions`; or pass its fields as keywords
            (``shuffle``, ``seed``, ``decode``, ``batch_size``, ``remainder``, ...).
        transform: called on each (decoded) sample dict in the worker; its result is yielded.
        topology: explicit rank/world size (skips detection).

    Raises:
        ManifestError: missing, corrupt or too new manifest (at construction).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        options: ReadOptions | None = None,
        *,
        transform: Callable[[dict[str, Any]], Any] | None = None,
        topology: Topology | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if options is None:
            options = ReadOptions(**kwargs)
        elif kwargs:
            raise UsageError("pass either options= or keyword options, not both")
        self.options = options
        self.transform = transform
        self.reader = DatasetReader(
            path, verify=options.verify, max_open_shards=options.max_open_shards,
            replicas=options.replicas, quarantine=options.quarantine,
            on_corrupt=options.on_corrupt, read_block=options.read_block)
        self.cache = self._node_cache()
        self.reader.ladder.cache = self.cache
        if options.zero_copy:
            from .sharedbytes import CHUNK_BYTES, Arena

            self.reader.set_arena(Arena(chunk_bytes=max(CHUNK_BYTES, options.read_block)))
        self._stager: Any = None
        self._stage_batch = 0  # the batch size self._stager's schedule was made with
        # Epoch and resume cursor live in a tiny shared array so that DataLoader workers kept
        # alive across epochs (persistent_workers=True) see set_epoch()/load_state_dict().
        # A third slot counts iterations in DataLoader workers (see state_dict); the next three
        # hold the node order's parameters once settled or loaded (0: not yet), which
        # persistent workers must see too (see _node_order); the rest keep the books of the
        # DataLoader workers' passes (see _worker_cursor).
        self._shared = multiprocessing.RawArray("q", _SHARED_SLOTS)
        self._worker_iters_seen = 0
        self._topology = topology
        self._delivered = 0
        self._iterated_here = False
        self._finished = False  # this process iterated the epoch to its end
        self._run_cursor = 0  # the cursor that iteration started from
        # Bumped whenever the position changes from outside an iteration (set_epoch to another
        # epoch, load_state_dict): a ShardLoader's own count of batches is then stale.
        self._position_gen = 0
        self._ident: str | None = None  # see _identity
        self._rounds_here = 0  # DataLoader-worker rounds this process took part in
        self._round_key = 0
        self._cursor = 0  # (and the worker-round books)

    @property
    def epoch(self) -> int:
        return int(self._shared[0])

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._shared[0] = int(value)

    @property
    def _node_order(self) -> tuple[int, int, int] | None:
        """(C, U, q) of the node-affine order once settled or loaded, else None.  Shared with
        DataLoader workers like the epoch and the cursor: a state loaded after persistent
        workers settled their own would otherwise be read against a different order."""
        c, u, q = self._shared[3:6]
        return None if c == 0 else (int(c), int(u), int(q))

    @_node_order.setter
    def _node_order(self, value: tuple[int, int, int] | None) -> None:
        self._shared[3:6] = (0, 0, 0) if value is None else tuple(int(v) for v in value)

    @property
    def _cursor(self) -> int:
        return int(self._shared[1])

    @_cursor.setter
    def _cursor(self, value: int) -> None:
        """A new position: the next DataLoader-worker round starts from it."""
        sh = self._shared
        sh[1] = sh[_ROUND_START] = int(value)
        sh[_CLAIM] = sh[_ROUND_DONE] = 0
        sh[_ENDED_START] = -1

    def _worker_cursor(self, info: Any) -> int:
        """Where this DataLoader worker's pass over the epoch starts.

        The main process cannot see the workers' passes (rounds: one per DataLoader
        iteration), so they keep the books in the shared array, as the main process does for
        its own iterations: a round starts from the position (``_cursor``), and the worker
        that completes a round (the last of its ``num_workers`` to finish) moves the position
        to 0, so that the next round replays the epoch from its start, as with
        ``num_workers=0``.  (Before, after a resume every later iteration without
        ``set_epoch`` read only the tail of the epoch again.)  A round is told by a key its
        workers share: DataLoader's base seed of the iteration (``info.seed - info.id``, new
        for each iteration of non-persistent workers) and this process's count of rounds (a
        persistent worker takes part in every iteration once)."""
        key = (hash((int(info.seed) - int(info.id), self._rounds_here)) & ((1 << 62) - 1)) | 1
        self._rounds_here += 1
        self._round_key = key
        sh = self._shared
        if sh[_CLAIM] != key:  # the first worker of a new round (or one that never ended)
            sh[_CLAIM] = key
            sh[_ROUND_DONE] = 0
            sh[_ENDED_START] = -1  # before the start: state_dict(batches=) reads them the other
            sh[_ROUND_START] = sh[1]  # way round (see there)
        return int(sh[_ROUND_START])

    def _worker_finished(self, info: Any) -> None:
        """This worker ended its share of its round; the last one ends the round."""
        sh = self._shared
        if sh[_CLAIM] != self._round_key:
            return  # (its round was taken over: a newer iteration started)
        done = fetch_add_u64(sh, 8 * _ROUND_DONE, 1) + 1
        if done == info.num_workers and sh[_CLAIM] == self._round_key:
            sh[_ENDED_START] = sh[_ROUND_START]  # what state_dict(batches=) counts from
            sh[1] = sh[_ROUND_START] = 0  # the next round replays the epoch from its start
            sh[_CLAIM] = 0

    # --- identity and sizes ------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self.reader.root

    @property
    def num_samples(self) -> int:
        """Samples in the whole dataset (all ranks)."""
        return len(self.reader)

    @property
    def topology(self) -> Topology:
        if self._topology is None:
            return _detect_topology()
        return self._topology

    def _plan(self, cursor: int | None = None) -> RankPlan:
        """This rank's plan for the rest of the epoch from ``cursor`` (default: the resume
        point)."""
        topo = self.topology
        cursor = self._cursor if cursor is None else cursor
        return RankPlan(self.num_samples - cursor, topo.world_size, topo.rank,
                        self.options.batch_size, self.options.remainder)

    def __len__(self) -> int:
        """Samples this rank yields in the current epoch (from the resume point, if any)."""
        return self._plan().per_rank

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows (call before each epoch).

        Raises:
            UsageError: ``epoch`` is not an integer >= 0.
        """
        if (isinstance(epoch, bool) or not isinstance(epoch, (int, np.integer))
                or not 0 <= epoch < 1 << 63):
            raise UsageError(f"epoch must be an integer in [0, 2**63), got {epoch!r}")
        if epoch != self.epoch:
            self._cursor = 0
            self._delivered = 0
            self._finished = False
            self._position_gen += 1
        self.epoch = int(epoch)
        self._start_staging(self.epoch)

    def _order(self, epoch: int | None = None, batch_size: int | None = None,
               settle: bool = True) -> Any:
        """The order of ``epoch`` (default: the current one): an :class:`EpochOrder`, or with
        ``order="node"`` a :class:`NodeAffineOrder` whose parameters are fixed on first use
        (``settle``: by this call, when not yet fixed)."""
        o = self.options
        epoch = self.epoch if epoch is None else epoch
        counts = np.diff(self.reader.offsets)
        if o.order == "global":
            return EpochOrder(counts, seed=o.seed, epoch=epoch, shuffle=o.shuffle,
                              shuffle_block=o.shuffle_block)
        c, u, q = self._node_params(batch_size or o.batch_size, settle)
        return NodeAffineOrder(counts, seed=o.seed, epoch=epoch, canonical_nodes=c,
                               slice_size=u, canonical_ranks=q, remainder=o.remainder,
                               shuffle=o.shuffle, shuffle_block=o.shuffle_block)

    def _node_params(self, batch_size: int, settle: bool = True) -> tuple[int, int, int]:
        """(C, U, q) of the node-affine order: from a loaded state, else from this job (its
        batch size: the loader's, whose batches are cut from the order); the first iteration
        settles them (``settle``), a checkpoint only looks."""
        if self._node_order is not None:
            return self._node_order
        topo = self.topology
        probe = NodeAffineOrder.for_job(
            np.ones(1, np.int64), world_size=topo.world_size,
            local_world_size=topo.local_world_size, batch_size=batch_size,
            canonical_nodes=self.options.canonical_nodes, remainder=self.options.remainder)
        params = (probe.canonical_nodes, probe.slice_size, probe.canonical_ranks)
        if settle:
            self._node_order = params
        return params

    def _order_state(self, batch_size: int | None = None) -> dict[str, Any]:
        """The order's part of a checkpoint.  It does not settle the node order's parameters:
        a checkpoint taken on one rank before the first batch (with the dataset's batch size,
        not the loader's) froze them on that rank only, and the ranks then split different
        orders (samples lost and others delivered twice)."""
        if self.options.order == "global":
            return {"kind": "global"}
        c, u, q = self._node_params(batch_size or self.options.batch_size, settle=False)
        # The remainder too: the node order's last round, hence its groups, depend on it.
        return {"kind": "node", "canonical_nodes": c, "slice_size": u, "canonical_ranks": q,
                "remainder": self.options.remainder}

    # --- iteration ---------------------------------------------------------------------------
    def _prepare(self, sample: dict[str, Any]) -> Any:
        o = self.options
        if o.decode:
            sample = decode_sample(sample, allow_pickle=o.allow_pickle, image_mode=o.image_mode)
        return self.transform(sample) if self.transform is not None else sample

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None and _FROZEN[0] != os.getpid():
            _freeze_inherited()
        cursor = self._cursor if info is None else self._worker_cursor(info)
        plan = self._plan(cursor)
        order = self._order()
        gen = self._position_gen  # (see the end of this iteration)
        if info is None:
            self._iterated_here = True
            self._delivered = 0
            self._finished = False
            self._run_cursor = cursor
            self._worker_iters_seen = int(self._shared[2])
        else:
            self._shared[2] += 1  # this process cannot see what a worker delivers
        self._start_staging(self.epoch)
        self.reader.prefer_cache()
        steps = plan.worker_steps(worker, workers)
        try:
            yield from self._steps(steps, order, plan, cursor, info, gen)
        finally:
            if self.cache is not None:
                # Done reading, or stopped: a report left behind would hold the stager's
                # frontier at this position (a peek at one sample, an epoch read here before
                # DataLoader workers took over) for the rest of the job.
                self.cache.withdraw()
        if info is None:
            if self._position_gen == gen:
                # The epoch is over: a later iteration without set_epoch() replays it from the
                # start.  (Unless the position was set while this iteration ran, by set_epoch
                # to another epoch or load_state_dict: that position is the next iteration's,
                # of which nothing was delivered.  Before, the end of this one overwrote it:
                # with set_epoch(e + 1) called before the loop of epoch e was over, the
                # checkpoint after the loop said epoch e + 1 was all delivered.)
                self._cursor = 0
                self._finished = True
        else:
            self._worker_finished(info)

    def _steps(self, steps: Sequence[int], order: EpochOrder, plan: RankPlan, cursor: int,
               info: Any, gen: int) -> Iterator[Any]:
        """The samples of ``steps`` (this worker's steps of the epoch from ``cursor``); in this
        process they count as delivered while the position is still generation ``gen``."""
        keep_spare = self.options.on_corrupt == "skip"
        spare: dict[str, Any] | None = None  # the last sample read, for skipped ones
        ahead: np.ndarray | None = None
        for k, t in enumerate(steps):
            ids = ahead if ahead is not None else self._step_ids(order, plan, cursor, t)
            ahead = None
            self._report(self.epoch, cursor + t * plan.world_size * plan.batch_size)
            if self.options.prefetch_shards and k + 1 < len(steps):
                ahead = self._step_ids(order, plan, cursor, steps[k + 1])
                self._advise(ahead)
            n = 0
            for sample in self.reader.read_ids(ids):
                n += 1
                if keep_spare:
                    spare = sample
                out = self._prepare(sample)
                if info is None and self._position_gen == gen:
                    self._delivered += 1
                yield out
            for _ in range(len(ids) - n):  # skipped (on_corrupt="skip"): keep the step full
                spare = repeat_for_skipped(self.reader, ids, spare)
                out = self._prepare(spare)
                if info is None and self._position_gen == gen:
                    self._delivered += 1
                yield out

    @staticmethod
    def _step_ids(order: EpochOrder, plan: RankPlan, cursor: int, t: int) -> np.ndarray:
        """Global sample ids of this rank's batch at step ``t``."""
        a, b = plan.batch_range(t)
        positions = cursor + np.arange(a, b, dtype=np.int64) % plan.remaining
        return _ids_at(order, positions)

    def _advise(self, ids: np.ndarray) -> None:
        """Read ahead the shards of an upcoming batch (``POSIX_FADV_WILLNEED``)."""
        # (willneed keeps the first occurrence of each shard; np.unique would import numpy.ma)
        shards = np.searchsorted(self.reader.offsets, ids, side="right") - 1
        self.reader.willneed(shards.tolist(), self.options.prefetch_shards)

    # --- node-local staging -------------------------------------------------------------------
    def _stage_options(self) -> Any:
        from .stage import StageOptions

        o = self.options
        # A reused copy is checked by the per-sample checksums on every read (verify=True), so
        # the stager re-hashes whole copies on reuse only when those checks are off.
        return StageOptions(cache_dir=o.cache_dir, budget=o.cache_budget, reserve=o.cache_reserve,
                            bandwidth=o.stage_bandwidth, lookahead=o.stage_lookahead,
                            verify_reuse=not o.verify)

    def _node_cache(self) -> Any:
        if self.options.cache_dir is None:
            return None
        from .stage import NodeCache

        try:
            cache = NodeCache.from_options(self.path, self.reader.manifest,
                                           self._stage_options())
        except StagingError as exc:
            if not exc.full:
                raise
            # A full disk is the job's condition of the moment, not a mistake in the options:
            # read directly, as the readers do when the disk fills up later.
            log.warning("node cache: %s; reading without staging", exc)
            return None
        if cache is None:
            log.warning("cache_dir='auto' found no usable node-local directory; reading without "
                        "staging")
        return cache

    def schedule(self, epoch: int, batch_size: int | None = None) -> NodeSchedule:
        """When this rank's node reads each shard in ``epoch`` (what the stager works from).

        It does not settle the node order's parameters: the stager, forked at ``set_epoch()``
        with ``ReadOptions.batch_size``, shares them with this process, and froze them with
        that batch size on its rank only, before a ShardLoader with another one began; the
        ranks then split different orders (samples lost and others delivered twice)."""
        topo, o = self.topology, self.options
        order = self._order(epoch, batch_size, settle=False)
        return node_schedule(order, world_size=topo.world_size,
                             local_world_size=topo.local_world_size, node=topo.node,
                             batch_size=batch_size or o.batch_size, remainder=o.remainder)

    def _start_staging(self, epoch: int, batch_size: int | None = None) -> None:
        """Make sure this node's stager runs (one per node: whoever takes the lock forks it; a
        dead stager is replaced by the next caller).  No-op without ``cache_dir``."""
        if self.cache is None:
            return
        from .stage import Stager

        if self._stager is not None and batch_size and batch_size != self._stage_batch:
            # Made at set_epoch() with ReadOptions.batch_size, before a ShardLoader with another
            # batch size began: it stages another job's schedule (on several nodes, shards this
            # node does not read instead of some it does).  The next one follows the loader.
            self._stager.stop(2.0)
            self._stager = None
        if self._stager is None:
            bs = self._stage_batch = batch_size or self.options.batch_size
            me = weakref.ref(self)  # the stager must not keep this dataset alive
            self._stager = Stager(self.cache, lambda e: me().schedule(e, bs),  # type: ignore
                                  self._stage_options())
            # Gone with the dataset (a notebook making many), not only with the process; at
            # exit the parent-death signal ends it, as before.
            weakref.finalize(self, self._stager.stop, 2.0).atexit = False
        try:
            self._stager.start(epoch)
        except StagingError as exc:
            if not getattr(exc, "full", False):
                raise
            # (As when the disk is full when the dataset is made: read directly; the next
            # epoch tries again.)
            log.warning("node cache: %s; reading without staging", exc)

    def _report(self, epoch: int, position: int) -> None:
        """Tell the stager where this reader is (epoch position of the step being read)."""
        if self.cache is not None:
            self.cache.report(epoch, position)

    def stage(self, epochs: Iterable[int]) -> dict[str, int]:
        """Stage the shards of ``epochs`` into the node cache now, in this process (job prologs:
        ``shardio stage``); returns the node counters.

        Raises:
            UsageError: no ``cache_dir`` was given.
            StagingError: another stager holds this node's lock.
        """
        if self.cache is None:
            raise UsageError("staging needs a node-local cache: pass cache_dir=DIR (or 'auto')")
        from .stage import Stager

        return Stager(self.cache, self.schedule, self._stage_options()).stage(epochs)

    def __getitem__(self, i: int) -> Any:
        """Sample ``i`` in manifest order (decoded and transformed like iteration): random
        access for evaluation and debugging.  ``i`` is taken as a list takes an index, over
        all the dataset's samples (``len(self.reader)``, not this rank's ``len(self)``): any
        integer, numpy's too, negative ones from the end.

        Raises:
            TypeError: ``i`` is not an integer (a float, a string, a slice).
            IndexError: ``i`` is out of range (the message shows the valid range).
        """
        return self._prepare(self.reader[i])

    def io_stats(self) -> dict[str, Any]:
        """Fault/repair events and reads per source (opens, stats, bytes) of this process and its
        forked workers (``repair``), and the node cache's counters (``stage``) when staging."""
        out: dict[str, Any] = {"repair": self.reader.counters.snapshot()}
        if self.cache is not None:
            out["stage"] = self.cache.counters()
        return out

    # --- checkpointing -----------------------------------------------------------------------
    def state_dict(self, batches: int | None = None) -> dict[str, Any]:
        """Where delivery stands, to resume exactly with :meth:`load_state_dict`.

        Args:
            batches: batches of ``batch_size`` this rank has consumed in the current epoch
                (since iteration began or since the state was loaded).  Needed when the dataset
                is iterated in DataLoader worker processes, which the main process cannot
                observe; counted automatically when iterated in this process.

        Raises:
            UsageError: ``batches`` is needed but missing, or is not an integer from 0 to the
                batches of this rank's epoch.
        """
        if batches is None:
            if not self._iterated_here or self._shared[2] != self._worker_iters_seen:
                raise UsageError(
                    "this ShardDataset was not iterated in this process (DataLoader workers "
                    "iterate it, or nothing was iterated yet), so it cannot see what was "
                    "delivered: pass state_dict(batches=<batches this rank consumed this epoch>, "
                    "0 before the first)"
                )
            if self._finished:  # the whole epoch was delivered: nothing of it is left
                batches = None
            elif self._delivered >= self._plan().per_rank:  # all, the last batch partial
                batches = self._plan().num_batches
            else:
                batches = self._delivered // self.options.batch_size
        if batches is None:
            cursor = self.num_samples
        else:
            if self._finished:
                # The epoch ended here and the resume point went back to its start (a replay):
                # ``batches`` counts from where that iteration began.  (DataLoader's
                # num_workers=0 runs the iterator to its end while it collates a partial last
                # batch, before the loop sees that batch.)
                start = self._run_cursor
            elif not self._iterated_here or self._shared[2] != self._worker_iters_seen:
                # DataLoader workers iterate: ``batches`` counts from where their round began,
                # or, once it ended (the position then went back to the epoch's start), where
                # the round that ended began.
                # The round's start first, then whether it ended: the workers write them the
                # other way round (the ended mark before the start is reset to 0, and cleared
                # before a new round's start is set), so a worker's update in between is seen
                # whole.  Read ended-first, a round ending between the two reads gave start 0.
                round_start = int(self._shared[_ROUND_START])
                ended = int(self._shared[_ENDED_START])
                start = ended if ended >= 0 else round_start
            else:
                start = self._cursor
            plan = self._plan(start)
            # (A count past the epoch's end, say the run's step count instead of the epoch's,
            # made a checkpoint that said the epoch was over: the resumed job skipped its rest.)
            if (isinstance(batches, bool) or not isinstance(batches, numbers.Integral)
                    or not 0 <= batches <= plan.num_batches):
                raise UsageError(
                    f"state_dict(batches={batches!r}): batches must be an integer in [0, "
                    f"{plan.num_batches}], the batches this rank took in the current epoch "
                    f"(since it began, set_epoch or load_state_dict), not over the whole run")
            cursor = start + plan.consumed(int(batches))
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "cursor": cursor,
            "num_samples": self.num_samples,
            "seed": self.options.seed,
            "shuffle": self.options.shuffle,
            "shuffle_block": self.options.shuffle_block,
            "order": self._order_state(),
            "dataset": self._identity(),
        }

    def _identity(self) -> str:
        """A digest of which sample sits at each global index: the shards in order, with
        their sample counts and digests (not the rest of the manifest, which a rewrite that
        keeps the shards may change).  A state from another dataset with as many samples
        would resume at the wrong samples."""
        if self._ident is None:
            shards = [[s.path, s.samples, s.digest] for s in self.reader.manifest.shards]
            self._ident = digest_bytes(json.dumps(shards, separators=(",", ":")).encode())
        return self._ident

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; world size, workers and batch size may differ.

        Raises:
            UsageError: the state belongs to another dataset or order (seed, shuffle settings).
        """
        if not isinstance(state, dict):
            raise UsageError(
                f"load_state_dict takes the dict state_dict() returned, got "
                f"{type(state).__name__}" + (" (json.loads it first)"
                                             if isinstance(state, (str, bytes)) else ""))
        if state.get("version") != STATE_VERSION:
            raise UsageError(f"not a ShardDataset state (version {state.get('version')!r}, "
                             f"this shardio reads {STATE_VERSION})")
        missing = [k for k in ("epoch", "cursor", "num_samples", "seed", "shuffle",
                               "shuffle_block") if k not in state]
        if missing:
            raise UsageError(f"the state lacks {', '.join(missing)}: pass the whole dict "
                             "state_dict() returned")
        if state["num_samples"] != self.num_samples:
            raise UsageError(
                f"state is for a dataset of {state['num_samples']} samples, this one has "
                f"{self.num_samples}: resume with the dataset the checkpoint was taken on"
            )
        if "dataset" in state and state["dataset"] != self._identity():
            raise UsageError(
                "state is for another dataset with as many samples (its shards differ: "
                "repacked, or another source): resume with the dataset the checkpoint was "
                "taken on, or start the epoch afresh (set_epoch) without loading the state")
        epoch, cursor = state["epoch"], state["cursor"]
        for name, value, top in (("epoch", epoch, (1 << 63) - 1),
                                 ("cursor", cursor, self.num_samples)):
            if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
                    or not 0 <= value <= top):
                raise UsageError(f"state {name} must be an integer in [0, {top}], got "
                                 f"{value!r}: pass the dict state_dict() returned, unchanged")
        o = self.options
        mine = (o.seed, o.shuffle, o.shuffle_block)
        theirs = (state["seed"], state["shuffle"], state["shuffle_block"])
        if mine != theirs:
            raise UsageError(
                f"state was taken with seed/shuffle/shuffle_block {theirs}, this dataset uses "
                f"{mine}; construct the dataset with the same values to resume"
            )
        theirs_order = state.get("order", {"kind": "global"})
        if not isinstance(theirs_order, dict) or theirs_order.get("kind") not in ("global",
                                                                                  "node"):
            raise UsageError(f"state order {theirs_order!r} is not one state_dict() writes: "
                             "pass the dict state_dict() returned, unchanged")
        if theirs_order["kind"] != o.order:
            raise UsageError(
                f"state was taken with order={theirs_order['kind']!r}, this dataset uses "
                f"order={o.order!r}; construct the dataset with the same order to resume")
        if o.order == "node":
            # The same global order as before, whatever this job's size: locality is kept when
            # the topology matches C, correctness always.
            try:
                params = tuple(int(theirs_order[k]) for k in
                               ("canonical_nodes", "slice_size", "canonical_ranks"))
            except (KeyError, TypeError, ValueError) as exc:
                raise UsageError(f"state order {theirs_order!r} lacks valid node-order "
                                 "parameters: pass the dict state_dict() returned, "
                                 "unchanged") from exc
            if min(params) < 1:
                raise UsageError(f"state order {theirs_order!r} has node-order parameters "
                                 "below 1: pass the dict state_dict() returned, unchanged")
            theirs_rem = theirs_order.get("remainder", o.remainder)  # (older states: unknown)
            if theirs_rem != o.remainder and params[0] > 1 and 0 < cursor < self.num_samples:
                # The epoch's order depends on it (the groups are cut for the last round; not
                # with one group): the rest of the epoch under another remainder repeats some
                # delivered samples and never delivers others.
                raise UsageError(
                    f"state was taken mid-epoch with order='node' and remainder={theirs_rem!r}, "
                    f"this dataset uses remainder={o.remainder!r}, which changes that epoch's "
                    f"order; construct the dataset with remainder={theirs_rem!r} to resume")
            if self._stager is not None and params != self._node_order:
                # Started before (set_epoch first), it plans with the order it forked with:
                # the next _start_staging forks one that follows this one.
                self._stager.stop(2.0)
                self._stager = None
            self._node_order = params
        self.epoch = int(epoch)
        self._cursor = int(cursor)
        self._delivered = 0
        self._finished = False
        self._position_gen += 1
        if self.cache is not None and self._stager is None and o.order == "node":
            self._start_staging(self.epoch)  # (the one stopped above, following this order)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        # Resolve rank/world in the main process: a spawned worker has no process group.
        state["_topology"] = self.topology
        # The node cache (shared mappings, progress file) and the stager belong to a process;
        # an unpickled copy opens its own.
        state["cache"], state["_stager"] = None, None
        if get_spawning_popen() is None:
            # Plain pickling (not handing the dataset to a new worker process): a shared array
            # cannot travel, so its values do.
            state["_shared"] = tuple(self._shared)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        shared = state["_shared"]
        if isinstance(shared, tuple):
            shared = (*shared, *[0] * _SHARED_SLOTS)[:_SHARED_SLOTS]
            old = state.pop("_node_order", None)  # (pickled before it was shared)
            if old is not None and shared[3] == 0:
                shared = (*shared[:3], *old)
            state["_shared"] = multiprocessing.RawArray("q", shared)
        self.__dict__.update(state)
        self.cache = self._node_cache()
        self.reader.ladder.cache = self.cache


def repeat_for_skipped(reader: DatasetReader, ids: np.ndarray,
                       spare: dict[str, Any] | None) -> dict[str, Any]:
    """The sample that takes a skipped one's place in its batch: under ``on_corrupt="skip"``
    a step still yields as many samples as it has ids, so every rank yields the same number
    of batches (a rank short of one would hang DDP's next collective) and positions stay
    exact for ``state_dict``.  It repeats the last sample read, or, with none read yet in
    this process, the first sample of the dataset that reads cleanly.

    Raises:
        UnrepairableError: no shard of the dataset has a readable sample.
    """
    if spare is not None:
        return spare
    shards = (np.searchsorted(reader.offsets, ids, side="right") - 1).tolist()
    found = reader.stand_in(avoid=shards)
    if found is not None:
        return found
    raise UnrepairableError(reader.manifest.shards[shards[0]].path, [(
        "every shard", "no readable sample left to keep the batch full (on_corrupt='skip')")])


def _ids_at(order: EpochOrder, positions: np.ndarray) -> np.ndarray:
    """Global sample ids at epoch positions (contiguous runs, except where padding wraps)."""
    if len(positions) == 0:
        return positions
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    runs = np.split(positions, breaks)
    return np.concatenate([order.samples(int(r[0]), int(r[-1]) + 1) for r in runs])


def zero_copy_collate(batch: list[Any]) -> Any:
    """torch's ``default_collate`` for ``ShardDataset(zero_copy=True)`` under DataLoader: a
    field that arrives as a read-only ``uint8`` array viewing shared memory (an arena chunk,
    or under ``ShardLoader`` the worker's ring) stays a list per field, as a ``bytes`` field
    does (``default_collate`` would try to stack them into one tensor, which fails when their
    sizes differ); everything else is collated as ``default_collate`` does.  Pass it as
    ``DataLoader(..., collate_fn=zero_copy_collate)`` (or ``ShardLoader``'s)."""
    from torch.utils.data._utils.collate import collate, default_collate_fn_map

    global _ZERO_COPY_MAP
    if _ZERO_COPY_MAP is None:
        _ZERO_COPY_MAP = {**default_collate_fn_map, np.ndarray: _collate_arrays}
    return collate(batch, collate_fn_map=_ZERO_COPY_MAP)


_ZERO_COPY_MAP: dict[Any, Any] | None = None


def _collate_arrays(batch: list[Any], *, collate_fn_map: Any = None) -> Any:
    from torch.utils.data._utils.collate import collate_numpy_array_fn

    from ._tree import is_area_field
    from .sharedbytes import is_arena_field

    # Fields cut from an arena (DataLoader) or from a ShardLoader worker's ring area: byte
    # fields of any size, kept a list as a column of bytes is (stacking fails on sizes).
    if any(is_arena_field(x) or is_area_field(x) for x in batch):
        return list(batch)
    return collate_numpy_array_fn(batch, collate_fn_map=collate_fn_map)
