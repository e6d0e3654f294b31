"""``shardio verify``: recompute every checksum of a dataset and list what is wrong.

Detects a flipped bit anywhere (whole-shard digest, per-field checksums, the index's own
checksum, the manifest's own digest, parity files), truncation at any point (sizes are recorded,
so a cut at a tar member boundary, which tar itself accepts, is caught; a manifest must also be
byte for byte what shardio writes, so a cut of its final newline is caught), missing shards and
parity files, shard and parity files in the dataset directory that the manifest does not list,
and an edited manifest (one whose values have the wrong JSON type included).  In a damaged tar
shard it also locates damage no field checksum covers: member headers, pax and long-name blocks,
zero padding and end-of-archive blocks (:mod:`shardio.formats.tarcheck`).  Whatever is wrong,
the finding is a :class:`Problem`, never an exception.

A damaged HDF5 shard (its digest does not match) is never parsed in this process: a flipped bit
in its HDF5 metadata can crash or hang the HDF5 library, so its index is loaded in a child
process with a time limit, and a crash or a hang there is one more problem line.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from multiprocessing import get_context
from typing import Any

import numpy as np

from ._fsutil import TMP_MARK, open_regular, pread_full, read_regular, resolve_in
from .checksum import digest_bytes, file_digest
from .codec import FLAG_ZSTD, Codec
from .errors import ShardioError
from .formats import Problem, ShardIndex, load_index, verify_fields
from .formats.tarcheck import tar_structure_problems
from .manifest import (
    MANIFEST_NAME,
    Manifest,
    ShardEntry,
    _body_digest,
    _canonical_json,
    dataset_dir,
)
from .parity import PARITY_DIR, PARITY_FILE
from .reader import load_codec
from .repair import rebuilt_index_matches

__all__ = ["Problem", "verify_dataset"]

_SHARD_SUFFIXES = (".tar", ".tar.idx", ".h5", ".idx")
# Seconds a damaged HDF5 shard's index may take to load in its child process: a sound index loads
# in well under a second; past this the HDF5 library is taken to hang on the damaged metadata.
_PARSE_TIMEOUT = 10.0
_CHILD = ("import sys\n"
          "from shardio.verify import _load_index_child\n"
          "_load_index_child(sys.argv[1], sys.argv[2])\n")


def _load_index_child(fmt: str, path: str) -> None:
    """Body of the child process: load the index, write ``(True, index)`` or ``(False, why)``
    pickled to stdout."""
    try:
        result: tuple[bool, Any] = (True, load_index(fmt, path))
    except ShardioError as exc:
        result = (False, str(exc))
    sys.stdout.buffer.write(pickle.dumps(result))


def _load_index_isolated(fmt: str, path: str, timeout: float = _PARSE_TIMEOUT) -> ShardIndex | str:
    """``load_index`` in a child process; return the index, or why it could not be loaded
    (the child's error, its crash, or its running past ``timeout`` seconds)."""
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
    try:
        # stderr is dropped: the HDF5 library prints pages of diagnostics on damaged metadata.
        done = subprocess.run([sys.executable, "-c", _CHILD, fmt, path], env=env,
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return (f"loading the index of the damaged shard {path} did not finish within "
                f"{timeout:g} s (the HDF5 library hangs on its metadata); restore the shard "
                "from a good copy or repack")
    if done.returncode < 0:
        try:
            how = signal.Signals(-done.returncode).name
        except ValueError:
            how = f"signal {-done.returncode}"
        return (f"the HDF5 library crashed ({how}) reading the metadata of the damaged shard "
                f"{path}; restore it from a good copy or repack")
    if done.returncode != 0:  # it failed before it could answer (e.g. out of memory)
        return (f"loading the index of the damaged shard {path} failed (exit status "
                f"{done.returncode}); restore it from a good copy or repack")
    ok, value = pickle.loads(done.stdout)  # our own child's answer
    return value if ok else str(value)


def _verify_shard(root: str, fmt: str, entry: ShardEntry, algorithm: str,
                  codec: Codec | None = None, packed: bool = True) -> list[Problem]:
    problems: list[Problem] = []
    try:
        _check_shard(root, fmt, entry, algorithm, problems, codec, packed)
    except Exception as exc:  # noqa: BLE001  (a finding, not a crash: the rest is still checked)
        problems.append(Problem(entry.path, f"cannot verify ({type(exc).__name__}: {exc})"))
    return problems


def _check_shard(root: str, fmt: str, entry: ShardEntry, algorithm: str,
                 problems: list[Problem], codec: Codec | None = None, packed: bool = True) -> None:
    """Append what is wrong with one shard: its bytes, its index, every field's checksum, the
    tar structure around the fields of a damaged tar shard (``packed``: shardio wrote it, rather
    than another tool whose tar ``shardio index`` read; see :mod:`shardio.formats.tarcheck`),
    and whether its compressed fields decode with the dataset's ``codec`` (None: the manifest's
    compression settings or dictionary could not be loaded, a problem reported already)."""
    path = resolve_in(root, entry.path)
    if not os.path.exists(path):
        problems.append(Problem(entry.path, "missing shard (listed in the manifest, not on disk)"))
        return
    damaged = _check_file(path, entry.path, entry.bytes, entry.digest, "shard", algorithm,
                          problems)
    if damaged is None:
        return
    if entry.index is not None:
        ipath = resolve_in(root, entry.index)
        if not os.path.exists(ipath):
            problems.append(Problem(entry.index, "missing index"))
            return
        idigest = file_digest(ipath)[0]
    if damaged and fmt == "hdf5":  # the index is HDF5 metadata inside the damaged file
        index: ShardIndex | str = _load_index_isolated(fmt, path)
    else:
        try:
            index = load_index(fmt, path)
        except ShardioError as exc:
            index = str(exc)
    if entry.index is not None and entry.index_digest and idigest != entry.index_digest and (
            isinstance(index, str) or not rebuilt_index_matches(index, entry)):
        # (An index read from a verified copy of the shard after a parity rebuild is not the
        # packer's, but says the same: its samples are checked below like any other's.)
        problems.append(Problem(entry.index, "index digest mismatch",
                                expected=entry.index_digest, found=idigest))
    if isinstance(index, str):
        problems.append(Problem(entry.index or entry.path, f"unreadable index: {index}"))
        return
    if (entry.index is None and entry.index_digest and index.digest != entry.index_digest
            and not rebuilt_index_matches(index, entry)):
        # An HDF5 shard's index digest is inside it (readers refuse one that differs).
        problems.append(Problem(entry.path, "index digest mismatch",
                                expected=entry.index_digest, found=index.digest or "none"))
    if len(index) != entry.samples:
        problems.append(Problem(entry.path, "sample count differs from the manifest",
                                expected=str(entry.samples), found=str(len(index))))
    fields = verify_fields(path, index)
    problems.extend(Problem(entry.path, p.what, p.key, p.field, p.offset, p.expected, p.found)
                    for p in fields)
    if damaged and fmt == "tar":
        # Headers, padding and end blocks: only the digest covers them, which says nothing of
        # where.  (An intact shard is skipped: its bytes are what was packed or indexed.)
        problems.extend(replace(p, path=entry.path)
                        for p in tar_structure_problems(path, index, packed, entry.bytes))
    if not fields:
        _check_decode(path, entry, index, codec, problems)


def _check_decode(path: str, entry: ShardEntry, index: ShardIndex, codec: Codec | None,
                  problems: list[Problem]) -> None:
    """The shard's first compressed field (its stored bytes checked) decodes with ``codec``:
    compression settings or a dictionary that are not the pack's pass every checksum, and
    every reader then fails."""
    rows = np.flatnonzero(index.f_flags & FLAG_ZSTD)
    if not len(rows):
        return
    if codec is None:
        return
    r = int(rows[0])
    k = int(np.searchsorted(index.sample_start, r, side="right")) - 1
    where = (index.key(k), index.field_names[int(index.f_name[r])], int(index.f_offset[r]))
    if codec.name != "zstd":
        problems.append(Problem(entry.path, "zstd-compressed fields, but the manifest's "
                                "compression names no zstd codec", *where))
        return
    fd = open_regular(path)
    try:
        stored = pread_full(fd, int(index.f_length[r]), int(index.f_offset[r]))
    finally:
        os.close(fd)
    try:
        codec.decode(stored, FLAG_ZSTD, int(index.f_raw_length[r]))
    except ShardioError as exc:
        problems.append(Problem(entry.path, f"compressed field does not decode: {exc}", *where))


def _check_file(path: str, rel: str, size: int, digest: str, kind: str, algorithm: str,
                problems: list[Problem]) -> bool | None:
    """Hash ``path`` against its recorded size and digest, appending what differs; return
    whether it differs, or None when it cannot be read."""
    try:
        found, nbytes = file_digest(path, algorithm)
    except OSError as exc:
        problems.append(Problem(rel, f"read error ({exc.strerror or exc})"))
        return None
    if nbytes != size:
        what = "truncated" if nbytes < size else "size differs"
        problems.append(Problem(rel, what, expected=f"{size} bytes", found=f"{nbytes} bytes"))
    if found != digest:
        problems.append(Problem(rel, f"{kind} digest mismatch", expected=digest, found=found))
    return nbytes != size or found != digest


def _verify_parity_file(root: str, rel: str, size: int, digest: str,
                        algorithm: str) -> list[Problem]:
    problems: list[Problem] = []
    try:
        path = resolve_in(root, rel)
        if not os.path.exists(path):
            return [Problem(rel, "missing parity file (listed in the manifest, not on disk)")]
        _check_file(path, rel, size, digest, "parity", algorithm, problems)
    except Exception as exc:  # noqa: BLE001  (a finding, not a crash: an unsafe path, ...)
        problems.append(Problem(str(rel), f"cannot verify ({type(exc).__name__}: {exc})"))
    return problems


def _parity_files(manifest: Manifest) -> tuple[list[tuple[str, int, str]], list[Problem]]:
    """``(path, bytes, digest)`` of every parity file the manifest lists (see
    :mod:`shardio.parity`), or the problem with its parity section."""
    if not manifest.parity:
        return [], []
    try:
        files = [(rel, size, digest) for group in manifest.parity["groups"]
                 for rel, digest, size in zip(group["files"], group["digests"], group["bytes"],
                                              strict=True)]
    except (KeyError, TypeError, ValueError) as exc:
        return [], [Problem(MANIFEST_NAME, f"malformed parity section ({exc!r}); restore the "
                            "manifest, or repack with --parity")]
    return files, []


def _manifest_problems(root: str) -> tuple[Manifest | None, list[Problem]]:
    problems = []
    try:
        raw = read_regular(os.path.join(root, MANIFEST_NAME))
        data = json.loads(raw)
    except (OSError, ValueError, RecursionError):  # (RecursionError: nested too deep)
        data = None  # Manifest.load says what is wrong
    if isinstance(data, dict) and data.get("format") == "shardio":
        # The digest first: it says the manifest was edited, before a bad value says how.
        found = _body_digest(data)
        if data.get("manifest_digest") != found:
            problems.append(Problem(MANIFEST_NAME, "manifest edited or damaged (its digest does "
                                    "not match its content)",
                                    expected=str(data.get("manifest_digest")), found=found))
        elif raw != _canonical_json(data):
            problems.append(Problem(MANIFEST_NAME, "manifest file is not byte for byte what "
                                    "shardio wrote (cut or reformatted; its content is intact): "
                                    "restore it from a good copy"))
    try:
        manifest = Manifest.load(root, strict=False)
    except ShardioError as exc:
        return None, problems + [Problem(MANIFEST_NAME, f"unusable manifest: {exc}")]
    if isinstance(data, dict) and data.get("num_samples") != manifest.num_samples:
        problems.append(Problem(MANIFEST_NAME, "num_samples is not the sum of the shards' samples",
                                expected=str(manifest.num_samples),
                                found=repr(data.get("num_samples"))))
    comp = manifest.compression or {}
    if comp.get("dictionary"):
        dpath = resolve_in(root, comp["dictionary"])
        if not os.path.exists(dpath):
            problems.append(Problem(comp["dictionary"], "missing zstd dictionary"))
        else:
            try:
                dict_digest = digest_bytes(read_regular(dpath))
            except OSError as exc:
                problems.append(Problem(comp["dictionary"], f"read error ({exc.strerror or exc})"))
            else:
                if dict_digest != comp.get("dictionary_digest"):
                    problems.append(Problem(comp["dictionary"], "dictionary digest mismatch",
                                            expected=comp.get("dictionary_digest"),
                                            found=dict_digest))
    return manifest, problems


def _extra_files(root: str, manifest: Manifest, parity: set[str] | None) -> list[Problem]:
    """Shard and parity files the manifest does not list (``parity`` None: its parity section
    is unreadable, so no parity file is called extra)."""
    known = {os.path.normpath(s.path) for s in manifest.shards}
    known |= {os.path.normpath(s.index) for s in manifest.shards if s.index}
    extra = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if TMP_MARK in name:
                continue
            rel = os.path.normpath(os.path.relpath(os.path.join(dirpath, name), root))
            if name.endswith(_SHARD_SUFFIXES) and rel not in known:
                extra.append(Problem(rel, "extra shard file not listed in the manifest"))
            elif (parity is not None and os.path.dirname(rel) == PARITY_DIR
                  and PARITY_FILE.fullmatch(name) and rel not in parity):
                extra.append(Problem(rel, "extra parity file not listed in the manifest"))
    return extra


def verify_dataset(root: str | os.PathLike[str], workers: int = 1) -> list[Problem]:
    """Check a dataset end to end; return the problems found (empty when clean).

    Args:
        root: dataset directory.
        workers: processes hashing shards and parity files in parallel.
    """
    root = dataset_dir(root)
    manifest, problems = _manifest_problems(root)
    if manifest is None:
        return problems
    parity, parity_problems = _parity_files(manifest)
    problems += parity_problems
    listed = None if parity_problems else {
        os.path.normpath(rel) for rel, _size, _digest in parity if isinstance(rel, str)}
    problems += _extra_files(root, manifest, listed)
    try:
        codec: Codec | None = load_codec(root, manifest)
    except ShardioError:  # a bad dictionary file: listed by _manifest_problems
        codec = None
    # A dataset `shardio index` made is tars another tool wrote (pax headers, other mtimes, ...).
    packed = not (manifest.stats.get("indexed_in_place")
                  or manifest.created_by.endswith("(index)"))
    jobs: list[tuple[str, Callable[..., list[Problem]], tuple[Any, ...]]] = [
        (e.path, _verify_shard, (root, manifest.shard_format, e, manifest.digest, codec, packed))
        for e in manifest.shards]
    jobs += [(str(rel), _verify_parity_file, (root, rel, size, digest, manifest.digest))
             for rel, size, digest in parity]
    if workers <= 1 or len(jobs) <= 1:
        results = [fn(*args) for _rel, fn, args in jobs]
    else:
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("spawn")) as ex:
            futures = [(rel, ex.submit(fn, *args)) for rel, fn, args in jobs]
            results = [_result(rel, fut) for rel, fut in futures]
    for r in results:
        problems += r
    return problems


def _result(rel: str, fut: Future[list[Problem]]) -> list[Problem]:
    try:
        return fut.result()
    except Exception as exc:  # noqa: BLE001  (a worker that died, BrokenProcessPool, too)
        return [Problem(rel, f"cannot verify ({type(exc).__name__}: {exc})")]
