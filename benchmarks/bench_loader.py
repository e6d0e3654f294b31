"""Loader benchmark: ``ShardLoader`` vs torch's DataLoader (and webdataset), same run, warm cache.

``python benchmarks/bench_loader.py`` builds the dataset exactly as ``bench_read.py`` does
(:func:`benchmarks.bench_read.prepare`: 20,000 JPEGs of 5-40 KB in 100 class folders, packed with
``shardio.pack(..., shard_size="64MB", workers=2, fsync=False)``), then measures, batch 256,
2 workers, every run a fresh child process started after every input was read again
(``bench_read.warm_inputs``: a warm page cache at the start of every run):

(a) **transfer**: what moving batches from the workers costs, nothing else.  Both loaders read
    ``ShardDataset(shards, batch_size=256, shuffle=True, verify=False, transform=FixedItem())``,
    whose transform ignores the sample and returns one preallocated ``uint8`` tensor of shape
    ``(3, 224, 224)``, and use their default collate: ShardLoader's stacks the 256 tensors straight
    into its shared-memory ring, torch's ``default_collate`` stacks them into a fresh shared-memory
    tensor in the worker, which reaches the main process as a file descriptor.  A batch is a
    ``uint8 [256, 3, 224, 224]`` tensor (38.5 MB).  Two consumers: ``pages`` reads one byte of
    every 4 KiB page of the batch (a real training step touches all of it; this makes the main
    process map every page, for a few microseconds of arithmetic), ``none`` only counts the batch.
    Two epochs with persistent workers (ShardLoader's always persist); the second, steady-state
    epoch is the figure (batches/s and CPU per batch of the main process and of the workers:
    ``getrusage`` for the main process and reaped workers, ``psutil`` ``cpu_times`` for live
    ones); the first, with worker start-up and the first touch of the ring, is reported as
    ``first_epoch_*``.

(b) **end to end**: one epoch (from ``iter(loader)`` to the loop's end, worker start and stop
    included, ``persistent_workers=False``: a ShardLoader's iterator stops its workers as it runs
    out, without waiting for their exit, see ``bench_read.py``) of the
    loaders ``bench_read.py`` defines (its ``_loader``): ``shardloader`` (``ShardLoader`` over
    ``ShardDataset``, default collate), ``shardio_dataloader`` (torch ``DataLoader`` over the same
    ``ShardDataset``), ``smallfiles`` (``DataLoader`` over the ImageFolder tree, one open/read per
    sample), ``wds_batched`` and ``wds_dataloader`` (webdataset's two usual setups; the summary
    uses the faster one per mode), in ``raw`` mode (JPEG bytes + label) and ``decode`` mode (Pillow
    decode, shorter side to 64, center crop 64, ``uint8`` CHW tensor), the per-sample function
    (``bench_read.raw_item``/``decode_item``) identical for all.  Pillow is imported before the
    loader starts (in every contender), so no worker pays the import in the timed epoch.

(c) **memory**: a thread samples the PSS and RSS of the process tree (``bench_read.TreeSampler``)
    every ``--sample-interval`` seconds in every run, stretched where one sample costs so much
    that the thread would use more than 10% of a CPU (``longest_sample_wait_s``;
    ``memory_samples`` counts them); ``peak_pss_mb`` is the highest tree sum.
    PSS only counts pages a process has mapped: ring pages that ``posix_fallocate`` reserved but
    no process touched yet do not appear, so each run also records the peak rise of the system's
    ``Shmem`` (``/proc/meminfo``; system-wide, so other jobs using ``/dev/shm`` disturb it).

(d) **decode ceiling**: ``decode_item`` over every sample's bytes, already in memory (read from
    the small files before the pool forks), in a 2-process ``multiprocessing`` fork pool, each
    process taking one half; nothing is read, batched or sent back but a count.  The pool is
    started before the clock.  Against it runs ``decode_shardloader_steady``: the end-to-end
    ShardLoader of (b) in decode mode, kept for two epochs, the second timed, so that its
    worker start is not timed either.  ``decode_vs_ceiling`` (the target) is that steady-state
    epoch's samples/s as a fraction of the ceiling: what reading, batching and transfer cost
    the decode; ``decode_shardloader_with_start_vs_ceiling`` gives (b)'s one-epoch figure, start
    and stop included (~80 ms of a ~6 s epoch here), as a fraction of the same ceiling.

``--ring-bytes`` sets the end-to-end ShardLoader's ``ring_bytes`` (memory experiments; the
transfer section's 38.5 MB batches always get the default).

Runs go in rounds (every contender once per round, order rotated each round); best and median of
``--repeat`` runs are reported, CPU of the best run and the lowest CPU per batch/sample.  The
decode ceiling and ``decode_shardloader_steady``, which differ by a few percent (less than this
kind of machine's run-to-run spread), run next to each other in every round, and alone in extra
rounds (order alternating) up to ``--decode-repeat`` runs (default 5); besides the best-run ratio
(the target), the summary gives each round's ratio and their median
(``decode_shardloader_vs_ceiling_paired_median``: two runs side by side share the machine's
state of the moment).  The
sampler thread's own CPU (it reads ``smaps_rollup``) is taken out of the main process's CPU and
reported as ``sampler_cpu_seconds``.  Wall-clock figures need an otherwise idle machine (the
load average is recorded per run and at the end); CPU per batch/sample much less so.

stdout: one JSON line per contender, then a ``summary`` line with the ratios and the targets
(``transfer_ge_3x_dataloader``: steady-state batches/s with the ``pages`` consumer;
``raw_ge_5x_smallfiles``; ``decode_ge_95pct_ceiling``; ``pss_below_smallfiles``: ShardLoader's peak
PSS below the small-files DataLoader's in both modes) and the load average.  stderr: a table.
``--quick`` (400 files, 64x64 transfer tensors, one run) is a smoke test whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import add_output_args, emit, run_in_workdir  # noqa: E402
from benchmarks._common import check_output_args, check_seconds  # noqa: E402

from benchmarks.bench_read import (
    BATCH,
    LOADER_DESC as READ_DESC,
    MEASURED_PEERS,
    MIN_SHARDS,
    WORKERS,
    ImageFolderBytes,
    TooFewShards,
    TreeSampler,
    _dist_version,
    _loader,
    decode_item,
    check_sizes,
    payload_of,
    prepare,
    raw_item,
    warm_inputs,
)

QUICK = {"files": 400, "classes": 10, "repeat": 1, "shard_size": "2MB", "side": 64,
         "decode_repeat": 1}
DEFAULTS = {"files": 20000, "classes": 100, "repeat": 3, "shard_size": "64MB", "side": 224,
            "decode_repeat": 5}
TOUCHES = ("pages", "none")
TRANSFER_LOADERS = ("shardloader", "dataloader")
E2E_LOADERS = ("shardloader", "shardio_dataloader", "smallfiles", "wds_batched", "wds_dataloader")
MODES = ("raw", "decode")
READ_KIND = {"shardloader": "shardio_loader", "shardio_dataloader": "shardio",
             "smallfiles": "smallfiles", "wds_batched": "wds_batched",
             "wds_dataloader": "wds_dataloader", "litdata": "litdata", "mosaic": "mosaic"}
TARGETS = {"transfer_vs_dataloader": 3.0, "raw_vs_smallfiles": 5.0, "decode_vs_ceiling": 0.95}
PAGE = 4096

LOADER_DESC = {
    ("transfer", "shardloader"): "ShardLoader(ShardDataset(transform=FixedItem), batch_size=256)",
    ("transfer", "dataloader"): ("DataLoader(ShardDataset(transform=FixedItem), batch_size=256, "
                                 "persistent_workers=True) (default_collate)"),
    ("e2e", "shardloader"): ("ShardLoader(ShardDataset(batch_size=256, shuffle=True, "
                             "transform=f, zero_copy=True), batch_size=256) (default collate), "
                             "closed per epoch"),
    ("e2e", "shardio_dataloader"): ("DataLoader(ShardDataset(batch_size=256, shuffle=True, "
                                    "transform=f, zero_copy=True), batch_size=256, "
                                    "collate_fn=collate_<mode>)"),
    ("e2e", "smallfiles"): ("DataLoader(ImageFolderBytes(src), batch_size=256, shuffle=True, "
                            "collate_fn=collate_<mode>)"),
    ("e2e", "wds_batched"): ("WebLoader(WebDataset(tars).shuffle(1000).to_tuple().map(f)"
                             ".batched(256), batch_size=None)"),
    ("e2e", "wds_dataloader"): ("DataLoader(WebDataset(tars).shuffle(1000).to_tuple().map(f), "
                                "batch_size=256)"),
    ("e2e", "litdata"): READ_DESC["litdata"],
    ("e2e", "mosaic"): READ_DESC["mosaic"],
    ("ceiling", "decode_ceiling"): ("multiprocessing fork Pool(2).map(decode_item over one half "
                                    "of the in-memory sample bytes)"),
    ("steady", "shardloader"): ("ShardLoader(ShardDataset(batch_size=256, shuffle=True, "
                                "transform=f, zero_copy=True), batch_size=256) (default "
                                "collate), second of two epochs (worker start not timed)"),
}


# --- per-sample work of the transfer section ----------------------------------------------------


class FixedItem:
    """Transform of the transfer section: ignores the sample, returns one preallocated tensor."""

    def __init__(self, side: int) -> None:
        import torch

        self.array = torch.full((3, side, side), 7, dtype=torch.uint8)

    def __call__(self, sample: Any) -> Any:
        return self.array


def touch_pages(batch: Any) -> int:
    """Read one byte of every 4 KiB page of a uint8 batch tensor (maps every page here)."""
    return int(batch.reshape(-1)[::PAGE].sum())


# --- child: one measured run --------------------------------------------------------------------


def _shmem() -> int:
    """System ``Shmem`` bytes (``/proc/meminfo``); 0 where unavailable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Shmem:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class Sampler(TreeSampler):
    """``bench_read.TreeSampler`` plus the peak of the system's ``Shmem``, on a CPU budget.

    Reading ``smaps_rollup`` walks the page tables, so a sample of a tree that maps a lot (the
    decode ceiling's 400 MB of bytes, ShardLoader's rings) costs 10-30 ms; on a 2-CPU machine a
    fixed 0.1 s interval would take up to 30% of a CPU from the run, more from some contenders
    than from others.  The wait after each sample is stretched so that the thread stays within
    ``budget`` of one CPU (default 10%: about 10 samples a second for a DataLoader tree, 3-4 for
    the ceiling's) for every contender alike.
    """

    def __init__(self, interval: float, budget: float = 0.1) -> None:
        super().__init__(interval)
        self.budget = budget
        self.base_shmem = _shmem()
        self.peak_shmem = self.base_shmem
        self.longest_wait = 0.0

    def _loop(self) -> None:
        first = True
        while True:
            c0 = time.thread_time()
            self.take()
            # The thread's first sample pays one-time costs (psutil's first walk of /proc: ~80 ms
            # of CPU here); stretched by it, the next sample came ~0.8 s later, after a whole raw
            # ShardLoader epoch (~0.2 s), whose workers and rings then went unmeasured.
            cost = 0.0 if first else time.thread_time() - c0
            first = False
            wait = max(self.interval, cost / self.budget)
            self.longest_wait = max(self.longest_wait, wait)
            if self._stop.wait(wait):
                return

    def take(self) -> tuple[int, int, int]:
        c0 = time.thread_time()
        shm = _shmem()
        self.cpu_seconds += time.thread_time() - c0
        self.peak_shmem = max(self.peak_shmem, shm)
        return super().take()


def tree_cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process, and of its descendants: live ones
    (``psutil`` ``cpu_times``, clock-tick resolution) plus reaped ones (``getrusage``)."""
    import psutil

    me = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    kids = reaped.ru_utime + reaped.ru_stime
    for p in psutil.Process().children(recursive=True):
        try:
            c = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        kids += c.user + c.system
    return me.ru_utime + me.ru_stime, kids


class Clock:
    """Wall and CPU time of one timed region (the sampler's CPU taken out of the main process's)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __enter__(self) -> Clock:
        # A full collection pending from set-up (~0.1 s in a process holding torch) would land
        # in whichever contender's timed region allocates first: run it before the clock starts.
        gc.collect()
        self.load = os.getloadavg()[0]
        (self._m0, self._w0), self._s0 = tree_cpu(), self.sampler.cpu_seconds
        self._t0 = time.perf_counter()
        return self

    def lap(self) -> float:
        return time.perf_counter() - self._t0

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0
        (m1, w1), s1 = tree_cpu(), self.sampler.cpu_seconds
        self.sampler_cpu = s1 - self._s0
        self.main_cpu = max(0.0, m1 - self._m0 - self.sampler_cpu)
        self.worker_cpu = w1 - self._w0

    def result(self, samples: int, batches: int, first: float | None) -> dict[str, Any]:
        return {"seconds": self.seconds, "samples": samples, "batches": batches,
                "first_batch_seconds": first, "load_1min": self.load,
                "main_cpu_seconds": self.main_cpu, "worker_cpu_seconds": self.worker_cpu,
                "sampler_cpu_seconds": self.sampler_cpu}


def _transfer(spec: dict[str, Any], sampler: Sampler) -> list[dict[str, Any]]:
    from torch.utils.data import DataLoader

    from shardio import ShardDataset, ShardLoader

    ds = ShardDataset(spec["shards"], batch_size=BATCH, shuffle=True, verify=False,
                      transform=FixedItem(int(spec["side"])))
    if spec["loader"] == "shardloader":
        loader: Any = ShardLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    else:
        loader = DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True)
    touch = spec["touch"] == "pages"
    epochs = []
    try:
        for epoch in range(2):
            ds.set_epoch(epoch)
            samples = batches = checksum = 0
            first = None
            x = None
            with Clock(sampler) as clock:
                for x in loader:
                    if first is None:
                        first = clock.lap()
                    if touch:
                        checksum += touch_pages(x)
                    samples += len(x)
                    batches += 1
            del x
            ep = clock.result(samples, batches, first)
            ep["batch_bytes"] = BATCH * 3 * int(spec["side"]) ** 2
            if touch and checksum != 7 * sum(
                    -(-min(BATCH, samples - k) * 3 * int(spec["side"]) ** 2 // PAGE)
                    for k in range(0, samples, BATCH)):
                raise RuntimeError(f"transfer/{spec['loader']}: wrong batch contents")
            epochs.append(ep)
    finally:
        if isinstance(loader, ShardLoader):
            loader.close()
    return epochs


def _timed_epoch(loader: Any, sampler: Sampler) -> dict[str, Any]:
    """Iterate one epoch of ``(x, labels, nbytes)`` batches under the clock (a non-persistent
    loader stops its workers as its iterator runs out, inside it)."""
    samples = batches = payload = 0
    first = None
    _x = labels = nbytes = None
    with Clock(sampler) as clock:
        for _x, labels, nbytes in loader:
            if first is None:
                first = clock.lap()
            samples += len(labels)
            batches += 1
            payload += payload_of(nbytes)
        del _x, labels, nbytes
    ep = clock.result(samples, batches, first)
    ep["payload_bytes"] = payload
    return ep


def _e2e(spec: dict[str, Any], sampler: Sampler) -> list[dict[str, Any]]:
    loader, set_epoch = _loader({**spec, "kind": READ_KIND[spec["loader"]], "persistent": False,
                                 "ring_bytes": spec["ring_bytes"]})
    set_epoch(0)
    return [_timed_epoch(loader, sampler)]


def _steady(spec: dict[str, Any], sampler: Sampler) -> list[dict[str, Any]]:
    """Two epochs of one ShardLoader (its workers persist); the second is the steady state."""
    loader, set_epoch = _loader({**spec, "kind": "shardio_loader", "persistent": True,
                                 "ring_bytes": spec["ring_bytes"]})
    epochs = []
    try:
        for epoch in range(2):
            set_epoch(epoch)
            epochs.append(_timed_epoch(loader, sampler))
    finally:
        loader.close()
    return epochs


_CEILING_DATA: list[tuple[bytes, int]] = []


def _ceiling_part(bounds: tuple[int, int]) -> tuple[int, int, int]:
    """Decode samples ``[a, b)`` of the inherited in-memory list; ``(count, payload, pid)``."""
    a, b = bounds
    n = payload = 0
    for data, label in _CEILING_DATA[a:b]:
        _img, _label, size = decode_item(data, label)
        n += 1
        payload += size
    return n, payload, os.getpid()


def _warm(_: int) -> int:
    return os.getpid()


def _ceiling(spec: dict[str, Any], sampler: Sampler) -> list[dict[str, Any]]:
    import multiprocessing as mp

    files = ImageFolderBytes(spec["src"], raw_item)
    _CEILING_DATA.clear()
    for path, label in files.samples:
        with open(path, "rb") as f:
            _CEILING_DATA.append((f.read(), label))
    n = len(_CEILING_DATA)
    half = n // 2
    with mp.get_context("fork").Pool(WORKERS) as pool:
        pool.map(_warm, range(WORKERS), chunksize=1)
        with Clock(sampler) as clock:
            parts = pool.map(_ceiling_part, [(0, half), (half, n)], chunksize=1)
    ep = clock.result(sum(p[0] for p in parts), 1, None)
    ep.update(payload_bytes=sum(p[1] for p in parts), processes_used=len({p[2] for p in parts}))
    return [ep]


def child(spec: dict[str, Any]) -> int:
    """One measured run of one contender; print one JSON line."""
    import torch  # noqa: F401  (imports outside every timed region)
    from PIL import Image  # noqa: F401

    import shardio.loader  # noqa: F401

    run = {"transfer": _transfer, "e2e": _e2e, "ceiling": _ceiling,
           "steady": _steady}[spec["section"]]
    with Sampler(float(spec["sample_interval"])) as sampler:
        _rss, base_pss, _n = sampler.take()
        epochs = run(spec, sampler)
    for ep in epochs:
        if ep["samples"] != int(spec["files"]):
            raise RuntimeError(f"{spec['section']}/{spec['loader']}/{spec.get('mode')} delivered "
                               f"{ep['samples']} samples, expected {spec['files']}")
    print(json.dumps({"baseline_pss": base_pss, "peak_pss": sampler.peak_pss,
                      "peak_rss": sampler.peak_rss, "memory_samples": sampler.samples,
                      "longest_sample_wait": sampler.longest_wait,
                      "peak_shmem_rise": sampler.peak_shmem - sampler.base_shmem,
                      "epochs": epochs}))
    return 0


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one child, inputs warmed first (``bench_read.warm_inputs``); return its result.

    Raises:
        RuntimeError: the child failed (its stderr is included).
    """
    warm_inputs(spec)
    # A peer's contender runs with the peers interpreter (bench_read.py, benchmarks/_common.py).
    python = spec.get("python") or sys.executable
    proc = subprocess.run([python, __file__, "--child", json.dumps(spec)], check=False,
                          capture_output=True, text=True, cwd=str(ROOT), stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['section']}/{spec['loader']} run exited {proc.returncode}:\n"
                           f"{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# --- orchestration and reporting ------------------------------------------------------------------


@dataclass
class Contender:
    section: str
    loader: str
    mode: str
    touch: str | None = None
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        if self.section == "transfer":
            return f"transfer_{self.touch}_{self.loader}"
        if self.section == "ceiling":
            return self.loader
        if self.section == "steady":
            return f"{self.mode}_{self.loader}_steady"
        return f"{self.mode}_{self.loader}"

    def spec(self) -> dict[str, Any]:
        return {"section": self.section, "loader": self.loader, "mode": self.mode,
                "touch": self.touch}

    def measured(self, run: dict[str, Any]) -> dict[str, Any]:
        """The epoch that counts: the last (the steady-state second one for transfer and
        steady, the only one otherwise)."""
        return run["epochs"][-1]


def _rate(n: float, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else float("inf")


def _mb(b: float) -> float:
    return round(b / 1e6, 1)


def contender_line(c: Contender, cfg: dict[str, Any]) -> dict[str, Any]:
    eps = [c.measured(r) for r in c.runs]
    best_i = min(range(len(eps)), key=lambda i: eps[i]["seconds"])
    best = eps[best_i]
    secs = [e["seconds"] for e in eps]
    med = statistics.median(secs)
    n, nb = best["samples"], best["batches"]
    line: dict[str, Any] = {
        "bench": "loader", "kind": "contender", "name": c.name, "section": c.section,
        "contender": c.loader, "mode": c.mode, "touch": c.touch,
        "loader": LOADER_DESC[(c.section, c.loader)], "batch_size": BATCH,
        "num_workers": WORKERS, "files": cfg["files"], "runs": len(eps),
        "samples": n, "batches": nb,
        "seconds": round(best["seconds"], 4), "median_seconds": round(med, 4),
        "all_seconds": [round(s, 4) for s in secs],
        "samples_per_s": _rate(n, best["seconds"]),
        "median_samples_per_s": _rate(n, med),
        "batches_per_s": _rate(nb, best["seconds"]),
        "median_batches_per_s": _rate(nb, med),
        "first_batch_seconds": (round(best["first_batch_seconds"], 4)
                                if best["first_batch_seconds"] is not None else None),
        "main_cpu_seconds": round(best["main_cpu_seconds"], 4),
        "worker_cpu_seconds": round(best["worker_cpu_seconds"], 4),
        "sampler_cpu_seconds": round(best["sampler_cpu_seconds"], 4),
        "main_cpu_ms_per_batch": round(best["main_cpu_seconds"] / nb * 1e3, 3),
        "worker_cpu_ms_per_batch": round(best["worker_cpu_seconds"] / nb * 1e3, 3),
        "min_cpu_ms_per_batch": round(min(
            (e["main_cpu_seconds"] + e["worker_cpu_seconds"]) / e["batches"] for e in eps) * 1e3,
            3),
        "min_cpu_us_per_sample": round(min(
            (e["main_cpu_seconds"] + e["worker_cpu_seconds"]) / e["samples"] for e in eps) * 1e6,
            1),
        "peak_pss_mb": _mb(max(r["peak_pss"] for r in c.runs)),
        "peak_rss_sum_mb": _mb(max(r["peak_rss"] for r in c.runs)),
        "baseline_pss_mb": _mb(min(r["baseline_pss"] for r in c.runs)),
        "peak_shmem_rise_mb": _mb(max(r["peak_shmem_rise"] for r in c.runs)),
        "memory_samples": min(r["memory_samples"] for r in c.runs),
        "longest_sample_wait_s": round(max(r["longest_sample_wait"] for r in c.runs), 3),
        "max_load_1min": round(max(c.measured(r)["load_1min"] for r in c.runs), 2),
    }
    if c.section == "transfer":
        first = [r["epochs"][0] for r in c.runs]
        fbest = min(first, key=lambda e: e["seconds"])
        line.update(
            batch_mb=_mb(best["batch_bytes"]),
            mb_per_s=_rate(best["batch_bytes"] * nb / 1e6, best["seconds"]),
            first_epoch_seconds=round(fbest["seconds"], 4),
            first_epoch_batches_per_s=_rate(fbest["batches"], fbest["seconds"]),
        )
    else:
        line.update(payload_bytes=best["payload_bytes"],
                    mb_per_s=_rate(best["payload_bytes"] / 1e6, best["seconds"]))
    if c.section == "ceiling":
        line["processes_used"] = min(c.measured(r)["processes_used"] for r in c.runs)
    return line


def summary_line(lines: dict[str, dict[str, Any]], cfg: dict[str, Any]) -> dict[str, Any]:
    def get(name: str, key: str) -> float:
        return float(lines[name][key])

    def ratio(a: str, b: str, key: str = "samples_per_s") -> float:
        return round(get(a, key) / get(b, key), 3)

    def cpu_ratio(a: str, b: str) -> float | None:
        # CPU times come in clock ticks (10 ms): over the few batches of a --quick run a
        # figure can read 0, and then there is no ratio to give.
        num, den = get(a, "min_cpu_ms_per_batch"), get(b, "min_cpu_ms_per_batch")
        return round(num / den, 3) if num > 0 and den > 0 else None

    wds = {m: max(("wds_batched", "wds_dataloader"), key=lambda k: get(f"{m}_{k}",
                                                                        "samples_per_s"))
           for m in MODES}
    transfer = ratio("transfer_pages_shardloader", "transfer_pages_dataloader", "batches_per_s")
    transfer_none = ratio("transfer_none_shardloader", "transfer_none_dataloader",
                          "batches_per_s")
    raw_files = ratio("raw_shardloader", "raw_smallfiles")
    decode_ceiling = ratio("decode_shardloader_steady", "decode_ceiling")
    # Run k of each is from the same round (adjacent in time): their ratio cancels slow drift.
    paired = [round(c / s, 3) for c, s in zip(lines["decode_ceiling"]["all_seconds"],
                                               lines["decode_shardloader_steady"]["all_seconds"])]
    pss = {m: get(f"{m}_shardloader", "peak_pss_mb") < get(f"{m}_smallfiles", "peak_pss_mb")
           for m in MODES}
    ratios = {
        "transfer_shardloader_vs_dataloader": transfer,
        "transfer_shardloader_vs_dataloader_median": ratio(
            "transfer_pages_shardloader", "transfer_pages_dataloader", "median_batches_per_s"),
        "transfer_untouched_shardloader_vs_dataloader": transfer_none,
        "transfer_first_epoch_shardloader_vs_dataloader": ratio(
            "transfer_pages_shardloader", "transfer_pages_dataloader",
            "first_epoch_batches_per_s"),
        "transfer_cpu_dataloader_vs_shardloader": cpu_ratio(
            "transfer_pages_dataloader", "transfer_pages_shardloader"),
        "raw_shardloader_vs_smallfiles": raw_files,
        "raw_shardloader_vs_smallfiles_median": ratio("raw_shardloader", "raw_smallfiles",
                                                      "median_samples_per_s"),
        "raw_shardloader_vs_webdataset": ratio("raw_shardloader", f"raw_{wds['raw']}"),
        "raw_shardloader_vs_shardio_dataloader": ratio("raw_shardloader",
                                                       "raw_shardio_dataloader"),
        "decode_shardloader_vs_ceiling": decode_ceiling,
        "decode_shardloader_vs_ceiling_median": ratio("decode_shardloader_steady",
                                                      "decode_ceiling", "median_samples_per_s"),
        "decode_shardloader_vs_ceiling_paired_median": statistics.median(paired),
        "decode_shardloader_with_start_vs_ceiling": ratio("decode_shardloader", "decode_ceiling"),
        "decode_shardloader_with_start_vs_ceiling_median": ratio(
            "decode_shardloader", "decode_ceiling", "median_samples_per_s"),
        "decode_shardloader_vs_smallfiles": ratio("decode_shardloader", "decode_smallfiles"),
        "decode_shardloader_vs_webdataset": ratio("decode_shardloader", f"decode_{wds['decode']}"),
        "decode_shardloader_vs_shardio_dataloader": ratio("decode_shardloader",
                                                          "decode_shardio_dataloader"),
        "raw_pss_shardloader_vs_smallfiles": ratio("raw_shardloader", "raw_smallfiles",
                                                   "peak_pss_mb"),
        "decode_pss_shardloader_vs_smallfiles": ratio("decode_shardloader", "decode_smallfiles",
                                                      "peak_pss_mb"),
    }
    for peer in MEASURED_PEERS:
        if f"raw_{peer}" in lines:
            ratios.update({f"{m}_{who}_vs_{peer}": ratio(f"{m}_{who}", f"{m}_{peer}")
                           for m in MODES for who in ("shardloader", "shardio_dataloader")})
    return {
        "bench": "loader", "kind": "summary", **cfg,
        "webdataset_setup": wds,
        "batches_per_s": {n: ln["batches_per_s"] for n, ln in lines.items()
                          if ln["section"] == "transfer"},
        "samples_per_s": {n: ln["samples_per_s"] for n, ln in lines.items()
                          if ln["section"] != "transfer"},
        "median_samples_per_s": {n: ln["median_samples_per_s"] for n, ln in lines.items()
                                 if ln["section"] != "transfer"},
        "cpu_ms_per_batch": {n: {"main": ln["main_cpu_ms_per_batch"],
                                 "workers": ln["worker_cpu_ms_per_batch"]}
                             for n, ln in lines.items()},
        "peak_pss_mb": {n: ln["peak_pss_mb"] for n, ln in lines.items()},
        "peak_shmem_rise_mb": {n: ln["peak_shmem_rise_mb"] for n, ln in lines.items()},
        "ratios": ratios,
        "decode_vs_ceiling_per_round": paired,
        "targets": {
            "transfer_ge_3x_dataloader": transfer >= TARGETS["transfer_vs_dataloader"],
            "raw_ge_5x_smallfiles": raw_files >= TARGETS["raw_vs_smallfiles"],
            "decode_ge_95pct_ceiling": decode_ceiling >= TARGETS["decode_vs_ceiling"],
            "pss_below_smallfiles": all(pss.values()),
        },
        "max_load_1min": max(ln["max_load_1min"] for ln in lines.values()),
        "loadavg_end": [round(v, 2) for v in os.getloadavg()],
        "notes": ("best-run ratios; transfer = steady-state (second) epoch, persistent workers, "
                  "consumer reading one byte per 4 KiB page (transfer_untouched: consumer reads "
                  "nothing); end-to-end = one epoch, worker start and stop timed, "
                  "persistent_workers=False; webdataset = the faster setup per mode; "
                  "decode ceiling = decode_item in a 2-process pool over in-memory bytes, "
                  "pool started before the clock, against ShardLoader's steady-state (second) "
                  "decode epoch (decode_shardloader_with_start_vs_ceiling: the one-epoch "
                  "figure with worker start); "
                  "pss_below_smallfiles = ShardLoader's peak tree PSS below smallfiles' in raw "
                  "and decode mode (PSS omits ring pages nobody touched: see "
                  "peak_shmem_rise_mb)."),
    }


def print_table(lines: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\nloader benchmark: {summary['files']} files, {summary['payload_mb']} MB, batch "
          f"{BATCH}, {WORKERS} workers, best of {summary['repeat']} (decode ceiling and steady: "
          f"{summary['decode_repeat']}; median in brackets), {summary['cpus']} CPUs; transfer batch uint8 [{BATCH},3,{summary['side']},"
          f"{summary['side']}]", file=err)
    print(f"{'contender':<34} {'rate':>22} {'best s':>8} {'cpu main/wrk ms/batch':>22} "
          f"{'PSS MB':>7} {'shm+ MB':>7}", file=err)
    for ln in lines:
        if ln["section"] == "transfer":
            rate = f"{ln['batches_per_s']:>8.1f} ({ln['median_batches_per_s']:>6.1f}) b/s"
        else:
            rate = f"{ln['samples_per_s']:>8.0f} ({ln['median_samples_per_s']:>6.0f}) s/s"
        print(f"{ln['name']:<34} {rate:>22} {ln['seconds']:>8.3f} "
              f"{ln['main_cpu_ms_per_batch']:>10.2f}/{ln['worker_cpu_ms_per_batch']:<11.2f} "
              f"{ln['peak_pss_mb']:>7.1f} {ln['peak_shmem_rise_mb']:>7.1f}", file=err)
    print("webdataset setup used: " + ", ".join(f"{m}={k}"
                                                for m, k in summary["webdataset_setup"].items()),
          file=err)
    print("ratios: " + ", ".join(f"{k}={v}" for k, v in summary["ratios"].items()), file=err)
    print(f"max 1-min load during runs {summary['max_load_1min']}, load average at end "
          f"{summary['loadavg_end']}", file=err)
    print("targets: " + ", ".join(f"{k}={'PASS' if v else 'MISS'}"
                                  for k, v in summary["targets"].items()), file=err)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=None, help="files to generate (default 20000)")
    p.add_argument("--classes", type=int, default=None, help="class folders (default 100)")
    p.add_argument("--repeat", type=int, default=None, help="runs per contender (default 3)")
    p.add_argument("--decode-repeat", type=int, default=None,
                   help="runs of the decode ceiling and steady-state ShardLoader, at least "
                        "--repeat (default 5)")
    p.add_argument("--shard-size", default=None, help="pack shard size (default 64MB)")
    p.add_argument("--side", type=int, default=None,
                   help="transfer tensors are uint8 (3, SIDE, SIDE) (default 224)")
    p.add_argument("--sample-interval", type=float, default=0.1,
                   help="seconds between memory samples (default 0.1; stretched to keep the "
                        "sampler within 10%% of a CPU)")
    p.add_argument("--ring-bytes", default=None,
                   help="ring_bytes of the end-to-end ShardLoader runs (default: shardio's "
                        "default; the transfer runs always use the default)")
    add_output_args(p, f"smoke configuration: {QUICK['files']} files, repeat {QUICK['repeat']}, "
                        f"{QUICK['side']}x{QUICK['side']} transfer tensors")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.child:
        return child(json.loads(a.child))
    base = QUICK if a.quick else DEFAULTS
    n_files = a.files if a.files is not None else base["files"]
    n_classes = a.classes if a.classes is not None else base["classes"]
    repeat = a.repeat if a.repeat is not None else base["repeat"]
    decode_repeat = a.decode_repeat if a.decode_repeat is not None else base["decode_repeat"]
    side = a.side if a.side is not None else base["side"]
    shard_size = a.shard_size or base["shard_size"]
    check_sizes(p, n_files, n_classes, shard_size)
    for option, value in (("--repeat", repeat), ("--decode-repeat", decode_repeat),
                          ("--side", side)):
        if value < 1:
            p.error(f"{option} {value}: at least 1 needed")
    check_seconds(p, "--sample-interval", a.sample_interval, positive=True)
    if a.ring_bytes is not None:
        from shardio.config import LoaderOptions
        from shardio.errors import UsageError

        try:
            LoaderOptions(ring_bytes=a.ring_bytes)
        except UsageError as exc:
            p.error(f"--ring-bytes {a.ring_bytes!r}: {exc}")
    check_output_args(p, a)
    return run_in_workdir("shardio-bench-loader-", a.workdir, a.keep,
                          lambda work: _bench(work, n_files, n_classes, repeat, side, shard_size,
                                              a.sample_interval, a.ring_bytes, a.json_out,
                                              decode_repeat))


def _bench(work: str, n_files: int, n_classes: int, repeat: int, side: int, shard_size: str,
           interval: float, ring_bytes: str | None, json_out: str | None,
           decode_repeat: int = 0) -> int:
    from shardio.config import LoaderOptions

    default_ring = LoaderOptions().ring_bytes
    e2e_ring = LoaderOptions(ring_bytes=ring_bytes).ring_bytes if ring_bytes else default_ring
    try:
        data = prepare(work, n_files, n_classes, shard_size, min_shards=MIN_SHARDS)
    except TooFewShards as exc:
        print(f"bench_loader: {exc}", file=sys.stderr)
        return 2
    base_spec = {k: data[k] for k in ("src", "shards", "tars", "files")}
    base_spec.update(sample_interval=interval, side=side, ring_bytes=e2e_ring)

    contenders = [Contender("transfer", ld, "transfer", t) for t in TOUCHES
                  for ld in TRANSFER_LOADERS]
    peers = [k for k in MEASURED_PEERS if data.get(k)]  # where the peers environment has them
    for k in peers:
        base_spec[k] = data[k]
    contenders += [Contender("e2e", ld, m) for m in MODES for ld in (*E2E_LOADERS, *peers)]
    contenders.append(Contender("ceiling", "decode_ceiling", "decode"))
    contenders.append(Contender("steady", "shardloader", "decode"))
    pair = contenders[-2:]  # the decode ceiling and the steady-state ShardLoader: adjacent
    rounds = [contenders[k:] + contenders[:k] for k in
              (rnd % len(contenders) for rnd in range(repeat))]
    # More runs of the decode pair alone (order alternating) up to decode_repeat: the two
    # differ by a few percent, less than this machine's run-to-run spread.
    rounds += [pair if rnd % 2 else pair[::-1] for rnd in range(repeat, decode_repeat)]
    for rnd, order in enumerate(rounds):
        for c in order:
            peer = {"python": data["peers_python"]} if c.loader in MEASURED_PEERS else {}
            c.runs.append(_run_child({**base_spec, **c.spec(), **peer}))
            ep = c.measured(c.runs[-1])
            print(f"  round {rnd + 1}/{len(rounds)} {c.name}: {ep['seconds']:.3f}s "
                  f"({ep['samples'] / ep['seconds']:.0f} samples/s, "
                  f"{ep['batches'] / ep['seconds']:.1f} batches/s, load {ep['load_1min']:.1f})",
                  file=sys.stderr)

    import shardio

    cfg = {
        "files": data["files"], "payload_bytes": data["payload_bytes"],
        "payload_mb": _mb(data["payload_bytes"]), "classes": n_classes,
        "num_shards": data["num_shards"], "shard_size": shard_size, "repeat": repeat,
        "decode_repeat": max(repeat, decode_repeat),
        "batch_size": BATCH, "num_workers": WORKERS, "side": side,
        "ring_bytes": default_ring, "e2e_ring_bytes": e2e_ring, "sample_interval": interval,
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "shardio": shardio.__version__, "torch": _dist_version("torch"),
        "webdataset": _dist_version("webdataset"), "pillow": _dist_version("pillow"),
        "peers_python": data["peers_python"], "peers": data["peers"],
    }
    lines = [contender_line(c, cfg) for c in contenders]
    summary = summary_line({ln["name"]: ln for ln in lines}, cfg)
    emit(lines, summary, json_out)
    print_table(lines, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
