"""Room for shared-memory rings, and what crashed owners left behind.

Before a pool creates its rings, :func:`check_shm_space` compares their total size with the free
space of the directory they go in (``/dev/shm`` by default) and, for a memory filesystem, with
what the memory cgroup still allows (tmpfs pages count against it), so an oversized request is a
typed error naming the option to change rather than a SIGBUS or an OOM kill later.
:func:`sweep_stale` removes ring files (``shardio-<pid>-<16 hex>``) whose creating process is gone:
rings are unlinked as soon as they are mapped, so only a creator killed in between leaves one.
"""

from __future__ import annotations

import os
import re

from .errors import ShmSpaceError, UsageError

__all__ = ["DEFAULT_SHM_DIR", "check_shm_space", "sweep_stale"]

DEFAULT_SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"shardio-(\d+)-([0-9a-f]{16})")
_MEMORY_FS = {"tmpfs", "ramfs", "hugetlbfs"}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" or n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def check_shm_space(nbytes: int, directory: str | os.PathLike[str] | None = None, *,
                    cgroup_root: str = "/sys/fs/cgroup") -> None:
    """Check that ``nbytes`` of rings fit in ``directory`` before creating them.

    Compares with the directory's free space (``statvfs``) and, when the directory is a memory
    filesystem (tmpfs such as ``/dev/shm``, whose pages count against the memory cgroup), with
    what the memory cgroup still allows: the smallest ``limit - usage + reclaimable page cache``
    of this process's cgroup and its ancestors (v2 ``memory.max``/``memory.current``, v1
    ``memory.limit_in_bytes``/``memory.usage_in_bytes``).

    Args:
        nbytes: total bytes about to be allocated.
        directory: default ``/dev/shm``.
        cgroup_root: where the cgroup filesystem is mounted (tests point it at a fake tree).

    Raises:
        ShmSpaceError: it does not fit; the message names the options to change.
        UsageError: the directory does not exist.
    """
    directory = DEFAULT_SHM_DIR if directory is None else os.fspath(directory)
    fix = "lower ring_bytes/num_workers or pass shm_dir=<a file-backed directory>"
    try:
        st = os.statvfs(directory)
    except (FileNotFoundError, NotADirectoryError) as exc:
        raise UsageError(f"shared-memory directory {directory} does not exist; pass "
                         "shm_dir=<an existing writable directory>") from exc
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise ShmSpaceError(f"rings need {_fmt_bytes(nbytes)} but {directory} has "
                            f"{_fmt_bytes(free)} free; {fix}")
    if _fs_type(directory) not in _MEMORY_FS:
        return
    limit = _cgroup_headroom(cgroup_root)
    if limit is not None and nbytes > limit[0]:
        raise ShmSpaceError(
            f"rings need {_fmt_bytes(nbytes)} but the memory cgroup allows only "
            f"{_fmt_bytes(max(limit[0], 0))} more ({limit[1]}), and pages in {directory} count "
            f"against it; {fix}")


def _fs_type(directory: str) -> str:
    """Filesystem type of the mount holding ``directory`` ("tmpfs" when it cannot be told)."""
    target = os.path.realpath(directory)
    best, fstype = -1, "tmpfs"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= best:
                    best, fstype = len(mnt), right.split()[0]
    except OSError:
        pass
    return fstype


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _reclaimable(stat_path: str) -> int:
    keys = {"inactive_file", "active_file", "total_inactive_file", "total_active_file"}
    found: dict[str, int] = {}
    try:
        with open(stat_path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key in keys and value.strip().isdigit():
                    found[key] = int(value)
    except (OSError, UnicodeDecodeError):
        return 0
    if "total_inactive_file" in found or "total_active_file" in found:  # v1, hierarchical
        return found.get("total_inactive_file", 0) + found.get("total_active_file", 0)
    return found.get("inactive_file", 0) + found.get("active_file", 0)


def _cgroup_headroom(root: str) -> tuple[int, str] | None:
    """(bytes the memory cgroup still allows, which file says so), or None when unlimited."""
    v2_path, v1_path = "/", "/"
    try:
        with open("/proc/self/cgroup", encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                if parts[0] == "0" and parts[1] == "":
                    v2_path = parts[2] or "/"
                elif "memory" in parts[1].split(","):
                    v1_path = parts[2] or "/"
    except OSError:
        pass
    best: tuple[int, str] | None = None
    candidates = [(root, v2_path, "memory.max", "memory.current"),
                  (os.path.join(root, "memory"), v1_path, "memory.limit_in_bytes",
                   "memory.usage_in_bytes")]
    for base, rel, limit_name, usage_name in candidates:
        rel = rel.strip("/")
        while True:
            d = os.path.join(base, rel) if rel else base
            limit = _read_int(os.path.join(d, limit_name))
            usage = _read_int(os.path.join(d, usage_name))
            if limit is not None and usage is not None and limit < 1 << 60:
                room = limit - usage + _reclaimable(os.path.join(d, "memory.stat"))
                if best is None or room < best[0]:
                    best = (room, f"{os.path.join(d, limit_name)} = {_fmt_bytes(limit)}, "
                                  f"{_fmt_bytes(usage)} in use")
            if not rel:
                break
            rel = os.path.dirname(rel)
    return best


# --- stale segments --------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def _process_start(pid: int) -> float | None:
    """Wall-clock start time of ``pid`` from /proc (None when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
        with open("/proc/stat", encoding="ascii") as f:
            btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        ticks = int(stat.rpartition(")")[2].split()[19])
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, StopIteration, IndexError):
        return None


def sweep_stale(directory: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove ring files whose creating process no longer exists; return their paths.

    Call it at start-up: it cleans up after a creator that was SIGKILLed (or crashed) before it
    could unlink.  A file is kept while its creator pid is alive, unless that pid now belongs to
    a process started after the file was last written (the pid was reused).  Other users' files
    that cannot be removed are skipped.
    """
    directory = DEFAULT_SHM_DIR if directory is None else os.fspath(directory)
    removed = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    for name in names:
        m = _NAME_RE.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(directory, name)
        pid = int(m.group(1))
        if _pid_alive(pid):
            started = _process_start(pid)
            try:
                mtime = os.stat(path).st_mtime
            except FileNotFoundError:
                continue
            # /proc/stat btime has 1 s resolution: only a clear gap proves pid reuse.
            if started is None or mtime >= started - 2.0:
                continue
        try:
            os.unlink(path)
        except (FileNotFoundError, PermissionError):
            continue
        removed.append(path)
    return removed
