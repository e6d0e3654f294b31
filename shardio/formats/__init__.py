"""Shard formats.  ``tar`` (default, WebDataset-compatible) and ``hdf5`` (h5py-readable).

Each format provides a writer and an index loader; reading is shared (:class:`ShardReader`
``pread``s stored bytes at absolute offsets).  h5py is imported only when an HDF5 shard is touched.
"""

from __future__ import annotations

from ..codec import Codec
from ..config import FORMATS, check_format
from .base import (
    IndexBuilder,
    Problem,
    ShardIndex,
    ShardReader,
    ShardWriter,
    WrittenShard,
    verify_fields,
)

__all__ = [
    "FORMATS",
    "IndexBuilder",
    "Problem",
    "ShardIndex",
    "ShardReader",
    "ShardWriter",
    "WrittenShard",
    "check_format",
    "load_index",
    "open_writer",
    "shard_suffix",
    "verify_fields",
]

_SUFFIX = {"tar": ".tar", "hdf5": ".h5"}


def shard_suffix(fmt: str) -> str:
    return _SUFFIX[check_format(fmt)]


def open_writer(fmt: str, final: str, codec: Codec, checksum: str, fsync: bool = True) -> ShardWriter:
    """A writer that publishes ``final`` (and its index) atomically on ``close()``."""
    if check_format(fmt) == "tar":
        from .tar import TarWriter

        return TarWriter(final, codec, checksum, fsync)
    from .hdf5 import Hdf5Writer

    return Hdf5Writer(final, codec, checksum, fsync)


def load_index(fmt: str, path: str) -> ShardIndex:
    """Load the index of the shard at ``path`` (offsets absolute in the file)."""
    if check_format(fmt) == "tar":
        from .tar import load_tar_index

        return load_tar_index(path)
    from .hdf5 import load_hdf5_index

    return load_hdf5_index(path)
