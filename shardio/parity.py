"""Erasure-coded parity across groups of shards (``shardio pack --parity K+M``).

Scheme: systematic Reed–Solomon over GF(2^8) from the maintained ``zfec`` library (a C extension;
``pip install zfec``).  The shards of a dataset are cut, in manifest order, into groups of K:
``[0..K-1], [K..2K-1], ...``; the last group may hold fewer (K' < K) data shards and still gets M
parity blocks.  Within a group every shard is treated as a byte string zero-padded to the group's
largest shard size, and M parity files of that padded size are computed.  Any K' of the K'+M
blocks of a group (data shard j is block j, parity file p is block K'+p) rebuild the others, so up
to M lost or corrupt shards per group come back with no replica.

File layout, relative to the dataset directory::

    parity/g000000.p0 ... parity/g000000.p{M-1}     group 0 (shards 0..K-1)
    parity/g000001.p0 ...                           group 1 (shards K..2K-1)

Each file is published atomically (temp name, fsync, rename) like every shardio artifact.

Manifest section (``manifest.parity``, covered by the manifest digest)::

    {"scheme": "zfec-rs", "k": K, "m": M, "chunk": 1048576,
     "groups": [{"shards": [0, 1, 2, 3], "size": <padded bytes>,
                 "files": ["parity/g000000.p0", ...], "digests": [...], "bytes": [...]}, ...]}

Digests use the manifest's shard digest algorithm (``xxh3_128`` by default), over whole files.

Memory: encoding and decoding run stripe by stripe: ``chunk`` bytes of every block of one group
at a time, so peak memory is about ``(K'+M) * chunk`` whatever the shard size.  The code works
byte by byte (output byte i depends only on byte i of each input), so any stripe size decodes
what any other stripe size encoded; ``chunk`` only bounds memory.

What can be rebuilt: the shard files themselves (for HDF5 that includes the in-file index).  The
``.idx`` beside a tar shard is not covered: a rebuilt tar shard whose index is also lost gets one
read from the rebuilt (verified) shard itself (``shardio.repair._ensure_index``), which a reader
accepts for that rebuilt copy; its digest differs from the manifest's (the packer's index also
records the pack job), so ``shardio verify`` still reports the original's index until a good copy
of it is restored.  A shard is usable as a source only when its size and
whole-file digest match the manifest; a parity file only when its digest matches.  With more than
M blocks of a group lost, :func:`rebuild_shard` raises :class:`~shardio.errors.ParityError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Sequence
from contextlib import ExitStack
from typing import Any

from ._fsutil import atomic_writer, pread_full, resolve_in, translate_oserror
from .checksum import StreamHasher, file_digest, new_digest
from .config import PARITY_MAX_BLOCKS, parse_parity
from .config import check_km as _check_km
from .errors import MissingDependencyError, ParityError, UsageError
from .manifest import Manifest

__all__ = [
    "PARITY_DIR",
    "SCHEME",
    "group_of",
    "parse_parity",
    "rebuild_shard",
    "verify_parity",
    "write_parity",
]

SCHEME = "zfec-rs"
PARITY_DIR = "parity"
#: A parity file's name inside :data:`PARITY_DIR` (``g<group:06d>.p<j>``).
PARITY_FILE = re.compile(r"g\d{6,}\.p\d+")
MAX_BLOCKS = PARITY_MAX_BLOCKS  # zfec works in GF(2^8): at most 256 blocks per group
DEFAULT_CHUNK = 1 << 20


def _zfec() -> Any:
    try:
        import zfec  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError as exc:
        raise MissingDependencyError(
            "parity (--parity K+M) needs the zfec package: pip install zfec "
            "(or pip install 'shardio[parity]')"
        ) from exc
    return zfec


# --- helpers ---------------------------------------------------------------------------------


def _open_fd(stack: ExitStack, path: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as exc:
        raise translate_oserror(exc, path, "opening") from exc
    stack.callback(os.close, fd)
    return fd


def _pread_padded(fd: int, offset: int, length: int, path: str) -> bytes:
    """``length`` bytes at ``offset``; past the end of the file the block is zeros."""
    try:
        data = pread_full(fd, length, offset)
    except OSError as exc:
        raise translate_oserror(exc, path, "reading") from exc
    if len(data) < length:
        data += bytes(length - len(data))
    return data


def _stripes(size: int, chunk: int) -> Iterator[tuple[int, int]]:
    for offset in range(0, size, chunk):
        yield offset, min(chunk, size - offset)


def _section(manifest: Manifest) -> dict[str, Any]:
    parity = manifest.parity
    if not parity:
        raise ParityError(
            "this dataset has no parity; pack it with --parity K+M (e.g. 8+2) to be able to "
            "rebuild lost shards, or restore them from a replica"
        )
    if not isinstance(parity, dict) or parity.get("scheme") != SCHEME:
        scheme = parity.get("scheme") if isinstance(parity, dict) else parity
        raise ParityError(f"unknown parity scheme {scheme!r}; this shardio reads {SCHEME!r}")
    return parity


# --- encoding --------------------------------------------------------------------------------


def _changed(path: str, what: str) -> ParityError:
    return ParityError(
        f"{path}: {what} does not match the manifest; parity would encode corrupt data: run "
        "`shardio verify`, restore the shard or repack, then write the parity again"
    )


def _encode_group(root: str, manifest: Manifest, number: int, shards: Sequence[int], m: int,
                  chunk: int, fsync: bool) -> dict[str, Any]:
    """Write the M parity files of one group; return its manifest entry."""
    zfec = _zfec()
    entries = [manifest.shards[i] for i in shards]
    k = len(shards)
    size = max(e.bytes for e in entries)
    files = [f"{PARITY_DIR}/g{number:06d}.p{j}" for j in range(m)]
    encoder = zfec.Encoder(k, k + m)
    wanted = tuple(range(k, k + m))
    with ExitStack() as stack:
        paths = [resolve_in(root, e.path) for e in entries]
        fds = [_open_fd(stack, p) for p in paths]
        for path, fd, e in zip(paths, fds, entries):
            if os.fstat(fd).st_size != e.bytes:
                raise _changed(path, "size")
        outs = [stack.enter_context(atomic_writer(resolve_in(root, f), fsync=fsync))
                for f in files]
        data_hash = [new_digest(manifest.digest) for _ in entries]
        par_hash = [new_digest(manifest.digest) for _ in files]
        for offset, length in _stripes(size, chunk):
            blocks = []
            for fd, e, path, h in zip(fds, entries, paths, data_hash):
                block = _pread_padded(fd, offset, length, path)
                h.update(memoryview(block)[: max(0, min(length, e.bytes - offset))])
                blocks.append(block)
            for out, h, parity in zip(outs, par_hash, encoder.encode(tuple(blocks), wanted)):
                out.write(parity)
                h.update(parity)
        for path, e, h in zip(paths, entries, data_hash):
            if h.hexdigest() != e.digest:
                # Raised inside the writers' context: no parity file of this group is published.
                raise _changed(path, "digest")
    return {"shards": list(shards), "size": size, "files": files,
            "digests": [h.hexdigest() for h in par_hash], "bytes": [size] * m}


def write_parity(root: str, manifest: Manifest, k: int, m: int, *, chunk: int = DEFAULT_CHUNK,
                 fsync: bool = True) -> dict[str, Any]:
    """Compute parity files for the shards of a published dataset.

    Call it after the shards are written; store the result as ``manifest.parity`` and save the
    manifest.  Each data shard's digest is checked while it is read, so corrupt data is never
    encoded.

    Args:
        root: dataset directory.
        manifest: the dataset's manifest (shard sizes and digests).
        k: data shards per group.
        m: parity files per group (the number of lost shards a group survives).
        chunk: stripe size in bytes; peak memory is about ``(k+m) * chunk``.
        fsync: fsync parity files before publishing them.

    Returns:
        The manifest section described in the module docstring.

    Raises:
        UsageError: bad K, M or chunk.
        MissingDependencyError: zfec is not installed.
        ParityError: a shard does not match its manifest entry.
        ShardIOError, StorageFullError: reading a shard or writing parity failed.
    """
    _check_km(k, m)
    if not isinstance(chunk, int) or chunk < 1:
        raise UsageError(f"parity chunk must be a positive number of bytes, got {chunk!r}")
    _zfec()
    root = os.fspath(root)
    try:
        os.makedirs(os.path.join(root, PARITY_DIR), exist_ok=True)
    except OSError as exc:
        raise translate_oserror(exc, os.path.join(root, PARITY_DIR), "creating") from exc
    n = len(manifest.shards)
    groups = [_encode_group(root, manifest, g, range(start, min(start + k, n)), m, chunk, fsync)
              for g, start in enumerate(range(0, n, k))]
    return {"scheme": SCHEME, "k": k, "m": m, "chunk": chunk, "groups": groups}


# --- decoding --------------------------------------------------------------------------------


def group_of(parity: dict[str, Any], shard: int) -> tuple[int, dict[str, Any]]:
    """Return ``(group number, group entry)`` of the group holding manifest shard ``shard``.

    Raises:
        ParityError: no group holds the shard (or the section is malformed).
    """
    try:
        for number, group in enumerate(parity["groups"]):
            if shard in group["shards"]:
                return number, group
    except (KeyError, TypeError) as exc:
        raise ParityError(f"malformed parity section in the manifest ({exc!r}); repack with "
                          "--parity or rerun write_parity") from exc
    raise ParityError(
        f"shard {shard} is in no parity group (it was added after the parity was written?); "
        "rerun write_parity over the dataset"
    )


def _file_ok(path: str, size: int, digest: str, algorithm: str) -> bool:
    try:
        if os.path.getsize(path) != size:
            return False
        return file_digest(path, algorithm)[0] == digest
    except OSError:
        return False


def _usable_blocks(root: str, manifest: Manifest, group: dict[str, Any], target: int,
                   bad: set[int]) -> tuple[list[tuple[int, str]], list[str]]:
    """``(block number, path)`` of every usable block except ``target``, and what is lost."""
    usable: list[tuple[int, str]] = []
    lost: list[str] = []
    shards = group["shards"]
    for j, i in enumerate(shards):
        entry = manifest.shards[i]
        path = resolve_in(root, entry.path)
        if i == target:
            lost.append(f"{entry.path} (being rebuilt)")
        elif i in bad or not _file_ok(path, entry.bytes, entry.digest, manifest.digest):
            lost.append(entry.path)
        else:
            usable.append((j, path))
    for p, (rel, digest) in enumerate(zip(group["files"], group["digests"])):
        path = resolve_in(root, rel)
        size = group["bytes"][p] if "bytes" in group else group["size"]
        if _file_ok(path, size, digest, manifest.digest):
            usable.append((len(shards) + p, path))
        else:
            lost.append(rel)
    return usable, lost


def rebuild_shard(root: str, manifest: Manifest, shard: int, dest: str, *,
                  bad: Iterable[int] = (), chunk_override: int | None = None) -> str:
    """Rebuild manifest shard ``shard`` into a new file ``dest`` from its group and parity.

    The rebuilt bytes are checked against the shard's manifest digest before ``dest`` is
    published (atomically); ``dest`` may be the shard's own path.

    Args:
        root: dataset directory.
        manifest: the dataset's manifest, with its ``parity`` section.
        shard: manifest index of the shard to rebuild.
        dest: where to publish the rebuilt shard.
        bad: manifest indexes of other shards known bad (skipped even if their digest matches).
        chunk_override: stripe size for decoding (memory bound); the section's ``chunk`` if None.

    Returns:
        ``dest``.

    Raises:
        ParityError: no parity, the shard is in no group, more than M blocks of its group are
            lost, or the rebuilt bytes fail the manifest digest.
        MissingDependencyError: zfec is not installed.
        ShardIOError, StorageFullError: reading or writing failed.
    """
    parity = _section(manifest)
    root = os.fspath(root)
    number, group = group_of(parity, shard)
    k, m = len(group["shards"]), int(parity["m"])
    usable, lost = _usable_blocks(root, manifest, group, shard, set(bad))
    if len(usable) < k:
        raise ParityError(
            f"parity group {number} (shards {group['shards'][0]}..{group['shards'][-1]}): "
            f"{len(lost)} of its {k + m} blocks are lost ({', '.join(lost)}); parity "
            f"{parity['k']}+{m} rebuilds at most {m} per group: restore from a replica or repack"
        )
    # Data blocks first: decoding from primaries is cheapest.
    chosen = sorted(usable)[:k]
    chunk = int(chunk_override or parity.get("chunk") or DEFAULT_CHUNK)
    entry = manifest.shards[shard]
    _decode_to(dest, chosen, group["shards"].index(shard), k, m, chunk, group["size"],
               entry.bytes, entry.digest, manifest.digest)
    return dest


def _decode_to(dest: str, chosen: list[tuple[int, str]], j: int, k: int, m: int, chunk: int,
               size: int, length: int, digest: str, algorithm: str) -> None:
    decoder = _zfec().Decoder(k, k + m)
    nums = tuple(n for n, _ in chosen)
    with ExitStack() as stack:
        fds = [_open_fd(stack, p) for _, p in chosen]
        out = stack.enter_context(atomic_writer(dest))
        h: StreamHasher = new_digest(algorithm)
        for offset, n in _stripes(size, chunk):
            if offset >= length:
                break
            blocks = tuple(_pread_padded(fd, offset, n, p) for fd, (_, p) in zip(fds, chosen))
            data = decoder.decode(blocks, nums)[j][: length - offset]
            out.write(data)
            h.update(data)
        if h.hexdigest() != digest:
            raise ParityError(
                f"rebuilt {dest} fails the manifest digest (expected {digest}, got "
                f"{h.hexdigest()}); a source block was damaged while read: rerun the rebuild, "
                "or restore from a replica"
            )


# --- verification ----------------------------------------------------------------------------


def verify_parity(root: str, manifest: Manifest) -> list[tuple[str, str]]:
    """Check every parity file of the dataset; return ``(path, problem)`` for each bad one.

    A dataset without parity has nothing to check and returns an empty list.
    """
    if not manifest.parity:
        return []
    try:
        parity = _section(manifest)
    except ParityError as exc:
        return [("manifest.json", str(exc))]
    root = os.fspath(root)
    problems: list[tuple[str, str]] = []
    try:
        for group in parity["groups"]:
            for rel, digest, size in zip(group["files"], group["digests"], group["bytes"]):
                problems += _check_parity_file(root, rel, digest, size, manifest.digest)
    except (KeyError, TypeError) as exc:
        problems.append(("manifest.json", f"malformed parity section ({exc!r}); rewrite it"))
    return problems


def _check_parity_file(root: str, rel: str, digest: str, size: int,
                       algorithm: str) -> list[tuple[str, str]]:
    path = resolve_in(root, rel)
    try:
        found, nbytes = file_digest(path, algorithm)
    except FileNotFoundError:
        return [(rel, "missing parity file")]
    except OSError as exc:
        return [(rel, f"read error ({exc.strerror or exc})")]
    if nbytes != size:
        return [(rel, f"parity file size differs (expected {size} bytes, found {nbytes})")]
    if found != digest:
        return [(rel, f"parity digest mismatch (expected {digest}, found {found})")]
    return []
