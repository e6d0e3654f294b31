"""The dataset manifest: the one file that says what a dataset is, written last, atomically.

``<dataset>/manifest.json`` (format version 1)::

    {
      "format": "shardio", "version": 1, "created_by": "shardio 0.1.0",
      "shard_format": "tar" | "hdf5",
      "checksum": {"sample": "xxh3_64", "shard": "xxh3_128"},
      "compression": null | {"codec": "zstd", "level": 3, "dictionary": "zstd.dict" | null,
                             "dictionary_digest": "..." | null},
      "fields": {"jpg": 20000, "cls": 20000},          # samples carrying each field
      "labels": null | {"field": "cls", "names": ["cat", "dog", ...]},
      "num_samples": 20000,
      "shards": [{"path": "shard-000000.tar", "index": "shard-000000.tar.idx", "samples": 512,
                  "bytes": ..., "digest": "...", "index_digest": "...",
                  "stored_bytes": ..., "raw_bytes": ...}, ...],
      "stats": {...},                                    # pack summary (informational)
      "job": "..." | null,                               # fingerprint of the pack job
      "parity": {...},                                   # only with --parity K+M (shardio.parity)
      "manifest_digest": "..."                           # xxh3_128 of the canonical JSON of the rest
    }

Paths are relative to the manifest's directory and may never be absolute or contain ``..``.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import asdict, dataclass, field
from typing import Any

from ._fsutil import atomic_write_bytes, check_relpath, read_regular, translate_oserror
from .checksum import (
    DEFAULT_DIGEST,
    DEFAULT_SAMPLE,
    DIGEST_ALGORITHMS,
    SAMPLE_ALGORITHMS,
    digest_bytes,
)
from .errors import (
    ManifestCorruptError,
    ManifestNotFoundError,
    ManifestVersionError,
)

__all__ = ["FORMAT_VERSION", "MANIFEST_NAME", "Manifest", "ShardEntry", "dataset_dir"]

MANIFEST_NAME = "manifest.json"
FORMAT_VERSION = 1


def dataset_dir(path: str | os.PathLike[str]) -> str:
    """The dataset directory ``path`` names: ``path`` itself, or the directory holding it when
    it is the manifest file (which :meth:`Manifest.load` also takes).  (Given the manifest's
    path, readers looked for ``manifest.json/shard-000000.tar`` and verify reported every shard
    missing.)"""
    p = os.fspath(path)
    if os.path.basename(p) == MANIFEST_NAME and os.path.isfile(p):
        return os.path.dirname(p) or "."
    return p


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest records it."""

    path: str
    samples: int
    bytes: int
    digest: str
    index: str | None = None
    index_digest: str = ""
    stored_bytes: int = 0
    raw_bytes: int = 0

    def __post_init__(self) -> None:
        check_relpath(self.path)
        if self.index is not None:
            check_relpath(self.index)


@dataclass
class Manifest:
    """In-memory model of ``manifest.json``; see the module docstring for the layout."""

    shard_format: str
    shards: list[ShardEntry]
    fields: dict[str, int]
    checksum: str = DEFAULT_SAMPLE
    digest: str = DEFAULT_DIGEST
    compression: dict[str, Any] | None = None
    labels: dict[str, Any] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    job: str | None = None
    parity: dict[str, Any] | None = None
    version: int = FORMAT_VERSION
    created_by: str = ""

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def total_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def label_names(self) -> list[str] | None:
        return list(self.labels["names"]) if self.labels else None

    # --- serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "format": "shardio",
            "version": self.version,
            "created_by": self.created_by,
            "shard_format": self.shard_format,
            "checksum": {"sample": self.checksum, "shard": self.digest},
            "compression": self.compression,
            "fields": dict(sorted(self.fields.items())),
            "labels": self.labels,
            "num_samples": self.num_samples,
            "shards": [asdict(s) for s in self.shards],
            "stats": self.stats,
            "job": self.job,
        }
        if self.parity is not None:
            body["parity"] = self.parity
        body["manifest_digest"] = _body_digest(body)
        return body

    def to_json(self) -> bytes:
        return _canonical_json(self.to_dict())

    def save(self, directory: str) -> str:
        """Publish ``directory/manifest.json`` atomically; return its path."""
        path = os.path.join(directory, MANIFEST_NAME)
        atomic_write_bytes(path, self.to_json())
        return path

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = MANIFEST_NAME, strict: bool = True) -> Manifest:
        """Build a manifest from parsed JSON.

        Args:
            strict: refuse a manifest whose ``manifest_digest`` does not match its content.

        Raises:
            ManifestVersionError: newer format version.
            ManifestCorruptError: missing fields, a value of the wrong type, or digest mismatch.
            UnsafePathError: a shard or dictionary path escapes the dataset directory.
        """
        if not isinstance(data, dict) or data.get("format") != "shardio":
            raise ManifestCorruptError(
                f"{where} is not a shardio manifest; for existing WebDataset tars run "
                "`shardio index TAR...`, otherwise pack the data with `shardio pack`"
            )
        version = data.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 1:
            raise ManifestCorruptError(f"{where}: invalid format version {version!r}")
        if version > FORMAT_VERSION:
            if strict and data.get("manifest_digest") != _body_digest(data):
                # A newer shardio still seals its manifest so: a version number that fails the
                # digest is a damaged one (a flipped bit made 1 into 5), not a reason to upgrade.
                raise ManifestCorruptError(
                    f"{where} fails its own digest (it says format version {version}, newer "
                    f"than this shardio reads, {FORMAT_VERSION}): it was edited or damaged; "
                    "restore it, or rebuild it with `shardio index` (tar) / repack")
            raise ManifestVersionError(
                f"{where} has format version {version}, newer than this shardio reads "
                f"({FORMAT_VERSION}); upgrade shardio: pip install -U shardio"
            )
        if strict and data.get("manifest_digest") != _body_digest(data):
            raise ManifestCorruptError(
                f"{where} fails its own digest: it was edited or damaged; restore it, or rebuild "
                "it with `shardio index` (tar) / repack"
            )
        try:
            _check_types(data, where)
            _check_totals(data, where)
            checksum = data["checksum"]
            return cls(
                shard_format=str(data["shard_format"]),
                shards=[ShardEntry(**s) for s in data["shards"]],
                fields={str(k): int(v) for k, v in data["fields"].items()},
                checksum=str(checksum["sample"]),
                digest=str(checksum["shard"]),
                compression=data.get("compression"),
                labels=data.get("labels"),
                stats=dict(data.get("stats") or {}),
                job=data.get("job"),
                parity=data.get("parity"),
                version=version,
                created_by=str(data.get("created_by", "")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ManifestCorruptError(
                f"{where} is missing or has malformed entries ({exc!r}); restore it or repack"
            ) from exc

    @classmethod
    def load(cls, directory: str | os.PathLike[str], strict: bool = True) -> Manifest:
        """Read ``directory/manifest.json`` (``directory`` may also be the manifest path itself).

        Raises:
            ManifestNotFoundError: no manifest there.
            ManifestCorruptError, ManifestVersionError, UnsafePathError: see :meth:`from_dict`.
        """
        directory = os.fspath(directory)
        # (a dataset directory may itself be named *.json: pack writes one such)
        path = (directory if directory.endswith(".json") and not os.path.isdir(directory)
                else os.path.join(directory, MANIFEST_NAME))
        try:
            raw = read_regular(path)
        except FileNotFoundError as exc:
            raise ManifestNotFoundError(
                f"no manifest at {path}; create the dataset with `shardio pack SRC {directory}` "
                "or index existing tars with `shardio index`"
            ) from exc
        except IsADirectoryError as exc:
            raise ManifestNotFoundError(f"{path} is a directory, not a manifest") from exc
        except NotADirectoryError as exc:
            raise ManifestNotFoundError(
                f"{directory} is a file, not a dataset directory; pass the directory that holds "
                f"{MANIFEST_NAME}"
            ) from exc
        except OSError as exc:
            raise translate_oserror(exc, path, "reading the manifest") from exc
        try:
            data = json.loads(raw)
        # (nested past the parser's recursion limit, or an integer of over 4,300 digits)
        except (ValueError, RecursionError) as exc:
            raise ManifestCorruptError(
                f"{path} is not valid JSON ({exc}); it is damaged: restore it or repack"
            ) from exc
        return cls.from_dict(data, path, strict=strict)


_NONE = type(None)
_SHARD_TYPES: dict[str, tuple[type, ...]] = {
    "path": (str,), "samples": (int,), "bytes": (int,), "digest": (str,), "index": (str, _NONE),
    "index_digest": (str,), "stored_bytes": (int,), "raw_bytes": (int,),
}
_COMPRESSION_TYPES: dict[str, tuple[type, ...]] = {
    "codec": (str, _NONE), "level": (int,), "dictionary": (str, _NONE),
    "dictionary_digest": (str, _NONE),
}
_KIND_NAMES = {str: "a string", int: "a non-negative integer", dict: "an object", list: "a list",
               _NONE: "null"}


# No count or size of a real dataset comes near this; past it int64 arithmetic overflows.
_MAX_INT = 1 << 60


def _expect(where: str, name: str, value: Any, kinds: tuple[type, ...]) -> None:
    """Refuse ``value`` unless it is one of ``kinds`` (a bool is not an int; ints are >= 0 and
    below ``_MAX_INT``)."""
    if isinstance(value, bool) or not isinstance(value, kinds) or (
            isinstance(value, int) and not 0 <= value < _MAX_INT):
        want = " or ".join(_KIND_NAMES[k] for k in kinds)
        raise ManifestCorruptError(
            f"{where}: {name} is {value!r}, not {want}; the manifest was edited or damaged: "
            "restore it, or rebuild it with `shardio index` (tar) / repack"
        )


def _check_types(data: dict[str, Any], where: str) -> None:
    """Check the JSON types of every value the model reads, so a hand-edited manifest is a
    :class:`ManifestCorruptError` naming the field, not a TypeError wherever it is used."""
    _expect(where, "shard_format", data["shard_format"], (str,))
    _expect(where, "checksum", data["checksum"], (dict,))
    for name, known in (("sample", SAMPLE_ALGORITHMS), ("shard", DIGEST_ALGORITHMS)):
        algorithm = data["checksum"][name]
        _expect(where, f"checksum.{name}", algorithm, (str,))
        if algorithm not in known:
            raise ManifestCorruptError(
                f"{where}: checksum.{name} is {algorithm!r}, which this shardio does not know "
                f"({', '.join(known)}): a damaged manifest (restore it or repack), or one a "
                "newer shardio wrote (upgrade shardio)")
    _expect(where, "fields", data["fields"], (dict,))
    for name, count in data["fields"].items():
        _expect(where, f"fields.{name}", count, (int,))
    _expect(where, "shards", data["shards"], (list,))
    for i, shard in enumerate(data["shards"]):
        _expect(where, f"shards[{i}]", shard, (dict,))
        for name, kinds in _SHARD_TYPES.items():
            if name in shard:
                _expect(where, f"shards[{i}].{name}", shard[name], kinds)
    for name in ("compression", "labels", "stats", "parity"):
        _expect(where, name, data.get(name), (dict, _NONE))
    for name in ("job", "created_by"):
        _expect(where, name, data.get(name), (str, _NONE))
    comp = data.get("compression") or {}
    for name, kinds in _COMPRESSION_TYPES.items():
        if name in comp:
            _expect(where, f"compression.{name}", comp[name], kinds)
    if comp and (comp.get("codec") not in ("zstd", None) or not 1 <= comp.get("level", 3) <= 22):
        raise ManifestCorruptError(
            f"{where}: compression is {comp!r}, not a setting shardio writes (codec zstd or "
            "null, level 1 to 22); the manifest was edited or damaged: restore it")
    if comp.get("dictionary"):
        check_relpath(comp["dictionary"])
    labels = data.get("labels")
    if labels is not None:
        _expect(where, "labels.field", labels.get("field"), (str,))
        _expect(where, "labels.names", labels.get("names"), (list,))
        for i, name in enumerate(labels["names"]):
            _expect(where, f"labels.names[{i}]", name, (str,))


def _canonical_json(body: dict[str, Any]) -> bytes:
    """The bytes of ``manifest.json`` holding ``body``, exactly as :meth:`Manifest.save` writes
    them (``shardio verify`` compares the file with them to catch a cut that keeps valid JSON)."""
    return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def _check_totals(data: dict[str, Any], where: str) -> None:
    """A manifest whose shard list cannot be right (edited, its digest recomputed): every shard
    once, every file it names (shard, index, dictionary) distinct, no negative count, totals
    within int64.  (``num_samples`` not their sum is a problem ``verify`` reports.)"""
    shards = data["shards"]
    paths = [posixpath.normpath(s["path"]) for s in shards]  # ("./a.tar" is "a.tar")
    if len(set(paths)) != len(paths):
        twice = sorted({p for p in paths if paths.count(p) > 1})
        raise ManifestCorruptError(f"{where} lists shard {twice[0]} more than once; restore it "
                                   "or repack")
    # Every file the manifest names is a different one, and none is the manifest: repair
    # writes an index or dictionary where the manifest says it is, over whatever file that is
    # (an index path naming another shard made `shardio repair` overwrite that good shard).
    files = [(p, "a shard") for p in paths] + [
        (posixpath.normpath(s["index"]), "an index") for s in shards if s.get("index")]
    dictionary = (data.get("compression") or {}).get("dictionary")
    if dictionary:
        files.append((posixpath.normpath(dictionary), "the zstd dictionary"))
    seen: dict[str, str] = {MANIFEST_NAME: "the manifest itself"}
    for path, kind in files:
        if path in seen:
            raise ManifestCorruptError(
                f"{where} names {path} twice, as {seen[path]} and as {kind}: the manifest was "
                "edited or damaged; restore it, or rebuild it with `shardio index` (tar) / "
                "repack")
        seen[path] = kind
    if any(s["samples"] < 0 or s["bytes"] < 0 for s in shards) or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0
            for v in data["fields"].values()):
        raise ManifestCorruptError(f"{where} has a negative or non-integer count; restore it "
                                   "or repack")
    for name in ("samples", "bytes"):
        # (each is below _MAX_INT; their sum, the readers' int64 offsets, must be too)
        total = sum(s[name] for s in shards)
        if total >= _MAX_INT:
            raise ManifestCorruptError(
                f"{where}: its shards' {name} add up to {total}, more than any dataset holds; "
                "the manifest was edited or damaged: restore it, or rebuild it with "
                "`shardio index` (tar) / repack")


def _body_digest(body: dict[str, Any]) -> str:
    rest = {k: v for k, v in body.items() if k != "manifest_digest"}
    return digest_bytes(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())
