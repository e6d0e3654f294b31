"""``ShardDataset`` end to end, with real components only: datasets packed by ``shardio.pack``,
real ``torch.utils.data.DataLoader`` worker processes, and real multi-process
``torch.distributed`` jobs (gloo on localhost, one OS process per rank, see ``_dist_rank.py``).

Checked against DESIGN.md §3 "Order and partitioning" and the contract in ``shardio/order.py``:
every sample exactly once per epoch across ranks and workers (apart from ``pad`` repeats / ``drop``
losses, fewer than R), equal sample and batch counts on every rank, an order that depends only on
(manifest, seed, epoch), and exact resume from ``state_dict`` on another world size, worker count
and batch size.  Plus decoding, transforms, random access, and the typed errors for bad datasets.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from torch.utils.data import DataLoader

import shardio
from shardio.errors import (
    ManifestCorruptError,
    ManifestError,
    ManifestNotFoundError,
    ManifestVersionError,
    ShardCorruptError,
    ShardNotFoundError,
    ShardTruncatedError,
    UnsafePathError,
    UsageError,
)
from shardio.manifest import _body_digest
from shardio.order import EpochOrder, RankPlan

ROOT = Path(__file__).resolve().parent.parent
RANK_SCRIPT = ROOT / "tests" / "_dist_rank.py"

N = 301  # samples of the `tiny` dataset: 301 mod 3 = 1, 301 mod 4 = 1 (remainders on purpose)
FEW = 10  # samples of the `few` dataset: 2 shards, fewer than the ranks reading it


# --- helpers ---------------------------------------------------------------------------------
def write_text_tree(src: Path, n: int, dirs: int = 5) -> None:
    for i in range(n):
        d = src / f"c{i % dirs}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"s{i:04d}.txt").write_text(f"sample {i} " + "x" * (i % 13))


def pack_text(base: Path, n: int, per_shard: int, **options: Any) -> Path:
    src, out = base / "src", base / "ds"
    write_text_tree(src, n)
    shardio.pack(src, out, samples_per_shard=per_shard, label_from_dir=True, fsync=False,
                 progress=False, **options)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """301 samples (txt + cls) in 38 shards of <= 8."""
    return pack_text(tmp_path_factory.mktemp("tiny"), N, 8)


@pytest.fixture(scope="module")
def few(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """10 samples in 2 shards."""
    return pack_text(tmp_path_factory.mktemp("few"), FEW, 5)


@pytest.fixture
def small(tmp_path: Path) -> Path:
    """A throwaway 24-sample dataset (6 shards) for tests that damage it."""
    return pack_text(tmp_path, 24, 4)


def manifest_keys(root: Path) -> list[str]:
    with shardio.open_dataset(root) as reader:
        return [s["__key__"] for s in reader]


def epoch_keys(root: Path, *, seed: int = 0, epoch: int = 0, shuffle: bool = True,
               shuffle_block: int = 1 << 18) -> list[str]:
    """The epoch order the contract defines, as keys (independent of any ShardDataset)."""
    with shardio.open_dataset(root) as reader:
        counts = np.diff(reader.offsets)
    keys = manifest_keys(root)
    order = EpochOrder(counts, seed=seed, epoch=epoch, shuffle=shuffle, shuffle_block=shuffle_block)
    return [keys[i] for i in order.samples(0, len(order))]


def expected_rank_batches(order: list[str], cursor: int, world: int, rank: int, batch: int,
                          remainder: str) -> list[list[str]]:
    """Batches of ``rank`` per the partition contract over the remaining order."""
    m = len(order) - cursor
    plan = RankPlan(m, world, rank, batch, remainder)
    out = []
    for t in range(plan.num_batches):
        a, b = plan.batch_range(t)
        out.append([order[cursor + p % m] for p in range(a, b)])
    return out


def collate_keys(batch: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in batch]


def load_batches(ds: shardio.ShardDataset, batch: int, workers: int,
                 max_batches: int | None = None) -> list[list[str]]:
    dl = DataLoader(ds, batch_size=batch, num_workers=workers, collate_fn=collate_keys)
    out: list[list[str]] = []
    for b in dl:
        out.append(b)
        if max_batches is not None and len(out) >= max_batches:
            break
    return out


def flat(batches: list[list[str]]) -> list[str]:
    return [k for b in batches for k in b]


def check_epoch_cover(delivered: list[str], all_keys: list[str], world: int,
                      remainder: str) -> None:
    """Each sample exactly once, apart from the documented pad repeats / drop losses (< R)."""
    n = len(all_keys)
    counts = Counter(delivered)
    assert set(counts) <= set(all_keys)
    if remainder == "pad":
        assert set(counts) == set(all_keys), "a sample was never delivered"
        repeats = sum(counts.values()) - n
        assert repeats == (-n) % world and 0 <= repeats < world
        assert all(c <= 2 for c in counts.values())
    else:
        assert all(c == 1 for c in counts.values()), "a sample was delivered twice"
        assert len(delivered) == n - n % world


def mod_manifest(root: Path, edit: Any, *, redigest: bool = True) -> None:
    path = root / "manifest.json"
    data = json.loads(path.read_bytes())
    edit(data)
    if redigest:
        data["manifest_digest"] = _body_digest(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


# --- real torch.distributed (gloo) jobs ------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _group_members(groups: list[int]) -> list[int]:
    """Live processes whose process group is one of ``groups`` (leaders first)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) in groups:  # fields: state, ppid, pgrp, ...
            found.append(int(entry))
    return sorted(found, key=lambda pid: (pid not in groups, pid))


def launch(world: int, runs: list[dict[str, Any]], work: Path, timeout: float = 120.0,
           ) -> list[dict[str, Any]]:
    """Run ``_dist_rank.py`` as ``world`` real processes joined by a gloo process group; return
    each rank's result.  A failing rank, or a job that overruns ``timeout`` (it takes 2-20 s),
    fails the test with every rank's output and, for a hang, every thread's stack in every
    process of every rank."""
    work.mkdir(parents=True, exist_ok=True)
    spec = work / "spec.json"
    spec.write_text(json.dumps({"runs": runs}))
    for _attempt in range(3):
        port = free_port()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if os.path.exists("/sys/class/net/lo"):
            env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        procs, logs = [], []
        for r in range(world):
            out = open(work / f"rank{r}.stdout", "w")
            err = open(work / f"rank{r}.stderr", "w")
            logs.append((out, err))
            # Each rank leads its own process group (with its DataLoader workers), so that a
            # hang can be dumped and killed as a whole.
            procs.append(subprocess.Popen(
                [sys.executable, str(RANK_SCRIPT), str(spec), str(work / f"rank{r}.json")],
                env=dict(env, RANK=str(r), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world)),
                stdout=out, stderr=err, cwd=str(ROOT),
                start_new_session=True))
        deadline = time.monotonic() + timeout
        timed_out = False
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        if timed_out:
            # Every process of a hung rank (the rank and its DataLoader workers) prints the stack
            # of each of its threads (faulthandler on SIGUSR1, see _dist_rank.py), then dies.
            for pid in _group_members([p.pid for p in procs]):
                try:
                    os.kill(pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass
                time.sleep(0.5)  # one at a time: the dumps share the rank's stderr
            for p in procs:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p in procs:
                p.wait(timeout=30)
        for out, err in logs:
            out.close()
            err.close()
        report = "".join(
            f"\n--- rank {r} exit {p.returncode} ---\nstdout:\n"
            f"{(work / f'rank{r}.stdout').read_text()}\nstderr:\n"
            f"{(work / f'rank{r}.stderr').read_text()[-12000:]}"
            for r, p in enumerate(procs))
        if not timed_out and all(p.returncode == 0 for p in procs):
            return [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]
        if not timed_out and ("EADDRINUSE" in report or "ddress already in use" in report):
            continue  # another process took the port between free_port() and bind: retry
        print(report)
        pytest.fail(f"gloo job of {world} ranks "
                    f"{'timed out after %.0fs' % timeout if timed_out else 'failed'}:{report}")
    pytest.fail("could not find a free port for the gloo job")


SEED, EPOCH = 7, 1


@pytest.fixture(scope="module")
def gloo_world4(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """World 4 x 2 workers, batch 8: stops after 4 batches and checkpoints (first half of the
    resume test)."""
    runs = [dict(name="part1", data=str(tiny), batch_size=8, workers=2, seed=SEED, epoch=EPOCH,
                 max_batches=4)]
    return launch(4, runs, tmp_path_factory.mktemp("gloo4"))


@pytest.fixture(scope="module")
def gloo_world3(tiny: Path, few: Path, gloo_world4: list[dict[str, Any]],
                tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """World 3 x 2 workers: full epochs with pad and drop, a dataset with fewer shards than
    ranks, and the resume (3 workers, batch 5) of the world-4 checkpoint."""
    work = tmp_path_factory.mktemp("gloo3")
    state = work / "state.json"
    state.write_text(json.dumps(gloo_world4[0]["runs"]["part1"]["state"]))
    runs = [
        dict(name="pad", data=str(tiny), batch_size=8, workers=2, seed=SEED, epoch=EPOCH),
        dict(name="drop", data=str(tiny), batch_size=8, workers=2, seed=SEED, epoch=EPOCH,
             remainder="drop"),
        dict(name="few", data=str(few), batch_size=2, workers=2),
        dict(name="few_drop", data=str(few), batch_size=2, workers=2, remainder="drop"),
        dict(name="resume", data=str(tiny), batch_size=5, workers=3, seed=SEED,
             state_in=str(state)),
    ]
    return launch(3, runs, work)


@pytest.fixture(scope="module")
def gloo_world3_again(tiny: Path, gloo_world3: list[dict[str, Any]],
                      tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """A second, independent world-3 job: the same epoch with 2 and with 3 workers, and under
    ShardLoader (with pad and drop)."""
    runs = [
        dict(name="pad", data=str(tiny), batch_size=8, workers=2, seed=SEED, epoch=EPOCH),
        dict(name="pad_w3", data=str(tiny), batch_size=8, workers=3, seed=SEED, epoch=EPOCH),
        dict(name="sl_pad", data=str(tiny), batch_size=8, workers=2, seed=SEED, epoch=EPOCH,
             loader="shardloader"),
        dict(name="sl_drop", data=str(tiny), batch_size=8, workers=3, seed=SEED, epoch=EPOCH,
             remainder="drop", loader="shardloader"),
    ]
    return launch(3, runs, tmp_path_factory.mktemp("gloo3b"))


def runs_of(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    assert [r["rank"] for r in results] == list(range(len(results)))
    return [r["runs"][name] for r in results]


def check_equal_shares(runs: list[dict[str, Any]]) -> None:
    """Every rank: same batch count (also seen by all_reduce MIN == MAX), same sample count,
    and len(dataset) / len(dataloader) say what was delivered."""
    world = len(runs)
    nbatches = {len(r["batches"]) for r in runs}
    nsamples = {len(flat(r["batches"])) for r in runs}
    assert len(nbatches) == 1 and len(nsamples) == 1, (nbatches, nsamples)
    for rank, r in enumerate(runs):
        # The rank came from the process group, the node layout from torchrun's variables.
        assert r["topology"] == [rank, world, rank, world]
        assert r["batches_min"] == r["batches_max"] == len(r["batches"])
        assert r["len"] == len(flat(r["batches"]))
        assert r["dl_len"] == len(r["batches"])


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_gloo_world3_every_sample_once(remainder: str, tiny: Path,
                                       gloo_world3: list[dict[str, Any]]) -> None:
    runs = runs_of(gloo_world3, remainder)
    check_equal_shares(runs)
    delivered = [k for r in runs for k in flat(r["batches"])]
    check_epoch_cover(delivered, manifest_keys(tiny), 3, remainder)
    if remainder == "pad":
        assert len(runs[0]["batches"]) == 13 and runs[0]["len"] == 101  # ceil(301/3) in 8s
    else:
        assert runs[0]["len"] == 100
    # Exactly the partition the contract defines (ranks take slices of global steps).
    order = epoch_keys(tiny, seed=SEED, epoch=EPOCH)
    for rank, r in enumerate(runs):
        assert r["batches"] == expected_rank_batches(order, 0, 3, rank, 8, remainder)


def test_gloo_more_ranks_than_shards(few: Path, gloo_world3: list[dict[str, Any]]) -> None:
    assert shardio.open_dataset(few).num_shards == 2
    for name, remainder in (("few", "pad"), ("few_drop", "drop")):
        runs = runs_of(gloo_world3, name)
        check_equal_shares(runs)
        delivered = [k for r in runs for k in flat(r["batches"])]
        check_epoch_cover(delivered, manifest_keys(few), 3, remainder)
        assert runs[0]["len"] == (4 if remainder == "pad" else 3)


def test_gloo_order_is_deterministic_and_independent_of_workers(
        gloo_world3: list[dict[str, Any]], gloo_world3_again: list[dict[str, Any]]) -> None:
    first = runs_of(gloo_world3, "pad")
    again = runs_of(gloo_world3_again, "pad")
    w3 = runs_of(gloo_world3_again, "pad_w3")
    for rank in range(3):
        assert again[rank]["batches"] == first[rank]["batches"]
        assert w3[rank]["batches"] == first[rank]["batches"]
    check_equal_shares(w3)


@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_gloo_shardloader_delivers_the_dataloader_partition(
        remainder: str, gloo_world3: list[dict[str, Any]],
        gloo_world3_again: list[dict[str, Any]]) -> None:
    """ShardLoader in a real 3-rank job (its workers forked from a process that runs gloo's
    threads) yields on every rank exactly DataLoader's batches, as many on every rank."""
    dataloader = runs_of(gloo_world3, remainder)
    shardloader = runs_of(gloo_world3_again, f"sl_{remainder}")
    assert {r["loader"] for r in shardloader} == {"ShardLoader"}
    assert {r["loader"] for r in dataloader} == {"DataLoader"}
    check_equal_shares(shardloader)
    for rank in range(3):
        assert shardloader[rank]["batches"] == dataloader[rank]["batches"]


def test_gloo_resume_world4_to_world3(tiny: Path, gloo_world4: list[dict[str, Any]],
                                      gloo_world3: list[dict[str, Any]]) -> None:
    """4 ranks x 2 workers x batch 8 stop after 4 batches; 3 ranks x 3 workers x batch 5 resume
    from the checkpoint: together exactly one epoch (plus the pad repeats of the resumed part)."""
    before = runs_of(gloo_world4, "part1")
    after = runs_of(gloo_world3, "resume")
    states = [r["state"] for r in before]
    assert all(s == states[0] for s in states)  # every rank writes the same checkpoint
    cursor = 4 * 4 * 8
    assert states[0]["cursor"] == cursor and states[0]["epoch"] == EPOCH
    assert all(len(r["batches"]) == 4 for r in before)
    check_equal_shares(after)
    order = epoch_keys(tiny, seed=SEED, epoch=EPOCH)
    first = [k for r in before for k in flat(r["batches"])]
    assert sorted(first) == sorted(order[:cursor])  # the checkpoint names an exact prefix
    rest = [k for r in after for k in flat(r["batches"])]
    m = N - cursor
    pad = (-m) % 3
    counts = Counter(rest)
    assert set(counts) == set(order[cursor:]) and len(rest) == m + pad
    # Padding repeats the start of the remaining order, never something already delivered.
    assert sorted(k for k, c in counts.items() if c > 1) == sorted(order[cursor:cursor + pad])
    assert Counter(first + rest) == Counter(order) + Counter(order[cursor:cursor + pad])
    for rank, r in enumerate(after):
        assert r["batches"] == expected_rank_batches(order, cursor, 3, rank, 5, "pad")


# --- one process, DataLoader workers ---------------------------------------------------------
@pytest.mark.parametrize("workers", [0, 2])
def test_single_process_every_sample_once(tiny: Path, workers: int) -> None:
    ds = shardio.ShardDataset(tiny, batch_size=16, seed=3)
    assert ds.topology == shardio.Topology()
    batches = load_batches(ds, 16, workers)
    keys = flat(batches)
    assert len(keys) == N == len(ds) and len(set(keys)) == N
    assert set(keys) == set(manifest_keys(tiny))
    assert [len(b) for b in batches] == [16] * (N // 16) + [N % 16]
    # The order is the contract's, whatever the worker count.
    assert keys == epoch_keys(tiny, seed=3)
    assert keys != manifest_keys(tiny)


def run_ranks(root: Path, world: int, batch: int, workers: int, *, remainder: str = "pad",
              state: dict[str, Any] | None = None, max_batches: int | None = None,
              **options: Any) -> tuple[list[list[list[str]]], list[shardio.ShardDataset]]:
    """Every rank of a ``world``-rank job, one after another in this process (explicit
    Topology), each through its own DataLoader."""
    out, sets = [], []
    for rank in range(world):
        ds = shardio.ShardDataset(root, batch_size=batch, remainder=remainder,
                                  topology=shardio.Topology(rank=rank, world_size=world),
                                  **options)
        if state is not None:
            ds.load_state_dict(state)
        out.append(load_batches(ds, batch, workers, max_batches))
        sets.append(ds)
    return out, sets


# 3 workers on a 2-CPU machine is what the test is about: torch's advice against it is noise here.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("remainder", ["pad", "drop"])
def test_resume_world4_workers2_to_world3_workers3(tiny: Path, remainder: str) -> None:
    k, opts = 3, dict(seed=11)
    before, sets = run_ranks(tiny, 4, 8, 2, remainder=remainder, max_batches=k, **opts)
    assert all(len(b) == k for b in before)
    states = [ds.state_dict(batches=k) for ds in sets]
    assert all(s == states[0] for s in states)
    cursor = k * 4 * 8
    assert states[0]["cursor"] == cursor
    state = json.loads(json.dumps(states[0]))  # a checkpoint goes through a file
    resumed = shardio.ShardDataset(tiny, batch_size=5, remainder=remainder,
                                   topology=shardio.Topology(rank=0, world_size=3), **opts)
    resumed.load_state_dict(state)
    expected_len = len(resumed)
    after, later = run_ranks(tiny, 3, 5, 3, remainder=remainder, state=state, **opts)
    assert len({len(b) for b in after}) == 1
    assert len({len(flat(b)) for b in after}) == 1 and expected_len == len(flat(after[0]))
    # The resumed epoch was delivered: the next iteration replays the whole epoch.
    whole = shardio.ShardDataset(tiny, batch_size=5, remainder=remainder,
                                 topology=shardio.Topology(rank=0, world_size=3), **opts)
    assert len(later[0]) == len(whole)

    order = epoch_keys(tiny, seed=11)
    first = [x for b in before for x in flat(b)]
    rest = [x for b in after for x in flat(b)]
    assert sorted(first) == sorted(order[:cursor])
    m = N - cursor
    if remainder == "pad":
        pad = (-m) % 3
        assert Counter(first + rest) == Counter(order) + Counter(order[cursor:cursor + pad])
    else:
        assert len(rest) == m - m % 3 and len(set(first + rest)) == len(first + rest)
        assert set(rest) == set(order[cursor:N - m % 3])
    for rank in range(3):
        assert after[rank] == expected_rank_batches(order, cursor, 3, rank, 5, remainder)


def test_state_dict_counted_automatically_without_workers(tiny: Path) -> None:
    ds = shardio.ShardDataset(tiny, batch_size=7, seed=2)
    before = load_batches(ds, 7, 0, max_batches=4)
    state = ds.state_dict()
    assert state == ds.state_dict(batches=4)
    assert state["cursor"] == 28 and state["epoch"] == 0
    resumed = shardio.ShardDataset(tiny, batch_size=10, seed=2)
    resumed.load_state_dict(state)
    assert len(resumed) == N - 28
    after = load_batches(resumed, 10, 2)
    order = epoch_keys(tiny, seed=2)
    assert flat(before) + flat(after) == order
    # A checkpoint taken mid-way through the resumed run continues from there.
    again = shardio.ShardDataset(tiny, batch_size=10, seed=2)
    again.load_state_dict(state)
    part = load_batches(again, 10, 0, max_batches=5)
    state2 = again.state_dict()
    assert state2["cursor"] == 28 + 50
    third = shardio.ShardDataset(tiny, batch_size=3, seed=2)
    third.load_state_dict(state2)
    assert flat(before) + flat(part) + flat(load_batches(third, 3, 2)) == order


@pytest.mark.parametrize("workers", [0, 2])
def test_checkpoint_in_the_loop_of_a_resumed_epoch(tiny: Path, workers: int) -> None:
    """The README's loop, ``state_dict(batches=step + 1)`` after every step, in an epoch that was
    itself resumed: the checkpoint after the last step resumes nothing.  (With num_workers=0,
    DataLoader runs the iterator to its end while collating the partial last batch, before the
    loop sees it; the epoch's end put the resume point back to 0, and the last checkpoint
    counted from there: it replayed most of the epoch.)"""
    probe = shardio.ShardDataset(tiny, batch_size=8)
    load_batches(probe, 8, 0, max_batches=20)
    ds = shardio.ShardDataset(tiny, batch_size=8)
    ds.load_state_dict(probe.state_dict())  # resumed at 160 of 301
    states = []
    for step, _batch in enumerate(DataLoader(ds, batch_size=8, num_workers=workers,
                                             collate_fn=collate_keys)):
        states.append(ds.state_dict(batches=step + 1))
    assert [s["cursor"] for s in states] == [min(160 + 8 * k, N) for k in range(1, 19)]
    again = shardio.ShardDataset(tiny, batch_size=8)
    again.load_state_dict(states[-1])
    assert len(again) == 0 and flat(load_batches(again, 8, 0)) == []


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_state_dict_after_a_complete_epoch_resumes_nothing(tiny: Path, resumed: bool) -> None:
    """After the whole epoch was delivered, "the rest" is empty: a job resumed from that
    checkpoint must not replay any sample of the epoch (the last batch is partial: 301 = 37*8+5)."""
    ds = shardio.ShardDataset(tiny, batch_size=8)
    if resumed:
        probe = shardio.ShardDataset(tiny, batch_size=8)
        load_batches(probe, 8, 0, max_batches=3)
        ds.load_state_dict(probe.state_dict())
    assert len(flat(load_batches(ds, 8, 0))) == (N - 24 if resumed else N)
    state = ds.state_dict()
    again = shardio.ShardDataset(tiny, batch_size=8)
    again.load_state_dict(state)
    assert flat(load_batches(again, 8, 0)) == []
    # The next epoch is complete.
    again.set_epoch(1)
    assert sorted(flat(load_batches(again, 8, 0))) == sorted(manifest_keys(tiny))
    # A checkpoint taken after set_epoch(), before the first batch, starts the new epoch.
    ds.set_epoch(1)
    assert (ds.state_dict()["epoch"], ds.state_dict()["cursor"]) == (1, 0)


def test_state_dict_after_taking_every_sample_without_exhausting(tiny: Path) -> None:
    """Direct iteration that takes all 301 samples but never asks for a 302nd."""
    from itertools import islice

    ds = shardio.ShardDataset(tiny, batch_size=8)
    taken = list(islice(iter(ds), N))
    assert len(taken) == N
    assert ds.state_dict()["cursor"] == N
    # Mid-batch, the partial batch is not counted as consumed (it would be delivered again).
    ds2 = shardio.ShardDataset(tiny, batch_size=8)
    it = iter(ds2)
    list(islice(it, 13))
    assert ds2.state_dict()["cursor"] == 8


@pytest.mark.parametrize("peek", [False, True])
def test_state_dict_needs_batches_when_iterated_in_workers(tiny: Path, peek: bool) -> None:
    """Also after a look at one sample in this process first: that iteration is not the one
    the workers delivered (state_dict() counted the peek, and said cursor 0)."""
    ds = shardio.ShardDataset(tiny, batch_size=8)
    if peek:
        next(iter(ds))
    load_batches(ds, 8, 2, max_batches=2)
    with pytest.raises(UsageError, match=r"state_dict\(batches="):
        ds.state_dict()
    assert ds.state_dict(batches=2)["cursor"] == 16


def test_bad_numbers_are_usage_errors(tiny: Path) -> None:
    for kwargs in ({"seed": None}, {"seed": -1}, {"batch_size": 2.5}, {"batch_size": "8"},
                   {"shuffle_block": None}, {"image_mode": "rgb"}):
        with pytest.raises(UsageError):
            shardio.ShardDataset(tiny, **kwargs)
    ds = shardio.ShardDataset(tiny)
    with pytest.raises(UsageError, match="2\\*\\*63"):
        ds.set_epoch(2**64)  # (wrapped round to epoch 0 in the shared int64)
    ds.set_epoch(2**63 - 1)
    assert ds.epoch == 2**63 - 1


def test_load_state_dict_rejects_another_order_or_dataset(tiny: Path, few: Path) -> None:
    state = shardio.ShardDataset(tiny, seed=1).state_dict(batches=0)
    with pytest.raises(UsageError, match="seed"):
        shardio.ShardDataset(tiny, seed=2).load_state_dict(state)
    with pytest.raises(UsageError, match="shuffle_block"):
        shardio.ShardDataset(tiny, seed=1, shuffle_block=64).load_state_dict(state)
    with pytest.raises(UsageError, match="dataset"):
        shardio.ShardDataset(few, seed=1).load_state_dict(state)
    with pytest.raises(UsageError):
        shardio.ShardDataset(tiny, seed=1).load_state_dict({"version": 99})
    # A state that is not the dict (the JSON text, None) or lacks a key: typed, naming the fix.
    with pytest.raises(UsageError, match=r"json.loads"):
        shardio.ShardDataset(tiny, seed=1).load_state_dict(json.dumps(state))
    with pytest.raises(UsageError, match="NoneType"):
        shardio.ShardDataset(tiny, seed=1).load_state_dict(None)
    with pytest.raises(UsageError, match="lacks cursor"):
        shardio.ShardDataset(tiny, seed=1).load_state_dict(
            {k: v for k, v in state.items() if k != "cursor"})


def test_a_state_of_another_dataset_with_as_many_samples_is_refused(
        tiny: Path, tmp_path: Path) -> None:
    """The same 301 files packed 7 to a shard hold other samples at each index: a checkpoint of
    one resumed on the other delivered some samples twice and lost others."""
    state = shardio.ShardDataset(tiny, seed=1, batch_size=8).state_dict(batches=3)
    repacked = pack_text(tmp_path, N, 7)
    assert shardio.Manifest.load(repacked).num_samples == N
    other = shardio.ShardDataset(repacked, seed=1, batch_size=8)
    with pytest.raises(UsageError, match="another dataset with as many samples"):
        other.load_state_dict(state)
    assert (other.epoch, other._cursor) == (0, 0)  # a refused state changes nothing
    same = shardio.ShardDataset(tiny, seed=1, batch_size=8)  # another object, the same data
    same.load_state_dict(state)
    assert same._cursor == 24
    older = {k: v for k, v in state.items() if k != "dataset"}  # written before the field
    shardio.ShardDataset(repacked, seed=1, batch_size=8).load_state_dict(older)


@pytest.mark.parametrize("change,match", [
    ({"cursor": -5}, "cursor must be an integer"),
    ({"cursor": N + 1}, "cursor must be an integer"),
    ({"cursor": None}, "cursor must be an integer"),
    ({"cursor": 2.0}, "cursor must be an integer"),
    ({"epoch": -1}, "epoch must be an integer"),
    ({"epoch": "3"}, "epoch must be an integer"),
    ({"order": {}}, "not one state_dict"),
    ({"order": "global"}, "not one state_dict"),
])
def test_a_malformed_state_is_refused_and_changes_nothing(tiny: Path, change: dict[str, Any],
                                                          match: str) -> None:
    """They loaded (a cursor past the end gave an empty epoch, a negative one a numpy error
    mid-iteration) or raised KeyError/TypeError after the epoch had been changed."""
    state = shardio.ShardDataset(tiny, seed=1, batch_size=8).state_dict(batches=2)
    ds = shardio.ShardDataset(tiny, seed=1, batch_size=8)
    ds.set_epoch(7)
    with pytest.raises(UsageError, match=match):
        ds.load_state_dict(state | change)
    assert (ds.epoch, ds._cursor) == (7, 0)


def test_resumed_under_workers_a_node_order_state_loaded_late_is_seen(tmp_path: Path) -> None:
    """order="node" under DataLoader(persistent_workers=True): a state loaded after the
    workers had settled their own node-order parameters was read against those (80 distinct
    samples of 96, 16 twice); the parameters now live in shared memory like the cursor."""
    root = pack_text(tmp_path, 96, 8)
    saved = shardio.ShardDataset(root, seed=5, batch_size=4, order="node",
                                 topology=shardio.Topology(rank=0, world_size=4, local_rank=0,
                                                           local_world_size=2))
    state = saved.state_dict(batches=3)
    assert state["order"]["canonical_nodes"] == 2
    ds = shardio.ShardDataset(root, seed=5, batch_size=4, order="node")
    dl = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True,
                    collate_fn=collate_keys)
    for _ in dl:  # the workers settle this job's parameters (one node)
        pass
    ds.load_state_dict(state)
    rest = [k for b in dl for k in b]
    fresh = shardio.ShardDataset(root, seed=5, batch_size=4, order="node")
    fresh.load_state_dict(state)  # loaded before anything was settled: the reference
    expected = [s["__key__"] for s in fresh]
    assert 0 < len(expected) < 96 and len(set(expected)) == len(expected)
    assert rest == expected


@pytest.mark.parametrize("persistent", [False, True])
def test_after_a_resume_later_iterations_under_workers_replay_the_whole_epoch(
        tiny: Path, persistent: bool) -> None:
    """Under DataLoader workers, every iteration after load_state_dict() without set_epoch
    started from the loaded position again: 301 - 24 samples each time, where num_workers=0
    (and ShardLoader) replay the whole epoch once the resumed one ended.  The workers now keep
    the books themselves; len() and state_dict(batches=) follow them."""
    whole = epoch_keys(tiny, seed=1)
    ds = shardio.ShardDataset(tiny, seed=1, batch_size=8)
    ds.load_state_dict(shardio.ShardDataset(tiny, seed=1, batch_size=8).state_dict(batches=3))
    dl = DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=persistent,
                    collate_fn=collate_keys)
    assert len(dl) == 35  # (301 - 24) / 8, rounded up
    first = [k for b in dl for k in b]
    assert sorted(first) == sorted(whole[24:])
    assert ds.state_dict(batches=len(first) // 8 + 1)["cursor"] == N  # the resumed epoch ended
    assert len(dl) == 38  # the next iteration replays all 301
    second = flat(load_batches(ds, 8, 2, max_batches=5))  # (a new loader: a new round too)
    assert sorted(second) == sorted(whole[:40])
    assert ds.state_dict(batches=5)["cursor"] == 40  # counted from the epoch's start
    third = [k for b in dl for k in b]  # the broken round above never ended: from 0 again
    assert sorted(third) == sorted(whole)
    ds.load_state_dict(ds.state_dict(batches=2) | {"cursor": 16})
    assert sorted(k for b in dl for k in b) == sorted(whole[16:])


def test_set_epoch_changes_the_order(tiny: Path) -> None:
    ds = shardio.ShardDataset(tiny, batch_size=8, seed=4)
    e0 = flat(load_batches(ds, 8, 2))
    ds.set_epoch(1)
    e1 = flat(load_batches(ds, 8, 2))
    ds.set_epoch(0)
    e0_again = flat(load_batches(ds, 8, 0))
    assert sorted(e0) == sorted(e1) == sorted(manifest_keys(tiny))
    assert e0 != e1
    assert e0_again == e0
    # Iterating again without set_epoch replays the same epoch.
    assert flat(load_batches(ds, 8, 0)) == e0
    assert e1 == epoch_keys(tiny, seed=4, epoch=1)


def test_shuffle_false_is_manifest_order(tiny: Path) -> None:
    ds = shardio.ShardDataset(tiny, batch_size=8, shuffle=False, seed=9, shuffle_block=16)
    ds.set_epoch(3)
    assert flat(load_batches(ds, 8, 2)) == manifest_keys(tiny)


def test_topology_from_environment(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ds = shardio.ShardDataset(tiny, batch_size=8)
    assert (ds.topology.rank, ds.topology.world_size) == (1, 2)
    assert len(ds) == 151
    keys = flat(load_batches(ds, 8, 2))
    assert keys == flat(expected_rank_batches(epoch_keys(tiny), 0, 2, 1, 8, "pad"))


def test_topology_for_a_process_group() -> None:
    """Under torch.distributed the node layout comes from the launcher's variables when they
    fit the group's world, else one rank per node."""
    env = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}
    t = shardio.Topology.for_group(5, 8, env)
    assert (t.rank, t.world_size, t.local_rank, t.local_world_size, t.node) == (5, 8, 1, 4, 1)
    assert shardio.Topology.for_group(5, 8, {}) == shardio.Topology(rank=5, world_size=8)
    assert shardio.Topology.for_group(5, 6, env) == shardio.Topology(rank=5, world_size=6)  # 4 does not divide 6


def test_random_access_agrees_with_iteration(tiny: Path) -> None:
    ds = shardio.ShardDataset(tiny, batch_size=4, seed=1)
    index = {k: i for i, k in enumerate(manifest_keys(tiny))}
    seen = 0
    for sample in ds:
        got = ds[index[sample["__key__"]]]
        assert got == sample
        seen += 1
    assert seen == N
    assert ds[-1] == ds[N - 1]
    with pytest.raises(IndexError):
        ds[N]


def test_random_access_takes_what_a_list_takes(tiny: Path) -> None:
    """An index is taken as a list takes one: ints, bools and numpy integers; negative ones
    from the end; a float (even 2.0), a numpy float or bool, a string is a TypeError (it was
    coerced with int(): ds[2.7] read sample 2), and so is a slice (no list of samples);
    out of range is an IndexError showing the
    index and the valid range."""
    keys = manifest_keys(tiny)
    ds = shardio.ShardDataset(tiny, shuffle=False)
    with shardio.open_dataset(tiny) as reader:
        shard0 = reader.shard(0)
        for seq, n, get in [(ds, N, lambda x: x["__key__"]),
                            (reader, N, lambda x: x["__key__"]),
                            (shard0, len(shard0), lambda x: x["__key__"])]:
            want = keys[:n]
            for i in [0, 1, n - 1, -1, -n, True, False, np.int64(3), np.uint8(2), np.int32(-2),
                      np.array(4)]:
                assert get(seq[i]) == want[i], i  # what the list of keys gives
            for bad in [2.0, 2.7, np.float64(1.0), "3", None, np.bool_(True), slice(0, 2)]:
                if type(bad) is not slice:  # (a list takes a slice; random access does not)
                    with pytest.raises(TypeError):
                        want[bad]  # type: ignore[index]
                with pytest.raises(TypeError, match=f"must be integers.*{type(bad).__name__}"):
                    seq[bad]
            for bad in [n, n + 7, -n - 1, np.int64(-n - 1)]:
                with pytest.raises(IndexError):
                    want[bad]
                with pytest.raises(IndexError) as ei:
                    seq[bad]
                assert f"sample index {int(bad)} out of range" in str(ei.value)
                assert f"valid indices: {-n}..{n - 1}" in str(ei.value)
        assert reader.locate(-1) == (reader.num_shards - 1, N - 1 - int(reader.offsets[-2]))
        assert reader.locate(np.int64(9)) == reader.locate(9)
        with pytest.raises(TypeError):
            reader.locate(9.0)


def test_decode_images_and_labels(image_tree: Path, tmp_path: Path) -> None:
    from PIL import Image

    out = tmp_path / "img"
    shardio.pack(image_tree, out, label_from_dir=True, samples_per_shard=8, fsync=False,
                 progress=False)
    ds = shardio.ShardDataset(out, decode=True)
    classes = sorted(p.name for p in image_tree.iterdir())
    n = 0
    for sample in ds:
        img, cls = sample["jpg"], sample["cls"]
        assert isinstance(img, np.ndarray) and img.dtype == np.uint8
        assert img.ndim == 3 and img.shape[2] == 3
        assert img.flags.writeable  # (it was not: torch warned at from_numpy)
        assert type(cls) is int
        cdir = sample["__key__"].split("/")[0]
        assert cls == classes.index(cdir)
        with Image.open(image_tree / f"{sample['__key__']}.jpg") as ref:
            np.testing.assert_array_equal(img, np.asarray(ref.convert("RGB")))
        n += 1
    assert n == 60
    # Through DataLoader workers too; raw mode gives the stored bytes.
    dl = DataLoader(shardio.ShardDataset(out, decode=True, batch_size=4), batch_size=4,
                    num_workers=2, collate_fn=list)
    shapes = [s["jpg"].shape for b in dl for s in b]
    assert len(shapes) == 60 and all(len(s) == 3 for s in shapes)
    raw = shardio.ShardDataset(out)[0]
    assert bytes(raw["jpg"]) == (image_tree / f"{raw['__key__']}.jpg").read_bytes()


def test_pickle_field_needs_allow_pickle(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"p{i}.pickle").write_bytes(pickle.dumps({"i": i, "sq": [i * i]}))
        (src / f"p{i}.txt").write_text(str(i))
    out = tmp_path / "ds"
    shardio.pack(src, out, samples_per_shard=4, fsync=False, progress=False)
    # The error names the sample as well as the field.
    with pytest.raises(UsageError,
                       match=r"sample 'p\d': field 'pickle' is a pickle.*allow_pickle=True"):
        next(iter(shardio.ShardDataset(out, decode=True)))
    with pytest.raises(UsageError, match="sample 'p0': field 'pickle' .*allow_pickle"):
        shardio.ShardDataset(out, decode=True)[0]
    got = {s["txt"]: s["pickle"] for s in shardio.ShardDataset(out, decode=True,
                                                               allow_pickle=True)}
    assert got == {str(i): {"i": i, "sq": [i * i]} for i in range(6)}
    # Raw mode never unpickles: bytes pass through.
    raw = next(iter(shardio.ShardDataset(out)))
    assert isinstance(raw["pickle"], (bytes, bytearray, memoryview))


def key_and_length(sample: dict[str, Any]) -> tuple[str, int]:
    """A module-level transform (picklable for worker processes)."""
    return sample["__key__"].upper(), len(sample["txt"]) + sample["cls"] * 1000


def test_transform_is_applied(tiny: Path) -> None:
    ds = shardio.ShardDataset(tiny, decode=True, transform=key_and_length, batch_size=8)
    dl = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list)
    got = [x for b in dl for x in b]
    assert len(got) == N
    expect = {}
    for s in shardio.ShardDataset(tiny, decode=True):
        expect[s["__key__"].upper()] = len(s["txt"]) + s["cls"] * 1000
    assert dict(got) == expect
    assert ds[0] == key_and_length(shardio.ShardDataset(tiny, decode=True)[0])


def test_indexes_are_numpy_arrays(tiny: Path) -> None:
    ds = shardio.ShardDataset(tiny)
    reader = ds.reader
    assert isinstance(reader.offsets, np.ndarray)
    for i in (0, reader.num_shards - 1):
        index = reader.shard(i).index
        for name in ("key_offsets", "sample_start", "f_name", "f_flags", "f_offset", "f_length",
                     "f_raw_length", "f_checksum"):
            assert isinstance(getattr(index, name), np.ndarray), name
        assert isinstance(index.key_blob, bytes)
    # What a worker process receives carries no open shard and no per-sample Python objects.
    blob = pickle.dumps(ds)
    assert len(blob) < 64 * 1024
    assert len(pickle.loads(blob).reader._readers) == 0


# --- bad datasets: typed errors that say what to do ------------------------------------------
def test_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestNotFoundError, match="shardio pack") as err:
        shardio.ShardDataset(tmp_path / "nowhere")
    assert isinstance(err.value, FileNotFoundError)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ManifestNotFoundError, match="manifest"):
        shardio.ShardDataset(tmp_path / "empty")


def test_corrupt_manifest_json(small: Path) -> None:
    path = small / "manifest.json"
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(ManifestCorruptError, match="not valid JSON.*restore it or repack"):
        shardio.ShardDataset(small)


def test_edited_manifest_fails_its_digest(small: Path) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["shards"][0]["samples"] += 1

    mod_manifest(small, edit, redigest=False)
    with pytest.raises(ManifestCorruptError, match="digest"):
        shardio.ShardDataset(small)


@pytest.mark.parametrize("version", [2, 1000])
def test_newer_manifest_version(small: Path, version: int) -> None:
    mod_manifest(small, lambda d: d.update(version=version))
    with pytest.raises(ManifestVersionError, match=f"version {version}.*upgrade shardio"):
        shardio.ShardDataset(small)


@pytest.mark.parametrize("version", [0, -1, "1", None, 1.5])
def test_invalid_manifest_version(small: Path, version: Any) -> None:
    mod_manifest(small, lambda d: d.update(version=version))
    with pytest.raises(ManifestError, match="version") as err:
        shardio.ShardDataset(small)
    assert isinstance(err.value, (ManifestCorruptError, ManifestVersionError))


def first_shard(root: Path) -> Path:
    return root / json.loads((root / "manifest.json").read_bytes())["shards"][0]["path"]


@pytest.mark.parametrize("workers", [0, 1])  # a worker's error costs torch 5 s per worker
def test_missing_shard(small: Path, workers: int) -> None:
    shard = first_shard(small)
    shard.unlink()
    ds = shardio.ShardDataset(small, batch_size=4)  # the manifest alone is fine
    with pytest.raises(ShardNotFoundError, match=f"{shard.name}.*missing.*restore") as err:
        load_batches(ds, 4, workers)
    assert isinstance(err.value, FileNotFoundError)


def test_truncated_shard(small: Path) -> None:
    shard = first_shard(small)
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    ds = shardio.ShardDataset(small, shuffle=False)
    with pytest.raises(ShardTruncatedError, match=f"{shard.name}.*{size // 2} bytes.*{size}.*"
                                                  "restore") as err:
        next(iter(ds))
    assert isinstance(err.value, ShardCorruptError)
    with pytest.raises(ShardTruncatedError):
        ds[0]


@pytest.mark.parametrize("field,bad", [
    ("path", "../outside.tar"),
    ("path", "sub/../../outside.tar"),
    ("path", "/etc/passwd"),
    ("index", "../outside.tar.idx"),
    ("index", "/tmp/x.idx"),
])
def test_unsafe_manifest_paths(small: Path, field: str, bad: str) -> None:
    def edit(d: dict[str, Any]) -> None:
        d["shards"][1][field] = bad

    mod_manifest(small, edit)
    with pytest.raises(UnsafePathError, match="dataset directory") as err:
        shardio.ShardDataset(small)
    assert bad in str(err.value)
    assert isinstance(err.value, ManifestError)


def test_bad_read_options(tiny: Path) -> None:
    with pytest.raises(UsageError, match="remainder"):
        shardio.ShardDataset(tiny, remainder="wrap")
    with pytest.raises(UsageError, match="batch_size"):
        shardio.ShardDataset(tiny, batch_size=0)
    with pytest.raises(UsageError, match="either"):
        shardio.ShardDataset(tiny, shardio.ReadOptions(), seed=1)
    for epoch in (-1, 1.5, "2", None):
        with pytest.raises(UsageError, match="epoch must be an integer"):
            shardio.ShardDataset(tiny).set_epoch(epoch)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="cache_reserve"):
        shardio.ShardDataset(tiny, cache_reserve=None)
    for bad in ({"cache_budget": [1]}, {"cache_budget": True}, {"stage_bandwidth": 1.5}):
        with pytest.raises(UsageError, match="invalid size"):
            shardio.ShardDataset(tiny, **bad)
    # A whole float is a size (800e9 bytes), as numbers often come from a config file.
    assert shardio.ReadOptions(cache_budget=800e9).cache_budget == 800 * 10**9
    from shardio.nodecache import StageOptions

    for bad in ({"reserve": None}, {"poll_interval": None}, {"bandwidth": "fast"}):
        with pytest.raises(UsageError):
            StageOptions(**bad)


def test_persistent_workers_follow_set_epoch_and_resume(tiny: Path) -> None:
    """Workers kept alive across epochs must see set_epoch() and load_state_dict()."""
    ds = shardio.ShardDataset(tiny, batch_size=8, seed=3)
    dl = DataLoader(ds, batch_size=8, num_workers=2, persistent_workers=True,
                    collate_fn=collate_keys)
    e0 = flat(list(dl))
    ds.set_epoch(1)
    e1 = flat(list(dl))
    assert e0 == epoch_keys(tiny, seed=3, epoch=0)
    assert e1 == epoch_keys(tiny, seed=3, epoch=1)
    state = ds.state_dict(batches=5) | {"epoch": 1}
    ds.load_state_dict(state)
    rest = flat(list(dl))
    assert rest == epoch_keys(tiny, seed=3, epoch=1)[5 * 8:]


def test_pickled_copy_keeps_epoch_and_cursor(tiny: Path) -> None:
    ds = shardio.ShardDataset(tiny, batch_size=4, seed=1)
    ds.set_epoch(2)
    ds.load_state_dict(ds.state_dict(batches=3) | {"epoch": 2})
    copy = pickle.loads(pickle.dumps(ds))
    assert (copy.epoch, copy.state_dict(batches=0)["cursor"]) == (2, 12)
    copy.set_epoch(5)
    assert ds.epoch == 2  # a pickled copy is independent


def test_zero_copy_collate_keeps_fields_as_lists(tmp_path: Path) -> None:
    """With zero_copy=True, fields of 4 KiB or more are uint8 arrays of different sizes, which
    torch's default_collate tries (and fails) to stack; zero_copy_collate keeps them a list per
    field, as default_collate does with bytes, and collates the rest as it does."""
    src = tmp_path / "src"
    for i in range(8):
        d = src / f"c{i % 2}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"s{i}.bin").write_bytes(bytes([i]) * (5000 + 100 * i))
    shardio.pack(src, tmp_path / "ds", label_from_dir=True, samples_per_shard=4, fsync=False,
                 progress=False)
    ds = shardio.ShardDataset(tmp_path / "ds", zero_copy=True, shuffle=False)
    with pytest.raises(RuntimeError):
        next(iter(DataLoader(ds, batch_size=4, num_workers=1)))
    batches = list(DataLoader(ds, batch_size=4, num_workers=1,
                              collate_fn=shardio.zero_copy_collate))
    assert len(batches) == 2
    b = batches[0]
    assert isinstance(b["bin"], list) and [len(x) for x in b["bin"]] == [5000, 5200, 5400, 5600]
    assert bytes(b["bin"][1]) == bytes([2]) * 5200
    assert b["__key__"] == ["c0/s0", "c0/s2", "c0/s4", "c0/s6"]
    assert isinstance(b["cls"], list) and b["cls"] == [b"0"] * 4  # small fields: bytes


def test_sixteen_bit_images_are_scaled_not_clipped() -> None:
    """A 16-bit PNG decodes to uint8 by its top 8 bits (Pillow's convert() clipped every value
    above 255: a full gradient came out as 5 levels); image_mode="I" keeps the 16 bits."""
    import io

    from PIL import Image

    from shardio.decode import decode_field

    wide = (np.arange(1024, dtype=np.uint16).reshape(16, 64) * 64)
    buf = io.BytesIO()
    Image.fromarray(wide).save(buf, "PNG")
    rgb = decode_field("png", buf.getvalue())
    assert rgb.shape == (16, 64, 3) and rgb.dtype == np.uint8
    assert np.array_equal(rgb[..., 0], (wide >> 8).astype(np.uint8))
    assert decode_field("png", buf.getvalue(), image_mode="I").max() == wide.max()
    small = io.BytesIO()
    Image.fromarray(np.full((4, 4), 200, np.int32)).save(small, "TIFF")  # 32-bit, 8-bit values
    assert decode_field("tif", small.getvalue()).max() == 200
