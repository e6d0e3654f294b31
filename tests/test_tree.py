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


def _written(plan):  # type: ignore[no-untyped-def]
    raw = np.zeros(plan.nbytes, dtype=np.uint8)
    plan.write(memoryview(raw), 1, [])
    return raw


def test_read_tree_reports_fields_and_copies_them_on_request() -> None:
    """on_field names each array and bytes column with the message span it views, and a user's
    view of a numpy field keeps the reported array alive (numpy stops collapsing the view chain
    at it, its base being a view of another type): what ShardLoader's weak references rely on.
    copy=True gives every field memory of its own, so keeping one keeps nothing of the rest."""
    import gc
    import weakref

    class Lease(np.ndarray):
        pass

    raw = _written(plan_tree({"img": torch.arange(12, dtype=torch.uint8).reshape(3, 4),
                              "arr": np.arange(5.0)}))
    cols = _written(plan_collate([{"b": b"abc"}, {"b": b""}, {"b": b"de"}]))
    for buf in (raw, cols):
        seen: list[tuple[weakref.ref[np.ndarray], int, int]] = []
        out = read_tree(buf.view(Lease), torch.from_numpy, True,
                        on_field=lambda a, off, n: seen.append((weakref.ref(a), off, n)))
        for ref, off, n in seen:
            a = ref()
            assert a is not None and np.shares_memory(a, buf)
            assert a.view(np.uint8).reshape(-1).tobytes() == buf[off:off + n].tobytes()
            del a
        if buf is raw:
            assert sorted(n for _ref, _off, n in seen) == [12, 40]
            field_ref = next(ref for ref, _off, n in seen if n == 40)
            assert type(out["arr"]) is np.ndarray and out["arr"] is field_ref()
            view = out["arr"][1:3]  # a user's view of the field: its base is the reported one
        else:
            assert [n for _ref, _off, n in seen if n == 5]  # the column's 5 bytes (+ bounds)
            field_ref = next(ref for ref, _off, n in seen if n == 5)
            view = out["b"][0]
        del out
        gc.collect()
        assert field_ref() is not None
        assert view.tolist() == ([1.0, 2.0] if buf is raw else list(b"abc"))
        del view
        gc.collect()
        assert field_ref() is None
    copied = read_tree(raw.view(Lease), torch.from_numpy, True, copy=True)
    assert not np.shares_memory(copied["arr"], raw)
    assert not np.shares_memory(copied["img"].numpy(), raw)
    assert copied["arr"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    col = read_tree(cols.view(Lease), torch.from_numpy, True, copy=True)["b"]
    assert not np.shares_memory(col[0], cols) and [bytes(x) for x in col] == [b"abc", b"", b"de"]
