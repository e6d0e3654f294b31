"""Multi-node packing: ``shardio pack --part I/N`` writes one part of the global shard plan,
``shardio merge OUT`` publishes the manifest once every part has finished.

Every part scans the same input and computes the same global plan (:func:`shardio.packplan.plan_shards`)
and job fingerprint (which include neither I nor N), then writes a contiguous, byte-balanced share
of the shards (:func:`split_plan`) under their global names, and publishes last, atomically, a
part record ``.shardio-part-IIII-of-NNNN.json`` with the facts the manifest needs.  ``merge``
checks the records (missing, duplicated or foreign parts, gaps, missing, wrong-size or foreign
shards) and publishes through the same :func:`shardio.packer._publish` as a single-process
pack, so the merged dataset is byte-identical whatever N was.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]

from . import __version__
from ._fsutil import (
    TMP_MARK,
    atomic_write_bytes,
    remove_temp_files,
    resolve_in,
    translate_oserror,
)
from ._scan import ScanResult
from .checksum import digest_bytes, file_digest
from .codec import Codec
from .config import PackOptions
from .errors import (
    ManifestCorruptError,
    ManifestError,
    ManifestNotFoundError,
    ManifestVersionError,
    OutputNotEmptyError,
    PartInProgressError,
    ShardCorruptError,
    ShardioError,
    ShardNotFoundError,
    UsageError,
)
from .formats import WrittenShard, shard_suffix
from .manifest import MANIFEST_NAME, Manifest
from .topology import rank_from_env

__all__ = ["PartResult", "merge", "split_plan"]

from .packer import _codec, _make_tasks, _progress_bar, _publish, _write_shards
from .packplan import _TAR_END, _canonical
from .packstate import (
    _PART_FILE,
    _PART_LOCK,
    DICT_NAME,
    STATE_NAME,
    _ours,
    _read_json,
    _recorded_digest,
    _remove_parity,
)


@dataclass(frozen=True)
class PartResult:
    """What :func:`pack` did for one part of a multi-node pack (``PackOptions.part``).

    Attributes:
        part: this part's number ``I`` (from 0).
        parts: the number of parts ``N``.
        first: the first global shard number of this part.
        stop: one past its last (``first == stop``: more parts than shards, nothing to write).
        total_shards: shards in the whole job.
        shards: file names of this part's shards (their global names).
        samples: samples in them.
        bytes: their size on disk.
        planned_bytes: the plan's estimate of them, which the split between parts balances.
        kept: shards an earlier, interrupted run of this part had finished and that were kept.
        merged: the job was already merged (``manifest.json`` of this job exists): nothing done.
        record: path of the part record published last (``None`` when ``merged``).
        merge_command: the command that publishes the dataset once every part has finished.
    """

    part: int
    parts: int
    first: int
    stop: int
    total_shards: int
    shards: list[str]
    samples: int
    bytes: int
    planned_bytes: int
    kept: int
    merged: bool
    record: str | None
    merge_command: str


@dataclass
class _Job:
    """One pack job after the scan and the plan: what every part computes identically."""

    src: str
    out: str
    files_from: str | None
    options: PackOptions
    scan: ScanResult
    sizes: list[int]
    ranges: list[tuple[int, int]]
    job: str
    docs: list[str]  # each sample's job-document entry (its shard's fingerprint is made of them)


def split_plan(shard_bytes: list[int], parts: int) -> list[tuple[int, int]]:
    """Cut the global shard list into ``parts`` contiguous ``[first, stop)`` ranges of about
    equal bytes: cut ``p`` is the shard boundary nearest to ``p/parts`` of the total.

    A pure function of the plan's shard sizes and ``parts``, so every part of a job computes
    the same split.  Each cut lies within half a shard of its target, so each part's bytes lie
    within one (largest) shard of ``total/parts``.  Contiguous ranges keep each part's files
    together in the source tree.  With more parts than shards some ranges are empty.
    """
    if parts < 1:
        raise UsageError(f"parts must be >= 1, got {parts}")
    cum = [0, *accumulate(shard_bytes)]
    total, cuts = cum[-1], [0]
    for p in range(1, parts):
        target = p * total  # compared with parts * cum[j]: exact integer arithmetic
        j = bisect_left(cum, target, key=lambda c: c * parts)
        if j > 0 and target - parts * cum[j - 1] <= parts * cum[j] - target:
            j -= 1  # the nearer boundary; on a tie the earlier one
        cuts.append(max(j, cuts[-1]))
    cuts.append(len(shard_bytes))
    return [(cuts[p], cuts[p + 1]) for p in range(parts)]


def _resolve_part(spec: tuple[int, int] | str | None) -> tuple[int, int] | None:
    if spec != "auto":
        return spec  # type: ignore[return-value]  (PackOptions parsed it to (I, N) or None)
    # (only the rank and the world: local ranks play no part in choosing a part)
    rank, world = rank_from_env()
    if world < 1 or not 0 <= rank < world:
        raise UsageError(f"--part auto: rank {rank} of world size {world} from the launcher's "
                         "variables is no part; pass --part I/N")
    return rank, world


def _record_name(part: int, parts: int) -> str:
    return f".shardio-part-{part:04d}-of-{parts:04d}.json"


def _part_state_name(part: int, parts: int) -> str:
    return f".shardio-pack-{part:04d}-of-{parts:04d}.json"


def _part_lock_name(part: int, parts: int) -> str:
    return f".shardio-part-{part:04d}-of-{parts:04d}.lock"


@contextmanager
def _part_lock(out: str, part: tuple[int, int]) -> Iterator[None]:
    """Hold part ``I/N``'s lock in OUT for a run of that part (taken before the scan, so a
    second run fails at once).  Two runs of one part (a requeued job while the first still
    runs) deleted each other's temp files: the first died publishing a shard (ENOENT).

    An exclusive, non-blocking ``flock`` on ``.shardio-part-IIII-of-NNNN.lock`` (the pid and
    host of the holder inside, for the message): a second run raises
    :class:`PartInProgressError`; the kernel releases the lock of a run that dies, so a killed
    run never blocks the next.  The holder removes the file when it ends (still holding the
    lock, and a run that locked a removed file checks and takes the new one).  Where the
    filesystem refuses flock (NFS, Lustre mounted without it) runs are not serialised, as
    before, like :func:`merge`'s."""
    index, parts = part
    path = os.path.join(out, _part_lock_name(index, parts))
    fd = _take_part_lock(out, index, parts, path)
    if fd < 0:
        yield  # (no flock here: not serialised)
        return
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    except OSError:
        pass  # (the pid is for the message only)
    try:
        yield
    finally:
        _unlink_quiet(path)
        os.close(fd)


def _take_part_lock(out: str, index: int, parts: int, path: str) -> int:
    """The descriptor holding the lock file ``path`` locked, or -1 where flock is refused."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise translate_oserror(exc, path, "creating the part lock") from exc
        try:
            if fcntl is None:
                raise OSError("no flock")
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 256, 0).decode(errors="replace").split()
            except OSError:
                holder = []
            os.close(fd)
            raise _part_in_progress(out, index, parts, holder) from None
        except OSError:
            os.close(fd)  # (the file stays: merge removes it)
            return -1
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # removed (or replaced) by the run that held it before us: take the new one


def _part_in_progress(out: str, index: int, parts: int, holder: list[str]
                      ) -> PartInProgressError:
    pid = int(holder[0]) if holder and holder[0].isdigit() else 0
    host = holder[1] if len(holder) > 1 else ""
    who = (f"pid {pid}" + (f" on {host}" if host else "")) if pid else "pid unknown"
    err = PartInProgressError(
        f"another run of part {index}/{parts} is in progress in OUT {out} ({who}); two runs of "
        "one part delete each other's files: wait for that run to finish, or stop it (scancel "
        "its job, kill its process), then rerun this command (a run that died holds no lock)"
    )
    err.pid, err.host = pid, host
    return err


def _pack_part(jb: _Job, part: tuple[int, int], progress: bool | None) -> PartResult:
    """Write part ``I`` of ``N`` of the job's shards and publish its record (see module doc)."""
    index, parts = part
    out, options = jb.out, jb.options
    base = _TAR_END if options.format == "tar" else 0
    planned = [base + sum(jb.sizes[a:b]) for a, b in jb.ranges]
    first, stop = split_plan(planned, parts)[index]
    merge_cmd = f"shardio merge {shlex.quote(out)}"
    merged, claims = _prepare_part_out(jb, index, parts, first, stop)
    if merged is not None:
        entries = merged.shards[first:stop]
        return PartResult(part=index, parts=parts, first=first, stop=stop,
                          total_shards=len(jb.ranges), shards=[e.path for e in entries],
                          samples=sum(e.samples for e in entries),
                          bytes=sum(e.bytes for e in entries),
                          planned_bytes=sum(planned[first:stop]), kept=len(entries), merged=True,
                          record=None, merge_command=merge_cmd)
    state_path = os.path.join(out, _part_state_name(index, parts))

    def write_state(dict_digest: str | None) -> None:
        atomic_write_bytes(state_path, json.dumps({
            "job": jb.job, "part": index, "parts": parts, "first": first, "stop": stop,
            "created_by": f"shardio {__version__}", "dictionary_digest": dict_digest,
        }).encode(), fsync=options.fsync)

    # The state goes first: a part starting now must see this job's file before any other.
    write_state(None)
    codec = _codec(out, jb.scan.samples, options, claims)
    dict_digest = digest_bytes(codec.dictionary) if codec.dictionary else None
    if dict_digest:
        write_state(dict_digest)
    tasks = _make_tasks(jb.scan.samples, jb.docs, jb.ranges, range(first, stop), out, options,
                        jb.scan.threads, codec)
    bar = _progress_bar(progress, sum(s.size for t in tasks for s in t.samples),
                        f"packing part {index}/{parts} "
                        f"(shards {first}..{max(first, stop - 1)})")
    written, skipped, layout_note, kept = _write_shards(tasks, options, codec, out, bar)
    record = {
        "format": "shardio-part", "version": _RECORD_VERSION,
        "created_by": f"shardio {__version__}",
        "job": jb.job, "part": index, "parts": parts, "first": first, "stop": stop,
        "total_shards": len(jb.ranges), "planned_bytes": sum(planned[first:stop]),
        "total_planned_bytes": sum(planned),
        "options": options.output_key(), "fsync": options.fsync,
        "src": os.path.abspath(jb.src),
        "files_from": os.path.abspath(jb.files_from) if jb.files_from else None,
        "files_in": jb.scan.files, "labels": jb.scan.labels,
        "scan_skipped": dict(sorted(jb.scan.skipped.items())),
        "skipped": dict(sorted(skipped.items())),
        "dictionary_digest": dict_digest, "layout": layout_note,
        "shards": [_shard_fact(w) for w in written],
    }
    record_path = os.path.join(out, _record_name(index, parts))
    # The state file stays until merge: a part that listed OUT before this record appeared
    # must still find this job's file when it reads it.
    atomic_write_bytes(record_path, _record_bytes(record), fsync=options.fsync)
    return PartResult(part=index, parts=parts, first=first, stop=stop,
                      total_shards=len(jb.ranges), shards=[os.path.basename(w.path) for w in written],
                      samples=sum(w.samples for w in written), bytes=sum(w.bytes for w in written),
                      planned_bytes=sum(planned[first:stop]), kept=kept, merged=False,
                      record=record_path, merge_command=merge_cmd)


def _prepare_part_out(jb: _Job, index: int, parts: int, first: int, stop: int
                      ) -> tuple[Manifest | None, set[str]]:
    """Decide whether part ``index`` may write into OUT, which other parts share.

    Returns the manifest when this job is already merged, else the dictionary digests this
    job's records and state files claim.  Files of the same job (records, state files, shards,
    ``zstd.dict``, temp files) are expected there: other parts write them concurrently.  Anything
    else needs ``--overwrite``, which then deletes only what no part of this job can own: other
    jobs' manifest, records and state files, and shards numbered beyond this job's plan.
    Shards inside the plan are replaced by the part that owns them (when their fingerprint is
    not this job's), never by another part, so concurrent parts never delete each other's work.
    """
    out, options, job = jb.out, jb.options, jb.job
    names = os.listdir(out)
    if MANIFEST_NAME in names:
        try:
            existing = Manifest.load(out)
        except ShardioError:
            existing = None
        if existing is not None and existing.job == job:
            return existing, set()
    shard_re = re.compile(re.escape(options.prefix) + r"-(\d{6})\.(tar|tar\.idx|h5)")
    # A shard of the other format (a job of another --format before): no part of this job
    # writes that name, so none would ever replace it.
    ours_ext = ("tar", "tar.idx") if shard_suffix(options.format) == ".tar" else ("h5",)
    ours_seen, own, claims = False, False, set()
    foreign, pending = [], []
    for name in names:
        pm = _PART_FILE.fullmatch(name)
        sm = shard_re.fullmatch(name)
        if pm is not None or name == STATE_NAME:
            doc = _read_json(os.path.join(out, name))
            if doc is None and not os.path.exists(os.path.join(out, name)):
                continue  # gone since the listing
            if doc is not None and doc.get("job") == job:
                ours_seen = True
                own = own or (pm is not None and (int(pm[2]), int(pm[3])) == (index, parts))
                if doc.get("dictionary_digest"):
                    claims.add(str(doc["dictionary_digest"]))
            else:
                foreign.append(name)
        elif TMP_MARK in name or _PART_LOCK.fullmatch(name) is not None:
            continue  # (a part's lock: see _part_lock)
        elif sm is not None and (int(sm[1]) >= len(jb.ranges) or sm[2] not in ours_ext):
            foreign.append(name)  # beyond this job's plan: no part of it will ever replace it
        elif sm is not None or name in (DICT_NAME, "parity"):
            pending.append(name)
        else:
            foreign.append(name)
    if options.resume and not own:
        raise OutputNotEmptyError(
            f"--resume: {out} holds no unfinished run of part {index}/{parts} of this job (the "
            "input or the options changed); rerun without --resume"
        )
    if not ours_seen:
        foreign += pending
    if foreign and not options.overwrite:
        shown = ", ".join(sorted(foreign)[:5]) + (", ..." if len(foreign) > 5 else "")
        raise OutputNotEmptyError(
            f"OUT {out} is not empty and holds files of no run of this job ({shown}); pass "
            "--overwrite to replace shardio's files in it (parts of this same job keep their "
            "work), or choose an empty directory"
        )
    if options.overwrite:
        # Shards in the plan are replaced by the part that owns them, zstd.dict by _codec and
        # parity by merge: a part deleting them could delete another part's fresh work.
        for name in set(foreign) - set(pending):
            path = os.path.join(out, name)
            if not _ours(name, options.prefix):
                continue  # not shardio's: kept
            if name.endswith(".json"):
                # Read again right before deleting: a part of this job may have just published
                # its record under the name another job's record had.
                doc = _read_json(path)
                if doc is not None and doc.get("job") == job:
                    continue
            _unlink_quiet(path)
    # Temp files a killed run of this part left; other parts' temp files may be in use.
    mine = {_record_name(index, parts), _part_state_name(index, parts)}
    suffix = shard_suffix(options.format)
    for n in range(first, stop):
        mine.update((f"{options.prefix}-{n:06d}{suffix}", f"{options.prefix}-{n:06d}{suffix}.idx"))
    tmp_re = re.compile(r"\.(.+)" + re.escape(TMP_MARK) + r"-\d+")
    for name in names:
        tm = tmp_re.fullmatch(name)
        if tm is not None and tm[1] in mine:
            _unlink_quiet(os.path.join(out, name))
    return None, claims


_RECORD_VERSION = 1


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _shard_fact(w: WrittenShard) -> dict[str, Any]:
    return {"path": os.path.basename(w.path),
            "index": os.path.basename(w.index_path) if w.index_path else None,
            "samples": w.samples, "bytes": w.bytes, "digest": w.digest,
            "index_digest": w.index_digest, "stored_bytes": w.stored_bytes,
            "raw_bytes": w.raw_bytes, "fields": dict(sorted(w.fields.items()))}


def _record_bytes(doc: dict[str, Any]) -> bytes:
    body = {**doc, "record_digest": digest_bytes(_canonical(doc).encode())}
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def _load_record(path: str) -> dict[str, Any]:
    """A part record, checked against its own digest.

    Raises:
        ManifestCorruptError: unreadable, not a part record, or edited/damaged.
        ManifestVersionError: written by a newer shardio.
    """
    fix = ("delete it and rerun that part (`shardio pack SRC OUT --part I/N` with the job's "
           "options), then `shardio merge`")
    try:
        with open(path, "rb") as f:
            doc = json.loads(f.read())
    except (OSError, ValueError) as exc:
        raise ManifestCorruptError(f"part record {path} is unreadable ({exc}); {fix}") from exc
    if not isinstance(doc, dict) or doc.get("format") != "shardio-part":
        raise ManifestCorruptError(f"{path} is not a shardio part record; {fix}")
    version = doc.get("version")
    if isinstance(version, int) and version > _RECORD_VERSION:
        raise ManifestVersionError(
            f"part record {path} has version {version}, newer than this shardio reads "
            f"({_RECORD_VERSION}); merge with the shardio that packed the parts, or upgrade: "
            "pip install -U shardio"
        )
    digest = doc.pop("record_digest", None)
    if digest != digest_bytes(_canonical(doc).encode()):
        raise ManifestCorruptError(f"part record {path} fails its own digest (edited or "
                                   f"damaged); {fix}")
    return doc


def _part_command(doc: dict[str, Any], out: str, part: int) -> str:
    """The ``shardio pack`` command line that (re)runs ``part`` of the job ``doc`` records."""
    o, dflt = doc["options"], PackOptions().output_key()
    args = ["shardio", "pack", doc["src"], out]
    if doc.get("files_from"):
        args += ["--files-from", doc["files_from"]]
    if o["format"] != dflt["format"]:
        args += ["--format", o["format"]]
    # The CLI drops its 256MB default when --samples-per-shard is given, so say it explicitly.
    if o["shard_size"] is not None and (o["shard_size"] != dflt["shard_size"]
                                        or o["samples_per_shard"] is not None):
        args += ["--shard-size", str(o["shard_size"])]
    for key, flag in (("samples_per_shard", "--samples-per-shard"), ("compress", "--compress"),
                      ("checksum", "--checksum"), ("on_error", "--on-error"),
                      ("prefix", "--prefix"), ("parity", "--parity")):
        if o[key] != dflt[key]:
            args += [flag, str(o[key])]
    args += [flag for key, flag in (("zstd_dict", "--zstd-dict"),
                                    ("label_from_dir", "--label-from-dir")) if o[key]]
    if not doc.get("fsync", True):
        args.append("--no-fsync")
    return shlex.join([*args, "--part", f"{part}/{doc['parts']}"])


def _describe_groups(records: list[tuple[str, dict[str, Any]]], key: str) -> str:
    groups: dict[Any, list[str]] = {}
    for name, doc in records:
        groups.setdefault(doc[key], []).append(name)
    order = sorted(groups, key=lambda k: (len(groups[k]), str(k)))  # the odd ones out first
    return "; ".join(f"{key} {str(k)[:12]}: {', '.join(groups[k])}" for k in order)


def _check_parts(out: str, records: list[tuple[str, dict[str, Any]]],
                 names: list[str]) -> list[dict[str, Any]]:
    """The records of parts ``0..N-1`` in order, after checking they form one whole job.

    Raises:
        ManifestNotFoundError: a part has no record (not finished, or never run).
        ManifestError: records of different jobs or part counts, a duplicated part, shard
            ranges that overlap or leave gaps, or shard lists that do not match the ranges.
    """
    if len({doc["job"] for _n, doc in records}) > 1:
        raise ManifestError(
            f"the part records in {out} come from different pack jobs (the input or the "
            f"options differ): {_describe_groups(records, 'job')}; delete the records of the "
            "job you do not want, rerun those parts with the same input and options as the "
            f"others, then rerun `shardio merge {out}`"
        )
    if len({doc["parts"] for _n, doc in records}) > 1:
        raise ManifestError(
            f"the part records in {out} disagree on the number of parts N: "
            f"{_describe_groups(records, 'parts')}; every part of a job needs the same N: delete "
            f"the records of the wrong N (and rerun those parts), then rerun `shardio merge {out}`"
        )
    n, first_doc = records[0][1]["parts"], records[0][1]
    by_part: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for name, doc in records:
        by_part.setdefault(doc["part"], []).append((name, doc))
    for p, recs in sorted(by_part.items()):
        if len(recs) > 1 or not 0 <= p < n:
            raise ManifestError(
                f"{', '.join(r[0] for r in recs)} {'all claim' if len(recs) > 1 else 'claims'} "
                f"to be part {p} of {n}; keep only {_record_name(p, n)} if it is that part's, or "
                f"delete them and rerun the part ({_part_command(first_doc, out, p)}), then "
                f"rerun `shardio merge {out}`"
            )
    missing = [p for p in range(n) if p not in by_part]
    if missing:
        started = [p for p in missing if _part_state_name(p, n) in names]
        note = (f" (part(s) {', '.join(map(str, started))} started: still running, or interrupted)"
                if started else "")
        cmds = "; ".join(_part_command(first_doc, out, p) for p in missing[:3])
        raise ManifestNotFoundError(
            f"part(s) {', '.join(map(str, missing))} of {n} have not finished: no "
            f"{', '.join(_record_name(p, n) for p in missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''} in {out}{note}; run (or rerun, it resumes) "
            f"{cmds}{'; ...' if len(missing) > 3 else ''}, then rerun `shardio merge {out}`"
        )
    ordered = [by_part[p][0][1] for p in range(n)]
    total, at = ordered[0]["total_shards"], 0
    suffix = shard_suffix(first_doc["options"]["format"])
    prefix = first_doc["options"]["prefix"]
    for doc in ordered:
        first, stop, p = doc["first"], doc["stop"], doc["part"]
        want = [f"{prefix}-{i:06d}{suffix}" for i in range(first, stop)]
        if (doc["total_shards"] != total or first != at or stop < first
                or [s["path"] for s in doc["shards"]] != want):
            what = ("a gap" if first > at else "an overlap") if first != at else "a mismatch"
            raise ManifestError(
                f"part {p} of {n} ({_record_name(p, n)}) records shards {first}..{stop - 1} of "
                f"{doc['total_shards']}, but the parts before it end at shard {at - 1} of {total} "
                f"({what}); delete that record, rerun the part "
                f"({_part_command(doc, out, p)}), then rerun `shardio merge {out}`"
            )
        at = stop
    if at != total:
        raise ManifestError(
            f"the parts of {out} end at shard {at - 1} but the job has {total} shards (a gap); "
            f"rerun part {n - 1} ({_part_command(first_doc, out, n - 1)}), then rerun "
            f"`shardio merge {out}`"
        )
    if len({doc["dictionary_digest"] for doc in ordered}) > 1:
        raise ManifestError(
            f"the parts of {out} compressed with different zstd dictionaries; delete the part "
            f"records and {DICT_NAME}, rerun every part, then rerun `shardio merge {out}`"
        )
    return ordered


def _merged_shards(out: str, ordered: list[dict[str, Any]], verify: bool) -> list[WrittenShard]:
    """Every part's shards, in global order, after checking each is on disk with its size and
    is the one its part recorded, as far as that is cheap: a tar shard's ``.idx`` (small; it
    holds the shard's digest and size) hashes to the recorded index digest, and an HDF5
    shard's ``user.shardio.digest`` attribute, where it has one, is the recorded digest.  With
    ``verify``, every shard is hashed too."""
    written = []
    for doc in ordered:
        rerun = (f"rerun part {doc['part']} ({_part_command(doc, out, doc['part'])}): it "
                 f"rewrites only missing or damaged shards; then rerun `shardio merge {out}`")
        for fact in doc["shards"]:
            path = resolve_in(out, fact["path"])
            idx = resolve_in(out, fact["index"]) if fact["index"] else None
            for p in filter(None, (path, idx)):
                if not os.path.isfile(p):
                    raise ShardNotFoundError(
                        f"{p}, written by part {doc['part']} of {doc['parts']}, is missing; {rerun}")
            size = os.path.getsize(path)
            if size != fact["bytes"]:
                raise ShardCorruptError(f"{path} is {size} bytes, but part {doc['part']} of "
                                        f"{doc['parts']} wrote {fact['bytes']}; {rerun}")
            recorded = _recorded_digest(path) if idx is None else None
            try:
                bad = ((idx is not None and file_digest(idx)[0] != fact["index_digest"])
                       or (recorded is not None and recorded != (fact["digest"], fact["bytes"]))
                       or (verify and file_digest(path)[0] != fact["digest"]))
            except OSError as exc:
                raise translate_oserror(exc, path, "reading") from exc
            if bad:
                raise ShardCorruptError(f"{path} (or its index) is not the shard part "
                                        f"{doc['part']} of {doc['parts']} wrote (another "
                                        f"job's, or damaged); {rerun}")
            written.append(WrittenShard(
                path=path, index_path=idx, samples=fact["samples"], bytes=fact["bytes"],
                digest=fact["digest"], index_digest=fact["index_digest"],
                stored_bytes=fact["stored_bytes"], raw_bytes=fact["raw_bytes"],
                fields=dict(fact["fields"])))
    return written


def merge(out: str | os.PathLike[str], *, verify: bool = False) -> Manifest:
    """Publish the manifest of a multi-node pack once every part has finished.

    Reads the part records ``pack`` left in ``out`` (``PackOptions.part``), checks that they form
    one whole job and that every shard they list is on disk with its size and is the one its
    part wrote (its index's digest, or an HDF5 shard's recorded digest), then builds and
    publishes the manifest exactly as a single-process pack of the same input and options
    would (byte for byte), writes parity if the job asked for it, and removes the part records
    and state files.  Running it again afterwards returns the published manifest.  Merges of
    one ``out`` run one at a time (a lock on the directory, where the filesystem has flock),
    so every rank of a job may call it.

    Args:
        out: the output directory every part packed into.
        verify: also hash every shard and index against the digests the parts recorded.

    Raises:
        ManifestNotFoundError: a part has not finished (the message gives its command), or
            ``out`` holds neither part records nor a manifest.
        ManifestError: records of different jobs or part counts, a duplicated part, shard
            ranges with gaps or overlaps (ManifestCorruptError: a damaged record).
        ShardNotFoundError, ShardCorruptError: a listed shard is missing, of the wrong size,
            not the one its part wrote (its index's digest), or (with ``verify``) of the wrong
            digest.
    """
    out = os.fspath(out)
    if not os.path.isdir(out):
        raise UsageError(f"OUT {out} is not a directory")
    with _merge_lock(out):
        return _merge(out, verify)


@contextmanager
def _merge_lock(out: str) -> Iterator[None]:
    """Serialise the merges of one OUT: every rank of a job may call :func:`merge`, and two at
    once deleted each other's parity and temp files (exit 1, or a traceback).  An exclusive
    ``flock`` on the directory itself (no file to clean up); a merge that waited then finds
    the job merged.  Where the filesystem has no flock (NFS, Lustre mounted without it, which
    may refuse one), merges are not serialised, as before."""
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:
                pass
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _merge(out: str, verify: bool) -> Manifest:
    """:func:`merge` of a directory, under :func:`_merge_lock`."""
    names = sorted(os.listdir(out))
    found = [n for n in names if (m := _PART_FILE.fullmatch(n)) is not None and m[1] == "part"]
    if not found:
        if MANIFEST_NAME in names:
            return Manifest.load(out)  # already merged (or packed by one process)
        raise ManifestNotFoundError(
            f"{out} holds no part records and no manifest; run `shardio pack SRC {out} --part "
            f"I/N` for every part I of N first, then `shardio merge {out}`"
        )
    records = [(n, _load_record(os.path.join(out, n))) for n in found]
    if MANIFEST_NAME in names:
        try:
            existing: Manifest | None = Manifest.load(out)
        except ShardioError:
            existing = None
        # A merge that stopped right after publishing (or while it removed the records, some
        # then gone: the check of the parts below would ask for them again, for ever).
        if existing is not None and all(doc.get("job") == existing.job for _n, doc in records):
            _remove_part_files(out)
            return existing
    ordered = _check_parts(out, records, names)
    head = ordered[0]
    written = _merged_shards(out, ordered, verify)
    options = PackOptions(**head["options"], fsync=all(d.get("fsync", True) for d in ordered))
    dictionary = None
    if head["dictionary_digest"]:
        try:
            with open(os.path.join(out, DICT_NAME), "rb") as f:
                dictionary = f.read()
        except OSError:
            dictionary = None
        if dictionary is None or digest_bytes(dictionary) != head["dictionary_digest"]:
            raise ManifestError(
                f"{os.path.join(out, DICT_NAME)} is missing or is not the dictionary the parts "
                f"compressed with; rerun any part ({_part_command(head, out, 0)}) to rewrite it, "
                f"then rerun `shardio merge {out}`"
            )
    else:
        _unlink_quiet(os.path.join(out, DICT_NAME))  # left by an overwritten job
    _remove_parity(out)  # an overwritten job's; this job's parity is written next
    skipped: Counter[str] = Counter(head["scan_skipped"])
    for doc in ordered:
        skipped.update(doc["skipped"])
    codec = Codec(options.codec_name, options.codec_level, dictionary)
    manifest = _publish(out, options, head["labels"], codec, head["job"], written, skipped,
                        head["layout"])
    _remove_part_files(out)
    return manifest


def _remove_part_files(out: str) -> None:
    """Delete every part record, part state file and part lock left by a killed run, and temp
    files, once merged."""
    for name in os.listdir(out):
        if _PART_FILE.fullmatch(name) or _PART_LOCK.fullmatch(name):
            _unlink_quiet(os.path.join(out, name))
    remove_temp_files(out)
