"""The scan's stats, and then the pack's reads, in threads (``PackOptions.scan_threads``,
``shardio/_scan.py``, ``shardio.packer._ReadAhead``).

A scan that fetches its stats through threads must find the same samples, in the same order,
with the same problems, as a one-thread scan; it must turn threads on by itself when stats are
slow (a parallel filesystem, simulated with ``SHARDIO_SLOW_STATS``) and not when they are fast;
and no stat thread may outlive the scan (the packer forks its workers around it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

import shardio
from shardio._packpool import Task
from shardio._scan import AUTO_SCAN_THREADS, Sample, Walk, scan_source
from shardio.cli import main as cli_main
from shardio.codec import Codec
from shardio.errors import UnreadableFileError, UsageError
from shardio.packer import _pack_shard, _ReadAhead
from tests.test_pack import file_bytes, write_files

ROOT = Path(__file__).resolve().parents[1]


def _tree(root: Path, n: int = 300) -> Path:
    """Class folders with nested subfolders, multi-field samples, hidden files, a link to a
    file, a broken link and a file without an extension (the last two are problems)."""
    files = {}
    for i in range(n):
        d = f"c{i % 3}/sub{i % 4}" if i % 5 else f"c{i % 3}"
        files[f"{d}/s{i:04d}.jpg"] = bytes([i % 256]) * (i % 700)
        if i % 7 == 0:
            files[f"{d}/s{i:04d}.json"] = b'{"i": %d}' % i
    files["c0/.hidden.jpg"] = b"never packed"
    files["c1/noext"] = b"no field name"
    write_files(root, files)
    os.symlink("s0005.jpg", root / "c2" / "alias.jpg")
    os.symlink("gone.jpg", root / "c2" / "broken.jpg")
    return root


def _walk(src: Path, threads: int | None) -> tuple[list[tuple[str, object, object]], dict, Walk]:
    w = Walk(str(src), str(src.parent / "out"), label_from_dir=True, on_error="skip",
             scan_threads=threads)
    found = [(s.key, s.files, s.label) for s in w]
    return found, dict(w.skipped), w


@pytest.mark.parametrize("threads", [2, 8, 64])
def test_threads_find_the_same_samples(tmp_path: Path, threads: int) -> None:
    src = _tree(tmp_path / "src")
    one, skipped_one, w1 = _walk(src, 1)
    many, skipped_many, wn = _walk(src, threads)
    assert many == one
    assert skipped_many == skipped_one == {"broken_symlink": 1, "no_extension": 1}
    assert len(one) == 301  # 300 samples and the link
    assert (w1.stats.threads, wn.stats.threads) == (1, threads)


def test_a_list_of_files_with_threads(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    names = sorted(str(p.relative_to(src)) for p in src.rglob("*") if not p.is_dir())
    listing = tmp_path / "list.txt"
    listing.write_text("\n".join(names + ["c0/missing.jpg"]) + "\n")
    results = [scan_source(str(src), str(tmp_path / "out"), files_from=str(listing),
                           label_from_dir=True, on_error="skip", scan_threads=t)
               for t in (1, 8)]
    a, b = ([(s.key, s.files) for s in r.samples] for r in results)
    assert a == b and len(a) == 302  # the hidden file too: a list names what it packs
    assert results[0].skipped == results[1].skipped
    assert results[1].skipped == {"broken_symlink": 1, "unreadable": 1, "no_extension": 1}


def test_no_stat_thread_outlives_the_scan(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    before = threading.active_count()
    _walk(src, 8)
    assert threading.active_count() == before
    # A scan abandoned half-way (the packer stops at an error) shuts its pool down too.
    w = Walk(str(src), str(tmp_path / "out"), label_from_dir=True, on_error="skip",
             scan_threads=8)
    it = iter(w)
    next(it)
    for _ in range(100):
        next(it)
    assert threading.active_count() > before  # the pool is running
    it.close()
    assert threading.active_count() == before


@pytest.mark.parametrize("workers", [1, 2])
def test_pack_is_the_same_with_threads(tmp_path: Path, workers: int) -> None:
    src = _tree(tmp_path / "src")
    outs = []
    for t in (1, 8):
        out = tmp_path / f"out{t}"
        shardio.pack(src, out, label_from_dir=True, on_error="skip", samples_per_shard=40,
                     workers=workers, scan_threads=t, fsync=False, progress=False)
        outs.append(file_bytes(out))
    assert outs[0].keys() == outs[1].keys()
    for name in outs[0]:
        assert outs[0][name] == outs[1][name], name


def test_bad_thread_counts_are_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                            ) -> None:
    src = _tree(tmp_path / "src", 10)
    for bad in (0, -2, 1.5):
        with pytest.raises(UsageError, match="scan_threads"):
            shardio.pack(src, tmp_path / "out", scan_threads=bad, progress=False)
    assert not (tmp_path / "out").exists()
    assert cli_main(["pack", str(src), str(tmp_path / "o2"), "--scan-threads", "0"]) == 2
    assert "scan_threads" in capsys.readouterr().err


_CHILD = textwrap.dedent("""
    import json, sys, threading, time
    import shardio._scan as scan
    seen = set()
    real = scan._fetch_entries
    def spy(entries, latency=0.0):
        seen.add(threading.get_ident())
        return real(entries, latency)
    scan._fetch_entries = spy
    out = {}
    for threads in (None, 1):
        w = scan.Walk(sys.argv[1], sys.argv[1] + "-out", label_from_dir=False, on_error="skip",
                      scan_threads=threads)
        seen.clear()
        t = time.perf_counter()
        keys = [s.key for s in w]
        out[str(threads)] = {"threads": w.stats.threads, "fetching_threads": len(seen),
                             "keys": keys, "seconds": time.perf_counter() - t,
                             "probes": w.stats.probes}
    print(json.dumps(out))
""")


def _child(src: Path, slow: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "SHARDIO_SLOW_STATS"}
    if slow is not None:
        env["SHARDIO_SLOW_STATS"] = slow
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(src)], env=env, cwd=str(ROOT),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_slow_stats_turn_threads_on(tmp_path: Path) -> None:
    src = write_files(tmp_path / "src", {f"d{i % 4}/f{i:04d}.bin": b"x" for i in range(400)})
    got = _child(src, f"{src}:0.002")  # 2 ms a stat: a loaded metadata server
    auto, one = got["None"], got["1"]
    assert auto["threads"] == AUTO_SCAN_THREADS and auto["fetching_threads"] > 1
    assert one["threads"] == 1 and one["fetching_threads"] == 1  # the simulated latency, in line
    assert auto["keys"] == one["keys"] and len(one["keys"]) == 400
    print(f"[scan] 400 stats at 2 ms: {one['seconds']:.2f} s in one thread, "
          f"{auto['seconds']:.2f} s automatic ({AUTO_SCAN_THREADS} threads after the probe)")


def test_fast_stats_keep_threads_off(tmp_path: Path) -> None:
    src = write_files(tmp_path / "src", {f"d{i % 4}/f{i:04d}.bin": b"x" for i in range(400)})
    auto = _child(src, None)["None"]
    # Only the probe's 64 stats, in line; nothing fetched ahead after it.
    assert auto["threads"] == 1 and auto["fetching_threads"] == 1


def test_a_slow_mount_further_down_is_found(tmp_path: Path) -> None:
    # The first folder answers at local speed (its dentries cached, say), the second slowly: the
    # automatic scan decides on one thread, times its stats again after 4096 and turns the
    # threads on for the slow folder.
    files = {f"a/f{i:05d}.bin": b"" for i in range(4200)}
    files.update({f"b/f{i:04d}.bin": b"" for i in range(300)})
    src = write_files(tmp_path / "src", files)
    got = _child(src, f"{src / 'b'}:0.002")
    auto, one = got["None"], got["1"]
    assert auto["probes"] == 2 and auto["threads"] == AUTO_SCAN_THREADS
    assert auto["fetching_threads"] > 1
    assert auto["keys"] == one["keys"] and len(auto["keys"]) == 4500


def test_slow_stats_rule_must_parse(tmp_path: Path) -> None:
    env = {**os.environ, "SHARDIO_SLOW_STATS": "/data:fast"}
    proc = subprocess.run([sys.executable, "-c", "import shardio._inject"], env=env,
                          cwd=str(ROOT), capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "DIR:LATENCY" in proc.stderr


def test_stats_of_a_long_list_come_back_in_order(tmp_path: Path) -> None:
    from shardio._scan import _Stats

    src = write_files(tmp_path / "src", {f"d/f{i:05d}.bin": bytes(i % 50) for i in range(5000)})
    paths = sorted(str(p) for p in (src / "d").iterdir()) * 2  # 10,000 stats
    paths.insert(17, str(src / "d" / "missing.bin"))
    for threads in (None, 1, 8):
        stats = _Stats(threads)
        try:
            got = stats.paths(paths)
        finally:
            stats.close()
        assert len(got) == len(paths)
        assert isinstance(got[17], FileNotFoundError)
        assert [g.st_size for i, g in enumerate(got) if i != 17] == \
            [os.stat(p).st_size for i, p in enumerate(paths) if i != 17]
        if threads is None:  # local speed: one thread, timed again after 4096 stats
            assert (stats.threads, stats.probes) == (1, 2)


# --- reads in threads (shardio.packer._ReadAhead) -------------------------------------------


def _task_files(root: Path, n: int = 60) -> list[Sample]:
    files = {f"d/s{i:03d}.bin": bytes([i]) * (100 + 37 * i) for i in range(n)}
    write_files(root, files)
    return [Sample(f"d/s{i:03d}", [("bin", str(root / f"d/s{i:03d}.bin"), 100 + 37 * i, 0)], i % 3)
            for i in range(n)]


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_threaded_reads_write_the_same_shard(tmp_path: Path, fmt: str) -> None:
    samples = _task_files(tmp_path / "src")
    samples.insert(7, Sample("d/gone", [("bin", str(tmp_path / "src/d/gone.bin"), 5, 0)], 1))
    out = {}
    for threads in (1, 4):
        final = str(tmp_path / f"t{threads}" / f"shard-000000{'.tar' if fmt == 'tar' else '.h5'}")
        os.makedirs(os.path.dirname(final))
        _n, written, skipped = _pack_shard(Task(0, final, samples, "fp", threads), fmt, Codec(),
                                           "xxh3_64", False, "skip")
        assert skipped == {"unreadable": 1} and written.samples == 60
        out[threads] = file_bytes(Path(final).parent)
    assert out[1] == out[4]
    # With on_error="raise" the missing file raises its typed error; nothing is published.
    final = str(tmp_path / "raise" / "shard-000000.tar")
    os.makedirs(os.path.dirname(final))
    with pytest.raises(UnreadableFileError, match="gone.bin"):
        _pack_shard(Task(0, final, samples, "fp", 4), "tar", Codec(), "xxh3_64", False, "raise")
    assert os.listdir(os.path.dirname(final)) == []
    assert not any(t.name.startswith("shardio-read") for t in threading.enumerate())


def test_reads_ahead_are_bounded(tmp_path: Path) -> None:
    samples = _task_files(tmp_path / "src", 40)
    wide = _ReadAhead(samples, 3)
    tight = _ReadAhead(samples, 3, ahead_bytes=1)
    try:
        for i in range(40):
            assert wide.get(i) == [("bin", bytes([i]) * (100 + 37 * i))]
            assert len(wide.pending) == min(11, 39 - i)  # 12 in flight with the one asked for
            assert tight.get(i)[0][1][:1] == bytes([i])
            assert len(tight.pending) == 0  # only the sample asked for was read
    finally:
        wide.close()
        tight.close()


# Packs argv[1] automatically and with one thread; "readers": the most threads that read files
# at once, seen either way: the C loop's (the threads argument of _tarpack.fill) or the Python
# reads' (_read_sample's distinct threads; argv[3] == "python" takes the C loop away).
_READ_CHILD = textwrap.dedent("""
    import json, os, shutil, sys, threading, time
    import shardio, shardio.packer as packer, shardio.formats.tar as tar_format
    seen, fills = set(), []
    real = packer._read_sample
    def spy(s):
        seen.add(threading.get_ident())
        return real(s)
    packer._read_sample = spy
    real_fill = tar_format._fill
    def fill_spy(*args):
        fills.append(args[11] if len(args) > 11 else 1)
        assert len(args) < 13 or args[12] is not None  # the simulated delays reach the C loop
        return real_fill(*args)
    tar_format._fill = None if sys.argv[3] == "python" else fill_spy
    out = {}
    for threads in (None, 1):
        dest = f"{sys.argv[2]}-{threads}"
        seen.clear()
        fills.clear()
        t = time.perf_counter()
        shardio.pack(sys.argv[1], dest, samples_per_shard=100, scan_threads=threads, fsync=False,
                     progress=False)
        out[str(threads)] = {"seconds": time.perf_counter() - t,
                             "readers": max([len(seen), *fills]),
                             "files": {n: open(os.path.join(dest, n), "rb").read().hex()
                                       for n in sorted(os.listdir(dest))}}
    print(json.dumps(out))
""")


def _pack_slow(tmp_path: Path, reader: str, stats: str | None, reads: str) -> tuple[float, float]:
    """Pack 300 small files under simulated latency (``SHARDIO_SLOW_STATS`` ``stats`` unless
    None, ``SHARDIO_SLOW_READS`` ``reads``) automatically and with one thread (``_READ_CHILD``);
    check both packs are the same and only the automatic one read in threads; their seconds."""
    src = write_files(tmp_path / "src", {f"d{i % 2}/f{i:04d}.bin": os.urandom(300)
                                         for i in range(300)})
    env = {k: v for k, v in os.environ.items() if k != "SHARDIO_SLOW_STATS"}
    env["SHARDIO_SLOW_READS"] = f"{src}:{reads}"
    if stats is not None:
        env["SHARDIO_SLOW_STATS"] = f"{src}:{stats}"
    proc = subprocess.run([sys.executable, "-c", _READ_CHILD, str(src), str(tmp_path / "out"),
                           reader],
                          env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    auto, one = got["None"], got["1"]
    assert auto["files"] == one["files"]  # the same shards and manifest
    assert auto["readers"] > 1 and one["readers"] == 1
    return one["seconds"], auto["seconds"]


@pytest.mark.parametrize("reader", ["c", "python"])
def test_a_slow_source_is_read_in_threads(tmp_path: Path, reader: str) -> None:
    one, auto = _pack_slow(tmp_path, reader, "0.001", "1GB:0.001")
    print(f"[pack, {reader} reads] 300 files at 1 ms a stat and 1 ms a read: {one:.2f} s in one "
          f"thread, {auto:.2f} s automatic")


@pytest.mark.parametrize("reader", ["c", "python"])
def test_slow_reads_alone_turn_read_threads_on(tmp_path: Path, reader: str) -> None:
    # Fast stats (a cached namespace) but slow reads: the scan keeps one thread, and each shard
    # times its first 128 reads and goes on in threads.
    one, auto = _pack_slow(tmp_path, reader, None, "1GB:0.002")
    print(f"[pack, {reader} reads] 300 files at 2 ms a read: {one:.2f} s in one thread, "
          f"{auto:.2f} s automatic")


def _spy_fill(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Record each call of the tar writer's C loop: (first key of its list, start, threads)."""
    import shardio.formats.tar as tar_format

    calls: list[tuple[str, int, int]] = []
    real = tar_format._fill

    def spy(*args: Any) -> Any:
        calls.append((args[0][0].key, args[1], args[11] if len(args) > 11 else 1))
        return real(*args)

    monkeypatch.setattr(tar_format, "_fill", spy)
    return calls


@pytest.mark.parametrize("per_shard", [200, 2])
def test_fast_reads_stay_in_the_c_loop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       per_shard: int) -> None:
    # Tiny shards too: the probe adds their reads up to 128 samples rather than judging each
    # one's first batch (page faults of fresh buffers included) on its own.
    import shardio.packer as packer

    fills = _spy_fill(monkeypatch)
    src = write_files(tmp_path / "src", {f"d/f{i:04d}.bin": b"x" * 100 for i in range(500)})
    shardio.pack(src, tmp_path / "out", samples_per_shard=per_shard, fsync=False,
                 progress=False)
    assert fills and {threads for _key, _start, threads in fills} == {1}
    assert packer._PROBE.verdict is False and packer._PROBE.samples >= 128
    assert packer._slow_reads(128, 128_000, 0.08)
    assert not packer._slow_reads(128, 128_000, 0.03)


def test_the_c_loop_stops_for_the_read_probe(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # No simulated delay here, so the C loop reads: it must hand back after the 128 probed
    # samples, and a "slow" verdict (forced) must move the rest of the shard to threads.
    import shardio.packer as packer

    fills = _spy_fill(monkeypatch)
    monkeypatch.setattr(packer, "_slow_reads", lambda files, nbytes, seconds: True)
    src = write_files(tmp_path / "src", {f"d/f{i:04d}.bin": bytes([i % 256]) * 300
                                         for i in range(500)})
    shardio.pack(src, tmp_path / "out", samples_per_shard=200, fsync=False, progress=False)
    # Where each shard (its first key) went on in threads: shard 0 from its 129th sample, later
    # ones from their first, without a probe.
    firsts: dict[str, int] = {}
    for key, start, threads in fills:
        if threads > 1:
            firsts.setdefault(key, start)
    assert list(firsts.values()) == [128, 0, 0]
    assert all(threads == 1 for key, start, threads in fills if key in firsts and
               start < firsts[key])
    monkeypatch.undo()
    shardio.pack(src, tmp_path / "ref", samples_per_shard=200, scan_threads=1, fsync=False,
                 progress=False)
    assert file_bytes(tmp_path / "out") == file_bytes(tmp_path / "ref")


# --- a large directory's samples as their stats arrive (Walk._walk_streamed) -------------------


def _big_folder(root: Path) -> Path:
    """A class folder of ~400 entries: stems with one and two fields, a subfolder named like a
    stem, hidden files, a file with no extension (a problem, skipped)."""
    files: dict[str, bytes] = {}
    for i in range(300):
        files[f"c0/{i:04d}.jpg"] = bytes(i % 7)
        if i % 4 == 0:
            files[f"c0/{i:04d}.json"] = b"{}"
    files.update({"c0/0100/x.jpg": b"1", "c0/0100-b/y.jpg": b"2", "c0/0100 c.jpg": b"",
                  "c0/0100.b.c": b"", "c0/.hidden.jpg": b"3", "c0/README": b"4",
                  "c1/z.jpg": b"5"})
    return write_files(root, files)


def _spy_streamed(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The folders Walk._walk_streamed walks, by name, in order."""
    streamed: list[str] = []
    real = Walk._walk_streamed

    def note(self: Any, path: str, *args: Any) -> Any:
        streamed.append(os.path.basename(path))
        return real(self, path, *args)

    monkeypatch.setattr(Walk, "_walk_streamed", note)
    return streamed


@pytest.mark.parametrize("label", [False, True])
def test_a_large_folder_streams_its_samples_as_stats_arrive(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, label: bool) -> None:
    from shardio import _scan

    src = _big_folder(tmp_path / "src")
    monkeypatch.setattr(_scan, "_STREAM_MIN", 50)
    monkeypatch.setattr(_scan, "_STREAM_PER", 1)  # runs of 2 x 1 entries (or a key's more)
    fetched: list[int] = []
    real_fetch = _scan._fetch_entries

    def counted(entries: Any, latency: float = 0.0) -> Any:
        out = real_fetch(entries, latency)
        fetched.append(len(entries))
        return out

    monkeypatch.setattr(_scan, "_fetch_entries", counted)
    walk = Walk(str(src), str(tmp_path / "o"), label_from_dir=label, on_error="skip",
                scan_threads=2)
    it = iter(walk)
    first = next(it)
    at_first = sum(fetched)
    got = [first, *it]
    assert at_first <= 6 and sum(fetched) > 350  # two runs' stats, not the folder's ~380
    monkeypatch.setattr(_scan, "_list_dir", None)
    ref = Walk(str(src), str(tmp_path / "o"), label_from_dir=label, on_error="skip",
               scan_threads=1)
    want = list(ref)
    assert [(s.key, s.files, s.label) for s in got] == [(s.key, s.files, s.label) for s in want]
    assert (walk.files, walk.skipped, walk.labels) == (ref.files, ref.skipped, ref.labels)
    assert walk.skipped == {"no_extension": 1}


def test_a_folder_with_links_or_closed_early_does_not_stream_or_leak(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from shardio import _scan

    src = _big_folder(tmp_path / "src")
    os.symlink(src / "c0" / "0001.jpg", src / "c0" / "9999.jpg")
    monkeypatch.setattr(_scan, "_STREAM_MIN", 50)
    monkeypatch.setattr(_scan, "_STREAM_PER", 8)
    streamed = _spy_streamed(monkeypatch)
    walk = Walk(str(src), str(tmp_path / "o"), label_from_dir=True, on_error="skip",
                scan_threads=4)
    keys = [s.key for s in walk]
    assert not streamed and "c0/9999" in keys  # a link's place needs its target's stat
    os.unlink(src / "c0" / "9999.jpg")
    walk = Walk(str(src), str(tmp_path / "o"), label_from_dir=True, on_error="skip",
                scan_threads=4)
    it = iter(walk)
    for _ in range(40):
        next(it)
    it.close()  # e.g. the pack failed: the runs in flight end, the pool with them
    assert streamed == ["c0"]
    assert not [t for t in threading.enumerate() if t.name.startswith("shardio-stat")]


def test_a_flat_tree_is_probed_inside_its_large_folder_then_streams(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe has not decided when the walk reaches the one large folder (the top holds
    # just it): it times that folder's first stats (here any stat counts as slow), turns the
    # threads on, and the folder streams, with the same samples as the one-thread walk.
    from shardio import _scan

    src = _big_folder(tmp_path / "src")
    monkeypatch.setattr(_scan, "_STREAM_MIN", 50)
    monkeypatch.setattr(_scan, "_SLOW_STAT", 0.0)
    streamed = _spy_streamed(monkeypatch)
    walk = Walk(str(src), str(tmp_path / "o"), label_from_dir=True, on_error="skip")
    got = [(s.key, s.files, s.label) for s in walk]
    assert streamed == ["c0"] and walk.stats.pooled and walk.stats.probes == 1
    monkeypatch.setattr(_scan, "_list_dir", None)
    ref = Walk(str(src), str(tmp_path / "o"), label_from_dir=True, on_error="skip",
               scan_threads=1)
    assert got == [(s.key, s.files, s.label) for s in ref]
    assert (walk.files, walk.skipped) == (ref.files, ref.skipped)
