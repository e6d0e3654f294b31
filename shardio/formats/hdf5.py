"""HDF5 shards, readable with plain h5py.

Layout (format version 1)::

    /                  attrs: shardio_format="shardio-hdf5", shardio_version=1,
                              checksum=<sample checksum name>, field_names=[...],
                              shardio_meta=<JSON>, index_digest=<xxh3_64 hex>
    /payload           uint8[total]  contiguous: every stored field, concatenated in sample order
    /index/key_blob    uint8         UTF-8 keys, concatenated
    /index/key_offsets uint64[n+1]   key i = key_blob[key_offsets[i]:key_offsets[i+1]]
    /index/sample_start uint64[n+1]  sample i owns field rows sample_start[i]:sample_start[i+1]
    /index/f_name, f_flags, f_offset, f_length, f_raw_length, f_checksum   (one row per field)

``f_offset`` is relative to ``/payload``: with plain h5py,
``f["payload"][off:off+length]`` is a field's stored bytes (zstd-compressed when ``f_flags & 1``).
Because ``/payload`` is contiguous, shardio reads fields with ``pread`` at the payload's file
offset and uses h5py only to load the index, so readers hold no HDF5 handle across ``fork``.
h5py is imported only here.

The per-field checksums cover stored bytes only, so the index checks itself, as a tar shard's
``.idx`` does: ``index_digest`` is an xxh3_64 over everything a reader takes from the index
(checksum name, ``json.dumps(field_names)``, meta, ``key_blob`` and every ``/index`` array as
stored, in the index model's little-endian dtypes, each part prefixed by its u64 byte length),
and on load the index must also hold together (offsets monotonic and inside ``/payload``, names
and flags known, raw lengths that fit the flags, keys valid UTF-8).  A shard written before
``index_digest`` existed gets the structural checks only.  Either failure raises
:class:`IndexCorruptError`, so the reader fails over to another copy instead of delivering a
wrong key or field.
"""

from __future__ import annotations

import errno
import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from .._fsutil import tmp_name, translate_oserror
from ..checksum import file_digest, new_digest, sample_checksum_fn
from ..codec import Codec
from ..errors import (
    IndexCorruptError,
    MissingDependencyError,
    ShardioError,
    ShardNotFoundError,
)
from .base import (
    _ARRAYS,
    IndexBuilder,
    ShardIndex,
    ShardWriter,
    WrittenShard,
    structure_problem,
)

try:  # the C read loop of a pack (shardio/_tarpack.c, headers=False); Hdf5Writer.add is the reference
    from .._tarpack import fill as _fill
except ImportError:  # pragma: no cover - built with the package on Linux
    _fill = None

__all__ = ["Hdf5Writer", "load_hdf5_index"]

FORMAT_NAME = "shardio-hdf5"
FORMAT_VERSION = 1
INDEX_DIGEST = "xxh3_64"  # algorithm of the ``index_digest`` attribute


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a core dependency
        raise MissingDependencyError("HDF5 shards need h5py: pip install h5py") from exc
    return h5py


# A payload buffer kept between the shards one process writes: a fresh buffer per shard costs a
# page fault per 4 KiB (the kernel zeroes each page) and an unmap when it is freed, about a fifth
# of an HDF5 pack's time.  The packer drops it at the end (release_buffers).
_SPARE: list[bytearray] = []
# Bytes add_files reads per call into the C loop (it releases the GIL while it reads them).
_FILL = 4 << 20


def release_buffers() -> None:
    """Free the payload buffer kept for the next shard."""
    _SPARE.clear()


class Hdf5Writer(ShardWriter):
    """Collect stored fields in memory (bounded by the shard size), write the file on close."""

    suffix = ".h5"

    def __init__(self, final: str, codec: Codec, checksum: str, fsync: bool = True,
                 layout: Any = None) -> None:
        self.final = final
        self.layout = layout
        self.codec = codec
        self.fsync = fsync
        self._tmp = tmp_name(final)
        self._check = sample_checksum_fn(checksum)
        self._index = IndexBuilder(checksum)
        # The payload is _buf[:_used]; _buf is reused from the previous shard when there is one.
        self._buf = _SPARE.pop() if _SPARE else bytearray()
        self._used = 0
        if _fill is not None and codec.name is None:
            self.add_files = self._add_files

    def add(self, key: str, fields: Sequence[tuple[str, bytes]]) -> None:
        index, check, used, put = self._index, self._check, self._used, self._put
        encode = self.codec.encode if self.codec.name is not None else None
        index.add_sample(key)
        for name, data in fields:
            if encode is None:
                stored, flags = data, 0
            else:
                stored, flags = encode(data)
            end = put(used, stored)
            index.add_field(name, flags, used, len(stored), len(data), check(stored))
            used = end
        self._used = used

    def _add_files(self, samples: list[Any], start: int, label_field: str, threads: int = 1,
                   delays: Any = None) -> int:
        """Read and add samples ``samples[start:]`` (:class:`shardio._scan.Sample`) in C
        (``threads`` and ``delays`` as for ``TarWriter.add_files``).

        Returns the index of the first sample not added: ``len(samples)``, or a sample the C
        code leaves to the caller (see shardio/_tarpack.c: non-ASCII names, a file it cannot
        read or that grew, ...), which must then go through :meth:`add`.  The payload and the
        index rows are exactly what :meth:`add` collects for the same samples.  The C code reads
        straight into the payload buffer where a recycled one has room; otherwise into a new
        ``bytes`` (uninitialised, unlike a bytearray grown by hand), appended as :meth:`add`
        appends.
        """
        index = self._index
        n = len(samples)
        while start < n:
            used = self._used
            if len(self._buf) - used > _FILL:
                with memoryview(self._buf) as whole, whole[used:] as out:
                    result = _fill(samples, start, index._names, label_field, self._check, used,
                                   len(index._keys), len(index.f_name), _FILL, out, False,
                                   threads, delays)
            else:
                result = _fill(samples, start, index._names, label_field, self._check, used,
                               len(index._keys), len(index.f_name), _FILL, None, False, threads,
                               delays)
            (start, slow, length, data, keys, key_offsets, starts, name_ids, offsets, lengths,
             checksums) = result
            index.add_columns(keys, key_offsets, starts, name_ids, offsets, lengths, checksums)
            self._used = used + length if data is None else self._put(used, data)
            if slow:
                break
        return start

    def _put(self, used: int, data: Any) -> int:
        """Place ``data`` at ``used`` in the payload buffer; returns the end of it."""
        end = used + len(data)
        buf = self._buf
        if end <= len(buf):  # room left in a recycled buffer: overwrite in place
            buf[used:end] = data
        else:  # append: the buffer grows by realloc (mremap: no copy, no re-fault)
            if used < len(buf):
                buf = self._truncate(used)
            buf += data
        return end

    def _truncate(self, used: int) -> bytearray:
        """Drop the stale tail of a recycled buffer, keeping the first ``used`` bytes."""
        try:
            del self._buf[used:]
        except BufferError:  # still viewed (by an array from a failed close): start a new one
            self._buf = bytearray(memoryview(self._buf)[:used])
        return self._buf

    def _recycle(self) -> None:
        buf, self._buf, self._used = self._buf, bytearray(), 0
        if len(buf) and (not _SPARE or len(_SPARE[0]) < len(buf)):
            _SPARE[:] = [buf]

    def close(self, meta: dict[str, Any] | None = None) -> WrittenShard:
        h5py = _h5py()
        index = self._index.build(meta)
        try:
            if self.layout is not None:
                # Create it empty with its Lustre layout first; h5py's truncating open keeps it.
                from . import create_shard_file

                os.close(create_shard_file(self._tmp, self.layout))
            with h5py.File(self._tmp, "w", libver=("earliest", "v110"), track_order=False) as f:
                f.attrs["shardio_format"] = FORMAT_NAME
                f.attrs["shardio_version"] = FORMAT_VERSION
                f.attrs["checksum"] = index.checksum
                f.attrs["field_names"] = np.array(index.field_names, dtype=h5py.string_dtype())
                meta_text = json.dumps(index.meta, sort_keys=True)
                f.attrs["shardio_meta"] = meta_text
                index_digest = _index_digest(
                    index.checksum, index.field_names, meta_text, index.key_blob, index.arrays()
                )
                f.attrs["index_digest"] = index_digest
                # A view of the payload, not a copy: h5py writes straight from it.
                view = np.frombuffer(self._buf, dtype=np.uint8, count=self._used)
                payload = f.create_dataset("payload", data=view, track_times=False)
                del view
                payload_offset = payload.id.get_offset()
                g = f.create_group("index", track_order=False)
                g.create_dataset(
                    "key_blob", data=np.frombuffer(index.key_blob, dtype=np.uint8),
                    track_times=False,
                )
                for name, arr in index.arrays().items():
                    g.create_dataset(name, data=arr, track_times=False)
            if self.fsync:
                fd = os.open(self._tmp, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            digest, size = self._digest(payload_offset)
            os.replace(self._tmp, self.final)
        except OSError as exc:
            self.abort()
            raise translate_oserror(exc, self.final, "writing shard") from exc
        except BaseException:
            self.abort()
            raise
        self._recycle()
        return WrittenShard(
            path=self.final, index_path=None, samples=len(index), bytes=size, digest=digest,
            index_digest=index_digest, stored_bytes=index.stored_bytes, raw_bytes=index.raw_bytes,
            fields=self._index.field_counts(),
        )

    def _digest(self, payload_offset: int | None) -> tuple[str, int]:
        """``file_digest`` of the written file, hashing the payload from memory: the file is
        read back only around it (the few KiB of HDF5 metadata), not the whole shard."""
        n = self._used
        if not n or payload_offset is None:
            return file_digest(self._tmp)
        h = new_digest()
        with open(self._tmp, "rb", buffering=0) as f:
            size = os.fstat(f.fileno()).st_size
            if payload_offset + n > size:
                return file_digest(self._tmp)
            head = os.pread(f.fileno(), payload_offset, 0)
            tail = os.pread(f.fileno(), size - payload_offset - n, payload_offset + n)
        if len(head) != payload_offset or len(head) + n + len(tail) != size:
            return file_digest(self._tmp)
        h.update(head)
        h.update(memoryview(self._buf)[:n])
        h.update(tail)
        return h.hexdigest(), size

    def abort(self) -> None:
        self._recycle()
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


def _index_digest(checksum: str, names: Sequence[str], meta_text: str, key_blob: bytes,
                  arrays: Mapping[str, np.ndarray]) -> str:
    """The ``index_digest`` attribute: xxh3_64 over everything a reader takes from the index,
    arrays as their little-endian values (``f_offset`` relative to ``/payload``)."""
    h = new_digest(INDEX_DIGEST)
    parts = [checksum.encode(), json.dumps(list(names)).encode(), meta_text.encode(), key_blob]
    parts += [np.ascontiguousarray(arrays[name], dtype=dt).tobytes() for name, dt in _ARRAYS]
    for part in parts:
        h.update(struct.pack("<Q", len(part)))
        h.update(part)
    return h.hexdigest()


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def load_hdf5_index(path: str) -> ShardIndex:
    """Load the index of an HDF5 shard, with ``f_offset`` made absolute file offsets.

    Raises:
        ShardNotFoundError: no such file.
        ShardIOError: the storage failed a read of its metadata (EIO, ...).
        IndexCorruptError: not a shardio HDF5 shard, or its index is damaged (unreadable, failing
            ``index_digest``, or inconsistent), or it claims a layout newer than this shardio.
    """
    h5py = _h5py()
    if not os.path.exists(path):
        raise ShardNotFoundError(f"shard {path} is missing; restore it or repack the dataset")
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("shardio_format") != FORMAT_NAME:
                raise IndexCorruptError(f"{path} is not a shardio HDF5 shard (no format attribute)")
            version = int(f.attrs.get("shardio_version", 0))
            if version > FORMAT_VERSION:
                # The dataset's manifest (checked against its own digest, and not newer than
                # this shardio) says which shardio wrote its shards: a shard claiming a newer
                # layout is damaged (a flipped bit in the attribute), a fault the reader meets
                # by reading another copy, not a reason to stop.
                raise IndexCorruptError(
                    f"{path} says HDF5 shard version {version}, newer than this shardio reads "
                    f"({FORMAT_VERSION}): the attribute is damaged (restore the shard from a "
                    "good copy), or a newer shardio wrote it (upgrade shardio)")
            payload = f["payload"]
            base = payload.id.get_offset()
            payload_len = int(payload.size)
            if (base is None and payload_len) or payload.dtype.itemsize != 1 or (
                    payload.ndim != 1) or payload.external:
                # Fields are read by file offset: a payload rewritten in chunks (h5repack -l
                # CHUNK, or with a filter), stored elsewhere or of wider items has none.
                raise IndexCorruptError(
                    f"the /payload of HDF5 shard {path} is not one contiguous byte array in the "
                    "file (chunked, filtered or external: rewritten by h5repack?), so its fields "
                    "cannot be read by offset; restore the shard as shardio wrote it, or repack")
            g = f["index"]
            # Cast to the index model's dtypes: a damaged HDF5 type message changes the values
            # read (which index_digest then catches), never the dtypes the reader works with.
            arrays = {name: np.asarray(g[name][()]).astype(dt, copy=False)
                      for name, dt in _ARRAYS}
            key_blob = np.asarray(g["key_blob"][()], dtype=np.uint8).tobytes()
            names = [_text(n) for n in f.attrs["field_names"]]
            meta_text = _text(f.attrs.get("shardio_meta", "{}"))
            meta = json.loads(meta_text)
            if not isinstance(meta, dict):
                raise TypeError("shardio_meta is not a JSON object")
            checksum = _text(f.attrs["checksum"])
            stored_digest = f.attrs.get("index_digest")
            # (h5py hands out text that is not UTF-8 with surrogate escapes, which encoding it
            # for the digest refuses: damaged metadata too, not a UnicodeEncodeError to raise)
            found = _index_digest(checksum, names, meta_text, key_blob, arrays)
    except ShardioError:
        raise
    except OSError as exc:
        if exc.errno is None:  # (h5py's damaged metadata: an OSError without errno)
            raise IndexCorruptError(
                f"cannot read the index of HDF5 shard {path} ({exc}); the file is damaged: "
                "restore it from a good copy or repack") from exc
        if exc.errno == errno.ENOENT:
            raise ShardNotFoundError(
                f"shard {path} is missing; restore it or repack the dataset") from exc
        # The storage failed a read (EIO, ...): an I/O error, not a damaged index.
        raise translate_oserror(
            OSError(exc.errno, os.strerror(exc.errno)), path, "reading the index of HDF5 shard"
        ) from exc
    except Exception as exc:  # h5py raises anything on damaged metadata (AttributeError, ...)
        raise IndexCorruptError(
            f"cannot read the index of HDF5 shard {path} ({exc}); the file is damaged: restore it "
            "from a good copy or repack"
        ) from exc
    problem = None
    if stored_digest is not None:  # absent in shards written before it existed
        if _text(stored_digest) != found:
            problem = f"index_digest mismatch: expected {_text(stored_digest)}, found {found}"
    problem = problem or structure_problem(names, payload_len, key_blob, arrays)
    if problem is not None:
        raise IndexCorruptError(
            f"the index of HDF5 shard {path} is corrupt ({problem}); restore the shard from a "
            "good copy (`shardio verify` lists the damaged ones) or repack"
        )
    arrays["f_offset"] = arrays["f_offset"] + np.uint64(base or 0)
    return ShardIndex(
        field_names=names, checksum=checksum, key_blob=key_blob, meta=meta, **arrays,
        digest="" if stored_digest is None else _text(stored_digest),
    )
