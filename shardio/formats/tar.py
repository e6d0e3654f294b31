"""tar shards: plain POSIX tar (ustar, pax headers for long or non-ASCII names).

One member per field, named ``<key>.<field>`` (``<key>.<field>.zst`` when the field is stored
zstd-compressed), members of a sample adjacent, samples in key order: the WebDataset convention, so
GNU tar lists the shard and ``webdataset.WebDataset`` reads it unchanged.  Members carry fixed
metadata (mode 0444, uid/gid 0, mtime 0) so the same input gives byte-identical shards.  The index
lives beside the shard as ``<shard>.idx`` (see :mod:`shardio.formats.base`), so the tar stays pure.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterator, Sequence
from typing import Any

from .._fsutil import tmp_name, translate_oserror
from ..checksum import digest_bytes, new_digest, sample_checksum_fn
from ..codec import FLAG_ZSTD, Codec
from ..errors import NotATarError, ShardIOError, ShardNotFoundError, ShardTruncatedError
from .base import IndexBuilder, ShardIndex, ShardWriter, WrittenShard

__all__ = ["TarWriter", "index_tar", "load_tar_index", "split_member_name"]

BLOCK = 512
_FLUSH = 8 << 20
_IOV_MAX = 1024
_ZERO = bytes(BLOCK * 2)


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


def _template() -> tuple[bytes, bytes, int]:
    hdr = bytearray(BLOCK)
    hdr[100:108] = _octal(0o444, 8)
    hdr[108:116] = _octal(0, 8)
    hdr[116:124] = _octal(0, 8)
    hdr[136:148] = _octal(0, 12)
    hdr[148:156] = b" " * 8
    hdr[156:157] = b"0"
    hdr[257:265] = b"ustar\x0000"
    return bytes(hdr[100:124]), bytes(hdr[136:148]), sum(hdr)


# Every member shares mode/uid/gid/mtime/type/magic; only the name and size vary, so the header
# checksum is the template's plus the bytes of those two fields (a tenth of the cost of tarfile).
_MODE_IDS, _MTIME, _BASE_SUM = _template()
_TAIL = b"0" + bytes(100) + b"ustar\x0000" + bytes(BLOCK - 265)


def ustar_header(name: str, size: int) -> bytes:
    """Header block(s) for a regular file member; pax extension when ustar cannot hold the name."""
    raw = name.encode("utf-8")
    if len(raw) <= 100 and raw.isascii() and size < 8**11:
        size_field = b"%011o\0" % size
        chk = _BASE_SUM + sum(raw) + sum(size_field)
        return b"".join((raw, bytes(100 - len(raw)), _MODE_IDS, size_field, _MTIME,
                         b"%06o\0 " % chk, _TAIL))
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, 0o444, 0, tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def split_member_name(name: str) -> tuple[str, str] | None:
    """WebDataset's rule: key = directory + basename up to its first dot; field = the rest."""
    d, base = os.path.split(name)
    if "." not in base or base.startswith("."):
        return None
    stem, ext = base.split(".", 1)
    return (f"{d}/{stem}" if d else stem), ext


class TarWriter(ShardWriter):
    """Stream samples into ``<final>``'s temp sibling, checksumming as it goes."""

    suffix = ".tar"

    def __init__(self, final: str, codec: Codec, checksum: str, fsync: bool = True) -> None:
        self.final = final
        self.index_final = final + ".idx"
        self.codec = codec
        self.fsync = fsync
        self._tmp = tmp_name(final)
        self._check = sample_checksum_fn(checksum)
        self._digest = new_digest()
        self._index = IndexBuilder(checksum)
        self._iov: list[bytes] = []
        self._pending = 0
        self._pos = 0
        self._fields: dict[str, int] = {}
        self._raw = 0
        # Opened on the first flush, so the temp file only ever exists while a caller is inside
        # add()/close() and can abort(): a Ctrl-C landing just after the open cannot orphan it.
        self._fd = -1

    def _open(self) -> None:
        try:
            self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise translate_oserror(exc, self.final, "creating shard") from exc

    def _emit(self, part: bytes) -> None:
        self._iov.append(part)
        self._digest.update(part)
        self._pending += len(part)
        self._pos += len(part)

    def _flush(self) -> None:
        if self._fd < 0:
            self._open()
        iov = self._iov
        self._iov, self._pending = [], 0
        try:
            while iov:
                batch = iov[:_IOV_MAX]
                n = os.writev(self._fd, batch)
                # A short write is legal: drop what went out and retry the rest.
                k = 0
                while k < len(batch) and n >= len(batch[k]):
                    n -= len(batch[k])
                    k += 1
                iov = iov[k:]
                if n:
                    iov[0] = iov[0][n:]
        except OSError as exc:
            raise translate_oserror(exc, self.final, "writing shard") from exc

    def add(self, key: str, fields: Sequence[tuple[str, bytes]]) -> None:
        self._index.add_sample(key)
        iov, update = self._iov, self._digest.update
        for name, data in fields:
            stored, flags = self.codec.encode(data)
            member = f"{key}.{name}.zst" if flags & FLAG_ZSTD else f"{key}.{name}"
            n = len(stored)
            header = ustar_header(member, n)
            pad = _ZERO[: -n % BLOCK]
            self._index.add_field(name, flags, self._pos + len(header), n, len(data),
                                  self._check(stored))
            iov += (header, stored, pad)
            update(header)
            update(stored)
            update(pad)
            size = len(header) + n + len(pad)
            self._pos += size
            self._pending += size
            self._fields[name] = self._fields.get(name, 0) + 1
            self._raw += len(data)
        if self._pending >= _FLUSH or len(iov) >= _IOV_MAX - 64:
            self._flush()

    def close(self, meta: dict[str, Any] | None = None) -> WrittenShard:
        self._emit(_ZERO)
        try:
            self._flush()
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        except BaseException:
            self.abort()
            raise
        meta = dict(meta or {})
        meta.update(shard_bytes=self._pos, shard_digest=self._digest.hexdigest())
        index = self._index.build(meta)
        blob = index.to_bytes()
        tmp_idx = tmp_name(self.index_final)
        try:
            with open(tmp_idx, "wb") as f:
                f.write(blob)
                if self.fsync:
                    os.fsync(f.fileno())
            # Shard first, index second: a present index means a complete shard.
            os.replace(self._tmp, self.final)
            os.replace(tmp_idx, self.index_final)
        except BaseException as exc:  # KeyboardInterrupt too: never leave a temp file behind
            for p in (tmp_idx, self._tmp):
                _unlink(p)
            if isinstance(exc, OSError):
                raise translate_oserror(exc, self.final, "publishing shard") from exc
            raise
        return WrittenShard(
            path=self.final, index_path=self.index_final, samples=len(index), bytes=self._pos,
            digest=self._digest.hexdigest(), index_digest=digest_bytes(blob),
            stored_bytes=index.stored_bytes, raw_bytes=self._raw, fields=dict(self._fields),
        )

    def abort(self) -> None:
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1
        _unlink(self._tmp)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def load_tar_index(path: str) -> ShardIndex:
    """Read the ``.idx`` beside a tar shard."""
    idx_path = path + ".idx"
    try:
        with open(idx_path, "rb") as f:
            data = f.read()
    except FileNotFoundError as exc:
        raise ShardNotFoundError(
            f"index {idx_path} is missing; rebuild it with `shardio index {path}`"
        ) from exc
    except OSError as exc:
        raise translate_oserror(exc, idx_path, "reading index") from exc
    return ShardIndex.from_bytes(data, idx_path)


def _members(path: str) -> Iterator[tarfile.TarInfo]:
    try:
        with tarfile.open(path, "r:") as tf:
            yield from tf
    except tarfile.ReadError as exc:
        raise NotATarError(
            f"{path} is not an uncompressed tar ({exc}); shardio indexes plain .tar shards: "
            "decompress it first (e.g. gunzip) or repack it with `shardio pack`"
        ) from exc
    except OSError as exc:
        raise translate_oserror(exc, path, "reading") from exc


def index_tar(path: str, checksum: str) -> tuple[ShardIndex, dict[str, int]]:
    """Build the index of an existing tar (e.g. written by webdataset) without rewriting it.

    Members are grouped into samples the way WebDataset groups them: consecutive members with the
    same key.  Members without an extension and non-files are skipped (WebDataset skips them too).

    Returns:
        The index and per-field member counts.
    """
    check = sample_checksum_fn(checksum)
    builder = IndexBuilder(checksum)
    counts: dict[str, int] = {}
    last_key: str | None = None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise translate_oserror(exc, path, "opening") from exc
    try:
        for m in _members(path):
            if not m.isreg():
                continue
            parts = split_member_name(m.name)
            if parts is None:
                continue
            key, field = parts
            if key != last_key:
                builder.add_sample(key)
                last_key = key
            data = os.pread(fd, m.size, m.offset_data)
            if len(data) < m.size:
                raise ShardTruncatedError(f"{path}: member {m.name} is truncated")
            builder.add_field(field, 0, m.offset_data, m.size, m.size, check(data))
            counts[field] = counts.get(field, 0) + 1
    except OSError as exc:
        if isinstance(exc, ShardIOError):
            raise
        raise translate_oserror(exc, path, "reading") from exc
    finally:
        os.close(fd)
    return builder.build(), counts
