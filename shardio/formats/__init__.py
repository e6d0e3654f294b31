"""Shard formats.  ``tar`` (default, WebDataset-compatible) and ``hdf5`` (h5py-readable).

Each format provides a writer and an index loader; reading is shared (:class:`ShardReader`
``pread``s stored bytes at absolute offsets).  h5py is imported only when an HDF5 shard is touched.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from ..lustre import LayoutRequest

__all__ = [
    "FORMATS",
    "IndexBuilder",
    "Problem",
    "ShardIndex",
    "ShardReader",
    "ShardWriter",
    "WrittenShard",
    "check_format",
    "create_shard_file",
    "index_loader",
    "load_index",
    "open_writer",
    "shard_suffix",
    "verify_fields",
]

_SUFFIX = {"tar": ".tar", "hdf5": ".h5"}


def shard_suffix(fmt: str) -> str:
    return _SUFFIX[check_format(fmt)]


def open_writer(fmt: str, final: str, codec: Codec, checksum: str, fsync: bool = True,
                layout: LayoutRequest | None = None) -> ShardWriter:
    """A writer that publishes ``final`` (and its index) atomically on ``close()``.

    ``layout``: create the shard with this Lustre layout (delayed create, set, read back; see
    :func:`shardio.lustre.create_striped`); pass it only when the output is on Lustre.
    """
    if check_format(fmt) == "tar":
        from .tar import TarWriter

        return TarWriter(final, codec, checksum, fsync, layout)
    from .hdf5 import Hdf5Writer

    return Hdf5Writer(final, codec, checksum, fsync, layout)


def create_shard_file(path: str, layout: LayoutRequest | None) -> int:
    """Create ``path`` for writing (replacing a stale file of that name), with ``layout`` on
    Lustre; returns the descriptor."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if layout is not None:
        from ..lustre import create_striped

        return create_striped(path, layout)[0]
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)


def load_index(fmt: str, path: str) -> ShardIndex:
    """Load the index of the shard at ``path`` (offsets absolute in the file)."""
    return index_loader(fmt)(path)


def index_loader(fmt: str) -> Callable[[str], ShardIndex]:
    """The index-loading function of format ``fmt``, importing its module now: a reader calls
    it before DataLoader workers fork, so they inherit the import instead of each repeating it."""
    if check_format(fmt) == "tar":
        from .tar import load_tar_index

        return load_tar_index
    from .hdf5 import load_hdf5_index

    return load_hdf5_index
