"""What the node stager does next: Belady planning over the known order of use (pure, no I/O).

The stager (:mod:`shardio.stage`) walks the accesses of the epochs it plans in order of first
use; :class:`_Planner` says, for the frontier of the readers, whether to stage the next access
(and which cached shards to evict for it, by :func:`belady_plan`), re-verify a cached copy, skip
an access already being read, read it directly (bypass), trim the cache to a smaller budget, or
wait for the readers.  :func:`simulate` drives the same planner with readers in lockstep: the
model the tests compare the real stager with.  Times are integers ``epoch << 40 | position``
(:func:`time_key`), so (epoch, position) pairs compare as one number.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import UsageError

__all__ = ["INF", "belady_plan", "simulate", "time_key"]

_POS_BITS = 40
_MAX_EPOCH = 1 << 23
_MAX_POSITION = 1 << _POS_BITS
INF = math.inf


def time_key(epoch: int, position: int) -> int:
    """The integer time of ``(epoch, position)``: ordered like the pair, as readers report it.

    Raises:
        UsageError: epoch outside [0, 2**23) or position outside [0, 2**40).
    """
    epoch, position = int(epoch), int(position)
    if not (0 <= epoch < _MAX_EPOCH and 0 <= position < _MAX_POSITION):
        raise UsageError(f"epoch {epoch} / position {position} out of range for staging "
                         f"(epoch < {_MAX_EPOCH}, position < 2**{_POS_BITS})")
    return epoch << _POS_BITS | position


def _split(key: int) -> tuple[int, int]:
    return key >> _POS_BITS, key & (_MAX_POSITION - 1)


def belady_plan(cached: Mapping[int, int], budget: int, next_use: Mapping[int, float],
                size: int, newcomer_next: float) -> list[int] | None:
    """Which cached shards to evict so a newcomer of ``size`` bytes fits, by Belady's rule.

    Victims are the cached shards needed after the newcomer's next use (``next_use`` larger than
    ``newcomer_next``; ``math.inf``: not needed again), farthest first (ties: larger first, then
    lower shard).  With the copy it is about to make being the read that serves the newcomer's
    current access, keeping the newcomer only pays when it is needed again before them; so
    ``None`` (do not keep it: read it directly) when those victims cannot free enough bytes.
    With equal sizes this is Belady's MIN with bypass, optimal in shared-filesystem reads.

    Args:
        cached: shard -> bytes of every cached shard.
        budget: bytes the cache may hold.
        next_use: shard -> time of its next use (missing: never).
        size: bytes of the newcomer.
        newcomer_next: time of the newcomer's next use after the current one.

    Returns:
        The victims in eviction order (``[]`` when it fits), or ``None``.
    """
    used = sum(cached.values())
    if used + size <= budget:
        return []
    if size > budget:
        return None
    need = used + size - budget
    later = [j for j in cached if next_use.get(j, INF) > newcomer_next]
    later.sort(key=lambda j: (-next_use.get(j, INF), -cached[j], j))
    victims, freed = [], 0
    for j in later:
        victims.append(j)
        freed += cached[j]
        if freed >= need:
            return victims
    return None


class _Planner:
    """What the stager does next, in order of use (pure: no I/O; see the module docstring).

    Accesses of the horizon are sorted by first use; ``c`` is the cursor.  For each cached shard
    ``nu`` is the time of its next access at or after the cursor and ``pend`` the last step of
    its accesses before the cursor (still to be read while ``pend >= frontier min``: busy).
    """

    def __init__(self, size_of: Callable[[int], int], budget: int, verify_reuse: bool) -> None:
        self.size_of, self.budget, self.verify_reuse = size_of, budget, verify_reuse
        self.cached: dict[int, int] = {}
        self.verified: dict[int, int] = {}
        self.used = 0
        self.epoch: int | None = None
        self.epochs: list[int] = []
        self.shard: list[int] = []
        self.start: list[int] = []
        self.end: list[int] = []
        self.ep: list[int] = []
        self.nxt: list[int] = []
        self.uses: dict[int, list[int]] = {}
        self.c = 0
        self.nu: dict[int, float] = {}
        self.pend: dict[int, int] = {}
        self._heap: list[tuple[float, int]] = []

    def plan(self, epoch: int, schedules: Sequence[tuple[int, Any]]) -> None:
        """Walk the accesses of ``schedules`` (``(epoch, schedule)``, epochs ascending)."""
        shard: list[int] = []
        start: list[int] = []
        end: list[int] = []
        ep: list[int] = []
        for e, sch in schedules:
            first = np.asarray(sch.first, dtype=np.int64)
            order = np.argsort(first, kind="stable")
            last = np.asarray(sch.last, dtype=np.int64)[order]
            if len(last) and (int(first.min()) < 0 or int(last.max()) >= _MAX_POSITION):
                raise UsageError(f"epoch {e}: schedule positions out of range for staging")
            shard += np.asarray(sch.shards, dtype=np.int64)[order].tolist()
            start += (first[order] + (e << _POS_BITS)).tolist()
            end += (last + (e << _POS_BITS)).tolist()
            ep += [e] * len(order)
        self.epoch, self.epochs = epoch, [e for e, _ in schedules]
        self.shard, self.start, self.end, self.ep = shard, start, end, ep
        self.nxt = [-1] * len(shard)
        self.uses = {}
        seen: dict[int, int] = {}
        for k in range(len(shard) - 1, -1, -1):
            self.nxt[k] = seen.get(shard[k], -1)
            seen[shard[k]] = k
        for k, s in enumerate(shard):
            self.uses.setdefault(s, []).append(k)
        self.c = 0
        self._reindex()

    def _reindex(self) -> None:
        self.nu, self.pend, self._heap = {}, {}, []
        for j in self.cached:
            ks = self.uses.get(j, [])
            i = bisect.bisect_left(ks, self.c)
            self.nu[j] = self.start[ks[i]] if i < len(ks) else INF
            self.pend[j] = max((self.end[k] for k in ks[:i]), default=-1)
            self._heap.append((-self.nu[j], j))
        heapq.heapify(self._heap)

    def _max_nu(self) -> float:
        heap = self._heap
        while heap:
            nu, j = heap[0]
            if self.nu.get(j) == -nu:
                return -nu
            heapq.heappop(heap)
        return -INF

    def advance(self, k: int) -> None:
        """The cursor moves past access ``k``."""
        self.c = k + 1
        s = self.shard[k]
        if s in self.cached:
            nx = self.nxt[k]
            nu = self.start[nx] if nx >= 0 else INF
            self.nu[s] = nu
            self.pend[s] = max(self.pend[s], self.end[k])
            if len(self._heap) > 2 * len(self.cached) + 64:
                self._reindex()
            else:
                heapq.heappush(self._heap, (-nu, s))

    def admit(self, k: int, size: int) -> None:
        """Shard ``shard[k]`` was staged for access ``k``."""
        s = self.shard[k]
        self.cached[s] = size
        self.used += size
        self.verified[s] = self.ep[k]
        self.nu[s], self.pend[s] = self.start[k], -1
        self.advance(k)

    def evict(self, j: int) -> None:
        self.used -= self.cached.pop(j)
        self.nu.pop(j, None)
        self.pend.pop(j, None)
        self.verified.pop(j, None)

    def requeue(self, j: int, hi: int | None) -> None:
        """Shard ``j`` lost its copy: walk again from its next use that has not begun."""
        bi = 0 if hi is None else bisect.bisect_right(self.start, hi)
        for k in self.uses.get(j, []):
            if k >= bi:
                if k < self.c:
                    self.c = k
                    self._reindex()
                return

    def next_action(self, lo: int | None, hi: int | None) -> tuple[Any, ...]:
        """``("skip"|"bypass"|"reverify", k)``, ``("stage", k, victims)``, ``("trim", victims)``,
        ``("wait",)`` or ``("end",)`` for the frontier span ``lo..hi`` (``None``: no reader)."""
        floor = 0 if lo is None else lo
        began = 0 if hi is None else bisect.bisect_right(self.start, hi)
        # Past the accesses readers have begun first: only then do ``pend`` mark the shards being
        # read and ``nu`` say when each is needed next (after a re-plan the cursor is at 0).
        while self.c < min(began, len(self.shard)):
            k = self.c
            if self.shard[k] not in self.cached:
                return ("skip", k)
            self.advance(k)
        if self.used > self.budget and (victims := self._trim(floor)):
            return ("trim", victims)
        while True:
            k = self.c
            if k >= len(self.shard):
                return ("end",)
            s = self.shard[k]
            if s in self.cached:
                if (self.verify_reuse and self.ep[k] == self.epoch
                        and self.verified.get(s, -1) < self.ep[k]):
                    return ("reverify", k)
                self.advance(k)
                continue
            size = self.size_of(s)
            nx = self.nxt[k]
            newcomer_next = self.start[nx] if nx >= 0 else INF
            if self.used + size <= self.budget:
                return ("stage", k, [])
            if size > self.budget or self._max_nu() <= newcomer_next:
                return ("bypass", k)
            victims = belady_plan(self.cached, self.budget, self.nu, size, newcomer_next)
            if victims is None:
                return ("bypass", k)
            if any(self.pend[j] >= floor for j in victims):
                return ("wait",)
            return ("stage", k, victims)

    def _trim(self, floor: int) -> list[int]:
        order = sorted(self.cached, key=lambda j: (-self.nu[j], -self.cached[j], j))
        victims, over = [], self.used - self.budget
        for j in order:
            if over <= 0:
                break
            if self.pend[j] < floor:
                victims.append(j)
                over -= self.cached[j]
        return victims


def _schedule_of(schedule: Callable[[int], Any] | Mapping[int, Any]) -> Callable[[int], Any]:
    return schedule.__getitem__ if isinstance(schedule, Mapping) else schedule


def simulate(schedule: Callable[[int], Any] | Mapping[int, Any], sizes: Sequence[int],
             budget: int, *, epochs: Sequence[int], lookahead: int = 1,
             steps: Callable[[int], Iterable[int]] | None = None,
             verify_reuse: bool = True) -> list[tuple[str, int, int]]:
    """What the stager does when readers advance in lockstep with it: it starts before any
    reader reports, and has finished every action it can take before a reader reports the next
    step.  Returns ``(event, shard, epoch)`` in order, event one of stage, evict, skip, bypass,
    reverify (as the stager's journal records them; copies and verifications succeed).

    Args:
        schedule: epoch -> NodeSchedule (or any object with ``shards``, ``first``, ``last``).
        sizes: bytes per shard (shard + index file).
        steps: epoch -> the positions readers report (default: every ``first`` and ``last``).
    """
    sched = _schedule_of(schedule)
    epochs = sorted({int(e) for e in epochs})
    p = _Planner(lambda i: int(sizes[i]), int(budget), verify_reuse)
    events: list[tuple[str, int, int]] = []

    def replan(e: int) -> None:
        p.plan(e, [(x, sched(x)) for x in [y for y in epochs if y >= e][: lookahead + 1]])

    def drive(t: int | None) -> None:
        while True:
            act = p.next_action(t, t)
            if act[0] in ("wait", "end"):
                return
            if act[0] == "trim":
                for j in act[1]:
                    p.evict(j)
                    events.append(("evict", j, int(p.epoch or 0)))
                continue
            k = act[1]
            s, e = p.shard[k], p.ep[k]
            if act[0] == "stage":
                for j in act[2]:
                    p.evict(j)
                    events.append(("evict", j, e))
                p.admit(k, int(sizes[s]))
            elif act[0] == "reverify":
                p.verified[s] = e
                p.advance(k)
            else:
                p.advance(k)
            events.append((act[0], s, e))

    replan(epochs[0])
    drive(None)
    for e in epochs:
        if e != p.epoch:
            replan(e)
        sch = sched(e)
        positions = (sorted(set(np.asarray(sch.first).tolist()) | set(np.asarray(sch.last).tolist()))
                     if steps is None else steps(e))
        for pos in positions:
            drive(time_key(e, pos))
    return events
