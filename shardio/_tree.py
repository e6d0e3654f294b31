"""Batch trees in shared memory: one message per batch, array data never pickled.

A batch is a tree of dicts, lists and tuples whose leaves are arrays (numpy arrays or torch
tensors), numbers, strings, bytes or ``None``.  Message layout (all offsets from the message
start, array payloads 64-byte aligned so they can be viewed in place)::

    0    header  <I kind> <I n_arrays> <q step> <I meta_len> <I generation> <6d stage seconds>
    72   table   n_arrays x <Q offset> <Q nbytes>
    ...  meta    pickle of the skeleton: the tree with every array replaced by ``_Arr(i, dtype,
                 shape, tensor)``; everything else is small and pickled in-band
    ...  arrays  raw bytes of array i at table[i].offset

Two ways to fill a message: :func:`plan_tree` for a tree already built by a user's
``collate_fn`` (one copy of each array into the message), and :func:`plan_collate`, the default
collate, which stacks per-sample arrays straight into the message (the only copy there is).
The reader side (:func:`read_tree`) rebuilds the skeleton with arrays that view the message.
"""

from __future__ import annotations

import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "KIND_BATCH",
    "KIND_ERROR",
    "KIND_RING_SPACE",
    "Plan",
    "error_message",
    "plan_collate",
    "plan_tree",
    "read_error",
    "read_header",
    "read_tree",
    "write_times",
]

KIND_BATCH = 1
KIND_ERROR = 2
# An error message (same payload as KIND_ERROR) from the pool itself, not from user code: a
# worker could not allocate its ring's memory (see "Ring sizing" in shardio.pool).
KIND_RING_SPACE = 3
_HEAD = struct.Struct("<IIqII6d")
_TIMES = struct.Struct("<6d")
ALIGN = 64
STAGES = ("read", "decode", "transform", "collate", "write", "total")


class _Arr(NamedTuple):
    index: int
    dtype: str
    shape: tuple[int, ...]
    tensor: bool


class _Bytes(NamedTuple):
    """A collated column of ``bytes``: one uint8 payload array plus int64 boundaries, written
    out of band like arrays (pickling megabytes of payload in-band would copy it twice)."""

    data: int
    bounds: int


def _put_bytes(items: Sequence[bytes]) -> Callable[[np.ndarray], None]:
    def fill(dst: np.ndarray, items: Sequence[bytes] = items) -> None:
        view = memoryview(dst)
        pos = 0
        for x in items:
            n = len(x)
            view[pos : pos + n] = x
            pos += n

    return fill


def _align(n: int) -> int:
    return n + (-n % ALIGN)


def _is_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "numpy")


@dataclass
class Plan:
    """A message ready to be written: sizes known, arrays filled by ``fills``."""

    meta: bytes
    shapes: list[tuple[np.dtype, tuple[int, ...]]]
    fills: list[Callable[[np.ndarray], None]]

    @property
    def table_offsets(self) -> list[tuple[int, int]]:
        pos = _align(_HEAD.size + 16 * len(self.shapes) + len(self.meta))
        out = []
        for dtype, shape in self.shapes:
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            out.append((pos, n))
            pos = _align(pos + n)
        return out

    @property
    def nbytes(self) -> int:
        t = self.table_offsets
        return t[-1][0] + t[-1][1] if t else _HEAD.size + len(self.meta)

    def write(self, buf: memoryview, step: int, times: Sequence[float], *,
              kind: int = KIND_BATCH, generation: int = 0) -> None:
        """Write header, table, meta and arrays into ``buf`` (at least :attr:`nbytes` long)."""
        table = self.table_offsets
        _HEAD.pack_into(buf, 0, kind, len(table), step, len(self.meta), generation & 0xFFFFFFFF,
                        *_times(times))
        pos = _HEAD.size
        for off, n in table:
            struct.pack_into("<QQ", buf, pos, off, n)
            pos += 16
        buf[pos : pos + len(self.meta)] = self.meta
        raw = np.frombuffer(buf, dtype=np.uint8)
        for (off, n), (dtype, shape), fill in zip(table, self.shapes, self.fills):
            fill(raw[off : off + n].view(dtype).reshape(shape))


def _times(times: Sequence[float]) -> list[float]:
    t = list(times)[: len(STAGES)]
    return t + [0.0] * (len(STAGES) - len(t))


def _copy_from(src: np.ndarray) -> Callable[[np.ndarray], None]:
    def fill(dst: np.ndarray) -> None:
        np.copyto(dst, src, casting="no")

    return fill


def _stack_into(arrs: list[np.ndarray]) -> Callable[[np.ndarray], None]:
    def fill(dst: np.ndarray) -> None:
        for i, a in enumerate(arrs):
            dst[i] = a

    return fill


# The planners below recurse through module-level functions over a plain accumulator, never
# through a recursive closure: such a closure is a reference cycle, and through ``fills`` it would
# keep every sample array of the batch alive until the cyclic GC happened to run (workers grew by
# about one batch per step until a full collection).
class _Acc:
    __slots__ = ("fills", "shapes")

    def __init__(self) -> None:
        self.shapes: list[tuple[np.dtype, tuple[int, ...]]] = []
        self.fills: list[Callable[[np.ndarray], None]] = []

    def add(self, dtype: np.dtype, shape: tuple[int, ...], fill: Callable[[np.ndarray], None],
            tensor: bool) -> _Arr:
        self.shapes.append((dtype, shape))
        self.fills.append(fill)
        return _Arr(len(self.shapes) - 1, dtype.str, shape, tensor)

    def plan(self, skeleton: Any) -> Plan:
        return Plan(pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL), self.shapes,
                    self.fills)


def _leaf(x: Any, acc: _Acc) -> Any:
    tensor = _is_tensor(x)
    if tensor or isinstance(x, np.ndarray):
        arr = np.ascontiguousarray(x.detach().cpu().numpy() if tensor else x)
        if arr.dtype.hasobject:
            return arr
        return acc.add(arr.dtype, arr.shape, _copy_from(arr), tensor)
    if isinstance(x, dict):
        return {k: _leaf(v, acc) for k, v in x.items()}
    if isinstance(x, list):
        return [_leaf(v, acc) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_leaf(v, acc) for v in x)
    return x


_NUMBER = (bool, np.bool_, int, np.integer, float, np.floating)
_KIND: dict[type, str] = {bool: "b", int: "i", float: "f"}


def _kind_of(x: Any) -> str | None:
    """``"b"``, ``"i"`` or ``"f"`` for a bool, integer or float (numpy's too); else None."""
    if isinstance(x, (bool, np.bool_)):
        return "b"
    if isinstance(x, (int, np.integer)):
        return "i"
    return "f" if isinstance(x, (float, np.floating)) else None


def plan_tree(tree: Any) -> Plan:
    """Plan a message for a tree built by the user's collate function."""
    acc = _Acc()
    return acc.plan(_leaf(tree, acc))


def _col(items: Sequence[Any], acc: _Acc) -> Any:
    first = items[0]
    if _is_tensor(first) or isinstance(first, np.ndarray):
        arrs = [x.detach().cpu().numpy() if _is_tensor(x) else x for x in items]
        a0 = arrs[0]
        if not a0.dtype.hasobject and all(
            a.shape == a0.shape and a.dtype == a0.dtype for a in arrs
        ):
            return acc.add(a0.dtype, (len(arrs), *a0.shape), _stack_into(arrs), True)
        return list(items)
    if isinstance(first, _NUMBER):
        # The column's type comes from every item, not the first: [1, 2.5] is float64 (not
        # [1, 2]) and [True, 5] int64, as torch's default_collate gives them.
        kinds = {_KIND.get(type(x)) or _kind_of(x) for x in items}
        if None in kinds:
            return list(items)
        dtype = np.float64 if "f" in kinds else np.int64 if "i" in kinds else np.bool_
        try:
            arr = np.asarray(items, dtype=dtype)
        except (OverflowError, ValueError, TypeError):
            return list(items)
        return acc.add(arr.dtype, arr.shape, _copy_from(arr), True)
    if isinstance(first, bytes) and all(type(x) is bytes for x in items):
        bounds = np.zeros(len(items) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in items], out=bounds[1:])
        u8 = np.dtype(np.uint8)
        data = acc.add(u8, (int(bounds[-1]),), _put_bytes(items), False)
        return _Bytes(data.index, acc.add(bounds.dtype, bounds.shape, _copy_from(bounds), False).index)
    if isinstance(first, dict):
        return {k: _col([d[k] for d in items], acc) for k in first}
    if isinstance(first, (list, tuple)) and all(len(x) == len(first) for x in items):
        cols = [_col([x[i] for x in items], acc) for i in range(len(first))]
        return tuple(cols) if isinstance(first, tuple) else cols
    return list(items)


def plan_collate(samples: Sequence[Any]) -> Plan:
    """Default collate, like torch's ``default_collate`` but writing into the message.

    Per-sample arrays/tensors of one shape and dtype are stacked into one batch tensor (written
    directly into the message), numbers become a float64 tensor if any item is a float, else
    int64 if any is an integer, else bool; dicts and sequences are collated field by field,
    strings and bytes become lists.
    """
    acc = _Acc()
    return acc.plan(_col(list(samples), acc))


def write_times(buf: Any, times: Sequence[float]) -> None:
    """Overwrite a written message's stage seconds (the write stage is known only after it)."""
    _TIMES.pack_into(buf, _HEAD.size - _TIMES.size, *_times(times))


def read_header(buf: Any) -> tuple[int, int, dict[str, float], int]:
    """``(kind, step, stage_seconds, generation)`` of a message."""
    kind, _n, step, _m, gen, *times = _HEAD.unpack_from(buf, 0)
    return kind, step, dict(zip(STAGES, times)), gen


def read_tree(buf: np.ndarray, to_tensor: Callable[[np.ndarray], Any] | None = None,
              bytes_as_views: bool = False, *, copy: bool = False,
              on_field: Callable[[np.ndarray, int, int], None] | None = None) -> Any:
    """Rebuild a message's tree with arrays viewing ``buf`` (a uint8 array over the message).

    Args:
        buf: the message bytes; arrays returned are views into it (zero-copy).
        to_tensor: applied to arrays that were tensors (e.g. ``torch.from_numpy``).
        bytes_as_views: a collated column of ``bytes`` comes back as read-only ``uint8`` arrays
            viewing ``buf`` (no copy; they keep ``buf`` alive) rather than as ``bytes`` copies.
        copy: every array (and bytes column) gets memory of its own instead of viewing ``buf``:
            keeping one field of the batch then keeps nothing else of it.
        on_field: called as ``on_field(array, offset, nbytes)`` for each array and bytes column,
            with the message bytes it views.  While ``array`` is alive (a weak reference
            tells), so is every view handed out of those bytes: the arrays that tensors wrap,
            and the plain ``ndarray`` arrays and columns whose base is a view of ``buf`` of
            another type, are where numpy stops collapsing a chain of views.
    """
    _kind, n, _step, mlen, _p, *_t = _HEAD.unpack_from(buf, 0)
    table = [struct.unpack_from("<QQ", buf, _HEAD.size + 16 * i) for i in range(n)]
    mstart = _HEAD.size + 16 * n
    skeleton = pickle.loads(buf[mstart : mstart + mlen].tobytes())
    return _build(skeleton, buf, table, to_tensor, _How(bytes_as_views, copy, on_field))


class _How(NamedTuple):
    views: bool
    copy: bool
    on_field: Callable[[np.ndarray, int, int], None] | None


def _build(x: Any, buf: np.ndarray, table: list[tuple[int, int]],
           to_tensor: Callable[[np.ndarray], Any] | None, how: _How) -> Any:
    # A module-level function, not a closure: a recursive closure is a reference cycle that
    # would keep ``buf`` (and so the ring region) alive until the cyclic GC runs.
    if isinstance(x, _Arr):
        off, nbytes = table[x.index]
        arr = buf[off : off + nbytes].view(np.dtype(x.dtype)).reshape(x.shape)
        tensor = x.tensor and to_tensor is not None
        if how.copy:
            arr = np.array(arr, copy=True, subok=False)
        elif not tensor and type(arr) is not np.ndarray:
            # A plain ndarray whose base is the subclass view: views of it stop here (see
            # on_field), and the cyclic GC does not track it.
            arr = arr.view(np.ndarray)
        if how.on_field is not None:
            how.on_field(arr, off, nbytes)
        return to_tensor(arr) if tensor else arr  # type: ignore[misc]
    if isinstance(x, _Bytes):
        off, nbytes = table[x.data]
        boff, bbytes = table[x.bounds]
        bounds = buf[boff : boff + bbytes].view(np.int64).tolist()
        if how.views:
            # Plain ndarrays (a subclass instance would be tracked by the cyclic GC), read-only;
            # their base chain holds ``buf``, and with it the message's place in the ring.
            col = buf[off : off + nbytes].view(np.ndarray)
            if how.copy:
                col = col.copy()
            col.flags.writeable = False
            if how.on_field is not None:
                how.on_field(col, off, nbytes)
            return [col[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        data = memoryview(buf[off : off + nbytes])
        return [bytes(data[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    if isinstance(x, dict):
        return {k: _build(v, buf, table, to_tensor, how) for k, v in x.items()}
    if isinstance(x, list):
        return [_build(v, buf, table, to_tensor, how) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_build(v, buf, table, to_tensor, how) for v in x)
    return x


def error_message(exc: BaseException, tb: str) -> Plan:
    """A message carrying a worker's exception and its traceback.

    The exception travels pickled on its own, next to its type name and text, so that one which
    pickles but does not unpickle (a custom ``__init__`` with required arguments, a class main
    cannot import) still arrives, as a RuntimeError naming it (see :func:`read_error`).
    """
    try:
        text = str(exc)
    except Exception:  # noqa: BLE001 - a broken __str__ must not hide the error
        text = "<unprintable>"
    try:
        pickled: bytes | None = pickle.dumps(exc, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - unpicklable exception: type and text still travel
        pickled = None
    cls = type(exc)
    payload = pickle.dumps({"exc": pickled, "type": f"{cls.__module__}.{cls.__qualname__}",
                            "text": text, "tb": tb}, protocol=pickle.HIGHEST_PROTOCOL)
    arr = np.frombuffer(payload, dtype=np.uint8)
    return Plan(pickle.dumps(_Arr(0, arr.dtype.str, arr.shape, False)), [(arr.dtype, arr.shape)],
                [_copy_from(arr)])


def read_error(buf: Any) -> tuple[BaseException, str]:
    """The ``(exception, traceback text)`` carried by an error message; an exception that cannot
    be rebuilt here becomes a RuntimeError with its type name and text."""
    payload = read_tree(np.frombuffer(bytes(buf), dtype=np.uint8))
    info = pickle.loads(payload.tobytes())
    exc: BaseException | None = None
    if info["exc"] is not None:
        try:
            exc = pickle.loads(info["exc"])
        except Exception:  # noqa: BLE001 - e.g. __init__ needs arguments pickle does not pass
            exc = None
    if not isinstance(exc, BaseException):
        exc = RuntimeError(f"{info['type']}: {info['text']}")
    return exc, info["tb"]
