"""Data-wait accounting: how long each training step waited for data versus computed.

``wait`` is the time the training loop spent inside ``next(loader)``; ``compute`` is the time
between handing a batch out and being asked for the next one (the user's step).  Worker-side
stage times (read, decode, transform, collate, write) travel in each batch's message header.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ._tree import STAGES

__all__ = ["LoaderStats"]

log = logging.getLogger("shardio.loader")


@dataclass
class LoaderStats:
    """Running totals plus a sliding window for the persistent-starvation warning.

    Args:
        log_every: log a summary line every this many steps (0: never).
        window: steps in the sliding window used for the warning.
        warn_ratio: warn when windowed wait exceeds ``warn_ratio`` x windowed compute.
    """

    log_every: int = 0
    window: int = 50
    warn_ratio: float = 1.0
    steps: int = 0
    wait_s: float = 0.0
    compute_s: float = 0.0
    stage_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    copied_out: int = 0
    spilled: int = 0
    detached: int = 0
    restarts: int = 0
    _recent: deque[tuple[float, float]] = field(default_factory=deque, repr=False)
    _warned: bool = field(default=False, repr=False)
    _last_return: float | None = field(default=None, repr=False)

    def begin_wait(self) -> float:
        """The loop asks for the next batch: the step that began when the last batch was handed
        out (the user's compute) ends now, the last step of an epoch included."""
        now = time.perf_counter()
        if self._last_return is not None:
            compute = now - self._last_return
            self._last_return = None
            self.compute_s += compute
            if self._recent:
                self._recent[-1] = (self._recent[-1][0], compute)
            self._check_starved()
        return now

    def end_wait(self, started: float, stages: dict[str, float]) -> None:
        """A batch is handed out: its wait ends (its compute is known at the next request)."""
        now = time.perf_counter()
        wait = now - started
        self.steps += 1
        self.wait_s += wait
        for k, v in stages.items():
            self.stage_s[k] = self.stage_s.get(k, 0.0) + v
        self._recent.append((wait, 0.0))
        if len(self._recent) > self.window:
            self._recent.popleft()
        self._last_return = now
        if self.log_every and self.steps % self.log_every == 0:
            s = self.summary()
            log.info("step %d: data wait %.1f%% of step time (wait %.3fs, compute %.3fs per step); "
                     "worker stage seconds per batch %s", self.steps, 100 * s["wait_fraction"],
                     s["wait_per_step_s"], s["compute_per_step_s"],
                     {k: round(v, 4) for k, v in s["stage_per_batch_s"].items()})

    def begin_epoch(self) -> None:
        """A new iteration starts: time since the last batch of an earlier (possibly abandoned)
        iteration is not a training step."""
        self._last_return = None

    def epoch_end(self) -> None:
        self._last_return = None

    def _check_starved(self) -> None:
        """Warn once when, over a full window of steps, waiting exceeded computing."""
        if len(self._recent) == self.window and not self._warned:
            w = sum(r[0] for r in self._recent)
            c = sum(r[1] for r in self._recent)
            if c > 0 and w > self.warn_ratio * c:
                self._warned = True
                log.warning(
                    "the training loop waited for data %.0f%% of the last %d steps (%.3fs wait vs "
                    "%.3fs compute per step): add workers (num_workers), stage data to local NVMe, "
                    "or check stats() for the slowest worker stage", 100 * w / (w + c),
                    self.window, w / self.window, c / self.window)

    def summary(self) -> dict[str, Any]:
        n = max(self.steps, 1)
        total = self.wait_s + self.compute_s
        return {
            "steps": self.steps,
            "wait_s": self.wait_s,
            "compute_s": self.compute_s,
            "wait_per_step_s": self.wait_s / n,
            "compute_per_step_s": self.compute_s / n,
            "wait_fraction": self.wait_s / total if total > 0 else 0.0,
            "stage_s": dict(self.stage_s),
            "stage_per_batch_s": {k: v / n for k, v in self.stage_s.items()},
            "copied_out": self.copied_out,
            "spilled": self.spilled,
            "detached": self.detached,
            "restarts": self.restarts,
        }
