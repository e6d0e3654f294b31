"""Random access to a packed dataset: global sample index → shard → ``pread`` at the indexed offset."""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np

from ._fsutil import resolve_in
from .checksum import digest_bytes
from .codec import Codec
from .errors import ManifestCorruptError, ShardNotFoundError, ShardTruncatedError
from .formats import ShardIndex, ShardReader, load_index
from .manifest import Manifest

__all__ = ["DatasetReader", "open_dataset"]


def load_codec(root: str, manifest: Manifest) -> Codec:
    """The codec a dataset was packed with, its zstd dictionary loaded and checked.

    Raises:
        ManifestCorruptError: the dictionary file is missing or does not match its digest.
    """
    comp = manifest.compression
    if not comp:
        return Codec()
    dictionary = None
    if comp.get("dictionary"):
        path = resolve_in(root, comp["dictionary"])
        try:
            with open(path, "rb") as f:
                dictionary = f.read()
        except FileNotFoundError as exc:
            raise ManifestCorruptError(
                f"zstd dictionary {path} named by the manifest is missing; restore it or repack"
            ) from exc
        if digest_bytes(dictionary) != comp.get("dictionary_digest"):
            raise ManifestCorruptError(
                f"zstd dictionary {path} does not match the manifest's digest; restore it or repack"
            )
    return Codec(comp.get("codec"), int(comp.get("level", 3)), dictionary)


class DatasetReader:
    """Read samples of a shardio dataset by global index or shard by shard.

    Indexes load lazily, one per shard touched, and are kept as numpy arrays.  The object pickles
    without open descriptors, so it can be handed to worker processes.

    Args:
        root: dataset directory (holding ``manifest.json``).
        verify: check each field's checksum on read.
    """

    def __init__(self, root: str | os.PathLike[str], *, verify: bool = True,
                 max_open_shards: int = 64) -> None:
        self.root = os.fspath(root)
        self.max_open_shards = max_open_shards
        self.manifest = Manifest.load(self.root)
        self.verify = verify
        self.codec = load_codec(self.root, self.manifest)
        counts = np.array([s.samples for s in self.manifest.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self._readers: OrderedDict[int, ShardReader] = OrderedDict()

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def shard_path(self, i: int) -> str:
        return resolve_in(self.root, self.manifest.shards[i].path)

    def shard_index(self, i: int) -> ShardIndex:
        return self.shard(i).index

    def shard(self, i: int) -> ShardReader:
        """Reader for shard ``i`` (cached).

        Raises:
            ShardNotFoundError, ShardTruncatedError, IndexCorruptError: the shard is unusable.
        """
        reader = self._readers.get(i)
        if reader is not None:
            self._readers.move_to_end(i)
        else:
            entry = self.manifest.shards[i]
            path = self.shard_path(i)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError as exc:
                raise ShardNotFoundError(
                    f"shard {path} listed in the manifest is missing; restore it from a copy or "
                    "repack the dataset"
                ) from exc
            if size < entry.bytes:
                raise ShardTruncatedError(
                    f"shard {path} has {size} bytes, the manifest records {entry.bytes}; it was "
                    "truncated: restore it from a good copy"
                )
            index = load_index(self.manifest.shard_format, path)
            if len(index) != entry.samples:
                raise ManifestCorruptError(
                    f"shard {path} indexes {len(index)} samples, the manifest says "
                    f"{entry.samples}; the manifest and shard disagree: run `shardio verify`"
                )
            reader = ShardReader(path, index, self.codec, self.verify, entry.bytes)
            self._readers[i] = reader
            while len(self._readers) > self.max_open_shards:
                self._readers.popitem(last=False)[1].close()
        return reader

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard, position in shard)`` of global sample ``i``."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sample {i} out of range ({n} samples)")
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return s, i - int(self.offsets[s])

    def __getitem__(self, i: int) -> dict[str, Any]:
        s, j = self.locate(i)
        return self.shard(s)[j]

    def read_ids(self, ids: np.ndarray) -> Iterator[dict[str, Any]]:
        """Samples with global ids ``ids``, in that order; runs of consecutive ids in one shard
        are read with one large ``pread``, single ids with one small one."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return
        shards = np.searchsorted(self.offsets, ids, side="right") - 1
        local = (ids - self.offsets[shards]).tolist()
        shard_list = shards.tolist()
        if len(ids) > 1:
            step = np.diff(ids)
            cut = ((step != 1) | (np.diff(shards) != 0)).tolist()
        else:
            cut = []
        n = len(local)
        k = 0
        while k < n:
            j = k
            while j < n - 1 and not cut[j]:
                j += 1
            reader = self.shard(shard_list[k])
            if j == k:
                yield reader.get(local[k])
            else:
                yield from reader.iter_range(local[k], local[j] + 1)
            k = j + 1

    def iter_shard(self, i: int) -> Iterator[dict[str, Any]]:
        return iter(self.shard(i))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in range(self.num_shards):
            yield from self.iter_shard(s)

    def close(self) -> None:
        for r in self._readers.values():
            r.close()
        self._readers.clear()

    def __enter__(self) -> DatasetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_readers"] = OrderedDict()
        return state


def open_dataset(root: str | os.PathLike[str], *, verify: bool = True,
                 max_open_shards: int = 64) -> DatasetReader:
    """Open a packed dataset for random access; see :class:`DatasetReader`."""
    return DatasetReader(root, verify=verify, max_open_shards=max_open_shards)
