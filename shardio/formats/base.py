"""The in-shard index shared by every shard format, and the writer/reader interfaces.

Index model (all arrays little-endian numpy, never lists of Python objects, so a reader holding
thousands of shard indexes stays small and fork-friendly)::

    key_offsets   uint64[n+1]   sample i's key is key_blob[key_offsets[i]:key_offsets[i+1]] (UTF-8)
    sample_start  uint64[n+1]   sample i owns field rows sample_start[i]:sample_start[i+1]
    f_name        uint16[m]     index into field_names
    f_flags       uint8[m]      bit 0: stored bytes are zstd-compressed
    f_offset      uint64[m]     byte offset of the stored bytes in the shard file
    f_length      uint64[m]     stored length
    f_raw_length  uint64[m]     length after decompression
    f_checksum    uint64[m]     per-field checksum of the stored bytes (algorithm in ``checksum``)

Standalone index file (``<shard>.idx``, used beside tar shards)::

    b"SHARDIDX" | u32 version | u32 header_len | header JSON | pad to 8
    | arrays in header order, each padded to 8 | u64 xxh3_64 of everything before | b"SHIDXEND"
"""

from __future__ import annotations

import json
import operator
import os
import struct
import sys
from array import array
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import xxhash

from .. import _inject
from .._fsutil import pread_full, preadv_full, translate_oserror
from ..checksum import hex64, sample_checksum_fn
from ..codec import FLAG_ZSTD, Codec
from ..errors import (
    ChecksumMismatchError,
    DatasetChangedError,
    IndexCorruptError,
    ManifestCorruptError,
    ManifestVersionError,
    ShardNotFoundError,
    ShardTruncatedError,
)

try:  # one-preadv sample reads (shardio/_sampleio.c); ShardReader._decode is the reference
    from .._sampleio import Index as _SampleIndex
except ImportError:  # pragma: no cover - built with the package on Linux
    _SampleIndex = None

__all__ = ["IndexBuilder", "ShardIndex", "ShardReader", "ShardWriter", "WrittenShard",
           "file_ident", "list_position"]

if TYPE_CHECKING:
    import numpy as np
else:
    class _LazyNumpy:
        """Stands in for numpy until first used, then replaces itself: writing a tar shard and its
        index needs no numpy, and importing it costs about a tenth of a small pack's run time."""

        def __getattr__(self, name: str) -> Any:
            import numpy

            globals()["np"] = numpy
            return getattr(numpy, name)

    np = _LazyNumpy()

# This process's id, refreshed in forked children, so readers notice a fork (and reopen their
# descriptors) without a getpid() system call per read.
_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))

FileIdent = tuple[int, int, int]


def file_ident(st: os.stat_result) -> FileIdent:
    """Which file a stat result describes: ``(st_dev, st_ino, st_mtime_ns)``.  A shard packed
    again in place is a new file (new inode), or at least a rewritten one (new mtime)."""
    return (st.st_dev, st.st_ino, st.st_mtime_ns)


def list_position(i: Any, n: int, where: str) -> int:
    """Position ``i`` in a sequence of ``n`` samples, taken as a list takes an index: any
    integer (``int``, ``bool``, numpy integers: :func:`operator.index`), negative ones counting
    from the end; never a float, a string or a slice.  ``where`` names the sequence in errors.

    Raises:
        TypeError: ``i`` is not an integer.
        IndexError: ``i`` is outside ``-n..n-1``; the message shows it and the valid range.
    """
    try:
        k = operator.index(i)
    except TypeError:
        hint = "; it reads one sample: index each one (or iterate)" if type(i) is slice else ""
        raise TypeError(f"sample indices of {where} must be integers (int or a numpy integer), "
                        f"not {type(i).__name__}{hint}") from None
    j = k + n if k < 0 else k
    if not 0 <= j < n:
        valid = f"{-n}..{n - 1}" if n else "none"
        raise IndexError(f"sample index {k} out of range for {where} ({n} samples; valid "
                         f"indices: {valid})")
    return j


INDEX_MAGIC = b"SHARDIDX"
INDEX_END = b"SHIDXEND"
INDEX_VERSION = 1
_BIG_ENDIAN = sys.byteorder == "big"
_NATIVE = {"Q": "=u8", "H": "=u2", "B": "u1"}  # IndexBuilder column typecodes as numpy dtypes

_ARRAYS: tuple[tuple[str, str], ...] = (
    ("key_offsets", "<u8"),
    ("sample_start", "<u8"),
    ("f_name", "<u2"),
    ("f_flags", "u1"),
    ("f_offset", "<u8"),
    ("f_length", "<u8"),
    ("f_raw_length", "<u8"),
    ("f_checksum", "<u8"),
)


@dataclass
class ShardIndex:
    """Where every sample field of one shard lies, with its checksum."""

    field_names: list[str]
    checksum: str
    key_blob: bytes
    key_offsets: np.ndarray
    sample_start: np.ndarray
    f_name: np.ndarray
    f_flags: np.ndarray
    f_offset: np.ndarray
    f_length: np.ndarray
    f_raw_length: np.ndarray
    f_checksum: np.ndarray
    meta: dict[str, Any] = field(default_factory=dict)
    # What a manifest records as this index's ``index_digest`` (set by the loaders: a tar
    # ``.idx`` file's digest, an HDF5 shard's ``index_digest`` attribute; "" when unknown).
    digest: str = field(default="", compare=False)
    _spans: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.key_offsets) - 1

    def key(self, i: int) -> str:
        return self.key_blob[int(self.key_offsets[i]) : int(self.key_offsets[i + 1])].decode("utf-8")

    def keys(self) -> list[str]:
        return [self.key(i) for i in range(len(self))]

    def rows(self, i: int) -> range:
        return range(int(self.sample_start[i]), int(self.sample_start[i + 1]))

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        """Per-sample ``(start, end)`` byte ranges covering every stored field, computed once."""
        if self._spans is None:
            n = len(self)
            lo = np.zeros(n, dtype=np.int64)
            hi = np.zeros(n, dtype=np.int64)
            first = self.sample_start[:-1].astype(np.int64)
            has = self.sample_start[1:] > self.sample_start[:-1]
            if has.any():
                off = self.f_offset.astype(np.int64)
                lo[has] = np.minimum.reduceat(off, first[has])
                hi[has] = np.maximum.reduceat(off + self.f_length.astype(np.int64), first[has])
            self._spans = (lo, hi)
        return self._spans

    def span(self, i: int) -> tuple[int, int]:
        """``(start, end)`` byte range covering every stored field of sample ``i``."""
        lo, hi = self.spans()
        return int(lo[i]), int(hi[i])

    @property
    def stored_bytes(self) -> int:
        return int(self.f_length.sum())

    @property
    def raw_bytes(self) -> int:
        return int(self.f_raw_length.sum())

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name, _ in _ARRAYS}

    def same_layout(self, other: ShardIndex) -> bool:
        """Whether ``other`` says the same as this index about every sample: keys, field names,
        where each field lies, how it is stored and its checksum (so reads through either give
        the same bytes).  ``digest`` and ``meta`` are left out: an index rebuilt from a verified
        copy of a shard has another digest but reads the same."""
        return (self.field_names == other.field_names and self.checksum == other.checksum
                and bytes(self.key_blob) == bytes(other.key_blob)
                and all(np.array_equal(getattr(self, n), getattr(other, n)) for n, _ in _ARRAYS))

    # --- standalone file -------------------------------------------------------------------
    def to_bytes(self) -> bytes:
        arrays = [np.ascontiguousarray(getattr(self, n), dtype=dt) for n, dt in _ARRAYS]
        return _index_bytes(self.field_names, self.checksum, self.key_blob,
                            [(a.tobytes(), int(a.shape[0])) for a in arrays], self.meta)

    @classmethod
    def from_bytes(cls, data: bytes, where: str = "<index>") -> ShardIndex:
        """Parse and check a standalone index.

        Raises:
            IndexCorruptError: bad magic, truncated, or failing its checksum.
            ManifestVersionError: written by a newer shardio.
        """
        def bad(why: str) -> IndexCorruptError:
            return IndexCorruptError(
                f"index {where} is corrupt ({why}); restore it from a good copy (`shardio repair "
                "--replica`, `shardio verify --repair`), or for a tar shardio did not pack, "
                "build it again with `shardio index`"
            )

        if len(data) < 32 or data[:8] != INDEX_MAGIC or data[-8:] != INDEX_END:
            raise bad("bad magic or truncated")
        (stored,) = struct.unpack_from("<Q", data, len(data) - 16)
        if xxhash.xxh3_64_intdigest(data[:-16]) != stored:
            raise bad("checksum mismatch")
        version, hlen = struct.unpack_from("<II", data, 8)
        if version > INDEX_VERSION:
            raise ManifestVersionError(
                f"index {where} has format version {version}, newer than this shardio reads "
                f"({INDEX_VERSION}); upgrade shardio: pip install -U shardio"
            )
        try:
            header = json.loads(data[16 : 16 + hlen])
            pos = 16 + hlen
            pos += -pos % 8
            klen = int(header["key_blob_len"])
            key_blob = bytes(data[pos : pos + klen])
            pos += klen + (-klen % 8)
            arrays: dict[str, np.ndarray] = {}
            if [[n, dt] for n, dt, _c in header["arrays"]] != [list(a) for a in _ARRAYS]:
                raise ValueError(f"arrays {header['arrays']}")
            for name, dt, count in header["arrays"]:
                nbytes = np.dtype(dt).itemsize * count
                arrays[name] = np.frombuffer(data, dtype=dt, count=count, offset=pos)
                pos += nbytes + (-nbytes % 8)
            names = header["field_names"]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise ValueError("field_names")
            problem = structure_problem(names, 1 << 63, key_blob, arrays)
            if problem is not None:
                raise bad(problem)
            return cls(
                field_names=list(names),
                checksum=header["checksum"],
                key_blob=key_blob,
                meta=dict(header.get("meta", {})),
                **arrays,
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise bad(f"malformed header: {exc}") from exc


def structure_problem(names: Sequence[str], payload_len: int, key_blob: bytes,
                      a: Mapping[str, np.ndarray]) -> str | None:
    """Why the index arrays (of ``_ARRAYS``' dtypes) cannot be what a shard writer wrote, or
    None when they can: fields in order inside the first ``payload_len`` bytes (an HDF5 shard's
    ``/payload``; a tar shard's file), keys cut from ``key_blob`` at UTF-8 boundaries, known
    field names and flags.

    An index that passes its own checksum (or an HDF5 one without ``index_digest``) still
    cannot then send a read outside the data, name a field that does not exist, decompress a
    raw field or mis-cut a key."""
    if any(arr.ndim != 1 for arr in a.values()):
        return "an index array is not one-dimensional"
    ko, ss = a["key_offsets"], a["sample_start"]
    rows = len(a["f_name"])
    per_row = [arr for name, arr in a.items() if name.startswith("f_")]
    if not len(ko) or len(ss) != len(ko) or any(len(arr) != rows for arr in per_row):
        return (f"array lengths disagree: {len(ko)} key offsets, {len(ss)} sample starts, "
                f"{rows} field names")
    for label, arr, end in (("key_offsets", ko, len(key_blob)), ("sample_start", ss, rows)):
        if arr[0] != 0 or arr[-1] != end or bool((arr[1:] < arr[:-1]).any()):
            return f"{label} are not increasing from 0 to {end}"
    blob = np.frombuffer(key_blob, dtype=np.uint8)
    cuts = ko[1:-1][ko[1:-1] < len(blob)]
    try:
        key_blob.decode("utf-8")
    except UnicodeDecodeError:
        return "key_blob is not UTF-8"
    if bool(((blob[cuts] & 0xC0) == 0x80).any()):
        return "key_offsets cut a UTF-8 character"
    fname, flags, off, length = a["f_name"], a["f_flags"], a["f_offset"], a["f_length"]
    if rows and int(fname.max()) >= len(names):
        return f"f_name {int(fname.max())} names no field (there are {len(names)})"
    if bool((flags & ~np.uint8(FLAG_ZSTD)).any()):
        return f"unknown f_flags {sorted(set(flags.tolist()) - {0, FLAG_ZSTD})}"
    if bool((off[1:] < off[:-1]).any()) or bool((off > payload_len).any()) or bool(
            (length > np.uint64(payload_len) - off).any()):
        return f"field offsets are not in order inside the {payload_len}-byte payload"
    # Codec.encode keeps a compressed field only when it is smaller than the raw bytes.
    if bool(np.where(flags == 0, a["f_raw_length"] != length, a["f_raw_length"] <= length).any()):
        return "a field's raw length does not fit its flags (equal if raw, larger if compressed)"
    return None


def _index_bytes(field_names: list[str], checksum: str, key_blob: bytes,
                 arrays: Sequence[tuple[bytes, int]], meta: dict[str, Any]) -> bytes:
    """Serialize a standalone index; ``arrays`` holds ``(little-endian bytes, count)`` per
    ``_ARRAYS`` entry, in that order."""
    header = {
        "field_names": field_names,
        "checksum": checksum,
        "key_blob_len": len(key_blob),
        "arrays": [[n, dt, count] for (n, dt), (_b, count) in zip(_ARRAYS, arrays)],
        "meta": meta,
    }
    hbytes = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    parts = [INDEX_MAGIC, struct.pack("<II", INDEX_VERSION, len(hbytes)), hbytes]
    pos = 16 + len(hbytes)
    for blob in [key_blob] + [b for b, _count in arrays]:
        parts.append(b"\0" * (-pos % 8))
        pos += -pos % 8
        parts.append(blob)
        pos += len(blob)
    parts.append(b"\0" * (-pos % 8))
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body)) + INDEX_END


class IndexBuilder:
    """Accumulate index rows while a shard is written.

    Columns are ``array.array``s of the index dtypes, so writing a standalone index
    (:meth:`to_bytes`) needs no numpy.  A writer on a hot path may append a row to the public
    columns (``f_name`` from :meth:`name_id`, ``f_flags`` ... ``f_checksum``) itself instead of
    calling :meth:`add_field`; a sample's rows follow its :meth:`add_sample` call.
    """

    def __init__(self, checksum: str) -> None:
        self.checksum = checksum
        self._names: dict[str, int] = {}
        self._keys = bytearray()
        self._key_offsets = array("Q", [0])
        self._starts = array("Q")  # row index where each sample begins
        self.f_name = array("H")
        self.f_flags = array("B")
        self.f_offset = array("Q")
        self.f_length = array("Q")
        self.f_raw_length = array("Q")
        self.f_checksum = array("Q")

    def add_sample(self, key: str) -> None:
        self._keys += key.encode("utf-8")
        self._key_offsets.append(len(self._keys))
        self._starts.append(len(self.f_name))

    def add_field(
        self, name: str, flags: int, offset: int, length: int, raw_length: int, checksum: int
    ) -> None:
        nid = self._names.setdefault(name, len(self._names))
        self.f_name.append(nid)
        self.f_flags.append(flags)
        self.f_offset.append(offset)
        self.f_length.append(length)
        self.f_raw_length.append(raw_length)
        self.f_checksum.append(checksum)

    def add_columns(self, keys: bytes, key_offsets: bytes, starts: bytes, name_ids: bytes,
                    offsets: bytes, lengths: bytes, checksums: bytes) -> None:
        """Append rows given as packed columns (native byte order; ``shardio._tarpack.fill``):
        key bytes, each sample's key end and first row (absolute), and per row its field name id,
        offset, length and checksum.  Flags are 0 and raw lengths equal lengths (stored as is)."""
        self._keys += keys
        self._key_offsets.frombytes(key_offsets)
        self._starts.frombytes(starts)
        self.f_name.frombytes(name_ids)
        self.f_flags.frombytes(bytes(len(name_ids) // 2))
        self.f_offset.frombytes(offsets)
        self.f_length.frombytes(lengths)
        self.f_raw_length.frombytes(lengths)
        self.f_checksum.frombytes(checksums)

    def name_id(self, name: str) -> int:
        """The ``f_name`` value of field ``name`` (registered on first use)."""
        return self._names.setdefault(name, len(self._names))

    def __len__(self) -> int:
        return len(self._key_offsets) - 1

    @property
    def stored_bytes(self) -> int:
        return sum(self.f_length)

    def field_counts(self) -> dict[str, int]:
        """Rows per field name, in order of first appearance."""
        ids = Counter(self.f_name)
        return {name: ids[i] for name, i in self._names.items() if ids[i]}

    def _columns(self) -> list[array]:
        sample_start = array("Q", self._starts)
        sample_start.append(len(self.f_name))
        return [self._key_offsets, sample_start, self.f_name, self.f_flags, self.f_offset,
                self.f_length, self.f_raw_length, self.f_checksum]

    def to_bytes(self, meta: dict[str, Any] | None = None) -> bytes:
        """The standalone index file, byte for byte what ``build(meta).to_bytes()`` gives."""
        parts = []
        for col in self._columns():
            if _BIG_ENDIAN and col.itemsize > 1:
                col = array(col.typecode, col)
                col.byteswap()
            parts.append((col.tobytes(), len(col)))
        return _index_bytes(list(self._names), self.checksum, bytes(self._keys), parts,
                            dict(meta or {}))

    def build(self, meta: dict[str, Any] | None = None) -> ShardIndex:
        cols = [np.frombuffer(c, dtype=_NATIVE[c.typecode]).astype(dt)
                for c, (_n, dt) in zip(self._columns(), _ARRAYS)]
        return ShardIndex(
            field_names=list(self._names),
            checksum=self.checksum,
            key_blob=bytes(self._keys),
            key_offsets=cols[0],
            sample_start=cols[1],
            f_name=cols[2],
            f_flags=cols[3],
            f_offset=cols[4],
            f_length=cols[5],
            f_raw_length=cols[6],
            f_checksum=cols[7],
            meta=dict(meta or {}),
        )


@dataclass
class WrittenShard:
    """What a writer reports once a shard and its index are published."""

    path: str
    index_path: str | None
    samples: int
    bytes: int
    digest: str
    index_digest: str
    stored_bytes: int
    raw_bytes: int
    fields: dict[str, int]


class ShardWriter:
    """Write one shard to a temp name; :meth:`close` publishes it atomically, :meth:`abort` drops it."""

    suffix = ""
    # ``add_files(samples, start, label_field, threads=1, delays=None) -> int``, when a writer
    # has it: read and add ``shardio._scan.Sample``s from ``start`` on (their files read by
    # ``threads`` threads), returning the first one left to :meth:`add`.
    add_files: Callable[..., int] | None = None

    def add(self, key: str, fields: Sequence[tuple[str, bytes]]) -> None:
        raise NotImplementedError

    def close(self, meta: dict[str, Any] | None = None) -> WrittenShard:
        raise NotImplementedError

    def abort(self) -> None:
        raise NotImplementedError


class ShardReader:
    """Random access to the samples of one shard, opened lazily (safe to pickle and fork).

    Stored bytes are read with ``pread`` on a descriptor opened lazily in each process;
    ``pread`` rather than ``mmap`` because a shard truncated under a live mapping kills the
    process with SIGBUS, while a short ``pread`` becomes a typed error.

    Args:
        path: shard file.
        index: its :class:`ShardIndex` (offsets absolute in the file).
        codec: decompression for fields stored compressed.
        verify: check the per-field checksum of every field read.
        expected_size: byte size the manifest records; a shorter file raises on open.
        ident: :func:`file_ident` of the file ``index`` was loaded from (None: the first file
            opened); a descriptor opened later on another file (the shard replaced) reads on
            only if that file's index, loaded with ``load_index``, is the same
            (:meth:`ShardIndex.same_layout`), else raises :class:`DatasetChangedError`.
        load_index: the format's index loader (``shardio.formats.index_loader``).
    """

    def __init__(self, path: str, index: ShardIndex, codec: Codec, verify: bool = True,
                 expected_size: int | None = None, *, read_block: int = 8 << 20,
                 on_read: Callable[[int], None] | None = None,
                 advice: int | None = None, ident: FileIdent | None = None,
                 load_index: Callable[[str], ShardIndex] | None = None) -> None:
        self.path = path
        self.index = index
        self.codec = codec
        self.verify = verify
        self.expected_size = expected_size
        self.read_block = read_block
        self.on_read = on_read
        self.advice = advice
        # The file ``index`` describes (None: the first one opened), and how to load the index of
        # another: a descriptor reopened after a fork, in another process or after close() may
        # meet a file packed again in place, which ``index`` must not be used to read.
        self.ident = ident
        self.load_index = load_index
        self._check = sample_checksum_fn(index.checksum)
        # Zero-copy reads (:mod:`shardio.sharedbytes`): spans are read into the arena's chunks
        # and large uncompressed fields are handed out as views of them.  Duck-typed here.
        self.arena: Any = None
        self._hfd: int | None = None
        self._hpid = -1
        self._mv: tuple[memoryview, ...] | None = None
        self._cidx: Any = None  # shardio._sampleio.Index (made with _mv), or None

    def __len__(self) -> int:
        return len(self.index)

    def open_fd(self) -> int | None:
        """This process's descriptor of the shard when it has opened it, else None."""
        return self._hfd if self._hpid == _PID[0] else None

    def _fd(self) -> int:
        if self._hfd is None or self._hpid != _PID[0]:
            try:
                fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError as exc:
                raise ShardNotFoundError(
                    f"shard {self.path} is missing; restore it or repack the dataset"
                ) from exc
            except OSError as exc:
                raise translate_oserror(exc, self.path, "opening shard") from exc
            st = os.fstat(fd)
            size = st.st_size
            try:
                self._check_same_file(file_ident(st))
            except BaseException:
                os.close(fd)
                raise
            if self.advice is not None:
                os.posix_fadvise(fd, 0, 0, self.advice)
            if self.expected_size is not None and size < self.expected_size:
                os.close(fd)
                raise ShardTruncatedError(
                    f"shard {self.path} has {size} bytes, the manifest records "
                    f"{self.expected_size}; it was truncated: restore it from a good copy"
                )
            self._hfd, self._hpid = fd, _PID[0]
        return self._hfd

    def _check_same_file(self, ident: FileIdent) -> None:
        """Check that the file just opened (``ident``) is one ``self.index`` reads: the file it
        was loaded from, or another whose own index says the same (a shard copied back over
        itself, restored from a replica).

        Raises:
            DatasetChangedError: the shard was replaced by another (packed again in place).
        """
        if self.ident is None or ident == self.ident:
            self.ident = ident
            return
        if self.load_index is None or not self.load_index(self.path).same_layout(self.index):
            raise DatasetChangedError(
                f"shard {self.path} was replaced since its index was loaded (the dataset was "
                "packed again in place?) and its new index differs: reading on through the old "
                "one would deliver wrong bytes; make a new reader/dataset (open_dataset, "
                "ShardDataset, ShardLoader) after repacking"
            )
        self.ident = ident

    def read_span(self, start: int, end: int) -> bytes:
        """Return shard bytes ``[start, end)``.

        Raises:
            ShardTruncatedError: the file ends before ``end``.
            ShardIOError: the read failed (EIO, ...).
        """
        n = end - start
        if n <= 0:
            return b""
        fd = self._fd()  # (its own typed error: a shard gone is missing, not an I/O error)
        try:
            data = pread_full(fd, n, start)
        except OSError as exc:
            raise translate_oserror(exc, self.path, f"reading offset {start} of") from exc
        self._after_read(start, n, len(data))
        return data

    def _after_read(self, start: int, n: int, got: int) -> None:
        if got < n:
            raise ShardTruncatedError(
                f"shard {self.path}: short read at offset {start} ({got} of {n} bytes); "
                "the shard is truncated: restore it from a good copy"
            )
        if self.on_read is not None:
            self.on_read(n)
        if _inject.ACTIVE:
            _inject.delay(self.path, n)

    def _span(self, start: int, end: int) -> tuple[Any, Any, int]:
        """Shard bytes ``[start, end)`` as ``(buffer, view or None, offset in view)``: with an
        arena, read straight into one of its chunks (one copy, no ``bytes`` object); fields are
        cut from the chunk's read-only ``view`` (:mod:`shardio.sharedbytes`)."""
        arena = self.arena
        if arena is None or end <= start:
            return self.read_span(start, end), None, 0
        n = end - start
        view, off, mv = arena.take(n)
        fd = self._hfd if self._hpid == _PID[0] and self._hfd is not None else self._fd()
        try:
            got = preadv_full(fd, mv, start)
        except OSError as exc:
            raise translate_oserror(exc, self.path, f"reading offset {start} of") from exc
        if got < n or _inject.ACTIVE:
            self._after_read(start, n, got)
        elif self.on_read is not None:
            self.on_read(n)
        return mv, view, off

    def willneed(self) -> None:
        """Ask the kernel to start reading the whole shard in the background
        (``POSIX_FADV_WILLNEED``): issued for the shards a reader will open next."""
        os.posix_fadvise(self._fd(), 0, 0, os.POSIX_FADV_WILLNEED)

    def close(self) -> None:
        """Release the descriptor (it reopens on next use)."""
        if self._hfd is not None and self._hpid == _PID[0]:
            os.close(self._hfd)
        self._hfd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _views(self) -> tuple[memoryview, ...]:
        """Scalar access to the index arrays through memoryviews (~4x cheaper than numpy
        scalars); the arrays stay numpy, only the views are cached."""
        if self._mv is None:
            idx = self.index
            lo, hi = idx.spans()
            arrays = [np.ascontiguousarray(a) for a in (
                idx.key_offsets, idx.sample_start, idx.f_name, idx.f_flags, idx.f_offset,
                idx.f_length, idx.f_raw_length, idx.f_checksum, lo, hi)]
            self._cidx = None
            if _SampleIndex is not None and not _BIG_ENDIAN:
                try:
                    self._cidx = _SampleIndex(bytes(idx.key_blob), *arrays[:6], *arrays[7:],
                                              tuple(idx.field_names))
                except (TypeError, ValueError):  # an index it cannot hold: the Python reads
                    self._cidx = None
            self._mv = tuple(memoryview(a) for a in arrays)
        return self._mv

    def _decode(self, i: int, base: int, buf: bytes | memoryview, view: Any = None,
                voff: int = 0) -> dict[str, Any]:
        """Sample ``i`` from shard bytes ``buf`` read at offset ``base`` (with an arena, ``buf``
        sits at ``voff`` of its chunk ``view``): checked, and cut into fields."""
        kof, sst, fname, fflags, foff, flen, fraw, fsum, _lo, _hi = self._views()
        cidx = self._cidx
        if cidx is not None:
            # shardio/_sampleio.c; anything else (a compressed field, a checksum that does not
            # match: the code below raises it with the key and field) goes on in Python.
            sample = cidx.cut(i, buf, base, view, voff,
                              self.arena.min_bytes if view is not None else 0,
                              self._check if self.verify else None)
            if type(sample) is dict:
                return sample
        return self._decode_py(i, base, buf, view, voff)

    def _decode_py(self, i: int, base: int, buf: bytes | memoryview, view: Any = None,
                   voff: int = 0) -> dict[str, Any]:
        """:meth:`_decode` in Python: every case, and the typed errors."""
        kof, sst, fname, fflags, foff, flen, fraw, fsum, _lo, _hi = self._views()
        idx = self.index
        key = idx.key_blob[kof[i] : kof[i + 1]].decode("utf-8")
        sample: dict[str, Any] = {"__key__": key}
        mv = buf if type(buf) is memoryview else memoryview(buf)
        names = idx.field_names
        check = self._check if self.verify else None
        # Fields at least this large are cut from the arena's view (never, without one).
        big = self.arena.min_bytes if view is not None else 1 << 62
        for r in range(sst[i], sst[i + 1]):
            off = foff[r] - base
            n = flen[r]
            stored = mv[off : off + n]
            name = names[fname[r]]
            if check is not None:
                found = check(stored)
                if found != fsum[r]:
                    raise ChecksumMismatchError(
                        self.path, key, name, foff[r], hex64(fsum[r]), hex64(found),
                    )
            flags = fflags[r]
            if flags:
                try:
                    sample[name] = self.codec.decode(stored, flags, fraw[r])
                except ManifestCorruptError:
                    if check is None:
                        # Unverified: check now.  Damaged bytes are the shard's fault (the
                        # ladder's business), not the compression settings'.
                        found = self._check(stored)
                        if found != fsum[r]:
                            raise ChecksumMismatchError(
                                self.path, key, name, foff[r], hex64(fsum[r]), hex64(found),
                            ) from None
                    raise
            elif n >= big:
                sample[name] = view[voff + off : voff + off + n]
            else:
                sample[name] = bytes(stored)
        return sample

    def get(self, i: int) -> dict[str, Any]:
        """Sample ``i`` with one ``pread`` and no bounds check (hot path of shuffled reads)."""
        cidx = self._cidx
        arena = self.arena
        if cidx is not None and not _inject.ACTIVE:
            # One read (shardio/_sampleio.c): without an arena each field straight into its
            # bytes, with one the whole span into the arena's room and big fields cut from its
            # view; None when anything is off, and then the code below reads it again and raises.
            fd = self._hfd if self._hpid == _PID[0] and self._hfd is not None else self._fd()
            check = self._check if self.verify else None
            if arena is None:
                sample = cidx.get(fd, i, check, self.on_read)
            else:
                v = self._views()
                lo, hi = v[8][i], v[9][i]
                sample = None
                if hi > lo:
                    view, voff, mv = arena.take(hi - lo)
                    sample = cidx.get_into(fd, i, mv, view, voff, arena.min_bytes, check,
                                           self.on_read)
                    del mv
            if type(sample) is dict:
                return sample
            if sample is not None:
                self._c_fault(i, sample)
        v = self._views()
        start = v[8][i]
        if self.arena is None:
            return self._decode(i, start, self.read_span(start, v[9][i]))
        return self._decode(i, start, *self._span(start, v[9][i]))

    def _c_fault(self, i: int, fault: tuple[Any, ...]) -> None:
        """Raise what the Python read raises for the fault ``_sampleio`` met reading sample ``i``."""
        start, end = self.index.span(i)
        if fault[0] == "io":
            exc = OSError(fault[1], os.strerror(fault[1]))
            raise translate_oserror(exc, self.path, f"reading offset {start} of") from exc
        if fault[0] == "short":
            self._after_read(start, end - start, fault[1])
            return  # (not short after all: the Python read tries again)
        row, found = fault[1], fault[2]
        idx = self.index
        raise ChecksumMismatchError(
            self.path, idx.key(i), idx.field_names[int(idx.f_name[row])], int(idx.f_offset[row]),
            hex64(int(idx.f_checksum[row])), hex64(found),
        )

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample ``i`` as ``{"__key__": key, field: bytes, ...}`` (``i`` taken as a list
        takes it: :func:`list_position`).

        Raises:
            TypeError, IndexError: as a list's.
            ChecksumMismatchError: a field failed its checksum.
            ShardTruncatedError, ShardIOError: the bytes could not be read.
        """
        i = list_position(i, len(self.index), f"shard {self.path}")
        start, end = self.index.span(i)
        return self._decode(i, start, *self._span(start, end))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Samples in shard order, read in large blocks rather than one read per sample."""
        return self.iter_range(0, len(self.index))

    def iter_range(self, first: int, stop: int, block: int | None = None
                   ) -> Iterator[dict[str, Any]]:
        """Samples ``first..stop-1`` in order, coalesced into reads that end at the next multiple
        of ``block`` (default ``read_block``, the stripe-aligned size on Lustre): so sequential
        reads are large and, after the first, aligned to the block."""
        block = block or self.read_block
        lo, hi = self.index.spans()
        i = first
        while i < stop:
            start, end = int(lo[i]), int(hi[i])
            limit = max(end, (start // block + 1) * block)
            j = i + 1
            while j < stop and lo[j] >= start and hi[j] <= limit:
                end = max(end, int(hi[j]))
                j += 1
            buf, view, voff = self._span(start, end)
            for k in range(i, j):
                yield self._decode(k, start, buf, view, voff)
            i = j

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.pop("_check", None)
        state["_hfd"], state["_hpid"], state["_mv"], state["_cidx"] = None, -1, None, None
        state["on_read"] = None  # a counter of the process that opened it
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._check = sample_checksum_fn(self.index.checksum)


@dataclass(frozen=True)
class Problem:
    """One finding of a verification pass, printed as one line by ``shardio verify``."""

    path: str
    what: str
    key: str | None = None
    field: str | None = None
    offset: int | None = None
    expected: str | None = None
    found: str | None = None

    def __str__(self) -> str:
        # One line per problem: a path with a newline (or other control character) is quoted.
        path = self.path if self.path.isprintable() else repr(self.path)
        parts = [f"{path}: {self.what}"]
        if self.key is not None:
            parts.append(f"key={self.key!r}")
        if self.field is not None:
            parts.append(f"field={self.field!r}")
        if self.offset is not None:
            parts.append(f"offset={self.offset}")
        if self.expected is not None or self.found is not None:
            parts.append(f"expected={self.expected} found={self.found}")
        return " ".join(parts)


def verify_fields(path: str, index: ShardIndex, block: int = 8 << 20) -> list[Problem]:
    """Recompute every field checksum of a shard against its index; return what is wrong.

    Reads in blocks of about ``block`` bytes.  Fields past the end of a truncated file are
    reported as ``truncated``.
    """
    check = sample_checksum_fn(index.checksum)
    problems: list[Problem] = []
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return [Problem(path, f"cannot open ({exc.strerror})")]
    try:
        size = os.fstat(fd).st_size
        lo, hi = index.spans()
        n = len(index)
        i = 0
        while i < n:
            start, end = int(lo[i]), int(hi[i])
            j = i + 1
            while j < n and lo[j] >= start and hi[j] - start <= block:
                end = max(end, int(hi[j]))
                j += 1
            try:
                buf = (pread_full(fd, max(0, min(end, size) - start), start) if start < size
                       else b"")
            except OSError as exc:
                problems.append(Problem(path, f"read error ({exc.strerror})", offset=start))
                buf = b""
            mv = memoryview(buf)
            for k in range(i, j):
                for r in index.rows(k):
                    off, ln = int(index.f_offset[r]), int(index.f_length[r])
                    name = index.field_names[int(index.f_name[r])]
                    if off + ln > start + len(buf):
                        problems.append(Problem(path, "truncated", index.key(k), name, off,
                                                f"{ln} bytes", f"{max(0, size - off)} bytes"))
                        continue
                    found = check(mv[off - start : off - start + ln])
                    if found != int(index.f_checksum[r]):
                        problems.append(Problem(path, "checksum mismatch", index.key(k), name, off,
                                                hex64(index.f_checksum[r]), hex64(found)))
            i = j
    finally:
        os.close(fd)
    return problems
