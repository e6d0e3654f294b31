"""``shardio._listdir.list_dir``: a pack source's directory listed and stat'ed in C, the fast
path of ``shardio._scan.Walk`` once stats proved fast (or ``scan_threads=1``).

The reference is the Python listing (``Walk._list`` over ``os.scandir``): the same samples, in
the same order, with the same sizes, paths and labels; every directory it does not handle (a
name that is not ASCII, a broken or looping link, no extension, a label file, a FIFO, too many
entries) is handed back whole (None) so that the Python code raises or skips exactly as before.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import pytest

import shardio
from shardio import _scan
from shardio._scan import LABEL_FIELD, Walk, scan_source
from shardio.errors import EmptySourceError
from tests.test_pack import file_bytes, write_files

list_dir = pytest.importorskip("shardio._listdir").list_dir


def _python_listing(directory: Path) -> tuple[int, list[tuple[str, list[Any]]], list[Any]]:
    """What list_dir returns, built from the Python code (Walk._list)."""
    walk = Walk(str(directory), str(directory.parent / "no-out"), label_from_dir=False,
                on_error="raise")
    base = str(directory) + os.sep
    with os.scandir(directory) as it:
        entries = list(it)
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        groups, subdirs = walk._list(str(directory), dfd, "", frozenset(), entries)
    finally:
        os.close(dfd)
    dirs = sorted((full[len(base):], dev, ino) for full, (dev, ino) in subdirs.values())
    return walk.files, sorted(groups.items()), dirs


def _list(directory: Path, stop: str | None = None, probe: int = 0, slow: float = 0.0,
          utf8: bool = False) -> Any:
    dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        return list_dir(dfd, str(directory) + os.sep, stop, probe, slow, utf8)
    finally:
        os.close(dfd)


def test_a_directory_lists_as_the_python_code_lists_it(tmp_path: Path) -> None:
    src = write_files(tmp_path / "src", {
        "b.jpg": b"12", "a.json": b"{}", "a.jpg": b"x" * 700, "a-b.jpg": b"", "a.b.c": b"3",
        "a_.txt": b"4", "0.cls.txt": b"5", "Z.jpg": b"6", "sub/x.jpg": b"7", "a/y.jpg": b"8",
        ".hidden.jpg": b"9", ".hid/z.jpg": b"0",
    })
    os.symlink(src / "b.jpg", src / "link.jpg")  # a link to a file is that file
    os.symlink(src / "sub", src / "linked")  # and to a directory, that directory
    got = _list(src)
    assert got is not None
    files, groups, dirs = got
    want_files, want_groups, want_dirs = _python_listing(src)
    assert (files, groups, sorted(dirs)) == (want_files, want_groups, want_dirs)
    assert [g[0] for g in groups] == sorted(g[0] for g in groups)  # stems in sorted order
    assert dict(groups)["a"] == [(field, str(src / f"a.{field}"), size,
                                  os.stat(src / f"a.{field}").st_mtime_ns)
                                 for field, size in [("b.c", 1), ("jpg", 700), ("json", 2)]]
    sub = _list(src / "sub")
    assert sub == (1, [("x", [("jpg", str(src / "sub" / "x.jpg"), 1,
                                  os.stat(src / "sub" / "x.jpg").st_mtime_ns)])], [])


def _leaves_to_python(tmp_path: Path, name: str) -> Path:
    """A directory holding one entry list_dir does not handle."""
    d = write_files(tmp_path / name, {"ok.jpg": b"1", "ok2.jpg": b"2"})
    if name == "non_ascii":
        (d / "déjà.jpg").write_bytes(b"3")
    elif name == "non_utf8":
        with open(os.path.join(os.fsencode(d), b"bad\xff.jpg"), "wb") as f:
            f.write(b"3")
    elif name == "broken_link":
        os.symlink(d / "missing.jpg", d / "gone.jpg")
    elif name == "link_loop":
        os.symlink(d / "loop.jpg", d / "loop.jpg")
    elif name == "no_extension":
        (d / "README").write_bytes(b"3")
    elif name == "fifo":
        os.mkfifo(d / "pipe.jpg")
    elif name == "label_file":
        (d / f"ok.{LABEL_FIELD}").write_bytes(b"3")
    return d


@pytest.mark.parametrize("name", ["non_ascii", "non_utf8", "broken_link", "link_loop",
                                  "no_extension", "fifo", "label_file"])
def test_what_it_does_not_handle_goes_back_to_python(tmp_path: Path, name: str) -> None:
    d = _leaves_to_python(tmp_path, name)
    assert _list(d, LABEL_FIELD) is None
    if name == "label_file":
        assert _list(d, None) is not None  # a "cls" field is only special with labels
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        _list(d, LABEL_FIELD)
    assert len(os.listdir("/proc/self/fd")) == fds  # no descriptor left open on the way out


@pytest.mark.parametrize("name", [
    "déjà.jpg", "日本語.jpg", "\U0001f600.jpg", "ok\u00ff.json", "ü/x.jpg",
])
def test_utf8_names_are_listed_when_the_filesystem_encoding_is_utf8(tmp_path: Path,
                                                                  name: str) -> None:
    d = write_files(tmp_path / "d", {name: b"12", "a.jpg": b"3", "z.jpg": b"4"})
    assert _list(d) is None  # not ASCII: Python's, unless the caller vouches for UTF-8
    got = _list(d, utf8=True)
    want_files, want_groups, want_dirs = _python_listing(d)
    assert (got[0], got[1], sorted(got[2])) == (want_files, want_groups, want_dirs)


@pytest.mark.parametrize("raw", [
    b"\xff.jpg",  # not UTF-8 at all
    b"\xc0\xaf.jpg",  # an overlong "/"
    b"\xed\xa0\x80.jpg",  # a surrogate (U+D800)
    b"\xf4\x90\x80\x80.jpg",  # above U+10FFFF
    b"\xe6\x97.jpg",  # a sequence cut short
])
def test_names_that_are_not_utf8_go_back_to_python(tmp_path: Path, raw: bytes) -> None:
    d = write_files(tmp_path / "d", {"a.jpg": b"3"})
    with open(os.path.join(os.fsencode(d), raw), "wb") as f:
        f.write(b"x")
    assert _list(d, utf8=True) is None


def test_slow_stats_are_reported(tmp_path: Path) -> None:
    d = write_files(tmp_path / "d", {f"{i:03d}.jpg": b"x" for i in range(100)})
    # Timed: the first 10 stats took at least 0 s each, so they were "slow".
    assert _list(d, None, 10, 0.0) is False
    assert _list(d, None, 10, 1.0) is not None  # a second a stat: never on a local disk
    assert _list(d, None, 0, 0.0) is not None  # not timed
    assert _list(d, None, 100, 0.0) is not None  # fewer entries than the probe: not timed


def test_bad_arguments() -> None:
    with pytest.raises(TypeError):
        list_dir(0, b"/", None, 1, 0.0)
    with pytest.raises(TypeError):
        list_dir(0, "/", 3, 1, 0.0)
    with pytest.raises(ValueError):
        list_dir(0, "/", None, -1, 0.0)
    with pytest.raises(TypeError):
        list_dir(0, "/", None, 1, 0.0, True, 1)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Route the walk's list_dir through a recorder: True per directory it listed."""
    calls: list[bool] = []

    def spy(*args: Any) -> Any:
        got = list_dir(*args)
        calls.append(got is not None)
        return got

    monkeypatch.setattr(_scan, "_list_dir", spy)
    return calls


def test_walk_yields_the_same_samples_either_way(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # Names that sort differently as bare names and as key prefixes, a file stem equal to a
    # folder name, dots inside names, label files, and (every third trial) a name only Python
    # handles; in some folders a broken link, a file with no extension or a FIFO (skipped and
    # counted by the Python code, either way).
    names = ["a", "a-b", "a.b", "a b", "a0", "b", "-", "a_b", "ab", "Z"]
    rng = random.Random(5)
    listed = 0
    for trial in range(30):
        files: dict[str, bytes] = {}
        for i in range(rng.randint(1, 40)):
            parts = [rng.choice(names + (["é"] if trial % 3 == 0 else []))
                     for _ in range(rng.randint(1, 3))]
            ext = rng.choice(["jpg", "json", "tar.gz", "jpg", LABEL_FIELD])
            files["/".join(parts) + f"{i % 3}.{ext}"] = bytes(rng.randint(0, 40))
        src = write_files(tmp_path / f"t{trial}", files)
        folders = sorted({p.parent for p in src.rglob("*")})
        for n, folder in enumerate(rng.sample(folders, min(3, len(folders)))):
            bad = folder / f"zz{n}"
            [lambda: os.symlink(folder / "missing.jpg", f"{bad}.jpg"),
             lambda: bad.write_bytes(b"no extension"),
             lambda: os.mkfifo(f"{bad}.jpg")][(trial + n) % 3]()
        for label in (False, True):
            got = []
            for fast in (False, True):
                calls = _spy(monkeypatch) if fast else []
                if not fast:
                    monkeypatch.setattr(_scan, "_list_dir", None)
                try:
                    scan = scan_source(str(src), str(tmp_path / "o"), files_from=None,
                                       label_from_dir=label, on_error="skip", scan_threads=1)
                    got.append(([(s.key, s.files, s.label) for s in scan.samples], scan.labels,
                                scan.files, scan.skipped))
                except EmptySourceError:
                    got.append("empty")
                listed += sum(calls)
            assert got[0] == got[1], (trial, label)
    assert listed > 100  # most directories went through it


def test_walk_uses_it_once_stats_proved_fast(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_files(tmp_path / "src", {f"c{i // 40}/{i:04d}.jpg": b"x" for i in range(400)})
    calls = _spy(monkeypatch)
    walk = Walk(str(src), str(tmp_path / "o"), label_from_dir=True, on_error="raise")
    samples = list(walk)
    # The first directories' stats are timed in Python (the probe); the rest come from C.
    assert walk.stats.probes == 1 and sum(calls) >= 8
    assert [s.key for s in samples] == [f"c{i // 40}/{i:04d}" for i in range(400)]
    assert [s.label for s in samples] == [i // 40 for i in range(400)]
    calls.clear()
    list(Walk(str(src), str(tmp_path / "o"), label_from_dir=True, on_error="raise",
              scan_threads=4))
    assert not calls  # stats in threads: never


def test_directories_it_timed_do_not_count_towards_the_next_probe(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 12 folders of 400 files: the first is where the walk's probe ends (in Python); each
    # other is timed by list_dir itself, so all 11 are listed in C although 4,800 stats pass
    # (after 4,096 untimed ones the walk probes again, in Python).
    big = write_files(tmp_path / "big", {f"c{i:02d}/{j:03d}.jpg": b"x"
                                         for i in range(12) for j in range(400)})
    calls = _spy(monkeypatch)
    # Stats are never slow here: on a loaded machine the 64 timed ones could average 50 us,
    # and a directory then went to the threads instead of list_dir.
    monkeypatch.setattr(_scan, "_SLOW_STAT", 1.0)
    walk = Walk(str(big), str(tmp_path / "o"), label_from_dir=True, on_error="raise")
    assert sum(1 for _ in walk) == 4800
    assert calls == [True] * 11 and walk.stats.probes == 1
    # 160 folders of 30 files (untimed: fewer than the probe's 64): the walk probes again.
    small = write_files(tmp_path / "small", {f"c{i:03d}/{j:02d}.jpg": b"x"
                                             for i in range(160) for j in range(30)})
    calls.clear()
    walk = Walk(str(small), str(tmp_path / "o"), label_from_dir=True, on_error="raise")
    assert sum(1 for _ in walk) == 4800
    assert walk.stats.probes == 2 and 150 <= sum(calls) < 160


def test_slow_stats_in_a_directory_turn_threads_on(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A tree whose first directories' stats are fast (the probe decides: one thread), then a
    # large directory that list_dir finds slow (here: any stat is "slow" in it): that directory
    # and the rest go through the stat threads, and the samples are the same.
    files = {f"a{i}/{j:03d}.jpg": b"x" * j for i in range(3) for j in range(30)}
    files.update({f"b/{j:04d}.jpg": b"y" * (j % 50) for j in range(300)})
    files.update({f"c/{j:03d}.jpg": b"z" for j in range(80)})
    src = write_files(tmp_path / "src", files)
    seen: list[str] = []

    def slow_in_b(dfd: int, base: str, stop: Any, probe: int, slow_s: float,
                  *rest: Any) -> Any:
        seen.append(os.path.basename(base.rstrip(os.sep)))
        return list_dir(dfd, base, stop, probe, 0.0 if base.endswith(f"{os.sep}b{os.sep}")
                        else slow_s, *rest)

    monkeypatch.setattr(_scan, "_list_dir", slow_in_b)
    walk = Walk(str(src), str(tmp_path / "o"), label_from_dir=True, on_error="raise")
    got = [(s.key, s.files, s.label) for s in walk]
    assert "b" in seen and "c" not in seen  # after b, stats go through threads
    assert walk.stats.pooled and walk.stats.probes == 2
    monkeypatch.setattr(_scan, "_list_dir", None)
    ref = Walk(str(src), str(tmp_path / "o"), label_from_dir=True, on_error="raise",
               scan_threads=1)
    assert got == [(s.key, s.files, s.label) for s in ref]


def test_pack_is_the_same_with_and_without_it(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    src = write_files(tmp_path / "src", {
        f"c{i % 7}/{i:05d}.{ext}": os.urandom(i % 300)
        for i in range(500) for ext in (("jpg", "json") if i % 5 == 0 else ("jpg",))
    })
    fast = shardio.pack(src, tmp_path / "fast", fsync=False, label_from_dir=True,
                        samples_per_shard=64, scan_threads=1)
    monkeypatch.setattr(_scan, "_list_dir", None)
    slow = shardio.pack(src, tmp_path / "slow", fsync=False, label_from_dir=True,
                        samples_per_shard=64, scan_threads=1)
    assert fast.to_dict() == slow.to_dict()
    assert file_bytes(tmp_path / "fast") == file_bytes(tmp_path / "slow")
