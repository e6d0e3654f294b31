"""HDF5 shards, readable with plain h5py.

Layout (format version 1)::

    /                  attrs: shardio_format="shardio-hdf5", shardio_version=1,
                              checksum=<sample checksum name>, field_names=[...]
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
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from .._fsutil import tmp_name, translate_oserror
from ..checksum import file_digest, sample_checksum_fn
from ..codec import Codec
from ..errors import (
    IndexCorruptError,
    ManifestVersionError,
    MissingDependencyError,
    ShardNotFoundError,
)
from .base import IndexBuilder, ShardIndex, ShardWriter, WrittenShard

__all__ = ["Hdf5Writer", "load_hdf5_index"]

FORMAT_NAME = "shardio-hdf5"
FORMAT_VERSION = 1


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a core dependency
        raise MissingDependencyError("HDF5 shards need h5py: pip install h5py") from exc
    return h5py


class Hdf5Writer(ShardWriter):
    """Collect stored fields in memory (bounded by the shard size), write the file on close."""

    suffix = ".h5"

    def __init__(self, final: str, codec: Codec, checksum: str, fsync: bool = True) -> None:
        self.final = final
        self.codec = codec
        self.fsync = fsync
        self._tmp = tmp_name(final)
        self._check = sample_checksum_fn(checksum)
        self._index = IndexBuilder(checksum)
        self._payload = bytearray()
        self._fields: dict[str, int] = {}
        self._raw = 0

    def add(self, key: str, fields: Sequence[tuple[str, bytes]]) -> None:
        self._index.add_sample(key)
        for name, data in fields:
            stored, flags = self.codec.encode(data)
            self._index.add_field(
                name, flags, len(self._payload), len(stored), len(data), self._check(stored)
            )
            self._payload += stored
            self._fields[name] = self._fields.get(name, 0) + 1
            self._raw += len(data)

    def close(self, meta: dict[str, Any] | None = None) -> WrittenShard:
        h5py = _h5py()
        index = self._index.build(meta)
        try:
            with h5py.File(self._tmp, "w", libver=("earliest", "v110"), track_order=False) as f:
                f.attrs["shardio_format"] = FORMAT_NAME
                f.attrs["shardio_version"] = FORMAT_VERSION
                f.attrs["checksum"] = index.checksum
                f.attrs["field_names"] = np.array(index.field_names, dtype=h5py.string_dtype())
                f.attrs["shardio_meta"] = json.dumps(index.meta, sort_keys=True)
                f.create_dataset(
                    "payload", data=np.frombuffer(bytes(self._payload), dtype=np.uint8),
                    track_times=False,
                )
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
            digest, size = file_digest(self._tmp)
            os.replace(self._tmp, self.final)
        except OSError as exc:
            self.abort()
            raise translate_oserror(exc, self.final, "writing shard") from exc
        except BaseException:
            self.abort()
            raise
        self._payload = bytearray()
        return WrittenShard(
            path=self.final, index_path=None, samples=len(index), bytes=size, digest=digest,
            index_digest="", stored_bytes=index.stored_bytes, raw_bytes=self._raw,
            fields=dict(self._fields),
        )

    def abort(self) -> None:
        try:
            os.unlink(self._tmp)
        except FileNotFoundError:
            pass


def load_hdf5_index(path: str) -> ShardIndex:
    """Load the index of an HDF5 shard, with ``f_offset`` made absolute file offsets.

    Raises:
        ShardNotFoundError: no such file.
        IndexCorruptError: not a shardio HDF5 shard, or its index is damaged.
        ManifestVersionError: written by a newer shardio.
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
                raise ManifestVersionError(
                    f"{path} has HDF5 shard version {version}, newer than this shardio reads "
                    f"({FORMAT_VERSION}); upgrade shardio: pip install -U shardio"
                )
            payload = f["payload"]
            base = payload.id.get_offset()
            g = f["index"]
            arrays = {name: np.asarray(g[name][()]) for name in
                      ("key_offsets", "sample_start", "f_name", "f_flags", "f_offset",
                       "f_length", "f_raw_length", "f_checksum")}
            key_blob = np.asarray(g["key_blob"][()], dtype=np.uint8).tobytes()
            names = [n.decode() if isinstance(n, bytes) else str(n) for n in f.attrs["field_names"]]
            meta = json.loads(f.attrs.get("shardio_meta", "{}"))
            checksum = f.attrs["checksum"]
            checksum = checksum.decode() if isinstance(checksum, bytes) else str(checksum)
    except (OSError, KeyError, ValueError) as exc:
        raise IndexCorruptError(
            f"cannot read the index of HDF5 shard {path} ({exc}); the file is damaged: restore it "
            "from a good copy or repack"
        ) from exc
    arrays["f_offset"] = arrays["f_offset"].astype("<u8") + np.uint64(base or 0)
    return ShardIndex(
        field_names=names, checksum=checksum, key_blob=key_blob, meta=meta, **arrays
    )
