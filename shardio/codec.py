"""Per-field compression: optional zstd, with an optional dictionary trained on the dataset.

A field is stored compressed only when that makes it smaller, so already-compressed payloads
(JPEG, PNG) cost nothing.  The index records per field whether it is compressed (flag bit 0).
zstd objects are created lazily per process, so a ``Codec`` survives ``fork`` and pickling.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ManifestCorruptError, MissingDependencyError, UsageError

__all__ = ["FLAG_ZSTD", "Codec", "parse_compress", "train_dictionary"]

FLAG_ZSTD = 1


def _zstd() -> Any:
    try:
        import zstandard
    except ImportError as exc:  # pragma: no cover - zstandard is a core dependency
        raise MissingDependencyError("zstd compression needs: pip install zstandard") from exc
    return zstandard


def parse_compress(text: str | None) -> tuple[str | None, int]:
    """Parse ``--compress``: ``none``, ``zstd`` or ``zstd:LEVEL`` (1..22)."""
    if text is None or text in ("", "none"):
        return None, 0
    m = re.fullmatch(r"zstd(?::(-?\d+))?", text)
    if not m:
        raise UsageError(f"invalid --compress {text!r}; use none, zstd or zstd:LEVEL (1-22)")
    level = int(m.group(1) or 3)
    if not 1 <= level <= 22:
        raise UsageError(f"zstd level {level} out of range; choose 1 to 22")
    return "zstd", level


def train_dictionary(samples: list[bytes], dict_size: int = 112 * 1024, level: int = 3) -> bytes:
    """Train a zstd dictionary on ``samples`` (deterministic for the same input).

    Raises:
        UsageError: too few or too small samples to train on.
    """
    zstd = _zstd()
    try:
        d = zstd.train_dictionary(dict_size, samples, level=level, threads=0)
    except zstd.ZstdError as exc:
        raise UsageError(
            f"could not train a zstd dictionary on {len(samples)} samples ({exc}); the dataset is "
            "too small or its samples too large for a dictionary: drop --zstd-dict"
        ) from exc
    return d.as_bytes()  # type: ignore[no-any-return]


@dataclass
class Codec:
    """Compress and decompress field payloads.

    Args:
        name: ``None`` (store raw) or ``"zstd"``.
        level: zstd level.
        dictionary: raw zstd dictionary bytes, or ``None``.
    """

    name: str | None = None
    level: int = 3
    dictionary: bytes | None = None
    _pid: int = field(default=-1, repr=False, compare=False)
    _c: Any = field(default=None, repr=False, compare=False)
    _d: Any = field(default=None, repr=False, compare=False)

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level, "dictionary": self.dictionary}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def _ensure(self) -> None:
        if self._pid != os.getpid():
            self._c = None  # made by the first encode: a reader never needs one
            self._d = _zstd().ZstdDecompressor(dict_data=self._zstd_dict())
            self._pid = os.getpid()

    def _zstd_dict(self) -> Any:
        return _zstd().ZstdCompressionDict(self.dictionary) if self.dictionary else None

    def encode(self, data: bytes) -> tuple[bytes, int]:
        """Return ``(stored_bytes, flags)``; raw when compression would not shrink the field."""
        if self.name is None or not data:
            return data, 0
        self._ensure()
        if self._c is None:
            # write_checksum off: shardio checksums every stored field itself.
            self._c = _zstd().ZstdCompressor(level=self.level, dict_data=self._zstd_dict(),
                                             write_content_size=True)
        packed = self._c.compress(data)
        if len(packed) < len(data):
            return packed, FLAG_ZSTD
        return data, 0

    def decode(self, stored: bytes | memoryview, flags: int, raw_length: int) -> bytes:
        """Undo :meth:`encode`.

        Raises:
            ManifestCorruptError: the field (whose stored bytes passed their checksum) does not
                decode to its ``raw_length`` bytes with this codec: the dataset's compression
                settings or zstd dictionary are not the ones it was packed with.
        """
        if not flags & FLAG_ZSTD:
            return stored if isinstance(stored, bytes) else bytes(stored)
        self._ensure()
        zstd = _zstd()
        try:
            # A frame's header says how large it decompresses (-1: unknown, then the bound
            # is raw_length); decompress() allocates that much before it reads a block, so a
            # damaged header (readers with verify=False) raised MemoryError, not this error.
            size = zstd.frame_content_size(stored)
            if size not in (-1, raw_length):
                raise self._mismatch(f"its frame header says {size} bytes, not {raw_length}")
            out = self._d.decompress(stored, max_output_size=raw_length)
        except zstd.ZstdError as exc:
            raise self._mismatch(str(exc)) from exc
        if len(out) != raw_length:
            raise self._mismatch(f"{len(out)} bytes, not {raw_length}")
        return out  # type: ignore[no-any-return]

    def _mismatch(self, why: str) -> ManifestCorruptError:
        return ManifestCorruptError(
            f"a zstd field does not decode ({why}) with the dataset's compression settings "
            f"({self.name}, {'a' if self.dictionary else 'no'} dictionary): the manifest's "
            "compression section or the dictionary file is not the one the shards were packed "
            "with; restore them from a good copy of the dataset")
