"""Job integration: SIGUSR1 (Slurm ``--signal=USR1@120``) saves the loader's exact position, the
next job resumes from it and the epoch is delivered exactly once; CPU discovery for pinning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import shardio
from shardio import PackOptions, pack
from shardio.topology import _parse_cpulist, discover_cpus

ROOT = Path(__file__).resolve().parent.parent

TRAIN = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {root!r})
    import shardio
    ds = shardio.ShardDataset({data!r}, seed=3)
    loader = shardio.ShardLoader(ds, batch_size=4, num_workers=2,
                                 collate_fn=lambda b: [s["__key__"] for s in b])
    state_path = {state!r}
    if os.path.exists(state_path):
        loader.load_state_dict(json.load(open(state_path)))
    loader.save_on_signal(state_path)
    with open({log!r}, "a") as log:
        for batch in loader:
            log.write(json.dumps(batch) + "\\n")
            log.flush()
            time.sleep(0.05)  # the training step
    print("preempted" if loader.preempted else "finished", flush=True)
    loader.close()
""")


@pytest.fixture
def data(image_tree: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    pack(image_tree, out, PackOptions(samples_per_shard=10, fsync=False))
    return out


def test_usr1_saves_a_state_that_resumes_exactly_once(data: Path, tmp_path: Path) -> None:
    state, log = tmp_path / "loader.json", tmp_path / "delivered.jsonl"
    script = tmp_path / "train.py"
    script.write_text(TRAIN.format(root=str(ROOT), data=str(data), state=str(state), log=str(log)))
    job1 = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (log.exists() and len(log.read_text().splitlines()) >= 3):
        assert time.monotonic() < deadline and job1.poll() is None, "job 1 made no progress"
        time.sleep(0.02)
    job1.send_signal(signal.SIGUSR1)  # Slurm's warning before the time limit
    out1, _ = job1.communicate(timeout=60)
    assert job1.returncode == 0 and "preempted" in out1
    first = [k for line in log.read_text().splitlines() for k in json.loads(line)]
    assert json.loads(state.read_text())["cursor"] == len(first)  # exactly what was delivered
    job2 = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert job2.returncode == 0 and "finished" in job2.stdout, job2.stderr
    delivered = [k for line in log.read_text().splitlines() for k in json.loads(line)]
    reference = [s["__key__"] for s in shardio.ShardDataset(data, seed=3)]
    assert delivered == reference  # same order, every sample exactly once across both jobs


def test_signal_outside_an_iteration_saves_at_once(data: Path, tmp_path: Path) -> None:
    got = []
    ds = shardio.ShardDataset(data)
    with shardio.ShardLoader(ds, batch_size=8, num_workers=1) as loader:
        old = signal.getsignal(signal.SIGUSR2)
        try:
            loader.save_on_signal(callback=got.append, signum=signal.SIGUSR2)
            os.kill(os.getpid(), signal.SIGUSR2)
            time.sleep(0.05)
        finally:
            signal.signal(signal.SIGUSR2, old)
    assert got and got[0]["cursor"] == 0 and loader.preempted
    with pytest.raises(shardio.errors.UsageError, match="path= .* or callback="):
        loader.save_on_signal()
    # A folder that is not there failed only when the signal came, and nothing was saved.
    with pytest.raises(shardio.errors.UsageError, match="does not exist; create it"):
        loader.save_on_signal(tmp_path / "no" / "such" / "loader.json")


@pytest.mark.parametrize("workers", [0, 2])
def test_signal_between_iterations_ends_the_next_one(data: Path, tmp_path: Path,
                                                     workers: int) -> None:
    """A stop signal while no iteration runs (before the epoch loop, or between epochs after
    the loop's `if loader.preempted` check) saved the position, and the next iteration then
    delivered the whole epoch that position says is still to come: twice across the resume.
    It ends at once now; a second signal during the save is absorbed (the nested save renamed
    the shared temp file from under the first: ShardIOError out of the handler)."""
    state = tmp_path / "state.json"
    ds = shardio.ShardDataset(data, batch_size=8)
    keys = lambda b: [s["__key__"] for s in b]  # noqa: E731
    old = signal.getsignal(signal.SIGUSR2)
    try:
        with shardio.ShardLoader(ds, 8, num_workers=workers, collate_fn=keys) as loader:
            first = [k for b in loader for k in b]  # epoch 0, whole
            saves = []

            def again(st: dict) -> None:  # a second signal lands inside the first one's save
                saves.append(st)
                if len(saves) == 1:
                    os.kill(os.getpid(), signal.SIGUSR2)

            loader.save_on_signal(state, callback=again, signum=signal.SIGUSR2)
            loader.set_epoch(1)
            os.kill(os.getpid(), signal.SIGUSR2)
            assert loader.preempted and len(saves) == 1
            assert list(loader) == []  # ended at once: nothing of epoch 1 delivered twice
            saved = json.loads(state.read_text())
            assert (saved["epoch"], saved["cursor"]) == (1, 0)
    finally:
        signal.signal(signal.SIGUSR2, old)
    resumed = shardio.ShardLoader(shardio.ShardDataset(data, batch_size=8), 8,
                                  num_workers=workers, collate_fn=keys)
    resumed.load_state_dict(saved)
    epoch1 = [k for b in resumed for k in b]
    resumed.close()
    assert sorted(epoch1) == sorted(first) and len(epoch1) == len(first)


@pytest.mark.parametrize("workers", [0, 2])
def test_signal_during_the_last_step_is_saved_when_the_epoch_ends(data: Path, tmp_path: Path,
                                                                  workers: int) -> None:
    """num_workers=0: a signal that came while the loop held the epoch's last batch was never
    saved (nor loader.preempted set) when the iteration ended; it waited for some later
    iteration.  A job killed during its final evaluation had no loader checkpoint."""
    state = tmp_path / "state.json"
    old = signal.getsignal(signal.SIGUSR2)
    try:
        with shardio.ShardLoader(shardio.ShardDataset(data, batch_size=4), 4,
                                 num_workers=workers) as loader:
            loader.save_on_signal(state, signum=signal.SIGUSR2)
            n = len(loader)
            for i, _batch in enumerate(loader):
                if i == n - 1:
                    os.kill(os.getpid(), signal.SIGUSR2)  # the warning, during the last step
            assert loader.preempted and state.exists()
            saved = json.loads(state.read_text())
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert (saved["epoch"], saved["cursor"]) == (0, loader.dataset.num_samples)


class _SignalMainAt:
    """Worker transform: sends SIGUSR2 to the training process on one key, while the training
    process waits for that key's batch (the worker is slower than the training step)."""

    def __init__(self, key: str) -> None:
        self.key = key

    def __call__(self, sample: dict) -> dict:
        time.sleep(0.02)
        if sample["__key__"] == self.key:
            os.kill(os.getppid(), signal.SIGUSR2)
            time.sleep(0.3)  # the training process handles it before the batch arrives
        return sample


def test_signal_without_stop_saves_and_delivers_every_batch(data: Path) -> None:
    """stop=False: the position is saved and the iteration goes on; the batch that arrived
    while the signal was pending is handed out (it was once dropped, and never redone)."""
    reference = [s["__key__"] for s in shardio.ShardDataset(data, seed=3)]
    ds = shardio.ShardDataset(data, seed=3, transform=_SignalMainAt(reference[14]))
    saved: list[dict] = []
    old = signal.getsignal(signal.SIGUSR2)
    try:
        with shardio.ShardLoader(ds, batch_size=4, num_workers=1,
                                 collate_fn=lambda b: [s["__key__"] for s in b]) as loader:
            loader.save_on_signal(callback=saved.append, signum=signal.SIGUSR2, stop=False)
            got = [k for batch in loader for k in batch]
    finally:
        signal.signal(signal.SIGUSR2, old)
    assert got == reference and loader.preempted
    # Saved once, before the batch holding key 14 (12 on a machine keeping pace; 8 if the
    # signal beat batch 2's arrival).
    assert len(saved) == 1 and saved[0]["cursor"] in (8, 12)


def test_cpu_discovery() -> None:
    assert _parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    nodes = {0: [0, 1, 2, 3], 1: [4, 5, 6, 7]}
    # the NUMA node with most allowed CPUs first; Slurm's per-task count caps the list
    assert discover_cpus({}, allowed={1, 4, 5, 6}, nodes=nodes) == [4, 5, 6, 1]
    assert discover_cpus({"SLURM_CPUS_PER_TASK": "2"}, allowed={1, 4, 5, 6}, nodes=nodes) == [4, 5]
    assert discover_cpus({}, allowed={3, 9}, nodes={}) == [3, 9]
    real = discover_cpus()
    assert real and set(real) <= set(os.sched_getaffinity(0))


def test_loader_pins_workers_with_cpus_auto(data: Path) -> None:
    ds = shardio.ShardDataset(data)
    with shardio.ShardLoader(ds, batch_size=8, num_workers=1, cpus="auto") as loader:
        assert sum(1 for _ in loader) > 0
        [pid] = loader._pool.pids()
        pinned = os.sched_getaffinity(pid)
    assert len(pinned) == 1 and pinned <= set(discover_cpus())
