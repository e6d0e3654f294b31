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


def _keys(batch: list) -> list:
    return [s["__key__"] for s in batch]


def test_signal_while_workers_start_is_saved_and_stops(data: Path, tmp_path: Path) -> None:
    """A signal that came while the first next() forked the workers found no iteration
    running: it was saved at once (position 0) and the iteration then delivered the whole
    epoch the save says is still to come (twice across the resume)."""
    state = tmp_path / "state.json"
    me, armed = os.getpid(), []

    def before_fork() -> None:  # in the training process, just before a worker's fork
        if armed and os.getpid() == me:
            armed.clear()
            signal.raise_signal(signal.SIGUSR2)  # (its handler runs before this returns)

    os.register_at_fork(before=before_fork)  # (cannot be removed: inert once disarmed)
    old = signal.getsignal(signal.SIGUSR2)
    try:
        with shardio.ShardLoader(shardio.ShardDataset(data, batch_size=8), 8, num_workers=2,
                                 collate_fn=_keys, timeout=60) as loader:  # (never a hang)
            loader.save_on_signal(state, signum=signal.SIGUSR2)
            armed.append(True)
            got = list(loader)
            assert not armed, "no worker was forked"
            assert got == [] and loader.preempted
            assert json.loads(state.read_text())["cursor"] == 0
            assert list(loader) == []  # and so does the next one
    finally:
        armed.clear()
        signal.signal(signal.SIGUSR2, old)


class _SignalAtCall:
    """A LoaderStats clock that raises SIGUSR2 at its ``n``-th reading."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self) -> float:
        self.calls += 1
        if self.calls == self.n:
            signal.raise_signal(signal.SIGUSR2)
        return float(self.calls)


@pytest.mark.parametrize("workers", [0, 2])
def test_signal_after_the_last_check_is_saved_at_the_end(data: Path, tmp_path: Path,
                                                         workers: int) -> None:
    """A signal after the iteration's last look at it (when the loop asks for the batch after
    the last) stayed pending past the end of the epoch: loader.preempted was not set when the
    loop checked it, and nothing was saved until some later iteration began."""
    state = tmp_path / "state.json"
    old = signal.getsignal(signal.SIGUSR2)
    try:
        with shardio.ShardLoader(shardio.ShardDataset(data, batch_size=8), 8,
                                 num_workers=workers, collate_fn=_keys,
                                 timeout=60 if workers else 0) as loader:
            n = len(loader)
            # The clock is read at each request and each hand-out: the (2n+1)-th reading is
            # the last request's, after the iteration's last check of a pending signal.
            loader._stats.clock = _SignalAtCall(2 * n + 1)
            loader.save_on_signal(state, signum=signal.SIGUSR2)
            got = [k for b in loader for k in b]
            assert len(got) == loader.dataset.num_samples  # the whole epoch was handed out
            assert loader.preempted and state.exists()
            saved = json.loads(state.read_text())
            assert (saved["epoch"], saved["cursor"]) == (0, loader.dataset.num_samples)
            loader.set_epoch(1)
            assert list(loader) == []  # the next iteration ends at once
    finally:
        signal.signal(signal.SIGUSR2, old)


def _signal_each_worker(loader: shardio.ShardLoader, signum: int) -> list:
    """One epoch, during which every worker gets ``signum`` (its keys), and one more."""
    it = iter(loader)
    got = next(it) + next(it)  # one batch of each worker: both began this epoch
    pids = loader._pool.pids()
    for pid in pids:
        os.kill(pid, signum)
    time.sleep(0.2)  # (a worker that handles it writes, or dies, by then)
    got += [k for b in it for k in b]
    loader.set_epoch(loader.dataset.epoch + 1)
    assert sum(1 for _ in loader) > 0  # (a worker that died idle is noticed here)
    assert loader._pool.pids() == pids and loader.stats()["restarts"] == 0
    return got


@pytest.mark.parametrize("started", ["after", "before"])
def test_workers_ignore_the_registered_signal(data: Path, tmp_path: Path, started: str) -> None:
    """save_on_signal(signum=SIGHUP): workers forked after the call inherited the loader's
    handler, and one that got the signal wrote the checkpoint itself (from its stale copy of
    the loader); workers started before the call were killed by it (and restarted)."""
    state = tmp_path / "state.json"
    old = signal.getsignal(signal.SIGHUP)
    try:
        with shardio.ShardLoader(shardio.ShardDataset(data, batch_size=4), 4, num_workers=2,
                                 collate_fn=_keys, timeout=60) as loader:
            if started == "before":
                assert sum(1 for _ in loader) > 0  # the workers start (persistent)
                loader.set_epoch(1)
            loader.save_on_signal(state, signum=signal.SIGHUP)
            got = _signal_each_worker(loader, signal.SIGHUP)
            assert sorted(got) == sorted(s["__key__"] for s in loader.dataset)
            assert not state.exists() and not loader.preempted
    finally:
        signal.signal(signal.SIGHUP, old)


def test_the_handler_saves_only_in_its_own_process(data: Path, tmp_path: Path) -> None:
    """A forked child of the training process (a worker before it ignores the signal, or any
    other fork) that got the signal ran the inherited handler and wrote the checkpoint."""
    state = tmp_path / "state.json"
    saved: list[dict] = []
    old = signal.getsignal(signal.SIGUSR2)
    try:
        loader = shardio.ShardLoader(shardio.ShardDataset(data, batch_size=4), 4, num_workers=1)
        loader.save_on_signal(state, callback=saved.append, signum=signal.SIGUSR2)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                signal.raise_signal(signal.SIGUSR2)
                code = 0 if not (state.exists() or saved or loader.preempted) else 3
            finally:
                os._exit(code)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not exit")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not state.exists() and not saved and not loader.preempted
        signal.raise_signal(signal.SIGUSR2)  # in the process that installed it: saved
        assert state.exists() and len(saved) == 1 and loader.preempted
        loader.close()
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_save_on_signal_refuses_a_directory(data: Path, tmp_path: Path) -> None:
    """A directory (or a path ending with '/') was accepted, and the save failed only when the
    signal came: the job lost its checkpoint at the time limit."""
    old = signal.getsignal(signal.SIGUSR2)
    try:
        with shardio.ShardLoader(shardio.ShardDataset(data), 4, num_workers=0) as loader:
            for path in (tmp_path, str(tmp_path), f"{tmp_path}/", f"{tmp_path / 'ckpt'}/"):
                with pytest.raises(shardio.errors.UsageError,
                                   match="is a directory; pass the path"):
                    loader.save_on_signal(path, signum=signal.SIGUSR2)
            loader.save_on_signal(tmp_path / "ckpt.json", signum=signal.SIGUSR2)  # a file: fine
    finally:
        signal.signal(signal.SIGUSR2, old)
