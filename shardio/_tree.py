"""Batch trees in shared memory: one message per batch, array data never pickled.

A batch is a tree of dicts, lists and tuples whose leaves are arrays (numpy arrays or torch
tensors), numbers, strings, bytes or ``None``.  Message layout (all offsets from the message
start, array payloads 64-byte aligned so they can be viewed in place)::

    0    header  <I kind> <I n_arrays> <q step> <I meta_len> <I generation> <Q table_off>
                 <6d stage seconds>
    T    table   n_arrays x <Q offset> <Q nbytes>, at T = table_off
    ...  meta    pickle of the skeleton, right after the table: the tree with every array
                 replaced by ``_Arr(i, dtype, shape, tensor)``; everything else is small and
                 pickled in-band (so are objects it does not look into: a dataclass, a
                 sparse or quantized tensor)
    ...  arrays  raw bytes of array i at table[i].offset

Usually the table follows the header and the arrays follow the meta.  A message whose worker read
its samples straight into it (an *area*: see :class:`Area` and ``shardio.loader``) has the area
right after the header, its other arrays after the area, and the table and meta last, since
they are known only once the samples have been read and collated.

Two ways to fill a message: :func:`plan_tree` for a tree already built by a user's
``collate_fn`` (one copy of each array into the message), and :func:`plan_collate`, the default
collate, which stacks per-sample arrays straight into the message (the only copy there is).
With an area, arrays that already lie in it are not copied at all: the table points at them.
The reader side (:func:`read_tree`) rebuilds the skeleton with arrays that view the message.

A tensor whose dtype numpy lacks (``bfloat16``, the ``float8`` types, ``complex32``) travels as
its bytes, an array of integers of the same width, and ``_Arr.tensor`` names its dtype: the
reader views the tensor as that dtype again.  Named tuples are looked into like tuples and come
back as their own type.
"""

from __future__ import annotations

import math
import pickle
import struct
import sys
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from ._atomics import buffer_offset
from .errors import UsageError

try:
    from ._sampleio import field_rows
except ImportError:  # not built: the Python loop in _pieces
    field_rows = None

__all__ = [
    "KIND_BATCH",
    "KIND_ERROR",
    "KIND_RING_SPACE",
    "Plan",
    "error_message",
    "is_area_field",
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
_HEAD = struct.Struct("<IIqIIQ6d")
_TIMES = struct.Struct("<6d")
ALIGN = 64
STAGES = ("read", "decode", "transform", "collate", "write", "total")


class _Arr(NamedTuple):
    index: int
    dtype: str
    shape: tuple[int, ...]
    # True for a tensor, False for a numpy array, or the name of the torch dtype (a tensor
    # whose dtype numpy lacks: ``dtype`` is then the integer type of its bytes).
    tensor: bool | str
    grad: int = 0  # a tensor that required grad: 1; an ``nn.Parameter``: 2 (as torch sends them)


class _Map(NamedTuple):
    """A mapping of a type other than ``dict`` (``OrderedDict``, ``defaultdict``, a batch class
    deriving from dict): ``shell`` an empty copy of it, filled with ``items`` when the message is
    read, as ``default_collate`` keeps the type of the mappings it collates."""

    shell: Any
    items: dict[Any, Any]


class _Seq(NamedTuple):
    """A tuple of a type other than ``tuple`` and named tuples (``torch.Size`` holding arrays,
    say): rebuilt as ``kind(items)``, a plain tuple when that fails."""

    kind: type
    items: tuple[Any, ...]


class _Pieces(NamedTuple):
    """A collated column of byte fields that are arrays (``zero_copy``): each one either a slice
    of the message's area (array ``area``, where the worker read it: no copy) or of ``extra``
    (the others, copied in); ``where`` is an int64 array of ``(source, start, end)`` rows,
    source 0 for the area and 1 for ``extra``; -1 for an index means no such array."""

    area: int
    extra: int
    where: int


class _Bytes(NamedTuple):
    """A collated column of ``bytes``: one uint8 payload array plus int64 boundaries, written
    out of band like arrays (pickling megabytes of payload in-band would copy it twice)."""

    data: int
    bounds: int


def _put_bytes(items: Sequence[Any]) -> Callable[[np.ndarray], None]:
    def fill(dst: np.ndarray, items: Sequence[Any] = items) -> None:
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


def _in_band(t: Any) -> bool:
    """A tensor that is not plain memory (sparse, quantized, nested, MKL-DNN, meta): pickled
    with the skeleton instead, as torch pickles it."""
    return str(t.layout) != "torch.strided" or t.is_quantized or t.is_nested or t.is_meta


_SAME_WIDTH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _tensor_array(t: Any) -> tuple[np.ndarray, bool | str] | None:
    """A tensor's data as a numpy array, and ``_Arr.tensor`` for it: True, or the name of its
    dtype when numpy has none (the array then holds its bytes as integers of the same width;
    the reader views them as that dtype again).  None for a tensor that goes in-band."""
    if t.is_meta:  # (no data: .cpu() would raise)
        return None
    t = t.detach().cpu()
    try:
        return t.numpy(), True  # the usual case, ~1 us: no more checks
    except (TypeError, RuntimeError):
        pass
    if _in_band(t):
        return None
    t = t.resolve_conj().resolve_neg()  # numpy() refuses the conjugate and negative bits
    try:
        return t.numpy(), True
    except TypeError:
        width = _SAME_WIDTH.get(t.element_size())
        if width is None:
            raise
    import torch

    return t.view(getattr(torch, width)).numpy(), str(t.dtype).removeprefix("torch.")


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


try:  # NumPy 2 moved it
    from numpy.lib.array_utils import byte_bounds as _byte_bounds
except ImportError:  # pragma: no cover - NumPy 1.x
    _byte_bounds = np.byte_bounds


# This process's live areas' arrays, by id: how a collate function (zero_copy_collate) tells a
# field the reader cut from a ring area from any other uint8 array (see is_area_field).
_AREAS: weakref.WeakValueDictionary[int, np.ndarray] = weakref.WeakValueDictionary()


def is_area_field(x: Any) -> bool:
    """Whether ``x`` is a byte field the reader cut from a ring area (``ShardLoader`` with
    ``zero_copy``: a read-only 1-d ``uint8`` array viewing the message being built)."""
    if type(x) is not np.ndarray or x.ndim != 1 or x.dtype != np.uint8:
        return False
    base = x.base
    return base is not None and _AREAS.get(id(base)) is base


class Area:
    """Memory a message is being built in before its size is known: ``buf`` (a writable
    buffer: a ring reservation) holds, from ``start``, bytes read into it (see
    ``shardio.loader``).  Arrays lying inside ``buf[start:start + used]`` are put in the
    message where they are rather than copied."""

    def __init__(self, buf: Any, start: int) -> None:
        self.buf = buf
        self.array = np.frombuffer(buf, dtype=np.uint8)
        self.array.flags.writeable = False  # fields are cut from it (read-only, as zero_copy's)
        _AREAS[id(self.array)] = self.array
        self.addr = self.array.ctypes.data
        self.start = start
        self.used = 0

    def field_offset(self, x: np.ndarray) -> int | None:
        """Message offset of ``x`` when it is a contiguous slice cut from the area (the reader's
        fields are), else None: the fast test of the default collate's columns."""
        if x.base is not self.array or not x.flags.c_contiguous or not x.size:
            return None
        return buffer_offset(x, self.array)

    def offset_of(self, arr: np.ndarray) -> int | None:
        """Message offset of ``arr``'s bytes when they lie inside the used area (C-contiguous,
        not empty), else None."""
        off = self.field_offset(arr)
        if off is not None:
            return off
        if arr.size == 0 or not arr.flags.c_contiguous:
            return None
        off = arr.__array_interface__["data"][0] - self.addr
        if self.start <= off and off + arr.nbytes <= self.start + self.used:
            return off
        return None

    def overlaps(self, arr: np.ndarray) -> bool:
        """Whether any byte ``arr`` spans lies in the area (a copy from it would read it)."""
        if arr.size == 0:
            return False
        lo, hi = _byte_bounds(arr)
        return lo < self.addr + self.start + self.used and hi > self.addr + self.start


@dataclass
class Plan:
    """A message ready to be written: sizes known, arrays filled by ``fills``.

    ``placed`` maps arrays that already lie in the message (in its area) to their offsets; they
    have no fill (None).  ``area_end`` is where the area ends (arrays not placed go after it):
    0 for a message without one.  ``claim`` is the worker-side hold on the memory the area is in
    (see ``shardio.pool``); ``size_hint`` the size this worker's later messages may reach, when
    larger than this one (ring sizing); ``field_bytes`` the bytes of sample fields that the
    batch carries as the reader cut them (``zero_copy``'s arrays, not its small ``bytes``)."""

    meta: bytes
    shapes: list[tuple[np.dtype, tuple[int, ...]]]
    fills: list[Callable[[np.ndarray], None] | None]
    placed: dict[int, int] | None = None
    area_end: int = 0
    claim: Any = None
    size_hint: int = 0
    field_bytes: int = 0

    _layout: tuple[list[tuple[int, int]], int, int] | None = field(
        default=None, init=False, repr=False, compare=False)

    def layout(self) -> tuple[list[tuple[int, int]], int, int]:
        """``(table, table_off, nbytes)``: each array's ``(offset, nbytes)``, where the table
        goes, and the message size.  Worked out once: a plan does not change once made, and
        the pool and the job ask for its size several times a batch (``np.prod`` per array
        made that ~50 us a call)."""
        if self._layout is None:
            self._layout = self._make_layout()
        return self._layout

    def _make_layout(self) -> tuple[list[tuple[int, int]], int, int]:
        n = len(self.shapes)
        sizes = [math.prod(int(d) for d in shape) * dtype.itemsize
                 for dtype, shape in self.shapes]
        out = []
        if not self.area_end:
            table_off = _HEAD.size
            pos = _align(table_off + 16 * n + len(self.meta))
            for size in sizes:
                out.append((pos, size))
                pos = _align(pos + size)
            end = out[-1][0] + out[-1][1] if out else table_off + 16 * n + len(self.meta)
            return out, table_off, end
        placed = self.placed or {}
        pos = _align(self.area_end)
        for i, size in enumerate(sizes):
            off = placed.get(i)
            if off is None:
                off = pos
                pos = _align(pos + size)
            out.append((off, size))
        return out, pos, pos + 16 * n + len(self.meta)

    @property
    def nbytes(self) -> int:
        return self.layout()[2]

    def write(self, buf: memoryview, step: int, times: Sequence[float], *,
              kind: int = KIND_BATCH, generation: int = 0) -> None:
        """Write header, table, meta and arrays into ``buf`` (at least :attr:`nbytes` long);
        placed arrays are there already."""
        table, table_off, _end = self.layout()
        _HEAD.pack_into(buf, 0, kind, len(table), step, len(self.meta), generation & 0xFFFFFFFF,
                        table_off, *_times(times))
        pos = table_off
        for off, n in table:
            struct.pack_into("<QQ", buf, pos, off, n)
            pos += 16
        buf[pos : pos + len(self.meta)] = self.meta
        raw = np.frombuffer(buf, dtype=np.uint8)
        for (off, n), (dtype, shape), fill in zip(table, self.shapes, self.fills):
            if fill is not None:
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
    __slots__ = ("area", "area_index", "field_bytes", "fills", "is_field", "placed", "shapes",
                 "touched")

    def __init__(self, area: Area | None = None,
                 is_field: Callable[[Any], bool] | None = None) -> None:
        self.shapes: list[tuple[np.dtype, tuple[int, ...]]] = []
        self.fills: list[Callable[[np.ndarray], None] | None] = []
        self.area = area
        self.placed: dict[int, int] = {}
        self.area_index = -1  # the array that is the whole used area (for _Pieces columns)
        self.touched = False  # a fill copies from the area: it must stay where it is
        self.field_bytes = 0  # see Plan.field_bytes
        self.is_field = is_field  # see plan_collate

    def add(self, dtype: np.dtype, shape: tuple[int, ...], fill: Callable[[np.ndarray], None],
            tensor: bool | str) -> _Arr:
        self.shapes.append((dtype, shape))
        self.fills.append(fill)
        return _Arr(len(self.shapes) - 1, dtype.str, shape, tensor)

    def add_array(self, arr: np.ndarray, tensor: bool | str) -> _Arr:
        """Array ``arr`` (contiguous, no objects) as a message array: referenced where it is
        when it lies in the area, else copied in."""
        area = self.area
        if self.is_field is not None and self.is_field(arr):
            self.field_bytes += arr.nbytes  # (a private arena's field: never in the area)
        if area is not None:
            off = area.offset_of(arr)
            if off is not None:
                self.field_bytes += arr.nbytes
                self.shapes.append((arr.dtype, arr.shape))
                self.fills.append(None)
                self.placed[len(self.shapes) - 1] = off
                return _Arr(len(self.shapes) - 1, arr.dtype.str, arr.shape, tensor)
            if area.overlaps(arr):
                self.touched = True
        return self.add(arr.dtype, arr.shape, _copy_from(arr), tensor)

    def whole_area(self) -> int:
        """Index of the array that is the whole used area (added once)."""
        if self.area_index < 0:
            area = self.area
            assert area is not None
            self.shapes.append((np.dtype(np.uint8), (area.used,)))
            self.fills.append(None)
            self.placed[len(self.shapes) - 1] = area.start
            self.area_index = len(self.shapes) - 1
        return self.area_index

    def plan(self, skeleton: Any) -> Plan:
        meta = pickle.dumps(skeleton, protocol=pickle.HIGHEST_PROTOCOL)
        area = self.area
        if area is None or not (self.placed or self.touched):
            return Plan(meta, self.shapes, self.fills, field_bytes=self.field_bytes)
        return Plan(meta, self.shapes, self.fills, dict(self.placed), area.start + area.used,
                    field_bytes=self.field_bytes)


def _leaf(x: Any, acc: _Acc) -> Any:
    tensor: bool | str = _is_tensor(x)
    if tensor or isinstance(x, np.ndarray):
        grad = 0
        if tensor:
            if x.requires_grad:
                grad = 2 if isinstance(x, sys.modules["torch"].nn.Parameter) else 1
            got = _tensor_array(x)
            if got is None:
                return x
            x, tensor = got
        # (np.ascontiguousarray makes a 0-d array 1-d: a scalar tensor came back of shape (1,))
        arr = (x if type(x) is np.ndarray and x.flags.c_contiguous
               else np.ascontiguousarray(x).reshape(x.shape))
        if arr.dtype.hasobject:
            return arr
        placed = acc.add_array(arr, tensor)
        return placed._replace(grad=grad) if grad else placed
    if isinstance(x, dict):
        items = {k: _leaf(v, acc) for k, v in x.items()}
        return items if type(x) is dict else _mapping(x, items)
    if isinstance(x, list):
        return [_leaf(v, acc) for v in x]
    if isinstance(x, tuple):
        built = tuple(_leaf(v, acc) for v in x)
        if _is_namedtuple(x):
            return type(x)(*built)
        if type(x) is tuple:
            return built
        if all(a is b for a, b in zip(built, x)) and _picklable(x):
            return x  # nothing in it moved into the message (a torch.Size): as it is
        return _Seq(type(x), built)
    return x


def _picklable(x: Any) -> bool:
    try:
        pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001  (anything a __reduce__ raises)
        return False
    return True


def _mapping(x: dict[Any, Any], items: dict[Any, Any]) -> Any:
    """``items`` (``x``'s, placed in the message) for a mapping ``x`` of another type than
    dict: that type again where an empty copy of ``x`` pickles (see :class:`_Map`), else a
    plain dict (a ``defaultdict`` of a lambda, ...)."""
    import copy

    try:
        shell = copy.copy(x)
        shell.clear()
    except Exception:  # noqa: BLE001  (a mapping type that cannot be copied or cleared)
        return items
    return _Map(shell, items) if _picklable(shell) else items


_NUMBER = (bool, np.bool_, int, np.integer, float, np.floating)
_INT64, _BOOL = np.dtype(np.int64), np.dtype(np.bool_)


class _Tup(NamedTuple):
    """A column (of strings, bytes or byte fields) inside a sequence: it comes back as a tuple,
    as ``default_collate`` leaves the ``zip`` of a sequence's column of strings."""

    inner: Any


def _stack_dtype(dtypes: Sequence[np.dtype]) -> np.dtype | None:
    """The dtype a column of equal-shape arrays is stacked to, as ``torch.stack`` promotes them;
    None when they make a list instead: a dtype torch has no tensor for (strings, objects,
    big-endian) or a mix it cannot promote."""
    d0 = dtypes[0]
    if all(d == d0 for d in dtypes):
        return d0 if d0.isnative and d0.kind in "biufc" else None
    if not all(d.isnative and d.kind in "biufc" for d in dtypes):
        return None
    return _promote(set(dtypes))


def _promote(dtypes: set[np.dtype]) -> np.dtype | None:
    """torch's promotion of ``dtypes`` (numeric, native): complex over float over integer over
    bool, the widest of the leading kind (float32 with int64 is float32, not numpy's float64);
    None for a mix without a common type (uint64 with int64)."""
    if any(d.kind == "c" for d in dtypes):
        return np.result_type(*dtypes)
    for group in ("f", "iu"):
        chosen = [d for d in dtypes if d.kind in group]
        if chosen:
            out = np.result_type(*chosen)
            return out if out.kind in group else None
    return _BOOL


def _default_float() -> np.dtype:
    """torch's default dtype (what ``torch.tensor`` makes of a Python float), as numpy's."""
    torch = sys.modules.get("torch")
    name = str(torch.get_default_dtype()).rpartition(".")[2] if torch is not None else "float32"
    return np.dtype(name if name in ("float16", "float32", "float64") else "float32")


def _number_dtype(items: Sequence[Any]) -> np.dtype | None:
    """The dtype ``default_collate`` gives a column of numbers, None when an item is not one.

    A Python float first (``np.float64`` is one): ``float64``.  Otherwise torch infers it from
    every item: numpy scalars keep their dtype, a Python float is the default dtype (float32),
    an int ``int64``, a bool ``bool``; any float makes the column the widest float present,
    else any integer the widest integer ([1, 2.5] is float32, [np.int16(1), 2] int64)."""
    if isinstance(items[0], float):
        ok = all(isinstance(x, _NUMBER) for x in items)
        return np.dtype(np.float64) if ok else None
    kinds = set(map(type, items))  # (the usual column, labels, is one type: no Python loop)
    if len(kinds) == 1 and (int in kinds or bool in kinds):
        return _INT64 if int in kinds else _BOOL
    dtypes: set[np.dtype] = set()
    for x in items:
        t = type(x)
        if t is int:
            dtypes.add(_INT64)
        elif t is bool:
            dtypes.add(_BOOL)
        elif isinstance(x, np.generic):
            if x.dtype.kind not in "biuf":
                return None
            dtypes.add(x.dtype)
        elif isinstance(x, float):
            dtypes.add(_default_float())
        elif isinstance(x, int):  # an int subclass (IntEnum, ...)
            dtypes.add(_INT64)
        else:
            return None
    return _promote(dtypes)


def plan_tree(tree: Any, area: Area | None = None,
              is_field: Callable[[Any], bool] | None = None) -> Plan:
    """Plan a message for a tree built by the user's collate function (arrays lying in
    ``area`` are referenced where they are; ``is_field`` as for :func:`plan_collate`)."""
    acc = _Acc(area, is_field)
    try:
        return acc.plan(_leaf(tree, acc))
    except RecursionError as exc:
        raise _not_a_tree() from exc


def _not_a_tree() -> UsageError:
    return UsageError(
        "the batch refers to itself (a dict or list inside itself) or is nested deeper than "
        "Python's recursion limit: ShardLoader writes a batch as a tree of containers; return "
        "one from collate_fn (DataLoader pickles such a batch; ShardLoader does not)")


def _is_field(x: Any, acc: _Acc) -> bool:
    """Whether ``x`` is a byte field the reader cut from the area or from an arena: a 1-d uint8
    array (``zero_copy``)."""
    if type(x) is not np.ndarray:
        return False
    area = acc.area
    if area is not None and x.base is area.array:
        return x.ndim == 1 and x.dtype == np.uint8 and x.flags.c_contiguous
    return (acc.is_field is not None and x.ndim == 1 and x.dtype == np.uint8
            and not x.flags.writeable and acc.is_field(x))


def _fields(items: Sequence[Any], acc: _Acc) -> bool:
    """Whether ``items`` is a column of byte fields with at least one array field among them
    (fields under ``zero_copy`` are arrays from 4 KiB up, ``bytes`` below)."""
    seen = False
    for x in items:
        if type(x) is bytes:
            continue
        if not _is_field(x, acc):
            return False
        seen = True
    return seen


def _area_column(items: Sequence[Any], acc: _Acc) -> _Pieces | None:
    """The column as :func:`_pieces` makes it when every item is a field cut from the area (the
    usual column of a batch read into its ring), checked and located in one C call; None
    otherwise (``_fields``/``_pieces`` then look at each item)."""
    area = acc.area
    if area is None or field_rows is None or getattr(items[0], "base", None) is not area.array:
        return None
    where = np.empty((len(items), 3), dtype=np.int64)
    if not field_rows(list(items), area.array, area.start, area.start + area.used, where):
        return None
    acc.field_bytes += int((where[:, 2] - where[:, 1]).sum())
    return _Pieces(acc.whole_area(), -1,
                   acc.add(where.dtype, where.shape, _copy_from(where), False).index)


def _pieces(items: Sequence[np.ndarray | bytes], acc: _Acc) -> _Pieces:
    """A column of byte fields (see :class:`_Pieces`): those in the area stay there, the others
    (arrays or ``bytes``) are copied into one array, as a column of ``bytes`` is."""
    area = acc.area
    where = np.empty((len(items), 3), dtype=np.int64)
    rows = []
    others: list[np.ndarray] = []
    pos = 0
    start = area.start if area is not None else 0
    for x in items:
        if type(x) is bytes:
            off, n = None, len(x)
        else:
            off = area.field_offset(x) if area is not None else None
            n = x.nbytes
        if off is not None:
            rows.append((0, off - start, off - start + n))
        else:
            rows.append((1, pos, pos + n))
            others.append(x)
            pos += n
    where[:] = rows
    acc.field_bytes += sum(x.nbytes for x in items if type(x) is not bytes)
    a = acc.whole_area() if len(others) < len(items) else -1
    u8 = np.dtype(np.uint8)
    e = acc.add(u8, (pos,), _put_bytes(others), False).index if others else -1
    return _Pieces(a, e, acc.add(where.dtype, where.shape, _copy_from(where), False).index)


def _col(items: Sequence[Any], acc: _Acc, in_seq: bool = False) -> Any:
    """The collated column ``items``, as ``default_collate`` makes it; ``in_seq``: a column of
    a sequence (its strings and bytes come back as a tuple: see :class:`_Tup`)."""
    first = items[0]
    # Fields that are arrays exist only under zero_copy (an area or an is_field test): without
    # one, a column of bytes goes straight on to _Bytes below.
    if (acc.area is not None or acc.is_field is not None) and (
            type(first) is np.ndarray or type(first) is bytes):
        col = _area_column(items, acc)
        if col is None and _fields(items, acc):
            col = _pieces(items, acc)
        if col is not None:
            return _Tup(col) if in_seq else col
    if _is_tensor(first) or isinstance(first, np.ndarray):
        # Arrays that are not stacked (mixed with other things, or of different shapes or
        # dtypes) make a list, as default_collate's; each array in it is still written out
        # of band (pickled in the skeleton, images of different sizes would be copied twice).
        if not all(_is_tensor(x) or isinstance(x, np.ndarray) for x in items):
            return [_leaf(x, acc) for x in items]
        got: list[tuple[np.ndarray, bool | str]] = []
        for x in items:
            pair = _tensor_array(x) if _is_tensor(x) else (x, True)
            if pair is None:  # in-band (sparse, quantized, ...)
                return [_leaf(x, acc) for x in items]
            got.append(pair)
        arrs = [a for a, _t in got]
        a0, t0 = got[0]
        if all(a.shape == a0.shape and t == t0 for a, t in got):
            dtype = _stack_dtype([a.dtype for a in arrs])
            if dtype is not None:
                if acc.area is not None and any(acc.area.overlaps(a) for a in arrs):
                    acc.touched = True
                return acc.add(dtype, (len(arrs), *a0.shape), _stack_into(arrs), t0)
        return [_leaf(x, acc) for x in items]
    if isinstance(first, _NUMBER):
        dtype = _number_dtype(items)
        if dtype is None:
            return list(items)
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
        col = _Bytes(data.index,
                     acc.add(bounds.dtype, bounds.shape, _copy_from(bounds), False).index)
        return _Tup(col) if in_seq else col
    if isinstance(first, dict):
        cols = {k: _col([d[k] for d in items], acc) for k in first}
        return cols if type(first) is dict else _mapping(first, cols)
    if isinstance(first, (list, tuple)) and all(len(x) == len(first) for x in items):
        cols = [_col([x[i] for x in items], acc, True) for i in range(len(first))]
        if _is_namedtuple(first):
            return type(first)(*cols)  # as default_collate
        return cols  # a list, for tuples too, as default_collate
    if in_seq and isinstance(first, str):
        return tuple(items)
    return list(items)


def plan_collate(samples: Sequence[Any], area: Area | None = None,
                 is_field: Callable[[Any], bool] | None = None) -> Plan:
    """Default collate, like torch's ``default_collate`` but writing into the message.

    Per-sample arrays/tensors of one shape and dtype are stacked into one batch tensor (written
    directly into the message), numbers become a tensor of the dtype ``default_collate`` gives
    (:func:`_number_dtype`); dicts and sequences are collated field by field (a sequence
    becomes a list, a named tuple itself), strings and bytes become lists (tuples inside a
    sequence, as there).  Byte fields that are arrays (``zero_copy``: those cut from
    ``area``, or for which ``is_field`` says so) become a list of such arrays, as a column of
    ``bytes`` does; those lying in ``area`` are referenced where they are, not copied.
    """
    acc = _Acc(area, is_field)
    try:
        return acc.plan(_col(list(samples), acc))
    except RecursionError as exc:
        raise _not_a_tree() from exc


def write_times(buf: Any, times: Sequence[float]) -> None:
    """Overwrite a written message's stage seconds (the write stage is known only after it)."""
    _TIMES.pack_into(buf, _HEAD.size - _TIMES.size, *_times(times))


def read_header(buf: Any) -> tuple[int, int, dict[str, float], int]:
    """``(kind, step, stage_seconds, generation)`` of a message."""
    kind, _n, step, _m, gen, _t, *times = _HEAD.unpack_from(buf, 0)
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
    _kind, n, _step, mlen, _p, table_off, *_t = _HEAD.unpack_from(buf, 0)
    table = [struct.unpack_from("<QQ", buf, table_off + 16 * i) for i in range(n)]
    mstart = table_off + 16 * n
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
        if not tensor:
            return arr
        t = to_tensor(arr)  # type: ignore[misc]
        if isinstance(x.tensor, str):  # its bytes: see _tensor_array
            import torch

            t = t.view(getattr(torch, x.tensor))
        if x.grad:
            import torch

            t = torch.nn.Parameter(t) if x.grad == 2 else t.requires_grad_(True)
        return t
    if isinstance(x, _Pieces):
        return _build_pieces(x, buf, table, how)
    if isinstance(x, _Tup):
        return tuple(_build(x.inner, buf, table, to_tensor, how))
    if isinstance(x, _Map):
        x.shell.update({k: _build(v, buf, table, to_tensor, how) for k, v in x.items.items()})
        return x.shell
    if isinstance(x, _Seq):
        items = tuple(_build(v, buf, table, to_tensor, how) for v in x.items)
        try:
            return x.kind(items)
        except Exception:  # noqa: BLE001  (a tuple type that does not take its items back)
            return items
    if isinstance(x, _Bytes):
        off, nbytes = table[x.data]
        boff, bbytes = table[x.bounds]
        bounds = buf[boff : boff + bbytes].view(np.int64).tolist()
        if how.views:
            col = _column(buf, off, nbytes, how)
            return [col[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        data = memoryview(buf[off : off + nbytes])
        return [bytes(data[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    if isinstance(x, dict):
        return {k: _build(v, buf, table, to_tensor, how) for k, v in x.items()}
    if isinstance(x, list):
        return [_build(v, buf, table, to_tensor, how) for v in x]
    if isinstance(x, tuple):
        if type(x) is not tuple and not _is_namedtuple(x):
            return x  # a tuple type kept as it was (nothing of it in the message: see _leaf)
        items = (_build(v, buf, table, to_tensor, how) for v in x)
        return type(x)(*items) if _is_namedtuple(x) else tuple(items)
    return x


def _column(buf: np.ndarray, off: int, nbytes: int, how: _How) -> np.ndarray:
    """A column of byte fields as a read-only plain ndarray (a subclass instance would be
    tracked by the cyclic GC) viewing ``buf``: its base chain holds ``buf``, and with it the
    message's place in the ring (a copy with ``how.copy``)."""
    col = buf[off : off + nbytes].view(np.ndarray)
    if how.copy:
        col = col.copy()
    col.flags.writeable = False
    if how.on_field is not None:
        how.on_field(col, off, nbytes)
    return col


def _build_pieces(x: _Pieces, buf: np.ndarray, table: list[tuple[int, int]],
                  how: _How) -> list[Any]:
    where = buf[slice(*_span(table[x.where]))].view(np.int64).reshape(-1, 3).tolist()
    cols = []
    for index in (x.area, x.extra):
        if index < 0:
            cols.append(None)
            continue
        off, nbytes = table[index]
        cols.append(_column(buf, off, nbytes, how) if how.views
                    else memoryview(buf[off : off + nbytes]))
    if not how.views:
        return [bytes(cols[src][a:b]) for src, a, b in where]  # type: ignore[index]
    return [cols[src][a:b] for src, a, b in where]  # type: ignore[index]


def _span(entry: tuple[int, int]) -> tuple[int, int]:
    return entry[0], entry[0] + entry[1]


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
