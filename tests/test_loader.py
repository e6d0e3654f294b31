"""``ShardLoader`` end to end with real components: datasets packed by ``shardio.pack``, forked
worker processes, rings in real shared memory, real signals (SIGKILL of a worker and of the
training process).

Checked against DESIGN.md §3 "Order and partitioning" and "Concurrency" and the protocol in
``shardio/pool.py``: batches in exactly the order ``shardio.order`` defines (world 1 and explicit
topologies), zero-copy batches that are never overwritten while the user holds them (copy-out
or spill when the ring would fill, never a hang), dead workers restarted with every sample still
delivered exactly once or a typed error, no shared memory left behind even after SIGKILL, exact
resume from ``state_dict`` with another worker count and batch size, sizing errors that name the
option to change, and the data-wait statistics.

Every test has a deadline (pytest-timeout dumps every thread's stack when it hits it), and an
autouse fixture checks that no ``shardio-`` file is left in ``/dev/shm`` and no worker process is
left alive after each test.
"""

from __future__ import annotations

import collections
import gc
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch

import shardio
import shardio.pool
from shardio import LoaderOptions, ShardDataset, ShardLoader, Topology
from shardio.errors import (
    ShmSpaceError,
    UsageError,
    WorkerCrashedError,
    WorkerError,
)
from shardio.stats import LoaderStats
from tests.test_dataset import (
    check_epoch_cover,
    epoch_keys,
    expected_rank_batches,
    flat,
    pack_text,
)

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parent.parent
SHM = Path("/dev/shm")
N_TEXT = 61  # samples of the `text` dataset (13 shards of <= 5): 61 is prime, remainders on purpose
IMG_H, IMG_W = 24, 32
N_IMG = 48  # samples of the `images` dataset: 3 classes x 16 PNGs of IMG_H x IMG_W
FAST = {"poll_interval": 0.05}  # notice dead workers quickly in tests

# Creator pids of rings this module may leave in /dev/shm: this process and the training-loop
# subprocesses it starts.  Rings of unrelated processes (other test sessions) are not ours.
OUR_RING_CREATORS: set[int] = {os.getpid()}
_RING_NAME = re.compile(r"shardio-(\d+)-[0-9a-f]{16}")


# --- helpers ---------------------------------------------------------------------------------
def our_rings() -> set[str]:
    out = set()
    for name in os.listdir(SHM):
        m = _RING_NAME.fullmatch(name)
        if m is not None and int(m.group(1)) in OUR_RING_CREATORS:
            out.add(name)
    return out


def live_children() -> list[psutil.Process]:
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Pids still alive (not zombies) after waiting up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.fixture(autouse=True)
def _no_leftovers() -> Iterator[None]:
    """No ring file in /dev/shm and no live worker process survives a test."""
    before_rings = our_rings()
    before_procs = {p.pid for p in live_children()}
    yield
    gc.collect()
    assert our_rings() - before_rings == set(), "shared memory left behind in /dev/shm"
    leaked = [p.pid for p in live_children() if p.pid not in before_procs]
    assert wait_gone(leaked, 5.0) == [], "worker processes left alive"


@pytest.fixture
def make_loader() -> Iterator[Callable[..., ShardLoader]]:
    """Build loaders that are closed at teardown even when the test fails."""
    made: list[ShardLoader] = []

    def make(ds: ShardDataset, batch_size: int, **kwargs: Any) -> ShardLoader:
        kwargs.setdefault("num_workers", 2)
        loader = ShardLoader(ds, batch_size, **kwargs)
        made.append(loader)
        return loader

    yield make
    for loader in made:
        loader.close()


def new_workers(before: set[int]) -> list[int]:
    return sorted(p.pid for p in live_children() if p.pid not in before)


def keys_collate(samples: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in samples]


def key_batches(loader: ShardLoader) -> list[list[str]]:
    return [list(b) for b in loader]


def copy_warnings(caught: list[warnings.WarningMessage]) -> int:
    """How many of ``caught`` are the loader's copy-out RuntimeWarning."""
    return sum(issubclass(w.category, RuntimeWarning) and "copies batches out" in str(w.message)
               for w in caught)


def shm_mapping_of(ptr: int) -> str | None:
    """Path of the file mapping (``/proc/self/maps``) that holds address ``ptr``, if any."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= ptr < hi:
                return parts[5].strip() if len(parts) == 6 else ""
    return None


def write_pngs(src: Path) -> dict[str, np.ndarray]:
    from PIL import Image

    pixels = {}
    for i in range(N_IMG):
        d = src / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        img = np.random.default_rng(i).integers(0, 256, (IMG_H, IMG_W, 3), dtype=np.uint8)
        Image.fromarray(img).save(d / f"i{i:04d}.png")
        pixels[f"c{i % 3}/i{i:04d}"] = img
    return pixels


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """61 samples (txt + cls, raw) in 13 shards."""
    return pack_text(tmp_path_factory.mktemp("text"), N_TEXT, 5)


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray],
                                                                dict[str, int]]:
    """48 PNGs of one size (png + cls) in 8 shards, with the source pixels and labels by key."""
    base = tmp_path_factory.mktemp("images")
    pixels = write_pngs(base / "src")
    shardio.pack(base / "src", base / "ds", samples_per_shard=6, label_from_dir=True,
                 fsync=False, progress=False)
    with shardio.open_dataset(base / "ds") as reader:
        labels = {s["__key__"]: int(bytes(s["cls"])) for s in reader}
    return base / "ds", pixels, labels


def check_image_batch(batch: dict[str, Any], keys: list[str], pixels: dict[str, np.ndarray],
                      labels: dict[str, int]) -> None:
    assert batch["__key__"] == keys
    png, cls = batch["png"], batch["cls"]
    assert isinstance(png, torch.Tensor) and png.dtype == torch.uint8
    assert tuple(png.shape) == (len(keys), IMG_H, IMG_W, 3)
    assert isinstance(cls, torch.Tensor) and cls.dtype == torch.int64
    assert cls.tolist() == [labels[k] for k in keys]
    for i, k in enumerate(keys):
        assert np.array_equal(png[i].numpy(), pixels[k]), f"pixels of {k} changed"


# Transforms and collates live at module level: workers are forked, but tracebacks and pickled
# exceptions should name real, importable functions.
def add_worker_pid(sample: dict[str, Any]) -> dict[str, Any]:
    return {**sample, "pid": os.getpid()}


def slow_transform(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.01)
    return sample


def tenth_of_a_second(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.1)
    return sample


def very_slow_transform(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.03)
    return sample


def explode_on_sample(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"].endswith("7"):
        raise ZeroDivisionError(f"cannot transform {sample['__key__']}")
    return sample


class NeedsTwoArgs(Exception):
    """Pickles fine, but unpickling calls ``NeedsTwoArgs(msg)`` and fails."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key, self.reason = key, reason


def raise_unpicklable(sample: dict[str, Any]) -> dict[str, Any]:
    raise NeedsTwoArgs(sample["__key__"], "bad sample")


def die_every_time(sample: dict[str, Any]) -> dict[str, Any]:
    os._exit(7)


def big_payload(sample: dict[str, Any]) -> dict[str, Any]:
    """256 KiB per sample, derived from the key, so that leaks and overwrites would show."""
    seed = int(sample["__key__"][-4:])
    return {"__key__": sample["__key__"], "x": np.full(1 << 16, seed, dtype=np.float32)}


# --- 1. order, sizes, epochs, decode, collate, transform -------------------------------------
@pytest.mark.parametrize(("batch", "shuffle"), [(4, True), (7, True), (5, False)])
def test_world1_order_is_the_contract(text: Path, make_loader: Callable[..., ShardLoader],
                                      batch: int, shuffle: bool) -> None:
    ds = ShardDataset(text, seed=11, shuffle=shuffle)
    loader = make_loader(ds, batch, collate_fn=keys_collate)
    order = epoch_keys(text, seed=11, shuffle=shuffle)
    expected = expected_rank_batches(order, 0, 1, 0, batch, "pad")
    got = key_batches(loader)
    assert got == expected
    assert len(loader) == len(expected) == -(-N_TEXT // batch)
    assert sorted(flat(got)) == sorted(order)  # every sample exactly once


def test_handouts_are_forgotten_once_released(text: Path,
                                              make_loader: Callable[..., ShardLoader]) -> None:
    """Every batch handed out from a ring was listed (for moving kept batches out of a full
    ring) and only a full ring pruned the list: a loop that drops its batches kept ~1 KB per
    step for good (1.7 million steps of a two-day job: ~2 GB).  The list now stays short, and
    batches the loop keeps stay intact."""
    loader = make_loader(ShardDataset(text, seed=1), 2)  # 31 batches an epoch, default collate
    kept = []
    for epoch in range(12):
        loader.set_epoch(epoch)
        for i, batch in enumerate(loader):
            if epoch == 0 and i < 3:
                kept.append((batch, [bytes(t) for t in batch["txt"]]))
            del batch
        assert len(loader._leased) <= 64 + len(kept), (epoch, len(loader._leased))
    assert loader._handouts == 12 * 31
    assert [[bytes(t) for t in b["txt"]] for b, _t in kept] == [t for _b, t in kept]


KeyBatch = collections.namedtuple("KeyBatch", "keys n")


def key_batch(samples: list[dict[str, Any]]) -> KeyBatch:
    return KeyBatch([s["__key__"] for s in samples], torch.tensor(len(samples)))


@pytest.mark.parametrize("workers", [0, 2])
def test_pin_memory_keeps_the_batch_type(text: Path, make_loader: Callable[..., ShardLoader],
                                         monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    """pin_memory=True turned a named tuple batch into a plain tuple (``batch.keys`` raised
    AttributeError).  No GPU here: CUDA is faked, pinning is a copy."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pinned: list[torch.Tensor] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *a, **k: pinned.append(self.clone()) or pinned[-1])
    loader = make_loader(ShardDataset(text, seed=1), 8, num_workers=workers,
                         collate_fn=key_batch, pin_memory=True)
    batches = list(loader)
    assert all(type(b) is KeyBatch for b in batches) and sum(len(b.keys) for b in batches) == 61
    assert [int(b.n) for b in batches] == [len(b.keys) for b in batches]
    assert len(pinned) == len(batches)


def test_workers_close_their_control_socket(text: Path) -> None:
    """A worker left its end of the control socket to the process's exit: a ResourceWarning
    ("unclosed <socket.socket ...>") per worker per epoch where warnings show (pytest, -X dev)."""
    script = ("import sys, shardio\n"
              "ds = shardio.ShardDataset(sys.argv[1])\n"
              "for epoch in range(2):\n"
              "    with shardio.ShardLoader(ds, 4, num_workers=2) as loader:\n"
              "        n = sum(1 for _ in loader)\n"
              "print(n)\n")
    proc = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c", script,
                           str(text)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "16", proc.stderr
    assert "ResourceWarning" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_explicit_topology_ranks(text: Path, make_loader: Callable[..., ShardLoader],
                                 remainder: str) -> None:
    world, batch = 3, 4
    order = epoch_keys(text, seed=5)
    delivered: list[str] = []
    lengths = set()
    for rank in range(world):
        ds = ShardDataset(text, seed=5, remainder=remainder,
                          topology=Topology(rank=rank, world_size=world))
        loader = make_loader(ds, batch, collate_fn=keys_collate)
        got = key_batches(loader)
        assert got == expected_rank_batches(order, 0, world, rank, batch, remainder)
        assert len(loader) == len(got)
        lengths.add(len(got))
        delivered += flat(got)
        loader.close()
    assert len(lengths) == 1, "ranks got different numbers of batches"
    check_epoch_cover(delivered, order, world, remainder)


@pytest.mark.parametrize("world", [1, 2])
def test_drop_last(text: Path, make_loader: Callable[..., ShardLoader], world: int) -> None:
    batch = 4
    order = epoch_keys(text, seed=2)
    for rank in range(world):
        ds = ShardDataset(text, seed=2, topology=Topology(rank=rank, world_size=world))
        loader = make_loader(ds, batch, collate_fn=keys_collate, drop_last=True)
        full = expected_rank_batches(order, 0, world, rank, batch, "pad")
        per_rank = -(-N_TEXT // world)
        assert len(loader) == per_rank // batch < len(full)
        got = key_batches(loader)
        assert got == full[: per_rank // batch]
        assert all(len(b) == batch for b in got)
        loader.close()


def test_epochs_with_persistent_workers(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    ds = ShardDataset(text, seed=9)
    before = {p.pid for p in live_children()}
    loader = make_loader(ds, 6, collate_fn=keys_collate)
    orders = []
    workers = None
    for epoch in range(3):
        loader.set_epoch(epoch)
        got = key_batches(loader)
        assert got == expected_rank_batches(epoch_keys(text, seed=9, epoch=epoch), 0, 1, 0, 6,
                                            "pad")
        orders.append(flat(got))
        now = new_workers(before)
        assert len(now) == 2
        if workers is not None:
            assert now == workers, "workers were not kept across epochs"
        workers = now
    assert orders[0] != orders[1] != orders[2], "set_epoch did not change the order"
    # Without set_epoch the same epoch repeats.
    assert flat(key_batches(loader)) == orders[2]
    assert loader.stats()["restarts"] == 0


def test_decode_default_collate_stacks_images(images: tuple[Path, dict[str, np.ndarray],
                                                            dict[str, int]],
                                              make_loader: Callable[..., ShardLoader]) -> None:
    root, pixels, labels = images
    ds = ShardDataset(root, seed=4, decode=True)
    loader = make_loader(ds, 5)
    expected = expected_rank_batches(epoch_keys(root, seed=4), 0, 1, 0, 5, "pad")
    got = list(loader)
    assert len(got) == len(expected) == len(loader)
    for batch, keys in zip(got, expected):
        assert set(batch) == {"__key__", "png", "cls"}
        check_image_batch(batch, keys, pixels, labels)


def rich_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [s["__key__"] for s in samples]
    ids = np.array([int(k[-4:]) for k in keys], dtype=np.int32)
    return {
        "keys": keys,
        "raw": [bytes(s["txt"]) for s in samples],
        "ids": ids,
        "table": np.stack([ids, ids * 2]).T.copy(),
        "weights": torch.arange(len(samples), dtype=torch.float32) / 2,
        "nested": [("first", keys[0]), {"count": len(samples), "none": None}],
        "label": "batch",
    }


def test_custom_collate_any_tree(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    ds = ShardDataset(text, seed=1)
    loader = make_loader(ds, 4, collate_fn=rich_collate)
    expected = expected_rank_batches(epoch_keys(text, seed=1), 0, 1, 0, 4, "pad")
    with shardio.open_dataset(text) as reader:
        txt = {s["__key__"]: bytes(s["txt"]) for s in reader}
    got = list(loader)
    assert len(got) == len(expected)
    for batch, keys in zip(got, expected):
        ids = [int(k[-4:]) for k in keys]
        assert batch["keys"] == keys
        assert batch["raw"] == [txt[k] for k in keys]
        assert all(isinstance(r, bytes) for r in batch["raw"])
        assert isinstance(batch["ids"], np.ndarray) and batch["ids"].dtype == np.int32
        assert batch["ids"].tolist() == ids
        assert batch["table"].tolist() == [[i, 2 * i] for i in ids]
        assert isinstance(batch["weights"], torch.Tensor)
        assert batch["weights"].dtype == torch.float32
        assert batch["weights"].tolist() == [i / 2 for i in range(len(keys))]
        assert batch["nested"] == [("first", keys[0]), {"count": len(keys), "none": None}]
        assert batch["label"] == "batch"


def test_transform_runs_in_workers(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    ds = ShardDataset(text, seed=3, transform=add_worker_pid)
    before = {p.pid for p in live_children()}
    loader = make_loader(ds, 8)
    pids: set[int] = set()
    keys: list[str] = []
    for batch in loader:
        assert batch["pid"].dtype == torch.int64  # default collate: ints become int64 tensors
        pids |= set(batch["pid"].tolist())
        keys += batch["__key__"]
    workers = set(new_workers(before))
    assert os.getpid() not in pids
    assert pids == workers and len(workers) == 2
    assert keys == epoch_keys(text, seed=3)


# --- 2. zero-copy and batch lifetime ---------------------------------------------------------
def test_batches_view_the_shared_ring(images: tuple[Path, dict[str, np.ndarray], dict[str, int]],
                                      make_loader: Callable[..., ShardLoader]) -> None:
    root, pixels, labels = images
    loader = make_loader(ShardDataset(root, seed=0, decode=True), 4)
    expected = expected_rank_batches(epoch_keys(root, seed=0), 0, 1, 0, 4, "pad")
    for batch, keys in zip(loader, expected):
        for t in (batch["png"], batch["cls"]):
            where = shm_mapping_of(t.data_ptr())
            assert where is not None and "/dev/shm/shardio-" in where, where
            assert "(deleted)" in where  # unlinked at creation: nothing to leave behind
        check_image_batch(batch, keys, pixels, labels)
    assert loader.stats()["copied_out"] == 0


def test_kept_batches_are_never_overwritten(images: tuple[Path, dict[str, np.ndarray],
                                                          dict[str, int]],
                                            make_loader: Callable[..., ShardLoader]) -> None:
    """Keeping every batch of an epoch with rings that hold ~3 batches: the loader must move
    the kept batches out of a ring when its worker waits for space (Ring.detach: private pages
    at the same addresses; a detach of a ring's current mapping maps the ring afresh), and copy
    later ones out on arrival once the loop holds most of a ring (one warning, and the mappings
    stay few), instead of deadlocking or reusing memory the kept batches still view."""
    from shardio.loader import _MAX_DETACH_EVENTS

    root, pixels, labels = images
    loader = make_loader(ShardDataset(root, seed=6, decode=True), 4, ring_bytes="40KiB", **FAST)
    expected = expected_rank_batches(epoch_keys(root, seed=6), 0, 1, 0, 4, "pad")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = list(loader)
    assert copy_warnings(caught) == 1, [str(w.message) for w in caught]
    assert "ring_bytes" in str(caught[0].message)
    assert len(kept) == len(expected) == 12
    assert loader.stats()["detached"] > 0
    assert loader.stats()["copied_out"] > 0 and loader.stats()["spilled"] == 0
    assert "/dev/shm/shardio-" not in (shm_mapping_of(kept[0]["png"].data_ptr()) or ""), \
        "the first batch should have left the ring"
    with open("/proc/self/maps", encoding="utf-8") as f:
        ring_lines = sum("/dev/shm/shardio-" in line for line in f)
    assert ring_lines < 3 * 2 * (_MAX_DETACH_EVENTS + 3), ring_lines
    for batch, keys in zip(kept, expected):
        check_image_batch(batch, keys, pixels, labels)
    # Once the batches are dropped, the ring is reused: the next epoch is zero-copy again.
    copied = loader.stats()["copied_out"]
    del kept, batch, caught
    for batch, keys in zip(loader, expected):
        assert "/dev/shm/shardio-" in (shm_mapping_of(batch["png"].data_ptr()) or "")
        check_image_batch(batch, keys, pixels, labels)
    assert loader.stats()["copied_out"] == copied


def test_one_batch_kept_forever_pins_nothing(images: tuple[Path, dict[str, np.ndarray],
                                                           dict[str, int]],
                                             make_loader: Callable[..., ShardLoader]) -> None:
    """A single kept batch would block its ring's space from being reused in order (the ring
    frees space in stream order), and every later batch of that worker would crawl through its
    pipe.  The loader moves it out of the ring once (Ring.detach): several epochs, nothing
    copied out or spilled, no warning, and the kept batch intact."""
    root, pixels, labels = images
    # A 48 KiB ring holds ~4 batches; the loop holds at most 2 of them (the kept one and the
    # current one), under max_held_fraction: only the pin check moves the kept one out.
    loader = make_loader(ShardDataset(root, seed=8, decode=True), 4, ring_bytes="48KiB", **FAST)
    first = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            loader.set_epoch(epoch)
            expected = expected_rank_batches(epoch_keys(root, seed=8, epoch=epoch), 0, 1, 0, 4,
                                             "pad")
            n = 0
            for batch, keys in zip(loader, expected):
                check_image_batch(batch, keys, pixels, labels)
                if first is None:
                    first = (batch, keys)
                n += 1
            assert n == len(expected)
            assert first is not None
            check_image_batch(first[0], first[1], pixels, labels)
    assert copy_warnings(caught) == 0
    assert loader.stats()["copied_out"] == 0 and loader.stats()["detached"] == 1
    assert loader.stats()["spilled"] == 0
    assert "/dev/shm/shardio-" not in (shm_mapping_of(first[0]["png"].data_ptr()) or "")


def test_holding_the_previous_batch_a_step_longer_moves_nothing(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    """``p, prev = prev, batch`` (a loss logged a step late, a double-buffered copy) holds
    batch n-1 while the loop asks for n+1.  While its ring has room that is no reason to move
    it: nothing is detached, copied out or spilled, and every held batch stays intact.  (The
    loader used to move every such batch, at the top of each step.)"""
    loader = make_loader(ShardDataset(text, seed=3, transform=big_payload), 4, **FAST)
    for epoch in range(2):
        loader.set_epoch(epoch)
        prev = p = None
        n = 0
        for batch in loader:
            p, prev = prev, batch
            for b in (p, prev):
                if b is not None:
                    assert all(b["x"][i, 0].item() == int(k[-4:])
                               for i, k in enumerate(b["__key__"]))
            n += 1
        assert n == len(loader)
        del batch, p, prev
    stats = loader.stats()
    assert (stats["detached"], stats["copied_out"], stats["spilled"]) == (0, 0, 0), stats


def test_a_kept_batch_moves_out_when_the_batches_after_it_were_copied(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    """Every hand-out counts in the numbering that tells a kept batch from the one the loop works
    on, copied ones too.  One worker keeps its first batch for good; with max_held_fraction that
    low, every later batch is copied out of the ring on arrival, so the kept one is the last batch
    *handed out from the ring*.  It must still move out once the ring fills behind it: one move,
    nothing through the pipe.  (Numbering ring hand-outs only, the kept batch would pass for the
    current one and stop the ring: every later batch a pipe trip after a poll_interval.)"""
    loader = make_loader(ShardDataset(text, seed=4, transform=big_payload), 4, num_workers=1,
                         ring_bytes="5MiB", max_held_fraction=0.05, **FAST)
    first = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the copy-out notice
        n = 0
        for batch in loader:
            first = first or batch
            n += 1
    assert first is not None and n == len(loader) > 8
    assert all(first["x"][i].eq(int(k[-4:])).all() for i, k in enumerate(first["__key__"]))
    stats = loader.stats()
    assert stats["detached"] == 1 and stats["spilled"] == 0, stats
    assert 0 < stats["copied_out"] < n


def settled_uss() -> int:
    """This process's USS after a full collection and, under glibc, ``malloc_trim(0)``: freed
    heap that the allocator keeps would otherwise swing it by megabytes between calls."""
    import ctypes
    import ctypes.util

    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
        if trim is not None:
            trim(0)
    return int(psutil.Process().memory_full_info().uss)


def payload_and_label(sample: dict[str, Any]) -> dict[str, Any]:
    """256 KiB of payload and a small label per sample, both derived from the key."""
    seed = int(sample["__key__"][-4:])
    return {"x": np.full(1 << 16, seed, dtype=np.float32), "label": seed}


def test_a_loop_keeping_only_the_labels_keeps_only_the_labels(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    """The common metrics habit, ``labels.append(batch["label"])`` for every batch of every
    epoch: DataLoader keeps 8 bytes a sample, and so must ShardLoader.  Kept batches moved out
    of a ring keep only the pages of the fields still held (Ring.detach with spans), and
    batches copied out of a ring get a copy per field, so this process's own memory (USS) grows
    by far less than the 15 MB of payload an epoch (whole batches kept: 40 MB or more in 4 epochs,
    measured; 0.6 MB now); and
    every kept label stays right."""
    # Rings of less than 2 batches (1 MiB each): the worker has room for its next batch only
    # once the batch before the one the loop holds has left the ring.
    loader = make_loader(ShardDataset(text, seed=7, transform=payload_and_label), 4,
                         ring_bytes="1800KiB", **FAST)
    kept: list[tuple[torch.Tensor, list[int]]] = []
    before = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the copy-out notice
        for epoch in range(5):
            loader.set_epoch(epoch)
            for batch in loader:
                assert batch["x"].shape[1] == 1 << 16
                kept.append((batch["label"], batch["label"].tolist()))
            del batch
            if epoch == 0:
                before = settled_uss()
    assert before is not None
    grown = settled_uss() - before
    stats = loader.stats()
    assert stats["detached"] > 0 and stats["copied_out"] > 0
    # The batch before the one the loop holds moves out before the loop waits for the next:
    # otherwise its worker, short of room for that next one, waits until main gives up and
    # takes it through the pipe (a poll_interval each time).
    assert stats["spilled"] == 0
    assert grown < 8 << 20, f"USS grew by {grown >> 20} MiB keeping only the labels"
    for labels, expected in kept:
        assert labels.tolist() == expected


def test_kept_fields_of_many_batches_bound_the_ring_mappings(
        text: Path, make_loader: Callable[..., ShardLoader],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each move of a batch out of a ring's current mapping maps the ring afresh, and the old
    mapping lives while a kept field views it: a loop that keeps the labels of every batch for
    the whole run would pile up mappings (vm.max_map_count).  With _MAX_RETIRED_MAPPINGS of a
    ring's old mappings in use, its batches are copied out on arrival instead: at most one
    more old mapping, and every kept label stays right."""
    import shardio.loader

    monkeypatch.setattr(shardio.loader, "_MAX_RETIRED_MAPPINGS", 2)
    loader = make_loader(ShardDataset(text, seed=5, transform=payload_and_label), 4,
                         ring_bytes="1800KiB", **FAST)
    kept: list[tuple[torch.Tensor, list[int]]] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the copy-out notice
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                kept.append((batch["label"], batch["label"].tolist()))
    rings = [w.ring for w in loader._pool._workers]
    assert 0 < max(r.retired_mappings() for r in rings) <= 3
    assert loader.stats()["copied_out"] > 0 and loader.stats()["spilled"] == 0
    for labels, expected in kept:
        assert labels.tolist() == expected


def test_a_kept_batch_that_cannot_be_moved_only_slows_its_ring(
        images: tuple[Path, dict[str, np.ndarray], dict[str, int]],
        make_loader: Callable[..., ShardLoader], monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The kernel refuses the page swap (ENOMEM: vm.max_map_count): one warning, no more
    attempts, and the kept batch stops its ring as before Ring.detach existed: the worker's
    later batches take its pipe (copied out), every epoch is complete, the kept batch intact."""
    import errno

    import shardio.ring

    def refused(buf: Any, off: int, n: int) -> int:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(shardio.ring, "_privatize", refused)
    root, pixels, labels = images
    loader = make_loader(ShardDataset(root, seed=8, decode=True), 4, ring_bytes="48KiB", **FAST)
    first = None
    with caplog.at_level(logging.WARNING, logger="shardio.loader"):
        for epoch in range(3):
            loader.set_epoch(epoch)
            expected = expected_rank_batches(epoch_keys(root, seed=8, epoch=epoch), 0, 1, 0, 4,
                                             "pad")
            for batch, keys in zip(loader, expected, strict=True):
                check_image_batch(batch, keys, pixels, labels)
                first = first or (batch, keys)
    assert first is not None
    check_image_batch(first[0], first[1], pixels, labels)
    moves = [r for r in caplog.records if "cannot move kept batches" in r.getMessage()]
    assert len(moves) == 1 and "Cannot allocate memory" in moves[0].getMessage()
    assert loader.stats()["detached"] == 0 and loader.stats()["copied_out"] > 0


def test_break_while_holding_then_next_epoch(text: Path,
                                             make_loader: Callable[..., ShardLoader]) -> None:
    """Break out mid-epoch holding 5 batches (the older ones moved out of the rings) while the
    batches prefetched behind them fill the rings; the next epoch must start (workers blocked on
    a full ring abandon the old epoch) and be complete, and the kept batches stay intact."""
    ds = ShardDataset(text, seed=12, transform=big_payload)
    loader = make_loader(ds, 4, ring_bytes="3MiB", **FAST)
    kept = []
    for batch in loader:
        kept.append(batch)
        if len(kept) == 5:
            break
    # Each ring holds 2 batches: steps 0 and 2 move out when main waits for step 4, which their
    # worker cannot write until they do; the second worker never waits (main stops at 4).
    assert loader.stats()["detached"] == 2
    time.sleep(0.3)  # let the workers run into their full rings
    loader.set_epoch(1)
    expected = expected_rank_batches(epoch_keys(text, seed=12, epoch=1), 0, 1, 0, 4, "pad")
    got = []
    for batch in loader:
        got.append(batch["__key__"])
        assert all(batch["x"][i, 0].item() == int(k[-4:]) for i, k in enumerate(batch["__key__"]))
    assert got == expected
    for batch in kept:  # still intact
        assert all(batch["x"][i].eq(int(k[-4:])).all() for i, k in enumerate(batch["__key__"]))


def tree_rss() -> int:
    """RSS of this process and its live children.  (Not PSS: PSS divides shared library pages by
    however many processes on the machine map them, so it moves with unrelated processes.)"""
    total = 0
    for p in [psutil.Process(), *live_children()]:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


@pytest.mark.timeout(90)
def test_memory_flat_over_ten_epochs(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    ds = ShardDataset(text, seed=13, transform=big_payload)  # ~15 MiB of batches per epoch
    loader = make_loader(ds, 4, ring_bytes="6MiB")
    samples = []
    baseline = 0
    for epoch in range(10):
        loader.set_epoch(epoch)
        n = 0
        for batch in loader:
            n += len(batch["__key__"])
            assert batch["x"].shape == (len(batch["__key__"]), 1 << 16)
        del batch
        assert n == N_TEXT
        gc.collect()
        if epoch == 2:  # rings and caches warm
            baseline = tree_rss()
        elif epoch > 2:
            samples.append(tree_rss())
    assert loader.stats()["copied_out"] == 0, "released batches did not free their ring space"
    growth = max(samples) - baseline
    assert growth <= 0.04 * baseline, (
        f"process tree memory grew {growth / 2**20:.1f} MiB over {baseline / 2**20:.1f} MiB "
        f"across 7 epochs: {[round(s / 2**20, 1) for s in samples]}")


# --- 3. failures -----------------------------------------------------------------------------
def test_transform_error_is_worker_error_with_traceback(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    loader = make_loader(ShardDataset(text, seed=0, transform=explode_on_sample), 4, **FAST)
    with pytest.raises(WorkerError) as info:
        for _ in loader:
            pass
    err = info.value
    assert type(err) is WorkerError
    assert isinstance(err.__cause__, ZeroDivisionError)
    assert "cannot transform" in str(err.__cause__)
    assert "explode_on_sample" in str(err), "the worker traceback is missing"
    assert "Traceback" in str(err)
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 3.0


def test_exception_that_cannot_unpickle_still_arrives(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    loader = make_loader(ShardDataset(text, seed=0, transform=raise_unpicklable), 4, **FAST)
    with pytest.raises(WorkerError) as info:
        next(iter(loader))
    assert "NeedsTwoArgs" in str(info.value) and "bad sample" in str(info.value)
    assert "raise_unpicklable" in str(info.value)
    assert isinstance(info.value.__cause__, BaseException)


def raise_long_error(sample: dict[str, Any]) -> dict[str, Any]:
    raise KeyError("x" * 20000)


def test_error_larger_than_the_ring_still_arrives(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    loader = make_loader(ShardDataset(text, transform=raise_long_error), 2, ring_bytes="4KiB",
                         **FAST)
    with pytest.raises(WorkerError) as info:
        next(iter(loader))
    assert isinstance(info.value.__cause__, KeyError)
    assert "raise_long_error" in str(info.value)
    assert loader.stats()["restarts"] == 0


def test_sigkill_of_a_worker_mid_epoch(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    ds = ShardDataset(text, seed=21, transform=slow_transform)
    before = {p.pid for p in live_children()}
    loader = make_loader(ds, 4, **FAST)
    expected = expected_rank_batches(epoch_keys(text, seed=21), 0, 1, 0, 4, "pad")
    got = []
    killed = None
    for batch in loader:
        got.append(list(batch["__key__"]))
        if len(got) == 3:
            workers = new_workers(before)
            assert len(workers) == 2
            killed = workers[0]
            os.kill(killed, signal.SIGKILL)
    assert got == expected, "a batch was lost, repeated or reordered after the restart"
    assert Counter(flat(got)) == Counter(epoch_keys(text, seed=21))
    assert loader.stats()["restarts"] >= 1
    assert killed not in new_workers(before)
    # The pool is whole again: another epoch works.
    loader.set_epoch(1)
    assert flat(key_batches_of(loader)) == epoch_keys(text, seed=21, epoch=1)


def test_restarted_worker_does_not_undo_set_epoch(text: Path,
                                                  make_loader: Callable[..., ShardLoader]) -> None:
    """set_epoch() during an epoch applies to the next one, even when a worker is restarted (and
    so starts the running epoch again) after the call."""
    ds = ShardDataset(text, seed=23, transform=slow_transform)
    before = {p.pid for p in live_children()}
    loader = make_loader(ds, 4, **FAST)
    got = []
    for batch in loader:
        got.append(list(batch["__key__"]))
        if len(got) == 2:
            loader.set_epoch(1)
            os.kill(new_workers(before)[1], signal.SIGKILL)
    assert got == expected_rank_batches(epoch_keys(text, seed=23), 0, 1, 0, 4, "pad")
    assert loader.stats()["restarts"] >= 1
    assert ds.epoch == 1
    assert flat(key_batches_of(loader)) == epoch_keys(text, seed=23, epoch=1)


def key_batches_of(loader: ShardLoader) -> list[list[str]]:
    return [list(b["__key__"]) for b in loader]


def test_worker_stuck_inside_fork_is_replaced(text: Path, make_loader: Callable[..., ShardLoader],
                                             monkeypatch: pytest.MonkeyPatch,
                                             tmp_path: Path) -> None:
    """A worker that never reaches its own code (on CPython < 3.11.10 a forked child can stop for
    good on an interpreter lock another thread held at the fork, python/cpython#112275) is
    killed and replaced ``start_timeout`` after its fork; the epoch stays exactly once."""
    import shardio.pool

    real = shardio.pool._worker_main
    marker = tmp_path / "stuck"

    def first_one_stuck(*args: Any) -> None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            real(*args)
            return
        time.sleep(600)  # never reaches _worker_main, like a child stuck in PyOS_AfterFork_Child

    monkeypatch.setattr(shardio.pool, "_worker_main", first_one_stuck)
    before = {p.pid for p in live_children()}
    loader = make_loader(ShardDataset(text, seed=21), 4, start_timeout=1.0, **FAST)
    t0 = time.monotonic()
    got = key_batches_of(loader)
    assert got == expected_rank_batches(epoch_keys(text, seed=21), 0, 1, 0, 4, "pad")
    assert loader.stats()["restarts"] == 1
    assert 1.0 <= time.monotonic() - t0 < 30
    assert marker.exists()
    assert len(new_workers(before)) == 2  # the stuck one is gone, its replacement runs


def test_workers_that_keep_sticking_in_fork_are_a_typed_error(
        text: Path, make_loader: Callable[..., ShardLoader],
        monkeypatch: pytest.MonkeyPatch) -> None:
    import shardio.pool

    def always_stuck(*args: Any) -> None:
        time.sleep(600)

    monkeypatch.setattr(shardio.pool, "_worker_main", always_stuck)
    before = {p.pid for p in live_children()}
    loader = make_loader(ShardDataset(text), 4, start_timeout=0.3, max_restarts=1, **FAST)
    with pytest.raises(WorkerCrashedError) as info:
        next(iter(loader))
    assert "still inside fork" in str(info.value) and "112275" in str(info.value)
    loader.close()
    assert wait_gone(new_workers(before), 5.0) == [], "a stuck worker survived the pool"


def test_slow_worker_is_not_taken_for_stuck(text: Path,
                                            make_loader: Callable[..., ShardLoader]) -> None:
    """start_timeout concerns the fork only: a worker whose first batch takes longer than it
    (16 samples x 0.1 s) is not restarted.  The timeout leaves a loaded machine 1 s to get a
    forked worker to its first line."""
    loader = make_loader(ShardDataset(text, seed=3, batch_size=16, transform=tenth_of_a_second),
                         16, start_timeout=1.0, **FAST)
    t0 = time.monotonic()
    assert flat(key_batches_of(loader)) == epoch_keys(text, seed=3)
    assert time.monotonic() - t0 > 2.5  # 61 samples x 0.1 s over 2 workers
    assert loader.stats()["restarts"] == 0
    for bad in (0, -1.0):
        with pytest.raises(UsageError, match="start_timeout"):
            LoaderOptions(start_timeout=bad)


def report_then_die(marker: Path) -> Callable[..., Any]:
    """An ``_Output.await_ring`` for the pool's workers: the first worker process to call it
    (it creates ``marker``) sends its size report and exits before its ring arrives."""
    import shardio.pool

    real = shardio.pool._Output.await_ring

    def await_ring(self: Any, control: Any, nbytes: int) -> Any:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return real(self, control, nbytes)
        self.data.send_bytes(shardio.pool._SIZE_REPORT.pack(shardio.pool._SIZE_MAGIC, nbytes))
        os._exit(9)

    return await_ring


def test_worker_killed_while_it_waits_for_its_ring_is_replaced(
        text: Path, make_loader: Callable[..., ShardLoader], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """The first worker process sends its size report and dies before its ring arrives (see
    "Ring sizing" in shardio.pool): main sizes the rings from that report anyway, its
    replacement inherits the ring through fork and allocates its pages (the dead worker never
    did), and the epoch stays exactly once."""
    import shardio.pool
    import shardio.ring

    marker = tmp_path / "died"
    reserved = tmp_path / "reserved"
    real_reserve = shardio.ring._reserve

    def recorded_reserve(fd: int, size: int) -> None:
        with open(reserved, "a") as f:
            f.write(f"{os.getpid()}\n")
        real_reserve(fd, size)

    monkeypatch.setattr(shardio.pool._Output, "await_ring", report_then_die(marker))
    monkeypatch.setattr(shardio.ring, "_reserve", recorded_reserve)  # inherited by the workers
    loader = make_loader(ShardDataset(text, seed=5), 4, **FAST)
    got = key_batches_of(loader)
    assert got == expected_rank_batches(epoch_keys(text, seed=5), 0, 1, 0, 4, "pad")
    assert marker.exists() and loader.stats()["restarts"] == 1
    assert loader.ring_bytes == 8 << 20  # sized (the floor: small batches)
    assert {int(x) for x in reserved.read_text().split()} == set(loader._pool.pids())


def test_replacement_that_cannot_allocate_its_ring_is_a_typed_error(
        text: Path, make_loader: Callable[..., ShardLoader], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """As above, but /dev/shm has filled up by the time the replacement allocates the ring
    it inherited: ShmSpaceError (naming the options), the pool is gone, nothing is left, and
    the next epoch starts a fresh pool."""
    import errno

    import shardio.pool
    import shardio.ring

    marker = tmp_path / "died"
    real_reserve = shardio.ring._reserve
    real_restart = shardio.pool.WorkerPool._restart

    def full_after_restart(fd: int, size: int) -> None:
        if os.environ.get("SHARDIO_TEST_SHM_FULL"):  # forked after the death (see below)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_reserve(fd, size)

    def restart(self: Any, *args: Any, **kwargs: Any) -> None:
        os.environ["SHARDIO_TEST_SHM_FULL"] = "1"  # what the replacement will inherit
        real_restart(self, *args, **kwargs)

    monkeypatch.delenv("SHARDIO_TEST_SHM_FULL", raising=False)  # restored after the test
    monkeypatch.setattr(shardio.pool._Output, "await_ring", report_then_die(marker))
    monkeypatch.setattr(shardio.ring, "_reserve", full_after_restart)
    monkeypatch.setattr(shardio.pool.WorkerPool, "_restart", restart)
    loader = make_loader(ShardDataset(text, seed=5), 4, **FAST)
    before = {p.pid for p in live_children()}
    with pytest.raises(ShmSpaceError, match="lower ring_bytes/num_workers or pass shm_dir="):
        key_batches_of(loader)
    assert marker.exists() and loader._pool is None
    assert wait_gone(new_workers(before), 5.0) == []
    monkeypatch.undo()
    assert key_batches_of(loader) == expected_rank_batches(epoch_keys(text, seed=5), 0, 1, 0,
                                                           4, "pad")


def raise_shm_space(sample: dict[str, Any]) -> dict[str, Any]:
    """User code that raises the same exception type a ring allocation does, once, on the
    sample SHARDIO_TEST_FIRST names."""
    if sample["__key__"] == os.environ["SHARDIO_TEST_FIRST"]:
        try:
            os.close(os.open(os.environ["SHARDIO_TEST_MARKER"],
                             os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return sample
        raise ShmSpaceError("the user's own shared-memory cache is full")
    return sample


def test_shm_space_error_from_user_code_is_an_ordinary_worker_error(
        text: Path, make_loader: Callable[..., ShardLoader], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """Only the pool's own ring allocation closes the pool on ShmSpaceError (a message kind of
    its own): the same type raised by a transform is a WorkerError with the worker's traceback,
    the workers stay, and the next epoch on them is exactly once."""
    order = epoch_keys(text, seed=6)
    monkeypatch.setenv("SHARDIO_TEST_FIRST", order[-1])  # near the end: the rings exist
    monkeypatch.setenv("SHARDIO_TEST_MARKER", str(tmp_path / "raised"))
    loader = make_loader(ShardDataset(text, seed=6, transform=raise_shm_space), 4, **FAST)
    with pytest.raises(WorkerError, match="user's own shared-memory cache") as info:
        key_batches_of(loader)
    assert isinstance(info.value.__cause__, ShmSpaceError)
    assert "raise_shm_space" in str(info.value)  # the worker's traceback
    pids = loader._pool.pids()
    loader.set_epoch(1)
    got = key_batches_of(loader)
    assert got == expected_rank_batches(epoch_keys(text, seed=6, epoch=1), 0, 1, 0, 4, "pad")
    assert loader._pool.pids() == pids and loader.stats()["restarts"] == 0


def record_pid(sample: dict[str, Any]) -> dict[str, Any]:
    with open(os.environ["SHARDIO_TEST_PIDS"], "a") as f:
        f.write(f"{os.getpid()}\n")
    return sample


def test_rings_are_sized_from_a_whole_first_batch_made_in_a_worker(
        text: Path, make_loader: Callable[..., ShardLoader], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """ring_bytes="auto" takes the first batch's exact size (32 rows of 256 KiB plus the
    message header: room for prefetch_factor + 1 = 3 of them and one of slack is 33 MiB), and
    the user's
    transform and collate never run in the training process, not even to size the rings."""
    pids = tmp_path / "pids"
    monkeypatch.setenv("SHARDIO_TEST_PIDS", str(pids))
    loader = make_loader(ShardDataset(text, batch_size=32, transform=record_pid), 32,
                         collate_fn=huge_collate, **FAST)
    n = sum(1 for _ in loader)
    assert n > 0 and loader.stats()["copied_out"] == 0
    assert loader.ring_bytes == 33 << 20
    seen = {int(x) for x in pids.read_text().split()}
    assert os.getpid() not in seen and seen <= set(loader._pool.pids())


def fail_first_sample_once(sample: dict[str, Any]) -> dict[str, Any]:
    """Raise (late) on the epoch's first sample, named by SHARDIO_TEST_FIRST, the first time."""
    if sample["__key__"] != os.environ["SHARDIO_TEST_FIRST"]:
        return sample
    try:
        os.close(os.open(os.environ["SHARDIO_TEST_MARKER"],
                         os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return sample
    time.sleep(0.5)  # the other worker has its batch ready and waits for its ring by then
    raise ValueError("first sample")


def test_error_before_the_rings_exist_then_a_whole_epoch(
        text: Path, make_loader: Callable[..., ShardLoader], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """A worker raises on the epoch's first batch, before any ring exists: the error arrives
    through its pipe; the other worker, waiting for its ring with a batch ready, drops that
    batch when the next epoch's command comes instead, and that epoch is exactly once."""
    order = epoch_keys(text, seed=9)
    monkeypatch.setenv("SHARDIO_TEST_MARKER", str(tmp_path / "failed"))
    monkeypatch.setenv("SHARDIO_TEST_FIRST", order[0])
    loader = make_loader(ShardDataset(text, seed=9, transform=fail_first_sample_once), 4,
                         **FAST)
    with pytest.raises(WorkerError, match="first sample"):
        next(iter(loader))
    assert loader.ring_bytes == 0  # no ring yet
    got = key_batches_of(loader)
    assert got == expected_rank_batches(order, 0, 1, 0, 4, "pad")
    assert loader.stats()["restarts"] == 0


def test_ring_that_a_worker_cannot_reserve_is_a_typed_error(
        text: Path, make_loader: Callable[..., ShardLoader],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """/dev/shm fills up between main's space check and the worker's allocation of its ring's
    pages: ShmSpaceError (naming the options), the pool is gone, and the next epoch starts a
    fresh one."""
    import errno

    import shardio.ring

    def full(fd: int, size: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shardio.ring, "_reserve", full)  # inherited by the forked workers
    loader = make_loader(ShardDataset(text, seed=4), 4, **FAST)
    with pytest.raises(ShmSpaceError, match="lower ring_bytes/num_workers or pass shm_dir="):
        next(iter(loader))
    assert loader._pool is None
    monkeypatch.undo()
    assert key_batches_of(loader) == expected_rank_batches(epoch_keys(text, seed=4), 0, 1, 0,
                                                           4, "pad")


def test_worker_that_keeps_dying_is_a_typed_error(text: Path,
                                                  make_loader: Callable[..., ShardLoader]) -> None:
    before = {p.pid for p in live_children()}
    loader = make_loader(ShardDataset(text, transform=die_every_time), 4, max_restarts=2, **FAST)
    t0 = time.monotonic()
    with pytest.raises(WorkerCrashedError) as info:
        next(iter(loader))
    assert time.monotonic() - t0 < 20
    assert "max_restarts=2" in str(info.value)
    assert "exit code 7" in str(info.value)
    assert isinstance(info.value, RuntimeError)
    assert loader.stats()["restarts"] >= 3
    assert wait_gone(new_workers(before), 5.0) == [], "the broken pool was not shut down"


def test_close_mid_epoch_is_prompt(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    ds = ShardDataset(text, seed=0, transform=slow_transform)
    before = {p.pid for p in live_children()}
    loader = make_loader(ds, 4)
    for i, _batch in enumerate(loader):
        if i == 2:
            break
    workers = new_workers(before)
    assert len(workers) == 2
    t0 = time.monotonic()
    loader.close()
    assert time.monotonic() - t0 < 2.0, "close() waited for the epoch to finish"
    assert wait_gone(workers, 2.0) == []
    assert _batch["__key__"]  # a batch handed out before close() stays readable


# --- 4. no shared memory left behind, even after SIGKILL of the training process -------------
TRAIN_SCRIPT = """
import faulthandler, os, sys, time
faulthandler.dump_traceback_later(50, exit=True)
sys.path.insert(0, {root!r})
import psutil
import shardio

def slow(sample):
    time.sleep(0.02)
    return sample

ds = shardio.ShardDataset({data!r}, seed=0, transform=slow)
loader = shardio.ShardLoader(ds, batch_size=2, num_workers=2, ring_bytes="1MiB")
for epoch in range(1000):
    loader.set_epoch(epoch)
    for i, batch in enumerate(loader):
        if epoch == 0 and i == 2:
            kids = [p.pid for p in psutil.Process().children()]
            print("workers", *kids, flush=True)
        time.sleep(0.01)  # the training step
"""


@pytest.mark.timeout(60)
def test_sigkill_of_the_training_process_leaves_nothing(text: Path, tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN_SCRIPT.format(root=str(ROOT), data=str(text))))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=str(tmp_path))
    OUR_RING_CREATORS.add(proc.pid)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("workers"), (line, proc.stderr.read() if proc.stderr else "")
        workers = [int(x) for x in line.split()[1:]]
        assert len(workers) == 2
        time.sleep(0.2)  # mid-epoch: workers busy with batches
        assert all(psutil.pid_exists(pid) for pid in workers)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert wait_gone(workers, 5.0) == [], "workers outlived the training process"
        left = [n for n in os.listdir(SHM) if n.startswith(f"shardio-{proc.pid}-")]
        assert left == [], f"rings left in /dev/shm: {left}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


SIZING_SCRIPT = """
import faulthandler, sys, time
faulthandler.dump_traceback_later(50, exit=True)
sys.path.insert(0, {root!r})
import shardio

def slow_first(sample):
    time.sleep(30)  # slow on its first call (a model download, a cold NFS, ...)
    return sample

ds = shardio.ShardDataset({data!r}, transform=slow_first)
for batch in shardio.ShardLoader(ds, batch_size=4, num_workers=2):  # ring_bytes="auto"
    pass
"""


@pytest.mark.timeout(60)
def test_sigkill_while_sizing_the_rings_leaves_no_process(text: Path, tmp_path: Path) -> None:
    """The ring-sizing child runs the user's transform; it dies with the training process
    (it once lived on for as long as the transform took)."""
    script = tmp_path / "size.py"
    script.write_text(textwrap.dedent(SIZING_SCRIPT.format(root=str(ROOT), data=str(text))))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=str(tmp_path))
    kids: list[psutil.Process] = []
    try:
        main = psutil.Process(proc.pid)
        deadline = time.monotonic() + 30
        while not (kids := main.children()):
            assert time.monotonic() < deadline and proc.poll() is None, "no sizing child"
            time.sleep(0.05)
        time.sleep(0.5)  # inside the transform
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert wait_gone([k.pid for k in kids], 5.0) == [], "the sizing child outlived main"
    finally:
        for p in [proc, *kids]:
            try:
                p.kill()
            except (ProcessLookupError, psutil.NoSuchProcess):
                pass
        proc.wait()


# --- 5. checkpoints --------------------------------------------------------------------------
@pytest.mark.parametrize(("k", "workers", "batch"), [(0, 3, 5), (3, 1, 5), (7, 3, 3), (15, 2, 4)])
def test_state_dict_resumes_exactly_the_rest(text: Path, make_loader: Callable[..., ShardLoader],
                                             k: int, workers: int, batch: int) -> None:
    order = epoch_keys(text, seed=17, epoch=2)
    first = make_loader(ShardDataset(text, seed=17), 4, collate_fn=keys_collate)
    first.set_epoch(2)
    head: list[list[str]] = []
    it = iter(first)
    for _ in range(k):
        head.append(next(it))
    time.sleep(0.1)  # more batches are prefetched into the rings, not delivered
    state = first.state_dict()
    assert state["epoch"] == 2 and state["cursor"] == min(4 * k, N_TEXT)
    assert head == expected_rank_batches(order, 0, 1, 0, 4, "pad")[:k]
    first.close()

    resumed = make_loader(ShardDataset(text, seed=17), batch, num_workers=workers,
                          collate_fn=keys_collate)
    resumed.load_state_dict(state)
    assert resumed.state_dict() | {"batch_size": 4} == state  # nothing delivered yet
    rest = key_batches(resumed)
    assert rest == expected_rank_batches(order, 4 * k, 1, 0, batch, "pad")
    union = flat(head) + flat(rest)
    assert union == order, "resume lost, repeated or reordered samples"


def test_state_dict_after_full_epoch_resumes_nothing(text: Path,
                                                     make_loader: Callable[..., ShardLoader]) -> None:
    first = make_loader(ShardDataset(text, seed=4), 4, collate_fn=keys_collate)
    assert len(key_batches(first)) == 16
    state = first.state_dict()
    assert state["cursor"] == N_TEXT
    first.close()
    resumed = make_loader(ShardDataset(text, seed=4), 3, collate_fn=keys_collate)
    resumed.load_state_dict(state)
    assert len(resumed) == 0
    assert key_batches(resumed) == []


def test_state_dict_resume_on_another_topology(text: Path,
                                               make_loader: Callable[..., ShardLoader]) -> None:
    """Two ranks take 3 batches each; the rest is re-split across three ranks."""
    order = epoch_keys(text, seed=3)
    delivered: list[str] = []
    states = []
    for rank in range(2):
        ds = ShardDataset(text, seed=3, topology=Topology(rank=rank, world_size=2))
        loader = make_loader(ds, 4, collate_fn=keys_collate)
        it = iter(loader)
        delivered += flat([next(it) for _ in range(3)])
        states.append(loader.state_dict())
        loader.close()
    assert states[0] == states[1] and states[0]["cursor"] == 24
    for rank in range(3):
        ds = ShardDataset(text, seed=3, topology=Topology(rank=rank, world_size=3))
        loader = make_loader(ds, 2, collate_fn=keys_collate)
        loader.load_state_dict(states[0])
        got = key_batches(loader)
        assert got == expected_rank_batches(order, 24, 3, rank, 2, "pad")
        delivered += flat(got)
        loader.close()
    # 37 remaining samples on 3 ranks: "pad" repeats 2 of them.
    counts = Counter(delivered)
    assert set(counts) == set(order) and sum(counts.values()) == N_TEXT + 2


# --- 6. sizing -------------------------------------------------------------------------------
def test_absurd_ring_bytes_fails_before_any_worker(text: Path,
                                                   make_loader: Callable[..., ShardLoader]) -> None:
    before = {p.pid for p in live_children()}
    loader = make_loader(ShardDataset(text), 4, ring_bytes="100TB")
    for _ in range(2):  # and again: a failed start leaves no half-built pool behind
        with pytest.raises(ShmSpaceError) as info:
            next(iter(loader))
        assert "ring_bytes" in str(info.value) and "shm_dir" in str(info.value)
        assert isinstance(info.value, OSError)
        assert new_workers(before) == []


def test_loader_start_sweeps_rings_of_dead_creators(
        images: tuple[Path, dict[str, np.ndarray], dict[str, int]],
        make_loader: Callable[..., ShardLoader], tmp_path: Path) -> None:
    """A creator SIGKILLed inside Ring.create leaves its file; the next loader's start removes
    it, and keeps a file whose creator is alive."""
    root, _pixels, _labels = images
    rings = tmp_path / "rings"
    rings.mkdir()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        os._exit(0)
    os.waitpid(pid, 0)  # reaped: no process has this pid now
    stale = rings / f"shardio-{pid}-{'ab' * 8}"
    stale.write_bytes(b"\0" * 4096)
    alive = rings / f"shardio-{os.getpid()}-{'cd' * 8}"
    alive.write_bytes(b"")
    loader = make_loader(ShardDataset(root, seed=2, decode=True), 4, shm_dir=str(rings))
    assert sum(1 for _ in loader) > 0
    loader.close()
    assert sorted(os.listdir(rings)) == [alive.name]


def test_shm_dir_on_disk(images: tuple[Path, dict[str, np.ndarray], dict[str, int]],
                         make_loader: Callable[..., ShardLoader], tmp_path: Path) -> None:
    root, pixels, labels = images
    rings = tmp_path / "rings"
    rings.mkdir()
    loader = make_loader(ShardDataset(root, seed=2, decode=True), 4, shm_dir=str(rings))
    expected = expected_rank_batches(epoch_keys(root, seed=2), 0, 1, 0, 4, "pad")
    n = 0
    for batch, keys in zip(loader, expected):
        where = shm_mapping_of(batch["png"].data_ptr()) or ""
        assert where.startswith(str(rings) + "/shardio-"), where
        check_image_batch(batch, keys, pixels, labels)
        n += 1
    assert n == len(expected)
    assert os.listdir(rings) == []  # unlinked at creation
    loader.close()
    assert os.listdir(rings) == []


def huge_collate(samples: list[dict[str, Any]]) -> np.ndarray:
    return np.zeros((len(samples), 1 << 18), dtype=np.uint8)


def test_batch_bigger_than_the_ring(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    """An oversized batch travels through the worker's pipe (one copy, one warning), not a crash."""
    loader = make_loader(ShardDataset(text), 4, ring_bytes="64KiB", collate_fn=huge_collate,
                         **FAST)
    with pytest.warns(RuntimeWarning, match="does not fit .* ring_bytes"):
        batches = list(loader)
    assert batches and all(tuple(b.shape)[1] == 1 << 18 for b in batches)
    assert loader.stats()["copied_out"] == len(batches)


def test_auto_ring_bytes_sized_from_the_first_batch(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    from shardio.loader import AUTO_RING_MAX, AUTO_RING_MIN

    def zombies() -> set[int]:
        return {p.pid for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE}

    before = zombies()
    loader = make_loader(ShardDataset(text), 4, collate_fn=huge_collate, **FAST)
    assert loader.options.ring_bytes == "auto" and loader.ring_bytes == 0
    n = sum(1 for _ in loader)
    assert zombies() - before == set()  # no helper process of any kind left unreaped
    want = (LoaderOptions().prefetch_factor + 2) * (4 * (1 << 18))
    assert AUTO_RING_MIN <= loader.ring_bytes <= AUTO_RING_MAX
    assert loader.ring_bytes >= min(want, AUTO_RING_MAX)
    assert n > 0 and loader.stats()["copied_out"] == 0


def test_prefetch_factor_sizes_auto_rings(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    """prefetch_factor (DataLoader's name): each auto-sized ring holds that many batches ready
    plus the one the loop holds, and one of slack; the default is DataLoader's 2."""
    def rows(samples: list[dict[str, Any]]) -> np.ndarray:
        return np.zeros((len(samples), 1 << 18), dtype=np.uint8)

    assert LoaderOptions().prefetch_factor == 2  # DataLoader's default
    batch = 32 * (1 << 18)  # 8 MiB: above the 8 MiB floor even with factor 1
    sizes = {}
    for factor in (1, 6):
        loader = make_loader(ShardDataset(text, batch_size=32), 32, num_workers=1,
                             collate_fn=rows, prefetch_factor=factor, **FAST)
        assert sum(1 for _ in loader) > 0 and loader.stats()["copied_out"] == 0
        sizes[factor] = loader.ring_bytes
        loader.close()
    # One worker: the loop's last batch and the arriving one share the ring; only the last one
    # counts against max_held_fraction (0.5), so even factor 1 copies nothing out.
    assert (1 + 2) * batch <= sizes[1] < (6 + 2) * batch <= sizes[6]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UsageError, match="prefetch_factor"):
            LoaderOptions(prefetch_factor=bad)


def worker_runtime(samples: list[dict[str, Any]]) -> np.ndarray:
    """collate_fn reporting, from inside the worker: torch intra-op threads, GC-frozen objects."""
    import gc

    import torch

    return np.array([[torch.get_num_threads(), gc.get_freeze_count()]] * len(samples))


def test_workers_run_one_torch_thread_and_freeze_inherited_objects(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    loader = make_loader(ShardDataset(text), 8, collate_fn=worker_runtime, **FAST)
    for batch in loader:
        threads, frozen = np.asarray(batch)[0]
        assert threads == 1  # as DataLoader's workers: no oversubscribed intra-op pools
        assert frozen > 1000  # the training process's objects, never traversed by the GC


# --- 7. data-wait accounting -----------------------------------------------------------------
STAT_KEYS = {"steps", "wait_s", "compute_s", "wait_fraction", "wait_per_step_s",
             "compute_per_step_s", "stage_s", "stage_per_batch_s", "copied_out", "spilled",
             "detached", "restarts"}
STAGES = {"read", "decode", "transform", "collate", "write", "total"}


def test_stats_slow_training_step(text: Path, make_loader: Callable[..., ShardLoader],
                                  caplog: pytest.LogCaptureFixture) -> None:
    loader = make_loader(ShardDataset(text, seed=0), 2, collate_fn=keys_collate, warn_window=5)
    with caplog.at_level(logging.WARNING, logger="shardio.loader"):
        for _batch in loader:
            time.sleep(0.04)  # the training step is the bottleneck
    s = loader.stats()
    assert STAT_KEYS <= set(s) and set(s["stage_s"]) == STAGES
    assert s["steps"] == 31
    assert s["compute_s"] >= 30 * 0.04
    assert s["wait_fraction"] < 0.3, s
    assert s["stage_s"]["read"] > 0 and s["stage_s"]["write"] > 0
    assert s["stage_s"]["total"] >= s["stage_s"]["read"] + s["stage_s"]["write"]
    assert not [r for r in caplog.records if "waited for data" in r.getMessage()]


def test_stats_count_the_last_step_of_every_epoch(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    """Each step's compute is the time from its batch to the next request, the last step of
    an epoch included (it was lost, and each epoch's first step counted none)."""
    loader = make_loader(ShardDataset(text, seed=0), 16, collate_fn=keys_collate)
    for epoch in range(3):
        loader.set_epoch(epoch)
        for _batch in loader:  # 61 samples: 4 steps
            time.sleep(0.05)
    s = loader.stats()
    assert s["steps"] == 12
    assert 12 * 0.05 <= s["compute_s"] < 12 * 0.05 + 0.3, s
    assert s["compute_per_step_s"] >= 0.05


def test_stats_slow_transform_warns(text: Path, make_loader: Callable[..., ShardLoader],
                                    caplog: pytest.LogCaptureFixture) -> None:
    ds = ShardDataset(text, seed=0, transform=very_slow_transform)
    loader = make_loader(ds, 2, num_workers=1, warn_window=4)
    with caplog.at_level(logging.WARNING, logger="shardio.loader"):
        for i, _batch in enumerate(loader):
            if i == 8:
                break
    s = loader.stats()
    assert s["steps"] == 9
    assert s["wait_fraction"] > 0.7, s
    assert s["stage_per_batch_s"]["transform"] >= 2 * 0.03 * 0.9
    warned = [r for r in caplog.records if "waited for data" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "num_workers" in warned[0].getMessage()


class _FakeClock:
    """A LoaderStats clock that moves only when told."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _stats_run(stats: LoaderStats, clock: _FakeClock, steps: list[tuple[float, float | None]],
               caplog: pytest.LogCaptureFixture) -> list[int]:
    """One iteration of ``(wait, compute)`` steps as the loader accounts them (compute None:
    the loop left the iteration during that step); the count of warnings once each step's
    compute is measured (at the next request)."""
    counts = []
    stats.begin_epoch()
    for i, (wait, compute) in enumerate(steps):
        started = stats.begin_wait()
        if i:
            counts.append(len(_starved_warnings(caplog)))
        clock.t += wait
        stats.end_wait(started, {})
        if compute is None:
            return counts
        clock.t += compute
    stats.begin_wait()  # the loop asks for the batch after the last
    counts.append(len(_starved_warnings(caplog)))
    stats.epoch_end()
    return counts


def _starved_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waited for data" in r.getMessage()]


def test_starvation_warning_leaves_out_start_up(caplog: pytest.LogCaptureFixture) -> None:
    """Each iteration's first wait (forking workers, filling the pipeline) counted as
    starvation: a loop that kept pace warned as soon as the window filled."""
    clock = _FakeClock()
    stats = LoaderStats(window=4, clock=clock)
    with caplog.at_level(logging.WARNING, logger="shardio.loader"):
        for _epoch in range(2):
            _stats_run(stats, clock, [(30.0, 1.0)] + [(0.1, 1.0)] * 4, caplog)
    assert _starved_warnings(caplog) == []
    assert stats.steps == 10 and stats.wait_s == pytest.approx(60.8)  # still counted


def test_starvation_warning_once_per_episode(caplog: pytest.LogCaptureFixture) -> None:
    """Once per episode of starvation, again after a recovery or in a later epoch, and at
    most once per window; before, it warned once for the loader's whole life."""
    clock = _FakeClock()
    stats = LoaderStats(window=3, clock=clock)
    starved, fine = (1.0, 0.1), (0.1, 1.0)
    with caplog.at_level(logging.WARNING, logger="shardio.loader"):
        counts = _stats_run(stats, clock, [fine] + [starved] * 6 + [fine] * 3 + [starved] * 3,
                            caplog)
        # (start-up) warned when the window filled, not again in that episode; recovered
        # (the window's ratio back under 1); warned again once it is starved again
        assert counts == [0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2]
        # A later epoch: a new episode, warned of a window after the last warning.
        counts = _stats_run(stats, clock, [fine] + [starved] * 4, caplog)
        assert counts == [2, 2, 3, 3, 3]
    caplog.clear()
    stats = LoaderStats(window=3, clock=clock)
    with caplog.at_level(logging.WARNING, logger="shardio.loader"):
        # Recovered, and starved again 2 steps after the warning: warned 3 steps after it.
        counts = _stats_run(stats, clock, [fine] + [(10.0, 1.0)] * 3 + [(0.0, 30.0)]
                            + [(30.0, 0.0)] * 2, caplog)
        assert counts == [0, 0, 0, 1, 1, 1, 2]


def test_starvation_warning_drops_unmeasured_steps(caplog: pytest.LogCaptureFixture) -> None:
    """The last step of an iteration the loop left has no compute time: it entered the
    window as all wait and no compute, and tipped the ratio."""
    clock = _FakeClock()
    stats = LoaderStats(window=3, clock=clock)
    with caplog.at_level(logging.WARNING, logger="shardio.loader"):
        _stats_run(stats, clock, [(1.0, 2.0), (1.0, 2.0), (1.0, 2.0), (5.0, None)], caplog)
        _stats_run(stats, clock, [(0.5, 2.0), (1.0, 2.0), (1.0, 2.0)], caplog)
    assert _starved_warnings(caplog) == []
    assert list(stats._recent) == [(1.0, 2.0)] * 3


@pytest.mark.parametrize("option, value", [
    ("log_every", -1), ("log_every", 2.5), ("log_every", True), ("warn_window", 0),
    ("warn_window", 1.5), ("warn_window", None), ("warn_wait_ratio", 0),
    ("warn_wait_ratio", -1.0), ("warn_wait_ratio", float("inf")), ("warn_wait_ratio", float("nan")),
    ("warn_wait_ratio", "2")])
def test_stats_options_are_checked(text: Path, option: str, value: Any) -> None:
    """A bad value failed late (warn_window=0: ZeroDivisionError in the warning, a string
    ratio: TypeError mid-epoch) or silently never warned (a negative or NaN ratio)."""
    with pytest.raises(UsageError, match=f"^{option} must be"):
        LoaderOptions(**{option: value})
    with pytest.raises(UsageError, match=f"^{option} must be"):
        ShardLoader(ShardDataset(text), 2, **{option: value})
    ok = LoaderOptions(log_every=np.int64(5), warn_window=3, warn_wait_ratio=2)
    assert (ok.log_every, ok.warn_window, ok.warn_wait_ratio) == (5, 3, 2.0)


class _DieWhenArmed:
    """Worker transform: the first worker to find the ``arm`` file removes it and dies."""

    def __init__(self, arm: Path) -> None:
        self.arm = arm

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        try:
            os.unlink(self.arm)
        except FileNotFoundError:
            return sample
        os._exit(7)


def test_restarts_count_over_the_loaders_life(text: Path, tmp_path: Path,
                                             make_loader: Callable[..., ShardLoader]) -> None:
    """stats()["restarts"] was the current pool's count: with persistent_workers=False (a new
    pool every epoch), or after a pool closed on a worker error, earlier restarts vanished."""
    arm = tmp_path / "arm"
    loader = make_loader(ShardDataset(text, transform=_DieWhenArmed(arm)), 4,
                         collate_fn=keys_collate, persistent_workers=False, timeout=60, **FAST)
    expected = sorted(s["__key__"] for s in ShardDataset(text))
    for epoch in range(3):
        arm.touch()
        loader.set_epoch(epoch)
        got = [k for b in loader for k in b]
        assert not arm.exists() and sorted(got) == expected
        assert loader.stats()["restarts"] == epoch + 1


def test_loaders_leave_no_descriptor_behind(
        text: Path, make_loader: Callable[..., ShardLoader], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """Control sockets, spill pipes and the ring descriptors main keeps until it has handed
    them over (see "Ring sizing" in shardio.pool) are all closed with the loader: whole
    epochs, an epoch whose first batch fails before any ring exists, and a loader closed while
    its workers wait for their rings."""
    def fds() -> set[str]:
        gc.collect()
        return set(os.listdir("/proc/self/fd"))

    order = epoch_keys(text, seed=9)
    monkeypatch.setenv("SHARDIO_TEST_MARKER", str(tmp_path / "failed"))
    monkeypatch.setenv("SHARDIO_TEST_FIRST", order[0])
    make_loader(ShardDataset(text), 4, **FAST).close()  # imports and first-use caches
    # Workers that earlier tests' non-persistent loaders left exiting (see shardio.pool,
    # "Closing without waiting") give their descriptors back when they are reaped: not here.
    shardio.pool.reap_exiting(wait=True)
    before = fds()
    for _ in range(3):
        loader = make_loader(ShardDataset(text, seed=1), 4, **FAST)
        assert sum(1 for _ in loader) > 0
        loader.close()
    loader = make_loader(ShardDataset(text, seed=9, transform=fail_first_sample_once), 4,
                         **FAST)
    with pytest.raises(WorkerError, match="first sample"):
        next(iter(loader))
    loader.close()
    loader = make_loader(ShardDataset(text, seed=2, transform=very_slow_transform), 4, **FAST)
    it = iter(loader)
    loader._ensure_pool()  # workers forked, no ring yet: their first batch takes 0.12 s
    loader.close()
    del it
    assert fds() == before


def test_auto_rings_that_do_not_fit_a_small_shm_dir(
        text: Path, make_loader: Callable[..., ShardLoader], small_tmpfs: Path) -> None:
    """A real 2 MiB tmpfs as shm_dir (a container's small /dev/shm): auto rings (8 MiB at
    least) are refused when the first batch sizes them, before any ring file exists, with the
    options to change; the pool is gone; an explicit ring_bytes that fits then works there."""
    loader = make_loader(ShardDataset(text, seed=3), 4, shm_dir=str(small_tmpfs), **FAST)
    with pytest.raises(ShmSpaceError, match=r"ring_bytes.*shm_dir="):
        next(iter(loader))
    assert loader._pool is None and os.listdir(small_tmpfs) == []
    fits = make_loader(ShardDataset(text, seed=3), 4, shm_dir=str(small_tmpfs),
                       ring_bytes="256KiB", **FAST)
    got = key_batches_of(fits)
    assert got == expected_rank_batches(epoch_keys(text, seed=3), 0, 1, 0, 4, "pad")
    fits.close()
    assert os.listdir(small_tmpfs) == []
