"""Data-wait accounting: how long each training step waited for data versus computed.

``wait`` is the time the training loop spent inside ``next(loader)``; ``compute`` is the time
between handing a batch out and being asked for the next one (the user's step).  Worker-side
stage times (read, decode, transform, collate, write) travel in each batch's message header.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ._tree import STAGES

__all__ = ["LoaderStats"]

log = logging.getLogger("shardio.loader")


@dataclass
class LoaderStats:
    """Running totals plus a sliding window for the persistent-starvation warning.

    The warning looks at the last ``window`` steps whose wait and compute were both measured:
    each iteration's first step (its wait is start-up: forking workers, filling the pipeline)
    and a step whose compute was never measured (the last one of an iteration the loop left)
    are left out.  It fires once per episode of starvation: again only after the ratio came
    back under ``warn_ratio`` or in a later epoch (iteration), and at most once per
    ``window`` measured steps.

    Args:
        log_every: log a summary line every this many steps (0: never).
        window: steps in the sliding window used for the warning.
        warn_ratio: warn when windowed wait exceeds ``warn_ratio`` x windowed compute.
        clock: seconds, monotonic (``time.perf_counter``; tests pass a fake one).
    """

    log_every: int = 0
    window: int = 50
    warn_ratio: float = 1.0
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)
    steps: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    copied_out: int = 0
    spilled: int = 0
    detached: int = 0
    restarts: int = 0
    # (wait, compute) of the last ``window`` measured steps.
    _recent: deque[tuple[float, float]] = field(default_factory=deque, repr=False)
    _measured: int = field(default=0, repr=False)  # steps that entered _recent
    # Steps whose compute is in compute_s: a step's compute is known only when the next batch
    # is asked for, so mid-iteration (the loop body calling stats(), the log line) one fewer
    # than ``steps``, and the last step of an iteration the loop left never.
    _computed: int = field(default=0, repr=False)
    _warned_at: int | None = field(default=None, repr=False)  # _measured at the last warning
    _starved: bool = field(default=False, repr=False)  # in a warned episode of starvation
    _first: bool = field(default=True, repr=False)  # the next step is an iteration's first
    _pending: float | None = field(default=None, repr=False)  # the wait of the step handed out
    _last_return: float | None = field(default=None, repr=False)

    def begin_wait(self) -> float:
        """The loop asks for the next batch: the step that began when the last batch was handed
        out (the user's compute) ends now, the last step of an epoch included."""
        now = self.clock()
        if self._last_return is not None:
            compute = now - self._last_return
            self._last_return = None
            self.compute_s += compute
            self._computed += 1
            if self._pending is not None:
                self._recent.append((self._pending, compute))
                self._pending = None
                if len(self._recent) > self.window:
                    self._recent.popleft()
                self._measured += 1
                self._check_starved()
        return now

    def end_wait(self, started: float, stages: dict[str, float]) -> None:
        """A batch is handed out: its wait ends (its compute is known at the next request)."""
        now = self.clock()
        wait = now - started
        self.steps += 1
        self.wait_s += wait
        for k, v in stages.items():
            self.stage_s[k] = self.stage_s.get(k, 0.0) + v
        # The first step's wait is the iteration's start-up: not judged (still in wait_s).
        self._pending = None if self._first else wait
        self._first = False
        self._last_return = now
        if self.log_every and self.steps % self.log_every == 0:
            s = self.summary()
            log.info("step %d: data wait %.1f%% of step time (wait %.3fs, compute %.3fs per step); "
                     "worker stage seconds per batch %s", self.steps, 100 * s["wait_fraction"],
                     s["wait_per_step_s"], s["compute_per_step_s"],
                     {k: round(v, 4) for k, v in s["stage_per_batch_s"].items()})

    def begin_epoch(self) -> None:
        """A new iteration starts: time since the last batch of an earlier (possibly abandoned)
        iteration is not a training step (that step is left out of the warning's window), its
        first step is start-up, and starvation may be warned of again."""
        self._last_return = None
        self._pending = None
        self._first = True
        self._starved = False

    def epoch_end(self) -> None:
        self._last_return = None
        self._pending = None

    def _check_starved(self) -> None:
        """Warn when, over a full window of measured steps, waiting exceeded ``warn_ratio`` x
        computing: once per episode, at most once per window."""
        if len(self._recent) < self.window:
            return
        w = sum(r[0] for r in self._recent)
        c = sum(r[1] for r in self._recent)
        if not (w > 0 and w > self.warn_ratio * c):
            self._starved = False  # recovered: a new episode may be warned of
            return
        if self._starved or (self._warned_at is not None
                             and self._measured - self._warned_at < self.window):
            return
        self._starved = True
        self._warned_at = self._measured
        log.warning(
            "the training loop waited for data %.0f%% of the last %d steps (%.3fs wait vs "
            "%.3fs compute per step): add workers (num_workers), stage data to local NVMe, "
            "or check stats() for the slowest worker stage", 100 * w / (w + c),
            self.window, w / self.window, c / self.window)

    def summary(self) -> dict[str, Any]:
        """Totals, and per-step means over the steps each total covers (compute_s covers the
        steps whose compute is known: dividing it by ``steps`` understated compute, and
        overstated the wait fraction, by one step in every stats() call made inside the loop:
        half the compute at the second step)."""
        n = max(self.steps, 1)
        wait = self.wait_s / n
        compute = self.compute_s / max(self._computed, 1)
        return {
            "steps": self.steps,
            "wait_s": self.wait_s,
            "compute_s": self.compute_s,
            "wait_per_step_s": wait,
            "compute_per_step_s": compute,
            "wait_fraction": wait / (wait + compute) if wait + compute > 0 else 0.0,
            "stage_s": dict(self.stage_s),
            "stage_per_batch_s": {k: v / n for k, v in self.stage_s.items()},
            "copied_out": self.copied_out,
            "spilled": self.spilled,
            "detached": self.detached,
            "restarts": self.restarts,
        }
