"""Persistent worker processes that produce batches straight into shared-memory rings.

Protocol
    Each worker owns one SPSC :class:`~shardio.ring.Ring` (worker produces, main consumes) and
    one control pipe (main → worker, control only; batch data never crosses it).  Commands are
    small tuples tagged with :class:`Cmd`:

    * ``(Cmd.EPOCH, generation, spec, steps)``: call ``job.begin(spec)`` then, for each step,
      ``job.produce(step)`` and write the resulting message into the ring.
    * ``(Cmd.STOP,)``: exit.

    Messages carry the step number and the generation (``_tree`` header); main drops messages of
    an older generation, and a worker abandons an epoch as soon as the shared generation counter
    moves on (checked before every step), so breaking out of an epoch costs at most one batch.

    Global step ``t`` of an epoch is produced by worker ``(t - first) % W``; main consumes steps in
    order, so batches arrive in the deterministic order the dataset contract defines.

Failure handling
    A worker exception travels back as a :data:`~shardio._tree.KIND_ERROR` message and is raised
    in main as :class:`~shardio.errors.WorkerError` with the worker's traceback.  A worker that dies
    (SIGKILL, segfault) is noticed within ``poll_interval`` seconds while main waits on its ring;
    committed messages still in its ring stay valid, and a fresh worker (same ring) redoes the
    steps that were never committed.  After ``max_restarts`` deaths, :class:`WorkerCrashedError`.
    Workers get ``PR_SET_PDEATHSIG``: if main dies, so do they, and the rings (unlinked at creation)
    vanish with the last mapping.

Worker states: STARTING → IDLE ⇄ PRODUCING → STOPPED | DEAD (→ restarted as a new STARTING).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

from ._tree import KIND_ERROR, Plan, error_message, read_error
from .errors import RingClosedError, RingTimeoutError, WorkerCrashedError, WorkerError
from .ring import Message, Ring, check_shm_space

__all__ = ["BatchJob", "Cmd", "PoolOptions", "WorkerPool"]

log = logging.getLogger("shardio.pool")


class Cmd(IntEnum):
    EPOCH = 1
    STOP = 2


class BatchJob(Protocol):
    """What a worker runs; built in main and inherited by ``fork``."""

    def begin(self, spec: Any) -> None: ...

    def produce(self, step: int) -> tuple[Plan, list[float]]: ...


@dataclass(frozen=True, kw_only=True)
class PoolOptions:
    """Worker pool settings (see :class:`~shardio.loader.ShardLoader`)."""

    num_workers: int = 2
    ring_bytes: int = 128 << 20
    shm_dir: str | None = None
    cpus: tuple[int, ...] | None = None
    poll_interval: float = 0.2
    max_restarts: int = 3
    join_timeout: float = 5.0


def _set_pdeathsig() -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        pass


def _worker_main(job: BatchJob, ring: Ring, conn: Any, gen: Any, index: int,
                 cpus: Sequence[int] | None, parent: int) -> None:
    _set_pdeathsig()
    if os.getppid() != parent:  # main died before prctl took effect
        os._exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is main's to handle
    if cpus:
        try:
            os.sched_setaffinity(0, {cpus[index % len(cpus)]})
        except OSError as exc:
            log.warning("worker %d: cannot pin to CPU %s: %s", index, cpus[index % len(cpus)], exc)
    ring.become_producer()
    while True:
        try:
            cmd = conn.recv()
        except (EOFError, OSError):
            return
        if cmd[0] == Cmd.STOP:
            return
        _, generation, spec, steps = cmd
        try:
            job.begin(spec)
            for step in steps:
                if gen.value != generation:
                    break
                plan, times = job.produce(step)
                buf = ring.reserve(plan.nbytes)
                plan.write(buf, step, times, generation=generation)
                del buf
                ring.commit()
        except RingClosedError:
            return
        except BaseException as exc:  # noqa: BLE001 - everything goes back to main
            plan = error_message(exc, traceback.format_exc())
            try:
                buf = ring.reserve(plan.nbytes)
                plan.write(buf, -1, [], kind=KIND_ERROR, generation=generation)
                del buf
                ring.commit()
            except RingClosedError:
                return


@dataclass
class _Worker:
    index: int
    ring: Ring
    proc: Any = None
    conn: Any = None
    restarts: int = 0
    pending: deque[Message] = field(default_factory=deque)


class WorkerPool:
    """``num_workers`` persistent processes, one ring each.

    Args:
        job: the batch producer, inherited by the forked workers.
        options: :class:`PoolOptions`.

    Raises:
        ShmSpaceError: the rings do not fit in the shared-memory directory or the cgroup limit.
    """

    def __init__(self, job: BatchJob, options: PoolOptions) -> None:
        self.job = job
        self.options = options
        self._ctx = mp.get_context("fork")
        self._gen = self._ctx.RawValue("q", 0)
        self._workers: list[_Worker] = []
        self._closed = False
        self.restarts = 0

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        o = self.options
        check_shm_space(o.ring_bytes * o.num_workers, o.shm_dir)
        try:
            for i in range(o.num_workers):
                ring = Ring.create(o.ring_bytes, directory=o.shm_dir, unlink_now=True)
                w = _Worker(i, ring)
                self._workers.append(w)
                self._spawn(w)
        except BaseException:
            self.close()
            raise

    def _spawn(self, w: _Worker) -> None:
        parent_conn, child_conn = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(
            target=_worker_main, name=f"shardio-worker-{w.index}", daemon=True,
            args=(self.job, w.ring, parent_conn, self._gen, w.index, self.options.cpus,
                  os.getpid()),
        )
        proc.start()
        parent_conn.close()
        w.proc, w.conn = proc, child_conn

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.proc is not None]

    # --- epochs ------------------------------------------------------------------------------
    def run(self, spec: Any, steps: Sequence[int]) -> Iterator[tuple[int, Ring, Message]]:
        """Produce ``steps`` (in order); yield ``(step, ring, message)`` for each.

        The caller releases every message with ``ring.release(message)`` once done with it.
        """
        if self._closed:
            raise WorkerError("the worker pool is closed; create a new loader")
        self._gen.value += 1
        generation = self._gen.value
        W = len(self._workers)
        assigned = [list(steps[i::W]) for i in range(W)]
        for w, mine in zip(self._workers, assigned):
            self._drop_stale(w, generation)
            w.conn.send((Cmd.EPOCH, generation, spec, mine))
        done = [0] * W
        for k, step in enumerate(steps):
            w = self._workers[k % W]
            msg = self._next(w, generation, spec, assigned[k % W][done[k % W]:])
            done[k % W] += 1
            yield step, w.ring, msg

    def _drop_stale(self, w: _Worker, generation: int) -> None:
        while w.pending:
            w.ring.release(w.pending.popleft())

    def _next(self, w: _Worker, generation: int, spec: Any, todo: list[int]) -> Message:
        from ._tree import read_header

        deadline_logged = False
        while True:
            if w.pending:
                msg = w.pending.popleft()
            else:
                try:
                    msg = w.ring.recv(timeout=self.options.poll_interval)
                except RingTimeoutError:
                    if w.proc.exitcode is not None:
                        self._restart(w, generation, spec, todo)
                    elif not deadline_logged and not w.proc.is_alive():
                        deadline_logged = True
                    continue
            kind, step, _times, gen = read_header(msg.view)
            if gen != generation:
                w.ring.release(msg)
                continue
            if kind == KIND_ERROR:
                exc, tb = read_error(msg.view)
                w.ring.release(msg)
                raise WorkerError(
                    f"worker {w.index} raised {type(exc).__name__}: {exc}\n"
                    f"--- worker traceback ---\n{tb}"
                ) from exc
            if step != todo[0]:
                w.ring.release(msg)
                raise WorkerError(f"worker {w.index} sent step {step}, expected {todo[0]}")
            return msg

    def _restart(self, w: _Worker, generation: int, spec: Any, todo: list[int]) -> None:
        code = w.proc.exitcode
        w.restarts += 1
        self.restarts += 1
        if w.restarts > self.options.max_restarts:
            raise WorkerCrashedError(
                f"worker {w.index} died ({_describe_exit(code)}) {w.restarts} times; giving up "
                f"after max_restarts={self.options.max_restarts}: look for out-of-memory kills "
                "(dmesg) or crashes in native decode/transform code"
            )
        log.warning("worker %d died (%s); restarting it and redoing its unfinished batches",
                    w.index, _describe_exit(code))
        # Whatever it committed is still in the ring and valid: keep it, redo only the rest.
        from ._tree import read_header

        committed: list[int] = []
        while True:
            try:
                msg = w.ring.recv(timeout=0)
            except RingTimeoutError:
                break
            kind, step, _t, gen = read_header(msg.view)
            if gen == generation and kind != KIND_ERROR:
                w.pending.append(msg)
                committed.append(step)
            else:
                w.ring.release(msg)
        redo = [s for s in todo if s not in set(committed)]
        w.conn.close()
        w.proc.join(0)
        w.ring.reset_producer()
        self._spawn(w)
        w.conn.send((Cmd.EPOCH, generation, spec, redo))

    def close(self) -> None:
        """Stop workers (join → terminate → kill, bounded) and release the rings."""
        if self._closed:
            return
        self._closed = True
        self._gen.value += 1
        for w in self._workers:
            try:
                w.conn.send((Cmd.STOP,))
            except (OSError, AttributeError, BrokenPipeError):
                pass
            w.ring.close()
        deadline = time.monotonic() + self.options.join_timeout
        for w in self._workers:
            if w.proc is None:
                continue
            w.proc.join(max(0.0, deadline - time.monotonic()))
            if w.proc.is_alive():
                w.proc.terminate()
                w.proc.join(1.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(1.0)
        for w in self._workers:
            w.pending.clear()
            w.ring.unlink()
            if w.conn is not None:
                w.conn.close()

    def __del__(self) -> None:
        if threading is not None and not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
