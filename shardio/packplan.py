"""Where a pack cuts its shards, and the fingerprints its resume compares.

Shard boundaries come from size estimates of each sample as stored (:func:`plan_shards` over a
scanned list, :class:`_Planner` as a streaming scan goes: the same cuts), never from what a worker
happened to write, so the plan and every output byte are the same whatever the worker count.
The job fingerprint is the xxh3-128 of a canonical JSON document of the output options and every
input file's key, label, field, size and mtime (:func:`_job_document`, built as text);
each shard's index records a fingerprint of its own samples' entries (:func:`_shard_fingerprint`),
so a rerun keeps exactly the shards whose inputs did not change.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import xxhash

from ._scan import LABEL_FIELD, Sample, ScanResult
from .config import PackOptions
from .errors import EmptySourceError, SampleTooLargeError
from .formats.tar import ustar_header

__all__ = ["plan_shards"]

_TAR_OVERHEAD = 512
_TAR_END = 1024
# An HDF5 shard's bytes besides its payload (shardio.formats.hdf5): a fixed part (superblock,
# groups, dataset headers, attributes: 10.3-10.9 KB measured with 3 fields; this leaves room for
# more field names and a longer meta), and per sample its key and two u64 index entries, per
# field an index row (u16 name, u8 flags, 4 u64s).
_H5_FIXED = 16 << 10
_H5_PER_SAMPLE = 16
_H5_PER_FIELD = 35


def _estimate(sample: Sample, options: PackOptions) -> int:
    sizes = [(f[0], f[2]) for f in sample.files]
    if sample.label is not None:
        sizes.append((LABEL_FIELD, 4))
    if options.format == "tar":
        zst = ".zst" if options.codec_name else ""
        return sum(_tar_header_size(f"{sample.key}.{name}{zst}", s) + s + (-s % 512)
                   for name, s in sizes)
    return (sum(s for _name, s in sizes) + _H5_PER_SAMPLE + len(sample.key.encode())
            + _H5_PER_FIELD * len(sizes))


def _tar_header_size(member: str, size: int) -> int:
    # Long or non-ASCII member names take a pax extended header before the ustar one.
    if len(member) <= 100 and member.isascii() and size < 8**11:
        return _TAR_OVERHEAD
    return len(ustar_header(member, size))


def _estimator(options: PackOptions) -> Callable[[Sample], int]:
    """``_estimate`` for these options, with the per-field work hoisted out of the call."""
    if options.format != "tar":
        def stored(s: Sample) -> int:
            key = s.key
            n = _H5_PER_SAMPLE + (len(key) if key.isascii() else len(key.encode()))
            if s.label is not None:
                n += 4 + _H5_PER_FIELD
            for f in s.files:
                n += f[2] + _H5_PER_FIELD
            return n

        return stored
    zst = ".zst" if options.codec_name else ""
    # len(f".{name}{zst}") per field name, or 1000 when it is not ASCII (then _tar_header_size).
    suffix = {LABEL_FIELD: len(LABEL_FIELD) + 1 + len(zst)}
    limit = 8**11

    def tar(s: Sample) -> int:
        key = s.key
        klen = len(key) if key.isascii() else 1000
        n = 0
        for name, _path, size, _mtime in s.files:
            sl = suffix.get(name)
            if sl is None:
                sl = suffix[name] = len(name) + 1 + len(zst) if name.isascii() else 1000
            if klen + sl <= 100 and size < limit:
                n += _TAR_OVERHEAD + size + (-size % 512)
            else:
                n += _tar_header_size(f"{key}.{name}{zst}", size) + size + (-size % 512)
        if s.label is not None:
            if klen + suffix[LABEL_FIELD] <= 100:
                n += _TAR_OVERHEAD + 512
            else:
                n += _tar_header_size(f"{key}.{LABEL_FIELD}{zst}", 4) + 512
        return n

    return tar


def _estimates(samples: list[Sample], options: PackOptions) -> list[int]:
    """``_estimate`` of every sample."""
    estimate = _estimator(options)
    return [estimate(s) for s in samples]


class _Planner:
    """Greedy shard boundaries over key-ordered sample estimates, honouring both limits: what
    :func:`plan_shards` computes over a list and the streaming pack computes as the scan goes."""

    def __init__(self, options: PackOptions) -> None:
        self.limit, self.per = options.shard_bytes, options.samples_per_shard
        # Every tar ends with two zero blocks, every HDF5 file has its metadata: both count
        # against the limit too.
        self.base = _TAR_END if options.format == "tar" else _H5_FIXED
        self.room = self.limit - self.base if self.limit is not None else None
        self.acc = self.count = 0

    def too_large(self, size: int) -> bool:
        """Whether a sample of this estimate fits in no shard."""
        return self.limit is not None and self.base + size > self.limit

    def error(self, key: str, size: int) -> SampleTooLargeError:
        return SampleTooLargeError(
            f"sample {key!r} needs {self.base + size} bytes, more than --shard-size {self.limit}; "
            f"raise --shard-size to at least {self.base + size} bytes, or pass --on-error skip "
            "to leave it out"
        )

    def cut(self, size: int) -> bool:
        """Add the next sample; True when it must open a new shard (the current one is full)."""
        room, per = self.room, self.per
        cut = self.count > 0 and ((room is not None and self.acc + size > room)
                                  or (per is not None and self.count >= per))
        if cut:
            self.acc = self.count = 0
        self.acc += size
        self.count += 1
        return cut


def plan_shards(samples: list[Sample], options: PackOptions,
                sizes: list[int] | None = None) -> list[tuple[int, int]]:
    """Split key-sorted samples into ``[start, end)`` ranges honouring both shard limits.

    ``sizes`` are the samples' ``_estimate``s when the caller has them already.

    Raises:
        SampleTooLargeError: one sample alone exceeds ``shard_size``.
    """
    if sizes is None:
        sizes = _estimates(samples, options)
    planner = _Planner(options)
    if sizes and planner.too_large(max(sizes)):
        s, size = next((s, n) for s, n in zip(samples, sizes) if planner.too_large(n))
        raise planner.error(s.key, size)
    ranges: list[tuple[int, int]] = []
    start = 0
    for i, size in enumerate(sizes):
        if planner.cut(size):
            ranges.append((start, i))
            start = i
    ranges.append((start, len(samples)))
    return ranges


def _drop_too_large(scan: ScanResult, options: PackOptions, sizes: list[int]) -> list[int]:
    """With ``on_error="skip"``, leave out (and count) samples that fit in no shard.

    ``sizes`` are the samples' estimates; returns those of the samples kept.
    """
    limit = options.shard_bytes
    planner = _Planner(options)
    if options.on_error != "skip" or limit is None or not planner.too_large(max(sizes, default=0)):
        return sizes
    kept = [(s, n) for s, n in zip(scan.samples, sizes) if not planner.too_large(n)]
    scan.skipped["too_large"] += len(scan.samples) - len(kept)
    scan.samples = [s for s, _n in kept]
    if not kept:
        raise EmptySourceError(
            f"every sample is larger than --shard-size {limit}; raise --shard-size"
        )
    return [n for _s, n in kept]


def _fingerprint(obj: Any) -> str:
    return xxhash.xxh3_128_hexdigest(_canonical(obj).encode())


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _plain(text: str) -> bool:
    """Whether ``json.dumps`` writes ``text`` as is between quotes (no escape needed)."""
    return text.isascii() and text.isprintable() and '"' not in text and "\\" not in text


def _sample_docs(samples: list[Sample]) -> list[str]:
    """Each sample's entry in the job document, ``_canonical([key, label, [[field, size,
    mtime], ...]])``, built as text (~4x faster than ``json.dumps``) unless a key or field name
    needs a JSON escape."""
    plain: dict[str, bool] = {}
    out: list[str] = []
    append = out.append
    for s in samples:
        key, files = s.key, s.files
        ok = _plain(key)
        if ok:
            for f in files:
                p = plain.get(f[0])
                if p is None:
                    p = plain[f[0]] = _plain(f[0])
                if not p:
                    ok = False
                    break
        if not ok:
            append(_canonical([key, s.label, [[f[0], f[2], f[3]] for f in files]]))
            continue
        label = "null" if s.label is None else s.label
        if len(files) == 1:
            name, _path, size, mtime = files[0]
            append(f'["{key}",{label},[["{name}",{size},{mtime}]]]')
        else:
            inner = ",".join([f'["{f[0]}",{f[2]},{f[3]}]' for f in files])
            append(f'["{key}",{label},[{inner}]]')
    return out


_JOB_HEAD = '{"files":['  # the job document up to its first sample entry


def _job_tail(labels: list[str] | None, options_key: dict[str, Any]) -> str:
    return f'],"labels":{_canonical(labels)},"options":{_canonical(options_key)}}}'


def _job_text(entries: list[str], labels: list[str] | None, options_key: dict[str, Any]) -> str:
    """The job document around its samples' entries (:func:`_sample_docs`)."""
    return _JOB_HEAD + ",".join(entries) + _job_tail(labels, options_key)


def _job_document(options_key: dict[str, Any], labels: list[str] | None,
                  samples: list[Sample]) -> str:
    """``_canonical`` of the job description (the output options and every input file's key,
    label, field, size and mtime); its xxh3-128 is the job fingerprint."""
    return _job_text(_sample_docs(samples), labels, options_key)


class _JobHash:
    """The job fingerprint (xxh3-128 of :func:`_job_document`), fed a shard's entries at a time
    while the streaming pack scans; the labels and options close the document."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_128(_JOB_HEAD.encode())
        self._sep = ""

    def add(self, entries: str) -> None:
        self._h.update((self._sep + entries).encode())
        self._sep = ","

    def finish(self, labels: list[str] | None, options_key: dict[str, Any]) -> str:
        self._h.update(_job_tail(labels, options_key).encode())
        return self._h.hexdigest()


def _shard_fingerprint(options_text: str, number: int, entries: str) -> str:
    """What a shard's index records (``job_shard``) for resume: its number, the output options
    and its samples' job-document entries, so it is known before the scan ends and a rerun
    keeps exactly the shards whose inputs are unchanged."""
    return xxhash.xxh3_128_hexdigest(f"{options_text}|{number}|{entries}".encode())
