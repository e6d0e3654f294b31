"""Shared fixtures: small real datasets on disk, a CLI runner, and fault injection helpers."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from shardio.topology import _LOCAL_VARS, _RANK_VARS  # noqa: E402
from tools.make_dataset import make_images  # noqa: E402


@pytest.fixture(scope="session")
def quick_runs(request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The benchmark scripts' ``--quick`` runs the session's tests ask for with
    ``@pytest.mark.quick_run(NAME)``, run two at a time (see ``tests/_quickruns.py``)."""
    from tests._quickruns import QuickRuns

    names = {m.args[0] for item in request.session.items
             for m in item.iter_markers("quick_run")}
    return QuickRuns(names, tmp_path_factory.mktemp("quick"))


@pytest.fixture
def quick_run(request: pytest.FixtureRequest, quick_runs: Any) -> Any:
    """The finished run of this test's ``@pytest.mark.quick_run(NAME)``
    (a ``tests._quickruns.Run``); the test fails here when the run did not exit 0."""
    marker = request.node.get_closest_marker("quick_run")
    assert marker is not None, "quick_run needs @pytest.mark.quick_run(NAME)"
    run = quick_runs.get(marker.args[0])
    if run.returncode != 0:
        pytest.fail(run.failure(), pytrace=False)
    return run


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests mean a single process unless they say otherwise: a Slurm/torchrun/MPI rank
    inherited from the environment the suite runs in must not leak into them."""
    for pair in (*_RANK_VARS, *_LOCAL_VARS):
        for var in pair:
            monkeypatch.delenv(var, raising=False)


@pytest.fixture
def image_tree(tmp_path: Path) -> Path:
    """ImageFolder tree: 3 classes x 20 real JPEGs (5-12 KB)."""
    src = tmp_path / "src"
    make_images(str(src), files=60, classes=3, min_kb=5, max_kb=12, seed=1, pool=12)
    return src


@pytest.fixture
def mixed_tree(tmp_path: Path) -> Path:
    """Samples with several fields each (jpg/json/txt/npy, some missing), nested keys, 0-byte field."""
    import json

    import numpy as np

    src = tmp_path / "mixed"
    for i in range(40):
        d = src / f"part{i % 3}" / "sub"
        d.mkdir(parents=True, exist_ok=True)
        stem = d / f"s{i:04d}"
        (stem.with_suffix(".txt")).write_text(f"caption {i} " * (i % 7))
        (stem.with_suffix(".json")).write_text(json.dumps({"i": i, "tags": ["a"] * (i % 4)}))
        if i % 2 == 0:
            buf = io.BytesIO()
            np.save(buf, np.arange(i * 10, dtype=np.float32))
            Path(str(stem) + ".npy").write_bytes(buf.getvalue())
        if i % 5 == 0:
            Path(str(stem) + ".empty.bin").write_bytes(b"")
    return src


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., tuple[int, str, str]]:
    """Run ``shardio`` in-process: ``rc, out, err = cli("pack", src, out, ...)``."""
    from shardio.cli import main

    def run(*args: object) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main([str(a) for a in args])
        cap = capsys.readouterr()
        return rc, cap.out, cap.err

    return run


def pack_bin_dataset(base: Path, n: int, payload: Callable[[int], bytes], classes: int,
                     samples_per_shard: int, text: Callable[[int], bool] = lambda i: True) -> Path:
    """Pack ``n`` samples into ``base / "ds"``: sample ``i`` is ``c{i % classes}/s{i:03d}`` with a
    ``bin`` field of ``payload(i)`` and, where ``text(i)``, a ``txt`` field; labels from the
    class folders."""
    import shardio

    src = base / "src"
    for i in range(n):
        d = src / f"c{i % classes}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"s{i:03d}.bin").write_bytes(payload(i))
        if text(i):
            (d / f"s{i:03d}.txt").write_text(f"sample {i}")
    out = base / "ds"
    shardio.pack(src, out, samples_per_shard=samples_per_shard, label_from_dir=True,
                 fsync=False, progress=False)
    return out


def flip_bit(path: str | os.PathLike[str], offset: int, bit: int = 0) -> None:
    """Flip one bit of a file in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def default_sigint() -> None:
    """``preexec_fn`` for a child a test will Ctrl-C: a shell starting CI in the background
    leaves SIGINT ignored, and Python then never installs its KeyboardInterrupt handler."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def truncate(path: str | os.PathLike[str], size: int) -> None:
    """Cut a file to ``size`` bytes."""
    os.truncate(path, size)


def mounted_tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    """Mount a real tmpfs with ``options`` (``size=2m``, ...) on the new directory ``mnt`` for
    the test, always unmounted after it; skipped where mounting is not permitted."""
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs: {exc}")
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (a full disk, or a small /dev/shm as in containers), mounted for the
    test and always unmounted after it; skipped where mounting is not permitted."""
    yield from mounted_tmpfs(tmp_path / "mnt", "size=2m")


@pytest.fixture
def world_tmp() -> Iterator[Path]:
    """A temp dir every user can traverse and write (pytest's own are private to root): for
    tests that drop to an unprivileged user to make a file unreadable."""
    d = Path(tempfile.mkdtemp(prefix="shardio-test-"))
    os.chmod(d, 0o777)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def strace_or_skip() -> str:
    """The strace binary, or skip the test when it is missing or ptrace is not permitted."""
    import shutil
    import subprocess

    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace not installed")
    probe = subprocess.run([strace, "-f", "-o", "/dev/null", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"ptrace not permitted here: {probe.stderr.decode().strip()}")
    return strace


def run_with_eio(script: Path, target: Path, syscall: str, when: int) -> dict[str, Any]:
    """Run python ``script`` under strace, failing its ``when``-th ``syscall`` on file ``target``
    with a real EIO; return the JSON object its last line of output holds."""
    import json
    import subprocess
    import sys

    strace = strace_or_skip()
    proc = subprocess.run(
        [strace, "-f", "-o", "/dev/null", "-P", str(target), "-e", f"trace={syscall}",
         "-e", f"inject={syscall}:error=EIO:when={when}", sys.executable, str(script)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
