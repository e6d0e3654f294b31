"""One rank of a real multi-process ``torch.distributed`` (gloo) job over a ``ShardDataset``.

Launched by ``tests/test_dataset.py`` once per rank::

    MASTER_ADDR=127.0.0.1 MASTER_PORT=... RANK=r WORLD_SIZE=R python tests/_dist_rank.py SPEC OUT

``SPEC`` is a JSON file ``{"runs": [run, ...]}``; every rank performs the runs in order, each a
real ``DataLoader`` (with real worker processes, started by a forkserver: see
``WORKERS_CONTEXT``) over a fresh ``ShardDataset``::

    {"name": str, "data": dataset dir, "batch_size": B, "workers": W, "remainder": "pad"|"drop",
     "seed": int, "epoch": int, "max_batches": int|null, "state_in": path|null,
     "loader": "dataloader" (default) | "shardloader"}

With ``"loader": "shardloader"`` the run uses ``shardio.ShardLoader`` (its own workers, forked
from this process) instead of torch's ``DataLoader``.

After every batch the rank does an ``all_reduce`` (like a DDP gradient sync), so a rank with more
batches than another would block; the process group has a short timeout so that shows up as an
error, not a hang.  Each run records the keys of every batch, ``len(dataset)``,
``len(dataloader)``, the min/max batch count over all ranks, and (with ``max_batches``)
``state_dict(batches=max_batches)``.  ``OUT`` gets ``{"rank", "world_size", "runs": {...}}``.
The job ends with a ``barrier`` so every rank proves it reached the end.
"""

from __future__ import annotations

import datetime
import faulthandler
import json
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

import shardio  # noqa: E402


# The DataLoader workers are forked by a forkserver, not by this process.  On CPython before
# 3.12 (or 3.11.10), forking a process whose gloo threads create or delete Python thread
# states can leave the child stuck in PyOS_AfterFork_Child on the runtime lock one of them held
# at that moment (python/cpython#112275): it happened once in CI, and once in ~2,500 runs
# here, where gdb showed both workers of a run in _PyThreadState_DeleteExcept.  A forkserver
# is single-threaded; it also makes the workers unpickle the dataset, as spawn does.
WORKERS_CONTEXT = multiprocessing.get_context("forkserver")
WORKERS_CONTEXT.set_forkserver_preload(["torch", "shardio"])


def dump_on_usr1(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: a worker, too, prints every thread's stack on SIGUSR1."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def collate_keys(batch: list[dict]) -> list[str]:
    return [s["__key__"] for s in batch]


def run_one(spec: dict, rank: int, world: int) -> dict:
    ds = shardio.ShardDataset(
        spec["data"], batch_size=spec["batch_size"], remainder=spec.get("remainder", "pad"),
        seed=spec.get("seed", 0),
    )
    if spec.get("state_in"):
        ds.load_state_dict(json.loads(Path(spec["state_in"]).read_text()))
    ds.set_epoch(spec.get("epoch", ds.epoch))
    topo = ds.topology
    dl: Any
    if spec.get("loader", "dataloader") == "shardloader":
        dl = shardio.ShardLoader(ds, spec["batch_size"], num_workers=spec["workers"],
                                 collate_fn=collate_keys)
    else:
        dl = DataLoader(ds, batch_size=spec["batch_size"], num_workers=spec["workers"],
                        collate_fn=collate_keys, multiprocessing_context=WORKERS_CONTEXT,
                        worker_init_fn=dump_on_usr1)
    out: dict = {"len": len(ds), "dl_len": len(dl),
                 "topology": [topo.rank, topo.world_size, topo.local_rank, topo.local_world_size],
                 "loader": type(dl).__name__, "batches": []}
    limit = spec.get("max_batches")
    try:
        for batch in dl:
            out["batches"].append(list(batch))
            sync = torch.tensor([len(batch)], dtype=torch.int64)
            dist.all_reduce(sync)  # what DDP does every step: blocks if a rank stopped early
            if limit is not None and len(out["batches"]) >= limit:
                break
    finally:
        if isinstance(dl, shardio.ShardLoader):
            dl.close()
    n = torch.tensor([len(out["batches"])], dtype=torch.int64)
    lo, hi = n.clone(), n.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    out["batches_min"], out["batches_max"] = int(lo), int(hi)
    if limit is not None:
        out["state"] = ds.state_dict(batches=len(out["batches"]))
    return out


def main() -> int:
    # On SIGUSR1 (sent by the test when the job overruns its deadline) this process and its
    # DataLoader workers (dump_on_usr1) print every thread's stack.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec_path, out_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    result = {"rank": rank, "world_size": world, "runs": {}}
    for run in spec["runs"]:
        result["runs"][run["name"]] = run_one(run, rank, world)
        print(f"rank {rank}: run {run['name']} done, "
              f"{len(result['runs'][run['name']]['batches'])} batches", flush=True)
    dist.barrier()
    Path(out_path).write_text(json.dumps(result))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
