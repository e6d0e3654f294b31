"""The simulated slow store (shardio._inject) used by the staging benchmark."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from shardio import PackOptions, pack
from shardio.errors import UsageError


def test_rules_parse_and_reject() -> None:
    from shardio._inject import parse_rules

    [(d, bw, lat)] = parse_rules("/data/x:200MB:0.002")
    assert d == os.path.realpath("/data/x") + "/" and bw == 200e6 and lat == 0.002
    assert parse_rules("") == []
    with pytest.raises(UsageError, match="DIR:BANDWIDTH:LATENCY"):
        parse_rules("/data/x:fast")


def test_reads_under_the_slow_dir_sleep(image_tree: Path, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "shared" / "ds"
    pack(image_tree, root, PackOptions(samples_per_shard=30, fsync=False))
    monkeypatch.setenv("SHARDIO_SLOW_READS", f"{tmp_path / 'shared'}:1MB:0.01")
    import shardio._inject as inj

    inj = importlib.reload(inj)
    slept: list[float] = []
    monkeypatch.setattr(inj.time, "sleep", slept.append)
    try:
        from shardio.reader import DatasetReader

        with DatasetReader(root) as r:
            n = sum(len(s["jpg"]) for s in r)
        assert inj.ACTIVE and len(slept) >= 2
        assert sum(slept) >= 0.01 * len(slept) + n / 1e6  # latency per read + bytes/bandwidth
        slept.clear()
        inj.delay(str(tmp_path / "elsewhere"), 10**6)
        assert slept == []
    finally:
        monkeypatch.delenv("SHARDIO_SLOW_READS")
        importlib.reload(inj)


@pytest.mark.parametrize("latency", ["-0.001", "nan", "inf", "-inf", "1e400"])
def test_latency_must_be_finite_and_not_negative(latency: str) -> None:
    """A negative latency made ``time.sleep`` fail at the first read (deep in a worker), an
    infinite one hung every read: both are refused when the rules are read, naming the fix."""
    from shardio._inject import STATS_ENV, _parse, parse_rules

    with pytest.raises(UsageError, match=r"LATENCY must be a finite number of seconds >= 0"):
        parse_rules(f"/data/x:200MB:{latency}")
    with pytest.raises(UsageError, match=rf"{STATS_ENV}: bad rule .*LATENCY must be"):
        _parse(f"/data/x:{latency}", STATS_ENV, "DIR:LATENCY", "/data/shared:0.0005")
    [(_d, _bw, zero)] = parse_rules("/data/x:200MB:0")
    assert zero == 0.0


def test_a_bad_latency_in_the_environment_fails_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardio._inject as inj

    monkeypatch.setenv("SHARDIO_SLOW_STATS", "/data/x:-1")
    try:
        with pytest.raises(UsageError, match="SHARDIO_SLOW_STATS"):
            importlib.reload(inj)
    finally:
        monkeypatch.delenv("SHARDIO_SLOW_STATS")
        importlib.reload(inj)
