"""Batch messages (shardio._tree): what the default collate writes is what the reader rebuilds."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import numpy as np
import pytest
import torch

from shardio import sharedbytes as sb
from shardio._tree import Area, plan_collate, plan_tree, read_header, read_tree
from shardio.errors import UsageError


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


class Batch(dict):
    """A batch class deriving from dict (as HF's BatchEncoding derives from UserDict)."""

    def to(self, device: str) -> Batch:
        return Batch({k: v.to(device) for k, v in self.items()})


def test_shapes_types_and_grad_flags_come_back_as_sent() -> None:
    """What came back otherwise: 0-d tensors and arrays of shape (1,) (np.ascontiguousarray),
    every mapping a plain dict and every tuple type a tuple (torch.Size), Parameters plain
    tensors and requires_grad dropped.  torch's DataLoader keeps them all."""
    tree = {"scale": torch.tensor(0.5), "n": np.array(2.5), "col": [np.array(1), np.array(2)],
            "od": collections.OrderedDict(b=torch.ones(2), a=1),
            "dd": collections.defaultdict(list, {"k": np.zeros(3)}),
            "batch": Batch(t=torch.arange(3)), "size": torch.Size([2, 3]),
            "param": torch.nn.Parameter(torch.ones(2)), "grad": torch.ones(2, requires_grad=True),
            "lambda_dd": collections.defaultdict(lambda: 0, {"z": 1})}  # (does not pickle)
    out = roundtrip(plan_tree(tree))
    assert out["scale"].shape == () and out["scale"].item() == 0.5
    assert out["n"].shape == () and out["col"][0].shape == ()
    assert type(out["od"]) is collections.OrderedDict and list(out["od"]) == ["b", "a"]
    assert type(out["dd"]) is collections.defaultdict and out["dd"]["missing"] == []
    assert type(out["batch"]) is Batch and torch.equal(out["batch"].to("cpu")["t"],
                                                       torch.arange(3))
    assert type(out["size"]) is torch.Size and out["size"] == torch.Size([2, 3])
    assert type(out["param"]) is torch.nn.Parameter and out["param"].requires_grad
    assert type(out["grad"]) is torch.Tensor and out["grad"].requires_grad
    assert out["lambda_dd"] == {"z": 1}  # a plain dict: its empty copy does not pickle
    # The default collate keeps the mapping type of the samples, as default_collate does.
    samples = [collections.OrderedDict(b=np.float32(i), a=torch.tensor(i)) for i in range(3)]
    want = torch.utils.data.default_collate(samples)
    got = roundtrip(plan_collate(samples))
    assert type(got) is type(want) is collections.OrderedDict and list(got) == list(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


Pair = collections.namedtuple("Pair", "image label")

# Dtypes numpy has no type for (sent as their bytes) next to ones it has.
ODD_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float16,
              torch.uint16, torch.bool, torch.complex64]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.view(torch.uint8) if a.dtype.is_floating_point and a.element_size() == 1 else a,
        b.view(torch.uint8) if b.dtype.is_floating_point and b.element_size() == 1 else b)


@pytest.mark.parametrize("dtype", ODD_DTYPES, ids=str)
def test_tensors_of_any_dtype_round_trip(dtype: torch.dtype) -> None:
    """bfloat16 and float8 batches (mixed-precision training) used to fail in the worker:
    ``.numpy()`` has no such dtype.  Strided, transposed, conjugated: all come back bit-exact,
    as tensors of their dtype."""
    x = (torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7).to(dtype)
    out = roundtrip(plan_tree({"x": x, "t": x.t(), "n": Pair(x[0], 3)}))
    assert _same(out["x"], x) and _same(out["t"], x.t())
    assert type(out["n"]) is Pair and _same(out["n"].image, x[0]) and out["n"].label == 3
    # The default collate stacks per-sample tensors of it.
    col = roundtrip(plan_collate([{"x": x[i], "p": Pair(x[i], i)} for i in range(4)]))
    assert _same(col["x"], x)
    assert type(col["p"]) is Pair and _same(col["p"].image, x)
    assert col["p"].label.tolist() == [0, 1, 2, 3]


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch deprecates quantized tensors
def test_conjugated_sparse_and_quantized_tensors() -> None:
    c = torch.tensor([1 + 2j, 3 - 1j]).conj()
    sparse = torch.eye(3).to_sparse()
    q = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.quint8)
    out = roundtrip(plan_tree({"c": c, "s": sparse, "q": q}))
    assert torch.equal(out["c"], c.resolve_conj()) and not out["c"].is_conj()
    assert out["s"].is_sparse and torch.equal(out["s"].to_dense(), torch.eye(3))  # in-band
    assert out["q"].is_quantized and torch.equal(out["q"].dequantize(), q.dequantize())


def test_tensors_of_two_dtypes_of_one_width_are_not_stacked_as_one() -> None:
    """Both float8 types travel as uint8 arrays, as uint8 tensors do: a column mixing them is
    a list, as default_collate would not stack them either."""
    items = [torch.ones(2).to(torch.float8_e4m3fn), torch.ones(2).to(torch.float8_e5m2),
             torch.ones(2, dtype=torch.uint8)]
    out = roundtrip(plan_collate([{"x": t} for t in items]))
    assert isinstance(out["x"], list) and [t.dtype for t in out["x"]] == [t.dtype for t in items]


def test_number_columns_take_default_collates_dtype() -> None:
    """A column's dtype is the one torch's ``default_collate`` gives it (it came from the first
    item: [1, 2.5] became [1, 2] and [True, 5] [True, True], silently; then float64 for every
    float column and int64 for every integer one, where torch keeps ``np.float32`` scalars
    float32 and makes [1, 2.5] float32)."""
    from torch.utils.data import default_collate

    cols = {"mixed": [1, 2.5, np.int32(3)], "float_first": [2.5, 1], "bool_int": [True, 5],
            "bools": [True, False], "np_bools": [np.bool_(True), np.bool_(False)],
            "ints": [np.int16(4), 7], "int16": [np.int16(4), np.int16(-2)],
            "uint8": [np.uint8(1), np.uint8(200)], "f32": [np.float32(1.5), np.float32(2)],
            "f16_f32": [np.float16(1), np.float32(2.5)], "int_f32": [3, np.float32(0.5)],
            "np_int_float": [np.int64(3), 2.5], "f64": [np.float64(0.5), np.float32(1)],
            "i16_f32": [np.int16(3), np.float32(0.5)], "int_bool": [2, False]}
    samples = [{k: v[i] for k, v in cols.items()} for i in range(2)]
    out, theirs = roundtrip(plan_collate(samples)), default_collate(samples)
    for k in cols:
        assert out[k].dtype == theirs[k].dtype, k
        assert out[k].tolist() == theirs[k].tolist(), k
    # Where default_collate gives up, the column stays a list.
    odd = roundtrip(plan_collate([{"huge": 1, "other": 1}, {"huge": 2**70, "other": "x"}]))
    assert odd == {"huge": [1, 2**70], "other": [1, "x"]}


def test_sequences_collate_as_default_collate_does() -> None:
    """A tuple sample makes a list (``batch[0] = ...`` works), a named tuple itself, and a
    column of strings or bytes inside a sequence a tuple, as with torch's ``default_collate``;
    at the top and inside a dict, a list."""
    from torch.utils.data import default_collate

    samples = [(f"k{i}", i, [f"s{i}", b"b" * i], {"name": f"n{i}", "raw": b"r" * i})
               for i in range(3)]
    out, theirs = roundtrip(plan_collate(samples)), default_collate(samples)
    assert type(out) is list and type(theirs) is list
    assert out[0] == theirs[0] == ("k0", "k1", "k2")
    assert out[1].tolist() == theirs[1].tolist()
    assert type(out[2]) is list and out[2] == theirs[2]
    assert out[3] == theirs[3] and type(out[3]["name"]) is list
    assert roundtrip(plan_collate(["a", "b"])) == default_collate(["a", "b"]) == ["a", "b"]


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


def _area_with(fields: list[bytes], size: int = 1 << 16, start: int = 128):  # type: ignore[no-untyped-def]
    """An Area over a fresh buffer holding ``fields`` as the reader leaves them: copied in at
    64-byte aligned offsets and cut as read-only slices of the area's array."""
    buf = memoryview(bytearray(size))
    area = Area(buf, start)
    cut = []
    for f in fields:
        off = start + area.used
        buf[off : off + len(f)] = f
        area.used = ((off + len(f) + 63) & ~63) - start
        cut.append(area.array[off : off + len(f)])
    return buf, area, cut


def _write_in_place(plan, buf):  # type: ignore[no-untyped-def]
    assert plan.nbytes <= len(buf)
    plan.write(buf, 5, [0.1])
    return np.frombuffer(buf, dtype=np.uint8)[: plan.nbytes].copy()


def test_fields_read_into_the_message_are_referenced_not_copied() -> None:
    """A column of fields cut from the area (a batch read into its ring message) becomes the
    area itself plus a table of where each field lies: the message's size grows by the table,
    not by the fields, and the reader rebuilds every field (as read-only views, or bytes).  A
    field read elsewhere (the worker's private arena), a small ``bytes`` field and a label
    column ride along, copied in."""
    fields = [bytes([i]) * (5000 + 300 * i) for i in range(6)]
    buf, area, cut = _area_with(fields)
    private = sb.Arena(shared=False)
    view, off, mv = private.take(4100)
    mv[:] = b"P" * 4100
    outside = view[off : off + 4100]
    samples = [{"jpg": x, "cls": i} for i, x in enumerate(cut)]
    samples += [{"jpg": outside, "cls": 6}, {"jpg": b"tiny", "cls": 7}]
    plan = plan_collate(samples, area, sb.is_arena_field)
    assert plan.area_end == area.start + area.used
    assert plan.field_bytes == sum(map(len, fields)) + 4100
    # the table, meta, labels and the two copied fields come after the area: nothing more
    assert plan.nbytes - plan.area_end < 4100 + 4 + 2000
    msg = _write_in_place(plan, buf)
    want = fields + [b"P" * 4100, b"tiny"]
    out = read_tree(msg, torch.from_numpy, True)
    assert [bytes(x) for x in out["jpg"]] == want
    assert all(type(x) is np.ndarray and not x.flags.writeable for x in out["jpg"])
    assert out["cls"].tolist() == list(range(8))
    assert read_tree(msg, torch.from_numpy)["jpg"] == want  # without views: bytes
    copied = read_tree(msg, torch.from_numpy, True, copy=True)["jpg"]
    msg[:] = 0
    assert [bytes(x) for x in copied] == want


def test_area_arrays_of_a_user_collate_are_placed_and_copies_of_them_are_not() -> None:
    """plan_tree references an array lying in the area where it is; an array copied from the
    area (or any other) is copied in after it; a plan that reads nothing of the area has no
    area layout (its worker writes it over the area)."""
    fields = [bytes(range(256)) * 20, b"\x07" * 6000]
    buf, area, cut = _area_with(fields)
    as_u32 = cut[0][:4096].view(np.uint32)  # a view of a field: placed too
    plan = plan_tree({"a": cut[1], "b": as_u32, "c": np.arange(5)}, area)
    assert sorted(plan.placed.values()) == [area.start, area.start + 5120 + 0]
    msg = _write_in_place(plan, buf)
    out = read_tree(msg, torch.from_numpy)
    assert bytes(out["a"]) == fields[1]
    assert out["b"].tolist() == np.frombuffer(fields[0][:4096], np.uint32).tolist()
    assert out["c"].tolist() == list(range(5))
    # Stacked into one array, area bytes are copied: the area must stay where it is.
    words = [x[:4096].view(np.uint32) for x in cut]
    touched = plan_collate(words, area)
    assert touched.area_end and not touched.placed
    stacked = read_tree(_write_in_place(touched, buf), None)
    assert stacked.tolist() == [np.frombuffer(f[:4096], np.uint32).tolist() for f in fields]
    decoded = plan_collate([np.full(3, i) for i in range(4)], area)  # nothing of the area
    assert decoded.area_end == 0 and decoded.field_bytes == 0


def test_field_rows_takes_only_slices_of_the_area() -> None:
    """The C fast path of a column in the area says no (and the Python path decides) for
    anything that is not a 1-d uint8 slice of the area's array inside its used bytes."""
    from shardio._sampleio import field_rows

    _buf, area, cut = _area_with([b"a" * 5000, b"b" * 5000])
    end = area.start + area.used
    out = np.empty((2, 3), np.int64)
    assert field_rows(cut, area.array, area.start, end, out)
    assert out.tolist() == [[0, 0, 5000], [0, 5056, 10056]]
    other = np.frombuffer(bytes(5000), np.uint8)
    for bad in ([cut[0], other], [cut[0], cut[1].view(np.int8)],
                [cut[0], cut[1][::2]]):
        assert not field_rows(bad, area.array, area.start, end, np.empty((2, 3), np.int64))
    assert not field_rows(cut, area.array, area.start, area.start + 5000, out)  # outside used


def test_arrays_that_are_not_stacked_still_travel_out_of_band() -> None:
    """Images of different sizes make a list (default_collate would refuse them); their bytes
    go into the message as arrays, not into the pickled skeleton."""
    imgs = [torch.full((3, 40 + i, 50), i, dtype=torch.uint8) for i in range(4)]
    arrs = [np.full(1000 + i, i, np.int32) for i in range(4)]
    plan = plan_collate([{"img": im, "a": a} for im, a in zip(imgs, arrs)])
    assert len(plan.meta) < 1000
    out = roundtrip(plan)
    assert all(torch.equal(x, y) for x, y in zip(out["img"], imgs))
    assert all(type(x) is np.ndarray and np.array_equal(x, y) for x, y in zip(out["a"], arrs))


def test_arrays_of_different_dtypes_stack_as_torch_stack_does() -> None:
    """Equal-shape arrays of different dtypes: default_collate stacks them (torch.stack promotes:
    float32 with float64 is float64, uint8 with int64 int64, int64 with float32 float32); they
    came back as a list.  Dtypes torch has no tensor for (big-endian, strings) stay a list of
    arrays (they were stacked, then failed in the training process, untyped)."""
    from torch.utils.data import default_collate

    cases = [(np.float32, np.float64), (np.uint8, np.int64), (np.int64, np.float32),
             (np.bool_, np.int16), (np.float16, np.complex64)]
    for a, b in cases:
        items = [np.arange(3).astype(a), np.arange(3).astype(b), np.ones(3, dtype=a)]
        out, theirs = roundtrip(plan_collate(items)), default_collate(items)
        assert out.dtype == theirs.dtype, (a, b)
        assert torch.equal(out, theirs)
    for odd in (np.arange(3, dtype=">f4"), np.array(["ab", "cd", "ef"])):
        out = roundtrip(plan_collate([odd, odd.copy()]))
        assert type(out) is list and all(np.array_equal(x, odd) for x in out)


@dataclasses.dataclass
class _Node:
    value: int
    next: _Node | None = None


def test_limits_of_a_batch_written_as_a_tree() -> None:
    """What README's "Limits of writing a batch as a tree" says: aliases come back as copies
    (ring fields excepted: referenced where they lie), channels_last comes back contiguous, a
    dict or list inside itself is a UsageError, a dataclass cycle is pickled and kept."""
    a = np.arange(10)
    t = torch.arange(12.0)
    out = roundtrip(plan_tree({"x": a, "y": a, "t": t, "v": t[2:5]}))
    assert out["x"] is not out["y"] and not np.shares_memory(out["x"], out["y"])
    assert out["y"].tolist() == a.tolist() and out["v"].tolist() == [2.0, 3.0, 4.0]
    assert not np.shares_memory(out["t"].numpy(), out["v"].numpy())
    cl = torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last)
    back = roundtrip(plan_tree({"cl": cl}))["cl"]
    assert torch.equal(back, cl) and back.is_contiguous()
    assert not back.is_contiguous(memory_format=torch.channels_last)
    d: dict[str, Any] = {"a": 1}
    d["self"] = d
    items: list[Any] = [1]
    items.append(items)
    for tree in (d, items):
        with pytest.raises(UsageError, match="refers to itself"):
            plan_tree(tree)
    node = _Node(1)
    node.next = node
    got = roundtrip(plan_tree({"n": node, "arr": np.ones(3)}))["n"]
    assert type(got) is _Node and got.next is got
    buf, area, cut = _area_with([b"\x07" * 5000])
    plan = plan_tree({"a": cut[0], "b": cut[0]}, area)
    assert sorted(plan.placed.values()) == [area.start, area.start]
    out = read_tree(_write_in_place(plan, buf), None)
    assert np.shares_memory(out["a"], out["b"]) and bytes(out["b"]) == b"\x07" * 5000
