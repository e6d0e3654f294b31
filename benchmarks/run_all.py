"""Run the whole benchmark suite, then write a Markdown report with tables and plots.

``python benchmarks/run_all.py`` runs ``bench_pack.py``, ``bench_read.py``, ``bench_loader.py`` and
``bench_stage.py`` one after the other, each as a child process with ``--json-out`` (never
concurrently: they measure throughput on the same CPUs), each under its own time limit; a
benchmark that fails or times out is recorded and the next one runs.  Then it writes
``REPORT.md`` into the output folder::

    python benchmarks/run_all.py                          # full sizes: tens of minutes
    python benchmarks/run_all.py --quick                  # smoke-test sizes: ~1.5 min on 2 CPUs
    python benchmarks/run_all.py --only read,loader --workdir /scratch/$USER
    python benchmarks/run_all.py --args read="--repeat 5" --timeout 7200
    python benchmarks/run_all.py --report-only            # rebuild REPORT.md from the files only

Files in the output folder (default ``benchmarks/results``):

``NAME.jsonl``  the script's JSON lines (``--json-out``); removed before the script runs, so a
                failed run never leaves the previous run's figures looking current
``NAME.log``    the script's stdout and stderr (its own table is at the end)
``runs.json``   how each benchmark last ran: command line, working directory, start time, wall
                time, exit status, load average before and after, the last lines of the log when
                it failed; and the machine (CPUs, memory, versions, git commit)
``REPORT.md``   :func:`build_report` over the files above
``*.png``       the report's plots (matplotlib, Agg; skipped with a note when it is missing)

A run with ``--only`` replaces only the named benchmarks' files and records; the report shows
every benchmark whose results are in the folder, each with the date it ran.  The scripts measure
what they measure: a peer library the report lists (MosaicML Streaming, LitData) that no script
measures is reported as installed or "not installed", never given figures.

Exit status: 0 every selected benchmark ran and wrote its results (targets missed do not count:
at ``--quick`` sizes they mostly miss), 1 at least one failed, timed out or wrote nothing (the
report is written anyway), 2 usage error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._common import check_dir  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "results"
RUNS_FILE = "runs.json"
REPORT_FILE = "REPORT.md"
RUNS_VERSION = 1
LOG_TAIL_LINES = 30


@dataclass(frozen=True)
class Bench:
    """One benchmark script and its time limits (seconds) at full and ``--quick`` sizes."""

    name: str
    script: str
    title: str
    timeout: int
    quick_timeout: int


BENCHES: dict[str, Bench] = {b.name: b for b in (
    Bench("pack", "bench_pack.py", "Pack throughput: shardio pack vs GNU tar vs webdataset",
          timeout=3600, quick_timeout=300),
    Bench("read", "bench_read.py",
          "Reading an epoch: shardio vs torch DataLoader over small files vs webdataset",
          timeout=3600, quick_timeout=600),
    Bench("loader", "bench_loader.py", "ShardLoader vs torch DataLoader",
          timeout=5400, quick_timeout=600),
    Bench("stage", "bench_stage.py", "A slow shared store vs a node-local staging cache",
          timeout=3600, quick_timeout=300),
    Bench("kept", "bench_kept.py", "A training loop that keeps a batch for good",
          timeout=1800, quick_timeout=300),
)}

# Distributions whose versions the machine section lists; the peers table reuses some.
VERSIONS = ("shardio", "torch", "numpy", "webdataset", "pillow", "psutil", "matplotlib",
            "mosaicml-streaming", "litdata")

# Peers the suite is meant to compare against: (label, distribution, what measures it).
PEERS = (
    ("torch DataLoader over small files", "torch",
     "read and loader (`smallfiles`: one open/read per sample)"),
    ("webdataset", "webdataset",
     "pack (`webdataset_shardwriter`), read and loader (`wds_batched`, `wds_dataloader`)"),
    ("MosaicML Streaming", "mosaicml-streaming", "pack (`mosaic_mdswriter`), read and loader "
     "(`mosaic`), in the peers environment (`make peers`)"),
    ("LitData", "litdata", "pack (`litdata_optimize`), read and loader (`litdata`), in the peers "
     "environment (`make peers`)"),
)

MISSING = "missing"


# --- machine information ---------------------------------------------------------------------

def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=10, check=False, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def machine_info() -> dict[str, Any]:
    """What the figures depend on: CPUs, memory, load, OS, versions, the repository's commit."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = None
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        mem = None
    commit = _git("rev-parse", "--short=12", "HEAD")
    if commit is not None and _git("status", "--porcelain", "--untracked-files=no"):
        commit += " (with uncommitted changes)"
    info: dict[str, Any] = {
        "date": _now(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": _cpu_model(),
        "memory_gb": round(mem / 1e9, 1) if mem else None,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "os": platform.platform(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "versions": {name: _dist_version(name) for name in VERSIONS},
        "git_commit": commit,
    }
    if os.environ.get("SLURM_JOB_ID"):
        info["slurm_job_id"] = os.environ["SLURM_JOB_ID"]
        info["slurm_cpus_per_task"] = os.environ.get("SLURM_CPUS_PER_TASK")
    return info


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).astimezone().isoformat(timespec="seconds")


# --- running ---------------------------------------------------------------------------------

def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_runs(results_dir: Path) -> dict[str, Any]:
    """``runs.json`` as a dict (``{"runs": {}, "machine": None}`` when absent or unreadable)."""
    try:
        data = json.loads((results_dir / RUNS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"version": RUNS_VERSION, "runs": {}, "machine": None}
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
        return {"version": RUNS_VERSION, "runs": {}, "machine": None}
    return data


def _default_sigint() -> None:
    """In the child before exec: SIGINT back to its default.  Started from a background shell
    (``nohup ... &``) it would be ignored, Python would install no KeyboardInterrupt handler, and
    _stop's SIGINT could not make the script clean up."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End the child's whole process group: SIGINT (its ``finally`` removes its temporary tree),
    then SIGTERM, then SIGKILL, each after a bounded wait."""
    for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
        # The leader is gone; its workers may linger in the group a moment longer.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        data = path.read_bytes()[-16384:]
    except OSError:
        return ""
    return "\n".join(data.decode("utf-8", "replace").splitlines()[-lines:])


def bench_command(bench: Bench, jsonl: Path, *, quick: bool, workdir: str | None,
                  extra: Sequence[str] = ()) -> list[str]:
    """The exact argv ``run_all`` runs for ``bench``."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / bench.script), "--json-out", str(jsonl)]
    if quick:
        cmd.append("--quick")
    if workdir:
        cmd += ["--workdir", workdir]
    return cmd + list(extra)


def run_bench(bench: Bench, out: Path, *, quick: bool, workdir: str | None = None,
              timeout: float | None = None, extra: Sequence[str] = ()) -> dict[str, Any]:
    """Run one benchmark script to completion or its time limit; return its run record.

    The record's ``status`` is ``ok`` (exit 0 and a JSON lines file), ``failed`` (non-zero exit
    or no results), ``timeout`` or ``interrupted`` (Ctrl-C; re-raised after the child stops).
    """
    # The script runs in the repository root: relative paths would land somewhere else.
    out = out.resolve()
    workdir = os.path.abspath(workdir) if workdir else None
    jsonl, log = out / f"{bench.name}.jsonl", out / f"{bench.name}.log"
    jsonl.unlink(missing_ok=True)
    limit = timeout if timeout is not None else (bench.quick_timeout if quick else bench.timeout)
    cmd = bench_command(bench, jsonl, quick=quick, workdir=workdir, extra=extra)
    record: dict[str, Any] = {
        "command": shlex.join(cmd), "cwd": str(ROOT), "quick": quick, "timeout_s": limit,
        "started": _now(), "loadavg_before": [round(x, 2) for x in os.getloadavg()],
    }
    t0 = time.monotonic()
    interrupted = False
    with open(log, "wb") as f:
        # A session of its own, so that a timeout ends the script's workers and children too.
        proc = subprocess.Popen(cmd, cwd=str(ROOT), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_default_sigint)
        try:
            rc: int | None = proc.wait(timeout=limit)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _stop(proc)
            rc, status = proc.returncode, "timeout"
        except KeyboardInterrupt:
            _stop(proc)
            rc, status, interrupted = proc.returncode, "interrupted", True
    record.update(seconds=round(time.monotonic() - t0, 1), returncode=rc,
                  loadavg_after=[round(x, 2) for x in os.getloadavg()])
    if status == "ok" and not (jsonl.is_file() and jsonl.stat().st_size):
        status = "failed"
        record["error"] = f"exit 0 but {jsonl.name} was not written"
    record["status"] = status
    if status in ("timeout", "interrupted"):
        # The script was stopped; if it still managed to write its lines during the grace
        # period (a signal its worker pool swallowed), they belong to a run that was cut off.
        jsonl.unlink(missing_ok=True)
    if status != "ok":
        record["log_tail"] = _log_tail(log)
    if interrupted:
        record["log_tail"] = _log_tail(log)
        _save_record(out, bench.name, record)
        raise KeyboardInterrupt
    return record


def _save_record(out: Path, name: str, record: dict[str, Any],
                 machine: dict[str, Any] | None = None) -> None:
    runs = load_runs(out)
    runs["version"] = RUNS_VERSION
    runs["runs"][name] = record
    if machine is not None:
        runs["machine"] = machine
    _atomic_write(out / RUNS_FILE, json.dumps(runs, indent=2, sort_keys=True) + "\n")


# --- reading results -------------------------------------------------------------------------

@dataclass
class Results:
    """One benchmark's JSON lines: contender lines, the summary, and what went wrong reading."""

    lines: list[dict[str, Any]]
    summary: dict[str, Any] | None
    present: bool
    bad_lines: int = 0


def read_results(path: Path) -> Results:
    """Parse a ``.jsonl`` file; a missing file or malformed lines are reported, not raised."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return Results([], None, present=False)
    lines: list[dict[str, Any]] = []
    summary, bad = None, 0
    for raw in text.splitlines():
        if not raw.strip():
            continue
        try:
            d = json.loads(raw)
        except ValueError:
            bad += 1
            continue
        if not isinstance(d, dict):
            bad += 1
        elif d.get("kind") == "summary" or d.get("summary") is True:
            summary = d
        else:
            lines.append(d)
    return Results(lines, summary, present=True, bad_lines=bad)


def _get(d: Mapping[str, Any] | None, *path: str) -> Any:
    cur: Any = d
    for key in path:
        if not isinstance(cur, Mapping) or key not in cur:
            return None
        cur = cur[key]
    return cur


def fmt(v: Any) -> str:
    """A table cell: numbers to a readable precision, ``None`` as ``missing``."""
    if v is None:
        return MISSING
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        a = abs(v)
        if a >= 1000:
            return f"{v:,.0f}"
        if a >= 100:
            return f"{v:.1f}"
        if a >= 1 or a == 0:
            return f"{v:.2f}".rstrip("0").rstrip(".") if a < 10 else f"{v:.1f}"
        return f"{v:.3g}"
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt(x) for x in v)
    if isinstance(v, Mapping):
        return "; ".join(f"{k}: {_inner(x, fmt)}" for k, x in v.items())
    return str(v)


def _inner(v: Any, f: Callable[[Any], str]) -> str:
    return "[" + ", ".join(f(x) for x in v) + "]" if isinstance(v, (list, tuple)) else f(v)


def fmt_exact(v: Any) -> str:
    """A ratio's cell: the value exactly as the script rounded it."""
    if isinstance(v, float) and not isinstance(v, bool):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return ", ".join(fmt_exact(x) for x in v)
    if isinstance(v, Mapping):
        return "; ".join(f"{k}: {_inner(x, fmt_exact)}" for k, x in v.items())
    return fmt(v)


def verdict(v: Any) -> str:
    """A target's cell: ``PASS``, ``MISS`` or ``missing``."""
    if v is True:
        return "PASS"
    if v is False:
        return "MISS"
    return MISSING


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> list[str]:
    out = ["| " + " | ".join(_cell(h) for h in headers) + " |",
           "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_cell(c if isinstance(c, str) else fmt(c)) for c in row) + " |"
            for row in rows]
    return out


def _ordered(seen: Iterable[str], expected: Sequence[str]) -> list[str]:
    """Expected names first, in their order (also when absent: they show as missing), then
    any others the script printed."""
    seen = list(dict.fromkeys(seen))
    return list(expected) + [s for s in seen if s not in expected]


# --- plots -----------------------------------------------------------------------------------

class Plotter:
    """Writes PNGs into the results folder with matplotlib's Agg canvas (no pyplot, no global
    backend switch).  ``available`` is False when matplotlib is not installed."""

    def __init__(self, out: Path, enabled: bool = True) -> None:
        self.out = out
        self.reason = ""
        self.available = False
        if not enabled:
            self.reason = "plots disabled (--no-plots)"
            return
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401
            from matplotlib.figure import Figure  # noqa: F401
        except ImportError:
            self.reason = ("plots skipped: matplotlib is not installed "
                           "(`pip install -e .[bench]`)")
            return
        self.available = True

    def _save(self, fig: Any, name: str) -> str:
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        FigureCanvasAgg(fig)
        path = self.out / name
        tmp = path.with_name(path.name + ".tmp")
        fig.tight_layout()
        fig.savefig(tmp, format="png", dpi=110)
        os.replace(tmp, path)
        return name

    def bars(self, name: str, title: str, ylabel: str, labels: Sequence[str],
             series: Mapping[str, Sequence[float | None]], *, log: bool = False,
             hline: tuple[float, str] | None = None,
             groups: Sequence[str] | None = None) -> str | None:
        """Grouped bars, one group per label, one bar per series; ``None`` values left out.
        ``groups`` (one series only) colours each bar by its group, e.g. the contender's tool.
        Returns the file name, or None (and removes a stale file) when there is nothing to draw."""
        path = self.out / name
        values = [v for vs in series.values() for v in vs if v]
        if not self.available or not labels or not values:
            path.unlink(missing_ok=True)
            return None
        from matplotlib.figure import Figure

        fig = Figure(figsize=(max(6.0, 0.9 * len(labels) + 2), 4.2))
        ax = fig.add_subplot()
        width = 0.8 / max(1, len(series))
        legend = len(series) > 1 or hline is not None
        for k, (sname, vs) in enumerate(series.items()):
            keep = [i for i, v in enumerate(vs) if v]
            xs = [i + (k - (len(series) - 1) / 2) * width for i in keep]
            ys = [vs[i] for i in keep]
            if groups is not None and len(series) == 1:
                names = list(dict.fromkeys(groups))
                palette = [f"C{names.index(groups[i]) % 10}" for i in keep]
                bars = ax.bar(xs, ys, width=width, color=palette)
                for g in names:
                    ax.bar([0], [0], width=0, color=f"C{names.index(g) % 10}", label=g)
                legend = True
            else:
                bars = ax.bar(xs, ys, width=width, label=sname if len(series) > 1 else None)
            ax.bar_label(bars, labels=[fmt(float(y)) for y in ys], fontsize=7, padding=1)
        if hline is not None:
            ax.axhline(hline[0], color="0.3", linestyle="--", linewidth=1, label=hline[1])
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        if legend:
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        return self._save(fig, name)

    def lines(self, name: str, title: str, ylabel: str, xlabel: str,
              series: Mapping[str, Sequence[tuple[float, float]]], *,
              log: bool = False) -> str | None:
        path = self.out / name
        if not self.available or not any(series.values()):
            path.unlink(missing_ok=True)
            return None
        from matplotlib.figure import Figure

        fig = Figure(figsize=(6.5, 4.2))
        ax = fig.add_subplot()
        for sname, pts in series.items():
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=sname)
        xs = sorted({p[0] for pts in series.values() for p in pts})
        ax.set_xticks(xs, [str(int(x)) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if log:
            ax.set_yscale("log")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3, which="both")
        return self._save(fig, name)


# --- report sections -------------------------------------------------------------------------

@dataclass
class Section:
    """A benchmark's part of the report and its targets (for the overview table)."""

    lines: list[str]
    targets: dict[str, Any]


def _setup(summary: Mapping[str, Any] | None, keys: Sequence[tuple[str, str]]) -> list[str]:
    if summary is None:
        return []
    parts = [f"{label} {fmt(summary[k])}" for k, label in keys if k in summary]
    return ["Setup: " + "; ".join(parts) + "."] if parts else []


def _figures(title: str, d: Mapping[str, Any] | None) -> list[str]:
    if not isinstance(d, Mapping) or not d:
        return [f"{title}: {MISSING}", ""]
    return [f"**{title}**", "",
            *md_table(("name", "value"), [(k, fmt_exact(v)) for k, v in d.items()]), ""]


def _targets(d: Mapping[str, Any]) -> list[str]:
    if not d:
        return ["Targets: missing (no summary line)", ""]
    return ["**Targets**", "", *md_table(("target", "result"),
                                         [(k, verdict(v)) for k, v in d.items()]), ""]


def _plot_ref(name: str | None, alt: str, plotter: Plotter) -> list[str]:
    if name:
        return [f"![{alt}]({name})", ""]
    return [f"_{plotter.reason or 'plot skipped: no data'}_", ""]


def _notes(summary: Mapping[str, Any] | None) -> list[str]:
    note = _get(summary, "notes")
    return [f"Notes from the script: {note}", ""] if isinstance(note, str) and note else []


PACK_ORDER = ("tar", "shardio_tar_w1_nofsync", "shardio_tar_w2_nofsync", "shardio_tar_w1_fsync",
              "shardio_tar_w2_fsync", "shardio_hdf5_w1_nofsync", "shardio_hdf5_w2_nofsync",
              "webdataset_shardwriter", "mosaic_mdswriter", "litdata_optimize")


def pack_section(res: Results, plotter: Plotter) -> Section:
    by = {d.get("contender"): d for d in res.lines if d.get("kind", "contender") == "contender"}
    names = _ordered([n for n in by if isinstance(n, str)], PACK_ORDER)
    rows = []
    for n in names:
        d = by.get(n, {})
        rows.append((n, fmt(d.get("tool")), fmt(d.get("files_per_s")),
                     fmt(d.get("median_files_per_s")), fmt(d.get("mb_per_s")),
                     fmt(d.get("seconds")), fmt(d.get("cpu_seconds")), fmt(d.get("peak_rss_mb"))))
    s = res.summary
    lines = _setup(s, (("files", "files"), ("payload_mb", "payload MB"), ("classes", "classes"),
                       ("repeat", "best of"), ("shard_size", "shard size"), ("cpus", "CPUs"),
                       ("load_avg_1min", "1-min load before/after"), ("tar", "tar version"),
                       ("webdataset", "webdataset")))
    lines += ["", *md_table(("contender", "tool", "files/s (best)", "files/s (median)", "MB/s",
                             "best s", "CPU s", "peak RSS MB"), rows), ""]
    plot = plotter.bars("pack_files_per_s.png", "pack: files/s (best run; higher is better)",
                        "files/s", names, {"files/s": [_num(by.get(n, {}).get("files_per_s"))
                                                       for n in names]},
                        groups=[str(by.get(n, {}).get("tool", "?")) for n in names])
    lines += _plot_ref(plot, "pack files/s per contender", plotter)
    lines += _figures("Ratios", _get(s, "ratios"))
    targets = dict(_get(s, "targets") or {})
    lines += _targets(targets) + _notes(s)
    return Section(lines, targets)


READ_ORDER = ("shardio", "shardio_loader", "smallfiles", "wds_batched", "wds_dataloader",
              "litdata", "mosaic")
MODES = ("raw", "decode")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def read_section(res: Results, plotter: Plotter) -> Section:
    contenders = [d for d in res.lines if d.get("kind", "contender") == "contender"]
    growth = [d for d in res.lines if d.get("kind") == "growth"]
    by = {(d.get("contender"), d.get("mode")): d for d in contenders}
    names = _ordered([str(d.get("contender")) for d in contenders], READ_ORDER)
    s = res.summary
    lines = _setup(s, (("files", "files"), ("payload_mb", "payload MB"),
                       ("num_shards", "shards"), ("batch_size", "batch"),
                       ("num_workers", "workers"), ("repeat", "best of"), ("cpus", "CPUs"),
                       ("max_load_1min", "max 1-min load"), ("torch", "torch"),
                       ("webdataset", "webdataset"), ("webdataset_setup", "webdataset setup used")))

    def f(n: str, m: str, key: str) -> Any:
        return by.get((n, m), {}).get(key)

    rows = [(n, *(fmt(f(n, m, "samples_per_s")) for m in MODES),
             *(fmt(f(n, m, "mb_per_s")) for m in MODES),
             *(fmt(f(n, m, "min_cpu_us_per_sample")) for m in MODES),
             *(fmt(f(n, m, "peak_pss_mb")) for m in MODES)) for n in names]
    lines += ["", "One epoch per run (worker start and stop included), best run:", "",
              *md_table(("contender", "raw samples/s", "decode samples/s", "raw MB/s",
                         "decode MB/s", "raw CPU µs/sample", "decode CPU µs/sample",
                         "raw peak PSS MB", "decode peak PSS MB"), rows), ""]
    loaders = {n: next((by[n, m].get("loader") for m in MODES if (n, m) in by), None)
               for n in names}
    lines += [f"- `{n}`: `{loaders[n]}`" if loaders[n] else f"- `{n}`: {MISSING}"
              for n in names] + [""]
    plot = plotter.bars("read_samples_per_s.png", "read: samples/s per epoch (best run)",
                        "samples/s", names,
                        {m: [_num(f(n, m, "samples_per_s")) for n in names] for m in MODES})
    lines += _plot_ref(plot, "read samples/s, raw and decode", plotter)
    if growth:
        grows = [(fmt(g.get("contender")), fmt(g.get("persistent_workers")), fmt(g.get("epochs")),
                  fmt(g.get("samples_per_s")), fmt(g.get("rss_growth_pct")),
                  fmt(g.get("pss_growth_pct"))) for g in growth]
        lines += ["Memory growth over epochs (raw mode):", "",
                  *md_table(("contender", "persistent workers", "epochs", "samples/s per epoch",
                             "RSS growth %", "PSS growth %"), grows), ""]
    else:
        lines += [f"Memory growth check: {MISSING}", ""]
    lines += _figures("Ratios (samples/s)", _get(s, "ratios"))
    lines += _figures("CPU ratios (CPU per sample, other/shardio)", _get(s, "cpu_ratios"))
    targets = dict(_get(s, "targets") or {})
    lines += _targets(targets) + _notes(s)
    return Section(lines, targets)


LOADER_E2E_ORDER = ("shardloader", "shardio_dataloader", "smallfiles", "wds_batched",
                    "wds_dataloader", "litdata", "mosaic")


def loader_section(res: Results, plotter: Plotter) -> Section:
    lns = [d for d in res.lines if d.get("kind", "contender") == "contender"]
    transfer = [d for d in lns if d.get("section") == "transfer"]
    e2e = {(d.get("contender"), d.get("mode")): d for d in lns if d.get("section") == "e2e"}
    ceiling = next((d for d in lns if d.get("section") == "ceiling"), None)
    steady = next((d for d in lns if d.get("section") == "steady"), None)
    s = res.summary
    lines = _setup(s, (("files", "files"), ("payload_mb", "payload MB"),
                       ("num_shards", "shards"), ("batch_size", "batch"),
                       ("num_workers", "workers"), ("side", "transfer tensor side"),
                       ("ring_bytes", "ring bytes"), ("repeat", "best of"), ("cpus", "CPUs"),
                       ("max_load_1min", "max 1-min load"), ("loadavg_end", "load at end"),
                       ("torch", "torch"), ("webdataset", "webdataset")))
    lines += ["", "**Transfer** (steady-state epoch, persistent workers; consumer `pages` "
              "touches every page of each batch, `none` nothing):", ""]
    if transfer:
        trows = [(fmt(d.get("name")), fmt(d.get("touch")), fmt(d.get("batches_per_s")),
                  fmt(d.get("median_batches_per_s")), fmt(d.get("main_cpu_ms_per_batch")),
                  fmt(d.get("worker_cpu_ms_per_batch")), fmt(d.get("first_epoch_batches_per_s")),
                  fmt(d.get("peak_pss_mb")), fmt(d.get("peak_shmem_rise_mb"))) for d in transfer]
        lines += [*md_table(("contender", "consumer", "batches/s (best)", "batches/s (median)",
                             "main CPU ms/batch", "worker CPU ms/batch",
                             "first-epoch batches/s", "peak PSS MB", "Shmem rise MB"), trows), ""]
    else:
        lines += [f"Transfer figures: {MISSING}", ""]
    tnames = [str(d.get("name")) for d in transfer]
    plot = plotter.bars("loader_transfer_batches_per_s.png",
                        "loader transfer: batches/s, steady state (best run)", "batches/s",
                        tnames, {"batches/s": [_num(d.get("batches_per_s")) for d in transfer]},
                        groups=[str(d.get("contender", "?")) for d in transfer])
    lines += _plot_ref(plot, "loader transfer batches/s", plotter)

    names = _ordered([str(k[0]) for k in e2e], LOADER_E2E_ORDER)

    def f(n: str, m: str, key: str) -> Any:
        return e2e.get((n, m), {}).get(key)

    rows = [(n, *(fmt(f(n, m, "samples_per_s")) for m in MODES),
             *(fmt(f(n, m, "min_cpu_us_per_sample")) for m in MODES),
             *(fmt(f(n, m, "peak_pss_mb")) for m in MODES),
             *(fmt(f(n, m, "peak_shmem_rise_mb")) for m in MODES)) for n in names]
    lines += ["**End to end** (one epoch, worker start and stop timed):", "",
              *md_table(("contender", "raw samples/s", "decode samples/s", "raw CPU µs/sample",
                         "decode CPU µs/sample", "raw peak PSS MB", "decode peak PSS MB",
                         "raw Shmem rise MB", "decode Shmem rise MB"), rows), ""]
    ceil = _num(_get(ceiling, "samples_per_s"))
    lines += [f"Decode ceiling (decode only, in-memory bytes, {fmt(_get(ceiling, 'num_workers'))}"
              f" processes, pool started before the clock): {fmt(ceil)} samples/s; ShardLoader's "
              f"steady-state decode epoch (second of two, worker start not timed): "
              f"{fmt(_get(steady, 'samples_per_s'))} samples/s (best of "
              f"{fmt(_get(s, 'decode_repeat'))}); ratio per round (ceiling seconds / ShardLoader "
              f"seconds, the two run side by side): "
              f"{fmt_exact(_get(s, 'decode_vs_ceiling_per_round'))}.", ""]
    plot = plotter.bars("loader_e2e_samples_per_s.png", "loader end to end: samples/s (best run)",
                        "samples/s", names,
                        {m: [_num(f(n, m, "samples_per_s")) for n in names] for m in MODES},
                        hline=(ceil, "decode ceiling") if ceil else None)
    lines += _plot_ref(plot, "loader end-to-end samples/s", plotter)
    lines += _figures("Ratios", _get(s, "ratios"))
    targets = dict(_get(s, "targets") or {})
    lines += _targets(targets) + _notes(s)
    return Section(lines, targets)


STAGE_ORDER = ("local", "shared", "staged")


def stage_section(res: Results, plotter: Plotter) -> Section:
    rows = [d for d in res.lines if "epoch" in d]
    by = {(d.get("contender"), d.get("epoch")): d for d in rows}
    names = _ordered([str(d.get("contender")) for d in rows], STAGE_ORDER)
    epochs = sorted({d["epoch"] for d in rows if isinstance(d.get("epoch"), int)})
    s = res.summary
    lines = _setup(s, (("files", "files"), ("samples", "samples"), ("shards", "shards"),
                       ("dataset_bytes", "dataset bytes"), ("epochs", "epochs"),
                       ("latency_s", "simulated latency s"),
                       ("bandwidth", "simulated bandwidth"), ("loadavg", "1-min load at end")))
    size = _num(_get(s, "dataset_bytes"))
    lines += ["", "Samples/s per epoch (`local`: a copy on local disk; `shared`: the slow store; "
              "`staged`: the slow store with a node-local cache):", ""]
    lines += md_table(("epoch", *names),
                      [(str(e + 1), *(fmt(by.get((n, e), {}).get("samples_per_s"))
                                      for n in names)) for e in epochs] or
                      [(MISSING, *(MISSING for _ in names))])
    lines += ["", "Bytes read from the shared store per epoch (direct + staged), in MB:", ""]

    def shared_mb(n: str, e: int) -> str:
        d = by.get((n, e))
        if d is None:
            return MISSING
        a, b = _num(d.get("shared_bytes_direct")), _num(d.get("shared_bytes_staged"))
        if a is None or b is None:
            return MISSING
        return fmt((a + b) / 1e6) + (f" ({fmt((a + b) / size)} passes)" if size else "")

    lines += md_table(("epoch", *names),
                      [(str(e + 1), *(shared_mb(n, e) for n in names)) for e in epochs]
                      or [(MISSING, *(MISSING for _ in names))])
    lines += [""]
    series = {n: [(float(e + 1), float(v)) for e in epochs
                  if (v := _num(by.get((n, e), {}).get("samples_per_s")))] for n in names}
    plot = plotter.lines("stage_epochs.png", "stage: samples/s per epoch", "samples/s (log)",
                         "epoch", series, log=True)
    lines += _plot_ref(plot, "stage samples/s per epoch", plotter)
    lines += _figures("Ratios", {k: s[k] for k in (
        "staged_vs_local_from_epoch_2", "staged_vs_local_from_epoch_2_overall",
        "shared_vs_local_from_epoch_2", "shared_store_passes_per_epoch", "staged_passes_over_all_epochs") if s and k in s})
    target = _get(s, "staged_vs_local_target")
    tname = f"staged_ge_{fmt(target) if target is not None else '0.9'}x_local_from_epoch_2"
    targets = {tname: _get(s, "staged_vs_local_pass"),
               "at_most_one_pass_per_epoch": _get(s, "at_most_one_pass_per_epoch")} if s else {}
    lines += _targets(targets)
    return Section(lines, targets)


KEPT_ORDER = ("none", "kept", "kept_without_detach", "previous", "labels",
              "labels_dataloader")
UNTARGETED = {"kept"}  # benchmarks no issue sets a target for (the overview says so)


def kept_section(res: Results, plotter: Plotter) -> Section:
    rows = {str(d.get("contender")): d for d in res.lines if d.get("kind") == "contender"}
    names = _ordered(list(rows), KEPT_ORDER)
    s = res.summary
    lines = _setup(s, (("files", "files"), ("repeat", "runs"), ("epochs", "timed epochs per run"),
                       ("cpus", "CPUs")))
    lines += ["", "Raw epochs (batch 256, 2 workers; `none`: the loop keeps no batch; `kept`: it "
              "keeps one for good; `kept_without_detach`: the same without `Ring.detach`, as "
              "before it existed; `previous`: it holds each batch one step longer; "
              "`labels`: it keeps every batch's label tensor; "
              "`labels_dataloader`: the same under torch's DataLoader), median of the runs' "
              "median epochs, and the main process's USS growth after the warm-up epoch:", ""]
    lines += md_table(("contender", "epoch s", "samples/s", "USS growth MB", "copied_out",
                       "detached"),
                      [(n, *(fmt(rows.get(n, {}).get(k)) for k in (
                          "median_epoch_seconds", "samples_per_s", "uss_growth_mb", "copied_out",
                          "detached")))
                       for n in names])
    lines += [""]
    lines += _figures("Ratios (epoch seconds over `none`'s) and memory", {
        k: s[k] for k in ("kept_vs_none", "kept_without_detach_vs_none", "previous_vs_none",
                          "labels_uss_growth_mb", "labels_dataloader_uss_growth_mb")
        if s and k in s})
    return Section(lines, {})


SECTIONS: dict[str, Callable[[Results, Plotter], Section]] = {
    "pack": pack_section, "read": read_section, "loader": loader_section, "stage": stage_section,
    "kept": kept_section}


# --- the report ------------------------------------------------------------------------------

def _status(name: str, res: Results, run: Mapping[str, Any] | None) -> str:
    if run is not None:
        st = str(run.get("status", "?"))
        text = f"{st} (exit {fmt(run.get('returncode'))}, {fmt(run.get('seconds'))} s)"
        if st == "ok" and not res.present:
            text += f"; {name}.jsonl {MISSING}"
        return text
    return "results present, no run record" if res.present else MISSING


def _machine_lines(machine: Mapping[str, Any] | None, recorded: bool,
                   probed: Mapping[str, Any] | None = None) -> list[str]:
    """The machine table; ``probed``: the peers environment's versions (``summary.peers`` of
    the read benchmark), shown where this environment lacks the distribution."""
    if not machine:
        return [f"Machine: {MISSING}", ""]
    v = dict(machine.get("versions") or {})
    for name, version in (probed or {}).items():
        if not v.get(name) and isinstance(version, str) and not version.startswith(
                ("unusable", "not installed")):
            v[name] = f"{version} (peers environment)"
    rows = [
        ("recorded", fmt(machine.get("date")) + ("" if recorded else
                                                 " (at report time: no runs.json)")),
        ("CPUs", f"{fmt(machine.get('cpu_count'))} ({fmt(machine.get('cpus_usable'))} usable "
                 "by this process)"),
        ("CPU model", fmt(machine.get("cpu_model"))),
        ("memory GB", fmt(machine.get("memory_gb"))),
        ("load average (1, 5, 15 min)", fmt(machine.get("loadavg"))),
        ("OS", fmt(machine.get("os"))),
        ("python", fmt(machine.get("python"))),
        *((name, v.get(name) or "not installed") for name in VERSIONS),
        ("git commit", fmt(machine.get("git_commit"))),
    ]
    if machine.get("slurm_job_id"):
        rows.append(("Slurm job", f"{machine['slurm_job_id']} "
                                  f"(cpus per task {fmt(machine.get('slurm_cpus_per_task'))})"))
    return ["## Machine", "", *md_table(("item", "value"), rows), ""]


def build_report(results_dir: str | os.PathLike[str], *, plots: bool = True) -> str:
    """The Markdown report for the results in ``results_dir``, from its files alone.

    Reads ``NAME.jsonl`` for every benchmark and ``runs.json`` (commands, statuses, machine);
    anything absent shows as ``missing``.  Writes the plots (PNG) into ``results_dir`` as a side
    effect unless ``plots`` is False or matplotlib is not installed; the caller writes the text.
    """
    out = Path(results_dir)
    runs = load_runs(out)
    records: dict[str, Any] = runs.get("runs") or {}
    machine = runs.get("machine")
    recorded = machine is not None
    if machine is None:
        machine = machine_info()
    plotter = Plotter(out, enabled=plots)
    results = {name: read_results(out / f"{name}.jsonl") for name in BENCHES}
    sections = {name: SECTIONS[name](results[name], plotter) for name in BENCHES}

    quick = [n for n, r in records.items() if isinstance(r, Mapping) and r.get("quick")]
    head = [
        "# shardio benchmark report",
        "",
        f"Built {_now()} from the files in this folder by `benchmarks/run_all.py` "
        "(`python benchmarks/run_all.py --report-only` rebuilds it without rerunning).",
        "",
    ]
    if quick:
        head += [f"**`--quick` runs ({', '.join(quick)}): smoke-test sizes; their figures mean "
                 "little and their targets mostly miss.**", ""]
    overview = []
    for name, bench in BENCHES.items():
        run = records.get(name) if isinstance(records.get(name), Mapping) else None
        t = sections[name].targets
        passed = sum(v is True for v in t.values())
        overview.append((f"[{name}](#{name})", _status(name, results[name], run),
                         fmt(_get(run, "started")),
                         f"{passed}/{len(t)} PASS" if t else
                         "none set" if name in UNTARGETED else MISSING))
    head += ["## Overview", "",
             *md_table(("benchmark", "status", "started", "targets"), overview), ""]

    # The read benchmark probes the peers environment: its versions (or why a peer is unusable).
    probed = _get(results["read"].summary, "peers") if "read" in results else None
    probed = probed if isinstance(probed, Mapping) else {}
    read_kinds = {str(d.get("contender")) for d in results["read"].lines} if "read" in results \
        else set()
    peers = []
    for label, dist, what in PEERS:
        version = (machine.get("versions") or {}).get(dist) or probed.get(dist) or "not installed"
        kind = {"mosaicml-streaming": "mosaic", "litdata": "litdata"}.get(dist)
        if kind is not None and kind not in read_kinds:
            what = f"not measured in this run ({version})" if version != "not installed" else what
        peers.append((label, dist, version, what))
    head += ["## Peers", "",
             "What the scripts compare shardio with, as installed where the suite ran:", "",
             *md_table(("peer", "distribution", "version", "measured by"), peers), ""]
    head += _machine_lines(machine, recorded, probed)

    body: list[str] = []
    for name, bench in BENCHES.items():
        res, run = results[name], records.get(name)
        body += [f"## {name}", "", f"{bench.title} (`benchmarks/{bench.script}`).", ""]
        if isinstance(run, Mapping):
            body += ["Command (run in `" + str(run.get("cwd", ROOT)) + "`):", "", "```sh",
                     str(run.get("command", MISSING)), "```", "",
                     f"Status: {_status(name, res, run)}; started {fmt(run.get('started'))}; "
                     f"time limit {fmt(run.get('timeout_s'))} s; load average before "
                     f"{fmt(run.get('loadavg_before'))}, after {fmt(run.get('loadavg_after'))}; "
                     f"log `{name}.log`.", ""]
            if run.get("status") != "ok":
                if run.get("error"):
                    body += [f"Error: {run['error']}", ""]
                if run.get("log_tail"):
                    body += ["Last lines of the log:", "", "```", str(run["log_tail"]), "```", ""]
        else:
            body += ["Command: unknown (no run record in runs.json).", ""]
        if not res.present:
            body += [f"Results: {MISSING} (`{name}.jsonl` not found).", ""]
            continue
        if res.bad_lines:
            body += [f"Warning: {res.bad_lines} malformed line(s) in `{name}.jsonl` skipped.", ""]
        if res.summary is None:
            body += [f"Warning: no summary line in `{name}.jsonl` (ratios and targets "
                     f"{MISSING}).", ""]
        body += sections[name].lines
    return "\n".join(head + body).rstrip() + "\n"


# --- command line ----------------------------------------------------------------------------

def _parse_only(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in BENCHES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown benchmark(s) {', '.join(bad) or '(none)'}; choose from "
            f"{', '.join(BENCHES)}, comma-separated")
    return names


def _parse_extra(text: str) -> tuple[str, list[str]]:
    name, sep, args = text.partition("=")
    if not sep or name not in BENCHES:
        raise argparse.ArgumentTypeError(
            f"--args takes NAME=ARGS with NAME one of {', '.join(BENCHES)}, e.g. "
            "--args read=\"--repeat 5\"")
    return name, shlex.split(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke-test sizes (each script's --quick)")
    p.add_argument("--only", type=_parse_only, default=list(BENCHES), metavar="NAMES",
                   help=f"comma-separated subset of {','.join(BENCHES)} (default all)")
    p.add_argument("--out", default=str(DEFAULT_OUT),
                   help="results folder (default benchmarks/results)")
    p.add_argument("--workdir", default=None,
                   help="where the scripts generate their data (default system temp)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="time limit per benchmark (default: "
                        + ", ".join(f"{b.name} {b.timeout}s ({b.quick_timeout}s quick)"
                                    for b in BENCHES.values()) + ")")
    p.add_argument("--args", type=_parse_extra, action="append", default=[], metavar="NAME=ARGS",
                   help="extra arguments for one script, e.g. --args read=\"--repeat 5\"")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing; rebuild REPORT.md (and plots) from the results folder")
    p.add_argument("--no-plots", action="store_true", help="write the report without plots")
    return p


def write_report(out: Path, *, plots: bool = True) -> Path:
    """Build the report for ``out`` and write ``out/REPORT.md`` atomically."""
    path = out / REPORT_FILE
    _atomic_write(path, build_report(out, plots=plots))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    out = Path(a.out)
    err = sys.stderr
    if a.report_only:
        if not out.is_dir():
            print(f"run_all: results folder {out} does not exist; run the suite first or pass "
                  "--out", file=err)
            return 2
        print(f"run_all: wrote {write_report(out, plots=not a.no_plots)}", file=err)
        return 0
    if a.timeout is not None and not (0 < a.timeout < float("inf")):
        p.error(f"--timeout {a.timeout}: give a finite number of seconds > 0")
    # Both made (and tried) now: a results folder that cannot be written would otherwise
    # surface only after the first benchmark, a work folder in every script's run.
    check_dir(p, a.out, "--out")
    check_dir(p, a.workdir, "--workdir")
    extra: dict[str, list[str]] = {}
    for name, args in a.args:
        extra.setdefault(name, []).extend(args)
    machine = machine_info()
    failed: list[str] = []
    try:
        for name in a.only:
            bench = BENCHES[name]
            print(f"run_all: {name}: running (log {out / (name + '.log')})", file=err, flush=True)
            rec = run_bench(bench, out, quick=a.quick, workdir=a.workdir, timeout=a.timeout,
                            extra=extra.get(name, ()))
            _save_record(out, name, rec, machine)
            print(f"run_all: {name}: {rec['status']} in {rec['seconds']} s", file=err, flush=True)
            if rec["status"] != "ok":
                failed.append(name)
    except KeyboardInterrupt:
        print("run_all: interrupted; writing the report for what ran", file=err)
        write_report(out, plots=not a.no_plots)
        return 130
    path = write_report(out, plots=not a.no_plots)
    print(f"run_all: wrote {path}" + (f"; failed: {', '.join(failed)}" if failed else ""),
          file=err)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
