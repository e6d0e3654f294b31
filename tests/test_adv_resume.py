"""Adversarial resume and order checks: positions set while an iteration runs, and other
corners of ``state_dict``/``load_state_dict`` that the main suites do not reach.

Real components only: datasets packed by ``shardio.pack``, torch's ``DataLoader``, and
``ShardLoader`` with its worker processes.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

import shardio

N = 13  # samples: 3 full batches of 4 and a partial one


def collate_keys(batch: list[dict[str, Any]]) -> list[str]:
    return [s["__key__"] for s in batch]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """13 samples in 4 shards of <= 4."""
    base = tmp_path_factory.mktemp("adv_resume")
    src = base / "src"
    for i in range(N):
        d = src / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"s{i:04d}.txt").write_text(f"sample {i}")
    shardio.pack(src, base / "ds", samples_per_shard=4, label_from_dir=True, fsync=False,
                 progress=False)
    return base / "ds"


def keys(batches: Any) -> list[str]:
    return [k for b in batches for k in b]


def test_set_epoch_before_the_loop_is_over_is_not_a_delivered_epoch(data: Path) -> None:
    """``set_epoch(e + 1)`` called in the loop of epoch ``e`` (before DataLoader ran the
    dataset's iterator to its end): the end of the iteration marked epoch ``e + 1`` as wholly
    delivered, so the checkpoint after the loop resumed an empty epoch (13 samples lost)."""
    ds = shardio.ShardDataset(data, batch_size=4, seed=1)
    dl = DataLoader(ds, batch_size=4, num_workers=0, collate_fn=collate_keys)
    for step, _batch in enumerate(dl):
        if step == len(dl) - 2:
            ds.set_epoch(1)
    state = ds.state_dict()
    assert (state["epoch"], state["cursor"]) == (1, 0)
    resumed = shardio.ShardDataset(data, batch_size=4, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    epoch1 = keys(DataLoader(resumed, batch_size=4, collate_fn=collate_keys))
    assert epoch1 == keys(dl) and sorted(epoch1) == sorted(set(epoch1)) and len(epoch1) == N


def test_a_state_loaded_while_the_dataset_is_iterated_stands(data: Path) -> None:
    """``load_state_dict`` during an iteration in this process: the iteration's end overwrote
    the loaded position (the next iteration replayed the whole epoch, the checkpoint said it was
    all delivered), and the batches after the load counted from the loaded position."""
    state = shardio.ShardDataset(data, batch_size=4, seed=1).state_dict(batches=2)
    ds = shardio.ShardDataset(data, batch_size=4, seed=1)
    for step, _batch in enumerate(DataLoader(ds, batch_size=4, collate_fn=collate_keys)):
        if step == 0:
            ds.load_state_dict(state)
        assert ds.state_dict()["cursor"] == 8
    assert ds.state_dict()["cursor"] == 8 and len(ds) == N - 8
    order = [s["__key__"] for s in shardio.ShardDataset(data, batch_size=4, seed=1)]
    assert keys(DataLoader(ds, batch_size=4, collate_fn=collate_keys)) == order[8:]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_state_loaded_into_a_running_shardloader_stands(data: Path, workers: int) -> None:
    """``ShardLoader.load_state_dict`` during an iteration: its end marked the loaded epoch
    delivered (``state_dict()`` said cursor 13, the next iteration replayed all 13), and the
    batches it handed out after the load were counted from the loaded position."""
    state = shardio.ShardDataset(data, batch_size=4, seed=1).state_dict(batches=2)
    order = [s["__key__"] for s in shardio.ShardDataset(data, batch_size=4, seed=1)]
    ds = shardio.ShardDataset(data, batch_size=4, seed=1)
    with shardio.ShardLoader(ds, 4, num_workers=workers, collate_fn=collate_keys) as loader:
        assert len(keys(loader)) == N  # (a first epoch: the pool is warm)
        for step, _batch in enumerate(loader):
            if step == 0:
                loader.load_state_dict(state)
            assert loader.state_dict()["cursor"] == 8
        assert loader.state_dict()["cursor"] == 8 and len(loader) == 2
        assert keys(loader) == order[8:]
        assert loader.state_dict()["cursor"] == N


def test_state_dict_refuses_a_batch_count_the_epoch_cannot_have(data: Path) -> None:
    """``state_dict(batches=global_step)`` (the run's count, not the epoch's) in the second
    epoch was clipped to the epoch's end: the checkpoint said epoch 1 was over after 2 of its 4
    batches, and the resumed job skipped the other 9 samples.  Negative, fractional, bool and
    string counts were taken too (-1 and 2.5 as silently wrong positions)."""
    from shardio.errors import UsageError

    ds = shardio.ShardDataset(data, batch_size=4, seed=1)
    ds.set_epoch(1)
    dl = DataLoader(ds, batch_size=4, num_workers=1, collate_fn=collate_keys)
    for step, _batch in enumerate(dl):
        if step == 1:
            with pytest.raises(UsageError, match=r"integer in \[0, 4\].*whole run"):
                ds.state_dict(batches=4 + step + 1)  # epoch 0's 4 batches counted in
            assert ds.state_dict(batches=step + 1)["cursor"] == 8
    for bad in (-1, 2.5, True, "3", 5):
        with pytest.raises(UsageError, match="batches must be an integer"):
            ds.state_dict(batches=bad)
    assert ds.state_dict(batches=4)["cursor"] == N


def node_dataset(root: Path, remainder: str, rank: int = 0) -> shardio.ShardDataset:
    return shardio.ShardDataset(root, batch_size=2, seed=1, order="node", remainder=remainder,
                                topology=shardio.Topology(rank=rank, world_size=4,
                                                          local_rank=rank % 2,
                                                          local_world_size=2))


def test_a_node_order_state_is_not_resumed_under_another_remainder(tmp_path: Path) -> None:
    """order="node": the epoch's order depends on the remainder (its groups are cut for the
    last round), which the state did not record.  A checkpoint of a "pad" job resumed with
    "drop" delivered 4 of 29 samples twice and 4 never (the rest of another order)."""
    from shardio.errors import UsageError

    src = tmp_path / "src"
    for i in range(29):
        (src / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 3}" / f"s{i:04d}.txt").write_text(f"sample {i}")
    root = tmp_path / "ds"
    shardio.pack(src, root, samples_per_shard=4, label_from_dir=True, fsync=False,
                 progress=False)
    first, states = [], []
    for rank in range(4):
        ds = node_dataset(root, "pad", rank)
        got = []
        for batch in DataLoader(ds, batch_size=2, collate_fn=collate_keys):
            got.append(batch)
            if len(got) == 2:
                break
        first += keys(got)
        states.append(ds.state_dict())
    state = json.loads(json.dumps(states[0]))
    assert state["cursor"] == 16 and state["order"]["remainder"] == "pad"
    other = node_dataset(root, "drop")
    other.set_epoch(3)
    with pytest.raises(UsageError, match="remainder='pad' to resume"):
        other.load_state_dict(state)
    assert (other.epoch, other._cursor, other._node_order) == (3, 0, None)  # nothing changed
    rest = []
    for rank in range(4):  # the same remainder resumes exactly the rest
        ds = node_dataset(root, "pad", rank)
        ds.load_state_dict(state)
        rest += keys(DataLoader(ds, batch_size=2, collate_fn=collate_keys))
    counts = Counter(first + rest)
    assert len(counts) == 29 and sum(counts.values()) == 32  # 3 pad repeats
    # At an epoch's boundary the delivered part does not depend on it: loaded as before.
    node_dataset(root, "drop").load_state_dict(state | {"cursor": 29})
    node_dataset(root, "drop").load_state_dict(state | {"cursor": 0})
