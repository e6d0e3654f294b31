"""tar shards: plain POSIX tar (ustar, pax headers for long or non-ASCII names).

One member per field, named ``<key>.<field>`` (``<key>.<field>.zst`` when the field is stored
zstd-compressed), members of a sample adjacent, samples in key order: the WebDataset convention, so
GNU tar lists the shard and ``webdataset.WebDataset`` reads it unchanged.  Members carry fixed
metadata (mode 0444, uid/gid 0, mtime 0) so the same input gives byte-identical shards.  The index
lives beside the shard as ``<shard>.idx`` (see :mod:`shardio.formats.base`), so the tar stays pure.
"""

from __future__ import annotations

import os
import re
import threading
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from .._fsutil import pread_full, read_regular, tmp_name, translate_oserror
from ..checksum import digest_bytes, new_digest, sample_checksum_fn
from ..codec import FLAG_ZSTD, Codec
from ..errors import (
    DuplicateKeyError,
    IndexCorruptError,
    NonUtf8NameError,
    NotATarError,
    ShardIOError,
    ShardNotFoundError,
    ShardTruncatedError,
)
from .base import IndexBuilder, ShardIndex, ShardWriter, WrittenShard

try:  # the C hot loop of a pack (shardio/_tarpack.c); TarWriter.add is the reference
    from .._tarpack import fill as _fill
except ImportError:  # pragma: no cover - built with the package on Linux
    _fill = None

if TYPE_CHECKING:
    import tarfile

__all__ = ["TarWriter", "index_tar", "load_tar_index", "split_member_name"]

BLOCK = 512
# Bytes queued before a writev: big enough that syscalls are few, small enough that the buffers
# stay in cache and malloc reuses them (8 MiB batches were slower: freed memory went back to the
# kernel and came back as page faults).
_FLUSH = 2 << 20
_IOV_MAX = 1024
_WRITEBACK_DEPTH = 2  # batches queued to _Writeback at most (it holds that many buffers)
_ZERO = bytes(BLOCK * 2)
_PADS = tuple(bytes(k) for k in range(BLOCK))  # _PADS[k]: k zero bytes, shared, never re-made
_USTAR_SIZE_LIMIT = 8**11


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
    if len(raw) <= 100 and raw.isascii() and size < _USTAR_SIZE_LIMIT:
        size_field = b"%011o\0" % size
        chk = _BASE_SUM + sum(raw) + sum(size_field)
        return b"".join((raw, _PADS[100 - len(raw)], _MODE_IDS, size_field, _MTIME,
                         b"%06o\0 " % chk, _TAIL))
    import tarfile  # only for pax headers and reading: a pack of plain names never loads it

    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime, info.type = size, 0o444, 0, tarfile.REGTYPE
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _writev_all(fd: int, iov: list[bytes], total: int) -> None:
    """Write every buffer of ``iov`` (``total`` bytes) in order, however short the writes."""
    while iov:
        batch = iov[:_IOV_MAX]
        n = os.writev(fd, batch)
        if n == total:  # the usual case: everything went out in one call
            return
        total -= n
        # A short write (or a batch cut at _IOV_MAX) is legal: drop what went out, retry the rest.
        k = 0
        while k < len(batch) and n >= len(batch[k]):
            n -= len(batch[k])
            k += 1
        iov = iov[k:]
        if n:
            iov[0] = iov[0][n:]


class _Writeback:
    """A thread that writes batches of buffers to ``fd`` in order while the caller builds the next.

    ``writev`` runs without the GIL, so the copy into the page cache (a quarter of a warm pack's
    time) overlaps the header and checksum work of the next batch.  At most ``depth`` batches are
    queued; the first error stops the writing and is re-raised by :meth:`put` or :meth:`finish`.
    """

    def __init__(self, fd: int, depth: int = _WRITEBACK_DEPTH) -> None:
        self._fd = fd
        self._jobs: deque[tuple[list[bytes], int] | None] = deque()
        self._ready = threading.Semaphore(0)
        self._room = threading.Semaphore(depth)
        self.error: BaseException | None = None
        self._cancelled = False  # the shard was aborted: drop what is queued
        self._thread = threading.Thread(target=self._run, name="shardio-writeback", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._ready.acquire()
            job = self._jobs.popleft()
            if job is None:
                return
            if self.error is None and not self._cancelled:
                try:
                    _writev_all(self._fd, *job)
                except BaseException as exc:  # noqa: BLE001  (re-raised by put/finish)
                    self.error = exc
            self._room.release()

    def put(self, iov: list[bytes], total: int) -> None:
        self._room.acquire()
        if self.error is not None:
            self._room.release()
            raise self.error
        self._jobs.append((iov, total))
        self._ready.release()

    def finish(self, cancel: bool = False) -> BaseException | None:
        """Write what is queued (with ``cancel``, only the batch being written), stop the
        thread; return the first error (or None)."""
        self._cancelled = self._cancelled or cancel
        self._jobs.append(None)
        self._ready.release()
        self._thread.join()
        return self.error


# Sets of TarWriter.add_files' batch buffers, kept between the shards of a pack: fresh 2 MiB
# buffers would cost a page fault per 4 KiB of data.  A set is _WRITEBACK_DEPTH + 1 buffers (the
# writer thread holds that many batches at most, and add_files hands each batch on at once).
_SPARE_BUFFERS: list[list[bytearray]] = []


def _take_buffers() -> list[bytearray]:
    try:
        return _SPARE_BUFFERS.pop()
    except IndexError:
        return [bytearray(_FLUSH + _FLUSH // 2) for _ in range(_WRITEBACK_DEPTH + 1)]


def release_buffers() -> None:
    """Free the spare batch buffers (the end of a pack)."""
    _SPARE_BUFFERS.clear()


# WebDataset's base_plus_ext: the key is the name up to the first dot of a stretch without one
# (``d/.h.txt`` is key ``d/``, field ``h.txt``), the field the rest of the last path component.
_MEMBER = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
# Members WebDataset skips: a top-level ``__x__``, and anything under a ``__x__`` prefix.
_META = re.compile(r"__[^/]*__($|/)")
# WebDataset's own entries of a sample dict: a field of that name clashes with them (WebDataset
# refuses the tar, "duplicate file name"; shardio's sample would lose its key).
RESERVED_FIELDS = frozenset({"__key__", "__url__"})


def skipped_member(name: str) -> bool:
    """Whether WebDataset skips the tar member ``name`` as metadata."""
    return bool(_META.match(name)) or (
        "/" not in name and name.startswith("__") and name.endswith("__"))


def split_member_name(name: str) -> tuple[str, str] | None:
    """``(key, field)`` of a tar member as WebDataset splits it; None for a name it skips
    (no extension)."""
    m = _MEMBER.match(name)
    return None if m is None else (m.group(1), m.group(2))


class TarWriter(ShardWriter):
    """Stream samples into ``<final>``'s temp sibling, checksumming as it goes."""

    suffix = ".tar"

    def __init__(self, final: str, codec: Codec, checksum: str, fsync: bool = True,
                 layout: Any = None) -> None:
        self.final = final
        self.layout = layout
        self.index_final = final + ".idx"
        self.codec = codec
        self.fsync = fsync
        self._tmp = tmp_name(final)
        self._check = sample_checksum_fn(checksum)
        self._digest = new_digest()
        self._index = IndexBuilder(checksum)
        self._iov: list[bytes] = []
        self._pending = 0  # bytes in _iov
        # End of the last member's data; its zero padding (_pad) goes out in front of the next
        # header (or the end blocks), which saves an iovec entry and a digest update per member.
        self._pos = 0
        self._pad = b""
        # Per (field name, flags): (index id, b".name[.zst]", its byte sum, ASCII?).
        self._names: dict[tuple[str, int], tuple[int, bytes, int, bool]] = {}
        # Opened on the first flush, so the temp file only ever exists while a caller is inside
        # add()/close() and can abort(): a Ctrl-C landing just after the open cannot orphan it.
        self._fd = -1
        self._bg: _Writeback | None = None
        self._buffers: list[bytearray] = []  # add_files' batch buffers (_take_buffers)
        self._turn = 0
        if _fill is not None and codec.name is None:
            self.add_files = self._add_files

    def _open(self) -> None:
        try:
            if self.layout is None:
                self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC,
                                   0o644)
            else:
                from . import create_shard_file

                self._fd = create_shard_file(self._tmp, self.layout)
        except OSError as exc:
            raise translate_oserror(exc, self.final, "creating shard") from exc

    def _flush(self) -> None:
        """Write what is queued, in this thread, after anything the background writer holds."""
        if self._fd < 0:
            self._open()
        iov, total = self._iov, self._pending
        self._iov, self._pending = [], 0
        try:
            if self._bg is not None:
                bg, self._bg = self._bg, None
                err = bg.finish()
                if err is not None:
                    raise err
            _writev_all(self._fd, iov, total)
        except OSError as exc:
            raise translate_oserror(exc, self.final, "writing shard") from exc

    def _flush_behind(self) -> None:
        """Hand what is queued to the background writer (started on the first full batch)."""
        if self._fd < 0:
            self._open()
        if self._bg is None:
            self._bg = _Writeback(self._fd, _WRITEBACK_DEPTH)
        iov, total = self._iov, self._pending
        self._iov, self._pending = [], 0
        try:
            self._bg.put(iov, total)
        except OSError as exc:
            raise translate_oserror(exc, self.final, "writing shard") from exc

    def _name(self, name: str, flags: int) -> tuple[int, bytes, int, bool]:
        member = f".{name}.zst" if flags & FLAG_ZSTD else f".{name}"
        raw = member.encode("utf-8")
        entry = (self._index.name_id(name), raw, sum(raw), raw.isascii())
        self._names[name, flags] = entry
        return entry

    def add(self, key: str, fields: Sequence[tuple[str, bytes]]) -> None:
        # The hot loop of a pack: one header, one checksum and a few appends per field, with
        # attributes looked up once per sample rather than once per field.
        index = self._index
        index.add_sample(key)
        kraw = key.encode("utf-8")
        ksum = sum(kraw) + _BASE_SUM
        klen = len(kraw)
        kascii = kraw.isascii()
        iov, update, check, names = self._iov, self._digest.update, self._check, self._names
        encode = self.codec.encode if self.codec.name is not None else None
        pos, pending, pad = self._pos, self._pending, self._pad
        for name, data in fields:
            if encode is None:
                stored, flags = data, 0
            else:
                stored, flags = encode(data)
            nid, sraw, ssum, sascii = names.get((name, flags)) or self._name(name, flags)
            n = len(stored)
            mlen = klen + len(sraw)
            if mlen <= 100 and kascii and sascii and n < _USTAR_SIZE_LIMIT:
                size_field = b"%011o\0" % n
                header = b"".join((pad, kraw, sraw, _PADS[100 - mlen], _MODE_IDS, size_field,
                                   _MTIME, b"%06o\0 " % (ksum + ssum + sum(size_field)), _TAIL))
            else:
                header = pad + ustar_header(key + sraw.decode("utf-8"), n)
            pos += len(header)
            index.f_name.append(nid)
            index.f_flags.append(flags)
            index.f_offset.append(pos)
            index.f_length.append(n)
            index.f_raw_length.append(len(data))
            index.f_checksum.append(check(stored))
            iov += (header, stored)
            update(header)
            update(stored)
            pos += n
            pending += len(header) + n
            pad = _PADS[-n % BLOCK]
        self._pos, self._pending, self._pad = pos, pending, pad
        if pending >= _FLUSH or len(iov) >= _IOV_MAX - 64:
            self._flush_behind()

    def _add_files(self, samples: list[Any], start: int, label_field: str, threads: int = 1,
                   delays: Any = None) -> int:
        """Read and add samples ``samples[start:]`` (:class:`shardio._scan.Sample`) in C, their
        files read by ``threads`` threads (a slow source; ``delays``: a simulated one's seconds
        per sample, see shardio/_tarpack.c).

        Returns the index of the first sample not added: ``len(samples)``, or a sample the C
        code leaves to the caller (see shardio/_tarpack.c: pax names, compression, a file it
        cannot read, ...), which must then go through :meth:`add`.  The shard bytes and the index
        rows are exactly what :meth:`add` writes for the same samples.
        """
        index = self._index
        n = len(samples)
        if not self._buffers:
            self._buffers = _take_buffers()
        while start < n:
            if self._pad:  # the last member's padding, held back by add()
                pad, self._pad = self._pad, b""
                self._iov.append(pad)
                self._digest.update(pad)
                self._pending += len(pad)
                self._pos += len(pad)
            out = self._buffers[self._turn]
            (start, slow, length, data, keys, key_offsets, starts, name_ids, offsets, lengths,
             checksums) = _fill(samples, start, index._names, label_field, self._check, self._pos,
                                len(index._keys), len(index.f_name), _FLUSH, out, True,
                                threads, delays)
            index.add_columns(keys, key_offsets, starts, name_ids, offsets, lengths, checksums)
            if length:
                if data is None:
                    data = memoryview(out)[:length]
                    self._turn = (self._turn + 1) % len(self._buffers)
                self._iov.append(data)
                self._digest.update(data)
                self._pending += length
                self._pos += length
                # Always handed on at once, so a buffer is refilled only after it was written:
                # the writer thread holds at most _WRITEBACK_DEPTH batches, the last buffer is free.
                self._flush_behind()
            if slow:
                break
        return start

    def close(self, meta: dict[str, Any] | None = None) -> WrittenShard:
        end = self._pad + _ZERO
        self._iov.append(end)
        self._digest.update(end)
        self._pending += len(end)
        self._pos += len(end)
        self._pad = b""
        try:
            self._flush()
            if self.fsync:
                os.fsync(self._fd)
            os.close(self._fd)
            self._fd = -1
        except BaseException:
            self.abort()
            raise
        self._give_back_buffers()
        index = self._index
        meta = dict(meta or {})
        meta.update(shard_bytes=self._pos, shard_digest=self._digest.hexdigest())
        blob = index.to_bytes(meta)
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
            stored_bytes=index.stored_bytes, raw_bytes=sum(index.f_raw_length),
            fields=index.field_counts(),
        )

    def _give_back_buffers(self) -> None:
        """Return the batch buffers to the pool (the writer thread is done with them)."""
        if self._buffers and self._bg is None:
            _SPARE_BUFFERS.append(self._buffers)
        self._buffers = []
        self._iov = []

    def abort(self) -> None:
        try:
            if self._bg is not None:
                bg, self._bg = self._bg, None
                bg.finish(cancel=True)
            self._give_back_buffers()
        finally:  # a second Ctrl-C during the wait still removes the temp file
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
    """Read the ``.idx`` beside a tar shard (``index.digest``: the file's digest, as
    :class:`TarWriter` records it in the manifest)."""
    idx_path = path + ".idx"
    try:
        data = read_regular(idx_path)
    except FileNotFoundError as exc:
        raise ShardNotFoundError(
            f"index {idx_path} is missing; restore it from a copy of the dataset (`shardio "
            "repair DATASET --replica DIR`, or `shardio verify DATASET --repair` with parity); "
            f"for a tar shardio did not pack, `shardio index {path}`"
        ) from exc
    except OSError as exc:
        raise translate_oserror(exc, idx_path, "reading index") from exc
    index = ShardIndex.from_bytes(data, idx_path)
    index.digest = digest_bytes(data)
    return index


def _members(path: str) -> Iterator[tarfile.TarInfo]:
    import tarfile

    try:
        # Names decode as UTF-8 whatever the locale; bytes that are not UTF-8 become surrogates,
        # which index_tar reports (_utf8_name).
        with tarfile.open(path, "r:", encoding="utf-8", errors="surrogateescape") as tf:
            yield from tf
            end = tf.offset
        _only_zeros_after(path, end)
    except tarfile.ReadError as exc:
        raise NotATarError(
            f"{path} is not an uncompressed tar ({exc}); shardio indexes plain .tar shards: "
            "decompress it first (e.g. gunzip) or repack it with `shardio pack`"
        ) from exc
    except OSError as exc:
        raise translate_oserror(exc, path, "reading") from exc


def _only_zeros_after(path: str, end: int) -> None:
    """Refuse a tar with bytes other than zeros after ``end``, where :mod:`tarfile` stopped
    reading: a header it could not parse after the first one reads as the end of the archive,
    so a damaged header would silently drop every member after it (GNU tar: "Skipping to next
    header")."""
    with open(path, "rb") as f:
        f.seek(end)
        at = end
        while chunk := f.read(1 << 16):
            bad = len(chunk) - len(chunk.lstrip(b"\0"))
            if bad < len(chunk):
                raise NotATarError(
                    f"{path}: bytes other than zeros at offset {at + bad}, after the last member "
                    f"tar can read (which ends at {end}): a damaged member header, or a second "
                    "archive appended to the first (`cat a.tar b.tar`), whose members tar and "
                    "WebDataset do not read; restore the tar from a good copy, or repack its "
                    "files (`tar -x --ignore-zeros`, then `shardio pack`)")
            at += len(chunk)


def _utf8_name(path: str, name: str) -> None:
    """Refuse a member name that is not valid UTF-8: sample keys and field names are UTF-8."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raw = name.encode("utf-8", "surrogateescape")
        raise NonUtf8NameError(
            f"{path}: member {raw!r} is not valid UTF-8 and cannot become a sample key; "
            "recreate the tar with UTF-8 names (extract it, rename the files, e.g. "
            "`convmv -f latin1 -t utf8 -r --notest DIR`, and pack DIR with `shardio pack` or tar)"
        ) from None


def _packed_field(path: str, name: str, ext: str, data: bytes, fields: Collection[str]
                  ) -> tuple[str, int, int]:
    """``(field, flags, raw length)`` of member ``name`` (extension ``ext``) of a tar shardio
    packed with ``--compress zstd`` (see :func:`index_tar`)."""
    base = ext[:-4] if ext.endswith(".zst") else None
    if base is None or ext in fields:
        if base is not None and base in fields:
            raise IndexCorruptError(
                f"{path}: member {name} may be field {ext!r} or field {base!r} compressed (the "
                "dataset has both): its index cannot be read from the shard; restore the "
                ".idx from a replica")
        if ext not in fields:
            raise IndexCorruptError(f"{path}: member {name} is no field of the dataset "
                                    f"({sorted(fields)})")
        return ext, 0, len(data)
    if base not in fields:
        raise IndexCorruptError(f"{path}: member {name} is no field of the dataset "
                                f"({sorted(fields)})")
    size = _zstd_content_size(data)
    if size < 0:
        raise IndexCorruptError(f"{path}: member {name} is not a zstd frame that records its "
                                "size, as shardio writes them; restore the .idx from a replica")
    return base, FLAG_ZSTD, size


def _zstd_content_size(data: bytes) -> int:
    """The decompressed size a zstd frame's header records; -1 when it has none."""
    from ..codec import _zstd

    try:
        size = _zstd().frame_content_size(data)
    except Exception:  # zstandard.ZstdError: not a frame
        return -1
    return size if size >= 0 else -1


def index_tar(path: str, checksum: str, webdataset: bool = True,
              zstd_fields: Collection[str] | None = None) -> tuple[ShardIndex, dict[str, int]]:
    """Build the index of an existing tar (e.g. written by webdataset) without rewriting it.

    Members are grouped into samples the way WebDataset groups them: consecutive members with the
    same key (:func:`split_member_name`), fields lowercased; members without an extension,
    non-files and ``__x__`` names are skipped, as WebDataset skips them.  ``webdataset=False``
    reads a tar that shardio packed as it wrote it instead: field names as they are, nothing
    skipped (a shard's index rebuilt from the shard itself).  ``zstd_fields``, for such a shard
    of a pack with ``--compress zstd``: the dataset's field names (its manifest's), by which a
    member ``key.F.zst`` is field F stored compressed (:class:`TarWriter` names it so) unless
    ``F.zst`` is itself a field.

    Returns:
        The index and per-field member counts.

    Raises:
        NotATarError: not an uncompressed tar.
        NonUtf8NameError: a member name is not valid UTF-8.
        DuplicateKeyError: a sample has the same field twice, or a field named like
            WebDataset's ``__key__``/``__url__`` (WebDataset refuses the tar too).
        ShardTruncatedError: a member ends past the end of the file.
        IndexCorruptError: (``zstd_fields``) a member that is no field of the dataset, or one
            whose field cannot be told.
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
        fields: set[str] = set()
        for m in _members(path):
            if not m.isreg():
                continue
            name = m.name
            if webdataset and skipped_member(name):
                continue
            parts = split_member_name(name)
            if parts is None:
                continue
            _utf8_name(path, name)
            key, field = parts
            if webdataset:
                field = field.lower()
            if m.issparse():
                raise NotATarError(
                    f"{path}: member {name} is a GNU sparse file, whose bytes are not stored "
                    "whole at one offset: shardio cannot read it by offset; recreate the tar "
                    "without --sparse (or repack the files with `shardio pack`)")
            if key != last_key:
                builder.add_sample(key)
                last_key = key
                fields.clear()
            if field in fields:
                raise DuplicateKeyError(
                    f"{path}: sample {key!r} has field {field!r} twice (member {name}); "
                    "WebDataset refuses such a tar too (duplicate file name): rewrite it "
                    "without the duplicate member")
            if field in RESERVED_FIELDS:
                raise DuplicateKeyError(
                    f"{path}: member {name} is a field named {field!r}, the name of an entry "
                    "every sample has; WebDataset refuses such a tar too (duplicate file name): "
                    "rename the member")
            fields.add(field)
            data = pread_full(fd, m.size, m.offset_data)
            if len(data) < m.size:
                raise ShardTruncatedError(f"{path}: member {m.name} is truncated")
            flags, raw_length = 0, m.size
            if zstd_fields is not None:
                field, flags, raw_length = _packed_field(path, name, field, data, zstd_fields)
            builder.add_field(field, flags, m.offset_data, m.size, raw_length, check(data))
            counts[field] = counts.get(field, 0) + 1
    except OSError as exc:
        if isinstance(exc, ShardIOError):
            raise
        raise translate_oserror(exc, path, "reading") from exc
    finally:
        os.close(fd)
    return builder.build(), counts
