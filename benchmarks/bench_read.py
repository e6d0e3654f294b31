"""Read throughput: ``ShardDataset`` vs torch over small files and webdataset, same run, warm cache.

``python benchmarks/bench_read.py`` generates an ImageFolder tree (default 20,000 JPEGs of 5-40 KB
in 100 class folders, :func:`tools.make_dataset.make_images`), packs it with
``shardio.pack(src, out, label_from_dir=True, shard_size="64MB", workers=2, fsync=False)``
(shardio's tar shards are plain WebDataset tars, so webdataset reads the very same files), then
times one epoch per run of the loaders below, each run in a fresh child process started after
every source file and shard was read again (:func:`warm_inputs`: everything sits in the page
cache at the start of every run, whatever the host evicted in between):

* ``shardio``: ``DataLoader(ShardDataset(out, batch_size=256, transform=...), batch_size=256,
  num_workers=2)`` (shuffled; per-sample checksums verified, the default);
* ``shardio_loader``: ``ShardLoader(ShardDataset(out, batch_size=256, transform=...),
  batch_size=256, num_workers=2)``: the same dataset, read by shardio's own worker pool, whose
  workers write whole batches into shared-memory rings (default ``ring_bytes``, default collate:
  tensors and numbers stacked straight into the ring, bytes pickled alongside), with
  ``persistent_workers=False`` like the DataLoaders: each epoch starts its workers, and stops
  them when its iterator runs out.  (It does not wait for the kernel to tear the stopped
  workers down, ~12 ms each here, as DataLoader's ``join`` does: see ``shardio.pool``,
  *Closing without waiting*.  A later epoch's start overlaps with that teardown;
  ``loader.close()`` waits for it.);
* ``smallfiles``: ``DataLoader(ImageFolderBytes(src), batch_size=256, shuffle=True,
  num_workers=2)``, a map-style dataset that lists the tree like torchvision's ImageFolder and
  opens and reads one file per ``__getitem__``;
* ``wds_batched``: ``wds.WebLoader(wds.WebDataset(tars, shardshuffle=len(tars)).shuffle(1000)
  .to_tuple("jpg", "cls").map(...).batched(256), batch_size=None, num_workers=2)``: batching inside
  the workers, the setup webdataset's documentation recommends;
* ``wds_dataloader``: the same pipeline without ``.batched`` under ``DataLoader(batch_size=256,
  num_workers=2)``, the other common setup.  The summary compares shardio with the faster of the
  two webdataset setups in each mode and names it.

each in two modes, with the same per-sample function for every contender:

* ``raw``: the JPEG bytes and the integer label; a batch is ``(list of bytes, int64 label tensor)``
  (plus the payload size: an int, or a per-sample tensor from ShardLoader's default collate);
* ``decode``: Pillow decode to RGB, resize the shorter side to 64 (bilinear), center crop 64x64,
  ``uint8`` CHW tensor; a batch is ``(uint8 [B,3,64,64], labels)``.

Every run is a fresh child process (``--child``), so a run's memory is its own and one contender's
heap does not inflate the next; importing torch/webdataset is outside the timed region.  A run
times one epoch from ``iter(loader)`` to the end of the loop, so starting the workers
(``persistent_workers=False``, fork) and shutting them down count, as they do every epoch in
training.  Runs go in rounds (every contender once per round, the order rotated each round); the
best and the median of ``--repeat`` runs are reported.

Memory: a background thread in the child samples the PSS (``psutil memory_full_info().pss``) and RSS
of the child and all its descendants (the DataLoader workers) every ``--sample-interval`` seconds;
``peak_pss_mb`` is the largest tree sum seen (PSS splits pages shared between the forked workers and
the main process, so the sum does not double count them; the RSS sum does).  ``baseline_pss_mb`` is
the tree before the loader starts (interpreter, torch, the dataset object).

CPU: each run also records the loader's CPU time, main process plus its workers (``getrusage``
of self and reaped children, plus live workers such as a ShardLoader's or persistent ones read
with ``psutil``; the memory sampler's own CPU taken out), per delivered sample, and the 1-minute
load average.  Wall time suffers when other jobs share the machine, CPU per sample
much less, so ``cpu_ratios`` cross-check the throughput ratios.

Growth check: ``--growth-epochs`` (default 10) epochs of raw mode in one child for shardio, the
ShardLoader (not persistent: closed and restarted every epoch) and the small-files loader, with
``persistent_workers`` False and True; the tree's RSS and PSS are read
after each epoch's loop ends and epoch 1 is compared with the last epoch (``*_growth_pct``; a
least-squares ``*_trend_pct`` too).  With persistent workers the tree is the main process and both
workers, which live across epochs, so a per-worker leak accumulates; without, the workers have
exited and only the main process, where a leak across epochs would have to live, remains.  The
persistent runs' epochs after the first also show what worker start-up costs (the
``..._persistent_workers`` ratio); the timed contenders use ``persistent_workers=False``.

stdout gets one JSON line per contender and mode, one per growth check, then one ``summary`` line
with the ratios and target booleans; stderr gets a table.  MB = 1e6 bytes of JPEG payload (the
``cls`` label bytes are not counted).  ``--quick`` (a few hundred files, 2 MB shards so that both
workers get shards, one run, two growth epochs) is a smoke configuration whose speeds mean nothing.
"""

from __future__ import annotations

import argparse
import gc
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import PEERS, peers_python, probe_peers, usable  # noqa: E402
from benchmarks._common import add_output_args, emit, run_in_workdir  # noqa: E402
from benchmarks._common import check_files_classes, check_output_args, check_seconds  # noqa: E402
from benchmarks._common import dist_version as _dist_version  # noqa: E402

BATCH = 256
WORKERS = 2
CROP = 64
WDS_SHUFFLE = 1000
QUICK = {"files": 400, "classes": 10, "repeat": 1, "growth_epochs": 2, "shard_size": "2MB"}
DEFAULTS = {"files": 20000, "classes": 100, "repeat": 3, "growth_epochs": 10, "shard_size": "64MB"}
KINDS = ("shardio", "shardio_loader", "smallfiles", "wds_batched", "wds_dataloader")
MODES = ("raw", "decode")
GROWTH = (("shardio", False), ("shardio", True), ("shardio_loader", False),
          ("shardio_loader", True), ("smallfiles", False), ("smallfiles", True))
# Each worker gets a batch (with fewer files one worker does all the work)...
MIN_FILES = BATCH * (WORKERS - 1) + 1
# ...and a shard: webdataset deals whole shards to the workers and stops a worker that gets none
# ("No samples found in dataset; perhaps you have fewer shards than workers").
MIN_SHARDS = WORKERS
# An upper bound on a packed sample of the generated tree (JPEGs are drawn below 40 KiB and come
# out at most ~32 KB; plus the tar framing of the jpg and cls members): a smaller --shard-size
# may not hold one sample, and at files * this or more the whole tree is certainly one shard.
MAX_PACKED_SAMPLE = 64 * 1024
TARGETS = {"raw_vs_smallfiles": 2.0, "raw_vs_webdataset": 4.0, "decode_vs_webdataset": 1.1,
           "rss_growth_pct": 5.0}


# --- the per-sample work, identical for every contender (runs in the DataLoader workers) -------


def raw_item(data: bytes, label: int) -> tuple[bytes, int, int]:
    """Raw mode: the bytes as stored, the label, and the payload size for the MB/s figure."""
    return data, label, len(data)


def decode_item(data: bytes, label: int) -> tuple[Any, int, int]:
    """Decode mode: RGB decode, shorter side to 64 (bilinear), center crop 64, uint8 CHW tensor."""
    import numpy as np
    import torch
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        rgb = img.convert("RGB")
    w, h = rgb.size
    scale = CROP / min(w, h)
    nw, nh = max(CROP, round(w * scale)), max(CROP, round(h * scale))
    rgb = rgb.resize((nw, nh), Image.Resampling.BILINEAR)
    left, top = (nw - CROP) // 2, (nh - CROP) // 2
    arr = np.array(rgb.crop((left, top, left + CROP, top + CROP)))
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous(), label, len(data)


ITEM = {"raw": raw_item, "decode": decode_item}


def collate_raw(items: Sequence[tuple[bytes, int, int]]) -> tuple[list[bytes], Any, int]:
    import torch

    return ([it[0] for it in items], torch.tensor([it[1] for it in items], dtype=torch.int64),
            sum(it[2] for it in items))


def collate_decode(items: Sequence[tuple[Any, int, int]]) -> tuple[Any, Any, int]:
    import torch

    return (torch.stack([it[0] for it in items]),
            torch.tensor([it[1] for it in items], dtype=torch.int64), sum(it[2] for it in items))


COLLATE = {"raw": collate_raw, "decode": collate_decode}


# --- peers (benchmarks/_common.py: their own environment, probed) ------------------------------
MEASURED_PEERS = ("litdata", "mosaic")  # kinds this script runs when their library imports


def _litdata_sample(item: tuple[str, int]) -> dict[str, Any]:
    """``litdata.optimize`` fn: one source file and its label."""
    path, label = item
    with open(path, "rb") as f:
        return {"jpg": f.read(), "cls": label}


def convert_litdata(src: str, out: str, workers: int = WORKERS) -> int:
    """Write the tree as a LitData dataset (64 MB chunks, like the shards) with ``workers``
    processes; return the samples written.  Peers python (``bench_pack.py`` times it too)."""
    import litdata

    items = ImageFolderBytes(src, raw_item).samples
    litdata.optimize(fn=_litdata_sample, inputs=items, output_dir=out, chunk_bytes="64MB",
                     num_workers=workers)
    return len(items)


def convert_mosaic(src: str, out: str) -> int:
    """Write the tree as a MosaicML Streaming (MDS) dataset, 64 MB shards, no compression and no
    extra hashes (shardio's own checksums are on in its contenders); return the samples
    written.  Peers python (``bench_pack.py`` times it too)."""
    from streaming import MDSWriter

    items = ImageFolderBytes(src, raw_item).samples
    with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int"}, size_limit="64mb") as w:
        for path, label in items:
            with open(path, "rb") as f:
                w.write({"jpg": f.read(), "cls": label})
    return len(items)


PEER_CONVERT = {"litdata": convert_litdata, "mosaic": convert_mosaic}


class MosaicItem:
    """Built in the child: a ``streaming.StreamingDataset`` over the local MDS tree whose items
    go through the mode's per-sample function."""

    @staticmethod
    def make(root: str, fn: Callable[[bytes, int], Any]) -> Any:
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        # Streaming coordinates its workers through named shared memory; a run killed earlier
        # can leave some behind, which its documentation says to clear this way.
        clean_stale_shared_memory()

        class _Items(StreamingDataset):  # type: ignore[misc]
            def __getitem__(self, index: Any) -> Any:
                s = super().__getitem__(index)
                return fn(s["jpg"], int(s["cls"]))

        return _Items(local=root, shuffle=True, batch_size=BATCH)


class LitDataItem:
    """Built in the child: a ``litdata.StreamingDataset`` whose items go through the mode's
    per-sample function."""

    @staticmethod
    def make(root: str, fn: Callable[[bytes, int], Any]) -> Any:
        import litdata

        class _Items(litdata.StreamingDataset):  # type: ignore[misc]
            def __getitem__(self, index: Any) -> Any:
                s = super().__getitem__(index)
                # LitData hands out a memoryview of its chunk, which cannot be pickled to the
                # main process: bytes, as every other contender delivers.
                return fn(bytes(s["jpg"]), int(s["cls"]))

        return _Items(root, shuffle=True)


class ShardioItem:
    """``ShardDataset`` transform: ``{"jpg", "cls", ...}`` → the mode's per-sample function."""

    def __init__(self, fn: Callable[[bytes, int], Any]) -> None:
        self.fn = fn

    def __call__(self, sample: dict[str, Any]) -> Any:
        return self.fn(sample["jpg"], int(sample["cls"]))


class WdsItem:
    """webdataset ``.map`` after ``.to_tuple("jpg", "cls")``."""

    def __init__(self, fn: Callable[[bytes, int], Any]) -> None:
        self.fn = fn

    def __call__(self, sample: tuple[bytes, bytes]) -> Any:
        return self.fn(sample[0], int(sample[1]))


class ImageFolderBytes:
    """Map-style dataset over an ImageFolder tree: one ``open``/``read`` per sample.

    Lists the tree the way torchvision's ``ImageFolder`` does (sorted class folders, sorted files,
    label = class position), without torchvision.
    """

    def __init__(self, root: str, fn: Callable[[bytes, int], Any]) -> None:
        self.fn = fn
        classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
        self.samples: list[tuple[str, int]] = []
        for label, name in enumerate(classes):
            d = os.path.join(root, name)
            self.samples += [(os.path.join(d, f), label) for f in sorted(os.listdir(d))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> Any:
        path, label = self.samples[i]
        with open(path, "rb") as f:
            return self.fn(f.read(), label)


# --- child: one measured run ------------------------------------------------------------------


def _tree_memory() -> tuple[int, int, int]:
    """``(rss, pss, processes)`` summed over this process and all its descendants."""
    import psutil

    me = psutil.Process()
    rss = pss = n = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            m = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue  # a worker exiting between listing and reading
        rss, pss, n = rss + m.rss, pss + m.pss, n + 1
    return rss, pss, n


class TreeSampler:
    """Background thread recording the peak PSS and RSS of the process tree.

    Reading ``smaps_rollup`` costs the kernel a few ms per process (it walks the page tables), so
    the interval is a trade between catching short peaks and stealing CPU from the run.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.peak_pss = self.peak_rss = self.samples = 0
        self.cpu_seconds = 0.0  # this thread's own CPU (kernel time of smaps_rollup included)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tree-sampler", daemon=True)

    def _loop(self) -> None:
        while True:
            self.take()
            if self._stop.wait(self.interval):
                return

    def take(self) -> tuple[int, int, int]:
        c0 = time.thread_time()
        rss, pss, n = _tree_memory()
        self.cpu_seconds += time.thread_time() - c0
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.samples += 1
        return rss, pss, n

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _loader(spec: dict[str, Any]) -> tuple[Any, Callable[[int], None]]:
    """The loader a spec names, and a per-epoch hook (``set_epoch`` for shardio).

    ``shardio_loader`` is a :class:`shardio.ShardLoader` with its default collate, which stacks
    the per-sample tensors and numbers straight into the shared-memory ring: the batch has the
    structure ``collate_*`` gives, except that ``nbytes`` is a per-sample int64 tensor (see
    :func:`payload_of`).  ``persistent`` is its ``persistent_workers``, as the DataLoaders'.
    """
    from torch.utils.data import DataLoader

    kind, mode, persistent = spec["kind"], spec["mode"], spec["persistent"]
    fn, collate = ITEM[mode], COLLATE[mode]
    common = {"num_workers": WORKERS, "persistent_workers": persistent}
    if kind in ("shardio", "shardio_loader"):
        from shardio import ShardDataset, ShardLoader

        ds = ShardDataset(spec["shards"], batch_size=BATCH, shuffle=True, transform=ShardioItem(fn),
                          zero_copy=True)
        if kind == "shardio_loader":
            ring = {"ring_bytes": spec["ring_bytes"]} if spec.get("ring_bytes") else {}
            loader = ShardLoader(ds, batch_size=BATCH, num_workers=WORKERS,
                                 persistent_workers=persistent, **ring)
            return loader, loader.set_epoch
        return DataLoader(ds, batch_size=BATCH, collate_fn=collate, **common), ds.set_epoch
    if kind == "smallfiles":
        ds = ImageFolderBytes(spec["src"], fn)
        return DataLoader(ds, batch_size=BATCH, shuffle=True, collate_fn=collate, **common), \
            lambda epoch: None
    if kind == "mosaic":
        from streaming import StreamingDataLoader

        mds = MosaicItem.make(spec["mosaic"], fn)
        return (StreamingDataLoader(mds, batch_size=BATCH, collate_fn=collate, **common),
                lambda epoch: None)
    if kind == "litdata":
        import litdata

        lds = LitDataItem.make(spec["litdata"], fn)
        return (litdata.StreamingDataLoader(lds, batch_size=BATCH, collate_fn=collate, **common),
                lds.set_epoch)
    import webdataset as wds

    urls = spec["tars"]
    pipe = (wds.WebDataset(urls, shardshuffle=len(urls)).shuffle(WDS_SHUFFLE)
            .to_tuple("jpg", "cls").map(WdsItem(fn)))
    if kind == "wds_batched":
        return wds.WebLoader(pipe.batched(BATCH, collation_fn=collate), batch_size=None,
                             **common), lambda epoch: None
    if kind == "wds_dataloader":
        return DataLoader(pipe, batch_size=BATCH, collate_fn=collate, **common), lambda epoch: None
    raise ValueError(f"unknown contender {kind!r}")


def payload_of(nbytes: Any) -> int:
    """A batch's payload bytes: an int (``collate_*``) or a per-sample tensor (default collate)."""
    return int(nbytes.sum()) if hasattr(nbytes, "sum") else int(nbytes)


def _is_shard_loader(loader: Any) -> bool:
    from shardio import ShardLoader

    return isinstance(loader, ShardLoader)


def settle(loader: Any, persistent: bool) -> None:
    """After an epoch's timed loop, before the tree's memory is read: the workers a
    non-persistent ``ShardLoader`` stopped as its iterator ran out are gone (it does not wait
    for their exit; ``close()`` does), as a non-persistent DataLoader's are by then."""
    if not persistent and _is_shard_loader(loader):
        loader.close()


def _cpu() -> tuple[float, float]:
    """CPU seconds (user + system) of this process, and of its workers: reaped children
    (``getrusage``) plus live descendants (``psutil``; ShardLoader and persistent workers)."""
    import psutil

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = 0.0
    for p in psutil.Process().children(recursive=True):
        try:
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        live += t.user + t.system
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime + live


def child(spec: dict[str, Any]) -> int:
    """Run ``spec["epochs"]`` epochs of one contender; print one JSON result line."""
    import torch  # noqa: F401  (import cost outside every timed region)

    expect = int(spec["files"])
    with TreeSampler(float(spec["sample_interval"])) as sampler:
        t0 = time.perf_counter()
        loader, set_epoch = _loader(spec)
        setup = time.perf_counter() - t0
        _rss, base_pss, _n = sampler.take()
        epochs: list[dict[str, Any]] = []
        for epoch in range(int(spec["epochs"])):
            set_epoch(epoch)
            samples = payload = 0
            first = None
            end_mem: tuple[int, int, int] | None = None
            load = os.getloadavg()[0]
            (main0, kids0), samp0 = _cpu(), sampler.cpu_seconds
            _x = labels = nbytes = None
            # A full collection pending from set-up (~0.1 s in a process holding torch) would
            # land in whichever contender's epoch allocates first: run it before the clock.
            gc.collect()
            t0 = time.perf_counter()
            for _x, labels, nbytes in loader:
                if first is None:
                    first = time.perf_counter() - t0
                samples += len(labels)
                payload += payload_of(nbytes)
            del _x, labels, nbytes
            dt = time.perf_counter() - t0
            (main1, kids1), samp1 = _cpu(), sampler.cpu_seconds
            if spec["end_memory"]:
                settle(loader, spec["persistent"])
                # After the loop: non-persistent workers have exited (what remains is the main
                # process, where a leak across epochs would live); persistent ones are all alive.
                # At the last batch the tree would hold a finished worker or not, depending on
                # which worker's last batch came last.
                end_mem = sampler.take()
            if samples != expect:
                raise RuntimeError(f"{spec['kind']}/{spec['mode']} delivered {samples} samples in "
                                   f"epoch {epoch}, expected {expect}")
            ep = {"seconds": dt, "samples": samples, "payload_bytes": payload,
                  "first_batch_seconds": first, "load_1min": load,
                  # the sampler's CPU is ours, not the loader's: take it out
                  "main_cpu_seconds": main1 - main0 - (samp1 - samp0),
                  "worker_cpu_seconds": kids1 - kids0, "sampler_cpu_seconds": samp1 - samp0}
            if end_mem is not None:
                ep.update(tree_rss=end_mem[0], tree_pss=end_mem[1], processes=end_mem[2])
            epochs.append(ep)
        if _is_shard_loader(loader):
            loader.close()
    print(json.dumps({"setup_seconds": setup, "baseline_pss": base_pss,
                      "peak_pss": sampler.peak_pss, "peak_rss": sampler.peak_rss,
                      "memory_samples": sampler.samples,
                      "epochs": epochs}))
    return 0


def warm_inputs(spec: dict[str, Any]) -> int:
    """Read every input a run's contenders read (the source tree, the shards and their indexes,
    the peers' converted copies), so that each run starts from a warm page cache, whatever
    the machine evicted since the last (a host that pages out cold page cache proactively,
    DAMON's ``pageout`` on this VM, had evicted ~12% of the small files between runs, which
    made the small-files DataLoader up to 25% slower in some runs than in others).  Returns the
    bytes read."""
    paths = [os.path.join(d, n) for d, _, names in os.walk(spec["src"]) for n in names]
    for key in ("shards", "mosaic", "litdata"):
        if spec.get(key):
            paths += [os.path.join(d, n) for d, _, names in os.walk(spec[key]) for n in names]
    return _read_all(paths)


def _run_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one child, inputs warmed first (:func:`warm_inputs`); return its result.

    Raises:
        RuntimeError: the child failed (its stderr is included).
    """
    warm_inputs(spec)
    proc = subprocess.run([spec.get("python") or sys.executable, __file__, "--child",
                           json.dumps(spec)],
                          capture_output=True, text=True, cwd=str(ROOT), stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['kind']}/{spec['mode']} run exited {proc.returncode}:\n"
                           f"{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


# --- dataset ----------------------------------------------------------------------------------


def _read_all(paths: Sequence[str]) -> int:
    total = 0
    buf = bytearray(8 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                total += n
    return total


class TooFewShards(Exception):
    """The tree packed into fewer shards than the loaders need (:data:`MIN_SHARDS`)."""


def check_sizes(p: argparse.ArgumentParser, files: int, classes: int, shard_size: str) -> None:
    """``bench_read`` and ``bench_loader``: refuse (``p.error``: exit 2) sizes that would stop
    the run or measure one worker: fewer than :data:`MIN_FILES` files, a class count outside
    ``1..files``, a shard size that is not a size, that may be smaller than one sample, or that
    certainly packs everything into one shard (the post-pack check, :class:`TooFewShards`,
    catches the rest)."""
    check_files_classes(p, files, classes, MIN_FILES,
                        f" (one batch of {BATCH} for each of the {WORKERS} workers, plus one)")
    from shardio._fsutil import parse_size
    from shardio.errors import UsageError

    try:
        size = parse_size(shard_size)
    except UsageError as exc:
        p.error(f"--shard-size {shard_size!r}: {exc}")
    if size < MAX_PACKED_SAMPLE:  # pack refuses a sample larger than a shard, after generating
        p.error(f"--shard-size {shard_size}: a generated sample takes up to "
                f"{MAX_PACKED_SAMPLE // 1024}KiB packed; pass --shard-size "
                f"{MAX_PACKED_SAMPLE // 1024}KiB or more")
    if size >= files * MAX_PACKED_SAMPLE:
        p.error(f"--shard-size {shard_size}: all {files} files would pack into one shard, and "
                f"the webdataset loaders need at least {MIN_SHARDS} (one per worker); pass "
                f"--shard-size {_kb(files * MAX_PACKED_SAMPLE // 8)} or less, or more --files")


def _kb(nbytes: int) -> str:
    return f"{max(1, nbytes // 1000)}KB"


def prepare(work: str, files: int, classes: int, shard_size: str,
            min_shards: int = 1) -> dict[str, Any]:
    """Generate the tree, pack it, read everything once (page cache warm).

    Returns:
        Paths and sizes: ``src``, ``shards``, ``tars``, ``files``, ``payload_bytes``, ...

    Raises:
        TooFewShards: the pack made fewer than ``min_shards`` shards (checked before the page
            cache is warmed and the peers' copies are made).
    """
    import shardio
    from tools.make_dataset import make_images

    src, shards = os.path.join(work, "src"), os.path.join(work, "shards")
    t0 = time.perf_counter()
    make_images(src, files=files, classes=classes)
    t_gen = time.perf_counter() - t0
    t0 = time.perf_counter()
    manifest = shardio.pack(src, shards, label_from_dir=True, shard_size=shard_size, workers=2,
                            fsync=False, progress=False)
    t_pack = time.perf_counter() - t0
    if len(manifest.shards) < min_shards:
        total = manifest.total_bytes
        raise TooFewShards(
            f"--shard-size {shard_size}: the {files} files ({total / 1e6:.1f} MB packed) made "
            f"{len(manifest.shards)} shard(s), and the webdataset loaders need at least "
            f"{min_shards} (one per worker): figures from this tree would mean nothing, so the "
            f"run stops here; pass --shard-size {_kb(total // (min_shards + 1))} or less, or "
            "more --files")
    sources = [os.path.join(d, n) for d, _, names in os.walk(src) for n in names]
    tars = [os.path.join(shards, s.path) for s in manifest.shards]
    payload = _read_all(sources)
    shard_bytes = _read_all(tars)
    _read_all([t + ".idx" for t in tars if os.path.exists(t + ".idx")])
    if len(sources) != files:
        raise RuntimeError(f"generated {len(sources)} files, expected {files}")
    print(f"generated {files} files ({payload / 1e6:.1f} MB) in {t_gen:.1f}s, packed into "
          f"{len(tars)} shards ({shard_bytes / 1e6:.1f} MB) in {t_pack:.1f}s; page cache warmed",
          file=sys.stderr)
    out = {"src": src, "shards": shards, "tars": tars, "files": files, "payload_bytes": payload,
           "num_shards": len(tars), "shard_bytes": shard_bytes}
    python = peers_python()
    out["peers_python"], out["peers"] = python, probe_peers(python)
    for kind in MEASURED_PEERS:
        if python is None or not usable(out["peers"][PEERS[kind][1]]):
            continue
        peer_out = os.path.join(work, kind)
        subprocess.run([python, __file__, "--peer-convert", kind, src, peer_out], check=True,
                       cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        _read_all([os.path.join(peer_out, n) for n in os.listdir(peer_out)])
        out[kind] = peer_out
    print("peers: " + ", ".join(f"{d} {v}" for d, v in out["peers"].items()), file=sys.stderr)
    return out


# --- orchestration and reporting ----------------------------------------------------------------


@dataclass
class Contender:
    kind: str
    mode: str
    runs: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.kind}_{self.mode}"


LOADER_DESC = {
    "mosaic": ("streaming.StreamingDataLoader(streaming.StreamingDataset(local=mds, shuffle=True, "
               "batch_size=256) with f applied in __getitem__, batch_size=256) (peers environment; "
               "data written by streaming.MDSWriter in 64 MB shards)"),
    "litdata": ("litdata.StreamingDataLoader(litdata.StreamingDataset(optimized, shuffle=True) "
                "with f applied in __getitem__, batch_size=256) (peers environment; data written "
                "by litdata.optimize in 64 MB chunks)"),
    "shardio": ("DataLoader(ShardDataset(batch_size=256, shuffle=True, transform=f, "
                "zero_copy=True), batch_size=256)"),
    "shardio_loader": ("ShardLoader(ShardDataset(batch_size=256, shuffle=True, transform=f, "
                       "zero_copy=True), batch_size=256) (default collate into the shared-memory "
                       "ring; raw bytes columns arrive as arrays viewing it)"),
    "smallfiles": "DataLoader(ImageFolderBytes(src), batch_size=256, shuffle=True)",
    "wds_batched": ("WebLoader(WebDataset(tars, shardshuffle=len(tars)).shuffle(1000).to_tuple()"
                    ".map(f).batched(256), batch_size=None)"),
    "wds_dataloader": ("DataLoader(WebDataset(tars, shardshuffle=len(tars)).shuffle(1000)"
                       ".to_tuple().map(f), batch_size=256)"),
}


def _rate(n: float, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else float("inf")


def _mb(b: float) -> float:
    return round(b / 1e6, 1)


def contender_line(c: Contender, data: dict[str, Any]) -> dict[str, Any]:
    secs = [r["epochs"][0]["seconds"] for r in c.runs]
    best = min(c.runs, key=lambda r: r["epochs"][0]["seconds"])["epochs"][0]
    med = statistics.median(secs)
    payload = best["payload_bytes"]
    return {
        "bench": "read", "kind": "contender", "contender": c.kind, "mode": c.mode,
        "loader": LOADER_DESC[c.kind], "batch_size": BATCH, "num_workers": WORKERS,
        "persistent_workers": False, "files": data["files"], "payload_bytes": payload,
        "runs": len(secs),
        "seconds": round(best["seconds"], 4),
        "samples_per_s": _rate(best["samples"], best["seconds"]),
        "mb_per_s": _rate(payload / 1e6, best["seconds"]),
        "median_seconds": round(med, 4),
        "median_samples_per_s": _rate(best["samples"], med),
        "median_mb_per_s": _rate(payload / 1e6, med),
        "all_seconds": [round(s, 4) for s in secs],
        "first_batch_seconds": round(best["first_batch_seconds"], 4),
        "peak_pss_mb": _mb(max(r["peak_pss"] for r in c.runs)),
        "peak_rss_sum_mb": _mb(max(r["peak_rss"] for r in c.runs)),
        "baseline_pss_mb": _mb(min(r["baseline_pss"] for r in c.runs)),
        "setup_seconds": round(min(r["setup_seconds"] for r in c.runs), 4),
        "cpu_seconds": round(best["main_cpu_seconds"] + best["worker_cpu_seconds"], 3),
        "main_cpu_seconds": round(best["main_cpu_seconds"], 3),
        "worker_cpu_seconds": round(best["worker_cpu_seconds"], 3),
        "min_cpu_us_per_sample": round(min(_cpu_us(r["epochs"][0]) for r in c.runs), 1),
        "max_load_1min": round(max(r["epochs"][0]["load_1min"] for r in c.runs), 2),
    }


def _cpu_us(ep: dict[str, Any]) -> float:
    """Loader CPU (main + workers, the memory sampler excluded) per delivered sample, in us."""
    return (ep["main_cpu_seconds"] + ep["worker_cpu_seconds"]) / ep["samples"] * 1e6


def _growth_pct(first: float, last: float) -> float:
    return round((last - first) / first * 100, 2)


def _trend_pct(values: Sequence[float]) -> float:
    """Least-squares growth from the first to the last epoch, in % of the fitted first value
    (less sensitive than first-vs-last to one noisy reading)."""
    import numpy as np

    if len(values) < 2:
        return 0.0
    slope, first = np.polyfit(np.arange(len(values)), np.asarray(values, dtype=float), 1)
    return round(float(slope * (len(values) - 1) / first * 100), 2)


def growth_line(kind: str, persistent: bool, r: dict[str, Any]) -> dict[str, Any]:
    eps = r["epochs"]
    rss = [e["tree_rss"] for e in eps]
    pss = [e["tree_pss"] for e in eps]
    sps = [_rate(e["samples"], e["seconds"]) for e in eps]
    return {
        "bench": "read", "kind": "growth", "contender": kind, "mode": "raw",
        "persistent_workers": persistent, "epochs": len(eps),
        "epoch_seconds": [round(e["seconds"], 3) for e in eps],
        "samples_per_s": sps,
        # epoch 1 pays worker start-up even with persistent workers; later epochs do not
        "median_samples_per_s_after_epoch1": statistics.median(sps[1:]) if len(sps) > 1 else sps[0],
        "tree_rss_mb": [_mb(v) for v in rss], "tree_pss_mb": [_mb(v) for v in pss],
        "processes": [e["processes"] for e in eps],
        "rss_growth_pct": _growth_pct(rss[0], rss[-1]),
        "pss_growth_pct": _growth_pct(pss[0], pss[-1]),
        "rss_trend_pct": _trend_pct(rss), "pss_trend_pct": _trend_pct(pss),
        "peak_pss_mb": _mb(r["peak_pss"]),
    }


def summary_line(lines: dict[str, dict[str, Any]], growth: list[dict[str, Any]],
                 cfg: dict[str, Any]) -> dict[str, Any]:
    def sps(name: str) -> float:
        return float(lines[name]["samples_per_s"])

    def cpu_ratio(a: str, b: str) -> float | None:
        # CPU times come in clock ticks (10 ms): in a --quick run a figure can read 0.
        num, den = lines[a]["min_cpu_us_per_sample"], lines[b]["min_cpu_us_per_sample"]
        return round(num / den, 3) if num > 0 and den > 0 else None

    wds_best = {m: max(("wds_batched", "wds_dataloader"), key=lambda k: sps(f"{k}_{m}"))
                for m in MODES}
    raw_vs_files = round(sps("shardio_raw") / sps("smallfiles_raw"), 3)
    raw_vs_wds = round(sps("shardio_raw") / sps(f"{wds_best['raw']}_raw"), 3)
    decode_vs_wds = round(sps("shardio_decode") / sps(f"{wds_best['decode']}_decode"), 3)
    loader_raw_vs_files = round(sps("shardio_loader_raw") / sps("smallfiles_raw"), 3)
    loader_raw_vs_wds = round(sps("shardio_loader_raw") / sps(f"{wds_best['raw']}_raw"), 3)
    loader_growth = [g for g in growth if g["contender"] == "shardio_loader"]
    shardio_growth = [g for g in growth if g["contender"] == "shardio"]
    rss_growth = max((g["rss_growth_pct"] for g in shardio_growth), default=None)
    steady = {g["contender"]: g["median_samples_per_s_after_epoch1"] for g in growth
              if g["persistent_workers"] and g["epochs"] > 1}
    ratios: dict[str, float | None] = {
        "raw_shardio_vs_smallfiles": raw_vs_files,
        "raw_shardio_vs_webdataset": raw_vs_wds,
        "decode_shardio_vs_webdataset": decode_vs_wds,
        "decode_shardio_vs_smallfiles": round(sps("shardio_decode") / sps("smallfiles_decode"), 3),
        "raw_shardio_vs_webdataset_median": round(
            lines["shardio_raw"]["median_samples_per_s"]
            / lines[f"{wds_best['raw']}_raw"]["median_samples_per_s"], 3),
        "raw_shardio_vs_smallfiles_persistent_workers": (
            round(steady["shardio"] / steady["smallfiles"], 3)
            if {"shardio", "smallfiles"} <= set(steady) else None),
        "shardio_rss_growth_pct": rss_growth,
        "shardio_pss_growth_pct": max((g["pss_growth_pct"] for g in shardio_growth),
                                      default=None),
        "raw_shardio_loader_vs_smallfiles": loader_raw_vs_files,
        "raw_shardio_loader_vs_webdataset": loader_raw_vs_wds,
        "decode_shardio_loader_vs_webdataset": round(
            sps("shardio_loader_decode") / sps(f"{wds_best['decode']}_decode"), 3),
        "decode_shardio_loader_vs_smallfiles": round(
            sps("shardio_loader_decode") / sps("smallfiles_decode"), 3),
        "raw_shardio_loader_vs_shardio": round(sps("shardio_loader_raw") / sps("shardio_raw"), 3),
        "decode_shardio_loader_vs_shardio": round(
            sps("shardio_loader_decode") / sps("shardio_decode"), 3),
        "raw_shardio_loader_vs_smallfiles_persistent_workers": (
            round(steady["shardio_loader"] / steady["smallfiles"], 3)
            if {"shardio_loader", "smallfiles"} <= set(steady) else None),
        "shardio_loader_rss_growth_pct": max((g["rss_growth_pct"] for g in loader_growth),
                                             default=None),
        "shardio_loader_pss_growth_pct": max((g["pss_growth_pct"] for g in loader_growth),
                                             default=None),
    }
    for peer in MEASURED_PEERS:
        if f"{peer}_raw" in lines:
            ratios.update({f"{m}_{who}_vs_{peer}": round(sps(f"{who}_{m}") / sps(f"{peer}_{m}"), 3)
                           for m in MODES for who in ("shardio", "shardio_loader")})
    return {
        "bench": "read", "kind": "summary", **cfg,
        "webdataset_setup": {m: wds_best[m] for m in MODES},
        "samples_per_s": {name: ln["samples_per_s"] for name, ln in lines.items()},
        "median_samples_per_s": {name: ln["median_samples_per_s"] for name, ln in lines.items()},
        "mb_per_s": {name: ln["mb_per_s"] for name, ln in lines.items()},
        "peak_pss_mb": {name: ln["peak_pss_mb"] for name, ln in lines.items()},
        "min_cpu_us_per_sample": {name: ln["min_cpu_us_per_sample"]
                                  for name, ln in lines.items()},
        "cpu_ratios": {
            "raw_smallfiles_vs_shardio": cpu_ratio("smallfiles_raw", "shardio_raw"),
            "raw_webdataset_vs_shardio": cpu_ratio(f"{wds_best['raw']}_raw", "shardio_raw"),
            "decode_webdataset_vs_shardio":
                cpu_ratio(f"{wds_best['decode']}_decode", "shardio_decode"),
            "raw_smallfiles_vs_shardio_loader": cpu_ratio("smallfiles_raw", "shardio_loader_raw"),
            "raw_webdataset_vs_shardio_loader":
                cpu_ratio(f"{wds_best['raw']}_raw", "shardio_loader_raw"),
            "decode_webdataset_vs_shardio_loader":
                cpu_ratio(f"{wds_best['decode']}_decode", "shardio_loader_decode"),
        },
        "max_load_1min": max(ln["max_load_1min"] for ln in lines.values()),
        "growth": {f"{g['contender']}_persistent_{g['persistent_workers']}".lower():
                   {k: g[k] for k in ("rss_growth_pct", "pss_growth_pct", "rss_trend_pct",
                                      "pss_trend_pct")}
                   for g in growth},
        "ratios": ratios,
        # Contenders whose payload differs from the small-files loader's: they repeated or
        # dropped samples within the epoch (each run delivers the right count: checked).
        "payload_mismatch": sorted(name for name, ln in lines.items()
                                   if ln["payload_bytes"] != lines[f"smallfiles_{ln['mode']}"][
                                       "payload_bytes"]),
        "targets": {
            "raw_shardio_ge_2x_smallfiles": raw_vs_files >= TARGETS["raw_vs_smallfiles"],
            "raw_shardio_ge_4x_webdataset": raw_vs_wds >= TARGETS["raw_vs_webdataset"],
            "decode_shardio_ge_1_1x_webdataset": decode_vs_wds >= TARGETS["decode_vs_webdataset"],
            "shardio_rss_growth_lt_5pct":
                rss_growth is not None and rss_growth < TARGETS["rss_growth_pct"],
            "raw_shardio_loader_ge_2x_smallfiles":
                loader_raw_vs_files >= TARGETS["raw_vs_smallfiles"],
            "raw_shardio_loader_ge_4x_webdataset":
                loader_raw_vs_wds >= TARGETS["raw_vs_webdataset"],
        },
        "notes": ("cpu_ratios: loader CPU per sample (main + workers, lowest run), other/shardio, "
                  "a load-independent cross-check when the machine is shared (max_load_1min); "
                  "ratios of best-run samples/s (one epoch, worker start and shutdown included, "
                  "persistent_workers=False); webdataset ratios use the faster webdataset setup "
                  "per mode (webdataset_setup); growth = tree RSS after the last epoch vs after "
                  "epoch 1, worst of shardio with persistent_workers False and True; "
                  "raw_shardio_vs_smallfiles_persistent_workers compares the growth runs' median "
                  "epoch after the first (no worker start-up); shardio = DataLoader over "
                  "ShardDataset, shardio_loader = ShardLoader (closed after each epoch when not "
                  "persistent, so its worker start and stop are timed like the DataLoader's)."),
    }


def print_table(lines: Sequence[dict[str, Any]], growth: Sequence[dict[str, Any]],
                summary: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\nread benchmark: {summary['files']} files, {summary['payload_mb']} MB in "
          f"{summary['num_shards']} shards, batch {BATCH}, {WORKERS} workers, best of "
          f"{summary['repeat']} (median in brackets), {summary['cpus']} CPUs", file=err)
    print(f"{'contender':<22} {'samples/s':>18} {'MB/s':>16} {'best s':>8} {'1st batch':>9} "
          f"{'PSS MB':>7} {'cpu us/smp':>10}", file=err)
    for ln in lines:
        print(f"{ln['contender'] + '_' + ln['mode']:<22} {ln['samples_per_s']:>9.0f} "
              f"({ln['median_samples_per_s']:>6.0f}) {ln['mb_per_s']:>7.1f} "
              f"({ln['median_mb_per_s']:>6.1f}) {ln['seconds']:>8.3f} "
              f"{ln['first_batch_seconds']:>9.3f} {ln['peak_pss_mb']:>7.1f} "
              f"{ln['min_cpu_us_per_sample']:>10.1f}", file=err)
    for g in growth:
        print(f"growth {g['contender']:<14} persistent={g['persistent_workers']!s:<5} "
              f"{g['epochs']} epochs, {g['processes'][-1]} procs: tree RSS "
              f"{g['tree_rss_mb'][0]} -> {g['tree_rss_mb'][-1]} MB ({g['rss_growth_pct']:+.2f}%, "
              f"trend {g['rss_trend_pct']:+.2f}%), PSS {g['tree_pss_mb'][0]} -> "
              f"{g['tree_pss_mb'][-1]} MB ({g['pss_growth_pct']:+.2f}%); "
              f"{g['median_samples_per_s_after_epoch1']:.0f} "
              f"samples/s after epoch 1", file=err)
    print("webdataset setup used: " + ", ".join(f"{m}={k}"
                                                for m, k in summary["webdataset_setup"].items()),
          file=err)
    print("ratios: " + ", ".join(f"{k}={v}" for k, v in summary["ratios"].items()), file=err)
    print("cpu ratios (other/shardio CPU per sample): "
          + ", ".join(f"{k}={v}" for k, v in summary["cpu_ratios"].items())
          + f"; max 1-min load during runs {summary['max_load_1min']}", file=err)
    if summary["payload_mismatch"]:
        print("delivered other bytes than the small-files loader (samples repeated or dropped): "
              + ", ".join(summary["payload_mismatch"]), file=err)
    print("targets: " + ", ".join(f"{k}={'PASS' if v else 'MISS'}"
                                  for k, v in summary["targets"].items()), file=err)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=None, help="files to generate (default 20000)")
    p.add_argument("--classes", type=int, default=None, help="class folders (default 100)")
    p.add_argument("--repeat", type=int, default=None, help="runs per contender (default 3)")
    p.add_argument("--growth-epochs", type=int, default=None,
                   help="epochs of the memory growth check (default 10; 0 skips it)")
    p.add_argument("--shard-size", default=None, help="pack shard size (default 64MB)")
    p.add_argument("--sample-interval", type=float, default=0.1,
                   help="seconds between memory samples (default 0.1)")
    add_output_args(p, f"smoke configuration: {QUICK['files']} files, repeat {QUICK['repeat']}, "
                        f"{QUICK['growth_epochs']} growth epochs, {QUICK['shard_size']} shards")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--peer-convert", nargs=3, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.child:
        return child(json.loads(a.child))
    if a.peer_convert:
        kind, src, out = a.peer_convert
        PEER_CONVERT[kind](src, out)
        return 0
    base = QUICK if a.quick else DEFAULTS
    n_files = a.files if a.files is not None else base["files"]
    n_classes = a.classes if a.classes is not None else base["classes"]
    repeat = a.repeat if a.repeat is not None else base["repeat"]
    growth_epochs = a.growth_epochs if a.growth_epochs is not None else base["growth_epochs"]
    shard_size = a.shard_size or base["shard_size"]
    check_sizes(p, n_files, n_classes, shard_size)
    if repeat < 1:
        p.error(f"--repeat {repeat}: at least 1 needed")
    if growth_epochs < 0:
        p.error(f"--growth-epochs {growth_epochs}: give 0 (no growth check) or more")
    check_seconds(p, "--sample-interval", a.sample_interval, positive=True)
    check_output_args(p, a)
    return run_in_workdir("shardio-bench-read-", a.workdir, a.keep,
                          lambda work: _bench(work, n_files, n_classes, repeat, growth_epochs,
                                              shard_size, a.sample_interval, a.json_out))


def _bench(work: str, n_files: int, n_classes: int, repeat: int, growth_epochs: int,
           shard_size: str, interval: float, json_out: str | None) -> int:
    try:
        data = prepare(work, n_files, n_classes, shard_size, min_shards=MIN_SHARDS)
    except TooFewShards as exc:
        print(f"bench_read: {exc}", file=sys.stderr)
        return 2
    base_spec = {k: data[k] for k in ("src", "shards", "tars", "files")}
    base_spec.update(sample_interval=interval, persistent=False, epochs=1, end_memory=False)
    kinds = list(KINDS)
    for kind in MEASURED_PEERS:
        if data.get(kind):
            kinds.append(kind)
            base_spec[kind] = data[kind]

    contenders = [Contender(k, m) for m in MODES for k in kinds]
    for rnd in range(repeat):
        k = rnd % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            peer = {"python": data["peers_python"]} if c.kind in MEASURED_PEERS else {}
            c.runs.append(_run_child({**base_spec, "kind": c.kind, "mode": c.mode, **peer}))
            ep = c.runs[-1]["epochs"][0]
            print(f"  round {rnd + 1}/{repeat} {c.name}: {ep['seconds']:.3f}s "
                  f"({ep['samples'] / ep['seconds']:.0f} samples/s, {_cpu_us(ep):.1f} us "
                  f"CPU/sample, load {ep['load_1min']:.1f})", file=sys.stderr)

    growth = []
    if growth_epochs:
        for kind, persistent in GROWTH:
            r = _run_child({**base_spec, "kind": kind, "mode": "raw", "persistent": persistent,
                            "epochs": growth_epochs, "end_memory": True})
            growth.append(growth_line(kind, persistent, r))
            g = growth[-1]
            print(f"  growth {kind} persistent={persistent}: RSS {g['rss_growth_pct']:+.2f}%, "
                  f"PSS {g['pss_growth_pct']:+.2f}%", file=sys.stderr)

    import shardio

    cfg = {
        "files": data["files"], "payload_bytes": data["payload_bytes"],
        "payload_mb": _mb(data["payload_bytes"]), "classes": n_classes,
        "num_shards": data["num_shards"], "shard_size": shard_size, "repeat": repeat,
        "growth_epochs": growth_epochs, "batch_size": BATCH, "num_workers": WORKERS,
        "persistent_workers": False, "sample_interval": interval, "cpus": os.cpu_count(),
        "python": platform.python_version(), "shardio": shardio.__version__,
        "torch": _dist_version("torch"), "webdataset": _dist_version("webdataset"),
        "pillow": _dist_version("pillow"),
        "peers_python": data["peers_python"], "peers": data["peers"],
    }
    lines = [contender_line(c, data) for c in contenders]
    summary = summary_line({f"{ln['contender']}_{ln['mode']}": ln for ln in lines}, growth, cfg)
    emit([*lines, *growth], summary, json_out)
    print_table(lines, growth, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
