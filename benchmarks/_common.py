"""Pieces every benchmark script shares: versions, common options, and result output."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# --- peers in their own environment ------------------------------------------------------------
# LitData and MosaicML Streaming pin dependencies shardio's environment cannot take (numpy<2.2,
# torchvision, transformers), so they live in a second virtual environment (`make peers`:
# .venv-peers, or $SHARDIO_PEERS_PYTHON).  bench_read and bench_pack run their contenders in a
# child process of that interpreter.  Kind -> (module, distribution).
PEERS = {"litdata": ("litdata", "litdata"), "mosaic": ("streaming", "mosaicml-streaming")}


def peers_python() -> str | None:
    """The peers' interpreter: ``$SHARDIO_PEERS_PYTHON``, else ``.venv-peers/bin/python``."""
    path = os.environ.get("SHARDIO_PEERS_PYTHON") or str(ROOT / ".venv-peers" / "bin" / "python")
    return path if os.access(path, os.X_OK) else None


_PROBE = """
import json, importlib.metadata as md
out = {}
for mod, dist in %r:
    try:
        __import__(mod)
        out[dist] = md.version(dist)
    except Exception as exc:
        out[dist] = "unusable: %%s: %%s" %% (type(exc).__name__, str(exc).splitlines()[0][:160])
print(json.dumps(out))
"""


def probe_peers(python: str | None) -> dict[str, str]:
    """Distribution -> version, or ``"unusable: <why>"``, or ``"not installed"``, per peer."""
    dists = [dist for _mod, dist in PEERS.values()]
    if python is None:
        return {d: "not installed (no peers environment: make peers)" for d in dists}
    proc = subprocess.run([python, "-c", _PROBE % (list(PEERS.values()),)], capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL, check=False)
    try:
        found = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        found = {}
    return {d: found.get(d, f"not installed in {python}") for d in dists}


def usable(version: str) -> bool:
    """A probe answer that names a version (the peer imports)."""
    return not version.startswith(("unusable", "not installed"))


def dist_version(name: str) -> str:
    """Installed version of a distribution, or ``"unknown"``."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return "unknown"


def add_output_args(p: argparse.ArgumentParser, quick_help: str) -> None:
    """``--workdir``, ``--keep``, ``--quick``, ``--json-out``: the same in every script."""
    p.add_argument("--workdir", default=None,
                   help="directory to work in (a fresh subdirectory is made; default system temp)")
    p.add_argument("--keep", action="store_true", help="keep the generated tree and shards")
    p.add_argument("--quick", action="store_true", help=quick_help)
    p.add_argument("--json-out", default=None, metavar="PATH",
                   help="also write the JSON lines here")


def check_json_out(p: argparse.ArgumentParser, path: str | None,
                   option: str = "--json-out") -> None:
    """Refuse (``p.error``: exit 2) a results file that could not be written at the end of a
    long run: a directory, a file in a folder that does not exist or is not writable, a
    read-only file."""
    if path is None:
        return
    if not path:
        p.error(f"{option}: empty path; name a file, e.g. {option} results.jsonl")
    if os.path.isdir(path):
        p.error(f"{option} {path}: is a directory; name a file in it, e.g. "
                f"{option} {os.path.join(path, 'results.jsonl')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        p.error(f"{option} {path}: folder {parent} does not exist; create it (mkdir -p) or "
                "name a file in an existing folder")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        p.error(f"{option} {path}: the file exists and is not writable; name another file")
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        p.error(f"{option} {path}: folder {parent} is not writable; name a file in a folder "
                "you can write")


def check_dir(p: argparse.ArgumentParser, path: str | None, option: str = "--workdir") -> None:
    """Make ``path`` (with parents) now and check that files can be created in it; refuse
    (``p.error``: exit 2) one that cannot be, rather than fail after minutes of work."""
    if path is None:
        return
    if not path:
        p.error(f"{option}: empty path; name a folder or leave the option out")
    if os.path.exists(path) and not os.path.isdir(path):
        p.error(f"{option} {path}: exists and is not a directory; name a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        p.error(f"{option} {path}: cannot create it ({exc.strerror or exc}); name a folder "
                "you can create")
    import tempfile

    try:
        probe = tempfile.mkdtemp(prefix=".shardio-probe-", dir=path)
    except OSError as exc:
        p.error(f"{option} {path}: cannot create files in it ({exc.strerror or exc}); name a "
                "writable folder")
    os.rmdir(probe)


def check_output_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """:func:`check_dir` on ``--workdir`` and :func:`check_json_out` on ``--json-out`` (the
    options :func:`add_output_args` adds), before any work starts."""
    check_json_out(p, a.json_out)
    check_dir(p, a.workdir)


def check_slow_store_dir(p: argparse.ArgumentParser, workdir: str | None) -> None:
    """Refuse a work folder whose path has a comma: a simulated slow store under it
    (``SHARDIO_SLOW_READS``/``SHARDIO_SLOW_STATS``, :mod:`shardio._inject`) would be cut in two
    there, since commas separate the rules."""
    import tempfile

    where = workdir or tempfile.gettempdir()
    if "," in os.path.abspath(where):
        p.error(f"--workdir {where}: the simulated slow store's path may not contain a comma "
                "(SHARDIO_SLOW_READS separates its rules with commas); name another folder")


def check_seconds(p: argparse.ArgumentParser, option: str, value: float, *,
                  positive: bool = False) -> None:
    """Refuse a negative (or, with ``positive``, zero), NaN or infinite number of seconds."""
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        p.error(f"{option} {value}: give a finite number of seconds "
                f"{'> 0' if positive else '>= 0'}")


def check_files_classes(p: argparse.ArgumentParser, files: int, classes: int,
                        min_files: int = 1, why: str = "") -> None:
    """Refuse fewer than ``min_files`` files (``why`` says what needs them) and a class count
    outside ``1..files`` (a class folder with no file in it)."""
    if files < min_files:
        p.error(f"--files {files}: at least {min_files} needed{why}; pass --files {min_files} "
                "or more")
    if classes < 1:
        p.error(f"--classes {classes}: at least 1 needed")
    if classes > files:
        p.error(f"--classes {classes} is more than --files {files}: some class folders would be "
                f"empty; pass --classes {files} or fewer, or more --files")


def emit(lines: list[dict[str, Any]], summary: dict[str, Any], json_out: str | None) -> None:
    """Print one JSON line per contender and the summary line (and save them to ``json_out``)."""
    text = "".join(json.dumps(ln) + "\n" for ln in [*lines, summary])
    sys.stdout.write(text)
    sys.stdout.flush()
    if json_out:
        Path(json_out).write_text(text)


def run_in_workdir(prefix: str, workdir: str | None, keep: bool, fn: Any) -> int:
    """``fn(work)`` in a fresh directory ``prefix*`` under ``workdir`` (default system temp),
    removed afterwards unless ``keep`` (then its path goes to stderr)."""
    import shutil
    import tempfile

    if workdir:
        os.makedirs(workdir, exist_ok=True)
    work = tempfile.mkdtemp(prefix=prefix, dir=workdir)
    try:
        return int(fn(work))
    finally:
        if keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
