"""``shardio bench loader DATASET``: run the loader on your dataset and settings against a simulated
training step, and find the fewest workers that keep the step from waiting for data.

For each worker count a fresh :class:`~shardio.ShardLoader` runs ``--steps`` steps after one
warm-up batch (worker start-up and the first batch are reported separately, not mixed into the
steady state).  Each step "computes" for ``--step-time`` seconds by sleeping, the way a training
loop waits on the GPU, so the CPUs stay free for the workers.  Reported per worker count: wait vs
compute per step, the fraction of step time spent waiting, samples/s, and the workers' per-stage
times per batch (read, decode, transform, collate, write) from the loader's own accounting; then
the smallest worker count whose waiting stays below ``--target`` (default 5%) of the step time.
"""

from __future__ import annotations

import argparse
import json
import numbers
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["add_arguments", "format_report", "run_cli", "run_loader_bench"]


def _delta(after: dict[str, Any], before: dict[str, Any], compute: float) -> dict[str, Any]:
    """The timed steps' figures: wait and stage times from the loader's accounting between the
    two ``stats()``; ``compute``, the steps' compute, as the bench timed it (the loader credits
    a step's compute only when the next batch is asked for, which the last step never does)."""
    steps = after["steps"] - before["steps"]
    n = max(steps, 1)
    wait = after["wait_s"] - before["wait_s"]
    stages = {k: (after["stage_s"][k] - before["stage_s"].get(k, 0.0)) / n
              for k in after["stage_s"]}
    return {"steps": steps, "wait_per_step_s": wait / n, "compute_per_step_s": compute / n,
            "wait_fraction": wait / (wait + compute) if wait + compute > 0 else 0.0,
            "stage_per_batch_s": stages}


def measure(path: str, workers: int, *, batch_size: int, steps: int, step_time: float,
            decode: bool, cache_dir: str | None, seed: int,
            loader_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One worker count: warm-up batch, then ``steps`` simulated training steps."""
    from .dataset import ShardDataset
    from .loader import ShardLoader

    kw: dict[str, Any] = {"cache_dir": cache_dir} if cache_dir else {}
    ds = ShardDataset(path, decode=decode, batch_size=batch_size, seed=seed, **kw)
    t0 = time.perf_counter()
    epoch, done, samples, compute = 0, 0, 0, 0.0
    try:
        with ShardLoader(ds, batch_size=batch_size, num_workers=workers,
                         **(loader_options or {})) as loader:
            loader.set_epoch(epoch)
            it = iter(loader)
            next(it)
            first = time.perf_counter() - t0
            before = loader.stats()
            t1 = time.perf_counter()
            while done < steps:
                try:
                    batch = next(it)
                except StopIteration:  # a small dataset: go on with the next epoch
                    epoch += 1
                    loader.set_epoch(epoch)
                    it = iter(loader)
                    continue
                got = time.perf_counter()
                samples += _batch_len(batch)
                del batch
                time.sleep(step_time)
                compute += time.perf_counter() - got
                done += 1
            wall = time.perf_counter() - t1
            result = _delta(loader.stats(), before, compute)
    finally:
        if ds._stager is not None:  # (on every way out: an error must not leave it copying)
            ds._stager.stop()
    result.update(workers=workers, first_batch_s=first, samples_per_s=samples / wall,
                  seconds=wall)
    return result


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        for v in batch.values():
            try:
                return len(v)
            except TypeError:
                continue
    try:
        return len(batch)
    except TypeError:
        return 1


def run_loader_bench(path: str, *, workers: Sequence[int] = (1, 2, 4), batch_size: int = 64,
                     steps: int = 50, step_time: float = 0.05, decode: bool = False,
                     cache_dir: str | None = None, target: float = 0.05, seed: int = 0,
                     cpus: Sequence[int] | str | None = None, prefetch_factor: int = 2
                     ) -> dict[str, Any]:
    """Measure each worker count; return the runs and the recommendation.

    ``cpus`` and ``prefetch_factor`` go to every ``ShardLoader`` (:class:`~shardio.LoaderOptions`:
    pin workers to these CPUs, or ``"auto"``; batches each worker prepares ahead).

    Raises:
        UsageError: bad settings.
        ManifestError: ``path`` is not a shardio dataset.
    """
    from .errors import UsageError
    from .manifest import Manifest

    if (isinstance(steps, bool) or not isinstance(steps, numbers.Integral)  # (2.5 ran 3 steps)
            or steps < 1 or batch_size < 1 or not 0 <= step_time < 3600 or not workers
            or min(workers) < 1 or not 0 < target <= 1):
        # (NaN fails every comparison: "not 0 <= nan" holds, so it is refused too.)
        raise UsageError("need --steps an integer >= 1, --batch-size >= 1, "
                         "0 <= --step-time < 3600 s, "
                         "--workers >= 1, 0 < --target <= 1")
    from .config import LoaderOptions

    opts = {"cpus": cpus, "prefetch_factor": prefetch_factor}
    LoaderOptions(**opts)  # bad values fail here, before any worker starts
    manifest = Manifest.load(path)
    runs = [measure(path, w, batch_size=batch_size, steps=steps, step_time=step_time,
                    decode=decode, cache_dir=cache_dir, seed=seed, loader_options=opts)
            for w in sorted(set(workers))]
    ok = [r["workers"] for r in runs if r["wait_fraction"] < target]
    best = min(runs, key=lambda r: r["wait_fraction"])
    if ok:
        advice = (f"{ok[0]} worker(s) keep waiting under {target:.0%} of the step "
                  f"({runs[[r['workers'] for r in runs].index(ok[0])]['wait_fraction']:.1%})")
    else:
        slowest = max(((k, v) for k, v in best["stage_per_batch_s"].items() if k != "total"),
                      key=lambda kv: kv[1])
        advice = (f"no worker count tried keeps waiting under {target:.0%} (best "
                  f"{best['wait_fraction']:.1%} with {best['workers']}); the slowest worker stage "
                  f"is {slowest[0]} ({slowest[1] * 1e3:.1f} ms per batch): try more workers, "
                  "staging (--cache-dir), or a lighter transform")
    return {"dataset": os.path.abspath(path), "samples": manifest.num_samples,
            "batch_size": batch_size, "steps": steps, "step_time_s": step_time, "decode": decode,
            "cache_dir": cache_dir, "target_wait_fraction": target, "runs": runs,
            "pinned_cpus": list(cpus) if isinstance(cpus, (list, tuple)) else cpus,
            "prefetch_factor": prefetch_factor,
            "recommended_workers": ok[0] if ok else None, "advice": advice,
            "cpus": os.cpu_count(), "loadavg": os.getloadavg()[0]}


def format_report(r: dict[str, Any]) -> str:
    lines = [f"shardio loader bench: {r['dataset']} ({r['samples']} samples), batch "
             f"{r['batch_size']}, simulated step {r['step_time_s'] * 1e3:.0f} ms, "
             f"{r['steps']} steps, decode={r['decode']}",
             f"{'workers':>7} {'wait ms':>8} {'compute ms':>10} {'wait %':>7} {'samples/s':>10} "
             f"{'1st batch s':>11}  worker ms per batch (read/decode/transform/collate/write)"]
    for x in r["runs"]:
        st = x["stage_per_batch_s"]
        stages = "/".join(f"{st.get(k, 0.0) * 1e3:.1f}"
                          for k in ("read", "decode", "transform", "collate", "write"))
        lines.append(f"{x['workers']:>7} {x['wait_per_step_s'] * 1e3:>8.1f} "
                     f"{x['compute_per_step_s'] * 1e3:>10.1f} {x['wait_fraction'] * 100:>6.1f}% "
                     f"{x['samples_per_s']:>10.0f} {x['first_batch_s']:>11.2f}  {stages}")
    lines.append(f"recommendation: {r['advice']}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dataset", help="a shardio dataset directory")
    p.add_argument("--workers", default=None,
                   help="worker counts to try, e.g. 1,2,4,8 (default: powers of 2 up to the CPUs)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--steps", type=int, default=50, help="timed steps per worker count")
    p.add_argument("--step-time", type=float, default=0.05,
                   help="simulated compute per step in seconds (your training step)")
    p.add_argument("--decode", action="store_true", help="decode samples (images, json, ...)")
    p.add_argument("--cache-dir", default=None, help="stage to this node-local directory")
    p.add_argument("--target", type=float, default=0.05, help="acceptable wait fraction")
    p.add_argument("--cpus", default=None,
                   help="pin workers to these CPUs, one each, round-robin: a list like 0-7,16 "
                        "(e.g. one NUMA node's cores) or 'auto' (cgroup/Slurm binding, NUMA "
                        "node first); default: not pinned")
    p.add_argument("--prefetch-factor", type=int, default=2,
                   help="batches each worker prepares ahead (DataLoader's prefetch_factor)")
    p.add_argument("--json", action="store_true")


def _cpu_list(text: str | None) -> list[int] | str | None:
    """``--cpus``: None, ``"auto"``, or a list in the kernel's cpulist format (``0-3,8``)."""
    from .errors import UsageError
    from .topology import _parse_cpulist

    if text is None or text == "auto":
        return text
    try:
        cpus = _parse_cpulist(text)
    except ValueError as exc:
        raise UsageError(f"--cpus {text!r}: write 'auto' or a list like 0-3,8") from exc
    if not cpus:
        raise UsageError(f"--cpus {text!r}: names no CPU; write 'auto' or a list like 0-3,8")
    return cpus


def run_cli(a: argparse.Namespace) -> int:
    from .errors import UsageError

    if a.workers:
        try:
            workers = [int(x) for x in a.workers.split(",")]
        except ValueError as exc:
            raise UsageError(f"--workers {a.workers!r}: write a list like 1,2,4") from exc
    else:
        cpus = os.cpu_count() or 1
        workers = [w for w in (1, 2, 4, 8, 16, 32, 64) if w <= cpus] or [1]
    r = run_loader_bench(a.dataset, workers=workers, batch_size=a.batch_size, steps=a.steps,
                         step_time=a.step_time, decode=a.decode, cache_dir=a.cache_dir,
                         target=a.target, cpus=_cpu_list(a.cpus),
                         prefetch_factor=a.prefetch_factor)
    print(json.dumps(r, sort_keys=True) if a.json else format_report(r))
    sys.stdout.flush()
    return 0
