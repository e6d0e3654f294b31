"""Who this process is: rank and world size of the job, node, and data-loader worker.

Computed once and injected, so tests build a :class:`Topology` directly instead of faking
``torch.distributed``.  Environment variables are read only by :meth:`Topology.from_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import UsageError

__all__ = ["Topology"]

_RANK_VARS = (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"),
              ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"))
_LOCAL_VARS = (("LOCAL_RANK", "LOCAL_WORLD_SIZE"), ("SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
               ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"))


@dataclass(frozen=True, kw_only=True)
class Topology:
    """Position of this process in a (possibly distributed) job.

    Args:
        rank: global rank, ``0 <= rank < world_size``.
        world_size: number of ranks reading the dataset.
        local_rank: rank within the node.
        local_world_size: ranks on this node.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise UsageError(f"invalid topology: rank {self.rank} of world size {self.world_size}")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise UsageError(
                f"invalid topology: local rank {self.local_rank} of {self.local_world_size}"
            )

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Topology:
        """Read rank and world size from torchrun (``RANK``/``WORLD_SIZE``), Slurm
        (``SLURM_PROCID``/``SLURM_NTASKS``), Open MPI or PMI variables; single process otherwise."""
        env = os.environ if env is None else env
        rank, world = 0, 1
        for r, w in _RANK_VARS:
            if r in env and w in env:
                rank, world = int(env[r]), int(env[w])
                break
        local, local_world = 0, 1
        for r, w in _LOCAL_VARS:
            if r in env and w in env:
                local, local_world = int(env[r]), int(env[w].split("(")[0].split(",")[0])
                break
        else:
            local, local_world = rank, world
        return cls(rank=rank, world_size=world, local_rank=local, local_world_size=local_world)
