"""A pack's output directory: what a rerun finds there and decides, and the state it resumes from.

``OUT`` holds the manifest (last, atomically), the shards with their ``.idx`` files, an optional
``zstd.dict``, ``parity/`` with ``--parity`` and, while a pack is unfinished, the state file
``.shardio-pack.json``: the job fingerprint (``null`` while a streaming pack still scans) and a
fingerprint of the output options (:mod:`shardio.packplan`).  :func:`_prepare_out` decides
between a fresh start, a resume (temp files of a killed run are removed, in ``OUT`` and
``OUT/parity``; :func:`_is_done` keeps each published shard whose fingerprint matches its new
plan and whose bytes still hash to the digest recorded when it was written) and a pack that is
already complete; anything else in a non-empty ``OUT`` is refused unless ``--overwrite``, which
deletes only shardio's own files (:func:`_ours`).

Where a shard's digest is recorded: a tar shard's in its ``.idx`` (``shard_digest``,
``shard_bytes``, covered by the index's own checksum).  An HDF5 shard has no file beside it, and
its digest cannot be inside the bytes it hashes, so the worker that wrote it records it in the
shard's extended attribute ``user.shardio.digest`` (:func:`_record_digest`): it stays with that
inode (a shard replaced or copied without its attributes has none), needs no file in ``OUT``
that a concurrent part of a multi-node pack would take for a foreign one, and nothing to clean
up.  A shard without it (a filesystem without user xattrs) is rewritten on resume, never trusted.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

from . import __version__
from ._fsutil import TMP_MARK, atomic_write_bytes, remove_temp_files, translate_oserror
from ._packpool import Task as _Task
from .checksum import DEFAULT_DIGEST, digest_bytes, file_digest
from .codec import Codec
from .config import PackOptions
from .errors import (
    OutputInsideSourceError,
    OutputNotEmptyError,
    ShardioError,
    UsageError,
)
from .formats import WrittenShard, load_index
from .manifest import MANIFEST_NAME, Manifest
from .packplan import _fingerprint
from .parity import PARITY_DIR, PARITY_FILE

__all__ = ["DICT_NAME", "STATE_NAME"]

log = logging.getLogger("shardio.pack")

STATE_NAME = ".shardio-pack.json"
# Part records and per-part state files of a multi-node pack (shardio.parts).
_PART_FILE = re.compile(r"\.shardio-(part|pack)-(\d+)-of-(\d+)\.json")
# The lock a run of one part holds while it runs (shardio.parts._part_lock).
_PART_LOCK = re.compile(r"\.shardio-part-(\d+)-of-(\d+)\.lock")
DICT_NAME = "zstd.dict"
_DIGEST_XATTR = "user.shardio.digest"  # an HDF5 shard's "<algorithm>:<digest>:<bytes>"


def _check_paths(src: str, out: str, files_from: str | None) -> None:
    if not os.path.isdir(src):
        raise UsageError(f"SRC {src} is not a directory")
    s, o = os.path.realpath(src), os.path.realpath(out)
    if files_from is None and (o == s or o.startswith(s.rstrip(os.sep) + os.sep)):
        raise OutputInsideSourceError(
            f"OUT {out} lies inside SRC {src}: the pack would read its own shards; choose an "
            "output directory outside SRC"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"OUT {out} exists and is not a directory")


def _shard_number(name: str, prefix: str) -> int | None:
    """The number of a shard or index file named as the packer names them
    (``<prefix>-<n:06d>.tar``, ``.tar.idx``, ``.h5``), or None for any other name."""
    m = re.fullmatch(re.escape(prefix) + r"-(\d{6,})\.(?:tar|tar\.idx|h5)", name)
    return int(m[1]) if m is not None and m[1] == f"{int(m[1]):06d}" else None


def _ours(name: str, prefix: str) -> bool:
    return (name in (MANIFEST_NAME, STATE_NAME, DICT_NAME) or TMP_MARK in name
            or _PART_FILE.fullmatch(name) is not None or _PART_LOCK.fullmatch(name) is not None
            or _shard_number(name, prefix) is not None)


def _remove_parity(out: str) -> None:
    """Delete parity files (and their temp files) a previous run left in ``OUT/parity``."""
    pdir = os.path.join(out, PARITY_DIR)
    if not os.path.isdir(pdir):
        return
    for n in os.listdir(pdir):
        if PARITY_FILE.fullmatch(n) or TMP_MARK in n:
            os.unlink(os.path.join(pdir, n))
    if not os.listdir(pdir):
        os.rmdir(pdir)


def _earlier_pack(out: str, prefix: str) -> Callable[[str], bool]:
    """Whether a name in ``out`` is a file of shardio's packs that ``--overwrite`` replaces:
    this pack's names, and those of an earlier pack made with another ``--prefix`` (the shards
    its manifest lists, or the prefix its unfinished run recorded).  A manifest ``shardio
    index`` wrote lists the user's own tars: those stay."""
    prefixes, listed = {prefix}, set()
    state = _read_json(os.path.join(out, STATE_NAME))
    if state is not None and isinstance(state.get("prefix"), str):
        prefixes.add(state["prefix"])
    try:
        earlier = Manifest.load(out) if os.path.exists(os.path.join(out, MANIFEST_NAME)) else None
    except ShardioError:  # damaged: its own prefix's files still go
        earlier = None
    if earlier is not None and earlier.job is not None:  # (a pack's, not an index's)
        listed = {p for s in earlier.shards for p in (s.path, s.index)
                  if p is not None and "/" not in p}
    return lambda name: name in listed or any(_ours(name, p) for p in prefixes)


def _lost_shards(out: str, manifest: Manifest) -> list[str]:
    """The shards of ``manifest`` (a finished pack in ``out``) whose file or index is missing,
    or whose file is not of the recorded size (a stat each: nothing is read)."""
    lost = []
    for s in manifest.shards:
        try:
            ok = os.stat(os.path.join(out, s.path)).st_size == s.bytes and (
                s.index is None or os.path.isfile(os.path.join(out, s.index)))
        except OSError:
            ok = False
        if not ok:
            lost.append(s.path)
    return lost


def _prepare_out(out: str, job: str, options: PackOptions) -> Manifest | None:
    """Decide fresh / resume / already complete; returns the manifest when already complete."""
    names = os.listdir(out) if os.path.isdir(out) else []
    if options.overwrite:
        ours = _earlier_pack(out, options.prefix)
        for n in names:
            if ours(n):
                os.unlink(os.path.join(out, n))
        _remove_parity(out)
        names = [n for n in names if not ours(n) and n != "parity"]
    state = _read_json(os.path.join(out, STATE_NAME))
    # An unfinished run of this job, or of these options over an input that changed since (or
    # that a streaming pack had not finished scanning: job None): each shard it published is
    # kept only if its own fingerprint (its files' sizes and mtimes) and bytes still match.
    if state is not None and (state.get("job") == job
                              or state.get("options") == _fingerprint(options.job_key())):
        remove_temp_files(out)
        remove_temp_files(os.path.join(out, PARITY_DIR))  # a run killed while writing parity
        return None
    if MANIFEST_NAME in names and state is None:
        try:
            existing = Manifest.load(out)
        except ShardioError:
            existing = None
        if existing is not None and existing.job == job:
            skipped = existing.stats.get("skipped")
            if options.on_error == "raise" and skipped:
                # The job leaves on_error out; this run may not pass off those skips as its own.
                raise OutputNotEmptyError(
                    f"OUT {out} holds this pack made with --on-error skip, which left out bad "
                    f"input files ({skipped}); rerun with --on-error skip to keep it, or with "
                    "--overwrite to pack again and stop at the first bad file"
                )
            lost = _lost_shards(out, existing)
            if not lost:
                return existing  # the same pack, finished: nothing to do
            # Files of the finished pack were deleted or cut since: finish it again, as a run
            # of this job killed before its manifest (every shard left is checked as one).
            log.warning("OUT %s: the manifest of this pack names %s, which %s missing or not "
                        "of the recorded size: writing %s again", out, ", ".join(lost[:3])
                        + (f" and {len(lost) - 3} more" if len(lost) > 3 else ""),
                        "is" if len(lost) == 1 else "are", "it" if len(lost) == 1 else "them")
            os.unlink(os.path.join(out, MANIFEST_NAME))
            remove_temp_files(out)
            remove_temp_files(os.path.join(out, PARITY_DIR))
            return None
    if options.resume:
        raise OutputNotEmptyError(
            f"--resume: {out} holds no unfinished run of a pack with these options (a finished "
            "pack, or one with other options); rerun without --resume and with --overwrite to "
            "start over"
        )
    if names and not options.overwrite:
        raise OutputNotEmptyError(
            f"OUT {out} is not empty and holds no unfinished run of a pack with these options; "
            "pass --overwrite to replace the shardio files in it, or choose an empty directory"
        )
    return None


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_done(task: _Task, options: PackOptions) -> tuple[WrittenShard, Counter[str]] | None:
    """A published shard of this job whose bytes still hash to the digest recorded when it was
    written, and the files it skipped; None when it must be written again."""
    fmt = options.format
    if not os.path.exists(task.final):
        return None
    try:
        if fmt != "tar":
            # Hashed before h5py parses it: damaged HDF5 metadata can crash or hang the library.
            recorded = _recorded_digest(task.final)
            if recorded is None or file_digest(task.final) != recorded:
                return None
        index = load_index(fmt, task.final)
        if index.meta.get("job_shard") != task.fingerprint:
            return None
        skipped = _skip_counts(index.meta)
        # A shard that left files out is no shard of an on_error="raise" run: written again, the
        # first file it cannot read raises, as in an uninterrupted run.
        if skipped is None or (skipped and options.on_error == "raise"):
            return None
        idx_path = task.final + ".idx" if fmt == "tar" else None
        if idx_path:
            recorded = (index.meta.get("shard_digest"), index.meta.get("shard_bytes"))
            if file_digest(task.final) != recorded:
                return None
        digest, size = recorded
        idx_digest = file_digest(idx_path)[0] if idx_path else index.digest
    except (ShardioError, OSError):
        return None
    fields = Counter(index.field_names[int(n)] for n in index.f_name)
    return WrittenShard(
        path=task.final, index_path=idx_path, samples=len(index), bytes=size, digest=digest,
        index_digest=idx_digest, stored_bytes=index.stored_bytes, raw_bytes=index.raw_bytes,
        fields=dict(fields),
    ), skipped


def _skip_counts(meta: dict[str, Any]) -> Counter[str] | None:
    """The files a shard's writer skipped (``skipped`` in its index meta; absent: none), or
    None when the entry is malformed."""
    counts = meta.get("skipped", {})
    if not isinstance(counts, dict) or not all(
            isinstance(k, str) and type(v) is int and v > 0 for k, v in counts.items()):
        return None
    return Counter(counts)


def _record_digest(written: WrittenShard) -> None:
    """Record a just-published HDF5 shard's digest and size on it (module docstring); where the
    filesystem refuses user xattrs, a resume writes the shard again instead of keeping it."""
    value = f"{DEFAULT_DIGEST}:{written.digest}:{written.bytes}".encode()
    try:
        os.setxattr(written.path, _DIGEST_XATTR, value)
    except (OSError, AttributeError):  # AttributeError: no os.setxattr (not Linux)
        pass


def _recorded_digest(path: str) -> tuple[str, int] | None:
    """``(digest, bytes)`` :func:`_record_digest` left on ``path``, or None."""
    try:
        algorithm, digest, size = os.getxattr(path, _DIGEST_XATTR).decode("ascii").split(":")
    except (OSError, AttributeError, UnicodeDecodeError, ValueError):
        return None
    if algorithm != DEFAULT_DIGEST or not size.isdigit():
        return None
    return digest, int(size)


def _remove_stale_shards(out: str, prefix: str, count: int) -> None:
    """Delete shards and indexes numbered ``count`` or more: an earlier run of this job
    planned more shards (its input has shrunk since), and none may outlive it beside the
    manifest.  Only names this prefix's shards are written under are touched."""
    for name in os.listdir(out):
        n = _shard_number(name, prefix)
        if n is None or n < count:
            continue
        try:
            os.unlink(os.path.join(out, name))
        except FileNotFoundError:
            pass


def _empty(out: str) -> bool:
    """Whether OUT is missing or an empty directory (a fresh pack: nothing to resume)."""
    try:
        with os.scandir(out) as it:
            return next(it, None) is None
    except FileNotFoundError:
        return True
    except OSError:
        return False  # the full path reports it


def _make_out(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise translate_oserror(exc, out, "creating") from exc


def _write_state(out: str, options: PackOptions, job: str | None, shards: int | None,
                 codec: Codec, fsync: bool) -> None:
    """The resumable state of an unfinished pack: its job fingerprint (None while a streaming
    pack is still scanning) and a fingerprint of its output options."""
    # Without --no-fsync the state file is synced like the shards; with it, syncing this one
    # small file would only cost a journal commit (~15 ms) and guard nothing.
    atomic_write_bytes(os.path.join(out, STATE_NAME), json.dumps({
        "job": job, "options": _fingerprint(options.job_key()), "shards": shards,
        "prefix": options.prefix,  # (what a later --overwrite with another prefix removes)
        "created_by": f"shardio {__version__}",
        "dictionary_digest": digest_bytes(codec.dictionary) if codec.dictionary else None,
    }).encode(), fsync=fsync)
