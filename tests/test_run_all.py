"""``benchmarks/run_all.py``: the report from JSON lines shaped like the scripts' (tables,
PASS/MISS, plots, missing files and fields), a time limit that stops a script, and one real
``--quick --only stage`` run end to end."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import run_all
from benchmarks.run_all import BENCHES, build_report, main, run_bench
from tests._quickruns import Run

PNG = b"\x89PNG\r\n\x1a\n"


def write_jsonl(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(d) + "\n" for d in lines))


def pack_lines() -> list[dict[str, Any]]:
    def c(name: str, tool: str, fps: float) -> dict[str, Any]:
        return {"bench": "pack", "kind": "contender", "contender": name, "tool": tool,
                "files": 600, "runs": 1, "seconds": 600 / fps, "files_per_s": fps,
                "mb_per_s": fps / 50, "median_files_per_s": fps, "cpu_seconds": 0.1,
                "peak_rss_mb": 25.0}
    return [c("tar", "gnu-tar", 29464.0), c("shardio_tar_w1_nofsync", "shardio", 4382.3),
            c("shardio_tar_w2_nofsync", "shardio", 4476.2),
            c("webdataset_shardwriter", "webdataset", 7053.9),
            {"bench": "pack", "kind": "summary", "files": 600, "payload_mb": 11.8, "cpus": 2,
             "ratios": {"shardio_w1_vs_tar": 0.149, "w2_vs_w1": 1.021},
             "targets": {"shardio_w1_ge_tar": False, "w2_ge_1_6x_w1": True},
             "notes": "ratios of best-run files/s"}]


def read_lines() -> list[dict[str, Any]]:
    out = []
    for mode, scale in (("raw", 1.0), ("decode", 0.25)):
        for name, sps in (("shardio", 5422.3), ("smallfiles", 3300.5), ("wds_batched", 1820.5)):
            out.append({"bench": "read", "kind": "contender", "contender": name, "mode": mode,
                        "loader": f"{name}-loader", "samples_per_s": sps * scale,
                        "mb_per_s": sps * scale / 50, "min_cpu_us_per_sample": 300.0 / scale,
                        "peak_pss_mb": 230.0})
    out.append({"bench": "read", "kind": "growth", "contender": "shardio", "mode": "raw",
                "persistent_workers": True, "epochs": 2, "samples_per_s": [3110.0, 15129.0],
                "rss_growth_pct": 1.06, "pss_growth_pct": 2.38})
    out.append({"bench": "read", "kind": "summary", "files": 400, "ratios":
                {"raw_shardio_vs_smallfiles": 1.643}, "cpu_ratios": {"raw_smallfiles_vs_shardio":
                                                                     1.426},
                "targets": {"raw_shardio_ge_2x_smallfiles": False,
                            "decode_shardio_ge_1_1x_webdataset": True}})
    return out


def loader_lines() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {"bench": "loader", "kind": "contender", "name": f"transfer_pages_{c}",
         "section": "transfer", "contender": c, "mode": "transfer", "touch": "pages",
         "batches_per_s": b, "median_batches_per_s": b, "main_cpu_ms_per_batch": 1.2,
         "worker_cpu_ms_per_batch": 0.0, "peak_pss_mb": 250.0, "peak_shmem_rise_mb": 268.4}
        for c, b in (("shardloader", 217.4), ("dataloader", 154.4))]
    for mode in ("raw", "decode"):
        for c, sps in (("shardloader", 2492.3), ("smallfiles", 5180.4)):
            out.append({"bench": "loader", "kind": "contender", "name": f"{mode}_{c}",
                        "section": "e2e", "contender": c, "mode": mode, "samples_per_s": sps,
                        "min_cpu_us_per_sample": 455.2, "peak_pss_mb": 264.3,
                        "peak_shmem_rise_mb": 0.0})
    out.append({"bench": "loader", "kind": "contender", "name": "decode_ceiling",
                "section": "ceiling", "contender": "decode_ceiling", "mode": "decode",
                "samples_per_s": 2561.4, "num_workers": 2})
    out.append({"bench": "loader", "kind": "contender", "name": "decode_shardloader_steady",
                "section": "steady", "contender": "shardloader", "mode": "decode",
                "samples_per_s": 2533.9, "num_workers": 2})
    out.append({"bench": "loader", "kind": "summary", "ratios": {"raw_shardloader_vs_smallfiles":
                                                                  0.481},
                "targets": {"transfer_ge_3x_dataloader": False, "raw_ge_5x_smallfiles": False}})
    return out


def stage_lines() -> list[dict[str, Any]]:
    rows = [{"contender": c, "epoch": e, "samples": 1500, "samples_per_s": sps,
             "shared_bytes_direct": d, "shared_bytes_staged": s, "bytes_cache": 0}
            for c, e, sps, d, s in (("local", 0, 12062.2, 0, 0), ("local", 1, 72304.9, 0, 0),
                                    ("shared", 0, 349.8, 29546944, 0),
                                    ("shared", 1, 361.2, 29546944, 0),
                                    ("staged", 0, 447.3, 20822018, 30945192),
                                    ("staged", 1, 43328.0, 0, 0))]
    return [*rows, {"summary": True, "dataset_bytes": 30945192, "epochs": 2,
                    "staged_vs_local_from_epoch_2": [0.599], "staged_vs_local_target": 0.9,
                    "staged_vs_local_pass": False, "at_most_one_pass_per_epoch": True,
                    "shared_store_passes_per_epoch": {"shared": [0.955, 0.955],
                                                      "staged": [1.673, 0.0]}}]


def kept_lines() -> list[dict[str, Any]]:
    rows = [{"bench": "kept", "kind": "contender", "contender": c, "files": 1500, "epochs": 2,
             "runs": 1, "median_epoch_seconds": sec, "samples_per_s": 1500 / sec,
             "uss_growth_mb": mb, "copied_out": co, "detached": de}
            for c, sec, mb, co, de in (("none", 0.0109, 0.1, 0, 0), ("kept", 0.0113, 4.7, 0, 1),
                                       ("kept_without_detach", 0.44, 0.3, 4, 0),
                                       ("labels", 0.0132, 0.2, 0, 16),
                                       ("labels_dataloader", 0.027, 0.2, 0, 0))]
    return [*rows, {"bench": "kept", "kind": "summary", "files": 1500, "epochs": 2, "repeat": 1,
                    "cpus": 2, "kept_vs_none": 1.037, "kept_without_detach_vs_none": 40.367,
                    "labels_uss_growth_mb": 0.2, "labels_dataloader_uss_growth_mb": 0.2}]


MACHINE = {"date": "2030-01-01T00:00:00+00:00", "cpu_count": 2, "cpus_usable": 2,
           "cpu_model": "Test CPU", "memory_gb": 25.3, "loadavg": [0.1, 0.2, 0.3], "os": "Linux",
           "python": "3.11.7", "git_commit": "abc123",
           "versions": {"shardio": "0.1.0", "torch": "2.1.0", "webdataset": "1.0.2",
                        "mosaicml-streaming": None, "litdata": None}}


@pytest.fixture
def results(tmp_path: Path) -> Path:
    out = tmp_path / "results"
    out.mkdir()
    for name, lines in (("pack", pack_lines()), ("read", read_lines()),
                        ("loader", loader_lines()), ("stage", stage_lines()),
                        ("kept", kept_lines())):
        write_jsonl(out / f"{name}.jsonl", lines)
    runs = {name: {"command": f"python benchmarks/{b.script} --json-out X --quick",
                   "cwd": "/repo", "quick": True, "started": "2030-01-01T00:00:00+00:00",
                   "seconds": 4.0, "returncode": 0, "status": "ok", "timeout_s": 300}
            for name, b in BENCHES.items()}
    (out / "runs.json").write_text(json.dumps({"version": 1, "machine": MACHINE, "runs": runs}))
    return out


def section(report: str, name: str) -> str:
    return report.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]


def test_report_tables_targets_commands_and_plots(results: Path) -> None:
    pytest.importorskip("matplotlib")
    report = build_report(results)
    for name, b in BENCHES.items():
        assert f"python benchmarks/{b.script} --json-out X --quick" in section(report, name)
    assert "| tar | gnu-tar | 29,464 |" in section(report, "pack")
    assert "| shardio_w1_ge_tar | MISS |" in report and "| w2_ge_1_6x_w1 | PASS |" in report
    assert "| shardio_w1_vs_tar | 0.149 |" in report
    read = section(report, "read")
    assert "| shardio | 5,422 | 1,356 |" in read  # raw and decode side by side
    assert "| shardio_loader | missing | missing |" in read  # expected contender not run
    assert "| decode_shardio_ge_1_1x_webdataset | PASS |" in read
    assert "| shardio | yes | 2 | 3,110, 15,129 | 1.06 | 2.38 |" in read
    loader = section(report, "loader")
    assert "| transfer_pages_shardloader | pages | 217.4 |" in loader
    assert "2,561 samples/s" in loader and "(second of two, worker start not timed): 2,534" in loader
    stage = section(report, "stage")
    assert "| 2 | 72,305 | 361.2 | 43,328 |" in stage
    assert "| staged_ge_0.9x_local_from_epoch_2 | MISS |" in stage
    assert "| at_most_one_pass_per_epoch | PASS |" in stage
    kept = section(report, "kept")
    assert "| kept_without_detach | 0.44 | 3,409 | 0.3 | 4 | 0 |" in kept
    assert "| labels_dataloader_uss_growth_mb | 0.2 |" in kept
    assert "| kept_without_detach_vs_none | 40.367 |" in kept
    overview = section(report, "Overview")
    assert "| [pack](#pack) | ok (exit 0, 4 s) | 2030-01-01T00:00:00+00:00 | 1/2 PASS |" in overview
    peers = section(report, "Peers")
    assert "| MosaicML Streaming | mosaicml-streaming | not installed |" in peers
    assert "| LitData | litdata | not installed |" in peers
    assert "| webdataset | webdataset | 1.0.2 |" in peers
    machine = section(report, "Machine")
    assert "Test CPU" in machine and "abc123" in machine and "0.1, 0.2, 0.3" in machine
    assert "--quick" in report.split("## Overview")[0]
    for png in ("pack_files_per_s.png", "read_samples_per_s.png",
                "loader_transfer_batches_per_s.png", "loader_e2e_samples_per_s.png",
                "stage_epochs.png"):
        assert f"]({png})" in report
        assert (results / png).read_bytes()[:8] == PNG


def test_missing_files_fields_and_bad_lines(results: Path) -> None:
    (results / "pack.jsonl").unlink()
    (results / "runs.json").unlink()
    lines = stage_lines()[:-1]  # no summary line
    del lines[0]["samples_per_s"]
    write_jsonl(results / "stage.jsonl", lines)
    with (results / "stage.jsonl").open("a") as f:
        f.write("{not json\n")
    (results / "read.jsonl").write_text("")
    (results / "pack_files_per_s.png").write_bytes(b"stale")
    report = build_report(results)
    pack = section(report, "pack")
    assert "Results: missing (`pack.jsonl` not found)." in pack
    assert "no run record" in pack
    assert not (results / "pack_files_per_s.png").exists()  # a stale plot does not linger
    stage = section(report, "stage")
    assert "| 1 | missing | 349.8 | 447.3 |" in stage
    assert "1 malformed line(s)" in stage and "no summary line" in stage
    assert "Targets: missing" in stage
    overview = section(report, "Overview")
    assert "| [pack](#pack) | missing | missing | missing |" in overview
    assert "(at report time: no runs.json)" in section(report, "Machine")
    assert "Transfer" in section(report, "loader")  # the others still render


def test_report_without_matplotlib(results: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib.backends.backend_agg", None)
    report = build_report(results)
    assert "plots skipped: matplotlib is not installed" in report
    assert not list(results.glob("*.png"))
    assert "| tar | gnu-tar | 29,464 |" in report


def test_report_only_and_usage_errors(results: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--report-only", "--out", str(results), "--no-plots"]) == 0
    text = (results / "REPORT.md").read_text()
    assert text.startswith("# shardio benchmark report") and "plots disabled" in text
    assert main(["--report-only", "--out", str(tmp_path / "nowhere")]) == 2
    for bad in (["--only", "pack,bogus"], ["--args", "bogus=--x"], ["--args", "read"]):
        with pytest.raises(SystemExit) as exc:
            main(bad)
        assert exc.value.code == 2
    assert "bogus" in capsys.readouterr().err


def test_time_limit_stops_the_script_and_is_recorded(tmp_path: Path) -> None:
    out, work = tmp_path / "results", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    (out / "stage.jsonl").write_text('{"stale": true}\n')
    bench = run_all.Bench("stage", "bench_stage.py", "t", timeout=2, quick_timeout=2)
    rec = run_bench(bench, out, quick=True, workdir=str(work))
    assert rec["status"] == "timeout" and rec["timeout_s"] == 2
    assert rec["seconds"] < 40
    assert not (out / "stage.jsonl").exists()  # the stale results were not left to look current
    assert "--quick" in rec["command"] and "--workdir" in rec["command"]
    assert not list(work.iterdir())  # SIGINT first: the script removed its temporary tree


@pytest.mark.timeout(900)
@pytest.mark.quick_run("run_all_stage")
def test_quick_stage_end_to_end(quick_run: Run) -> None:
    out = quick_run.dir / "results"
    lines = [json.loads(x) for x in (out / "stage.jsonl").read_text().splitlines()]
    assert lines[-1]["summary"] is True
    runs = json.loads((out / "runs.json").read_text())
    rec = runs["runs"]["stage"]
    assert rec["status"] == "ok" and rec["returncode"] == 0 and "bench_stage.py" in rec["command"]
    assert runs["machine"]["cpu_count"] >= 1
    report = (out / "REPORT.md").read_text()
    assert rec["command"] in report
    assert "| [stage](#stage) | ok " in report and "| [pack](#pack) | missing |" in report
    assert "PASS" in section(report, "stage") or "MISS" in section(report, "stage")
    if run_all.Plotter(out).available:
        assert (out / "stage_epochs.png").read_bytes()[:8] == PNG
    assert (out / "stage.log").stat().st_size > 0


def test_machine_table_names_the_peers_environment_versions() -> None:
    """A peer missing from this environment but probed in the peers one shows that version."""
    machine = {"versions": {"shardio": "0.1.0", "litdata": None}, "date": "2026-11-29"}
    probed = {"mosaicml-streaming": "0.13.0", "litdata": "unusable: ImportError: no"}
    table = "\n".join(run_all._machine_lines(machine, True, probed))
    assert "| mosaicml-streaming | 0.13.0 (peers environment) |" in table
    assert "| litdata | not installed |" in table  # unusable there: not a version
    assert "| shardio | 0.1.0 |" in table
