"""``ShardLoader`` as a drop-in ``DataLoader``: its arguments, in DataLoader's places, and what
a DataLoader worker sets up for the user's code (seeded generators, ``get_worker_info()``,
``worker_init_fn``), with real forked workers and real shared memory.

Random augmentations are checked against the contract in ``ShardLoader``'s docstring: each
batch's draws come from (base seed, epoch, rank, the batch's place in the epoch) only, so they
differ between batches and between torch, ``random`` and numpy, and stay the same with another
worker count, after a worker's restart and after a resume.
"""

from __future__ import annotations

import collections
import gc
import inspect
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, get_worker_info

from shardio import ShardDataset, ShardLoader, Topology
from shardio.errors import UsageError, WorkerError, WorkerTimeoutError
from tests.test_dataset import epoch_keys, expected_rank_batches
from tests.test_loader import (  # noqa: F401 - fixtures
    FAST,
    _no_leftovers,
    live_children,
    make_loader,
    new_workers,
    our_rings,
    text,
    wait_gone,
)

pytestmark = pytest.mark.timeout(60)


# Transforms live at module level: tracebacks from the forked workers name real functions.
class Draws:
    """A transform that draws one number from each global generator, sleeping ``delay`` s."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        if self.delay:
            time.sleep(self.delay)
        return {"__key__": sample["__key__"], "t": torch.rand(()).item(),
                "r": random.random(), "n": float(np.random.rand())}


def draws_of(loader: ShardLoader) -> dict[str, tuple[float, float, float]]:
    """The (torch, random, numpy) draws of each key in one epoch of ``loader``."""
    out: dict[str, tuple[float, float, float]] = {}
    for batch in loader:
        for k, t, r, n in zip(batch["__key__"], batch["t"].tolist(), batch["r"].tolist(),
                              batch["n"].tolist()):
            assert k not in out or out[k] == (t, r, n)  # padding repeats a sample whole
            out[k] = (t, r, n)
    return out


def worker_facts(sample: dict[str, Any]) -> dict[str, Any]:
    time.sleep(0.01)  # slow enough for a worker to be killed mid-epoch
    info = get_worker_info()
    return {"__key__": sample["__key__"], "id": info.id, "num_workers": info.num_workers,
            "seed": str(info.seed), "pid": os.getpid(),
            "is_shard": isinstance(info.dataset, ShardDataset)}


def mark_worker(directory: str) -> Callable[[int], None]:
    def init(worker_id: int) -> None:
        with open(os.path.join(directory, f"{worker_id}.{os.getpid()}"), "w") as f:
            f.write(str(get_worker_info().id))
    return init


def failing_init(worker_id: int) -> None:
    raise KeyError(f"no GPU for worker {worker_id}")


def hang_on_key_7(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"].endswith("7"):
        time.sleep(30)
    return sample


# --- random augmentations ---------------------------------------------------------------------
def test_every_batch_draws_its_own_numbers(text: Path,
                                           make_loader: Callable[..., ShardLoader]) -> None:
    """Forked workers inherit the parent's generators: unseeded, two workers draw the very same
    numbers for their batches (and random and numpy seeded alike would too)."""
    draws = draws_of(make_loader(ShardDataset(text, seed=3, transform=Draws()), 4))
    assert set(draws) == set(epoch_keys(text, seed=3))
    for lib in range(3):
        column = [d[lib] for d in draws.values()]
        assert len(set(column)) == len(column), "two samples drew the same number"
    assert all(len(set(d)) == 3 for d in draws.values()), "torch, random and numpy agree"


def test_draws_do_not_depend_on_the_worker_count(text: Path,
                                                 make_loader: Callable[..., ShardLoader]) -> None:
    one = make_loader(ShardDataset(text, seed=3, transform=Draws()), 4, num_workers=1)
    three = make_loader(ShardDataset(text, seed=3, transform=Draws()), 4, num_workers=3)
    first = draws_of(one)
    assert draws_of(three) == first
    three.set_epoch(1)
    assert set(draws_of(three).values()).isdisjoint(first.values()), "epoch 1 repeats epoch 0"


def test_base_seed_comes_from_the_dataset_seed_or_the_generator(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    def loader(seed: int = 3, **kw: Any) -> ShardLoader:
        return make_loader(ShardDataset(text, seed=seed, transform=Draws()), 4, **kw)

    torch.manual_seed(5)
    a = loader()
    torch.manual_seed(6)  # not the dataset's seed: no effect
    b = loader()
    c = loader(generator=torch.Generator().manual_seed(5))
    d = loader(generator=torch.Generator().manual_seed(5))
    assert a.seed == b.seed != loader(seed=4).seed
    assert c.seed == d.seed != loader(generator=torch.Generator().manual_seed(6)).seed
    assert draws_of(a) == draws_of(b)
    assert draws_of(c) == draws_of(d) != draws_of(a)


def test_ranks_draw_differently(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    """Every rank has the same base seed (and so the same state_dict): their batches at the
    same place in the epoch still draw different numbers."""
    got, loaders = [], []
    for rank in range(2):
        ds = ShardDataset(text, seed=3, transform=Draws(),
                          topology=Topology(world_size=2, rank=rank))
        loaders.append(make_loader(ds, 4))
        got.append(draws_of(loaders[-1]))
    assert loaders[0].state_dict() == loaders[1].state_dict()
    assert not set(got[0].values()) & set(got[1].values())


def test_resume_draws_what_the_uninterrupted_epoch_drew(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    whole = draws_of(make_loader(ShardDataset(text, seed=3, transform=Draws()), 4,
                                 generator=torch.Generator().manual_seed(9)))
    first = make_loader(ShardDataset(text, seed=3, transform=Draws()), 4,
                        generator=torch.Generator().manual_seed(9))
    it = iter(first)
    for _ in range(5):
        next(it)
    state = first.state_dict()
    it.close()
    assert state["worker_seed"] == first.seed
    # Another process's loader: another base seed until the state is loaded, 3 workers.
    second = make_loader(ShardDataset(text, seed=3, transform=Draws()), 4, num_workers=3,
                         generator=torch.Generator().manual_seed(10))
    second.load_state_dict(state)
    rest = draws_of(second)
    assert len(rest) == len(whole) - 20
    assert all(whole[k] == v for k, v in rest.items())


def test_a_restarted_worker_redraws_the_same_numbers(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    gen = torch.Generator().manual_seed(4)
    calm = draws_of(make_loader(ShardDataset(text, seed=3, transform=Draws()), 4,
                                generator=gen.clone_state()))
    before = {p.pid for p in live_children()}
    loader = make_loader(ShardDataset(text, seed=3, transform=Draws(0.01)), 4,
                         generator=gen.clone_state(), **FAST)
    got: dict[str, tuple[float, float, float]] = {}
    for i, batch in enumerate(loader):
        got.update(zip(batch["__key__"], zip(batch["t"].tolist(), batch["r"].tolist(),
                                             batch["n"].tolist())))
        if i == 2:
            os.kill(new_workers(before)[0], signal.SIGKILL)
    assert loader.stats()["restarts"] >= 1
    assert got == calm


# --- what a DataLoader worker sets up -----------------------------------------------------------
def test_worker_init_fn_and_get_worker_info(text: Path, tmp_path: Path,
                                            make_loader: Callable[..., ShardLoader]) -> None:
    marks = tmp_path / "marks"
    marks.mkdir()
    before = {p.pid for p in live_children()}
    loader = make_loader(ShardDataset(text, seed=3, transform=worker_facts), 4,
                         worker_init_fn=mark_worker(str(marks)), **FAST)
    facts = []
    for i, batch in enumerate(loader):
        facts += list(zip(batch["id"].tolist(), batch["num_workers"].tolist(),
                          map(int, batch["seed"]), batch["pid"].tolist(),
                          batch["is_shard"].tolist()))
        if i == 1:
            killed = new_workers(before)[1]
            os.kill(killed, signal.SIGKILL)
    base = loader.seed
    by_id = {i: {(n, s, sh) for i2, n, s, _p, sh in facts if i2 == i} for i in (0, 1)}
    assert by_id == {0: {(2, base, True)}, 1: {(2, base + 1, True)}}
    pids = {p for *_, p, _sh in facts}
    # Called once in each worker process, the replacement of the killed one included.
    assert sorted(os.listdir(marks)) == sorted(f"{i}.{p}" for i, *_, p, _sh in set(facts))
    assert len(pids) == 3 and killed in pids
    loader.set_epoch(1)
    draws = list(loader)
    assert draws and len(os.listdir(marks)) == 3, "worker_init_fn ran again for a new epoch"


def test_worker_init_fn_error_is_a_worker_error(text: Path,
                                                make_loader: Callable[..., ShardLoader]) -> None:
    loader = make_loader(ShardDataset(text, seed=3), 4, worker_init_fn=failing_init)
    with pytest.raises(WorkerError, match="no GPU for worker") as caught:
        next(iter(loader))
    assert "failing_init" in str(caught.value)
    assert isinstance(caught.value.__cause__, KeyError)


# --- DataLoader's arguments ---------------------------------------------------------------------
def test_the_signature_is_dataloaders() -> None:
    """Every DataLoader argument is ShardLoader's too, in the same place and of the same kind,
    so ``DataLoader(...)`` -> ``ShardLoader(...)`` is the one change a training script needs."""
    theirs = list(inspect.signature(DataLoader.__init__).parameters.values())[1:]
    ours = inspect.signature(ShardLoader.__init__).parameters
    names = list(ours)[1:]
    for i, p in enumerate(theirs):
        assert p.name in ours, f"DataLoader's {p.name} is missing"
        assert ours[p.name].kind == p.kind, p.name
        if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            assert names[i] == p.name, f"{p.name} is not at position {i + 1}"


def test_a_dataloader_call_works_unchanged(text: Path) -> None:
    ds = ShardDataset(text, seed=3)
    args = (4, False, None, None, 2, None, False, False, 0, None, "fork",
            torch.Generator().manual_seed(1))
    kwargs = {"prefetch_factor": 3, "persistent_workers": True, "pin_memory_device": "",
              "in_order": True}
    with ShardLoader(ds, *args, **kwargs) as loader:
        dl = DataLoader(ds, *args, **kwargs)
        # (collate_fn None is ShardLoader's own default collate: DataLoader shows its own.)
        for name in ("batch_size", "num_workers", "pin_memory", "drop_last",
                     "timeout", "worker_init_fn", "multiprocessing_context", "generator",
                     "prefetch_factor", "persistent_workers", "pin_memory_device", "in_order"):
            mine, theirs = getattr(loader, name), getattr(dl, name)
            assert mine == theirs or (name == "multiprocessing_context"
                                      and theirs.get_start_method() == mine), name
        got = [list(b["__key__"]) for b in loader]
    assert got == expected_rank_batches(epoch_keys(text, seed=3), 0, 1, 0, 4, "pad")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"shuffle": True}, r"ShardDataset\(\.\.\., shuffle=True"),
    ({"shuffle": "yes"}, "shuffle must be"),
    ({"shuffle": 1}, "pass num_workers by keyword"),  # ShardLoader(ds, 64, 1): the old order
    ({"shuffle": 0}, "pass num_workers by keyword"),
    ({"sampler": [1, 2]}, "no sampler"),
    ({"batch_sampler": [[1, 2]]}, "no sampler"),
    ({"batch_size": None}, "moves whole batches"),
    ({"timeout": -1}, "timeout must be"),
    ({"worker_init_fn": 3}, "must be callable"),
    ({"multiprocessing_context": "spawn"}, "forks its workers"),
    ({"generator": 7}, "torch.Generator"),
    ({"persistent_workers": None}, "persistent_workers must be"),
    ({"pin_memory_device": "xpu"}, "CUDA only"),
    ({"in_order": "no"}, "in_order must be"),
    ({"prefetch_factor": 0}, "prefetch_factor must be"),
    ({"prefetch_factor": 2, "num_workers": 0}, "with num_workers=0 leave it None"),
])
def test_dataloader_arguments_it_cannot_honour(text: Path, kwargs: dict[str, Any],
                                               match: str) -> None:
    with pytest.raises(UsageError, match=match):
        ShardLoader(ShardDataset(text, seed=3, shuffle=False), **{"batch_size": 4, **kwargs})


def test_spawn_context_object_is_refused_and_fork_taken(text: Path) -> None:
    import multiprocessing as mp

    with pytest.raises(UsageError, match="forks its workers"):
        ShardLoader(ShardDataset(text, seed=3), 4, multiprocessing_context=mp.get_context("spawn"))
    ShardLoader(ShardDataset(text, seed=3), 4, multiprocessing_context=mp.get_context("fork"))


def test_shuffle_true_on_a_shuffling_dataset(text: Path,
                                             make_loader: Callable[..., ShardLoader]) -> None:
    loader = make_loader(ShardDataset(text, seed=3, shuffle=True), 4, shuffle=True)
    assert [list(b["__key__"]) for b in loader] == expected_rank_batches(
        epoch_keys(text, seed=3), 0, 1, 0, 4, "pad")


def test_workers_that_do_not_persist(text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    """persistent_workers=False: the workers and rings of an iteration are gone when it ends,
    completed or abandoned, and the next iteration starts new ones."""
    before = {p.pid for p in live_children()}
    rings = our_rings()
    loader = make_loader(ShardDataset(text, seed=3), 4, persistent_workers=False)
    expected = expected_rank_batches(epoch_keys(text, seed=3), 0, 1, 0, 4, "pad")
    assert [list(b["__key__"]) for b in loader] == expected
    first = new_workers(before)
    assert wait_gone(first, 5.0) == [] and our_rings() == rings
    it = iter(loader)
    batch = next(it)
    second = new_workers(before)
    assert second and not set(second) & set(first)
    it.close()
    assert wait_gone(second, 5.0) == []
    assert list(batch["__key__"]) == expected[0]  # a batch kept past the close is intact
    loader.set_epoch(1)
    assert len(list(loader)) == len(expected)


def test_timeout_is_a_typed_error_and_stops_the_workers(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    before = {p.pid for p in live_children()}
    loader = make_loader(ShardDataset(text, seed=3, transform=hang_on_key_7), 4, timeout=0.5,
                         **FAST)
    t0 = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"did not deliver step \d+ within 0.5 s") as e:
        for _ in loader:
            pass
    assert time.monotonic() - t0 < 15
    assert isinstance(e.value, RuntimeError) and isinstance(e.value, TimeoutError)
    assert wait_gone(new_workers(before), 10.0) == []
    # The loader itself is fine: the next iteration starts new workers (here with the hang
    # fixed) and delivers the epoch from its start.
    loader.dataset.transform = None
    assert [list(b["__key__"]) for b in loader] == expected_rank_batches(
        epoch_keys(text, seed=3), 0, 1, 0, 4, "pad")


# --- num_workers=0 ------------------------------------------------------------------------------
Half = collections.namedtuple("Half", "x key")


def to_bfloat16(sample: dict[str, Any]) -> dict[str, Any]:
    n = int(sample["__key__"][-4:])
    return {"__key__": sample["__key__"], "x": torch.full((3, 2), n / 8, dtype=torch.bfloat16)}


def half_batch(samples: list[dict[str, Any]]) -> Half:
    return Half(torch.stack([s["x"] for s in samples]).to(torch.float8_e4m3fn),
                [s["__key__"] for s in samples])


@pytest.mark.parametrize("workers", [0, 2])
def test_bfloat16_float8_and_named_tuple_batches(text: Path, workers: int,
                                                 make_loader: Callable[..., ShardLoader]) -> None:
    """Mixed-precision batches: numpy has no bfloat16 or float8, and these used to be a
    WorkerError; a collate_fn's named tuple comes back as itself."""
    expected = {k: torch.full((3, 2), int(k[-4:]) / 8, dtype=torch.bfloat16)
                for k in epoch_keys(text, seed=3)}
    stacked = make_loader(ShardDataset(text, seed=3, transform=to_bfloat16), 4,
                          num_workers=workers)
    for b in stacked:
        assert b["x"].dtype == torch.bfloat16
        assert all(torch.equal(x, expected[k]) for k, x in zip(b["__key__"], b["x"]))
    named = make_loader(ShardDataset(text, seed=3, transform=to_bfloat16), 4,
                        collate_fn=half_batch, num_workers=workers)
    for b in named:
        assert type(b) is Half and b.x.dtype == torch.float8_e4m3fn
        assert all(torch.equal(x.float(), expected[k].to(torch.float8_e4m3fn).float())
                   for k, x in zip(b.key, b.x))


def in_main_facts(sample: dict[str, Any]) -> dict[str, Any]:
    return {"__key__": sample["__key__"], "pid": os.getpid(), "none": get_worker_info() is None}


def explode_on_key_7(sample: dict[str, Any]) -> dict[str, Any]:
    if sample["__key__"].endswith("7"):
        raise ZeroDivisionError(f"cannot transform {sample['__key__']}")
    return sample


def test_no_workers_makes_the_same_batches_here(text: Path,
                                                make_loader: Callable[..., ShardLoader]) -> None:
    """num_workers=0: no process, no ring; the same batches and draws as with workers, and the
    training process's own generators are where they were."""
    before = {p.pid for p in live_children()}
    rings = our_rings()
    ds = ShardDataset(text, seed=3, transform=Draws())
    here = make_loader(ds, 4, num_workers=0)
    arena = ds.reader.arena
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    expect = (torch.rand(3), random.random(), np.random.rand(2))
    torch.manual_seed(1)
    random.seed(1)
    np.random.seed(1)
    draws = draws_of(here)
    assert new_workers(before) == [] and our_rings() == rings
    got = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(got[0], expect[0]) and got[1] == expect[1]
    assert np.array_equal(got[2], expect[2])
    assert ds.reader.arena is arena
    assert draws == draws_of(make_loader(ShardDataset(text, seed=3, transform=Draws()), 4))
    facts = [b for b in make_loader(ShardDataset(text, seed=3, transform=in_main_facts), 4,
                                    num_workers=0)]
    assert {p for b in facts for p in b["pid"].tolist()} == {os.getpid()}
    assert all(b["none"].all() for b in facts)


def test_no_workers_zero_copy_batches_stay_intact(text: Path,
                                                 make_loader: Callable[..., ShardLoader]) -> None:
    ds = ShardDataset(text, seed=3, zero_copy=True)
    batches = list(make_loader(ds, 4, num_workers=0))
    with_workers = list(make_loader(ShardDataset(text, seed=3, zero_copy=True), 4))
    assert len(batches) == len(with_workers)
    for a, b in zip(batches, with_workers):  # every batch kept: none was written over
        assert a["__key__"] == b["__key__"]
        assert [bytes(x) for x in a["txt"]] == [bytes(x) for x in b["txt"]]


def test_no_workers_raises_the_transform_error_itself_and_resumes(
        text: Path, make_loader: Callable[..., ShardLoader]) -> None:
    with pytest.raises(ZeroDivisionError, match="cannot transform"):
        list(make_loader(ShardDataset(text, seed=3, transform=explode_on_key_7), 4,
                         num_workers=0))
    loader = make_loader(ShardDataset(text, seed=3), 4, num_workers=0)
    it = iter(loader)
    head = [list(next(it)["__key__"]) for _ in range(6)]
    state = loader.state_dict()
    it.close()
    rest = make_loader(ShardDataset(text, seed=3), 2, num_workers=2)
    rest.load_state_dict(state)
    expected = epoch_keys(text, seed=3)
    assert [k for b in head for k in b] == expected[:24]
    assert [k for b in rest for k in b["__key__"]] == expected[24:]


@pytest.mark.parametrize("workers", [0, 2])
def test_state_after_the_datasets_set_epoch(text: Path, workers: int,
                                            make_loader: Callable[..., ShardLoader]) -> None:
    """A DataLoader loop calls ``ds.set_epoch(epoch)``; with only the loader line changed, a
    checkpoint between that call and the first batch (or a preemption signal there) is the
    start of the new epoch, not the end of the last (which resumed to an empty epoch)."""
    ds = ShardDataset(text, batch_size=4)
    loader = make_loader(ds, 4, num_workers=workers)
    for epoch in range(2):
        ds.set_epoch(epoch)
        state = loader.state_dict()
        assert (state["epoch"], state["cursor"]) == (epoch, 0)
        assert sum(1 for _ in loader) == len(loader)
    ds.load_state_dict(state)  # the dataset's own position moves: the loader counts from it
    assert loader.state_dict()["cursor"] == 0
    again = make_loader(ShardDataset(text, batch_size=4), 4, num_workers=workers)
    again.load_state_dict(state)
    assert sum(1 for _ in again) == len(loader)


@pytest.mark.parametrize("workers,persistent", [(0, True), (2, False)])
def test_superseded_iterator_without_workers(text: Path,
                                             make_loader: Callable[..., ShardLoader],
                                             workers: int, persistent: bool) -> None:
    """With num_workers=0 as with workers, a newer iter(loader) makes the older one raise (it
    went on producing, and state_dict() counted both iterators' batches).  With
    persistent_workers=False the newer iteration, run to its end, closed the pool, and the older
    one said "the worker pool is closed; create a new loader" (a WorkerError)."""
    loader = make_loader(ShardDataset(text, batch_size=4), 4, num_workers=workers,
                         persistent_workers=persistent)
    first = iter(loader)
    for _ in range(3):
        next(first)
    second = iter(loader)
    next(second)
    next(second)
    if not persistent:
        assert sum(1 for _ in second) == len(loader) - 2  # its end closes the pool
    with pytest.raises(UsageError, match="superseded"):
        next(first)
    if persistent:
        assert loader.state_dict()["cursor"] == 8
    for batch_size in (2.5, "8", True):
        with pytest.raises(UsageError, match="batch_size"):
            ShardLoader(ShardDataset(text, batch_size=4), batch_size, num_workers=0)


def test_a_loader_dropped_without_close_stops_its_workers(text: Path) -> None:
    """Dropping the last reference to a loader stops its workers, as with DataLoader, even
    with the cyclic GC off: the pool called back into the loader through bound methods, a
    cycle that kept workers and rings alive until a GC pass (16 workers after 8 loaders)."""
    was = gc.isenabled()
    gc.disable()
    try:
        pids = []
        for _ in range(3):
            loader = ShardLoader(ShardDataset(text, batch_size=4), 4, num_workers=2)
            assert sum(1 for _ in loader) == len(loader)
            pids += [w.proc.pid for w in loader._pool._workers]
            del loader
        assert wait_gone(pids, 10.0) == []
    finally:
        if was:
            gc.enable()


def test_ctrl_c_inside_close_leaves_no_worker_and_a_usable_loader(
        text: Path, monkeypatch: pytest.MonkeyPatch,
        make_loader: Callable[..., ShardLoader]) -> None:
    """Ctrl-C landing in close() (or in the close ending a non-persistent epoch) left the
    loader holding a pool marked closed ("the worker pool is closed" at the next epoch) and its
    workers as zombies, for good: a second close() returned at once."""
    from shardio import pool as pool_mod

    loader = make_loader(ShardDataset(text, batch_size=4), 4, num_workers=2)
    assert sum(1 for _ in loader) == len(loader)
    pids = [w.proc.pid for w in loader._pool._workers]
    orphan = loader._pool  # (its own close finishes once it is collected: below)
    real = pool_mod.WorkerPool._stop_workers

    def interrupted(self: Any, wait: bool = True) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(pool_mod.WorkerPool, "_stop_workers", interrupted)
    with pytest.raises(KeyboardInterrupt):
        loader.close()
    monkeypatch.setattr(pool_mod.WorkerPool, "_stop_workers", real)
    assert not orphan._closed
    del orphan
    for pid in pids:  # killed and reaped: no zombie either
        assert not psutil.pid_exists(pid) or psutil.Process(pid).ppid() != os.getpid()
    assert loader._pool is None
    assert sum(1 for _ in loader) == len(loader)  # a new pool
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_stats_count_the_last_steps_compute(text: Path, workers: int,
                                            make_loader: Callable[..., ShardLoader]) -> None:
    """Each step of the loop sleeps 10 ms, so the compute stats() reports is at least 10 ms a
    step (a lower bound: a sleep is never shorter).  With num_workers=0 the last step of every
    epoch counted nothing (0.296 s for 30 steps of 10 ms)."""
    loader = make_loader(ShardDataset(text, batch_size=4), 4, num_workers=workers)
    steps = 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        for _batch in loader:
            time.sleep(0.01)
            steps += 1
    s = loader.stats()
    assert s["steps"] == steps
    assert s["compute_s"] >= 0.01 * steps, (s["compute_s"], steps)


@pytest.mark.parametrize("seed", [-1, 1.5, 2**70, "7", True])
def test_a_malformed_worker_seed_is_refused_and_changes_nothing(
        text: Path, make_loader: Callable[..., ShardLoader], seed: Any) -> None:
    """A float or out-of-range worker_seed was taken as it came (2**70 overflowed the workers'
    int64 seeds later), a negative one failed with a ValueError after the dataset had already
    moved to the state's position."""
    loader = make_loader(ShardDataset(text, seed=3), 4, num_workers=0)
    state = make_loader(ShardDataset(text, seed=3), 4, num_workers=0).state_dict()
    loader.dataset.set_epoch(5)
    before = loader.seed
    with pytest.raises(UsageError, match="worker_seed must be an integer"):
        loader.load_state_dict(state | {"worker_seed": seed, "cursor": 8})
    assert (loader.seed, loader.dataset.epoch, loader.dataset._cursor) == (before, 5, 0)


def _meta_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    return {"w": torch.empty(3, device="meta"), "n": len(samples)}


def _cyclic_collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    batch: dict[str, Any] = {"n": len(samples)}
    batch["self"] = batch
    return batch


def test_odd_batches_from_collate_fn(text: Path,
                                     make_loader: Callable[..., ShardLoader]) -> None:
    """A meta tensor (no data) failed in ``.cpu()`` before it could go in-band, as torch pickles
    it; a batch inside itself overflowed the stack (RecursionError) with no word of why."""
    ds = ShardDataset(text, batch_size=8)
    b = next(iter(make_loader(ds, 8, collate_fn=_meta_collate)))
    assert b["w"].is_meta and b["w"].shape == (3,) and b["n"] == 8
    with pytest.raises(WorkerError, match="the batch refers to itself"):
        next(iter(make_loader(ShardDataset(text, batch_size=8), 8, collate_fn=_cyclic_collate)))


@pytest.mark.parametrize("value, words", [(0, "ring_bytes: size must be positive"),
                                          (127, "ring_bytes must be at least 128 bytes"),
                                          ("lots", "ring_bytes: invalid size")])
def test_a_bad_ring_size_names_the_option(text: Path, value: Any, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        ShardLoader(ShardDataset(text, batch_size=8), 8, num_workers=2, ring_bytes=value)
