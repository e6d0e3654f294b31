"""Batch messages (shardio._tree): what the default collate writes is what the reader rebuilds."""

from __future__ import annotations

import numpy as np
import torch

from shardio._tree import plan_collate, plan_tree, read_header, read_tree


def roundtrip(plan, step=3):  # type: ignore[no-untyped-def]
    buf = np.zeros(plan.nbytes, dtype=np.uint8)
    plan.write(memoryview(buf), step, [0.1, 0.2])
    assert read_header(memoryview(buf))[1] == step
    return read_tree(buf, torch.from_numpy)


def test_default_collate_stacks_arrays_and_keeps_bytes_out_of_band() -> None:
    samples = [{"__key__": f"k{i}", "img": np.full((2, 3), i, np.uint8), "cls": i,
                "jpg": bytes([i]) * (i * 37), "f": i / 2} for i in range(6)]
    plan = plan_collate(samples)
    # payload bytes travel as arrays, not inside the pickled skeleton
    assert len(plan.meta) < 400
    out = roundtrip(plan)
    assert out["__key__"] == [f"k{i}" for i in range(6)]
    assert out["img"].shape == (6, 2, 3) and out["img"][4].tolist() == [[4] * 3] * 2
    assert out["cls"].tolist() == list(range(6)) and out["cls"].dtype == torch.int64
    assert out["jpg"] == [s["jpg"] for s in samples]  # includes a 0-byte value
    assert all(type(x) is bytes for x in out["jpg"])
    assert out["f"].tolist() == [i / 2 for i in range(6)]


def test_user_tree_round_trips() -> None:
    tree = {"x": torch.arange(6).reshape(2, 3), "y": [np.ones(2), "s", b"b"], "z": (1, None)}
    out = roundtrip(plan_tree(tree))
    assert torch.equal(out["x"], tree["x"])
    assert out["y"][0].tolist() == [1.0, 1.0] and out["y"][1:] == ["s", b"b"]
    assert out["z"] == (1, None)


def test_number_columns_take_their_type_from_every_item() -> None:
    """A column's dtype comes from all its items (it came from the first: [1, 2.5] became
    [1, 2] and [True, 5] [True, True], silently)."""
    cols = {"mixed": [1, 2.5, np.int32(3)], "bool_int": [True, 5, False], "bools": [True, False],
            "ints": [np.int16(4), 7, True], "floats": [0.5, np.float32(1.5), 2],
            "huge": [1, 2**70], "other": [1, "x"]}
    out = roundtrip(plan_collate([{k: v[i] for k, v in cols.items()} for i in range(2)]))
    assert out["mixed"].dtype == torch.float64 and out["mixed"].tolist() == [1.0, 2.5]
    assert out["bool_int"].dtype == torch.int64 and out["bool_int"].tolist() == [1, 5]
    assert out["bools"].dtype == torch.bool and out["bools"].tolist() == [True, False]
    assert out["ints"].dtype == torch.int64 and out["ints"].tolist() == [4, 7]
    assert out["floats"].dtype == torch.float64 and out["floats"].tolist() == [0.5, 1.5]
    assert out["huge"] == [1, 2**70]  # beyond int64: kept as Python ints
    assert out["other"] == [1, "x"]
