"""Slow storage, simulated: delays added to shardio's own reads and scans under given directories.

For benchmarks and demos that need a slow shared filesystem on a machine that has none (the
staging benchmark measures a node-local cache against it).  Set before the process starts::

    SHARDIO_SLOW_READS="DIR:BANDWIDTH:LATENCY[,DIR:BANDWIDTH:LATENCY...]"
    e.g. SHARDIO_SLOW_READS="/data/shared:200MB:0.002"

Every read shardio makes of a file under ``DIR`` (shard reads, stager copies) then costs
``LATENCY`` seconds plus ``bytes / BANDWIDTH``, slept in the reading process: a per-process
model of a loaded parallel filesystem (each reader sees that latency and bandwidth).  Unset, the
only cost is one attribute test per read.  Never set in production.

A slow metadata server, for the scan of ``shardio pack``::

    SHARDIO_SLOW_STATS="DIR:LATENCY[,DIR:LATENCY...]"     e.g. "/data/shared:0.0005"

Every stat the scan makes of a file under ``DIR`` then sleeps ``LATENCY`` seconds first, in the
thread that makes it (a sleep releases the GIL, as a stat waiting on its reply does).
"""

from __future__ import annotations

import os
import time

from ._fsutil import parse_size
from .errors import UsageError

__all__ = ["ACTIVE", "STATS_ACTIVE", "covers", "delay", "parse_rules", "stat_latency"]

ENV = "SHARDIO_SLOW_READS"
STATS_ENV = "SHARDIO_SLOW_STATS"


def parse_rules(text: str) -> list[tuple[str, float, float]]:
    """``DIR:BANDWIDTH:LATENCY`` rules -> ``[(dir + "/", bytes_per_s, latency_s)]``.

    Raises:
        UsageError: a malformed rule.
    """
    rules = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            d, bw, lat = part.rsplit(":", 2)
            rules.append((os.path.realpath(d).rstrip("/") + "/", float(parse_size(bw)),
                          float(lat)))
        except (ValueError, UsageError) as exc:
            raise UsageError(f"{ENV}: bad rule {part!r}; write DIR:BANDWIDTH:LATENCY, e.g. "
                             "/data/shared:200MB:0.002") from exc
    return rules


_RULES = parse_rules(os.environ.get(ENV, ""))
ACTIVE = bool(_RULES)


_MATCH: dict[str, tuple[float, float] | None] = {}


def _rule_for(path: str) -> tuple[float, float] | None:
    """The (bandwidth, latency) rule covering ``path``, resolved once per path: reads on
    other paths (a local copy, the node cache) must not pay a ``realpath`` per read."""
    try:
        return _MATCH[path]
    except KeyError:
        real = os.path.realpath(path)
        rule = next(((bw, lat) for prefix, bw, lat in _RULES if real.startswith(prefix)), None)
        _MATCH[path] = rule
        return rule


def covers(path: str) -> bool:
    """Whether reads of ``path`` are slowed (a rule of ``SHARDIO_SLOW_READS`` covers it)."""
    return ACTIVE and _rule_for(path) is not None


def delay(path: str, nbytes: int) -> None:
    """Sleep as a read of ``nbytes`` from ``path`` would take on the simulated slow store."""
    rule = _rule_for(path)
    if rule is not None:
        time.sleep(rule[1] + nbytes / rule[0])


def _parse_stat_rules(text: str) -> list[tuple[str, float]]:
    """``DIR:LATENCY`` rules -> ``[(dir + "/", latency_s)]``.

    Raises:
        UsageError: a malformed rule.
    """
    rules = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            d, lat = part.rsplit(":", 1)
            rules.append((os.path.realpath(d).rstrip("/") + "/", float(lat)))
        except ValueError as exc:
            raise UsageError(f"{STATS_ENV}: bad rule {part!r}; write DIR:LATENCY, e.g. "
                             "/data/shared:0.0005") from exc
    return rules


_STAT_RULES = _parse_stat_rules(os.environ.get(STATS_ENV, ""))
STATS_ACTIVE = bool(_STAT_RULES)


def stat_latency(directory: str) -> float:
    """Seconds each stat of a file in ``directory`` sleeps (``SHARDIO_SLOW_STATS``), 0 if none."""
    real = os.path.realpath(directory).rstrip("/") + "/"
    return next((lat for prefix, lat in _STAT_RULES if real.startswith(prefix)), 0.0)
