"""The pack's fast paths give exactly what the plain code gives, and fail the same way.

* the background shard writer (writev in a thread): errors mid-shard (disk full, an unreadable
  file) still raise typed errors and leave no temp file;
* the forked worker pool: same bytes for any worker count, a worker's error raised typed in the
  parent, a dead worker reported;
* the streaming pack (shards written while the walk goes on): the same bytes as a pack that
  scans first, and the walk yields samples in sorted key order;
* the text-built job fingerprint, the hoisted size estimates and the numpy-free index writer
  against the reference implementations (``json.dumps``, ``_estimate``, ``ShardIndex.to_bytes``).
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest

import shardio
from shardio.errors import FileChangedError
import shardio.formats.tar as tar_format
from shardio import packer, packplan, packstate
from shardio._scan import scan_source
from shardio.config import PackOptions
from shardio.errors import EmptySourceError, ShardioError, StorageFullError, UnreadableFileError
from shardio.formats.base import IndexBuilder, ShardIndex
from tests.test_pack import (
    assert_nothing_published,
    file_bytes,
    random_tree,
    read_back,
    temp_files,
    write_files,
)


@pytest.fixture
def small_flush(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flush every 4 KiB, so even a small shard goes through the background writer."""
    monkeypatch.setattr(tar_format, "_FLUSH", 4096)


def _odd_tree(root: Path) -> Path:
    """Long names (pax headers), non-ASCII names, several fields, compressible text."""
    files: dict[str, bytes] = {}
    for c in ["a", "b", "ü"]:
        for i in range(12):
            stem = f"x{i}" + "L" * (110 if i % 4 == 0 else 0) + ("é" if i % 3 == 0 else "")
            files[f"{c}/{stem}.txt"] = (f"hello {i} " * (i * 40)).encode()
            if i % 2:
                files[f"{c}/{stem}.json"] = json.dumps({"i": i}).encode()
    return write_files(root, files)


# --- background writer ---------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_background_writer_disk_full(small_tmpfs: Path, tmp_path: Path, small_flush: None,
                                     workers: int) -> None:
    # One big shard per worker: ENOSPC comes back from the writer thread, mid-shard.
    src = random_tree(tmp_path / "src", 40, 90_000, 110_000)
    out = small_tmpfs / "ds"
    with pytest.raises(StorageFullError) as ei:
        shardio.pack(src, out, samples_per_shard=20, workers=workers)
    assert "free space" in str(ei.value) and ei.value.errno is not None
    assert_nothing_published(out)
    assert temp_files(small_tmpfs) == []


def _before_write(monkeypatch: pytest.MonkeyPatch, victim: Path,
                  change: Callable[[Path], None]) -> None:
    """Apply ``change`` to ``victim`` after the scan listed it, just before its shard is written
    (in whichever process writes it)."""
    real = packer._pack_shard

    def change_then_write(task: Any, *args: Any) -> Any:
        if any(f[1] == str(victim) for s in task.samples for f in s.files):
            change(victim)
        return real(task, *args)

    monkeypatch.setattr(packer, "_pack_shard", change_then_write)


def _unreadable_after_scan(monkeypatch: pytest.MonkeyPatch, victim: Path) -> None:
    """Turn ``victim`` into a directory once the scan has listed it as a file: opening it then
    works (even as root) and reading it fails with EISDIR, in the middle of a shard."""

    def to_directory(path: Path) -> None:
        path.unlink()
        path.mkdir()

    _before_write(monkeypatch, victim, to_directory)


@pytest.mark.parametrize("workers", [1, 2])
def test_unreadable_mid_shard_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     small_flush: None, workers: int) -> None:
    src = random_tree(tmp_path / "src", 60, 3000, 9000, dirs=2)
    victim = src / "d0" / "f00030.bin"
    _unreadable_after_scan(monkeypatch, victim)
    out = tmp_path / "out"
    with pytest.raises(UnreadableFileError) as ei:
        shardio.pack(src, out, samples_per_shard=30, workers=workers)
    assert "f00030.bin" in str(ei.value) and "--on-error skip" in str(ei.value)
    assert isinstance(ei.value, OSError)
    assert_nothing_published(out)


@pytest.mark.parametrize("workers", [1, 2])
def test_unreadable_mid_shard_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      small_flush: None, workers: int) -> None:
    src = random_tree(tmp_path / "src", 60, 3000, 9000, dirs=2)
    victim = src / "d0" / "f00030.bin"
    expected = {k: v for k, v in _samples(src).items() if k != "d0/f00030"}
    _unreadable_after_scan(monkeypatch, victim)
    out = tmp_path / "out"
    m = shardio.pack(src, out, samples_per_shard=30, workers=workers, on_error="skip")
    assert m.stats["skipped"] == {"unreadable": 1}
    assert read_back(out) == expected
    assert temp_files(out) == []


def _samples(src: Path) -> dict[str, dict[str, bytes]]:
    found = {}
    for p in sorted(src.rglob("*.bin")):
        rel = p.relative_to(src).as_posix()
        found[rel.split(".", 1)[0]] = {"bin": p.read_bytes()}
    return found


def test_file_that_grew_after_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                       small_flush: None) -> None:
    src = random_tree(tmp_path / "src", 20, 3000, 5000, dirs=1)
    grown = src / "d0" / "f00007.bin"
    before = grown.stat().st_size

    def grow(path: Path) -> None:
        with open(path, "ab") as f:
            f.write(b"more" * 5000)

    # A file still being written: packing a moment of it would be wrong, and the shard would
    # outgrow its planned size (it was packed whole, silently).  A typed error, or a skip.
    _before_write(monkeypatch, grown, grow)
    out = tmp_path / "out"
    with pytest.raises(FileChangedError, match=r"f00007.bin grew from .* --on-error skip"):
        shardio.pack(src, out, samples_per_shard=8)
    assert grown.stat().st_size == before + 20000
    assert not (out / "manifest.json").exists()
    grown.write_bytes(grown.read_bytes()[:before])
    _before_write(monkeypatch, grown, grow)
    m = shardio.pack(src, tmp_path / "skip", samples_per_shard=8, on_error="skip")
    assert m.stats["skipped"] == {"changed": 1} and m.num_samples == 19
    assert "d0/f00007" not in read_back(tmp_path / "skip")


# --- forked workers ------------------------------------------------------------------------


def test_worker_count_does_not_change_bytes(tmp_path: Path) -> None:
    src = random_tree(tmp_path / "src", 300, 100, 3000, dirs=5)
    outs = []
    for workers in (1, 2, 3, 8):
        out = tmp_path / f"w{workers}"
        shardio.pack(src, out, samples_per_shard=7, workers=workers, fsync=False)
        outs.append(file_bytes(out))
    assert all(o == outs[0] for o in outs[1:])
    assert len([n for n in outs[0] if n.endswith(".tar")]) == 43


def test_dead_worker_is_reported_and_resumable(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    src = random_tree(tmp_path / "src", 40, 100, 2000)
    out = tmp_path / "out"
    parent = os.getpid()
    real = packer._pack_shard

    def die_in_child(task: Any, *args: Any) -> Any:
        if os.getpid() != parent:  # the worker dies on its first task, before opening a file
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)  # the parent is slow: the worker surely claims a task
        return real(task, *args)

    monkeypatch.setattr(packer, "_pack_shard", die_in_child)
    with pytest.raises(ShardioError) as ei:
        shardio.pack(src, out, samples_per_shard=4, workers=2)
    assert "died" in str(ei.value) and "resume" in str(ei.value)
    assert not (out / "manifest.json").exists()
    monkeypatch.setattr(packer, "_pack_shard", real)
    shardio.pack(src, out, samples_per_shard=4, workers=2)
    clean = tmp_path / "clean"
    shardio.pack(src, clean, samples_per_shard=4)
    assert file_bytes(out) == file_bytes(clean)
    assert temp_files(out) == []


def test_worker_error_keeps_its_type_and_traceback(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    src = random_tree(tmp_path / "src", 40, 100, 2000)
    parent = os.getpid()
    real = packer._pack_shard

    def fail_in_child(task: Any, *args: Any) -> Any:
        if os.getpid() != parent:
            raise UnreadableFileError(13, "cannot read /x/y.bin: Permission denied")
        time.sleep(0.05)  # the parent is slow: a worker surely claims a task
        return real(task, *args)

    monkeypatch.setattr(packer, "_pack_shard", fail_in_child)
    with pytest.raises(UnreadableFileError) as ei:
        shardio.pack(src, tmp_path / "out", samples_per_shard=4, workers=3)
    assert ei.value.errno == 13 and "y.bin" in str(ei.value)
    notes = getattr(ei.value, "__notes__", [""])
    assert "pack worker" in notes[0]
    assert_nothing_published(tmp_path / "out")


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_first_shards_are_written_while_the_scan_goes_on(tmp_path: Path, workers: int) -> None:
    # Shard 0 holds d0's files; while it is written the walk has not listed d9 yet (the state
    # file still has no job: that is written when the scan ends).
    src = random_tree(tmp_path / "src", 200, 100, 900, dirs=10)
    out = tmp_path / "out"
    seen = tmp_path / "seen"
    seen.mkdir()
    real = packer._pack_shard

    def note_state(task: Any, *args: Any) -> Any:
        state = json.loads((out / packstate.STATE_NAME).read_text())
        (seen / f"{task.number}.json").write_text(json.dumps(state))
        return real(task, *args)

    import shardio._scan as scan_mod

    listed: list[str] = []  # directories in the order the walk lists them (in C or Python)
    real_visit = scan_mod.Walk._visit

    def note_listing(self: Any, path: str, *args: Any) -> Any:
        listed.append(os.path.basename(path))
        return real_visit(self, path, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packer, "_pack_shard", note_state)
        mp.setattr(scan_mod.Walk, "_visit", note_listing)
        m = shardio.pack(src, out, samples_per_shard=5, workers=workers, fsync=False)
    assert len(m.shards) == 40
    states = {int(p.stem): json.loads(p.read_text()) for p in seen.iterdir()}
    assert sorted(states) == list(range(40))
    assert states[0]["job"] is None and states[0]["shards"] is None
    assert states[39]["job"] == m.job and states[39]["shards"] == 40
    assert listed == ["src", *[f"d{i}" for i in range(10)]]
    assert not (out / packstate.STATE_NAME).exists()
    # The same bytes as a pack that scans everything first (OUT not empty: no streaming).
    full = tmp_path / "full"
    full.mkdir()
    (full / "notes.txt").write_text("mine")
    shardio.pack(src, full, samples_per_shard=5, workers=workers, fsync=False, overwrite=True)
    got = file_bytes(full)
    del got["notes.txt"]
    assert got == file_bytes(out)


def test_scan_pauses_while_the_workers_are_behind(tmp_path: Path) -> None:
    # The pack's main process stops pulling tasks (scanning) while 2 x workers wait, and goes on
    # as soon as a worker reports; every task is written once.  The workers hold their first
    # task until the 6th is pulled, so nothing can come back before then.
    from collections import Counter

    from shardio._packpool import Task, run_forked

    release, done_dir = tmp_path / "release", tmp_path / "done"
    done_dir.mkdir()

    def write(task: Task) -> Any:
        while not release.exists():
            time.sleep(0.005)
        (done_dir / str(task.number)).touch()
        return task.number, Counter()

    finished_at_pull: list[int] = []

    def tasks() -> Any:
        for i in range(12):
            finished_at_pull.append(len(os.listdir(done_dir)))
            if i == 5:
                release.touch()
            yield Task(i, str(tmp_path / f"s{i}"), [], "fp")

    got: list[int] = []
    run_forked(tasks(), 2, write, lambda n, _sk: got.append(n))
    assert sorted(got) == list(range(12))
    assert finished_at_pull[:6] == [0] * 6  # 2 handed out, 4 queued: no report needed yet
    assert finished_at_pull[6] >= 1  # the 7th pull waited for a worker to finish


@pytest.mark.parametrize("kwargs", [
    {"samples_per_shard": 3},
    {"shard_size": "20KB", "label_from_dir": True},
    {"shard_size": "4KB", "on_error": "skip", "compress": "zstd"},
    {"shard_size": "30KB", "format": "hdf5", "workers": 2},
])
def test_streaming_and_scan_first_packs_are_identical(tmp_path: Path,
                                                      kwargs: dict[str, Any]) -> None:
    for i, src in enumerate([_odd_tree(tmp_path / "odd"), random_tree(tmp_path / "r", 60, 0,
                                                                        9000, dirs=3)]):
        fresh, full = tmp_path / f"fresh{i}", tmp_path / f"full{i}"
        m1 = shardio.pack(src, fresh, fsync=False, **kwargs)
        full.mkdir()
        (full / "keep.txt").write_text("x")
        m2 = shardio.pack(src, full, fsync=False, overwrite=True, **kwargs)
        assert m1.to_dict() == m2.to_dict()
        got = file_bytes(full)
        del got["keep.txt"]
        assert got == file_bytes(fresh)


def test_walk_yields_the_order_of_sorted_keys(tmp_path: Path) -> None:
    # Names that sort differently as bare names and as key prefixes: "a" < "a-b" but "a-b/x" <
    # "a/x"; a file stem equal to a folder name; dots inside names.
    names = ["a", "a-b", "a.b", "a b", "a0", "b", "-", "é", "a_b", "ab"]
    rng = random.Random(3)
    for trial in range(30):
        files: dict[str, bytes] = {}
        for i in range(rng.randint(1, 30)):
            parts = [rng.choice(names) for _ in range(rng.randint(1, 3))]
            ext = rng.choice(["jpg", "json", "tar.gz"])
            files["/".join(parts) + f"{i % 3}.{ext}"] = bytes(rng.randint(0, 40))
        src = write_files(tmp_path / f"t{trial}", files)
        listing = tmp_path / f"list{trial}.txt"
        listing.write_text("\n".join(sorted(files)))
        for label in (False, True):
            try:
                ref = scan_source(str(src), str(tmp_path / "o"), files_from=str(listing),
                                  label_from_dir=label, on_error="skip")
            except EmptySourceError:  # every file at the top, none in a class folder
                with pytest.raises(EmptySourceError):
                    scan_source(str(src), str(tmp_path / "o"), files_from=None,
                                label_from_dir=label, on_error="skip")
                continue
            walk = scan_source(str(src), str(tmp_path / "o"), files_from=None,
                               label_from_dir=label, on_error="skip")
            assert [s.key for s in walk.samples] == sorted(s.key for s in ref.samples)
            assert [(s.key, s.files, s.label) for s in walk.samples] == \
                [(s.key, s.files, s.label) for s in ref.samples]
            assert (walk.labels, walk.files, walk.skipped) == (ref.labels, ref.files, ref.skipped)


# --- reference implementations --------------------------------------------------------------


def _trees(tmp_path: Path) -> list[tuple[Path, bool]]:
    mixed = write_files(tmp_path / "mixed", {
        f"p{i % 3}/s{i:03d}.{ext}": os.urandom(i * 37 % 900)
        for i in range(30) for ext in (["txt", "json"] + (["npy"] if i % 2 else []))
    })
    return [(random_tree(tmp_path / "r", 50, 0, 9000, dirs=3), True), (mixed, False),
            (mixed, True), (_odd_tree(tmp_path / "odd"), True), (_odd_tree(tmp_path / "odd2"), False)]


def test_estimates_match_reference(tmp_path: Path) -> None:
    for src, label in _trees(tmp_path):
        scan = scan_source(str(src), str(tmp_path / "o"), files_from=None, label_from_dir=label,
                           on_error="raise")
        for fmt in ("tar", "hdf5"):
            for compress in (None, "zstd"):
                opts = PackOptions(format=fmt, compress=compress, label_from_dir=label)
                assert packplan._estimates(scan.samples, opts) == \
                    [packplan._estimate(s, opts) for s in scan.samples]


def _reference_document(key: dict[str, Any], labels: Any, samples: list[Any]) -> str:
    return json.dumps({"options": key, "labels": labels, "files": [
        [s.key, s.label, s.files and [[f[0], f[2], f[3]] for f in s.files]] for s in samples]},
        sort_keys=True, separators=(",", ":"))


@pytest.mark.parametrize("name", ["plain", 'quo"te', "back\\slash", "tab\there", "déjà", "del\x7f"])
def test_job_document_matches_json(tmp_path: Path, name: str) -> None:
    src = write_files(tmp_path / "src", {
        f"c{i % 2}/{name}{i}.{ext}": b"x" * i for i in range(6) for ext in ("a", "b.c")
    })
    for label in (False, True):
        scan = scan_source(str(src), str(tmp_path / "o"), files_from=None, label_from_dir=label,
                           on_error="raise")
        key = PackOptions(label_from_dir=label).output_key()
        assert packplan._job_document(key, scan.labels, scan.samples) == \
            _reference_document(key, scan.labels, scan.samples)


def test_index_builder_bytes_match_shard_index() -> None:
    rng = random.Random(7)
    for rows in (0, 1, 500):
        b = IndexBuilder("xxh3_64")
        offset = 0
        for i in range(rows):
            if i % 3 == 0:
                b.add_sample(f"key/{i}é")
            # (what a writer writes: fields in order; a compressed one's raw length larger)
            flags, length = rng.randint(0, 1), rng.randint(0, 2**31)
            offset += rng.randint(0, 2**20)
            b.add_field(rng.choice(["jpg", "cls", "json"]), flags, offset, length,
                        length + flags * rng.randint(1, 2**31), rng.getrandbits(64))
            offset += length
        meta = {"job_shard": "abc", "shard_bytes": 123}
        idx = b.build(meta)
        assert b.to_bytes(meta) == idx.to_bytes()
        back = ShardIndex.from_bytes(b.to_bytes(meta))
        assert back.keys() == idx.keys() and back.meta == meta
        assert b.stored_bytes == idx.stored_bytes and len(b) == len(idx)
        counts: dict[str, int] = {}
        for n in idx.f_name:
            counts[idx.field_names[int(n)]] = counts.get(idx.field_names[int(n)], 0) + 1
        assert b.field_counts() == counts


def test_hdf5_payload_buffer_reuse(tmp_path: Path) -> None:
    # Shards of very different sizes in one process reuse one payload buffer: a smaller shard
    # after a bigger one must not pick up the stale tail of the bigger one.
    files = {f"c/s{i:03d}.bin": os.urandom(20_000 if i < 10 else 300) for i in range(40)}
    src = write_files(tmp_path / "src", files)
    out = tmp_path / "h5"
    m = shardio.pack(src, out, format="hdf5", samples_per_shard=10, fsync=False)
    assert [s.samples for s in m.shards] == [10, 10, 10, 10]
    assert [s.bytes < 20_000 for s in m.shards] == [False, True, True, True]
    assert read_back(out) == {k.split(".")[0]: {"bin": v} for k, v in files.items()}
    assert shardio.verify_dataset(out) == []  # digests (hashed from memory) match the files
    from shardio.formats import hdf5

    assert hdf5._SPARE == []  # released at the end of the pack


# --- one worker: the scan planned one shard ahead in a thread (packer._ScanAhead) -------------


def _threads() -> set[str]:
    import threading

    return {t.name for t in threading.enumerate() if t.name.startswith("shardio-")}


@pytest.mark.parametrize("failure", [OSError, KeyboardInterrupt])
def test_a_writer_failure_stops_the_scan_thread(tmp_path: Path, failure: type) -> None:
    # The writer fails on shard 2 while the scan thread has planned further: the pack raises
    # the writer's error, and neither the scan thread nor its stat threads outlive it.
    src = random_tree(tmp_path / "src", 200, 100, 900, dirs=10)
    real = packer._pack_shard
    started: list[str] = []

    def fail_third(task: Any, *args: Any) -> Any:
        started.append(", ".join(sorted(_threads())))
        if task.number == 2:
            raise failure("the disk went away")
        return real(task, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packer, "_pack_shard", fail_third)
        with pytest.raises(failure, match="the disk went away"):
            shardio.pack(src, tmp_path / "out", samples_per_shard=5, fsync=False,
                         scan_threads=4)
    assert "shardio-scan" in started[0]  # the scan ran beside the writer
    assert not _threads()
    # Nothing half-written is published, and the rerun resumes from the two finished shards.
    assert not (tmp_path / "out" / "manifest.json").exists()
    m = shardio.pack(src, tmp_path / "out", samples_per_shard=5, fsync=False, resume=True)
    assert len(m.shards) == 40


def test_a_scan_error_is_raised_where_the_writer_reaches_it(tmp_path: Path) -> None:
    # A broken link in the last folder: the shards before it are written, then the scan's own
    # error (its type and message) comes out of pack(), with no thread left.
    src = random_tree(tmp_path / "src", 100, 100, 900, dirs=5)
    last = sorted(p for p in src.iterdir() if p.is_dir())[-1]
    os.symlink(last / "missing.jpg", last / "zzz.jpg")
    written: list[int] = []
    real = packer._pack_shard

    def note(task: Any, *args: Any) -> Any:
        written.append(task.number)
        return real(task, *args)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packer, "_pack_shard", note)
        with pytest.raises(ShardioError, match="zzz.jpg"):
            shardio.pack(src, tmp_path / "out", samples_per_shard=5, fsync=False)
    assert written and written == list(range(len(written)))
    assert not _threads()
    assert not (tmp_path / "out" / "manifest.json").exists()
