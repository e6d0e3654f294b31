"""Pack throughput: ``shardio pack`` against GNU tar and webdataset's ShardWriter, same run, warm cache.

``python benchmarks/bench_pack.py`` generates an ImageFolder tree (default 20,000 JPEGs of 5-40 KB in
100 class folders, :func:`tools.make_dataset.make_images`), reads every file once so the source sits in
the page cache, then times, ``--repeat`` times each, in rounds (every contender once per round, the
order rotated each round):

* ``tar``: ``tar cf OUT/src.tar -C PARENT src`` (process wall time; tar does not fsync);
* ``shardio_tar_w{1,2}_{fsync,nofsync}``: ``python -m shardio pack SRC OUT --label-from-dir
  --workers N --shard-size 64MB [--no-fsync]`` as a subprocess, so interpreter start-up counts against
  shardio as process start counts against tar.  shardio's modules are byte-compiled first
  (``compileall``), as ``pip install`` leaves them: under ``PYTHONDONTWRITEBYTECODE=1`` every run
  would otherwise compile them from source (~35 ms of a ~0.45 s run);
* ``shardio_hdf5_w{1,2}_nofsync``: the same with ``--format hdf5 --no-fsync``;
* ``shardio_tar_w1_slowfs_{1thread,auto}``: ``shardio_tar_w1_nofsync`` on a simulated parallel
  filesystem whose every stat, and every file read, first waits ``--fs-latency`` seconds (default
  0.5 ms, a loaded Lustre; ``SHARDIO_SLOW_STATS`` and ``SHARDIO_SLOW_READS``,
  :mod:`shardio._inject`), with ``--scan-threads 1`` and with the default (the scan turns its
  stat threads on by itself, and the workers read with as many); ``--fs-latency 0`` leaves them
  out;
* ``webdataset_shardwriter``: ``webdataset.ShardWriter("OUT/%06d.tar", maxsize=64e6)`` fed
  ``{"__key__", "jpg", "cls"}`` samples.  It runs in a child process (so its memory is measurable
  and does not mix with this script's), timed *inside* the child around listing, reading and
  writing: ``import webdataset`` (which imports torch, ~2 s) is left out of its figure, so the
  comparison favours webdataset.  The child's whole wall time is reported as ``process_seconds``;
* ``mosaic_mdswriter`` (``streaming.MDSWriter``, 64 MB shards) and ``litdata_optimize``
  (``litdata.optimize``, 64 MB chunks, one worker), where the peers environment (``make peers``,
  ``benchmarks/_common.py``) imports them: timed like webdataset, inside a child of the peers
  interpreter, import excluded.

Output directories are deleted (and ``sync`` run) between runs, outside the timed region; nothing is
dropped from the page cache.  stdout gets one JSON line per contender, then one ``summary`` line with
the ratios and target booleans; stderr gets a table.  MB = 1e6 bytes of source payload.  Peak RSS
(GNU ``time`` ``%M``; null where GNU time is missing) is the largest single-process peak in the
contender's process tree, so with two workers it is the largest of the three processes, not their
sum; webdataset's includes importing torch.  ``cpu_seconds`` is user+system time of the whole
process tree, except for webdataset and the peers, where it covers the timed region only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import PEERS, peers_python, probe_peers, usable  # noqa: E402
from benchmarks._common import add_output_args, emit, run_in_workdir  # noqa: E402
from benchmarks._common import check_files_classes, check_output_args, check_seconds  # noqa: E402
from benchmarks._common import check_slow_store_dir  # noqa: E402
from benchmarks._common import dist_version as _dist_version  # noqa: E402

SHARD_SIZE = "64MB"
FS_LATENCY = 0.0005
WDS_MAXSIZE = 64e6
QUICK = {"files": 600, "classes": 10, "repeat": 1}
DEFAULTS = {"files": 20000, "classes": 100, "repeat": 3}


@dataclass
class Run:
    """One timed run of one contender."""

    seconds: float
    cpu_seconds: float | None = None
    peak_rss_bytes: int | None = None
    process_seconds: float | None = None
    out_bytes: int = 0


@dataclass
class Contender:
    """A named contender; ``run(out)`` performs one timed run writing into ``out`` and checks it."""

    name: str
    run: Callable[[str], Run]
    meta: dict[str, Any] = field(default_factory=dict)
    runs: list[Run] = field(default_factory=list)


# --- process timing -------------------------------------------------------------------------------


def _gnu_time() -> str | None:
    """Path of a working GNU ``time``, or None.

    The ``ru_maxrss`` that ``wait4`` reports for a child of this script is never below this script's
    own RSS: Linux carries the forked (or vforked) parent's high-water mark across ``exec``.  GNU time
    is a small C program, so the child it forks starts near zero and its ``%M`` is the command's own.
    """
    path = shutil.which("time") or "/usr/bin/time"
    try:
        with tempfile.NamedTemporaryFile("r") as f:
            subprocess.run([path, "-f", "%M", "-o", f.name, "true"], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            int(f.read().split()[-1])
    except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
        return None
    return path


GNU_TIME = _gnu_time()


def _timed_process(cmd: Sequence[str], cwd: str | None = None,
                   env: dict[str, str] | None = None) -> tuple[Run, str]:
    """Run ``cmd``; return its wall time, CPU time (``wait4``), peak RSS (GNU time) and stdout.

    Raises:
        RuntimeError: the command failed (its stderr is included).
    """
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, \
            tempfile.NamedTemporaryFile("r") as rss_file:
        argv = list(cmd)
        if GNU_TIME:
            argv = [GNU_TIME, "-f", "%M", "-o", rss_file.name, *argv]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out, stderr=err, stdin=subprocess.DEVNULL, cwd=cwd,
                                env=env)
        _pid, status, ru = os.wait4(proc.pid, 0)
        dt = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
        rss_text = rss_file.read().split()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr}")
    # %M is the largest ru_maxrss of the command's process tree, in KiB.
    rss = int(rss_text[-1]) * 1024 if GNU_TIME and rss_text else None
    return Run(seconds=dt, cpu_seconds=ru.ru_utime + ru.ru_stime, peak_rss_bytes=rss,
               process_seconds=dt), stdout


def _byte_compile() -> None:
    """Write the ``__pycache__`` of the shardio package the contenders run (this checkout's), as an
    install does; ``compileall`` writes it even under ``PYTHONDONTWRITEBYTECODE``."""
    import compileall

    if not compileall.compile_dir(str(ROOT / "shardio"), quiet=1):
        raise RuntimeError(f"byte-compiling {ROOT / 'shardio'} failed")


def _dir_bytes(path: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(path) if e.is_file())


# --- contenders -----------------------------------------------------------------------------------


def _tar(src: str) -> Callable[[str], Run]:
    parent, name = os.path.split(os.path.abspath(src))

    def run(out: str) -> Run:
        os.makedirs(out)
        r, _ = _timed_process(["tar", "cf", os.path.join(out, "src.tar"), "-C", parent, name])
        r.out_bytes = _dir_bytes(out)
        return r

    return run


def _shardio(src: str, files: int, payload: int, fmt: str, workers: int, fsync: bool,
             extra: Sequence[str] = (), env: dict[str, str] | None = None) -> Callable[[str], Run]:
    def run(out: str) -> Run:
        cmd = [sys.executable, "-m", "shardio", "pack", src, out, "--label-from-dir",
               "--workers", str(workers), "--shard-size", SHARD_SIZE, "--format", fmt, "--json",
               "--no-progress", *extra] + ([] if fsync else ["--no-fsync"])
        # cwd=ROOT: `python -m` puts the working directory first on sys.path, so this checkout runs.
        r, stdout = _timed_process(cmd, cwd=str(ROOT), env=env)
        stats = json.loads(stdout.strip().splitlines()[-1])
        # raw_bytes also counts the "cls" labels --label-from-dir adds, so it exceeds the payload.
        if stats["files_in"] != files or stats["raw_bytes"] < payload:
            raise RuntimeError(f"shardio packed {stats['files_in']} files / {stats['raw_bytes']} "
                               f"bytes, expected {files} / {payload}")
        r.out_bytes = _dir_bytes(out)
        return r

    return run


def _webdataset(src: str, files: int) -> Callable[[str], Run]:
    def run(out: str) -> Run:
        os.makedirs(out)
        r, stdout = _timed_process([sys.executable, __file__, "--webdataset-child", src, out])
        child = json.loads(stdout.strip().splitlines()[-1])
        if child["files"] != files:
            raise RuntimeError(f"webdataset wrote {child['files']} samples, expected {files}")
        r.seconds, r.cpu_seconds = child["seconds"], child["cpu_seconds"]
        r.out_bytes = _dir_bytes(out)
        return r

    return run


def webdataset_child(src: str, out: str) -> int:
    """Write ``src`` with ``webdataset.ShardWriter``; print the timed region's seconds as JSON.

    Listing (sorted, like shardio's scan), reading and writing are inside the timed region; importing
    webdataset (and torch with it) is not.
    """
    import webdataset as wds

    t0, c0 = time.perf_counter(), time.process_time()
    items = _listing(src)
    with wds.ShardWriter(os.path.join(out, "%06d.tar"), maxsize=WDS_MAXSIZE, verbose=0) as sink:
        for key, path, cls in items:
            with open(path, "rb") as f:
                data = f.read()
            sink.write({"__key__": key, "jpg": data, "cls": cls})
    n = len(items)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(json.dumps({"seconds": dt, "cpu_seconds": cpu, "files": n}))
    return 0


def _listing(src: str) -> list[tuple[str, str, int]]:
    """``(key, path, class id)`` of every file, sorted like shardio's scan (classes, then names)."""
    classes = sorted(e.name for e in os.scandir(src) if e.is_dir() and not e.name.startswith("."))
    items = []
    for cls, cname in enumerate(classes):
        cdir = os.path.join(src, cname)
        items += [(f"{cname}/{f.split('.', 1)[0]}", os.path.join(cdir, f), cls)
                  for f in sorted(os.listdir(cdir)) if not f.startswith(".")]
    return items


# Peer writers, run with the peers interpreter (benchmarks/_common.py): contender name -> kind.
PEER_WRITERS = {"mosaic_mdswriter": "mosaic", "litdata_optimize": "litdata"}


def _peer(name: str, src: str, files: int, python: str) -> Callable[[str], Run]:
    def run(out: str) -> Run:
        r, stdout = _timed_process([python, __file__, "--peer-child", name, src, out],
                                   cwd=str(ROOT))
        child = json.loads(stdout.strip().splitlines()[-1])
        if child["files"] != files:
            raise RuntimeError(f"{name} wrote {child['files']} samples, expected {files}")
        r.seconds, r.cpu_seconds = child["seconds"], child["cpu_seconds"]
        r.out_bytes = sum(_dir_bytes(d) for d, _sub, _f in os.walk(out))
        return r

    return run


def peer_child(name: str, src: str, out: str) -> int:
    """Write ``src`` with a peer's writer; print the timed region's seconds as JSON.

    The writers are ``bench_read.py``'s conversions, timed here like webdataset's (listing,
    reading and writing timed, the import not): ``mosaic_mdswriter`` is ``streaming.MDSWriter``
    (64 MB shards, columns ``jpg: bytes``, ``cls: int``, no compression, no extra hashes) in
    this process; ``litdata_optimize`` is ``litdata.optimize`` (64 MB chunks) with one worker,
    the process it starts included.  CPU time covers this process and its children.
    """
    from benchmarks.bench_read import convert_litdata, convert_mosaic

    if name == "mosaic_mdswriter":
        import streaming  # noqa: F401  (imported outside the timed region)
    else:
        import litdata  # noqa: F401

    t0 = time.perf_counter()
    c0, k0 = os.times(), resource.getrusage(resource.RUSAGE_CHILDREN)
    if name == "mosaic_mdswriter":
        n = convert_mosaic(src, out)
    else:
        n = convert_litdata(src, out, workers=1)
    dt = time.perf_counter() - t0
    c1, k1 = os.times(), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (c1.user - c0.user + c1.system - c0.system
           + k1.ru_utime - k0.ru_utime + k1.ru_stime - k0.ru_stime)
    print(json.dumps({"seconds": dt, "cpu_seconds": cpu, "files": n}))
    return 0


# --- dataset --------------------------------------------------------------------------------------


def make_tree(src: str, files: int, classes: int) -> tuple[int, int]:
    """Generate the tree, then read every file once so it sits in the page cache.

    Returns:
        ``(files, payload_bytes)`` as found on disk.
    """
    from tools.make_dataset import make_images

    make_images(src, files=files, classes=classes)
    n, total = 0, 0
    for dirpath, _dirs, names in os.walk(src):
        for name in names:
            with open(os.path.join(dirpath, name), "rb") as f:
                total += len(f.read())
            n += 1
    return n, total


def _clear(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    os.sync()  # settle deferred writeback of the last output so it does not bleed into the next run


# --- reporting ------------------------------------------------------------------------------------


def _rate(n: float, seconds: float) -> float:
    return round(n / seconds, 1) if seconds > 0 else float("inf")


def contender_line(c: Contender, files: int, payload: int) -> dict[str, Any]:
    secs = [r.seconds for r in c.runs]
    best = min(c.runs, key=lambda r: r.seconds)
    med = statistics.median(secs)
    rss = [r.peak_rss_bytes for r in c.runs if r.peak_rss_bytes is not None]
    line: dict[str, Any] = {
        "bench": "pack", "kind": "contender", "contender": c.name, **c.meta,
        "files": files, "payload_bytes": payload, "runs": len(secs),
        "seconds": round(best.seconds, 4),
        "files_per_s": _rate(files, best.seconds),
        "mb_per_s": _rate(payload / 1e6, best.seconds),
        "median_seconds": round(med, 4),
        "median_files_per_s": _rate(files, med),
        "median_mb_per_s": _rate(payload / 1e6, med),
        "all_seconds": [round(s, 4) for s in secs],
        "cpu_seconds": round(best.cpu_seconds, 3) if best.cpu_seconds is not None else None,
        "peak_rss_mb": round(max(rss) / 1e6, 1) if rss else None,
        "output_bytes": best.out_bytes,
    }
    if best.process_seconds is not None and best.process_seconds != best.seconds:
        line["process_seconds"] = round(best.process_seconds, 4)
    return line


def summary_line(lines: dict[str, dict[str, Any]], files: int, payload: int,
                 cfg: dict[str, Any]) -> dict[str, Any]:
    def fps(name: str) -> float:
        return float(lines[name]["files_per_s"])

    def ratio(a: str, b: str) -> float:
        return round(fps(a) / fps(b), 3)

    w1, w2 = "shardio_tar_w1_nofsync", "shardio_tar_w2_nofsync"
    ratios = {
        # tar does not fsync, webdataset does not either: compare like with like.
        "shardio_w1_vs_tar": ratio(w1, "tar"),
        "shardio_w1_vs_webdataset": ratio(w1, "webdataset_shardwriter"),
        "w2_vs_w1": ratio(w2, w1),
        "shardio_w1_fsync_vs_tar": ratio("shardio_tar_w1_fsync", "tar"),
        "shardio_w1_fsync_vs_webdataset": ratio("shardio_tar_w1_fsync", "webdataset_shardwriter"),
        "w2_vs_w1_fsync": ratio("shardio_tar_w2_fsync", "shardio_tar_w1_fsync"),
        "fsync_cost_w1": ratio(w1, "shardio_tar_w1_fsync"),
        "hdf5_w1_vs_tar": ratio("shardio_hdf5_w1_nofsync", "tar"),
        "hdf5_w1_vs_shardio_tar_w1": ratio("shardio_hdf5_w1_nofsync", w1),
        "hdf5_w2_vs_w1": ratio("shardio_hdf5_w2_nofsync", "shardio_hdf5_w1_nofsync"),
    }
    if "shardio_tar_w1_slowfs_auto" in lines:
        ratios["slowfs_auto_vs_1thread"] = ratio("shardio_tar_w1_slowfs_auto",
                                                 "shardio_tar_w1_slowfs_1thread")
    ratios.update({f"shardio_w1_vs_{name}": ratio(w1, name) for name in PEER_WRITERS
                   if name in lines})
    return {
        "bench": "pack", "kind": "summary", "files": files, "payload_bytes": payload,
        "payload_mb": round(payload / 1e6, 1), **cfg,
        "files_per_s": {name: line["files_per_s"] for name, line in lines.items()},
        "ratios": ratios,
        "targets": {
            "shardio_w1_ge_tar": ratios["shardio_w1_vs_tar"] >= 1.0,
            "shardio_ge_2x_webdataset": ratios["shardio_w1_vs_webdataset"] >= 2.0,
            "w2_ge_1_6x_w1": ratios["w2_vs_w1"] >= 1.6,
        },
        "notes": ("ratios of best-run files/s; shardio_w1_vs_tar, shardio_w1_vs_webdataset and w2_vs_w1 "
                  "use --no-fsync (tar and webdataset do not fsync); *_fsync ratios use shardio's "
                  "default fsync. shardio and tar timings include process start-up; webdataset's "
                  "and the peers' (mosaic_mdswriter, litdata_optimize: peers environment) exclude "
                  "their import (see process_seconds)."),
    }


def print_table(lines: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    err = sys.stderr
    print(f"\npack benchmark: {summary['files']} files, {summary['payload_mb']} MB, "
          f"best of {summary['repeat']} (median in brackets), {summary['cpus']} CPUs, "
          f"load average {summary['load_avg_1min'][0]} -> {summary['load_avg_1min'][1]}", file=err)
    print(f"{'contender':<24} {'files/s':>18} {'MB/s':>16} {'best s':>8} {'cpu s':>7} "
          f"{'RSS MB':>7}", file=err)
    for ln in lines:
        print(f"{ln['contender']:<24} {ln['files_per_s']:>9.0f} ({ln['median_files_per_s']:>6.0f})"
              f" {ln['mb_per_s']:>7.1f} ({ln['median_mb_per_s']:>6.1f}) {ln['seconds']:>8.3f}"
              f" {ln['cpu_seconds'] if ln['cpu_seconds'] is not None else '-':>7}"
              f" {ln['peak_rss_mb'] if ln['peak_rss_mb'] is not None else '-':>7}", file=err)
    print("ratios: " + ", ".join(f"{k}={v}" for k, v in summary["ratios"].items()), file=err)
    print("targets: " + ", ".join(f"{k}={'PASS' if v else 'MISS'}"
                                  for k, v in summary["targets"].items()), file=err)


# --- main -----------------------------------------------------------------------------------------


def _tool_version(cmd: Sequence[str]) -> str:
    try:
        return subprocess.run(list(cmd), capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=None, help="files to generate (default 20000)")
    p.add_argument("--classes", type=int, default=None, help="class folders (default 100)")
    p.add_argument("--repeat", type=int, default=None, help="runs per contender (default 3)")
    p.add_argument("--fs-latency", type=float, default=FS_LATENCY,
                   help=f"seconds each stat and each file read waits in the slow-filesystem "
                   f"contenders (default {FS_LATENCY}; 0: leave them out)")
    add_output_args(p, f"smoke configuration: {QUICK['files']} files, repeat {QUICK['repeat']}")
    p.add_argument("--webdataset-child", nargs=2, metavar=("SRC", "OUT"), help=argparse.SUPPRESS)
    p.add_argument("--peer-child", nargs=3, metavar=("NAME", "SRC", "OUT"), help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.webdataset_child:
        return webdataset_child(*a.webdataset_child)
    if a.peer_child:
        return peer_child(*a.peer_child)
    base = QUICK if a.quick else DEFAULTS
    n_files = a.files if a.files is not None else base["files"]
    n_classes = a.classes if a.classes is not None else base["classes"]
    repeat = a.repeat if a.repeat is not None else base["repeat"]
    check_files_classes(p, n_files, n_classes)
    if repeat < 1:
        p.error(f"--repeat {repeat}: at least 1 needed")
    check_seconds(p, "--fs-latency", a.fs_latency)
    if a.fs_latency > 0:
        check_slow_store_dir(p, a.workdir)
    check_output_args(p, a)
    return run_in_workdir("shardio-bench-pack-", a.workdir, a.keep,
                          lambda work: _bench(work, n_files, n_classes, repeat, a.json_out,
                                              a.fs_latency))


def _bench(work: str, n_files: int, n_classes: int, repeat: int, json_out: str | None,
           fs_latency: float = FS_LATENCY) -> int:
    load_start = os.getloadavg()[0]
    src = os.path.join(work, "src")
    t0 = time.perf_counter()
    files, payload = make_tree(src, n_files, n_classes)
    print(f"generated and warmed {files} files, {payload / 1e6:.1f} MB in "
          f"{time.perf_counter() - t0:.1f}s under {src}", file=sys.stderr)

    _byte_compile()
    contenders = [Contender("tar", _tar(src), {"tool": "gnu-tar", "fsync": False, "workers": 1})]
    for fmt, workers, fsync in [("tar", 1, True), ("tar", 1, False), ("tar", 2, True),
                                ("tar", 2, False), ("hdf5", 1, False), ("hdf5", 2, False)]:
        name = f"shardio_{fmt}_w{workers}_{'fsync' if fsync else 'nofsync'}"
        contenders.append(Contender(name, _shardio(src, files, payload, fmt, workers, fsync),
                                    {"tool": "shardio", "format": fmt, "workers": workers,
                                     "fsync": fsync}))
    if fs_latency > 0:
        slow = {**os.environ, "SHARDIO_SLOW_STATS": f"{src}:{fs_latency}",
                "SHARDIO_SLOW_READS": f"{src}:100GB:{fs_latency}"}
        for mode, extra in [("1thread", ["--scan-threads", "1"]), ("auto", [])]:
            contenders.append(Contender(
                f"shardio_tar_w1_slowfs_{mode}",
                _shardio(src, files, payload, "tar", 1, False, extra, slow),
                {"tool": "shardio", "format": "tar", "workers": 1, "fsync": False,
                 "fs_latency_s": fs_latency, "scan_threads": 1 if extra else "auto"}))
    contenders.append(Contender("webdataset_shardwriter", _webdataset(src, files),
                                {"tool": "webdataset", "fsync": False, "workers": 1,
                                 "timing": "in-process, import excluded"}))
    python = peers_python()
    peers = probe_peers(python)
    for name, kind in PEER_WRITERS.items():
        dist = PEERS[kind][1]
        if python is not None and usable(peers[dist]):
            contenders.append(Contender(name, _peer(name, src, files, python),
                                        {"tool": dist, "fsync": False, "workers": 1,
                                         "timing": "in-process, import excluded"}))
    print("peers: " + ", ".join(f"{d} {v}" for d, v in peers.items()), file=sys.stderr)

    for rnd in range(repeat):
        k = rnd % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            out = os.path.join(work, "out")
            _clear(out)
            c.runs.append(c.run(out))
            print(f"  round {rnd + 1}/{repeat} {c.name}: {c.runs[-1].seconds:.3f}s", file=sys.stderr)
            _clear(out)

    import shardio

    cfg = {
        "repeat": repeat, "classes": n_classes, "cpus": os.cpu_count(),
        "python": platform.python_version(), "shardio": shardio.__version__,
        "webdataset": _dist_version("webdataset"), "peers_python": python, "peers": peers,
        "tar": _tool_version(["tar", "--version"]), "shard_size": SHARD_SIZE,
        "rss_method": "gnu-time %M" if GNU_TIME else "unavailable",
        # Other work on the machine skews the figures (most the 2-worker ones); a 1-minute load
        # average near or above the CPU count means the run was not alone.
        "load_avg_1min": [round(load_start, 2), round(os.getloadavg()[0], 2)],
    }
    lines = [contender_line(c, files, payload) for c in contenders]
    summary = summary_line({ln["contender"]: ln for ln in lines}, files, payload, cfg)
    emit(lines, summary, json_out)
    print_table(lines, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
