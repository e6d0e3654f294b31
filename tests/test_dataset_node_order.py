"""ShardDataset / ShardLoader with order="node": every sample once per epoch across ranks, each
node reads a small set of shards, exact resume on another job size, and staging follows it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import shardio
from shardio import PackOptions, Topology, pack
from shardio.errors import UsageError


@pytest.fixture
def data(image_tree: Path, tmp_path: Path) -> Path:
    out = tmp_path / "ds"
    pack(image_tree, out, PackOptions(samples_per_shard=3, fsync=False))  # 20 shards
    return out


def topo(rank: int, world: int, local: int) -> Topology:
    return Topology(rank=rank, world_size=world, local_rank=rank % local, local_world_size=local)


def shard_of(root: Path) -> dict[str, int]:
    from shardio.reader import DatasetReader

    with DatasetReader(root) as r:
        return {s["__key__"]: int(np.searchsorted(r.offsets, i, side="right") - 1)
                for i, s in enumerate(r)}


@pytest.mark.parametrize("order", ["global", "node"])
def test_each_sample_once_and_node_locality(data: Path, order: str) -> None:
    world, local, batch = 4, 2, 3
    per_rank = {r: [s["__key__"] for s in shardio.ShardDataset(
        data, seed=5, batch_size=batch, order=order, topology=topo(r, world, local))]
        for r in range(world)}
    got = [k for keys in per_rank.values() for k in keys]
    assert sorted(got) == sorted(shard_of(data))  # 60 samples, divisible by 4: exactly once
    shards = shard_of(data)
    per_node = [{shards[k] for r in (2 * n, 2 * n + 1) for k in per_rank[r]} for n in (0, 1)]
    if order == "node":
        assert not per_node[0] & per_node[1] or len(per_node[0] & per_node[1]) <= 1
        assert max(len(p) for p in per_node) <= 11  # about half of the 20 shards each
    else:
        assert len(per_node[0] & per_node[1]) > 5  # the global shuffle spreads every node


def test_node_order_resumes_on_another_job_size(data: Path) -> None:
    world, local, batch = 4, 2, 3
    ds = [shardio.ShardDataset(data, seed=1, batch_size=batch, order="node",
                               topology=topo(r, world, local)) for r in range(world)]
    its = [iter(d) for d in ds]
    first = [next(it)["__key__"] for it in its for _ in range(batch)]  # one batch per rank
    for d in ds:
        d._delivered = batch
    state = ds[0].state_dict()
    assert state["order"]["kind"] == "node" and state["order"]["canonical_nodes"] == 2
    # resume on 3 ranks of 1 per node: same global order, the rest exactly once
    rest = []
    for r in range(3):
        d = shardio.ShardDataset(data, seed=1, batch_size=2, order="node", topology=topo(r, 3, 1))
        d.load_state_dict(state)
        rest += [s["__key__"] for s in d]
    assert sorted(first + rest) == sorted(shard_of(data))
    plain = shardio.ShardDataset(data, seed=1, batch_size=batch)
    with pytest.raises(UsageError, match="order='node'"):
        plain.load_state_dict(state)


def test_loader_with_node_order_matches_the_dataset(data: Path) -> None:
    t = topo(1, 2, 1)
    ds = shardio.ShardDataset(data, seed=2, batch_size=4, order="node", topology=t)
    expected = [s["__key__"] for s in ds]
    with shardio.ShardLoader(shardio.ShardDataset(data, seed=2, order="node", topology=t),
                             batch_size=4, num_workers=2,
                             collate_fn=lambda b: [s["__key__"] for s in b]) as loader:
        got = [k for b in loader for k in b]
    assert got == expected


@pytest.mark.parametrize("early", ["loader", "dataset"])
def test_a_checkpoint_before_the_first_batch_on_one_rank_does_not_change_its_order(
        data: Path, early: str) -> None:
    """README's ShardLoader example leaves the dataset's batch_size at 1: a state_dict() taken
    by rank 0 alone before its first batch (an initial checkpoint) froze the node order's slice
    size from that batch size on rank 0 only, so the ranks split two different orders: 60
    samples, 2 ranks, 17 lost and 17 delivered twice."""
    keys = lambda b: [s["__key__"] for s in b]  # noqa: E731
    got, states = [], []
    for rank in range(2):
        ds = shardio.ShardDataset(data, seed=2, order="node", topology=topo(rank, 2, 1))
        with shardio.ShardLoader(ds, batch_size=4, num_workers=0, collate_fn=keys) as loader:
            loader.set_epoch(0)
            if rank == 0:
                states.append(loader.state_dict() if early == "loader" else ds.state_dict(0))
            got += [k for b in loader for k in b]
            states.append(loader.state_dict())
    assert sorted(got) == sorted(shard_of(data))  # 60 samples, 2 x 30: each exactly once
    if early == "loader":  # the loader's checkpoint names its own batches' slice size
        assert states[0]["order"] == states[1]["order"] == states[2]["order"]


def test_staged_node_order_copies_only_the_nodes_shards(data: Path, tmp_path: Path) -> None:
    cache = tmp_path / "nvme"
    cache.mkdir()
    ds = shardio.ShardDataset(data, seed=4, batch_size=3, order="node", topology=topo(0, 4, 2),
                              cache_dir=str(cache), cache_reserve=0, stage_lookahead=0)
    counters = ds.stage([0])
    assert 0 < counters["shards_staged"] <= 11  # this node's group, not all 20 shards
    assert len({s["__key__"] for s in ds}) == 15  # rank 0 of 4: a quarter of 60


def test_bad_order_options() -> None:
    with pytest.raises(UsageError, match="order"):
        shardio.ReadOptions(order="random")
    with pytest.raises(UsageError, match="canonical_nodes"):
        shardio.ReadOptions(order="node", canonical_nodes=0)


def test_stage_command_with_node_order(data: Path, tmp_path: Path, cli) -> None:
    cache = tmp_path / "nvme"
    cache.mkdir()
    rc, out, err = cli("stage", data, "--cache", cache, "--epochs", "0", "--reserve", "0",
                       "--seed", "4", "--batch-size", "3", "--order", "node",
                       "--world-size", "4", "--ranks-per-node", "2", "--node", "0")
    assert rc == 0, err
    ds = shardio.ShardDataset(data, seed=4, batch_size=3, order="node", topology=topo(0, 4, 2),
                              cache_dir=str(cache), cache_reserve=0)
    before = ds.io_stats()["repair"]["bytes_original"]
    assert len([s for s in ds]) == 15
    assert ds.io_stats()["repair"]["bytes_original"] == before == 0  # all from the node cache
    copied = int(out.split("copied ")[1].split(" ")[0])
    assert 0 < copied <= 11
    ds._stager.stop()


@pytest.mark.parametrize("args", [["--node", "2"], ["--node", "-1"], ["--world-size", "0"],
                                  ["--ranks-per-node", "-1"], ["--ranks-per-node", "5"]])
def test_stage_command_refuses_an_impossible_job(data: Path, tmp_path: Path, cli,
                                                 args: list[str]) -> None:
    """A prolog with a job layout that cannot exist is a usage error (exit 2), not a run
    that stages nothing and exits 0."""
    cache = tmp_path / "nvme"
    cache.mkdir()
    rc, _out, err = cli("stage", data, "--cache", cache, "--epochs", "0", "--reserve", "0",
                        "--world-size", "4", "--ranks-per-node", "2", *args)
    assert rc == 2 and "error:" in err, (rc, err)
    assert not [p for p in cache.rglob("*") if p.suffix == ".tar"]


@pytest.mark.parametrize("order", ["global", "node"])
def test_stage_in_a_slurm_prolog_step_plans_for_the_training_job(
        data: Path, tmp_path: Path, cli, monkeypatch: pytest.MonkeyPatch, order: str) -> None:
    """`srun --ntasks-per-node=1 shardio stage ... --ranks-per-node 2` (tools/slurm/train.sbatch)
    on node 1 of 2: the step's own variables say 2 tasks, one per node.  The prolog planned for
    that (a job of 2 ranks, 2 per node, has no node 1: exit 2, aborting the job script), or
    without --ranks-per-node for 1 rank per node (13 of 93 needed shards missing); it must
    stage what node 1's ranks of the 4-rank training job read."""
    for k in [k for k in os.environ if k.startswith(("SLURM_", "OMPI_", "PMI_"))] + [
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]:
        monkeypatch.delenv(k, raising=False)
    for k, v in {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0",
                 "SLURM_NTASKS_PER_NODE": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "nvme"
    cache.mkdir()
    rc, out, err = cli("stage", data, "--cache", cache, "--epochs", "0", "--reserve", "0",
                       "--seed", "4", "--batch-size", "3", "--order", order,
                       "--ranks-per-node", "2")
    assert rc == 0, err
    assert out.startswith("node 1:")
    want = set()
    for rank in (2, 3):  # node 1's ranks of the training job
        ds = shardio.ShardDataset(data, seed=4, batch_size=3, order=order,
                                  topology=topo(rank, 4, 2))
        want |= set(ds.schedule(0).shards.tolist())
    names = {e.path: i for i, e in enumerate(shardio.Manifest.load(data).shards)}
    staged = {names[p.name] for p in cache.rglob("*.tar")}
    assert staged == want


def test_a_resumed_node_order_restarts_a_stager_forked_before(data: Path,
                                                              tmp_path: Path) -> None:
    """set_epoch() before load_state_dict() forked the stager with this job's own node order
    (C=2 here); the checkpoint's (C=4) is the one the readers follow, so the stager staged the
    wrong shards for the rest of the job.  It is replaced by one that follows the state."""
    a = shardio.ShardDataset(data, order="node", batch_size=3, topology=topo(0, 4, 1))
    a.set_epoch(3)
    state = a.state_dict(batches=1)
    (tmp_path / "nvme").mkdir()
    b = shardio.ShardDataset(data, order="node", batch_size=3, topology=topo(0, 2, 1),
                             cache_dir=str(tmp_path / "nvme"), cache_reserve=0)
    b.set_epoch(3)
    first = b._stager
    assert first is not None and first.pid is not None
    b.load_state_dict(state)
    assert b._stager is not first and b._stager is not None and b._stager.pid is not None
    assert first.join(10) is not None  # the first one was stopped
    assert b._node_params(3)[0] == 4
    b._stager.stop()
