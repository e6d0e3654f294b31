"""Checksum registry: a fast per-sample checksum and a streaming per-shard digest.

The per-sample checksum is stored as an unsigned 64-bit integer in every shard index; the name of
the algorithm is stored in the manifest and the index so a reader never guesses.  ``xxh3_64`` is
the default: it runs at memory bandwidth (tens of GB/s), far above ``zlib.crc32``.  The shard
digest is ``xxh3_128`` over the whole file, kept as hex in the manifest.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Protocol

import xxhash

from ._fsutil import open_regular
from .errors import UsageError

__all__ = [
    "DEFAULT_DIGEST",
    "DEFAULT_SAMPLE",
    "StreamHasher",
    "digest_bytes",
    "file_digest",
    "new_digest",
    "sample_checksum_fn",
]

DEFAULT_SAMPLE = "xxh3_64"
DEFAULT_DIGEST = "xxh3_128"
SAMPLE_ALGORITHMS = ("xxh3_64", "crc32", "crc32c")  # what _sample_registry knows
DIGEST_ALGORITHMS = ("xxh3_128", "xxh3_64")  # what new_digest knows


def _crc32c() -> Callable[[bytes], int]:
    try:
        import crc32c  # type: ignore[import-not-found]
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from .errors import MissingDependencyError

        raise MissingDependencyError(
            "checksum 'crc32c' needs the crc32c package: pip install crc32c (or use xxh3_64)"
        ) from exc
    return crc32c.crc32c  # type: ignore[no-any-return]


def _sample_registry(name: str) -> Callable[[bytes], int]:
    if name == "xxh3_64":
        return xxhash.xxh3_64_intdigest
    if name == "crc32":
        return zlib.crc32
    if name == "crc32c":
        return _crc32c()
    raise UsageError(f"unknown sample checksum {name!r}; choose one of xxh3_64, crc32, crc32c")


def sample_checksum_fn(name: str = DEFAULT_SAMPLE) -> Callable[[bytes], int]:
    """Return the function mapping a bytes-like object to its integer checksum.

    Raises:
        UsageError: unknown algorithm name.
        MissingDependencyError: the algorithm needs a package that is not installed.
    """
    return _sample_registry(name)


class StreamHasher(Protocol):
    def update(self, data: bytes | memoryview, /) -> None: ...
    def hexdigest(self) -> str: ...


def new_digest(name: str = DEFAULT_DIGEST) -> StreamHasher:
    """Return a fresh streaming hasher for shard digests."""
    if name == "xxh3_128":
        return xxhash.xxh3_128()
    if name == "xxh3_64":
        return xxhash.xxh3_64()
    raise UsageError(f"unknown shard digest {name!r}; choose xxh3_128 or xxh3_64")


def digest_bytes(data: bytes | memoryview, name: str = DEFAULT_DIGEST) -> str:
    """Hex digest of an in-memory buffer."""
    h = new_digest(name)
    h.update(data)
    return h.hexdigest()


def file_digest(path: str, name: str = DEFAULT_DIGEST, block: int = 8 << 20) -> tuple[str, int]:
    """Stream a file through the digest; return ``(hexdigest, bytes_read)``.

    Raises OSError from the read unchanged; callers translate it with the shard path at hand.
    Something other than a regular file (a FIFO, whose open would wait for a writer for ever;
    a device) is an OSError too (``EINVAL``).
    """
    h = new_digest(name)
    total = 0
    buf = bytearray(block)
    view = memoryview(buf)
    with open(open_regular(path), "rb", buffering=0) as f:
        while True:
            n = f.readinto(buf)
            if not n:
                break
            h.update(view[:n])
            total += n
    return h.hexdigest(), total


def hex64(value: int) -> str:
    """Format a 64-bit checksum the way error messages and ``verify`` print it."""
    return f"{int(value):016x}"
