"""Kept-batch benchmark: a training loop that keeps one batch for good, against one that keeps none.

``python benchmarks/bench_kept.py`` builds the dataset exactly as ``bench_read.py`` does
(:func:`benchmarks.bench_read.prepare`: 20,000 JPEGs of 5-40 KB in 100 class folders, packed
into 64 MB shards, page cache warm), then runs, each in a fresh child process, a raw-mode
``ShardLoader`` (batch 256, 2 workers, the loader ``bench_read.py`` times as
``shardio_loader``, its workers kept across epochs) for a warm-up epoch and ``--epochs``
timed epochs:

* ``none``: the loop keeps no batch (``for x, label, nbytes in loader: pass``);
* ``kept``: the loop keeps the last batch of the warm-up epoch for good (a module-level name
  left bound, a batch saved for plotting);
* ``kept_without_detach``: the same, with ``ShardLoader._make_room`` reduced in the child to
  giving back what the loop let go of: how the loader behaved before ``Ring.detach``.  A ring
  frees space in stream order, so the kept batch stopped its ring once the worker came round to
  it, and every later batch of that worker went through its pipe;
* ``previous``: the loop holds each batch one step longer (``p, prev = prev, batch``: a loss
  logged a step late, a double-buffered copy), so it holds two while it asks for the next;
* ``labels``: the loop keeps the label tensor of every batch of every epoch (the metrics
  habit), and ``labels_dataloader`` the same with torch's ``DataLoader`` over the same
  ``ShardDataset`` (the loader ``bench_read.py`` times as ``shardio``): what the kept labels
  cost in memory, ``uss_growth_mb`` (the main process's USS from after the warm-up epoch to
  after the last).  Before shardio kept only the fields a loop holds, each label kept its
  whole batch.

Contenders alternate over ``--repeat`` rounds; each run prints its median timed epoch, and the
summary gives, from the median of the runs: ``kept_vs_none`` (~1: keeping a batch costs one
copy of it, once), ``kept_without_detach_vs_none`` (what it cost before), ``previous_vs_none``
(~1: nothing moves while the rings have room), and the two loaders'
USS growth keeping labels, with the loader's ``copied_out`` and ``detached`` counts.  Timed
figures compare within one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import (  # noqa: E402
    add_output_args,
    check_files_classes,
    check_output_args,
    emit,
    run_in_workdir,
)

CONTENDERS = ("none", "kept", "kept_without_detach", "previous", "labels", "labels_dataloader")
DEFAULTS = {"files": 20000, "classes": 100, "repeat": 3, "epochs": 3}
QUICK = {"files": 1500, "classes": 10, "repeat": 1, "epochs": 2}


def _warm_up(loader: Any, keep: bool) -> Any:
    """One untimed epoch; its last batch if ``keep``."""
    last = None
    for batch in loader:
        last = batch if keep else None
    return last


def _uss() -> int:
    import psutil

    return int(psutil.Process().memory_full_info().uss)


def child(spec: dict[str, Any]) -> int:
    """One run: a warm-up epoch, then ``epochs`` timed ones; print one JSON line."""
    import gc

    import torch  # noqa: F401  (imports outside every timed region)

    from benchmarks.bench_read import _loader
    from shardio import ShardLoader

    who = spec["contender"]
    if who == "kept_without_detach":  # releases only: no Ring.detach
        ShardLoader._make_room = (  # type: ignore[method-assign]
            lambda self, ring: self._drain_releases(ring))
    kind = "shardio" if who == "labels_dataloader" else "shardio_loader"
    loader, set_epoch = _loader({"kind": kind, "mode": "raw", "persistent": True,
                                 "shards": spec["shards"]})
    labels: list[Any] = []  # the "labels" loops keep each batch's label tensor, every epoch
    set_epoch(0)
    if who.startswith("labels"):
        for _x, label, _nbytes in loader:
            labels.append(label)
        kept = None
    else:
        kept = _warm_up(loader, keep=who.startswith("kept"))
    gc.collect()
    uss0 = _uss()
    epochs = []
    samples = 0
    for epoch in range(1, spec["epochs"] + 1):
        set_epoch(epoch)
        t0 = time.perf_counter()
        samples = 0
        prev = p = None
        for batch in loader:
            _x, label, _nbytes = batch
            samples += len(label)
            if labels:
                labels.append(label)
            if who == "previous":
                p, prev = prev, batch
        del p, prev
        epochs.append(time.perf_counter() - t0)
    del _x, label, _nbytes, batch
    gc.collect()
    grown = _uss() - uss0
    stats = loader.stats() if isinstance(loader, ShardLoader) else {}
    if isinstance(loader, ShardLoader):
        loader.close()
    del kept, labels
    print(json.dumps({"contender": who, "epoch_seconds": epochs, "samples": samples,
                      "uss_growth_bytes": grown, "copied_out": stats.get("copied_out", 0),
                      "detached": stats.get("detached", 0)}))
    return 0


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=900, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['contender']} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, what in (("files", "files to generate"), ("classes", "class folders"),
                       ("repeat", "runs per contender"), ("epochs", "timed epochs per run")):
        p.add_argument(f"--{name}", type=int, default=None,
                       help=f"{what} (default {DEFAULTS[name]})")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # one run (see child())
    add_output_args(p, f"smoke configuration: {QUICK['files']} files, repeat {QUICK['repeat']}, "
                       f"{QUICK['epochs']} epochs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    size = {k: v if (v := getattr(a, k)) is not None else (QUICK if a.quick else DEFAULTS)[k]
            for k in DEFAULTS}
    if a.child:
        return child(json.loads(a.child))
    check_files_classes(p, size["files"], size["classes"])
    for name in ("repeat", "epochs"):
        if size[name] < 1:
            p.error(f"--{name} {size[name]}: at least 1 needed")
    check_output_args(p, a)
    return run_in_workdir("shardio-bench-kept-", a.workdir, a.keep,
                          lambda work: _bench(work, **size, json_out=a.json_out))


def _bench(work: str, files: int, classes: int, repeat: int, epochs: int,
           json_out: str | None) -> int:
    from benchmarks.bench_read import prepare

    data = prepare(work, files, classes, "64MB")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONTENDERS}
    for rnd in range(repeat):
        k = rnd % len(CONTENDERS)
        order = CONTENDERS[k:] + CONTENDERS[:k]
        for c in order:
            got = _run_child({"contender": c, "shards": data["shards"], "epochs": epochs})
            if got["samples"] != files:
                raise RuntimeError(f"{c} delivered {got['samples']} samples, expected {files}")
            got["median_epoch_seconds"] = statistics.median(got["epoch_seconds"])
            runs[c].append(got)
            print(f"  round {rnd + 1}/{repeat} {c}: median epoch "
                  f"{got['median_epoch_seconds']:.3f}s (copied_out {got['copied_out']}, "
                  f"detached {got['detached']})", file=sys.stderr)
    lines = []
    for c in CONTENDERS:
        med = statistics.median(r["median_epoch_seconds"] for r in runs[c])
        lines.append({"bench": "kept", "kind": "contender", "contender": c, "files": files,
                      "epochs": epochs, "runs": repeat, "median_epoch_seconds": round(med, 4),
                      "all_median_epoch_seconds": [round(r["median_epoch_seconds"], 4)
                                                   for r in runs[c]],
                      "samples_per_s": round(files / med, 1),
                      "uss_growth_mb": round(statistics.median(
                          r["uss_growth_bytes"] for r in runs[c]) / 1e6, 1),
                      "copied_out": max(r["copied_out"] for r in runs[c]),
                      "detached": max(r["detached"] for r in runs[c])})
    by = {ln["contender"]: ln for ln in lines}
    none = by["none"]["median_epoch_seconds"]
    summary = {"bench": "kept", "kind": "summary", "files": files, "epochs": epochs,
               "repeat": repeat, "cpus": os.cpu_count(),
               "kept_vs_none": round(by["kept"]["median_epoch_seconds"] / none, 3),
               "kept_without_detach_vs_none": round(
                   by["kept_without_detach"]["median_epoch_seconds"] / none, 3),
               "previous_vs_none": round(by["previous"]["median_epoch_seconds"] / none, 3),
               "labels_uss_growth_mb": by["labels"]["uss_growth_mb"],
               "labels_dataloader_uss_growth_mb": by["labels_dataloader"]["uss_growth_mb"],
               "notes": "epoch seconds, median of runs of each run's median timed epoch; "
                        "ratios > 1 are slower than keeping nothing"}
    for ln in lines:
        print(f"{ln['contender']:22s} {ln['median_epoch_seconds']:.3f} s/epoch "
              f"({ln['samples_per_s']:,.0f} samples/s)  main USS {ln['uss_growth_mb']:+.1f} MB  "
              f"copied_out {ln['copied_out']}  detached {ln['detached']}", file=sys.stderr)
    print(f"kept/none {summary['kept_vs_none']}x; before Ring.detach "
          f"{summary['kept_without_detach_vs_none']}x; previous/none "
          f"{summary['previous_vs_none']}x; keeping every batch's labels: main USS "
          f"{summary['labels_uss_growth_mb']:+.1f} MB (DataLoader "
          f"{summary['labels_dataloader_uss_growth_mb']:+.1f} MB)", file=sys.stderr)
    emit(lines, summary, json_out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
