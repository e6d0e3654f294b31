"""A pack's output directory: what a rerun finds there and decides, and the state it resumes from.

``OUT`` holds the manifest (last, atomically), the shards with their ``.idx`` files, an optional
``zstd.dict`` and, while a pack is unfinished, the state file ``.shardio-pack.json``: the job
fingerprint (``null`` while a streaming pack still scans) and a fingerprint of the output
options (:mod:`shardio.packplan`).  :func:`_prepare_out` decides between a fresh start, a resume
(temp files of a killed run are removed; :func:`_is_done` keeps each published shard whose
fingerprint matches its new plan and whose bytes still hash to what its index promises) and a
pack that is already complete; anything else in a non-empty ``OUT`` is refused unless
``--overwrite``, which deletes only shardio's own files (:func:`_ours`).
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from typing import Any

from . import __version__
from ._fsutil import TMP_MARK, atomic_write_bytes, remove_temp_files, translate_oserror
from ._packpool import Task as _Task
from .checksum import digest_bytes, file_digest
from .codec import Codec
from .config import PackOptions
from .errors import (
    OutputInsideSourceError,
    OutputNotEmptyError,
    ShardioError,
    UsageError,
)
from .formats import WrittenShard, load_index, verify_fields
from .manifest import MANIFEST_NAME, Manifest
from .packplan import _fingerprint

__all__ = ["DICT_NAME", "STATE_NAME"]

STATE_NAME = ".shardio-pack.json"
# Part records and per-part state files of a multi-node pack (shardio.parts).
_PART_FILE = re.compile(r"\.shardio-(part|pack)-(\d+)-of-(\d+)\.json")
DICT_NAME = "zstd.dict"


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


def _ours(name: str, prefix: str) -> bool:
    return (name in (MANIFEST_NAME, STATE_NAME, DICT_NAME) or TMP_MARK in name
            or _PART_FILE.fullmatch(name) is not None
            or re.fullmatch(re.escape(prefix) + r"-\d{6}\.(tar|tar\.idx|h5)", name) is not None)


def _remove_parity(out: str) -> None:
    """Delete parity files a previous ``--parity`` run left in ``OUT/parity``."""
    pdir = os.path.join(out, "parity")
    if not os.path.isdir(pdir):
        return
    for n in os.listdir(pdir):
        if re.fullmatch(r"g\d{6}\.p\d+", n) or TMP_MARK in n:
            os.unlink(os.path.join(pdir, n))
    if not os.listdir(pdir):
        os.rmdir(pdir)


def _prepare_out(out: str, job: str, options: PackOptions) -> Manifest | None:
    """Decide fresh / resume / already complete; returns the manifest when already complete."""
    names = os.listdir(out) if os.path.isdir(out) else []
    if options.overwrite:
        for n in names:
            if _ours(n, options.prefix):
                os.unlink(os.path.join(out, n))
        _remove_parity(out)
        names = [n for n in names if not _ours(n, options.prefix) and n != "parity"]
    state = _read_json(os.path.join(out, STATE_NAME))
    # (job None: a streaming pack stopped before its scan ended; then the options must match)
    if state is not None and (state.get("job") == job or (
            state.get("job") is None
            and state.get("options") == _fingerprint(options.output_key()))):
        remove_temp_files(out)
        return None
    if MANIFEST_NAME in names and state is None:
        try:
            existing = Manifest.load(out)
        except ShardioError:
            existing = None
        if existing is not None and existing.job == job:
            return existing
    if options.resume:
        raise OutputNotEmptyError(
            f"--resume: {out} holds no unfinished run of this job (the input or the options "
            "changed); rerun without --resume and with --overwrite to start over"
        )
    if names and not options.overwrite:
        raise OutputNotEmptyError(
            f"OUT {out} is not empty and holds no unfinished run of this job; pass --overwrite to "
            "replace the shardio files in it, or choose an empty directory"
        )
    return None


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_done(task: _Task, fmt: str) -> WrittenShard | None:
    """A published shard of this job that still hashes to what its index promises, or None."""
    if not os.path.exists(task.final):
        return None
    try:
        index = load_index(fmt, task.final)
        if index.meta.get("job_shard") != task.fingerprint:
            return None
        digest, size = file_digest(task.final)
        idx_path = task.final + ".idx" if fmt == "tar" else None
        idx_digest = file_digest(idx_path)[0] if idx_path else ""
        if idx_path:
            if (index.meta.get("shard_digest"), index.meta.get("shard_bytes")) != (digest, size):
                return None
        elif verify_fields(task.final, index):
            return None
    except (ShardioError, OSError):
        return None
    fields = Counter(index.field_names[int(n)] for n in index.f_name)
    return WrittenShard(
        path=task.final, index_path=idx_path, samples=len(index), bytes=size, digest=digest,
        index_digest=idx_digest, stored_bytes=index.stored_bytes, raw_bytes=index.raw_bytes,
        fields=dict(fields),
    )


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
        "job": job, "options": _fingerprint(options.output_key()), "shards": shards,
        "created_by": f"shardio {__version__}",
        "dictionary_digest": digest_bytes(codec.dictionary) if codec.dictionary else None,
    }).encode(), fsync=fsync)
