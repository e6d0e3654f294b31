"""``ShardLoader``: a drop-in replacement for ``torch.utils.data.DataLoader`` over a ShardDataset.

Workers (:mod:`shardio.pool`) read, decode, transform and collate whole batches and write them
into per-worker shared-memory rings; the training loop receives tensors that view the ring
(zero-copy).  A ring region is reused only after every tensor of its batch is garbage: each
batch's arrays hang off one *lease* object whose finalizer queues the region for release.  A
batch the user keeps (still held when a later one is handed out) is moved out of its ring
(``Ring.detach``: its pages become private copies at the same addresses), since a ring frees
space in order and a kept batch would otherwise stop it.  If the user keeps so many batches
that a ring would fill (or needs many such moves in an epoch), new batches are copied out of the
ring, or reach main through the worker's spill pipe when the ring is full anyway (see
:mod:`shardio.pool`), with one warning, instead of deadlocking or overwriting.

With ``zero_copy=True`` (and no built-in ``decode``) a worker reads each batch's samples
straight into its ring: it reserves the batch's read bytes plus room for the rest before it
reads (``WorkerPool``'s *Reading into the ring*), the reader cuts fields out of that memory
(read-only ``uint8`` arrays, as under DataLoader), and the default collate's column of such
fields points at them instead of copying them (``_tree.Area``).  What does not fit, or a batch
whose ring has no room right now, is read into the worker's private arena and copied into the
message as before.
"""

from __future__ import annotations

import json
import logging
import numbers
import os
import random
import signal
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from ._fsutil import atomic_write_bytes
from ._tree import ALIGN, STAGES, Area, Plan, plan_collate, plan_tree, read_header, read_tree
from .config import LoaderOptions
from .dataset import ShardDataset, repeat_for_skipped
from .errors import ShmSpaceError, UsageError, WorkerCrashedError, WorkerTimeoutError
from .order import RankPlan
from .pool import Claim, PoolOptions, WorkerPool, reap_exiting, still_exiting
from .sharedbytes import CHUNK_BYTES, Arena, is_arena_field
from .stats import LoaderStats
from .topology import discover_cpus

__all__ = ["ShardLoader"]

log = logging.getLogger("shardio.loader")

AUTO_RING_MIN = 8 << 20
AUTO_RING_MAX = 256 << 20


class _Lease(np.ndarray):
    """The uint8 view of one ring message; every array of the batch is a view of it."""


_ONE_THREAD = [0]  # pid of the process whose torch was set to one intra-op thread
# Detach events per epoch, and replaced ring mappings still in use per ring, before batches
# are copied out of the ring instead (see _make_room).
_MAX_DETACH_EVENTS = 8
_MAX_RETIRED_MAPPINGS = 32
_SWEEP_MIN = 64  # hand-outs listed before ShardLoader._drain_releases sweeps the list


def _held(entry: tuple[int, Any, Any, list[Any]]) -> bool:
    """Whether a hand-out (an entry of ``ShardLoader._leased``) is still in its ring: not
    released, not moved out, its pool not gone."""
    _n, ring, msg, _fields = entry
    return bool(msg.in_use) and not msg.detached and not ring.closed


# Where a batch read into its ring message starts (after the message header) and the room
# first claimed for what the batch adds to its samples (labels, keys, the table); the job
# learns the real figure from its batches.
_AREA_START = 128
_TAIL_MIN = 16 << 10
_TAIL_FIRST = 256 << 10

_MASK64 = (1 << 64) - 1
_BATCH_SEEDS = 0xBA7C5EED  # domain word of the per-batch seeds (see _Job.produce)
_WORKER_SEEDS = 0x5EED0F  # domain word of a base seed derived from the dataset's seed


def _mix64(*words: int) -> int:
    """A 64-bit seed from integers (splitmix64 over them): nearby inputs (steps, workers) give
    unrelated seeds."""
    h = 0
    for w in words:
        h = (h + 0x9E3779B97F4A7C15 + (w & _MASK64)) & _MASK64
        h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 31
    return h


def _seed_rngs(seed: int) -> None:
    """Seed the global generators a transform may draw from: torch's CPU generator with
    ``seed`` (not ``torch.manual_seed``, which also seeds every accelerator's: ~80 us against
    ~1 us), ``random`` and numpy's legacy ``np.random`` with seeds derived from it.  (Both of
    the latter are Mersenne Twisters seeded the same way: given one seed, they would draw the
    very same numbers.)"""
    torch.default_generator.manual_seed(seed)
    random.seed(_mix64(seed, 1))
    n = _mix64(seed, 2)
    np.random.seed([n & 0xFFFFFFFF, n >> 32])


class _ClaimArena:
    """The reader's arena while a batch is read into its ring reservation: room in ``area`` up
    to ``limit``, then the worker's private arena."""

    __slots__ = ("area", "limit", "min_bytes", "private")

    def __init__(self, area: Area, limit: int, private: Arena) -> None:
        self.area, self.limit, self.private = area, limit, private
        self.min_bytes = private.min_bytes

    def take(self, n: int) -> tuple[np.ndarray, int, memoryview]:
        a = self.area
        off = a.start + a.used
        if 0 < n and off + n <= self.limit:
            a.used = ((off + n + ALIGN - 1) & ~(ALIGN - 1)) - a.start
            return a.array, off, a.buf[off:off + n]
        return self.private.take(n)

    def room(self) -> tuple[np.ndarray, int, memoryview] | None:
        """See :meth:`shardio.sharedbytes.Arena.room`: the area's room, then the private
        arena's."""
        a = self.area
        off = a.start + a.used
        if off < self.limit:
            return a.array, off, a.buf[off:self.limit]
        return self.private.room()

    def advance(self, used: int) -> None:
        a = self.area
        if a.start + a.used < self.limit:
            a.used += used
        else:
            self.private.advance(used)


class _Job:
    """Runs in each worker: the epoch's order and plan, then one batch per ``produce``."""

    def __init__(self, dataset: ShardDataset, collate_fn: Callable[[list[Any]], Any] | None,
                 worker_init_fn: Callable[[int], Any] | None = None, *,
                 in_process: bool = False) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.worker_init_fn = worker_init_fn
        # num_workers=0: batches made in the training process (ShardLoader._iter_here), which
        # keeps its torch threads, and its worker info (None) and generators (restored).
        self.in_process = in_process
        self.worker = (0, 1)  # (index, num_workers) of this worker (bind_worker)
        self.inited = 0  # pid of the process whose worker set-up ran (_init_worker)
        self.seed = 0  # the loader's base seed (spec)
        self.rank = 0
        self.order: Any = None
        self.plan: RankPlan | None = None
        self.cursor = 0
        self.spare: dict[str, Any] | None = None  # last sample read (see repeat_for_skipped)
        self.claim: Callable[[int], Claim | None] | None = None  # see bind_output
        self.private: Arena | None = None  # zero_copy reads that are not into the ring
        self.tail = _TAIL_FIRST  # room claimed beyond a batch's read bytes (learned)
        # Whether the last batch carried sample fields as they were read (only then is reading
        # into the ring worth its room: a transform that decodes them does not).
        self.through = True

    def bind_output(self, claim: Callable[[int], Claim | None]) -> None:
        """Called by the pool in each worker: ``claim(nbytes)`` reserves ring memory to build
        the next batch in (see *Reading into the ring* in :mod:`shardio.pool`)."""
        self.claim = claim

    def bind_worker(self, index: int, num_workers: int) -> None:
        """Called by the pool in each worker: which worker of how many this process is."""
        self.worker = (index, num_workers)

    def _init_worker(self) -> None:
        """Once per worker process, at its first epoch: what a DataLoader worker sets up before
        the user's code runs.  The generators get the seed ``base + index`` (DataLoader's), which
        ``get_worker_info().seed`` reports, then ``worker_init_fn(index)`` runs (an exception
        from it reaches main as a WorkerError, like one from a transform)."""
        from torch.utils.data._utils import worker as torch_worker

        index, count = self.worker
        seed = (self.seed + index) & (_MASK64 >> 1)
        _seed_rngs(seed)
        torch_worker._worker_info = torch_worker.WorkerInfo(
            id=index, num_workers=count, seed=seed, dataset=self.dataset)
        if self.worker_init_fn is not None:
            self.worker_init_fn(index)
        self.inited = os.getpid()

    def begin(self, spec: dict[str, Any]) -> None:
        # Everything comes from ``spec``: the dataset's epoch and cursor live in memory shared
        # with main, and a worker that starts an epoch late (a restart) must not write them.
        ds = self.dataset
        o = ds.options
        if _ONE_THREAD[0] != os.getpid() and not self.in_process:
            # As DataLoader does in its workers: N workers each running torch's intra-op pool
            # of one thread per core would oversubscribe the CPUs (and OpenMP threads spin).
            torch.set_num_threads(1)
            _ONE_THREAD[0] = os.getpid()
        # The ring carries batches without pickling them: no shared chunks here.  zero_copy
        # fields are read into the ring (produce) or, failing that, into private memory.
        if o.zero_copy and self.private is None:
            self.private = Arena(chunk_bytes=max(CHUNK_BYTES, o.read_block), shared=False)
        ds.reader.set_arena(self.private if o.zero_copy else None)
        self.cursor = spec["cursor"]
        if spec.get("node_order"):
            ds._node_order = tuple(spec["node_order"])
        self.order = ds._order(spec["epoch"], spec["batch_size"])
        self.plan = RankPlan(ds.num_samples - self.cursor, spec["world_size"], spec["rank"],
                             spec["batch_size"], o.remainder)
        self.stride = spec.get("stride", 1)
        self.epoch = spec["epoch"]
        self.seed, self.rank = spec.get("seed", 0), spec["rank"]
        ds.reader.prefer_cache()
        self.ahead: tuple[int, np.ndarray] | None = None
        if self.inited != os.getpid() and not self.in_process:
            self._init_worker()

    def produce(self, step: int) -> tuple[Any, list[float]]:
        assert self.plan is not None and self.order is not None
        t0 = time.perf_counter()
        ds, plan = self.dataset, self.plan
        if self.ahead is not None and self.ahead[0] == step:
            ids = self.ahead[1]
        else:
            ids = ds._step_ids(self.order, plan, self.cursor, step)
        self.ahead = None
        position = self.cursor + step * plan.world_size * plan.batch_size
        ds._report(self.epoch, position)
        # The random augmentations of a batch depend on nothing but the batch: the same with
        # any worker count, after a worker's restart and after a resume (see ShardLoader).
        _seed_rngs(_mix64(self.seed, self.epoch, self.rank, position, _BATCH_SEEDS))
        nxt = step + self.stride
        if ds.options.prefetch_shards and nxt < plan.num_batches:
            self.ahead = (nxt, ds._step_ids(self.order, plan, self.cursor, nxt))
            ds._advise(self.ahead[1])
        o = ds.options
        need = None
        if self.claim is not None and o.zero_copy and not o.decode and self.through:
            need = ds.reader.read_bytes(ids)
        claim = None if need is None else self.claim(_AREA_START + need + self.tail)
        if claim is None:
            out, times = self._make(ids, t0, None)
            if need is not None and self.through:  # (a batch that will be read into the ring)
                out.size_hint = _AREA_START + need + self.tail
            return out, times
        try:
            out, times = self._make(ids, t0, claim)
        except BaseException:
            claim.abort()
            raise
        if out.claim is None:  # it did not fit: made again without the claim
            del out
            claim.drop()
            return self._make(ids, t0, None)
        return out, times

    def _make(self, ids: np.ndarray, t0: float, claim: Claim | None) -> tuple[Plan, list[float]]:
        """The batch of ``ids``: read (into ``claim``'s memory when there is one), decoded,
        transformed and collated.  With a claim, ``plan.claim`` is None when the batch does not
        fit in it (nothing of it may then be used)."""
        ds = self.dataset
        o = ds.options
        area = None
        if self.private is not None:
            self.private.rewind()  # the last batch's private reads are dead: reuse their pages
        if claim is not None:
            assert claim.buf is not None and self.private is not None
            area = Area(claim.buf, _AREA_START)
            ds.reader.set_arena(_ClaimArena(area, len(claim.buf) - self.tail, self.private))
        try:
            raw = list(ds.reader.read_ids(ids))
            if o.on_corrupt == "skip" and raw:
                self.spare = raw[-1]
            while len(raw) < len(ids):  # skipped (on_corrupt="skip"): the batch stays full
                self.spare = repeat_for_skipped(ds.reader, ids, self.spare)
                raw.append(self.spare)
            if area is not None and self.spare is not None:
                self.spare = self._own(self.spare)  # it outlives the batch: not in the ring
        finally:
            if area is not None:
                ds.reader.set_arena(self.private)
        t1 = time.perf_counter()
        if o.decode:
            from .decode import decode_sample

            raw = [decode_sample(s, allow_pickle=o.allow_pickle, image_mode=o.image_mode)
                   for s in raw]
        t2 = time.perf_counter()
        tf = self.dataset.transform
        samples = [tf(s) for s in raw] if tf is not None else raw
        del raw
        t3 = time.perf_counter()
        is_field = is_arena_field if o.zero_copy else None
        out = (plan_tree(self.collate_fn(samples), area, is_field) if self.collate_fn
               else plan_collate(samples, area, is_field))
        del samples
        t4 = time.perf_counter()
        self.through = out.field_bytes > 0
        # Learn the room the rest of a batch takes beside its fields (with a margin).
        if out.area_end:
            self.tail = int((out.nbytes - out.area_end) * 1.5) + _TAIL_MIN
        elif self.through and claim is None:
            self.tail = int((out.nbytes - out.field_bytes) * 1.5) + _TAIL_MIN
        if claim is not None and area is not None:
            assert claim.buf is not None
            claim.area = (area.start, area.used)
            claim.watch = weakref.ref(area.array)
            if out.nbytes <= len(claim.buf):
                out.claim = claim
        return out, [t1 - t0, t2 - t1, t3 - t2, t4 - t3, 0.0, t4 - t0]

    def _own(self, sample: dict[str, Any]) -> dict[str, Any]:
        """``sample`` with its fields copied out of the ring message it was read into (it is
        kept beyond its batch: see repeat_for_skipped)."""
        assert self.private is not None
        out = {}
        for k, v in sample.items():
            if type(v) is np.ndarray:
                view, off, mv = self.private.take(v.nbytes)
                mv[:] = memoryview(v)
                v = view[off:off + v.nbytes]
            out[k] = v
        return out


class ShardLoader:
    """Iterate batches of a :class:`~shardio.ShardDataset` with a shared-memory worker pool.

    Replaces ``DataLoader`` in a training loop, with the same arguments in the same places:
    batches come in the dataset's deterministic order, every rank gets the same number of them,
    and ``state_dict()`` records exactly the batches handed out (not those prefetched).

    Random augmentations: before each batch, the worker making it seeds torch's CPU generator,
    ``random`` and ``np.random`` from (base seed, epoch, rank, the batch's place in the epoch),
    so a transform that draws from them gives each batch its own draws, and the same ones
    whatever the worker count, after a worker's restart, and after a resume.  The base seed
    comes from the dataset's ``seed`` (like its order: the same on every rank, so every rank's
    ``state_dict()`` is the same), or is drawn at construction from ``generator`` when one is
    given (another run of the same order with other draws); ``state_dict()`` saves it.  (A
    DataLoader seeds each worker once, base + worker id, from torch's default generator; each
    ShardLoader worker starts that way too, which ``get_worker_info().seed`` reports.)

    Args:
        dataset: the :class:`~shardio.ShardDataset` (its order, decode and transform apply).
        batch_size: samples per batch.
        shuffle: None or False; True only if the dataset shuffles (the order is the dataset's:
            ``ShardDataset(shuffle=True, seed=...)``).
        sampler, batch_sampler: must be None: the dataset defines the order and splits it over
            ranks itself (no ``DistributedSampler``).
        num_workers: worker processes; 0 makes each batch in this process when the loop asks
            for it (slower: for debugging, as DataLoader's 0), with the same batches and the
            same random draws.
        collate_fn: builds a batch from a list of samples in the worker; default stacks arrays
            straight into shared memory (like torch's ``default_collate``).
        pin_memory: copy batches into pinned memory (only useful with CUDA).
        drop_last: drop each rank's final partial batch.
        timeout: seconds to wait for one batch before :class:`~shardio.errors.WorkerTimeoutError`
            (0: no limit; checked every ``poll_interval``).  The workers are then stopped; the
            next iteration starts new ones.
        worker_init_fn: called as ``worker_init_fn(worker_id)`` in each worker process (a
            restarted one too) before its first batch; ``torch.utils.data.get_worker_info()``
            works there and in the transform, as under DataLoader.
        multiprocessing_context: None or ``"fork"`` (the workers are forked: they inherit the
            dataset, the rings and their descriptors).
        generator: a ``torch.Generator`` to draw the base seed from, instead of deriving it
            from the dataset's seed.
        prefetch_factor: as :attr:`LoaderOptions.prefetch_factor` (None: its default).
        persistent_workers: True (default): workers live until :meth:`close`.  False: they
            are stopped at the end of each iteration (completed or not) and started again by
            the next, as a DataLoader's are, but the iteration does not wait for their exit
            (see *Closing without waiting* in :mod:`shardio.pool`; :meth:`close` does).
        pin_memory_device: ``""`` or ``"cuda"`` (``"cuda:N"``).
        in_order: accepted for DataLoader's sake; batches always come in order.
        options: :class:`~shardio.config.LoaderOptions` (ring size, shm directory, CPU pinning,
            restarts, logging); or pass its fields as keywords.

    Raises:
        UsageError: an argument ShardLoader cannot honour (the message says what to pass).
        ShmSpaceError: the rings do not fit (names the option to change).
        WorkerError: a worker raised (its traceback attached); WorkerCrashedError when workers
            keep dying; WorkerTimeoutError past ``timeout``.
    """

    def __init__(
        self,
        dataset: ShardDataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 2,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = True,
        pin_memory_device: str = "",
        in_order: bool = True,
        options: LoaderOptions | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(dataset, ShardDataset):
            raise UsageError("ShardLoader reads a shardio.ShardDataset; wrap your data with one")
        _check_dataloader_args(dataset, batch_size, shuffle, sampler, batch_sampler, timeout,
                               worker_init_fn, multiprocessing_context, generator,
                               persistent_workers, pin_memory_device, in_order)
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or (
                batch_size < 1):  # (None: _check_dataloader_args)
            raise UsageError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise UsageError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if prefetch_factor is not None:
            if num_workers == 0:  # as DataLoader refuses it
                raise UsageError("prefetch_factor is for worker processes: with num_workers=0 "
                                 "leave it None")
            kwargs["prefetch_factor"] = prefetch_factor
        if options is None:
            options = LoaderOptions(**kwargs)
        elif kwargs:
            raise UsageError("pass either options= or keyword options, not both")
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.pin_memory = pin_memory
        self.timeout = float(timeout)
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        # DataLoader's attributes that training code reads back (sampler: there is none).
        self.generator = generator
        self.multiprocessing_context = multiprocessing_context
        self.pin_memory_device = pin_memory_device
        self.in_order = in_order
        self.sampler = self.batch_sampler = None
        self.options = options
        self.prefetch_factor = options.prefetch_factor
        # The base of every worker's seeds (see the class docstring): a non-negative int64,
        # drawn from the generator as DataLoader draws its own when there is one.
        self.seed = (_mix64(dataset.options.seed, _WORKER_SEEDS) >> 1 if generator is None else
                     int(torch.empty((), dtype=torch.int64).random_(generator=generator).item()))
        self._stats = LoaderStats(log_every=options.log_every, window=options.warn_window,
                                  warn_ratio=options.warn_wait_ratio)
        self._iterating: object | None = None  # the running iteration's token
        self._warned_big = False
        self.ring_bytes = 0 if options.ring_bytes == "auto" else int(options.ring_bytes)
        self._preempt: tuple[str | None, Any, bool] = (None, None, True)
        self._preempt_pending = False
        self.preempted = False
        self._saving = False  # a preemption save is being written (the handler re-entered)
        self._signals: set[int] = set()  # handled by save_on_signal: the workers ignore them
        self._restarts_before = 0  # worker restarts of this loader's closed pools
        self._exiting: list[Any] = []  # workers of pools closed without waiting (close() waits)
        # A stop save happened (while no iteration ran, at an iteration's end, or ending one):
        # later iterations end at once (they would deliver what the saved position says is to
        # come), until load_state_dict or save_on_signal.
        self._stop_next = False
        self._pool: WorkerPool | None = None
        self._released: deque[tuple[Any, Any]] = deque()
        self._delivered = 0
        self._warned_copy = False
        self._detach_events = 0  # this epoch's (see _make_room)
        self._detach_failed = False
        # Batches handed out from a ring and not yet seen released, oldest first: (hand-out
        # number, ring, message, its fields as (weak reference, offset, nbytes)); every batch
        # handed out is numbered (see _make_room).
        self._leased: deque[tuple[int, Any, Any, list[Any]]] = deque()
        self._sweep_at = _SWEEP_MIN  # see _drain_releases
        self._handouts = 0
        self._finished = False
        # The dataset's position generation the two counts above refer to (see state_dict).
        self._gen = dataset._position_gen

    # --- sizes and epochs --------------------------------------------------------------------
    def _plan(self) -> RankPlan:
        topo = self.dataset.topology
        return RankPlan(self.dataset.num_samples - self.dataset._cursor, topo.world_size,
                        topo.rank, self.batch_size, self.dataset.options.remainder)

    def _num_steps(self, plan: RankPlan) -> int:
        if self.drop_last:
            return plan.per_rank // self.batch_size
        return plan.num_batches

    def __len__(self) -> int:
        """Batches this rank yields in the current epoch (from the resume point, if any)."""
        return self._num_steps(self._plan())

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration follows (forwards to the dataset, which checks
        it)."""
        self.dataset.set_epoch(epoch)  # (a new epoch makes this loader's count stale)

    # --- iteration ---------------------------------------------------------------------------
    def _ensure_pool(self) -> WorkerPool:
        if self._pool is not None and self._pool.owner != os.getpid():
            # Inherited through fork: its workers are the parent's (closing only lets go here).
            self._close(wait=True)
        if self._pool is None:
            o = self.options
            # The pool calls back into this loader through weak methods: bound ones would make
            # a cycle (loader -> pool -> loader), and a loader dropped without close() would
            # keep its workers and rings until a cyclic GC pass (never, under gc.disable()).
            pool = WorkerPool(
                _Job(self.dataset, self.collate_fn, self.worker_init_fn),
                PoolOptions(num_workers=self.num_workers,
                            ring_bytes=(_weakly(self._ring_size, AUTO_RING_MIN)
                                        if o.ring_bytes == "auto" else o.ring_bytes),
                            shm_dir=o.shm_dir, cpus=self._cpus(), poll_interval=o.poll_interval,
                            max_restarts=o.max_restarts, start_timeout=o.start_timeout,
                            timeout=self.timeout, ignore_signals=tuple(self._signals)),
            )
            pool.start()  # closes itself if it fails: keep no half-started pool around
            pool.make_room = _weakly(self._make_room, False)
            self._pool = pool
        return self._pool

    def _ring_size(self, nbytes: int) -> int:
        """``ring_bytes="auto"``: room for ``prefetch_factor + 1`` batches of ``nbytes``, the
        size of the epoch's first batch (built by the worker that produces it; see "Ring
        sizing" in :mod:`shardio.pool`), plus one more, in whole MiB between
        :data:`AUTO_RING_MIN` and :data:`AUTO_RING_MAX`.

        The one more is slack, not depth: a message never wraps round the end of the ring
        (up to a message's worth of the end stays unused when the next does not fit there),
        and later batches are often larger than the first.  With room for exactly
        ``prefetch_factor + 1`` first batches, only 2 of the 3 fitted most of the time (the
        20,000-JPEG benchmark set, batches of 4.9-5.4 MB in 14 MiB rings): a worker then had
        one batch ready, not two, while the loop held one, and a loop that keeps the
        previous batch a step longer (``prev = batch``) filled its rings."""
        want = (self.options.prefetch_factor + 2) * (nbytes + 4096)
        size = min(AUTO_RING_MAX, max(AUTO_RING_MIN, -(-want // (1 << 20)) << 20))
        log.info("ring_bytes auto: first batch %d bytes -> %d MiB per worker", nbytes, size >> 20)
        self.ring_bytes = size
        return size

    def _cpus(self) -> tuple[int, ...] | None:
        cpus = self.options.cpus
        if cpus != "auto":
            return cpus  # type: ignore[return-value]
        found = discover_cpus()
        if len(found) > self.num_workers:
            found = found[1:]  # the first (of the best NUMA node) stays with the training loop
        return tuple(found)

    # --- preemption --------------------------------------------------------------------------
    def save_on_signal(self, path: str | os.PathLike[str] | None = None,
                       callback: Callable[[dict[str, Any]], None] | None = None, *,
                       signum: int = signal.SIGUSR1, stop: bool = True) -> None:
        """Save the exact position when the batch system warns of the time limit.

        With ``#SBATCH --signal=USR1@120`` Slurm sends SIGUSR1 two minutes before the limit.  At
        the next batch boundary (at once when no iteration is running) :meth:`state_dict` is
        written to ``path`` (JSON, atomically) and/or passed to ``callback``; with ``stop=True``
        the running iteration then ends, so the loop can save the model and exit, and the next
        job resumes with ``load_state_dict(json.load(open(path)))``, every sample exactly once.

        An iteration counts as running from its first ``next()`` (while it starts its workers
        too) to its end: a signal that comes after its last batch boundary is saved as it ends.
        After a stop save, every later iteration ends at once (what it would deliver comes
        after the saved position) until :meth:`load_state_dict` or another
        ``save_on_signal``.  The workers ignore ``signum`` (those running now from their next
        epoch; the stager ignores SIGUSR1 and SIGUSR2), and the handler saves only in the
        process that called this: a forked child that gets the signal writes nothing.  Call
        from the main thread.

        Raises:
            UsageError: neither ``path`` nor ``callback`` given, ``path`` is a directory (or
                ends with ``/``), or its directory does not exist or cannot be written (found
                now, not when the signal comes).
        """
        if path is None and callback is None:
            raise UsageError("save_on_signal needs path= (a JSON file) or callback=")
        if path is not None:
            name = os.fspath(path)
            if name.endswith(("/", os.sep)) or os.path.isdir(name):
                raise UsageError(f"save_on_signal: {name!r} is a directory; pass the path of "
                                 f"the JSON file to write, e.g. "
                                 f"{os.path.join(name, 'loader.json')!r}")
            folder = os.path.dirname(os.path.abspath(os.fspath(path)))
            if not os.path.isdir(folder):
                raise UsageError(f"save_on_signal: the folder of {os.fspath(path)!r} does not "
                                 f"exist; create it first (os.makedirs({folder!r}))")
            if not os.access(folder, os.W_OK | os.X_OK):
                raise UsageError(f"save_on_signal: cannot write in {folder}, the folder of "
                                 f"{os.fspath(path)!r}; choose a writable path")
        owner = os.getpid()
        self._preempt = (None if path is None else os.fspath(path), callback, stop)
        self._preempt_pending = False
        self._stop_next = False

        def handler(signo: int, frame: Any) -> None:
            if os.getpid() != owner:
                # A forked child (a worker before it ignores the signal, or any other fork of
                # this process) holds a stale copy of this loader: the position is main's.
                return
            if self._saving:  # a second signal while the first one's save runs: the same
                return
            if self._iterating:
                self._preempt_pending = True  # saved at the next batch boundary, or the end
            else:
                self._save_preempted()
                self._stop_next = self._stop_next or stop

        signal.signal(signum, handler)
        # Workers ignore it: those started from now on at once, running ones from their next
        # epoch (see WorkerPool.ignore_signals).
        self._signals.add(int(signum))
        if self._pool is not None:
            self._pool.ignore_signals = tuple(self._signals)

    def _save_preempted(self) -> None:
        self._preempt_pending = False
        path, callback, _stop = self._preempt
        self._saving = True
        try:
            state = self.state_dict()
            if path is not None:
                atomic_write_bytes(path, json.dumps(state, sort_keys=True).encode())
            if callback is not None:
                callback(state)
        finally:
            self._saving = False
        self.preempted = True
        log.warning("preemption signal: loader position saved (%s)", path or "callback")

    def _drain_releases(self, ring: Any = None) -> bool:
        """Release the messages whose batches the loop let go of; True if one was ``ring``'s.

        Then forget the hand-outs (``_leased``, kept for :meth:`_make_room`) that are over:
        from the front, where the loop's batches are let go of in order, and in a sweep of the
        whole list when batches kept ahead of the others make it grow (its length bounds the
        next sweep, so each hand-out costs O(1)).  Before, only a full ring pruned it: a loop
        whose rings never filled kept ~1 KB a batch for good (1.7 million steps, 2 GB)."""
        mine = False
        while self._released:
            r, msg = self._released.popleft()
            r.release(msg)
            mine = mine or r is ring
        leased = self._leased
        while leased and not _held(leased[0]):
            leased.popleft()
        if len(leased) > self._sweep_at:
            self._leased = deque(e for e in leased if _held(e))
            self._sweep_at = max(_SWEEP_MIN, 2 * len(self._leased))
        return mine

    def _materialize(self, ring: Any, msg: Any) -> Any:
        spilled = ring is None  # came through the worker's spill pipe: already a private copy
        views = self.dataset.options.zero_copy  # bytes columns as arrays viewing the message
        self._handouts += 1
        if spilled:
            self._stats.spilled += 1
        if spilled and self.ring_bytes and len(msg.view) > self.ring_bytes - 4096:
            if not self._warned_big:
                self._warned_big = True
                warnings.warn(
                    f"a batch of {len(msg.view)} bytes does not fit the {self.ring_bytes} byte "
                    "shared-memory ring; such batches are copied through a pipe (slower): raise "
                    "ring_bytes", RuntimeWarning, stacklevel=4)
            self._stats.copied_out += 1
            return read_tree(np.frombuffer(msg.view, dtype=np.uint8), torch.from_numpy, views)
        # Batches of this ring the loop still holds (not those received ahead of their turn,
        # nor this one: it has only just arrived).
        if spilled or self._copy_all(ring) or (
                sum(m.nbytes for m in ring.held_messages() if m.in_use)
                > ring.capacity * self.options.max_held_fraction):
            if not self._warned_copy:
                self._warned_copy = True
                warnings.warn(
                    "the training loop holds on to so many batches that the shared-memory ring "
                    "would fill; shardio copies batches out of the ring while it does (slower). "
                    "Drop references to old batches, or raise ring_bytes", RuntimeWarning,
                    stacklevel=4)
            self._stats.copied_out += 1
            if spilled:
                return read_tree(np.frombuffer(msg.view, dtype=np.uint8), torch.from_numpy, views)
            # Each field copied on its own: a loop that keeps one field of every batch (its
            # labels, say) keeps that much, not whole batches.
            tree = read_tree(np.frombuffer(msg.view, dtype=np.uint8), torch.from_numpy, views,
                             copy=True)
            ring.release(msg)
            return tree
        lease = ring.array(msg, writable=True).view(_Lease)
        weakref.finalize(lease, self._released.append, (ring, msg))
        fields: list[tuple[weakref.ref[Any], int, int]] = []
        tree = read_tree(lease, torch.from_numpy, views,
                         on_field=lambda a, off, n: fields.append((weakref.ref(a), off, n)))
        self._leased.append((self._handouts, ring, msg, fields))
        return tree

    def _copy_all(self, ring: Any) -> bool:
        """Whether batches of ``ring`` are copied out on arrival rather than handed out from it
        (see :meth:`_make_room`)."""
        return (self._detach_events > _MAX_DETACH_EVENTS
                or ring.retired_mappings() >= _MAX_RETIRED_MAPPINGS)

    def _make_room(self, ring: Any) -> bool:
        """The pool's ``make_room``: ``ring``'s worker waits for space while the loop waits for
        its next batch (or a batch of it just came through the pipe).  True if space came back.

        A ring frees space in stream order, so a batch kept for good (a batch saved for
        plotting, a variable left bound after a loop) stops it once the worker comes round to
        it, and every later batch of that worker would crawl through its pipe.  A loop holds
        the batch it works on while it asks for the next; a batch handed out before that one
        and still held when its ring is full is kept on purpose, and gets its pages replaced by
        private copies at the same addresses (``Ring.detach``: one copy of the pages of the
        fields still referenced; the user's tensors do not notice) and its ring space back.
        Only then: a loop that merely holds a batch a step longer (``prev = batch``) never
        pays for a move while its ring has room.  A loop that keeps batch after batch would
        need a move every time the ring fills (and a new mapping of the ring, alive while
        anything kept views it): after ``_MAX_DETACH_EVENTS`` in an epoch, or with
        ``_MAX_RETIRED_MAPPINGS`` of a ring's old mappings still in use, batches are copied out
        of that ring on arrival instead (see ``_materialize``), and the kept ones still in it
        move out together, the one the loop works on included."""
        freed = self._drain_releases(ring)
        if not self._leased or self._detach_failed:
            return freed
        last = self._handouts
        copy_all = self._copy_all(ring)
        msgs: list[Any] = []
        spans: list[Any] = []
        still: deque[tuple[int, Any, Any, list[Any]]] = deque()
        for entry in self._leased:
            n, r, msg, fields = entry
            if msg.detached or not msg.in_use or r.closed:
                continue  # released (or queued for it), moved out, or its pool is gone
            if r is ring and (n < last or copy_all):
                # Only the fields still held keep their bytes (a loop that keeps the labels
                # of every batch keeps just those); None: whatever holds the batch, all of it.
                msgs.append(msg)
                spans.append([(off, size) for ref, off, size in fields if ref() is not None]
                             or None)
            else:
                still.append(entry)
        self._leased = still
        if not msgs:
            return freed
        before = len(ring.held_messages())
        try:
            ring.detach(msgs, spans)
        except (OSError, UsageError) as exc:
            # Kept batches then stop their rings as before detach existed: slower (their
            # workers' batches take the pipe), never wrong.
            self._detach_failed = True
            log.warning("cannot move kept batches out of the shared-memory ring (%s); "
                        "later batches may be slower while they are kept", exc)
        self._detach_events += 1
        moved = before - len(ring.held_messages())
        self._stats.detached += moved
        return freed or moved > 0

    def _spec(self, stride: int) -> dict[str, Any]:
        """What every worker needs to make its batches of the coming epoch (``_Job.begin``)."""
        ds = self.dataset
        topo = ds.topology
        return {"epoch": ds.epoch, "cursor": ds._cursor, "world_size": topo.world_size,
                "rank": topo.rank, "batch_size": self.batch_size, "stride": stride,
                "seed": self.seed,
                "node_order": (ds._node_params(self.batch_size)
                               if ds.options.order == "node" else None)}

    def __iter__(self) -> Iterator[Any]:
        # Marked running before anything else: from here on a preemption signal is left pending
        # for a batch boundary of this iteration (or its end), never saved by the handler
        # behind its back while it starts its workers.  (The token: a superseded iteration
        # must not clear a newer one's mark.)
        self._iterating = token = object()
        try:
            if self._stop_next:
                # A stop signal was saved before this iteration (between iterations, or at the
                # end of the last one), recording the position from which it would deliver: it
                # ends at once (exactly once on resume).
                log.warning("preemption: the loader position was saved before this iteration; "
                            "it ends at once (check loader.preempted and exit)")
                return
            if self.num_workers == 0:
                yield from self._iter_here(token)
            else:
                yield from self._iter_pool(token)
        finally:
            if self._iterating is token:
                if self.num_workers and not self.persistent_workers:
                    # As a DataLoader's iterator stops its workers, but the loop does not wait
                    # for the kernel to tear them down (close() does).
                    self._close(wait=False)
                self._iterating = None
                # A signal after this iteration's last check (it was running, so the handler
                # left it pending) is saved now; after this, the handler saves by itself.
                if self._preempt_pending:
                    self._save_preempted()
                    self._stop_next = self._stop_next or self._preempt[2]

    def _iter_pool(self, token: object) -> Iterator[Any]:
        """The iteration with worker processes (``num_workers > 0``)."""
        pool = self._ensure_pool()
        steps = range(self._num_steps(self._plan()))
        spec = self._spec(pool.num_workers)
        self._begin_epoch()
        self._detach_events = 0
        pool.ignore_signals = tuple(self._signals)  # (registered since the pool started)
        self._count_restarts(pool)
        it = pool.run(spec, steps)
        while True:
            if self._iterating is not token:
                # (checked here too: with persistent_workers=False the newer iteration may
                # have closed the pool, whose own check then said "the pool is closed")
                raise UsageError(
                    "this iterator was superseded by a newer iter(loader) (each one "
                    "starts a new epoch); iterate one at a time")
            self._drain_releases()
            if self._preempt_pending and self._preempt_stop():
                return
            started = self._stats.begin_wait()
            try:
                _step, ring, msg = next(it)
            except StopIteration:
                break
            except (WorkerCrashedError, WorkerTimeoutError, ShmSpaceError):
                # The pool lost a worker for good, one hangs, or its rings did not fit: a
                # later iteration starts a fresh one.
                self.close()
                raise
            if self._preempt_pending:  # arrived while waiting: save before this batch
                if self._preempt[2]:  # stop: not handed out (the resume redoes it)
                    WorkerPool._discard(ring, msg)
                    self._preempt_stop()
                    return
                self._save_preempted()  # and go on: the batch is handed out as usual
            stages = read_header(msg.view)[2]
            batch = self._materialize(ring, msg)
            del msg
            if self.pin_memory:
                batch = _pin(batch)
            self._delivered += 1
            self._count_restarts(pool)
            self._stats.end_wait(started, stages)
            yield batch
        self._count_restarts(pool)
        self._end_epoch()

    def _iter_here(self, token: object) -> Iterator[Any]:
        """``num_workers=0``: each batch made in this process when the loop asks for it, as
        DataLoader's ``num_workers=0`` does (a breakpoint in a transform stops the loop; its
        exceptions arrive as they are).  The same batches, and the same random draws, as with
        workers: the generators are seeded for each batch as a worker would seed them, and
        this process's own generator states are put back afterwards."""
        ds = self.dataset
        views = ds.options.zero_copy
        job = _Job(ds, self.collate_fn, in_process=True)
        keep = ds.reader.arena  # the job reads into its own memory; the dataset's is put back
        self._begin_epoch()
        for step in range(self._num_steps(self._plan())):
            if self._iterating is not token:
                raise UsageError(
                    "this iterator was superseded by a newer iter(loader) (each one "
                    "restarts the epoch from the loader's position): iterate one at a time")
            if self._preempt_pending and self._preempt_stop():
                return
            started = self._stats.begin_wait()
            states = (torch.get_rng_state(), random.getstate(), np.random.get_state())
            try:
                if step == 0:
                    job.begin(self._spec(1))
                else:
                    ds.reader.set_arena(job.private if views else None)
                out, times = job.produce(step)
                t0 = time.perf_counter()
                buf = np.empty(out.nbytes, dtype=np.uint8)
                out.write(memoryview(buf), step, times)
                del out
            finally:
                ds.reader.set_arena(keep)
                torch.set_rng_state(states[0])
                random.setstate(states[1])
                np.random.set_state(states[2])
            times[4] = time.perf_counter() - t0
            times[5] += times[4]
            batch = read_tree(buf, torch.from_numpy, views)
            del buf
            if self.pin_memory:
                batch = _pin(batch)
            self._delivered += 1
            self._stats.end_wait(started, dict(zip(STAGES, times)))
            yield batch
        # A signal that came during the last step is saved now, as the loop with workers
        # saves it when it asks for the batch after the last (the end of the epoch).
        if self._preempt_pending and self._preempt_stop():
            return
        self._stats.begin_wait()  # the last step's compute ends here (as with workers)
        self._end_epoch()

    def _begin_epoch(self) -> None:
        """An iteration starts (with workers or without): counters, stats, staging."""
        self._delivered = 0
        self._finished = False
        self._gen = self.dataset._position_gen
        self._stats.begin_epoch()
        self.dataset._start_staging(self.dataset.epoch, self.batch_size)

    def _end_epoch(self) -> None:
        """An iteration delivered its whole epoch: the next one starts the epoch over (unless
        the position was set while it ran: see :meth:`load_state_dict`)."""
        self._stats.epoch_end()
        ds = self.dataset
        if self._gen != ds._position_gen:
            return
        self._finished = True
        ds._run_cursor, ds._finished = ds._cursor, True  # what ds.state_dict(batches=) counts from
        ds._cursor = 0

    def _count_restarts(self, pool: WorkerPool) -> None:
        """``stats()["restarts"]``: over the loader's life (its closed pools' too)."""
        self._stats.restarts = self._restarts_before + pool.restarts

    def _preempt_stop(self) -> bool:
        """Save the position; True when the iteration must end (``stop=True``): so do later
        ones, at once (what they would deliver comes after the saved position)."""
        self._save_preempted()
        if self._preempt[2]:
            self._stop_next = True
            self.close()  # the undelivered prefetched batches are dropped; resume redoes them
            return True
        return False

    # --- checkpointing and stats -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Resume point after the batches handed out so far (prefetched ones do not count)."""
        ds = self.dataset
        if self._gen != ds._position_gen:
            # The dataset's position was set since this loader counted (ds.set_epoch to
            # another epoch, ds.load_state_dict): nothing of it was handed out yet.
            cursor = ds._cursor
        elif self._finished:
            cursor = ds.num_samples
        else:
            # This loader's batch size, not the dataset's ReadOptions.batch_size: the batches
            # counted here were cut by the loader.
            cursor = ds._cursor + self._plan().consumed(self._delivered)
        return ds.state_dict(batches=0) | {"cursor": cursor, "batch_size": self.batch_size,
                                           "worker_seed": self.seed,
                                           "order": ds._order_state(self.batch_size)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly after what :meth:`state_dict` recorded (world size, worker count and
        batch size may differ), with its base seed of the workers' generators (a state without
        one, from a ShardDataset, keeps this loader's).  Loaded during an iteration, it applies
        to the next one (as :meth:`set_epoch` does)."""
        seed = state.get("worker_seed") if isinstance(state, dict) else None
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
                                 or not 0 <= seed < 1 << 63):
            # (checked first: a refused state changes nothing)
            raise UsageError(f"state worker_seed must be an integer in [0, 2**63), got "
                             f"{seed!r}: pass the dict state_dict() returned, unchanged")
        self.dataset.load_state_dict(state)
        if seed is not None:
            self.seed = int(seed)
        self._stop_next = False
        if self._iterating is not None:
            # Loaded while an iteration runs: the position is the next iteration's.  The
            # running one's count stays with its own (now stale) generation, so state_dict()
            # says the loaded position and its end does not overwrite it.  (Before, its end
            # marked the loaded epoch delivered, and its batches counted from the loaded
            # position.)
            return
        self._delivered = 0
        self._finished = False
        self._gen = self.dataset._position_gen

    def stats(self) -> dict[str, Any]:
        """Data-wait vs compute per step, per-stage worker times, copies, worker restarts (over
        the loader's life, its earlier pools' included); ``repair``: fault and self-repair
        events and reads per source (metadata operations, bytes), summed over the workers;
        ``stage``: the node cache's counters when staging is on."""
        out = self._stats.summary()
        out.update(self.dataset.io_stats())
        return out

    def close(self) -> None:
        """Stop the workers and release shared memory (also done at garbage collection).  When
        it returns, no worker of this loader is left, including those of iterations that ended
        with ``persistent_workers=False`` (which do not wait for their workers to exit)."""
        self._close(wait=True)
        exiting, self._exiting = self._exiting, []
        if exiting:
            reap_exiting(wait=True, procs=exiting)

    def _close(self, wait: bool) -> None:
        """Close the pool; ``wait=False``: leave its workers' exits to
        :func:`shardio.pool.reap_exiting` (see *Closing without waiting* there)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            # Let go of the pool first: a close interrupted by Ctrl-C leaves this loader with
            # no half-closed pool (the next iteration starts a new one), and the pool finishes
            # its own close when it is collected (or closed again).
            self._released.clear()
            self._leased.clear()
            self._restarts_before += pool.restarts
            self._stats.restarts = self._restarts_before
            pool.close(wait)
            if not wait:
                self._exiting = [p for p in self._exiting if still_exiting(p)]
                self._exiting += pool.exiting

    def __enter__(self) -> ShardLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _check_dataloader_args(dataset: ShardDataset, batch_size: int | None, shuffle: Any,
                           sampler: Any, batch_sampler: Any, timeout: Any, worker_init_fn: Any,
                           context: Any, generator: Any, persistent_workers: Any,
                           pin_memory_device: Any, in_order: Any) -> None:
    """DataLoader's arguments that ShardLoader takes: a UsageError for a value it cannot
    honour, naming what to do instead."""
    if batch_size is None:
        raise UsageError("batch_size=None (one sample at a time) is DataLoader's; ShardLoader "
                         "moves whole batches: give a batch size, or iterate the ShardDataset "
                         "under DataLoader(batch_size=None)")
    if shuffle is not None and not isinstance(shuffle, bool):  # (0 == False, 1 == True)
        raise UsageError(f"shuffle must be None, False or True, got {shuffle!r} (the arguments "
                         "are in DataLoader's places: shuffle is the third; pass num_workers "
                         "by keyword)")
    if shuffle and not dataset.options.shuffle:
        raise UsageError("shuffle=True: the order is the dataset's, and this ShardDataset does "
                         "not shuffle; construct it with ShardDataset(..., shuffle=True, seed=...)")
    if sampler is not None or batch_sampler is not None:
        raise UsageError("ShardLoader takes no sampler or batch_sampler: the ShardDataset defines "
                         "the order (seed, shuffle) and splits it over ranks itself (no "
                         "DistributedSampler needed); drop the argument")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
        raise UsageError(f"timeout must be a number of seconds >= 0, got {timeout!r}")
    if worker_init_fn is not None and not callable(worker_init_fn):
        raise UsageError(f"worker_init_fn must be callable, got {worker_init_fn!r}")
    method = context if context is None or isinstance(context, str) else getattr(
        context, "get_start_method", lambda: context)()
    if method not in (None, "fork"):
        raise UsageError(f"multiprocessing_context={context!r}: ShardLoader forks its workers "
                         "(they inherit the dataset and the shared-memory rings); drop the "
                         "argument or pass 'fork'")
    if generator is not None and not isinstance(generator, torch.Generator):
        raise UsageError(f"generator must be a torch.Generator, got {generator!r}")
    if not isinstance(persistent_workers, bool):
        raise UsageError(f"persistent_workers must be True or False, got {persistent_workers!r}")
    if not isinstance(pin_memory_device, str) or pin_memory_device.split(":")[0] not in ("",
                                                                                         "cuda"):
        raise UsageError(f"pin_memory_device={pin_memory_device!r}: ShardLoader pins memory for "
                         "CUDA only; pass '' or 'cuda'")
    if not isinstance(in_order, bool):
        raise UsageError(f"in_order must be True or False, got {in_order!r}")


def _weakly(method: Callable[..., Any], gone: Any) -> Callable[..., Any]:
    """``method`` (a bound method) called through a weak reference to its object; ``gone``
    once the object is collected."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        live = ref()
        return gone if live is None else live(*args)

    return call


def _pin(tree: Any) -> Any:
    """The batch in page-locked memory, as DataLoader's ``pin_memory=True`` makes it: torch's
    own routine, so named tuples, mapping types and batch objects with a ``pin_memory()``
    method come out as there (a loop of our own turned a named tuple into a plain tuple)."""
    if not torch.cuda.is_available():
        return tree
    from torch.utils.data._utils.pin_memory import pin_memory

    return pin_memory(tree)
