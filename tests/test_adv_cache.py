"""The node-local cache and its neighbours under conditions that come up on shared clusters: a
cache directory another user made, parity rebuilds next to the stager's copies, and a pack part
run twice at once.  Real files, real processes, real privilege drops; every child process has a
deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shardio.errors import CacheNotWritableError, StagingError
from shardio.manifest import Manifest
from shardio.stage import NodeCache
from tests.conftest import pack_bin_dataset

pytestmark = pytest.mark.timeout(60)

_UID = 65534  # nobody

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="drops privileges to another user")


# --- a node cache another user made ------------------------------------------------------------

_CACHE_CHILD = r"""
import json, logging, os, sys
# Imported as root: the interpreter's and the venv's files need not be readable by nobody.
import numpy  # noqa: F401
import shardio.cli, shardio.order, shardio.stage, shardio.formats.tar  # noqa: F401
from shardio.errors import CacheNotWritableError
from shardio.manifest import Manifest
from shardio.stage import NodeCache, StageOptions

root, cache_dir = sys.argv[1:3]
STAGE = ["stage", root, "--cache", "auto", "--reserve", "0", "--world-size", "1",
         "--ranks-per-node", "1"]
shardio.cli._parser(with_bench=False).parse_args(STAGE)  # (argparse's lazy imports)
os.setgroups([])
os.setgid(UID)
os.setuid(UID)
warnings = []


class Keep(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())


logging.getLogger("shardio").addHandler(Keep())
manifest = Manifest.load(root)
res = {}
for name, where in (("auto", "auto"), ("explicit", cache_dir)):
    try:
        cache = NodeCache.from_options(root, manifest, StageOptions(cache_dir=where, reserve=0))
        res[name] = {"cache": None if cache is None else cache.dir}
    except CacheNotWritableError as exc:
        res[name] = {"error": type(exc).__name__, "message": str(exc), "path": exc.path,
                     "permission": isinstance(exc, PermissionError)}
# What a job prolog run as the user does (and ShardDataset(cache_dir="auto") before reading).
res["stage"] = shardio.cli.main(STAGE)
res["warnings"] = warnings
print(json.dumps(res))
""".replace("UID", str(_UID))


def _as_nobody(root: Path, cache_dir: Path) -> dict:
    env = dict(os.environ, SHARDIO_CACHE_DIR=str(cache_dir))
    r = subprocess.run([sys.executable, "-c", _CACHE_CHILD, str(root), str(cache_dir)],
                       env=env, capture_output=True, text=True, timeout=30, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _bin_dataset(base: Path) -> Path:
    root = pack_bin_dataset(base, 12, lambda i: bytes([i]) * 300, classes=2, samples_per_shard=4)
    for d, _, files in os.walk(base):
        os.chmod(d, 0o755)
        for f in files:
            os.chmod(os.path.join(d, f), 0o644)
    return root


@needs_root
def test_auto_cache_falls_back_to_a_per_user_directory_when_root_made_the_shared_one(
        world_tmp: Path) -> None:
    """A root prolog made this dataset's cache (``<dir>/shardio-<digest>``, mode 0755) in a
    shared node directory: a user job's ShardDataset(cache_dir="auto") (which calls NodeCache.from_options) raised StagingError "not
    writable" instead of staging elsewhere or reading directly; an explicit cache_dir must still
    raise, with a typed error naming the fix."""
    root = _bin_dataset(world_tmp)
    node = world_tmp / "node"
    node.mkdir()
    os.chmod(node, 0o1777)  # like /tmp or a world-writable /local/scratch
    NodeCache(node, root, Manifest.load(root)).close()  # as root
    shared = next(node.glob("shardio-*"))
    res = _as_nobody(root, node)
    own = node / f"shardio-user-{_UID}" / shared.name
    assert res["auto"]["cache"] == str(own)
    assert any("not writable" in w and f"shardio-user-{_UID}" in w for w in res["warnings"])
    assert res["stage"] == 0  # and the per-user cache works: every shard staged there
    assert sorted(os.listdir(own / "data")) == sorted(
        n for n in os.listdir(root) if n.startswith("shard-")) and os.listdir(
        shared / "data") == []
    assert os.stat(own).st_uid == _UID and (os.stat(own.parent).st_mode & 0o777) == 0o700
    explicit = res["explicit"]
    assert explicit["error"] == "CacheNotWritableError" and explicit["permission"]
    assert explicit["path"] == str(shared)
    assert "not writable" in explicit["message"] and "cache_dir" in explicit["message"]
    assert issubclass(CacheNotWritableError, StagingError)


@needs_root
def test_auto_cache_reads_directly_when_neither_shared_nor_own_directory_is_writable(
        world_tmp: Path) -> None:
    """The shared dataset cache is root's and the per-user name is taken by another user (a
    squatter in a shared /tmp): "auto" reads directly with a warning, never uses the other
    user's directory."""
    root = _bin_dataset(world_tmp)
    node = world_tmp / "node"
    node.mkdir()
    os.chmod(node, 0o1777)
    NodeCache(node, root, Manifest.load(root)).close()
    squat = node / f"shardio-user-{_UID}"
    squat.mkdir(mode=0o777)
    os.chmod(squat, 0o777)  # writable by nobody, but not nobody's
    res = _as_nobody(root, node)
    assert res["auto"] == {"cache": None}
    assert any("reading without staging" in w for w in res["warnings"])
    assert res["stage"] == 2  # (no usable cache: the CLI says so)
    assert os.listdir(squat) == []


@needs_root
def test_auto_cache_falls_back_when_only_the_node_file_is_another_users(world_tmp: Path) -> None:
    """The directories are writable but the node file is root's 0644: the open of the node file
    failed with a plain StagingError, which "auto" did not fall back from."""
    root = _bin_dataset(world_tmp)
    node = world_tmp / "node"
    node.mkdir()
    os.chmod(node, 0o1777)
    NodeCache(node, root, Manifest.load(root)).close()
    shared = next(node.glob("shardio-*"))
    for d in (shared, shared / ".progress", shared / "data"):
        os.chmod(d, 0o777)
    res = _as_nobody(root, node)
    assert res["auto"]["cache"] == str(node / f"shardio-user-{_UID}" / shared.name)
    assert res["explicit"]["error"] == "CacheNotWritableError"
    assert res["explicit"]["path"] == str(shared / ".node")


# --- parity rebuilds in the node cache ---------------------------------------------------------


def _two_level_dataset(base: Path) -> Manifest:
    """Six shards with parity 3+1: ``shard-00000N.tar`` (keys A...) and, below, a
    ``data/shard-00000N.tar`` of other samples (keys B...): manifest paths that mirror the
    cache's own ``data/`` tree."""
    import shardio
    from shardio.parity import write_parity

    root = base / "ds"
    (root / "data").mkdir(parents=True)
    for tag, where in (("A", root), ("B", root / "data")):
        src = base / f"src{tag}"
        for i in range(8):
            (src / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
            (src / f"c{i % 2}" / f"{tag}{i:03d}.bin").write_bytes(bytes([i]) * (200 + i))
        shardio.pack(src, base / f"p{tag}", samples_per_shard=4, fsync=False, progress=False)
        for t in sorted((base / f"p{tag}").glob("*.tar")):
            (where / t.name).write_bytes(t.read_bytes())
    tars = sorted(root.glob("*.tar")) + sorted((root / "data").glob("*.tar"))
    manifest = shardio.index_tars(tars, root=root)
    manifest.parity = write_parity(str(root), manifest, 2, 1, fsync=False)
    manifest.save(str(root))
    return Manifest.load(root)


def test_a_parity_rebuild_never_lands_among_the_stagers_copies(tmp_path: Path) -> None:
    """Shards rebuilt from parity went to ``<cache dir>/<shard path>``: the rebuild of shard
    ``data/shard-000000.tar`` replaced the stager's published copy of shard ``shard-000000.tar``
    (``<cache dir>/data/shard-000000.tar``) with other bytes and index, so the next read of that
    shard found its copy corrupt, discarded it (the rebuild with it) and the two chased each
    other; a stager starting meanwhile deleted the rebuild's temp file as its own."""
    from shardio.checksum import file_digest
    from shardio.reader import DatasetReader
    from shardio.stage import StageOptions, Stager
    from tests.test_stage import schedule
    from tools.faults import corrupt_dataset

    m = _two_level_dataset(tmp_path)
    root = tmp_path / "ds"
    bad = next(i for i, s in enumerate(m.shards) if s.path == "data/shard-000000.tar")
    twin = next(i for i, s in enumerate(m.shards) if s.path == "shard-000000.tar")
    (tmp_path / "cache").mkdir()
    cache = NodeCache(tmp_path / "cache", root, m)
    options = StageOptions(cache_dir=str(tmp_path / "cache"), reserve=0)
    Stager(cache, schedule(m), options).stage([0])
    corrupt_dataset(str(root), [bad], "flip", seed=1)
    cache.discard(bad, "test")  # (its copy gone: the ladder goes to the original, then parity)
    try:
        with DatasetReader(root, cache=cache) as r:
            keys = [s["__key__"] for s in r]
            rebuilt = r.ladder._rebuilt_path(bad)
            assert r.counters.get("parity_rebuilt") == 1
        assert len(keys) == len(set(keys)) == sum(s.samples for s in m.shards) == 16
        copy = cache.lookup(twin, wait=0)
        assert copy is not None and file_digest(copy)[0] == m.shards[twin].digest
        assert not rebuilt.startswith(cache.data_dir + os.sep)
        assert rebuilt.startswith(cache.rebuilt_dir + os.sep)
        # Read again: the stager's copy and the rebuilt copy both serve, nothing is discarded.
        with DatasetReader(root, cache=cache) as r:
            assert [s["__key__"] for s in r] == keys
            assert not r.counters.get("cache_discarded") and not r.counters.get("parity_rebuilt")
        # A stager starting cleans its own temp files only, never a rebuild's in progress.
        tmp = Path(os.path.dirname(rebuilt)) / ".shard-000000.tar.shardio-tmp-999999"
        tmp.write_bytes(b"rebuild in progress")
        Stager(cache, schedule(m), options).stage([0])
        assert tmp.exists()
    finally:
        cache.close()


# --- two runs of one pack part at once ---------------------------------------------------------


def _part_source(base: Path) -> Path:
    src = base / "src"
    for i in range(16):
        (src / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (src / f"c{i % 2}" / f"s{i:03d}.bin").write_bytes(bytes([i]) * (300 + i))
    return src


_PART_KW = {"samples_per_shard": 4, "fsync": False, "progress": False}
_PART_CHILD = ("import sys, shardio; shardio.pack(sys.argv[1], sys.argv[2], part=(0, 2), "
               "samples_per_shard=4, fsync=False, progress=False)")


def _start_part_0(src: Path, out: Path, latency: float) -> subprocess.Popen[str]:
    """``pack(part=(0, 2))`` in a child process whose every source read takes ``latency``
    seconds (shardio._inject), so that it is still running when the test acts."""
    env = dict(os.environ, SHARDIO_SLOW_READS=f"{src}:1GB:{latency}")
    return subprocess.Popen([sys.executable, "-c", _PART_CHILD, str(src), str(out)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 20.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"{path} never appeared: {proc.communicate(timeout=10)}")
        time.sleep(0.01)


def test_a_second_run_of_the_same_part_fails_fast_and_other_parts_still_run(
        tmp_path: Path) -> None:
    """``shardio pack --part 0/2`` started again while the first run still ran (a requeued job):
    the later run's start deleted the earlier run's temp files and the earlier one died with
    "ShardIOError ... publishing shard ...: No such file or directory".  Now the second run
    fails at once with PartInProgressError naming the first's pid; part 1 still runs beside it,
    and the merge is whole."""
    import shardio
    from shardio.errors import PartInProgressError

    src, out = _part_source(tmp_path), tmp_path / "out"
    first = _start_part_0(src, out, 0.15)
    try:
        _wait_for(out / ".shardio-pack-0000-of-0002.json", first)  # (its scan is over)
        with pytest.raises(PartInProgressError, match=r"another run of part 0/2 .*\(pid") as ei:
            shardio.pack(src, out, part=(0, 2), **_PART_KW)
        assert ei.value.pid == first.pid and isinstance(ei.value, BlockingIOError)
        assert first.poll() is None  # (it was still running: the check meant something)
        other = shardio.pack(src, out, part=(1, 2), **_PART_KW)
        assert other.part == 1 and not other.merged
        assert first.wait(timeout=30) == 0, first.communicate(timeout=10)
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate(timeout=10)
    assert not [n for n in os.listdir(out) if n.endswith(".lock")]
    manifest = shardio.merge(out)
    assert manifest.num_samples == 16
    shardio.pack(src, tmp_path / "single", **_PART_KW)
    assert (out / "manifest.json").read_bytes() == (tmp_path / "single" / "manifest.json"
                                                    ).read_bytes()


def test_a_lock_left_by_a_killed_part_run_never_blocks(tmp_path: Path) -> None:
    """A run of a part killed (SIGKILL: no cleanup) leaves its lock file; the kernel released
    the lock with the process, so the rerun goes ahead, and removes the file at its end."""
    import shardio

    src, out = _part_source(tmp_path), tmp_path / "out"
    first = _start_part_0(src, out, 0.15)
    try:
        _wait_for(out / ".shardio-pack-0000-of-0002.json", first)
    finally:
        first.kill()
        first.communicate(timeout=10)
    lock = out / ".shardio-part-0000-of-0002.lock"
    assert lock.exists() and lock.read_text().split()[0] == str(first.pid)
    result = shardio.pack(src, out, part=(0, 2), **_PART_KW)
    assert result.part == 0 and not lock.exists()
    shardio.pack(src, out, part=(1, 2), **_PART_KW)
    assert shardio.merge(out).num_samples == 16
