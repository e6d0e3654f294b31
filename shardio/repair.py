"""Self-repair: the ladder of copies a shard is read from, the counters of every fault, and
offline repair of a damaged dataset.

Ladder (:class:`CopyLadder`), for shard ``i`` in order:

    1. ``cache``     the node-local staged copy (:class:`shardio.stage.NodeCache`), when present;
    2. ``original``  the shard in the dataset directory on the shared filesystem;
    3. ``replica``   the same relative path under each directory of ``replicas=[...]``, in order;
    4. ``parity``    a copy rebuilt from the other shards of its parity group (``--parity K+M``).

Every copy of a shard is byte-identical (same manifest digest), so one index serves them all and
a read that fails on one copy is retried, for the same samples, on the next: the caller sees the
same samples in the same order.  A fault is a checksum mismatch, a short read (truncation), a
missing file, an unreadable index or an I/O error (EIO).  What happens to the bad copy:

* ``cache``: discarded (the stager copies it again);
* ``original``: left alone unless ``quarantine=True``, then kept in ``<dataset>/.quarantine/``
  and replaced (verified copy, atomic rename) by the first good copy;
* ``replica``: left alone (it is not ours to change).

A fault met while reading one sample (a checksum mismatch, an I/O error) marks the copy bad for
that sample only: a later sample that fails on the next copy is read again from a copy that
failed on another sample (bad bytes in two copies of a shard, at different places, lose nothing).
A copy that cannot be opened (missing, truncated, unreadable index) is bad for the whole shard.

Only when every copy fails a sample does ``on_corrupt`` decide: ``"raise"``
(:class:`UnrepairableError`) or ``"skip"`` (the sample is dropped and counted).  Every event is counted in
:class:`RepairCounters`, which live in shared memory that every worker process adds to (forked,
spawned or forkserver), logged on the ``shardio.repair`` logger, and reported by ``stats()``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from multiprocessing.context import get_spawning_popen
from multiprocessing.sharedctypes import RawArray
from typing import TYPE_CHECKING, Any

from ._atomics import fetch_add_u64, load_u64
from ._fsutil import resolve_in, tmp_name, translate_oserror
from .checksum import file_digest
from .errors import (
    ChecksumMismatchError,
    IndexCorruptError,
    ManifestCorruptError,
    MissingDependencyError,
    ParityError,
    ShardIOError,
    ShardioError,
    ShardNotFoundError,
    ShardTruncatedError,
    UnrepairableError,
    UsageError,
)
from .manifest import Manifest, ShardEntry

if TYPE_CHECKING:
    from .formats.base import ShardIndex

__all__ = ["COUNTERS", "FAULTS", "CopyLadder", "RepairCounters", "RepairReport",
           "fault_kind", "repair_dataset"]

log = logging.getLogger("shardio.repair")

FAULTS = (ChecksumMismatchError, ShardTruncatedError, ShardNotFoundError, IndexCorruptError,
          ManifestCorruptError, ShardIOError)
"""Exceptions that mean "this copy of the shard is bad": the ladder moves to the next copy."""

COUNTERS = (
    # faults seen, by kind
    "checksum_mismatch", "truncated", "missing", "index_corrupt", "io_error",
    # what was done about them
    "failovers", "cache_discarded", "originals_restored", "quarantined", "parity_rebuilt",
    "skipped_samples", "unrepairable",
    # a parity rebuild that failed (damaged or missing parity, more of the group lost than
    # parity covers, zfec not installed): a fault of the parity copy, not a read error
    "parity_failed",
    # reads by source (metadata operations and bytes)
    "opens", "stats", "bytes_cache", "bytes_original", "bytes_replica", "bytes_parity",
)
QUARANTINE_DIR = ".quarantine"
REBUILT_DIR = ".shardio-rebuilt"


def fault_kind(exc: BaseException) -> str:
    """The counter a fault increments."""
    if isinstance(exc, ChecksumMismatchError):
        return "checksum_mismatch"
    if isinstance(exc, ShardTruncatedError):
        return "truncated"
    if isinstance(exc, ShardNotFoundError):
        return "missing"
    if isinstance(exc, (IndexCorruptError, ManifestCorruptError)):
        return "index_corrupt"
    if isinstance(exc, (ParityError, MissingDependencyError)):
        return "parity_failed"
    return "io_error"


class RepairCounters:
    """Event and I/O counters in shared memory: workers add to the same numbers, atomically
    (u64 fetch-and-add), so the parent's ``stats()`` sees every event.  Forked workers inherit
    the mapping; spawned and forkserver workers (DataLoader's ``multiprocessing_context``) get
    it with the dataset, as a ``multiprocessing`` shared array."""

    def __init__(self, shared: Any = None) -> None:
        self._arr = shared if shared is not None else RawArray(ctypes.c_uint64, len(COUNTERS))
        self._buf = memoryview(self._arr).cast("B")
        self._slot = {name: 8 * k for k, name in enumerate(COUNTERS)}

    def add(self, name: str, n: int = 1) -> None:
        fetch_add_u64(self._buf, self._slot[name], n)

    def adder(self, name: str) -> Callable[[int], Any]:
        """``add(name, n)`` as one C call, for per-read hot paths."""
        return functools.partial(fetch_add_u64, self._buf, self._slot[name])

    def get(self, name: str) -> int:
        return load_u64(self._buf, self._slot[name])

    def snapshot(self) -> dict[str, int]:
        return {name: self.get(name) for name in COUNTERS}

    def __getstate__(self) -> dict[str, Any]:
        if get_spawning_popen() is not None:  # handed to a new process: the array travels
            return {"shared": self._arr}
        return {}  # plain pickling: a mapping cannot travel; the copy counts alone

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state.get("shared"))  # type: ignore[misc]


@dataclass(frozen=True)
class Copy:
    """One copy of a shard on the ladder: ``kind`` in cache/original/replica/parity."""

    kind: str
    path: str


class CopyLadder:
    """Where the copies of each shard are, and what to do with a bad one.

    Args:
        root: dataset directory.
        manifest: its manifest.
        cache: a node cache (``lookup(i)``, ``discard(i, reason)``, ``rebuilt_dir``), or ``None``.
        replicas: dataset directories holding byte-identical copies of the shards.
        quarantine: allow moving a bad original aside and replacing it with a good copy.
        on_corrupt: ``"raise"`` or ``"skip"`` once every copy failed.
    """

    def __init__(self, root: str, manifest: Manifest, *, cache: Any = None,
                 replicas: Sequence[str] = (), quarantine: bool = False,
                 on_corrupt: str = "raise", counters: RepairCounters | None = None) -> None:
        if on_corrupt not in ("raise", "skip"):
            raise UsageError(f"on_corrupt must be 'raise' or 'skip', got {on_corrupt!r}")
        self.root, self.manifest, self.cache = root, manifest, cache
        self.replicas = tuple(os.fspath(r) for r in replicas)
        self.quarantine, self.on_corrupt = quarantine, on_corrupt
        self.counters = counters or RepairCounters()
        # Per shard: the paths of copies bad as a whole, and (path, sample) of copies bad for
        # one sample (see the module docstring).
        self._bad: dict[int, set[str]] = {}
        self._bad_samples: dict[int, set[tuple[str, int]]] = {}
        self._attempts: dict[int, list[tuple[str, str]]] = {}
        # The copies tried when the ladder last gave up on a shard (see give_up).
        self.gave_up: dict[int, list[tuple[str, str]]] = {}
        self._last: dict[int, BaseException] = {}
        # Shards given up with every copy bad as a whole, under on_corrupt="skip": the attempts
        # and the last error (see give_up).
        self._lost: dict[int, tuple[list[tuple[str, str]], BaseException | None]] = {}
        self._rebuilt_dir: str | None = None
        # (path, inode, size, mtime) of rebuilt copies found good in this process.
        self._rebuilt_ok: set[tuple[str, int, int, int]] = set()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["cache"] = None  # process-bound; the owner re-attaches its own
        return state

    def entry(self, i: int) -> ShardEntry:
        return self.manifest.shards[i]

    def original(self, i: int) -> str:
        return resolve_in(self.root, self.entry(i).path)

    def copies(self, i: int, sample: int | None = None) -> list[Copy]:
        """The copies of shard ``i`` not yet found bad (as a whole, or for ``sample`` when one
        is given), in ladder order (parity last, rebuilt on demand by :meth:`rebuild`)."""
        bad = set(self._bad.get(i, ()))
        if sample is not None:
            bad.update(p for p, k in self._bad_samples.get(i, ()) if k == sample)
        out = []
        if self.cache is not None:
            cached = self.cache.lookup(i)
            if cached is not None:
                out.append(Copy("cache", cached))
        out.append(Copy("original", self.original(i)))
        rel = self.entry(i).path
        out += [Copy("replica", resolve_in(r, rel)) for r in self.replicas]
        if self.manifest.parity:
            out.append(Copy("parity", self._rebuilt_path(i)))
        return [c for c in out if c.path not in bad]

    def failed(self, i: int, copy: Copy, exc: BaseException, sample: int | None = None, *,
               reading: int | None = None) -> None:
        """Record that ``copy`` of shard ``i`` is bad (for ``sample`` only, when the fault came
        from reading that sample); deal with it as the module docstring says.  ``reading``: the
        sample the copy was opened for (a fault of the whole copy), whose next copy is the
        failover (none when every other copy failed that sample).

        A staged copy that the stager no longer publishes (it evicted it, or another reader
        found it bad and discarded it, after :meth:`copies` named it here) is not counted
        again: its file may be gone before this reader opens it, and a fault of it was counted
        by the reader that discarded it.  The next :meth:`copies` no longer names it."""
        kind = fault_kind(exc)
        if copy.kind == "cache" and self.cache is not None and not self.cache.published(i):
            log.debug("shard %s: its staged copy was dropped while this reader used it (%s); "
                      "reading the next copy", self.entry(i).path, kind)
            return
        self.counters.add(kind)
        if sample is None:
            self._bad.setdefault(i, set()).add(copy.path)
        else:
            self._bad_samples.setdefault(i, set()).add((copy.path, sample))
        self._attempts.setdefault(i, []).append((f"{copy.kind} {copy.path}", kind))
        self._last[i] = exc
        if copy.kind == "cache" and self.cache is not None:
            self.cache.discard(i, kind)
            self.counters.add("cache_discarded")
        left = self.copies(i, sample if sample is not None else reading)
        if left:  # (a failover is a move to another copy: none when none is left)
            self.counters.add("failovers")
        log.warning("shard %s: %s copy failed (%s: %s); %s", self.entry(i).path, copy.kind,
                    kind, exc, "trying the next copy" if left else (
                        "no other copy left" if self.manifest.parity
                        else "no other copy (add replicas=, or pack with --parity)"))

    def recovered(self, i: int, copy: Copy) -> None:
        """A read from ``copy`` succeeded after earlier copies failed: restore the original from
        it when quarantine is allowed."""
        original = self.original(i)
        if (copy.kind != "original" and self.quarantine and self._is_bad(i, original)
                and restore_original(self.root, self.entry(i), copy.path, self.counters,
                                     self.manifest)):
            self._bad.get(i, set()).discard(original)
            self._bad_samples[i] = {b for b in self._bad_samples.get(i, ()) if b[0] != original}

    def _all_bad(self, i: int) -> bool:
        """Whether every copy of shard ``i`` past the node cache is bad as a whole (a cached
        copy is staged from the original, so it cannot outlive it)."""
        bad = self._bad.get(i, ())
        rel = self.entry(i).path
        paths = [self.original(i), *(resolve_in(r, rel) for r in self.replicas)]
        if self.manifest.parity:
            paths.append(self._rebuilt_path(i))
        return all(p in bad for p in paths)

    def _is_bad(self, i: int, path: str) -> bool:
        """Whether ``path`` failed as shard ``i``'s copy, as a whole or for any sample."""
        return (path in self._bad.get(i, ())
                or any(p == path for p, _k in self._bad_samples.get(i, ())))

    def give_up(self, i: int) -> Exception:
        """The error for shard ``i`` once no copy is left; resets the ladder so the next sample
        starts from the top again (a copy bad in one sample may be good in another).  With a
        single copy configured that copy's own typed error is returned (it names the fix);
        otherwise :class:`UnrepairableError` listing every attempt, chained to the last.

        Under ``on_corrupt="skip"`` a copy bad as a whole (missing, truncated, a bad index)
        stays bad, and a shard none of whose copies opens stays lost: its other samples are
        given up without trying those copies again, so each fault and the shard's
        ``unrepairable`` are counted (and logged) once, not once per sample."""
        attempts = self._attempts.pop(i, [])
        last = self._last.pop(i, None)
        lost = self._lost.get(i)
        if lost is not None and not attempts:
            attempts, last = lost  # known lost: no copy was tried again, no new event
        else:
            self.counters.add("unrepairable")
        self._bad_samples.pop(i, None)
        if self.on_corrupt == "skip":
            # (the reading goes on: a copy bad as a whole stays bad, as it does while a later
            # copy serves the shard)
            if self._all_bad(i):
                self._lost[i] = (attempts, last)
        else:  # (the error ends the reading: a new one, after a repair, starts from the top)
            self._bad.pop(i, None)
            self._lost.pop(i, None)
        self.gave_up[i] = attempts  # (random access under on_corrupt="skip" reports them)
        if len(attempts) == 1 and isinstance(last, Exception):
            return last
        hint = None
        if self.manifest.parity:  # ("pack with --parity" would be no advice here)
            hint = ("more of its parity group is lost than parity covers: add a replica "
                    "(replicas=[...] or `shardio repair --replica DIR`), or set "
                    "on_corrupt='skip'")
        err = UnrepairableError(self.entry(i).path, attempts, hint=hint)
        err.__cause__ = last
        return err

    def rebuild(self, i: int) -> str:
        """Rebuild shard ``i`` (and its index) from parity into the rebuilt directory, or reuse
        a copy rebuilt there earlier once its size and digest match the manifest (a copy left
        by an earlier dataset packed to the same directory is rebuilt, never served).

        Raises:
            ParityError, MissingDependencyError: as :func:`shardio.parity.rebuild_shard`.
            ShardIOError: the rebuilt directory cannot be written or read.
        """
        from .parity import rebuild_shard

        dest = self._rebuilt_path(i)
        try:
            if not self._rebuilt_good(i, dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                # No stale copy is removed first: the rebuild replaces ``dest`` atomically, and a
                # stale ``.idx`` is refused and made again (_ensure_index).  (Removing them
                # opened a window where another process that had just published its rebuild
                # found it missing, and gave the shard up.)
                rebuild_shard(self.root, self.manifest, i, dest, bad=self._bad_originals())
                self.counters.add("parity_rebuilt")
                log.warning("shard %s rebuilt from parity into %s", self.entry(i).path, dest)
            _ensure_index(self, i, dest)
        except OSError as exc:
            raise translate_oserror(exc, dest, "rebuilding shard into") from exc
        return dest

    def _rebuilt_good(self, i: int, path: str) -> bool:
        """Whether ``path`` holds shard ``i``'s bytes (hashed once per process and file)."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return False
        key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in self._rebuilt_ok:
            return True
        entry = self.entry(i)
        if st.st_size != entry.bytes or file_digest(path, self.manifest.digest)[0] != entry.digest:
            return False
        self._rebuilt_ok.add(key)
        return True

    def _bad_originals(self) -> list[int]:
        shards = set(self._bad) | set(self._bad_samples)
        return sorted(j for j in shards if self._is_bad(j, self.original(j)))

    def _rebuilt_path(self, i: int) -> str:
        return resolve_in(self._rebuilt_base(), self.entry(i).path)

    def _rebuilt_base(self) -> str:
        """The node cache's ``rebuilt`` directory, else ``<dataset>/.shardio-rebuilt``, else (a
        read-only dataset directory, as shared datasets usually are) a per-user directory under
        the system's temp directory, named after the dataset's path."""
        if self.cache is not None:
            # (Not the cache directory itself: a shard path "data/x.tar" landed among the
            # stager's copies, replacing its copy of shard "x.tar", and a starting stager
            # deleted the temp file of a rebuild in progress.)
            return str(self.cache.rebuilt_dir)
        if self._rebuilt_dir is None:
            base = os.path.join(self.root, REBUILT_DIR)
            if not os.access(base if os.path.isdir(base) else self.root, os.W_OK):
                tag = hashlib.sha256(os.path.realpath(self.root).encode()).hexdigest()[:16]
                base = os.path.join(tempfile.gettempdir(), f"shardio-rebuilt-{os.getuid()}", tag)
            self._rebuilt_dir = base
        return self._rebuilt_dir


def _ensure_index(ladder: CopyLadder, i: int, shard_path: str) -> None:
    """Give a rebuilt tar shard its ``.idx``: a good copy from any copy of the shard, else
    one made by scanning the (verified) tar (see :func:`_make_index`)."""
    entry = ladder.entry(i)
    if entry.index is None:
        return
    sources = [(resolve_in(base, entry.index), base) for base in (ladder.root, *ladder.replicas)]
    _make_index(ladder.manifest, entry, shard_path + ".idx", shard_path, sources, scan=True)


def _make_index(m: Manifest | None, entry: ShardEntry, dest: str, shard: str,
                sources: Iterable[tuple[str, str]], *, scan: bool) -> str | None:
    """Make ``dest`` an index file shard ``entry`` may use (:func:`index_file_ok`): keep it
    when it is one; else copy the first of ``sources`` (``(index path, what it is)``) that is
    one; else, with ``scan``, read one from the tar ``shard`` (a copy that matches the
    manifest's digest).  Returns where the index came from ("" when it was kept), or None.

    Raises:
        OSError, ShardioError: reading the shard failed (``scan``).
    """
    if index_file_ok(dest, entry):
        return ""
    if os.path.exists(dest):  # (damaged since it was made: every reader failed on it for good)
        log.warning("the index %s is damaged; making it again", dest)
    for src, what in sources:
        try:
            if _copy_index(src, dest, entry):
                return what
        except OSError as exc:
            log.warning("cannot copy the index %s to %s: %s", src, dest, exc)
    if not scan or m is None:
        return None
    _scan_index(m, entry, shard, dest)
    return "an index read from the shard itself"


def _scan_index(m: Manifest, entry: ShardEntry, shard_path: str, dest: str) -> None:
    """Write at ``dest`` an index read from the tar ``shard_path`` (a copy that matched the
    manifest's digest)."""
    from .formats.tar import index_tar

    # The shard was verified against its manifest digest: an index read from it, as shardio
    # wrote it, says where its samples are (the packer's own index records the pack job too,
    # so this one's digest differs from the manifest's: see DatasetReader._open_copy).
    zstd = (m.compression or {}).get("codec") == "zstd"
    index, _ = index_tar(shard_path, m.checksum, webdataset=False,
                         zstd_fields=set(m.fields) if zstd else None)
    index.meta.update(shard_bytes=entry.bytes, shard_digest=entry.digest, rebuilt=True)
    tmp = tmp_name(dest)
    with open(tmp, "wb") as f:
        f.write(index.to_bytes())
    os.replace(tmp, dest)


def restore_index(root: str, entry: ShardEntry, shard: str, sources: Iterable[tuple[str, str]],
                  manifest: Manifest | None) -> str | None:
    """Make the index file of ``entry`` in ``root`` one it may use, the shard file being good
    (:func:`_make_index`; the scan needs ``manifest``, a tar, and ``shard`` matching the
    manifest's digest).  Returns where the index came from ("" when it was fine), or None
    when no good index could be made."""
    if entry.index is None:
        return ""
    scan = (manifest is not None and manifest.shard_format == "tar"
            and _matches(shard, entry.digest, entry.bytes))
    try:
        return _make_index(manifest, entry, resolve_in(root, entry.index), shard, sources,
                           scan=scan)
    except (OSError, ShardioError) as exc:
        log.warning("cannot read an index from %s: %s", shard, exc)
        return None


def rebuilt_index_matches(index: ShardIndex, entry: ShardEntry) -> bool:
    """Whether an index whose digest is not the manifest's was read from a copy of the shard that
    matched the manifest, by :func:`_ensure_index`: it then says where that shard's samples are
    as well as the packer's own (whose digest also covers the pack job).  Its sample count and
    sizes must be the manifest's too: one that took a compressed field for a raw one has other
    raw bytes."""
    meta = index.meta
    return (bool(meta.get("rebuilt")) and meta.get("shard_digest") == entry.digest
            and meta.get("shard_bytes") == entry.bytes and len(index) == entry.samples
            and index.stored_bytes == entry.stored_bytes and index.raw_bytes == entry.raw_bytes)


def index_file_ok(path: str, entry: ShardEntry) -> bool:
    """Whether the ``.idx`` at ``path`` is one shard ``entry`` may use: the manifest's (its
    digest), or one rebuilt from a verified copy of the shard (:func:`rebuilt_index_matches`)."""
    if _matches(path, entry.index_digest or None, None):
        return True
    from .formats.base import ShardIndex

    try:
        with open(path, "rb") as f:
            index = ShardIndex.from_bytes(f.read(), path)
    except (OSError, ShardioError):
        return False
    return rebuilt_index_matches(index, entry)


def _copy_index(src: str, dest: str, entry: ShardEntry) -> bool:
    """Publish a copy of the index ``src`` at ``dest`` when :func:`index_file_ok` accepts it."""
    if not index_file_ok(src, entry):
        return False
    digest = entry.index_digest or None
    _copy_verified(src, dest, digest if _matches(src, digest, None) else None)
    return True


def _copy_verified(src: str, dest: str, digest: str | None, layout: Any = None) -> None:
    """Copy ``src`` to ``dest`` through a temp file; publish only if the copy has ``digest``.
    With ``layout`` (a :class:`shardio.lustre.LayoutRequest`) the temp file is created with
    that Lustre layout (else a plain copy gets its directory's default)."""
    tmp = tmp_name(dest)
    try:
        if layout is None or not _copy_striped(src, tmp, layout):
            shutil.copyfile(src, tmp)
        if digest is not None and file_digest(tmp)[0] != digest:
            raise ShardIOError(0, f"copy of {src} does not match its digest; not published")
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _copy_striped(src: str, tmp: str, layout: Any) -> bool:
    """Copy ``src`` into the new file ``tmp`` created with the Lustre ``layout``; False (and
    nothing at ``tmp``) when the layout cannot be set there."""
    from . import lustre

    try:
        fd, _report = lustre.create_striped(tmp, layout)
    except (ShardioError, OSError) as exc:  # LayoutError, LayoutNotAppliedError, ...
        log.warning("cannot give %s the Lustre layout of the shard it replaces (%s); it gets "
                    "its directory's default layout", tmp, exc)
        return False
    with os.fdopen(fd, "wb") as out, open(src, "rb") as inp:
        shutil.copyfileobj(inp, out, 16 << 20)
    return True


def _layout_to_keep(root: str, entry: ShardEntry, manifest: Manifest | None) -> Any:
    """The Lustre layout a restored copy of ``entry`` should be created with: the damaged
    original's, else a sibling shard's (a pack gives all its shards one layout); None off
    Lustre, or when none is a plain layout to copy."""
    from . import lustre

    paths = [resolve_in(root, entry.path)]
    if manifest is not None:
        paths += [resolve_in(root, s.path) for s in manifest.shards[:8] if s.path != entry.path]
    for path in paths:
        try:
            layout = lustre.get_layout(path)
        except (ShardioError, OSError):
            continue
        if layout is None:
            return None  # not Lustre
        if not layout.composite and layout.stripe_size > 0 and layout.stripe_count >= 1:
            try:
                return lustre.LayoutRequest(stripe_count=layout.stripe_count,
                                            stripe_size=layout.stripe_size, pool=layout.pool)
            except UsageError:  # a layout no request can name (a non-ASCII pool, damaged)
                continue
    return None


def restore_original(root: str, entry: ShardEntry, good: str,
                     counters: RepairCounters | None = None,
                     manifest: Manifest | None = None) -> bool:
    """Move the bad original of ``entry`` into ``<root>/.quarantine/`` and publish a verified
    copy of ``good`` in its place, with a good index (:func:`restore_index`: the good copy's,
    else one read from the shard).  An original whose shard file is fine but whose index is
    not gets a good index only.  Serialised across processes by a lock file; returns False
    when nothing needed restoring (another process restored it), when the good copy does not
    match the manifest, or when no good index could be made for the shard."""
    original = resolve_in(root, entry.path)
    lock_path = os.path.join(root, ".shardio-repair.lock")
    try:
        lock = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        log.warning("cannot restore %s: dataset directory not writable (%s)", original, exc)
        return False
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        sources = [(good + ".idx", f"the index of {good}")]
        if _matches(original, entry.digest, entry.bytes):
            # The shard is fine: restored by another process, or only its index is bad (an
            # original that kept failing over on its index was never mended).
            came = restore_index(root, entry, original, sources, manifest)
            if not came:
                return False
            if counters is not None:
                counters.add("originals_restored")
            log.warning("shard %s: bad index restored (%s)", entry.path, came)
            return True
        if not _matches(good, entry.digest, entry.bytes):
            return False
        layout = _layout_to_keep(root, entry, manifest)  # (before the original moves away)
        if os.path.exists(original):
            _quarantine(root, entry, original)
            if counters is not None:
                counters.add("quarantined")
        _copy_verified(good, original, entry.digest, layout)
        if restore_index(root, entry, original, sources, manifest) is None:
            # (the shard is mended, but not its index: not a repair to report as done)
            log.warning("shard %s restored from %s, but no good index for it could be made: "
                        "restore %s from a good copy", entry.path, good, entry.index)
            return False
        if counters is not None:
            counters.add("originals_restored")
        log.warning("shard %s: bad original quarantined and restored from %s", entry.path, good)
        return True
    except OSError as exc:
        log.warning("cannot restore %s from %s: %s", original, good, exc)
        return False
    finally:
        os.close(lock)


def _quarantine(root: str, entry: ShardEntry, original: str) -> None:
    """Keep the bad ``original`` of ``entry`` under ``<root>/.quarantine/``, named with the time
    (and a number, when that name is taken: an earlier bad copy is never overwritten).

    A hard link, where the filesystem has them: the original stays at its path until the good
    copy replaces it (atomically), so a reader of the dataset (another job's, with no other
    copy) never finds the shard missing while it is restored.  Elsewhere it is moved."""
    qdir = os.path.join(root, QUARANTINE_DIR, os.path.dirname(entry.path))
    os.makedirs(qdir, exist_ok=True)
    base = os.path.join(qdir, f"{os.path.basename(entry.path)}.{time.strftime('%Y%m%dT%H%M%S')}")
    for n in range(1000):
        dest = base if n == 0 else f"{base}-{n}"
        try:
            os.link(original, dest)
            return
        except FileExistsError:
            continue
        except OSError:  # (no hard links on this filesystem)
            if os.path.lexists(dest):
                continue
            os.replace(original, dest)
            return
    raise FileExistsError(errno.EEXIST, "no free quarantine name", base)


def _matches(path: str, digest: str | None, size: int | None) -> bool:
    try:
        if size is not None and os.stat(path).st_size != size:
            return False
        return digest is None or file_digest(path)[0] == digest
    except OSError:
        return False


@dataclass
class RepairReport:
    """What :func:`repair_dataset` found and did, shard by shard."""

    checked: int = 0
    damaged: list[str] | None = None
    repaired: list[tuple[str, str]] | None = None  # (shard, source)
    unrepaired: list[str] | None = None

    @property
    def ok(self) -> bool:
        return not self.unrepaired


def repair_dataset(root: str, *, replicas: Iterable[str] = (), use_parity: bool = True,
                   damaged: Iterable[int] | None = None) -> RepairReport:
    """Repair a dataset offline: every damaged shard (whole-file digest or size wrong, missing,
    or index bad) is quarantined and replaced by a verified copy from ``replicas`` or rebuilt
    from parity.  ``damaged`` limits the work to shards already known bad (from a verify pass).

    Raises:
        ManifestError: the dataset's manifest is unusable (repair needs it).
    """
    root = os.fspath(root)
    manifest = Manifest.load(root)
    replicas = tuple(os.fspath(r) for r in replicas)
    ladder = CopyLadder(root, manifest, replicas=replicas, quarantine=True)
    report = RepairReport(damaged=[], repaired=[], unrepaired=[])
    _repair_dictionary(root, manifest, tuple(replicas), report)
    todo = range(len(manifest.shards)) if damaged is None else sorted(set(damaged))
    left = []
    for i in todo:
        entry = manifest.shards[i]
        report.checked += 1
        idx_ok = entry.index is None or index_file_ok(resolve_in(root, entry.index), entry)
        if _matches(ladder.original(i), entry.digest, entry.bytes) and idx_ok:
            continue
        report.damaged.append(entry.path)
        source = _repair_one(ladder, i, replicas, False)
        if source is None:
            left.append(i)
        else:
            report.repaired.append((entry.path, source))
    # Parity last: a group with more damaged shards than its parity covers rebuilds the rest
    # once replicas restored enough of them, whatever their order in the manifest.
    for i in left:
        entry = manifest.shards[i]
        source = _repair_one(ladder, i, (), True) if use_parity else None
        if source is None:
            report.unrepaired.append(entry.path)
        else:
            report.repaired.append((entry.path, source))
    return report


def _repair_dictionary(root: str, manifest: Manifest, replicas: Sequence[str],
                       report: RepairReport) -> None:
    """Restore the dataset's zstd dictionary from the first replica whose copy matches the
    manifest, when the dataset's own is missing or damaged."""
    comp = manifest.compression or {}
    rel = comp.get("dictionary")
    if not rel:
        return
    dest = resolve_in(root, rel)
    if _matches(dest, comp.get("dictionary_digest"), None):
        return
    report.damaged.append(rel)
    for r in replicas:
        src = resolve_in(r, rel)
        if _matches(src, comp.get("dictionary_digest"), None):
            try:
                _copy_verified(src, dest, comp.get("dictionary_digest"))
            except OSError as exc:
                log.warning("cannot restore %s from %s: %s", dest, src, exc)
                continue
            report.repaired.append((rel, f"replica {r}"))
            return
    report.unrepaired.append(rel)


def _repair_one(ladder: CopyLadder, i: int, replicas: Sequence[str], use_parity: bool) -> str | None:
    entry = ladder.entry(i)
    original = ladder.original(i)
    if _matches(original, entry.digest, entry.bytes):
        # Only the index is bad: a replica's, else one read from the shard itself (a tar lost
        # only its .idx needs no other copy, parity or replica).
        sources = [(resolve_in(r, entry.index), f"the index of replica {r}") for r in replicas
                   if entry.index is not None]
        return restore_index(ladder.root, entry, original, sources, ladder.manifest) or None
    ladder._bad.setdefault(i, set()).add(original)
    for r in replicas:
        cand = resolve_in(r, entry.path)
        if _matches(cand, entry.digest, entry.bytes) and restore_original(
                ladder.root, entry, cand, ladder.counters, ladder.manifest):
            ladder._bad[i].discard(original)  # (good now: a source for its group's parity)
            return f"replica {r}"
    if use_parity and ladder.manifest.parity:
        try:
            rebuilt = ladder.rebuild(i)
        except (ShardioError, OSError) as exc:  # ParityError, MissingDependencyError, EIO
            log.warning("shard %s: parity rebuild failed: %s", entry.path, exc)
            return None
        try:
            if restore_original(ladder.root, entry, rebuilt, ladder.counters, ladder.manifest):
                ladder._bad[i].discard(original)
                return "parity"
        finally:
            for p in (rebuilt, rebuilt + ".idx"):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
    return None
