"""A minimal training loop wired for Slurm: node-local staging, exact resume, USR1 preemption.

Run under ``srun`` (ranks from SLURM_PROCID/SLURM_NTASKS, or torchrun's RANK/WORLD_SIZE); see
tools/slurm/train.sbatch.  The model is a stand-in: replace ``step()`` with your training step.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import shardio


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dataset")
    p.add_argument("--cache", default="auto", help="node-local staging directory")
    p.add_argument("--ckpt", required=True, help="checkpoint directory (shared filesystem)")
    p.add_argument("--epochs", type=int, default=90)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--workers", type=int, default=int(os.environ.get("SLURM_CPUS_PER_TASK", 4)))
    a = p.parse_args()
    ckpt = Path(a.ckpt)
    rank = shardio.Topology.from_env().rank
    ds = shardio.ShardDataset(a.dataset, decode=True, seed=0, batch_size=a.batch_size,
                              cache_dir=a.cache)
    loader = shardio.ShardLoader(ds, batch_size=a.batch_size, num_workers=a.workers, cpus="auto")
    state_file = ckpt / f"loader-rank{rank}.json"
    if state_file.exists():
        loader.load_state_dict(json.loads(state_file.read_text()))
    loader.save_on_signal(state_file)  # SIGUSR1 from --signal=USR1@120
    start = loader.state_dict()["epoch"]
    for epoch in range(start, a.epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            step(batch)
        if loader.preempted:
            # save the model here too, then leave; the job script requeues the job
            (ckpt / "PREEMPTED").touch()
            break
        if rank == 0:
            print(f"epoch {epoch}: {loader.stats()['wait_fraction']:.1%} of step time waiting "
                  "for data", flush=True)
    loader.close()
    return 0


def step(batch: object) -> None:
    time.sleep(0.01)  # stands in for forward/backward/optimizer on the GPU


if __name__ == "__main__":
    raise SystemExit(main())
