"""``shardio inspect``: what a dataset holds, from its manifest (no shard is read)."""

from __future__ import annotations

import math
import os
from typing import Any

from .manifest import Manifest

__all__ = ["describe", "format_description"]


def describe(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Summary and per-shard listing of a dataset as plain JSON-able data."""
    m = Manifest.load(os.fspath(root))
    stats = m.stats
    return {
        "path": os.fspath(root),
        "version": m.version,
        "created_by": m.created_by,
        "shard_format": m.shard_format,
        "shards": len(m.shards),
        "samples": m.num_samples,
        "bytes": m.total_bytes,
        "raw_bytes": sum(s.raw_bytes for s in m.shards),
        "fields": m.fields,
        "checksum": {"sample": m.checksum, "shard": m.digest},
        # (the settings shardio knows: another key, unchecked, may hold a NaN, not JSON)
        "compression": {k: v for k, v in m.compression.items() if k in _COMPRESSION_KEYS}
        if m.compression else m.compression,
        # (stats are informative, written by the pack: values of another type are left out)
        "compression_ratio": _number(stats.get("compression_ratio")),
        "labels": m.label_names,
        "skipped": _counts(stats.get("skipped")),
        "shard_list": [
            {"path": s.path, "samples": s.samples, "bytes": s.bytes, "digest": s.digest}
            for s in m.shards
        ],
    }


_COMPRESSION_KEYS = ("codec", "level", "dictionary", "dictionary_digest")


def _number(value: Any) -> float | None:
    # (NaN or Infinity, which json reads, would make `inspect --json` print JSON no parser
    # takes; an integer past a float's range made float() raise OverflowError)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def _counts(value: Any) -> dict[str, int]:
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if type(v) is int}


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def format_description(d: dict[str, Any], listing: bool = True) -> str:
    """Human-readable rendering of :func:`describe`."""
    comp = d["compression"]
    comp_text = "none" if not comp else (
        f"{comp.get('codec')}:{comp.get('level')}"
        + (" + dictionary" if comp.get("dictionary") else "")
        + (f" (ratio {d['compression_ratio']:.2f}x)" if d["compression_ratio"] is not None
           else " (ratio unknown)")
    )
    labels = d["labels"]
    lines = [
        f"dataset     {d['path']}  (shardio format v{d['version']}, {d['created_by']})",
        f"shards      {d['shards']} x {d['shard_format']}, {_human(d['bytes'])}",
        f"samples     {d['samples']}",
        "fields      " + ", ".join(f"{k} ({v})" for k, v in d["fields"].items()),
        f"checksums   sample {d['checksum']['sample']}, shard {d['checksum']['shard']}",
        f"compression {comp_text}",
        "labels      " + ("none" if labels is None else
                          f"{len(labels)} classes: " + ", ".join(labels[:8])
                          + (", ..." if len(labels) > 8 else "")),
    ]
    if d["skipped"]:
        lines.append("skipped     " + ", ".join(f"{k}={v}" for k, v in d["skipped"].items()))
    if listing:
        lines.append("")
        lines.append(f"{'shard':<32} {'samples':>9} {'bytes':>12}  digest")
        for s in d["shard_list"]:
            lines.append(f"{s['path']:<32} {s['samples']:>9} {s['bytes']:>12}  {s['digest']}")
    return "\n".join(lines)
