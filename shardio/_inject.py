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

import math
import os
import time
from typing import Any

from ._fsutil import parse_size
from .errors import UsageError

__all__ = ["ACTIVE", "STATS_ACTIVE", "covers", "delay", "parse_rules", "sample_delays",
           "stat_latency"]

ENV = "SHARDIO_SLOW_READS"
STATS_ENV = "SHARDIO_SLOW_STATS"


def _parse(text: str, env: str, form: str, example: str) -> list[tuple[Any, ...]]:
    """Comma-separated ``DIR:VALUE...`` rules (``form``, e.g. ``DIR:BANDWIDTH:LATENCY``) ->
    ``[(dir + "/", value, ...)]``: a size for ``BANDWIDTH``, seconds for ``LATENCY`` (finite,
    ``>= 0``: a negative one would make ``time.sleep`` fail at the first read, an infinite one
    sleep forever, and NaN do either).

    Raises:
        UsageError: a malformed rule (``env`` and ``example`` name the fix).
    """
    fields = form.split(":")[1:]
    rules = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            d, *values = part.rsplit(":", len(fields))
            if len(values) != len(fields):
                raise ValueError(part)
            parsed = [float(parse_size(v)) if f == "BANDWIDTH" else float(v)
                      for f, v in zip(fields, values)]
        except (ValueError, OverflowError, UsageError) as exc:
            raise UsageError(f"{env}: bad rule {part!r}; write {form}, e.g. {example}") from exc
        for f, v in zip(fields, parsed):
            if f == "LATENCY" and not (math.isfinite(v) and v >= 0):
                raise UsageError(f"{env}: bad rule {part!r}: LATENCY must be a finite number of "
                                 f"seconds >= 0, got {v}; write {form}, e.g. {example}")
        rules.append((os.path.realpath(d).rstrip("/") + "/", *parsed))
    return rules


def parse_rules(text: str) -> list[tuple[str, float, float]]:
    """``DIR:BANDWIDTH:LATENCY`` rules -> ``[(dir + "/", bytes_per_s, latency_s)]``.

    Raises:
        UsageError: a malformed rule.
    """
    return _parse(text, ENV, "DIR:BANDWIDTH:LATENCY", "/data/shared:200MB:0.002")


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


def sample_delays(samples: Any) -> Any:
    """Seconds reading each of ``samples`` (``shardio._scan.Sample``) takes on the simulated
    store, as :func:`delay` sleeps them file by file: an ``array("d")`` for the C loop of a pack
    (shardio/_tarpack.c sleeps each sample's before reading it)."""
    from array import array

    out = array("d", bytes(8 * len(samples)))
    for k, s in enumerate(samples):
        for _name, path, size, _mtime in s.files:
            rule = _rule_for(path)
            if rule is not None:
                out[k] += rule[1] + size / rule[0]
    return out


def delay(path: str, nbytes: int) -> None:
    """Sleep as a read of ``nbytes`` from ``path`` would take on the simulated slow store."""
    rule = _rule_for(path)
    if rule is not None:
        time.sleep(rule[1] + nbytes / rule[0])


_STAT_RULES = _parse(os.environ.get(STATS_ENV, ""), STATS_ENV, "DIR:LATENCY",
                     "/data/shared:0.0005")
STATS_ACTIVE = bool(_STAT_RULES)


def stat_latency(directory: str) -> float:
    """Seconds each stat of a file in ``directory`` sleeps (``SHARDIO_SLOW_STATS``), 0 if none."""
    real = os.path.realpath(directory).rstrip("/") + "/"
    return next((lat for prefix, lat in _STAT_RULES if real.startswith(prefix)), 0.0)
