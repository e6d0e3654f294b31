"""``shardio pack``: turn a tree of small files into checksummed shards plus a manifest.

Pipeline: scan SRC into key-sorted samples → plan shard boundaries from file sizes (so the plan,
and therefore every output byte, is independent of the worker count) → write shards in parallel
processes, each to a temp name, fsynced and renamed → write the manifest last, atomically.

Resumability: a state file ``.shardio-pack.json`` records the job fingerprint (options that shape
the output plus every input path, size and mtime).  Rerunning the same command finds it, removes
temp files left by a killed run, keeps every shard whose index carries this job's shard
fingerprint and whose bytes still hash to the same digest, and writes only the rest.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from typing import Any

import xxhash

from . import __version__
from ._fsutil import TMP_MARK, atomic_write_bytes, remove_temp_files, translate_oserror
from ._scan import LABEL_FIELD, Sample, ScanResult, scan_source
from .checksum import DEFAULT_DIGEST, digest_bytes, file_digest
from .codec import Codec, train_dictionary
from .config import PackOptions
from .errors import (
    EmptySourceError,
    OutputInsideSourceError,
    OutputNotEmptyError,
    SampleTooLargeError,
    ShardioError,
    UnreadableFileError,
    UsageError,
)
from .formats import WrittenShard, load_index, open_writer, shard_suffix, verify_fields
from .formats.tar import ustar_header
from .manifest import MANIFEST_NAME, Manifest, ShardEntry

__all__ = ["pack"]

STATE_NAME = ".shardio-pack.json"
DICT_NAME = "zstd.dict"
_TAR_OVERHEAD = 512
_TAR_END = 1024


@dataclass
class _Task:
    number: int
    final: str
    samples: list[Sample]
    fingerprint: str


def _estimate(sample: Sample, options: PackOptions) -> int:
    sizes = [(f[0], f[2]) for f in sample.files]
    if sample.label is not None:
        sizes.append((LABEL_FIELD, 4))
    if options.format == "tar":
        zst = ".zst" if options.codec_name else ""
        return sum(_tar_header_size(f"{sample.key}.{name}{zst}", s) + s + (-s % 512)
                   for name, s in sizes)
    return sum(s for _name, s in sizes)


def _tar_header_size(member: str, size: int) -> int:
    # Long or non-ASCII member names take a pax extended header before the ustar one.
    if len(member) <= 100 and member.isascii() and size < 8**11:
        return _TAR_OVERHEAD
    return len(ustar_header(member, size))


def plan_shards(samples: list[Sample], options: PackOptions) -> list[tuple[int, int]]:
    """Split key-sorted samples into ``[start, end)`` ranges honouring both shard limits.

    Raises:
        SampleTooLargeError: one sample alone exceeds ``shard_size``.
    """
    limit, per = options.shard_bytes, options.samples_per_shard
    # Every tar ends with two zero blocks, which count against the limit too.
    base = _TAR_END if options.format == "tar" else 0
    ranges: list[tuple[int, int]] = []
    start, acc = 0, base
    for i, s in enumerate(samples):
        size = _estimate(s, options)
        if limit is not None and base + size > limit:
            raise SampleTooLargeError(
                f"sample {s.key!r} needs {base + size} bytes, more than --shard-size {limit}; "
                f"raise --shard-size to at least {base + size} bytes, or pass --on-error skip "
                "to leave it out"
            )
        full = (limit is not None and acc + size > limit) or (per is not None and i - start >= per)
        if i > start and full:
            ranges.append((start, i))
            start, acc = i, base
        acc += size
    ranges.append((start, len(samples)))
    return ranges


def _drop_too_large(scan: ScanResult, options: PackOptions) -> None:
    """With ``on_error="skip"``, leave out (and count) samples that fit in no shard."""
    limit = options.shard_bytes
    if options.on_error != "skip" or limit is None:
        return
    base = _TAR_END if options.format == "tar" else 0
    fits = [s for s in scan.samples if base + _estimate(s, options) <= limit]
    if len(fits) == len(scan.samples):
        return
    scan.skipped["too_large"] += len(scan.samples) - len(fits)
    scan.samples = fits
    if not fits:
        raise EmptySourceError(
            f"every sample is larger than --shard-size {limit}; raise --shard-size"
        )


def _read_file(path: str, size: int = 0) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # One read when the size from the scan still holds; a short read of a regular file
            # is EOF, and a file that grew since the scan is read to its end.
            data = os.read(fd, size + 1)
            if len(data) > size:
                rest = [data]
                while chunk := os.read(fd, 1 << 20):
                    rest.append(chunk)
                data = b"".join(rest)
            return data
        finally:
            os.close(fd)
    except OSError as exc:
        raise UnreadableFileError(
            exc.errno, f"cannot read {path}: {exc.strerror}; fix its permissions or pass "
            "--on-error skip to leave it out"
        ) from exc


def _pack_shard(task: _Task, fmt: str, codec: Codec, checksum: str, fsync: bool,
                on_error: str) -> tuple[int, WrittenShard, Counter[str]]:
    """Write one shard (runs in a worker process, or inline with one worker)."""
    skipped: Counter[str] = Counter()
    writer = open_writer(fmt, task.final, codec, checksum, fsync)
    try:
        for s in task.samples:
            fields: list[tuple[str, bytes]] = []
            try:
                for name, path, size, _mtime in s.files:
                    fields.append((name, _read_file(path, size)))
            except UnreadableFileError:
                if on_error == "raise":
                    raise
                skipped["unreadable"] += 1
                continue
            if s.label is not None:
                fields.append((LABEL_FIELD, str(s.label).encode()))
                fields.sort()
            writer.add(s.key, fields)
        written = writer.close({"job_shard": task.fingerprint})
    except BaseException:
        writer.abort()
        raise
    return task.number, written, skipped


def _fingerprint(obj: Any) -> str:
    return xxhash.xxh3_128_hexdigest(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


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
            or re.fullmatch(re.escape(prefix) + r"-\d{6}\.(tar|tar\.idx|h5)", name) is not None)


def _prepare_out(out: str, job: str, options: PackOptions) -> Manifest | None:
    """Decide fresh / resume / already complete; returns the manifest when already complete."""
    names = os.listdir(out) if os.path.isdir(out) else []
    if options.overwrite:
        for n in names:
            if _ours(n, options.prefix):
                os.unlink(os.path.join(out, n))
        names = [n for n in names if not _ours(n, options.prefix)]
    state = _read_json(os.path.join(out, STATE_NAME))
    if state is not None and state.get("job") == job:
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


def _dictionary(out: str, samples: list[Sample], level: int, state: dict[str, Any]) -> bytes:
    path = os.path.join(out, DICT_NAME)
    want = state.get("dictionary_digest")
    if want and os.path.exists(path):
        with open(path, "rb") as f:
            data = f.read()
        if digest_bytes(data) == want:
            return data
    step = max(1, len(samples) // 4000)
    training = [_read_file(p, size) for s in samples[::step] for _n, p, size, _m in s.files
                if 0 < size <= 64 * 1024]
    data = train_dictionary(training, level=level)
    atomic_write_bytes(path, data)
    return data


def _run_tasks(tasks: list[_Task], options: PackOptions, codec: Codec,
               done: Callable[[WrittenShard, Counter[str]], None]) -> None:
    args = (options.format, codec, options.checksum, options.fsync, options.on_error)
    if options.workers == 1 or len(tasks) <= 1:
        for t in tasks:
            _n, w, sk = _pack_shard(t, *args)
            done(w, sk)
        return
    # fork: workers inherit the imported modules instead of re-importing them (spawn costs ~0.2 s
    # per worker).  The pool forks all workers on the first submit, before its manager thread
    # starts, and the progress bar runs without a monitor thread, so no thread is forked.
    ctx = get_context("fork")
    with ProcessPoolExecutor(max_workers=min(options.workers, len(tasks)), mp_context=ctx) as ex:
        pending = {ex.submit(_pack_shard, t, *args) for t in tasks}
        try:
            while pending:
                finished, pending = wait(pending, return_when=FIRST_EXCEPTION)
                for fut in finished:
                    _n, w, sk = fut.result()
                    done(w, sk)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise


def pack(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    options: PackOptions | None = None,
    *,
    files_from: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
    **kwargs: Any,
) -> Manifest:
    """Pack the files under ``src`` into shards in ``out`` and return the published manifest.

    Args:
        src: source directory (keys are paths relative to it).
        out: output directory; created if missing.
        options: a :class:`PackOptions`; or pass its fields as keyword arguments.
        files_from: a file listing the paths to pack (relative to ``src`` or absolute inside it).
        progress: show a progress bar; ``None`` shows one when stderr is a terminal.

    Raises:
        UsageError: bad options, OUT inside SRC, OUT not empty (OutputNotEmptyError).
        SourceError: bad input files or an oversize sample (unless ``on_error="skip"``), empty
            source.
        StorageFullError: the output filesystem filled up; nothing was published.
    """
    if options is None:
        options = PackOptions(**kwargs)
    elif kwargs:
        raise UsageError("pass either options= or keyword options, not both")
    src, out = os.fspath(src), os.fspath(out)
    flist = os.fspath(files_from) if files_from is not None else None
    _check_paths(src, out, flist)
    scan = scan_source(src, out, files_from=flist, label_from_dir=options.label_from_dir,
                       on_error=options.on_error)
    _drop_too_large(scan, options)
    ranges = plan_shards(scan.samples, options)
    key = options.output_key()
    job = _fingerprint({"options": key, "labels": scan.labels, "files": [
        [s.key, s.label, s.files and [[f[0], f[2], f[3]] for f in s.files]] for s in scan.samples]})
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as exc:
        raise translate_oserror(exc, out, "creating") from exc
    complete = _prepare_out(out, job, options)
    if complete is not None:
        return complete
    state_path = os.path.join(out, STATE_NAME)
    state = _read_json(state_path) or {}
    codec = Codec(options.codec_name, options.codec_level)
    if options.zstd_dict:
        codec = Codec(options.codec_name, options.codec_level,
                      _dictionary(out, scan.samples, options.codec_level, state))
    atomic_write_bytes(state_path, json.dumps({
        "job": job, "shards": len(ranges), "created_by": f"shardio {__version__}",
        "dictionary_digest": digest_bytes(codec.dictionary) if codec.dictionary else None,
    }).encode())
    suffix = shard_suffix(options.format)
    tasks = []
    for n, (a, b) in enumerate(ranges):
        chunk = scan.samples[a:b]
        fp = _fingerprint([job, n, chunk[0].key, chunk[-1].key, b - a])
        tasks.append(_Task(n, os.path.join(out, f"{options.prefix}-{n:06d}{suffix}"), chunk, fp))

    results: dict[str, WrittenShard] = {}
    skipped = Counter(scan.skipped)
    bar = _progress_bar(progress, scan)

    def done(w: WrittenShard, sk: Counter[str]) -> None:
        results[w.path] = w
        skipped.update(sk)
        if bar is not None:
            bar.update(w.raw_bytes)
            bar.set_postfix_str(f"shards {len(results)}/{len(tasks)}", refresh=False)

    todo = []
    for t in tasks:
        w = _is_done(t, options.format)
        if w is None:
            for p in (t.final, t.final + ".idx"):
                if os.path.exists(p):
                    os.unlink(p)
            todo.append(t)
        else:
            done(w, Counter())
    try:
        _run_tasks(todo, options, codec, done)
    finally:
        if bar is not None:
            bar.close()
    return _publish(out, options, scan, codec, job, [results[t.final] for t in tasks], skipped)


def _progress_bar(progress: bool | None, scan: Any) -> Any:
    if progress is False or (progress is None and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm

    tqdm.monitor_interval = 0
    return tqdm(total=sum(s.size for s in scan.samples), unit="B", unit_scale=True,
                unit_divisor=1024, file=sys.stderr, desc=f"packing {scan.files} files",
                dynamic_ncols=True)


def _publish(out: str, options: PackOptions, scan: Any, codec: Codec, job: str,
             written: list[WrittenShard], skipped: Counter[str]) -> Manifest:
    fields: Counter[str] = Counter()
    for w in written:
        fields.update(w.fields)
    raw = sum(w.raw_bytes for w in written)
    stored = sum(w.stored_bytes for w in written)
    per_shard_ops = 4 if options.format == "tar" else 2
    compression = None
    if codec.name:
        compression = {
            "codec": codec.name, "level": codec.level,
            "dictionary": DICT_NAME if codec.dictionary else None,
            "dictionary_digest": digest_bytes(codec.dictionary) if codec.dictionary else None,
        }
    manifest = Manifest(
        shard_format=options.format,
        shards=[ShardEntry(
            path=os.path.basename(w.path), samples=w.samples, bytes=w.bytes, digest=w.digest,
            index=os.path.basename(w.index_path) if w.index_path else None,
            index_digest=w.index_digest, stored_bytes=w.stored_bytes, raw_bytes=w.raw_bytes,
        ) for w in written],
        fields=dict(fields),
        checksum=options.checksum,
        digest=DEFAULT_DIGEST,
        compression=compression,
        labels={"field": LABEL_FIELD, "names": scan.labels} if scan.labels is not None else None,
        stats={
            "files_in": scan.files,
            "samples": sum(w.samples for w in written),
            "shards": len(written),
            "raw_bytes": raw,
            "stored_bytes": stored,
            "shard_bytes": sum(w.bytes for w in written),
            "compression_ratio": round(raw / stored, 4) if stored else 1.0,
            "skipped": dict(sorted(skipped.items())),
            "metadata_ops_small_files": 2 * scan.files,
            "metadata_ops_shards": per_shard_ops * len(written),
        },
        job=job,
        created_by=f"shardio {__version__}",
    )
    manifest.save(out)
    try:
        os.unlink(os.path.join(out, STATE_NAME))
    except FileNotFoundError:
        pass
    return manifest
