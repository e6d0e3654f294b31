"""Who this process is: rank and world size of the job, node, and data-loader worker.

Computed once and injected, so tests build a :class:`Topology` directly instead of faking
``torch.distributed``.  Environment variables are read only by :meth:`Topology.from_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import UsageError

__all__ = ["Topology", "check_cpus", "discover_cpus", "numa_nodes"]

# The launcher's own variables first: mpirun inside a Slurm allocation leaves the batch step's
# SLURM_PROCID=0/SLURM_NTASKS=1 in every rank's environment.
_RANK_VARS = (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
              ("PMI_RANK", "PMI_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS"))
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
        rank, world = rank_from_env(env)
        local, local_world = local_from_env(env) or (rank, world)
        return cls(rank=rank, world_size=world, local_rank=local, local_world_size=local_world)

    @classmethod
    def for_group(cls, rank: int, world_size: int,
                  env: Mapping[str, str] | None = None) -> Topology:
        """The rank and world size of a process group (``torch.distributed``, which knows no
        nodes) with the local rank and size from the launcher's variables when they fit that
        world, else one rank per node."""
        local = local_from_env(env)
        if local is None or world_size % local[1] or not 0 <= local[0] < local[1]:
            local = (0, 1)
        return cls(rank=rank, world_size=world_size, local_rank=local[0],
                   local_world_size=local[1])


def rank_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int]:
    """``(rank, world size)`` from torchrun, Open MPI, PMI or Slurm variables (the first pair
    set, in that order); ``(0, 1)`` when none is.

    Raises:
        UsageError: a variable of that pair is not a number (an empty ``WORLD_SIZE=``, ...).
    """
    env = os.environ if env is None else env
    for r, w in _RANK_VARS:
        if r in env and w in env:
            return _env_number(env, r), _env_number(env, w)
    return 0, 1


def local_from_env(env: Mapping[str, str] | None = None) -> tuple[int, int] | None:
    """``(local rank, ranks on this node)`` from torchrun, Slurm or Open MPI variables, or
    ``None`` when none is set.

    Raises:
        UsageError: a variable of that pair is not a number.
    """
    env = os.environ if env is None else env
    for r, w in _LOCAL_VARS:
        if r in env and w in env:
            # SLURM_NTASKS_PER_NODE reads like "2(x3),1" on uneven allocations.
            return _env_number(env, r), _env_number(env, w, env[w].split("(")[0].split(",")[0])
    return None


def _env_number(env: Mapping[str, str], name: str, text: str | None = None) -> int:
    value = env[name] if text is None else text
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"environment variable {name}={env[name]!r} is not a number: the job "
                         "launcher set it wrong, or unset it") from None


def numa_nodes(sysfs: str = "/sys/devices/system/node") -> dict[int, list[int]]:
    """NUMA node -> its CPUs, from sysfs (``{}`` where sysfs has no node directory)."""
    out: dict[int, list[int]] = {}
    try:
        names = os.listdir(sysfs)
    except OSError:
        return out
    for name in names:
        if name.startswith("node") and name[4:].isdigit():
            try:
                with open(os.path.join(sysfs, name, "cpulist")) as f:
                    out[int(name[4:])] = _parse_cpulist(f.read())
            except (OSError, ValueError):
                continue
    return dict(sorted(out.items()))


def _parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` -> ``[0, 1, 2, 3, 8, 10, 11]`` (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def discover_cpus(env: Mapping[str, str] | None = None,
                  allowed: set[int] | None = None,
                  nodes: Mapping[int, list[int]] | None = None) -> list[int]:
    """The CPUs this process may run loader workers on, grouped by NUMA node.

    Starts from the affinity mask (which already reflects the cgroup cpuset and a Slurm or MPI
    binding); when ``SLURM_CPUS_PER_TASK`` is set and smaller, keeps that many, preferring the
    NUMA node with the most allowed CPUs so that workers share a memory controller.

    Args:
        env, allowed, nodes: injected environment, affinity set and NUMA map (tests).
    """
    env = os.environ if env is None else env
    if allowed is None:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    if not allowed:
        allowed = set(range(os.cpu_count() or 1))
    nodes = numa_nodes() if nodes is None else nodes
    groups = [[c for c in cpus if c in allowed] for cpus in nodes.values()]
    groups = sorted((g for g in groups if g), key=lambda g: (-len(g), g[0]))
    placed = {c for g in groups for c in g}
    ordered = [c for g in groups for c in g] + sorted(allowed - placed)
    limit = env.get("SLURM_CPUS_PER_TASK", "")
    if limit.isdigit() and 0 < int(limit) < len(ordered):
        ordered = ordered[: int(limit)]
    return ordered


def pinnable_cpus(cgroup_root: str = "/sys/fs/cgroup") -> set[int] | None:
    """The CPUs a child of this process may be pinned to: its cpuset (which may be wider than
    this process's own affinity mask, say when the training process pinned itself to one core),
    with the affinity mask; the online CPUs where no cpuset file can be read; None when nothing
    can be told."""
    found: set[int] = set()
    if hasattr(os, "sched_getaffinity"):
        found |= set(os.sched_getaffinity(0))
    v2, v1 = "", ""
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
                    v2 = parts[2].strip("/")
                elif len(parts) == 3 and "cpuset" in parts[1].split(","):
                    v1 = parts[2].strip("/")
    except OSError:
        pass
    # The cgroup's own directory, else the mount's root (a container that sees only its own).
    candidates = [os.path.join(cgroup_root, v2, "cpuset.cpus.effective"),
                  os.path.join(cgroup_root, "cpuset.cpus.effective"),
                  os.path.join(cgroup_root, "cpuset", v1, "cpuset.effective_cpus"),
                  os.path.join(cgroup_root, "cpuset", "cpuset.effective_cpus"),
                  "/sys/devices/system/cpu/online"]
    for path in candidates:
        try:
            with open(path, encoding="ascii") as f:
                cpus = _parse_cpulist(f.read())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if cpus:
            return found | set(cpus)
    return found or None


def check_cpus(cpus: tuple[int, ...] | None, allowed: set[int] | None = None) -> None:
    """Refuse CPUs that workers cannot be pinned to (``allowed``: :func:`pinnable_cpus`).

    Raises:
        UsageError: a CPU number is not an integer >= 0, or not one this process may use.
    """
    if cpus is None:
        return
    for c in cpus:
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise UsageError(f"cpus: {c!r} is not a CPU number; pass integers >= 0 "
                             "(e.g. cpus=[2, 3]) or cpus='auto'")
    allowed = pinnable_cpus() if allowed is None else allowed
    if allowed is None:
        return
    bad = sorted(set(cpus) - allowed)
    if bad:
        usable = ",".join(str(c) for c in sorted(allowed))
        raise UsageError(f"cpus: CPU {', '.join(map(str, bad))} is not available to this process "
                         f"(it may use {usable}); pass CPUs from that list, or cpus='auto'")
