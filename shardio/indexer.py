"""``shardio index``: make existing WebDataset tars readable by shardio without rewriting them.

Each tar gets an ``<tar>.idx`` beside it and the tars' common directory gets a ``manifest.json``
listing them by relative path.  Samples are grouped exactly as WebDataset groups them.
"""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any

from . import __version__
from ._fsutil import atomic_write_bytes
from .checksum import DEFAULT_DIGEST, DEFAULT_SAMPLE, digest_bytes, file_digest
from .errors import OutputNotEmptyError, ShardioError, UsageError
from .formats.tar import index_tar
from .manifest import MANIFEST_NAME, Manifest, ShardEntry

__all__ = ["index_tars"]


def _index_one(path: str, rel: str, checksum: str) -> tuple[ShardEntry, dict[str, int]]:
    digest, size = file_digest(path)
    index, counts = index_tar(path, checksum)
    index.meta.update(shard_bytes=size, shard_digest=digest)
    blob = index.to_bytes()
    atomic_write_bytes(path + ".idx", blob)
    entry = ShardEntry(
        path=rel, samples=len(index), bytes=size, digest=digest, index=rel + ".idx",
        index_digest=digest_bytes(blob), stored_bytes=index.stored_bytes,
        raw_bytes=index.raw_bytes,
    )
    return entry, counts


def _refuse_a_dataset_above(paths: list[str], checked: set[str]) -> None:
    """Refuse tars that a dataset in a directory above them lists (one not in ``checked``,
    whose manifest refuses any tar): their ``.idx`` files are that dataset's, and indexing
    anew would replace them (with another checksum, say), which breaks it."""
    above: set[str] = set()
    for p in paths:
        d = os.path.dirname(p)
        while d not in above:
            above.add(d)
            up = os.path.dirname(d)
            if up == d:
                break
            d = up
    for d in sorted(above - checked):
        found = os.path.join(d, MANIFEST_NAME)
        if not os.path.isfile(found):
            continue
        try:
            listed = {os.path.normpath(os.path.join(d, s.path)) for s in Manifest.load(d).shards}
        except ShardioError:  # not shardio's, or damaged: no claim on these tars
            continue
        for p in paths:
            if os.path.normpath(p) in listed:
                raise OutputNotEmptyError(
                    f"{p} is a shard of the dataset {d} (its manifest {found} lists it), whose "
                    "index indexing would replace; to check or repair that dataset use "
                    "`shardio verify` or `shardio repair`, to index the tar anew anyway pass "
                    "--overwrite")


def index_tars(
    tars: list[str | os.PathLike[str]],
    *,
    root: str | os.PathLike[str] | None = None,
    checksum: str = DEFAULT_SAMPLE,
    workers: int = 1,
    overwrite: bool = False,
) -> Manifest:
    """Index existing tar shards in place and publish a manifest for them.

    Args:
        tars: tar files, in the order the dataset should list them.
        root: dataset directory for the manifest; default the tars' common directory. Every tar
            must lie inside it.
        checksum: per-sample checksum algorithm to record.
        workers: processes indexing tars in parallel.
        overwrite: replace the manifest already in ``root`` (and the tars' ``.idx`` files).

    Raises:
        OutputNotEmptyError: ``root`` already has a manifest (a packed or indexed dataset),
            without ``overwrite``.
        UsageError: no tars, duplicates, or a tar outside ``root``.
        NotATarError: a file is not an uncompressed tar.
    """
    paths = [os.path.abspath(os.fspath(t)) for t in tars]
    if not paths:
        raise UsageError("give at least one tar file to index")
    real = [os.path.realpath(p) for p in paths]  # (a symlink to a tar given is that tar)
    if len(set(real)) != len(real):
        raise UsageError("a tar is listed twice (perhaps once through a symlink); list each "
                         "shard once")
    for p in paths:
        if not os.path.isfile(p):
            raise UsageError(f"{p} is not a file")
    for p in paths:
        if os.path.realpath(p + ".idx") in real:
            raise UsageError(f"{p}.idx is one of the tars given, and {p}'s index would be "
                             f"written over it; rename that tar (shardio writes each tar's "
                             "index beside it as TAR.idx)")
    base = os.path.abspath(os.fspath(root)) if root is not None else os.path.commonpath(
        [os.path.dirname(p) for p in paths])
    rels = []
    for p in paths:
        rel = os.path.relpath(p, base)
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            raise UsageError(
                f"{p} lies outside the dataset directory {base}; manifests only list files "
                "below their directory: pass --root with a directory containing every tar"
            )
        rels.append(rel.replace(os.sep, "/"))
    checked = {base, *(os.path.dirname(p) for p in paths)}
    for d in sorted(checked):
        existing = os.path.join(d, MANIFEST_NAME)
        if os.path.exists(existing) and not overwrite:
            # Indexing a shard of a packed dataset would replace its manifest (labels, parity,
            # every other shard) with one listing the given tars, and its .idx files.
            raise OutputNotEmptyError(
                f"{existing} exists: {d} is already a dataset, whose manifest and indexes "
                "indexing would replace; to check or repair it use `shardio verify` or "
                "`shardio repair`, to index these tars anew anyway pass --overwrite")
    if not overwrite:
        _refuse_a_dataset_above(paths, checked)
    jobs = [(p, r, checksum) for p, r in zip(paths, rels)]
    if workers <= 1 or len(jobs) <= 1:
        results = [_index_one(*j) for j in jobs]
    else:
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("spawn")) as ex:
            results = list(ex.map(_index_one, *zip(*jobs)))
    fields: Counter[str] = Counter()
    for _e, counts in results:
        fields.update(counts)
    entries = [e for e, _c in results]
    stats: dict[str, Any] = {
        "files_in": sum(fields.values()), "samples": sum(e.samples for e in entries),
        "shards": len(entries), "raw_bytes": sum(e.raw_bytes for e in entries),
        "stored_bytes": sum(e.stored_bytes for e in entries),
        "shard_bytes": sum(e.bytes for e in entries), "compression_ratio": 1.0, "skipped": {},
        "indexed_in_place": True,
    }
    manifest = Manifest(
        shard_format="tar", shards=entries, fields=dict(fields), checksum=checksum,
        digest=DEFAULT_DIGEST, stats=stats, created_by=f"shardio {__version__} (index)",
    )
    manifest.save(base)
    return manifest
