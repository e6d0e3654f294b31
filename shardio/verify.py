"""``shardio verify``: recompute every checksum of a dataset and list what is wrong.

Detects a flipped bit anywhere (whole-shard digest, per-field checksums, the index's own
checksum, the manifest's own digest), truncation at any point (sizes are recorded, so a cut at a
tar member boundary, which tar itself accepts, is caught), missing shards, shard files in the
dataset directory that the manifest does not list, and an edited manifest.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from ._fsutil import TMP_MARK, resolve_in
from .checksum import digest_bytes, file_digest
from .errors import ShardioError
from .formats import Problem, load_index, verify_fields
from .manifest import MANIFEST_NAME, Manifest, ShardEntry, _body_digest

__all__ = ["Problem", "verify_dataset"]

_SHARD_SUFFIXES = (".tar", ".tar.idx", ".h5", ".idx")


def _verify_shard(root: str, fmt: str, entry: ShardEntry, samples_expected: int) -> list[Problem]:
    path = resolve_in(root, entry.path)
    if not os.path.exists(path):
        return [Problem(entry.path, "missing shard (listed in the manifest, not on disk)")]
    problems: list[Problem] = []
    try:
        digest, size = file_digest(path)
    except OSError as exc:
        return [Problem(entry.path, f"read error ({exc.strerror})")]
    if size != entry.bytes:
        what = "truncated" if size < entry.bytes else "size differs"
        problems.append(Problem(entry.path, what, expected=f"{entry.bytes} bytes",
                                found=f"{size} bytes"))
    if digest != entry.digest:
        problems.append(Problem(entry.path, "shard digest mismatch", expected=entry.digest,
                                found=digest))
    if entry.index is not None:
        ipath = resolve_in(root, entry.index)
        if not os.path.exists(ipath):
            return problems + [Problem(entry.index, "missing index")]
        idigest = file_digest(ipath)[0]
        if entry.index_digest and idigest != entry.index_digest:
            problems.append(Problem(entry.index, "index digest mismatch",
                                    expected=entry.index_digest, found=idigest))
    try:
        index = load_index(fmt, path)
    except ShardioError as exc:
        return problems + [Problem(entry.index or entry.path, f"unreadable index: {exc}")]
    if len(index) != samples_expected:
        problems.append(Problem(entry.path, "sample count differs from the manifest",
                                expected=str(samples_expected), found=str(len(index))))
    problems += [Problem(entry.path, p.what, p.key, p.field, p.offset, p.expected, p.found)
                 for p in verify_fields(path, index)]
    return problems


def _manifest_problems(root: str) -> tuple[Manifest | None, list[Problem]]:
    path = os.path.join(root, MANIFEST_NAME)
    try:
        manifest = Manifest.load(root, strict=False)
    except ShardioError as exc:
        return None, [Problem(MANIFEST_NAME, f"unusable manifest: {exc}")]
    problems = []
    with open(path, "rb") as f:
        data = json.load(f)
    if data.get("manifest_digest") != _body_digest(data):
        problems.append(Problem(MANIFEST_NAME, "manifest edited or damaged (its digest does not "
                                "match its content)", expected=data.get("manifest_digest"),
                                found=_body_digest(data)))
    comp = manifest.compression or {}
    if comp.get("dictionary"):
        dpath = resolve_in(root, comp["dictionary"])
        if not os.path.exists(dpath):
            problems.append(Problem(comp["dictionary"], "missing zstd dictionary"))
        else:
            with open(dpath, "rb") as f:
                found = digest_bytes(f.read())
            if found != comp.get("dictionary_digest"):
                problems.append(Problem(comp["dictionary"], "dictionary digest mismatch",
                                        expected=comp.get("dictionary_digest"), found=found))
    return manifest, problems


def _extra_files(root: str, manifest: Manifest) -> list[Problem]:
    known = {os.path.normpath(s.path) for s in manifest.shards}
    known |= {os.path.normpath(s.index) for s in manifest.shards if s.index}
    extra = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for name in sorted(filenames):
            if TMP_MARK in name or not name.endswith(_SHARD_SUFFIXES):
                continue
            rel = os.path.normpath(os.path.relpath(os.path.join(dirpath, name), root))
            if rel not in known:
                extra.append(Problem(rel, "extra shard file not listed in the manifest"))
    return extra


def verify_dataset(root: str | os.PathLike[str], workers: int = 1) -> list[Problem]:
    """Check a dataset end to end; return the problems found (empty when clean).

    Args:
        root: dataset directory.
        workers: processes hashing shards in parallel.
    """
    root = os.fspath(root)
    manifest, problems = _manifest_problems(root)
    if manifest is None:
        return problems
    problems += _extra_files(root, manifest)
    jobs = [(root, manifest.shard_format, e, e.samples) for e in manifest.shards]
    if workers <= 1 or len(jobs) <= 1:
        results = [_verify_shard(*j) for j in jobs]
    else:
        with ProcessPoolExecutor(min(workers, len(jobs)), mp_context=get_context("spawn")) as ex:
            results = list(ex.map(_verify_shard, *zip(*jobs)))
    for r in results:
        problems += r
    return problems
