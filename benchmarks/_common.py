"""Pieces every benchmark script shares: versions, common options, and result output."""

from __future__ import annotations

import argparse
import json
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
