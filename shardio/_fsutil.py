"""Filesystem helpers: atomic publication, size parsing, OS error translation, path safety."""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO

from .errors import ShardIOError, StorageFullError, UnsafePathError, UsageError

TMP_MARK = ".shardio-tmp"
"""Infix of every temporary file shardio writes; anything carrying it is never a finished artifact."""

_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(text: str | int | float) -> int:
    """Parse ``256MB``, ``1GiB``, ``4096`` (or a whole float such as ``800e9``) into bytes
    (decimal for MB, binary for MiB).

    Raises:
        UsageError: the value is not a positive size.
    """
    if isinstance(text, float) and text.is_integer():
        text = int(text)
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise UsageError(f"invalid size {text!r}; write it like 256MB, 1GiB or 1048576")
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?)?B?\s*", text.upper())
        if not m:
            raise UsageError(f"invalid size {text!r}; write it like 256MB, 1GiB or 1048576")
        if m.group(2) is None and "." in m.group(1):  # ("1.5" was 1 byte: no unit, bytes)
            raise UsageError(f"invalid size {text!r}: a number of bytes is whole; give a unit "
                             "(1.5MB) or write the bytes (1500000)")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value <= 0:
        raise UsageError(f"size must be positive, got {text!r}")
    return value


# A read returns at most ~2 GiB whatever it asks for (Linux: 2 GiB less a page; macOS: 2 GiB), so
# a short read that long may be that cap rather than the end of the file: read on.  A shorter
# short read of a regular file is its end, as everywhere else in shardio.
BIG_READ = 1 << 30


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at ``path``; IsADirectoryError for a
    directory, OSError (``EINVAL``) for anything else, whose open or read could wait for ever
    (a FIFO waits for a writer)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):  # (open() of a directory fails so; os.open does not)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        if not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str) -> bytes:
    """The bytes of the regular file at ``path`` (see :func:`open_regular`)."""
    with open(open_regular(path), "rb") as f:
        return f.read()


def pread_full(fd: int, n: int, offset: int) -> bytes:
    """``os.pread(fd, n, offset)``, read on past the kernel's cap on one read (a sample or span
    over 2 GiB); fewer than ``n`` bytes only at the end of the file."""
    data = os.pread(fd, n, offset)
    last = len(data)
    if last < n and last >= BIG_READ:
        parts, got = [data], last
        while last >= BIG_READ and got < n:
            chunk = os.pread(fd, n - got, offset + got)
            last = len(chunk)
            parts.append(chunk)
            got += last
        data = b"".join(parts)
    return data


def preadv_full(fd: int, buf: memoryview, offset: int) -> int:
    """``os.preadv(fd, [buf], offset)`` read on past the kernel's cap on one read; returns the
    bytes read (fewer than ``len(buf)`` only at the end of the file)."""
    got = last = os.preadv(fd, [buf], offset)
    while last >= BIG_READ and got < len(buf):
        last = os.preadv(fd, [buf[got:]], offset + got)
        got += last
    return got


def translate_oserror(exc: OSError, path: str, action: str) -> ShardIOError:
    """Map an OSError raised while touching ``path`` to the shardio error a caller should see."""
    if exc.errno in _FULL:
        return StorageFullError(
            exc.errno, f"{action} {path}: {os.strerror(exc.errno or 0)}; free space on that "
            "filesystem or choose another output directory (nothing was published)"
        )
    return ShardIOError(exc.errno, f"{action} {path}: {exc.strerror or exc}")


def tmp_name(final: str) -> str:
    """A temporary sibling of ``final`` unique to this process."""
    d, base = os.path.split(final)
    return os.path.join(d, f".{base}{TMP_MARK}-{os.getpid()}")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_writer(final: str, *, fsync: bool = True) -> Iterator[BinaryIO]:
    """Write ``final`` through a temp file in the same directory, then fsync and rename.

    On any exception the temp file is unlinked and ``final`` is untouched.  OSErrors come out as
    ``ShardIOError``/``StorageFullError`` naming the path.
    """
    tmp = tmp_name(final)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and not isinstance(exc, ShardIOError):
            raise translate_oserror(exc, final, "writing") from exc
        raise


def atomic_write_bytes(final: str, data: bytes, *, fsync: bool = True) -> None:
    """Publish ``data`` at ``final`` atomically (see :func:`atomic_writer`)."""
    with atomic_writer(final, fsync=fsync) as f:
        f.write(data)


def remove_temp_files(directory: str) -> int:
    """Delete shardio temp files left in ``directory`` (by a killed run); return how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return 0
    for name in names:
        if TMP_MARK in name:
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


def check_relpath(rel: str) -> str:
    """Return ``rel`` if it is a relative path that stays inside its base directory.

    Raises:
        UnsafePathError: absolute, empty, or climbing out with ``..``.
    """
    if not isinstance(rel, str) or not rel or os.path.isabs(rel) or rel.startswith(("/", "\\")):
        raise UnsafePathError(
            f"manifest path {rel!r} is not relative; manifests may only name files inside the "
            "dataset directory (regenerate it with `shardio pack` or `shardio index`)"
        )
    if "\0" in rel or not _encodable(rel):
        raise UnsafePathError(
            f"manifest path {rel!r} holds a NUL or is not valid UTF-8, so it names no file; the "
            "manifest was edited or damaged (regenerate it with `shardio pack` or `shardio index`)")
    parts = rel.replace("\\", "/").split("/")
    if ".." in parts:
        raise UnsafePathError(
            f"manifest path {rel!r} leaves the dataset directory through '..'; move the shards "
            "under the manifest's directory and rerun `shardio index`"
        )
    return rel


def resolve_in(base: str, rel: str) -> str:
    """Join a checked relative path onto ``base``."""
    return os.path.join(base, check_relpath(rel))


def set_pdeathsig(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when the thread that forked it ends
    (``PR_SET_PDEATHSIG``; Linux).  The caller checks ``os.getppid()`` afterwards: a parent
    that died before this call sent nothing."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # pragma: no cover - non-Linux
        pass
