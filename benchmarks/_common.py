"""Pieces every benchmark script shares: versions, common options, and result output."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


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
