"""Check a damaged tar shard's structure against its index: what the field checksums cannot see.

A field checksum covers a member's data only.  The 512-byte ustar header in front of it (name,
size, checksum, type, ...), the pax or GNU long-name blocks in front of that header, the zero
padding after the data and the end-of-archive zero blocks are covered by nothing but the
whole-shard digest, so damage there read as "shard digest mismatch" and no more, while GNU tar and
WebDataset misread the member (or stop at it).  :func:`tar_structure_problems` reads those bytes
(``pread`` at the offsets the index gives, never a payload) and says which are wrong: one
:class:`Problem` per damaged header block (offset: the block; ``what`` names the header fields
that are wrong), per stretch of non-zero padding and for non-zero end-of-archive blocks (offset:
the first non-zero byte).

Two strictnesses, by who wrote the tar:

* ``packed`` (shardio wrote it): each field's header must be byte for byte what
  :func:`shardio.formats.tar.ustar_header` makes for ``<key>.<field>`` (``.zst`` appended for a
  compressed field) and the field's stored length, right after the previous member's padding;
  the archive ends with zero blocks.  A name that needs a pax header is checked by meaning, as
  below, since those bytes are whatever the running Python's ``tarfile`` writes.
* not ``packed`` (``shardio index`` read a tar that webdataset, GNU tar or another tool wrote,
  with pax headers, long-name blocks, other modes and mtimes, members the index skips): by
  meaning.  Every header from the end of one field to the next is walked; each must hold its
  checksum (the unsigned or signed byte sum, as tar accepts either); the field's own header must
  be a regular file whose name (a pax ``path``, a GNU long name, or ustar prefix and name) splits
  into the sample's key and field as WebDataset splits it (the field in any case: ``shardio
  index`` lowercases it), and whose size (or pax ``size``) is the field's stored length.

Both: the bytes from the end of each field's (and each extension block's) data to the next
512-byte boundary, and the end-of-archive blocks up to the shard's recorded size, must be zeros.

Call it only on a shard whose digest does not match: an intact shard is byte for byte what was
packed or indexed, and how it differs from what shardio writes is then its writer's choice.
"""

from __future__ import annotations

import os
import re
import struct

import numpy as np

from .._fsutil import pread_full
from ..codec import FLAG_ZSTD
from .base import Problem, ShardIndex
from .tar import BLOCK, split_member_name, ustar_header

__all__ = ["tar_structure_problems"]

# The fields of a ustar header block: (name, start, end).
_HEADER_FIELDS = (
    ("name", 0, 100), ("mode", 100, 108), ("uid", 108, 116), ("gid", 116, 124),
    ("size", 124, 136), ("mtime", 136, 148), ("checksum", 148, 156), ("type", 156, 157),
    ("linkname", 157, 257), ("magic", 257, 265), ("uname", 265, 297), ("gname", 297, 329),
    ("devmajor", 329, 337), ("devminor", 337, 345), ("prefix", 345, 500), ("padding", 500, 512),
)
_REGULAR = frozenset(b"0\x007")  # tar's regular-file types (what tarfile's isreg() accepts)
_EXTENSION = frozenset(b"xgLK")  # pax (per-member, global) and GNU long name/link blocks
# Stretches between two fields up to this long are read with one pread (a shardio shard's is
# under 1 KiB, a pax name's a little more); a longer one (members the index skips, in a tar
# another tool wrote) is walked header by header, its members' data never read.
_ONE_READ = 64 << 10
_MAX_EXTENSION = 1 << 20  # an extension block's data, at most (longer: not a name or size)
_PAX_RECORD = re.compile(rb"(\d+) ")


def tar_structure_problems(path: str, index: ShardIndex, packed: bool,
                           recorded_bytes: int) -> list[Problem]:
    """Where the tar structure of the shard at ``path`` disagrees with ``index``.

    Args:
        path: the tar shard.
        index: its index (rows in any order; each field's data offset and stored length).
        packed: shardio wrote the tar (strict), rather than another tool that ``shardio index``
            read (by meaning; see the module docstring).
        recorded_bytes: the shard's size in the manifest: its end-of-archive blocks end there.

    Returns:
        The problems found, ``path`` as their path; none for a sound shard.  Bytes past the end
        of a truncated shard are not looked at (the cut is reported by the size check).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return [Problem(path, f"cannot open ({exc.strerror or exc})")]
    try:
        check = _Check(path, fd, packed)
        check.run(index, recorded_bytes)
        return check.problems
    except OSError as exc:
        return [Problem(path, f"read error ({exc.strerror or exc})")]
    finally:
        os.close(fd)


def _align(n: int) -> int:
    return n + (-n % BLOCK)


def _number(raw: bytes) -> int | None:
    """A header's numeric field as tar reads it (octal text, or GNU base-256); None when it is
    neither."""
    if raw[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(raw[1:], "big")
        return n - (1 << (8 * (len(raw) - 1))) if raw[0] == 0xFF else n
    text = raw.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    if not text.isdigit() or b"8" in text or b"9" in text:
        return None
    return int(text, 8)


def _sums(block: bytes) -> tuple[int, int]:
    """The header's unsigned and signed byte sums, its checksum field counted as spaces."""
    return (256 + sum(struct.unpack_from("148B8x356B", block)),
            256 + sum(struct.unpack_from("148b8x356b", block)))


def _ustar_name(block: bytes) -> bytes:
    name = block[:100].split(b"\0", 1)[0]
    prefix = block[345:500].split(b"\0", 1)[0]
    if block[257:263] == b"ustar\0" and prefix:  # POSIX ustar: a long name split at a slash
        return prefix + b"/" + name
    return name


def _show_name(raw: bytes) -> str:
    return repr(raw.decode("utf-8", "backslashreplace"))


def _pax_records(data: bytes) -> dict[bytes, bytes] | None:
    """The ``"LEN key=value\\n"`` records of a pax extended header; None when they do not
    parse."""
    records: dict[bytes, bytes] = {}
    pos = 0
    data = data.rstrip(b"\0")
    while pos < len(data):
        m = _PAX_RECORD.match(data, pos)
        if m is None:
            return None
        end = pos + int(m.group(1))
        record = data[m.end():end]
        if end > len(data) or not record.endswith(b"\n") or b"=" not in record:
            return None
        key, _, value = record[:-1].partition(b"=")
        records[key] = value
        pos = end
    return records


class _Check:
    """One shard's walk: reads, and the problems found so far."""

    def __init__(self, path: str, fd: int, packed: bool) -> None:
        self.path = path
        self.fd = fd
        self.packed = packed
        self.size = os.fstat(fd).st_size
        self.problems: list[Problem] = []
        self._base = 0
        self._buf = b""

    def read(self, pos: int, n: int) -> bytes:
        """``n`` bytes at ``pos`` (fewer at the end of the file), from the stretch read last
        when they lie in it."""
        if self._base <= pos and pos + n <= self._base + len(self._buf):
            return self._buf[pos - self._base:pos - self._base + n]
        return pread_full(self.fd, max(0, n), pos) if pos < self.size else b""

    def run(self, index: ShardIndex, recorded_bytes: int) -> None:
        n = len(index.f_offset)
        rows = np.argsort(index.f_offset, kind="stable")
        samples = np.searchsorted(index.sample_start, np.arange(n), side="right") - 1
        end = 0  # the end of the previous field's data
        where: tuple[str | None, str | None] = (None, None)
        for r in rows.tolist():
            key = index.key(int(samples[r]))
            field = index.field_names[int(index.f_name[r])]
            offset, length = int(index.f_offset[r]), int(index.f_length[r])
            if offset - BLOCK < _align(end):  # no room for a header: not a tar's index
                end = max(end, offset + length)  # (a layout readers refuse; reported there)
                continue
            self._buf, self._base = (self.read(end, offset - end), end) if (
                offset - end <= _ONE_READ) else (b"", 0)
            self._padding(end, where, "tar padding after the field")
            self._member(_align(end), key, field, int(index.f_flags[r]), offset, length)
            end, where = offset + length, (key, field)
        self._buf, self._base = b"", 0
        self._padding(end, where, "tar padding after the field")
        self._end(_align(end), min(recorded_bytes, self.size))

    def _padding(self, end: int, where: tuple[str | None, str | None], what: str) -> None:
        """The bytes from ``end`` (a member's data end) to the next block boundary are zeros."""
        pad = self.read(end, _align(end) - end)
        if pad.count(0) != len(pad):
            first = len(pad) - len(pad.lstrip(b"\0"))
            self.problems.append(Problem(
                self.path, f"non-zero bytes in the {what}", *where, end + first, "zero bytes",
                f"{len(pad) - pad.count(0)} non-zero byte(s)"))

    def _skipped_padding(self, end: int, block: bytes) -> None:
        self._padding(end, (None, None), "tar padding after a member the index skips ("
                      f"{_show_name(_ustar_name(block))})")

    def _header(self, offset: int, key: str | None, field: str | None,
                wrong: list[tuple[str, str, str]]) -> None:
        """One problem for a damaged header block: the fields ``wrong`` names, the first one's
        expected and found values."""
        names = ", ".join(w[0] for w in wrong)
        self.problems.append(Problem(self.path, f"damaged tar header ({names})", key, field,
                                     offset, wrong[0][1], wrong[0][2]))

    def _checksum(self, block: bytes) -> tuple[str, str, str] | None:
        """What is wrong with the block's checksum field, if anything."""
        stored = _number(block[148:156])
        unsigned, signed = _sums(block)
        if stored in (unsigned, signed) and (
                not self.packed or block[148:156] == b"%06o\0 " % stored):
            return None
        return ("checksum", f"{unsigned:06o} (the block's byte sum)", repr(block[148:156]))

    def _member(self, start: int, key: str, field: str, flags: int, offset: int,
                length: int) -> None:
        """The header block(s) of one field, from ``start`` (the previous member's end) to its
        data at ``offset``."""
        header = offset - BLOCK
        name = f"{key}.{field}.zst" if flags & FLAG_ZSTD else f"{key}.{field}"
        if self.packed:
            expected = ustar_header(name, length)
            found = self.read(offset - len(expected), len(expected))
            if start == offset - len(expected) and found == expected:
                return
            if len(expected) == BLOCK and start == header:
                if len(found) == BLOCK:
                    self._compare(found, expected, header, key, field, length)
                return
        ext = self._walk(start, header, key, field)
        block = self.read(header, BLOCK)
        if len(block) < BLOCK:
            return
        wrong = []
        if ext is not None:
            pax, longname = ext
            found_name = pax.get(b"path") or longname or _ustar_name(block)
            if not self._name_matches(found_name, name, key, field):
                wrong.append(("name", repr(name), _show_name(found_name)))
            size = (int(pax[b"size"]) if pax[b"size"].isdigit() else None) if b"size" in pax \
                else _number(block[124:136])
            if size != length:
                wrong.append(("size", f"{length} bytes",
                              f"{size} bytes" if size is not None else repr(block[124:136])))
        if block[156] not in _REGULAR:
            wrong.append(("type", "b'0' (a regular file)", repr(block[156:157])))
        bad = self._checksum(block)
        if bad is not None:
            wrong.append(bad)
        if wrong:
            self._header(header, key, field, wrong)

    def _name_matches(self, found: bytes, name: str, key: str, field: str) -> bool:
        if found == name.encode("utf-8"):
            return True
        if self.packed:
            return False
        parts = split_member_name(found.decode("utf-8", "surrogateescape"))
        return parts is not None and parts[0] == key and parts[1].lower() == field

    def _compare(self, found: bytes, expected: bytes, offset: int, key: str, field: str,
                 length: int) -> None:
        """Name the fields in which a shardio header differs from the one the packer wrote."""
        wrong = []
        for label, a, b in _HEADER_FIELDS:
            if found[a:b] == expected[a:b]:
                continue
            if label == "name":
                wrong.append((label, _show_name(_ustar_name(expected)),
                              _show_name(found[a:b].split(b"\0", 1)[0])))
            elif label == "size":
                size = _number(found[a:b])
                wrong.append((label, f"{length} bytes",
                              f"{size} bytes" if size is not None else repr(found[a:b])))
            elif label == "checksum" and (bad := self._checksum(found)) is not None:
                wrong.append(bad)
            else:
                wrong.append((label, repr(expected[a:b]), repr(found[a:b])))
        self._header(offset, key, field, wrong)

    def _walk(self, pos: int, stop: int, key: str, field: str
              ) -> tuple[dict[bytes, bytes], bytes | None] | None:
        """Walk the headers from ``pos`` to the field's header at ``stop``: extension blocks
        (their pax records and long name returned) and, in a tar another tool wrote, members the
        index skips.  None when a damaged block stops the walk (the field's name and size are
        then unknown)."""
        pax: dict[bytes, bytes] = {}
        longname: bytes | None = None
        while pos < stop:
            block = self.read(pos, BLOCK)
            if len(block) < BLOCK:
                return None
            bad = self._checksum(block)
            size = _number(block[124:136])
            if bad is not None or size is None or size < 0:
                self._header(pos, key, field, [bad or ("size", "a size", repr(block[124:136]))])
                return None
            kind = block[156]
            data_end = pos + BLOCK + size
            if kind in _EXTENSION and size <= _MAX_EXTENSION:
                data = self.read(pos + BLOCK, size)
                if len(data) < size:
                    return None
                self._padding(data_end, (key, field), "tar padding after an extension header")
                if kind == ord("x"):
                    records = _pax_records(data)
                    if records is None:
                        self.problems.append(Problem(
                            self.path, "damaged pax extended header (its records do not parse)",
                            key, field, pos + BLOCK, "'LENGTH key=value\\n' records",
                            repr(data[:60])))
                        return None
                    pax.update(records)
                elif kind == ord("L"):
                    longname = data.split(b"\0", 1)[0]
            elif self.packed:
                self.problems.append(Problem(
                    self.path, "tar member the index does not list, in front of the field",
                    key, field, pos, "none", _show_name(_ustar_name(block))))
                return None
            else:  # a member the index skips: the extension blocks read were its own
                pax, longname = {}, None
                self._skipped_padding(data_end, block)
            pos = _align(data_end)
        if pos != stop:
            self.problems.append(Problem(
                self.path, "tar headers in front of the field do not end at its header", key,
                field, stop, f"a header at offset {stop}", f"the next header at offset {pos}"))
            return None
        return pax, longname

    def _end(self, pos: int, end: int) -> None:
        """After the last field: (in a tar another tool wrote) members the index skips, then
        zeros up to ``end``."""
        while not self.packed and pos < end:
            block = self.read(pos, BLOCK)
            if len(block) < BLOCK or not any(block[:100]):  # no name: the end-of-archive blocks
                break
            bad = self._checksum(block)
            size = _number(block[124:136])
            if bad is not None or size is None or size < 0:
                self._header(pos, None, None, [bad or ("size", "a size", repr(block[124:136]))])
                return
            if block[156] not in _EXTENSION:
                self._skipped_padding(pos + BLOCK + size, block)
            pos = _align(pos + BLOCK + size)
        first, nonzero = -1, 0
        while pos < end:
            chunk = self.read(pos, min(end - pos, 1 << 16))
            if not chunk:
                break
            if chunk.count(0) != len(chunk):
                if first < 0:
                    first = pos + len(chunk) - len(chunk.lstrip(b"\0"))
                nonzero += len(chunk) - chunk.count(0)
            pos += len(chunk)
        if nonzero:
            self.problems.append(Problem(
                self.path, "non-zero bytes in the tar end-of-archive blocks", None, None, first,
                "zero bytes", f"{nonzero} non-zero byte(s)"))
