"""Bad arguments to the benchmark scripts and tools stop them at the start with a usage error
(exit 2, a message naming the option and the fix), never a traceback or a wasted run.

Every test here replaces the function that would start the real work with one that fails the
test (``WorkStarted``), so an argument that slipped through shows up at once, not after minutes
of generating, packing and timing.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import bench_kept, bench_loader, bench_pack, bench_read, bench_stage, run_all
from tools import demo


class WorkStarted(AssertionError):
    """The script went on to do its work: the bad argument was not refused."""


def _no_work(*_args: Any, **_kwargs: Any) -> Any:
    raise WorkStarted("the script started its work instead of refusing the arguments")


@pytest.fixture(autouse=True)
def _nothing_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    for mod in (bench_kept, bench_loader, bench_pack, bench_read):
        monkeypatch.setattr(mod, "run_in_workdir", _no_work)
    monkeypatch.setattr(bench_stage, "prepare", _no_work)
    monkeypatch.setattr(run_all, "run_bench", _no_work)
    monkeypatch.setattr(run_all, "machine_info", _no_work)
    monkeypatch.setattr(demo, "make_images", _no_work)


def usage_error(main: Any, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``main(argv)``, expect argparse's exit 2, return stderr."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# --- --json-out and --workdir, the same in every script -------------------------------------

SCRIPTS = [bench_pack.main, bench_read.main, bench_loader.main, bench_kept.main, bench_stage.main]
IDS = ["pack", "read", "loader", "kept", "stage"]


@pytest.mark.parametrize("main", SCRIPTS, ids=IDS)
def test_json_out_in_a_missing_folder_is_refused(main: Any, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """It used to be found out only when the results were written, after the whole run."""
    err = usage_error(main, ["--quick", "--json-out", str(tmp_path / "no" / "such.jsonl")],
                      capsys)
    assert "--json-out" in err and "does not exist" in err and "mkdir" in err


@pytest.mark.parametrize("main", SCRIPTS, ids=IDS)
def test_json_out_that_is_a_directory_is_refused(main: Any, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(main, ["--quick", "--json-out", str(tmp_path)], capsys)
    assert "--json-out" in err and "is a directory" in err
    assert os.path.join(str(tmp_path), "results.jsonl") in err  # the fix, spelled out


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
@pytest.mark.parametrize("main", SCRIPTS, ids=IDS)
def test_json_out_in_a_read_only_folder_is_refused(main: Any, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o555)
    err = usage_error(main, ["--quick", "--json-out", str(ro / "x.jsonl")], capsys)
    assert "--json-out" in err and "not writable" in err


def test_unwritable_places_are_refused_even_as_root(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The same branches as the test above where it is skipped (root), through a stand-in for
    the permission answers."""
    import tempfile

    from benchmarks import _common

    real_access = os.access
    monkeypatch.setattr(_common.os, "access", lambda *_a, **_k: False)
    err = usage_error(bench_read.main, ["--quick", "--json-out", str(tmp_path / "x.jsonl")],
                      capsys)
    assert "--json-out" in err and "not writable" in err
    (tmp_path / "old.jsonl").write_text("")
    err = usage_error(bench_read.main, ["--quick", "--json-out", str(tmp_path / "old.jsonl")],
                      capsys)
    assert "exists and is not writable" in err
    monkeypatch.setattr(_common.os, "access", real_access)

    def refuse(*_a: Any, **_k: Any) -> str:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    err = usage_error(run_all.main, ["--quick", "--out", str(tmp_path / "r")], capsys)
    assert "--out" in err and "cannot create files in it (Permission denied)" in err


@pytest.mark.parametrize("main", SCRIPTS, ids=IDS)
def test_workdir_that_is_a_file_is_refused(main: Any, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("mine")
    err = usage_error(main, ["--quick", "--workdir", str(f)], capsys)
    assert "--workdir" in err and "not a directory" in err
    err = usage_error(main, ["--quick", "--workdir", str(f / "sub")], capsys)
    assert "--workdir" in err and "cannot create" in err
    assert f.read_text() == "mine"


def test_stage_creates_its_workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--workdir`` that does not exist yet: made (bench_stage's ``mkdtemp`` failed on it)."""
    work = tmp_path / "a" / "b"
    seen: list[Path] = []

    def prepare(base: Path, cfg: dict[str, Any]) -> Any:
        seen.append(base)
        raise WorkStarted("stop here")

    monkeypatch.setattr(bench_stage, "prepare", prepare)
    with pytest.raises(WorkStarted, match="stop here"):
        bench_stage.main(["--quick", "--workdir", str(work)])
    assert seen and seen[0].parent == work
    assert not list(work.iterdir())  # the run's folder was removed


# --- bench_stage --------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "words"), [
    (["--files", "64"], ["--files 64", "at least 65"]),
    (["--files", "0"], ["--files 0", "at least 65"]),  # 0 used to mean the default, 1,500
    (["--epochs", "1"], ["--epochs 1", "at least 2", "second epoch"]),
    (["--epochs", "0"], ["--epochs 0", "at least 2"]),  # 0 used to mean the default
    (["--latency", "-0.001"], ["--latency", ">= 0"]),
    (["--latency", "nan"], ["--latency nan", "finite"]),
    (["--latency", "inf"], ["--latency inf", "finite"]),
    (["--bandwidth", "fast"], ["--bandwidth 'fast'", "256MB"]),
    (["--bandwidth", "0"], ["--bandwidth '0'", "positive"]),
])
def test_stage_refuses(argv: list[str], words: list[str], tmp_path: Path,
                       capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(bench_stage.main, ["--quick", "--workdir", str(tmp_path / "w"), *argv],
                      capsys)
    for w in words:
        assert w in err
    assert not (tmp_path / "w").exists()  # refused before anything was made


def test_stage_refuses_a_workdir_with_a_comma(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """SHARDIO_SLOW_READS separates rules with commas: the children failed to parse it."""
    err = usage_error(bench_stage.main, ["--quick", "--workdir", str(tmp_path / "a,b")], capsys)
    assert "comma" in err


# --- bench_read and bench_loader ------------------------------------------------------------


@pytest.mark.parametrize("main", [bench_read.main, bench_loader.main], ids=["read", "loader"])
@pytest.mark.parametrize(("argv", "words"), [
    (["--files", "256"], ["--files 256", "at least 257"]),
    (["--files", "300", "--classes", "301"], ["--classes 301", "--files 300", "fewer"]),
    (["--classes", "0"], ["--classes 0", "at least 1"]),
    (["--shard-size", "big"], ["--shard-size 'big'", "256MB"]),
    (["--shard-size", "1.5"], ["--shard-size '1.5'", "unit"]),
    (["--shard-size", "20KB"], ["--shard-size 20KB", "64KiB or more"]),  # pack: sample too large
    (["--files", "300", "--shard-size", "64MB"], ["one shard", "--shard-size", "or less"]),
    (["--sample-interval", "nan"], ["--sample-interval nan", "> 0"]),
])
def test_read_and_loader_refuse(main: Any, argv: list[str], words: list[str], tmp_path: Path,
                                capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(main, ["--quick", *argv], capsys)
    for w in words:
        assert w in err


@pytest.mark.parametrize(("argv", "words"), [
    (["--ring-bytes", "lots"], ["--ring-bytes 'lots'", "ring_bytes"]),
    (["--ring-bytes", "100"], ["--ring-bytes '100'", "at least 128"]),
    (["--decode-repeat", "0"], ["--decode-repeat 0", "at least 1"]),
])
def test_loader_refuses(argv: list[str], words: list[str],
                        capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(bench_loader.main, ["--quick", *argv], capsys)
    for w in words:
        assert w in err


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mod", [bench_read, bench_loader], ids=["read", "loader"])
def test_one_shard_stops_after_the_pack(mod: Any, tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A tree that packs into one shard (below the bound the start-up check knows) stops right
    after the pack with exit 2 and a shard size that works: webdataset's loaders stop a worker
    that gets no shard, so the run used to fail after the shardio contenders had been timed."""
    from benchmarks._common import run_in_workdir

    monkeypatch.setattr(mod, "run_in_workdir", run_in_workdir)
    monkeypatch.setattr(mod, "_run_child", _no_work)
    work = tmp_path / "w"
    assert mod.main(["--files", "257", "--classes", "2", "--shard-size", "16MB",
                     "--workdir", str(work)]) == 2
    err = capsys.readouterr().err
    assert "made 1 shard(s)" in err and "at least 2" in err and "--shard-size" in err
    assert not list(work.iterdir())


# --- bench_pack and bench_kept --------------------------------------------------------------


@pytest.mark.parametrize("main", [bench_pack.main, bench_kept.main], ids=["pack", "kept"])
def test_more_classes_than_files_is_refused(main: Any,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(main, ["--files", "5", "--classes", "6"], capsys)
    assert "--classes 6 is more than --files 5" in err and "--classes 5 or fewer" in err


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_pack_refuses_a_bad_fs_latency(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(bench_pack.main, ["--quick", "--fs-latency", value], capsys)
    assert "--fs-latency" in err and "finite" in err


# --- run_all ----------------------------------------------------------------------------------


def test_run_all_checks_out_and_workdir_first(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "file"
    f.write_text("mine")
    err = usage_error(run_all.main, ["--quick", "--out", str(f)], capsys)
    assert "--out" in err and "not a directory" in err
    err = usage_error(run_all.main, ["--quick", "--out", str(tmp_path / "r"),
                                     "--workdir", str(f / "sub")], capsys)
    assert "--workdir" in err and "cannot create" in err
    err = usage_error(run_all.main, ["--quick", "--out", str(tmp_path / "r"),
                                     "--timeout", "nan"], capsys)
    assert "--timeout nan" in err
    assert f.read_text() == "mine"


# --- tools/demo.py --------------------------------------------------------------------------


def test_demo_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--out DIR" in out and "SHARDIO_DEMO_DIR" in out


def test_demo_never_empties_a_folder_it_did_not_write(tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """``SHARDIO_DEMO_DIR=~ make demo`` used to ``rmtree`` the home folder."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    err = usage_error(demo.main, ["--out", str(mine)], capsys)
    assert "not empty" in err and "not a previous demo" in err
    assert (mine / "thesis.tex").read_text() == "years of work"
    (mine / "thesis.tex").unlink()  # only folders the demo also writes: still not the demo's
    for name in ("images/class_000", "images/class_001", "dataset"):
        (mine / name).mkdir(parents=True)
    assert "make clean" in usage_error(demo.main, ["--out", str(mine)], capsys)
    assert sorted(os.listdir(mine)) == ["dataset", "images"]
    f = tmp_path / "file"
    f.write_text("x")
    assert "not a directory" in usage_error(demo.main, ["--out", str(f)], capsys)


def test_demo_out_default_comes_from_the_environment(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    mine = tmp_path / "env"
    mine.mkdir()
    (mine / "keep").write_text("x")
    monkeypatch.setenv("SHARDIO_DEMO_DIR", str(mine))
    err = usage_error(demo.main, [], capsys)
    assert str(mine) in err and (mine / "keep").exists()


@pytest.mark.parametrize("layout", ["marker", "empty", "missing"])
def test_demo_reuses_its_own_output(layout: str, tmp_path: Path) -> None:
    """A previous demo's (marked) folder and an empty or missing one are emptied and marked;
    the demo then starts (make_images)."""
    out = tmp_path / "demo-out"
    if layout != "missing":
        out.mkdir()
    if layout == "marker":
        (out / demo.MARKER).write_text("")
        (out / "dataset").mkdir()
        (out / "dataset" / "shard-000000.tar").write_bytes(b"x")
    with pytest.raises(WorkStarted):
        demo.main(["--out", str(out)])
    assert sorted(os.listdir(out)) == [demo.MARKER]
