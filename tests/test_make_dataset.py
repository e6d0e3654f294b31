"""``tools/make_dataset.py``: the text and array generators are deterministic, write what they
say, and produce trees that ``shardio.pack`` packs and ``ShardDataset(decode=True)`` decodes."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest

import shardio
from tools.make_dataset import TreeSummary, main, make_arrays, make_images, make_text, parse_shape


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_text_is_deterministic_and_counts_add_up(tmp_path: Path) -> None:
    a = make_text(str(tmp_path / "a"), files=150, seed=3, per_dir=40)
    b = make_text(str(tmp_path / "b"), files=150, seed=3, per_dir=40)
    ta, tb = tree(tmp_path / "a"), tree(tmp_path / "b")
    assert ta == tb and a == b
    assert a == TreeSummary(samples=150, files=300, bytes=sum(map(len, ta.values())))
    assert sorted({k.split("/")[0] for k in ta}) == ["part_000", "part_001", "part_002",
                                                      "part_003"]
    assert sum(k.endswith(".txt") for k in ta) == sum(k.endswith(".json") for k in ta) == 150
    make_text(str(tmp_path / "c"), files=150, seed=4, per_dir=40)
    assert tree(tmp_path / "c") != ta


def test_text_lengths_are_heavy_tailed_and_metadata_consistent(tmp_path: Path) -> None:
    make_text(str(tmp_path), files=600, median_words=12, seed=0)
    metas = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(tmp_path.rglob("*.json"))]
    words = np.array([m["words"] for m in metas])
    assert 8 <= np.median(words) <= 16
    assert np.percentile(words, 99) > 5 * np.median(words)  # a long tail, not a bell
    assert words.min() >= 1
    for m in metas[:50]:
        text = (tmp_path / "part_000" / f"{m['key']}.txt").read_text(encoding="utf-8")
        assert len(text.split()) == m["words"]
        assert {"url", "width", "height", "similarity", "language", "tags"} <= m.keys()
    texts = "".join(p.read_text(encoding="utf-8") for p in tmp_path.rglob("*.txt"))
    assert not texts.isascii()  # some non-ASCII words exercise UTF-8 handling


def test_arrays_shapes_dtypes_labels(tmp_path: Path) -> None:
    s = make_arrays(str(tmp_path / "f"), files=80, shape="4-40,3", dtype="float32", classes=5,
                    seed=1)
    assert s.samples == 80 and s.files == 160
    shapes = set()
    for p in sorted((tmp_path / "f").rglob("*.npy")):
        arr = np.load(p, allow_pickle=False)
        assert arr.dtype == np.float32 and arr.ndim == 2 and arr.shape[1] == 3
        assert 4 <= arr.shape[0] <= 40
        shapes.add(arr.shape)
        assert 0 <= int(p.with_suffix(".cls").read_text()) < 5
    assert len(shapes) > 5  # shapes vary
    make_arrays(str(tmp_path / "i"), files=20, shape="16", dtype="int64", seed=1)
    ints = [np.load(p) for p in (tmp_path / "i").rglob("*.npy")]
    assert all(a.dtype == np.int64 and a.shape == (16,) and a.min() >= 0 for a in ints)
    make_arrays(str(tmp_path / "f2"), files=80, shape="4-40,3", dtype="float32", classes=5,
                seed=1)
    assert tree(tmp_path / "f") == tree(tmp_path / "f2")


@pytest.mark.parametrize("spec", ["", "a", "0", "5-2", "3,,4", "-3"])
def test_bad_shapes_are_rejected(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shape"):
        parse_shape(spec)
    with pytest.raises(SystemExit) as exc:
        main(["arrays", str(tmp_path / "x"), "--files", "2", "--shape", spec])
    assert exc.value.code == 2
    assert parse_shape("16-256, 64") == [(16, 256), (64, 64)]


def test_cli_writes_every_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["text", str(tmp_path / "t"), "--files", "7", "--seed", "2"]) == 0
    assert main(["arrays", str(tmp_path / "a"), "--files", "7", "--shape", "2-5,8",
                 "--dtype", "uint8"]) == 0
    assert main(["images", str(tmp_path / "i"), "--files", "4", "--classes", "2"]) == 0
    assert len(list((tmp_path / "t").rglob("*.txt"))) == 7
    assert len(list((tmp_path / "a").rglob("*.cls"))) == 7
    assert len(list((tmp_path / "i").rglob("*.jpg"))) == 4
    assert "wrote 7 text samples (14 files)" in capsys.readouterr().err


def test_text_tree_packs_and_decodes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_text(str(src), files=60, seed=5, per_dir=25)
    m = shardio.pack(src, tmp_path / "ds", samples_per_shard=16, fsync=False, progress=False)
    assert m.num_samples == 60
    n = 0
    for sample in shardio.ShardDataset(tmp_path / "ds", decode=True):
        key = sample["__key__"]
        assert isinstance(sample["txt"], str)
        assert sample["txt"] == (src / f"{key}.txt").read_text(encoding="utf-8")
        assert isinstance(sample["json"], dict)
        assert sample["json"] == json.loads((src / f"{key}.json").read_bytes())
        n += 1
    assert n == 60


def test_array_tree_packs_and_decodes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_arrays(str(src), files=40, shape="3-30,2-6", dtype="float32", classes=4, seed=2,
                per_dir=15)
    m = shardio.pack(src, tmp_path / "ds", samples_per_shard=8, fsync=False, progress=False)
    assert m.num_samples == 40
    n = 0
    for sample in shardio.ShardDataset(tmp_path / "ds", decode=True):
        key = sample["__key__"]
        assert isinstance(sample["npy"], np.ndarray) and sample["npy"].dtype == np.float32
        ref = np.load(io.BytesIO((src / f"{key}.npy").read_bytes()))
        np.testing.assert_array_equal(sample["npy"], ref)
        assert type(sample["cls"]) is int and 0 <= sample["cls"] < 4
        n += 1
    assert n == 40


@pytest.mark.parametrize(("kw", "flag"), [
    ({"files": -1}, "files"), ({"classes": 0}, "classes"), ({"min_kb": 0}, "min_kb"),
    ({"min_kb": 40, "max_kb": 5}, "min_kb"), ({"max_kb": -3}, "max_kb"), ({"pool": 0}, "pool"),
])
def test_bad_image_sizes_are_refused_before_writing(kw: dict[str, int], flag: str,
                                                    tmp_path: Path) -> None:
    """classes=0 was a ZeroDivisionError, min_kb > max_kb numpy's 'low >= high' from deep in the
    generator (after the class folders were made); now a ValueError naming the option."""
    args = {"files": 4, "classes": 2, **kw}
    with pytest.raises(ValueError, match=flag):
        make_images(str(tmp_path / "x"), **args)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("argv", [["--classes", "0"], ["--files", "-2"], ["--min-kb", "0"],
                                  ["--min-kb", "41"], ["--seed", "-1"]])
def test_bad_image_options_are_usage_errors(argv: list[str], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["images", str(tmp_path / "x"), "--files", "3", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and argv[0].lstrip("-").replace("-", "_") in err.replace("-", "_")
    assert not (tmp_path / "x").exists()


def test_equal_min_and_max_kb_is_one_size(tmp_path: Path) -> None:
    make_images(str(tmp_path / "e"), files=6, classes=2, min_kb=8, max_kb=8, pool=4)
    assert len(list((tmp_path / "e").rglob("*.jpg"))) == 6
