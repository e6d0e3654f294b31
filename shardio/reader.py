"""Random access to a packed dataset: global sample index → shard → ``pread`` at the indexed offset."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from . import _inject
from ._fsutil import read_regular, resolve_in, translate_oserror
from .checksum import digest_bytes
from .codec import Codec
from .errors import (
    DatasetChangedError,
    IndexCorruptError,
    LayoutError,
    ManifestCorruptError,
    ManifestError,
    MissingDependencyError,
    ParityError,
    ShardIOError,
    ShardNotFoundError,
    ShardTruncatedError,
    UnrepairableError,
)
from .formats import ShardIndex, ShardReader, index_loader
from .formats.base import FileIdent, file_ident, list_position
from .lustre import (
    MAX_READ_BLOCK,
    MiB,
    detect_fs,
    get_layout,
    read_block_size,
    spread_by_ost,
)
from .manifest import MANIFEST_NAME, Manifest, dataset_dir
from .repair import FAULTS, Copy, CopyLadder, rebuilt_index_matches

log = logging.getLogger("shardio.reader")

try:  # batch reads of single samples (shardio/_sampleio.c); ShardReader.get is the reference
    from ._sampleio import read_many as _read_many
except ImportError:  # pragma: no cover - the C extension is optional
    _read_many = None

__all__ = ["DatasetReader", "open_dataset"]


def load_dictionary(root: str, manifest: Manifest, replicas: Sequence[str] = ()) -> bytes | None:
    """The dataset's zstd dictionary (None without one): the first copy, the dataset's own
    then each replica's, that matches the manifest's digest.

    Raises:
        ManifestCorruptError: no copy of the dictionary file matches (missing or damaged).
    """
    comp = manifest.compression or {}
    if not comp.get("dictionary"):
        return None
    why = []
    for base in (root, *replicas):
        path = resolve_in(base, comp["dictionary"])
        try:
            data = read_regular(path)
        except OSError as exc:
            why.append(f"{path}: {exc.strerror or exc}")
            continue
        if digest_bytes(data) == comp.get("dictionary_digest"):
            if base != root:
                log.warning("zstd dictionary of %s: using the replica's copy %s (%s)", root,
                            path, "; ".join(why))
            return data
        why.append(f"{path}: does not match the manifest's digest")
    raise ManifestCorruptError(
        f"no good copy of the zstd dictionary named by the manifest ({'; '.join(why)}); restore "
        "it from a copy of the dataset (`shardio repair DATASET --replica DIR`) or repack")


def load_codec(root: str, manifest: Manifest, replicas: Sequence[str] = ()) -> Codec:
    """The codec a dataset was packed with, its zstd dictionary loaded and checked
    (:func:`load_dictionary`).

    Raises:
        ManifestCorruptError: no copy of the dictionary file matches the manifest's digest.
    """
    comp = manifest.compression
    if not comp:
        return Codec()
    dictionary = load_dictionary(root, manifest, replicas)
    return Codec(comp.get("codec"), int(comp.get("level", 3)), dictionary)


class DatasetReader:
    """Read samples of a shardio dataset by global index or shard by shard, with self-repair.

    Indexes load lazily, one per shard touched, and are kept as numpy arrays.  The object pickles
    without open descriptors, so it can be handed to worker processes.  Each shard is read from
    the first good copy on its ladder (node cache, original, replicas, parity; see
    :mod:`shardio.repair`); a fault on one copy retries the same samples on the next.

    Args:
        root: dataset directory (holding ``manifest.json``).
        verify: check each field's checksum on read.
        max_open_shards: shard readers (descriptor + index) kept open per process.
        cache: a :class:`shardio.stage.NodeCache` whose staged copies are read first.
        replicas: directories holding byte-identical copies of the dataset.
        quarantine: allow replacing a bad original with a verified good copy.
        on_corrupt: ``"raise"`` or ``"skip"`` when no good copy of a sample exists.
        read_block: size of coalesced sequential reads (raised to a multiple of the Lustre
            stripe size when the shards are on Lustre).
    """

    def __init__(self, root: str | os.PathLike[str], *, verify: bool = True,
                 max_open_shards: int = 256, cache: Any = None, replicas: Sequence[str] = (),
                 quarantine: bool = False, on_corrupt: str = "raise",
                 read_block: int = 8 << 20) -> None:
        self.root = dataset_dir(root)
        self.max_open_shards = max_open_shards
        # (stat first: a manifest replaced between the two is then seen as changed, and checked)
        self._manifest_ident = self._manifest_now()
        self.manifest = Manifest.load(self.root)
        self.verify = verify
        self.codec = load_codec(self.root, self.manifest, tuple(os.fspath(r) for r in replicas))
        self._load_index = index_loader(self.manifest.shard_format)
        counts = np.array([s.samples for s in self.manifest.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(counts)])
        self.ladder = CopyLadder(self.root, self.manifest, cache=cache, replicas=replicas,
                                 quarantine=quarantine, on_corrupt=on_corrupt)
        self.counters = self.ladder.counters
        self.read_block = read_block
        self._fs: str | None = None
        self._osts: dict[int, int | None] = {}
        self._readers: OrderedDict[int, tuple[Copy, ShardReader]] = OrderedDict()
        self._reopened = 0  # counts changes to _readers (read_ids' batch reads look at it)
        self._removals_seen = -1  # the node cache's removal count at the last look
        # Each cached index with the file it was loaded from: (path, identity, index).
        self._indexes: OrderedDict[int, tuple[str, FileIdent, ShardIndex]] = OrderedDict()
        self._advised: set[int] = set()
        self.arena: Any = None

    def set_arena(self, arena: Any) -> None:
        """Read into ``arena`` (a :class:`shardio.sharedbytes.Arena`; ``None``: plain ``bytes``)
        from now on: large uncompressed fields come out as views of its chunks."""
        self.arena = arena
        for _copy, reader in self._readers.values():
            reader.arena = arena

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_shards(self) -> int:
        return len(self.manifest.shards)

    def shard_path(self, i: int) -> str:
        return resolve_in(self.root, self.manifest.shards[i].path)

    def shard_index(self, i: int) -> ShardIndex:
        return self.shard(i).index

    def shard(self, i: int) -> ShardReader:
        """Reader for shard ``i`` on its first good copy (cached per process).

        Raises:
            UnrepairableError: no copy of the shard could be opened.
        """
        got = self._readers.get(i)
        if got is not None:
            self._readers.move_to_end(i)
            return got[1]
        return self._open(i)[1]

    def _open(self, i: int, sample: int | None = None) -> tuple[Copy, ShardReader]:
        """Shard ``i`` opened on its first copy that opens cleanly, among those not found bad
        (for ``sample``, when the read is for that sample: see :class:`CopyLadder`)."""
        while True:
            copies = self.ladder.copies(i, sample)
            if not copies:
                raise self.ladder.give_up(i)
            copy = copies[0]
            try:
                path = self.ladder.rebuild(i) if copy.kind == "parity" else copy.path
                reader = self._open_copy(i, copy.kind, path)
            except (*FAULTS, ParityError, MissingDependencyError) as exc:
                self.ladder.failed(i, copy, exc, reading=sample)
                continue
            if copy.kind != "original":
                self.ladder.recovered(i, copy)  # restores a bad original when allowed
            return self._keep(i, copy, reader)

    def _probe(self, i: int) -> ShardReader | None:
        """Shard ``i``'s reader for a prefetch hint: opened on its first good copy when that
        opens cleanly (no parity rebuild); otherwise ``None``, with the ladder and its fault
        counters untouched, so that the real read meets the fault and counts it once."""
        got = self._readers.get(i)
        if got is not None:
            return got[1]
        copies = self.ladder.copies(i)
        if not copies or copies[0].kind == "parity":
            return None
        copy = copies[0]
        try:
            reader = self._open_copy(i, copy.kind, copy.path)
        except (*FAULTS, MissingDependencyError):
            return None
        if copy.kind != "original":
            self.ladder.recovered(i, copy)
        return self._keep(i, copy, reader)[1]

    def stand_in(self, avoid: Iterable[int] = ()) -> dict[str, Any] | None:
        """The first sample, in shard order, that reads cleanly from a shard not in ``avoid``,
        found without the repair ladder or its counters (a stand-in for skipped samples);
        ``None`` when no shard has one."""
        skip = set(avoid)
        for s in range(self.num_shards):
            if s in skip or self.offsets[s + 1] == self.offsets[s]:
                continue
            reader = self._probe(s)
            if reader is None:
                continue
            try:
                return reader.get(0)
            except FAULTS:
                continue
        return None

    def _keep(self, i: int, copy: Copy, reader: ShardReader) -> tuple[Copy, ShardReader]:
        reader.arena = self.arena
        self._readers[i] = (copy, reader)
        self._reopened += 1
        while len(self._readers) > self.max_open_shards:
            j, (_, old) = self._readers.popitem(last=False)
            old.close()
            self._indexes.pop(j, None)
            self._advised.discard(j)
        return copy, reader

    def _open_copy(self, i: int, kind: str, path: str) -> ShardReader:
        entry = self.manifest.shards[i]
        if self._fs is None:
            _ = self.on_lustre  # sets read_block from the stripe size on Lustre
        self.counters.add("stats")
        try:
            st = os.stat(path)
        except FileNotFoundError as exc:
            raise ShardNotFoundError(
                f"shard {path} listed in the manifest is missing; restore it from a copy or "
                "repack the dataset"
            ) from exc
        except OSError as exc:
            raise translate_oserror(exc, path, "opening shard") from exc
        size, ident = st.st_size, file_ident(st)
        if size < entry.bytes:
            raise ShardTruncatedError(
                f"shard {path} has {size} bytes, the manifest records {entry.bytes}; it was "
                "truncated: restore it from a good copy"
            )
        cached = self._indexes.get(i)
        if cached is not None and cached[:2] == (path, ident):
            index = cached[2]
        else:
            # First open, another copy, or the file changed since its index was loaded: load
            # this file's own index (a cached one may describe another file: never read through
            # it), and check it and the manifest on disk.
            self.counters.add("opens")
            index = self._load_index(path)
            self._check_manifest()
            if (entry.index_digest and index.digest != entry.index_digest
                    and not rebuilt_index_matches(index, entry)):
                # Self-consistent, but not the index the dataset was packed with: a replica or
                # copy of another version of the shard (its fields would pass their checksums).
                # (Save one read from a verified copy of the shard after a parity rebuild: see
                # repair._ensure_index.)  Or the dataset was packed again in place.
                self._check_manifest(gone_is_change=True)
                raise IndexCorruptError(
                    f"the index of {path} does not match the manifest (index_digest "
                    f"{entry.index_digest}, found {index.digest or 'none'}): this copy is damaged "
                    "or belongs to another version of the dataset; restore it from a good copy "
                    "(`shardio verify` lists the damaged shards)"
                )
            if len(index) != entry.samples:
                self._check_manifest(gone_is_change=True)
                raise ManifestCorruptError(
                    f"shard {path} indexes {len(index)} samples, the manifest says "
                    f"{entry.samples}; the manifest and shard disagree: run `shardio verify`"
                )
            self._indexes[i] = (path, ident, index)
        self.counters.add("opens")
        return ShardReader(path, index, self.codec, self.verify, entry.bytes,
                           read_block=self.read_block, on_read=self.counters.adder(f"bytes_{kind}"),
                           advice=os.POSIX_FADV_SEQUENTIAL if kind != "cache" else None,
                           ident=ident, load_index=self._load_index)

    def _manifest_now(self) -> FileIdent | None:
        try:
            return file_ident(os.stat(os.path.join(self.root, MANIFEST_NAME)))
        except OSError:
            return None

    def _check_manifest(self, gone_is_change: bool = False) -> None:
        """Called as a shard's index is loaded: one ``stat`` while the manifest is the file this
        reader loaded; when it was replaced, its shard list is compared.  With
        ``gone_is_change`` (a shard's index disagrees with the manifest) a manifest that is
        gone, or cannot be loaded now, counts as changed too: a pack in progress in place.

        Raises:
            DatasetChangedError: the manifest on disk now lists other shards (the dataset was
                packed again in place since this reader was made).
        """
        now = self._manifest_now()
        if now == self._manifest_ident or (now is None and not gone_is_change):
            return  # (otherwise a manifest gone is the shard reads' business)
        try:
            shards = Manifest.load(self.root).shards if now is not None else None
        except (OSError, ManifestError):
            shards = None
        if shards is None and not gone_is_change:
            return  # (mid-write, damaged: the shard reads meet what is wrong)
        if shards != self.manifest.shards:
            raise DatasetChangedError(
                f"the dataset {self.root} was packed again in place since this reader was made: "
                "its manifest is gone or lists other shards now; make a new reader/dataset "
                "(open_dataset, ShardDataset, ShardLoader) after repacking"
            )
        self._manifest_ident = now  # rewritten, same shards (a repair): no need to look again

    def prefer_cache(self) -> int:
        """Move shards read from elsewhere onto node-cache copies published since they were
        opened (called at the start of an epoch); returns how many moved."""
        cache = self.ladder.cache
        if cache is None:
            return 0
        moved = [i for i, (copy, _r) in self._readers.items()
                 if copy.kind != "cache" and cache.lookup(i, wait=0) is not None]
        for i in moved:
            self._drop(i)
        return len(moved) + self._leave_removed()

    def _leave_removed(self) -> int:
        """Close the readers of node-cache copies that were taken out of the cache since they
        were opened (the stager evicted one, or re-hashed it, found it bad and copied the shard
        again): a descriptor kept open since an earlier step would read on from the unlinked
        file.  Their next read opens down the ladder again.  Called before each batch: one
        load of the node's removal count, and a stat per copy held open only when it moved.
        Returns how many were closed."""
        cache = self.ladder.cache
        if cache is None:
            return 0
        seen = cache.removals()
        if seen == self._removals_seen:
            return 0
        self._removals_seen = seen
        stale = [i for i, (copy, r) in self._readers.items()
                 if copy.kind == "cache" and not _same_file(r, cache.path(i))]
        for i in stale:
            self._drop(i)
        return len(stale)

    def _drop(self, i: int) -> Copy | None:
        got = self._readers.pop(i, None)
        if got is None:
            return None
        self._reopened += 1
        got[1].close()
        return got[0]

    def _fault(self, i: int, exc: BaseException, sample: int) -> None:
        """The copy of shard ``i`` in use failed reading ``sample``: move down the ladder (or
        give up)."""
        copy = self._drop(i)
        if copy is not None:
            self.ladder.failed(i, copy, exc, sample)

    @property
    def on_lustre(self) -> bool:
        """Whether the dataset directory is on Lustre (probed once per process)."""
        if self._fs is None:
            self._fs = detect_fs(self.root).kind
            if self._fs == "lustre":
                # Coalesced reads: whole multiples of the stripe size, at least 4 MiB.  The
                # layout comes from the first shard that answers: a missing or damaged shard is
                # the ladder's business when it is read, not a fault of the shard being opened.
                for j in range(min(self.num_shards, 8)):
                    try:
                        layout = get_layout(self.shard_path(j))
                    except (ShardIOError, LayoutError):
                        continue
                    # At least the read_block asked for and a multiple of the stripe, or for
                    # stripes over 64 MiB a divisor of it.  (Rounding read_block up to a
                    # multiple of such a divisor gave reads that crossed stripe boundaries,
                    # or went past the bound: 144 MiB for a 96 MiB stripe and 100 MiB asked.)
                    self.read_block = read_block_size(
                        layout, minimum=max(self.read_block, 4 * MiB),
                        maximum=max(MAX_READ_BLOCK, self.read_block))
                    break
        return self._fs == "lustre"

    def ost_of(self, i: int) -> int | None:
        """The storage target (Lustre OST index) holding the start of shard ``i``, or None
        (not on Lustre, or its layout cannot be read: the read itself meets that fault)."""
        if i not in self._osts:
            try:
                layout = get_layout(self.shard_path(i)) if self.on_lustre else None
            except (ShardIOError, LayoutError):
                layout = None
            self._osts[i] = layout.first_ost if layout is not None else None
        return self._osts[i]

    def willneed(self, shards: Iterable[int], limit: int = 4) -> None:
        """Start background reads (``POSIX_FADV_WILLNEED``) of up to ``limit`` upcoming shards
        not yet advised, opening them early; faults are left for the real read to handle.  On
        Lustre the shards advised together are picked from distinct OSTs where possible."""
        fresh = list(dict.fromkeys(i for i in shards if i not in self._advised))
        if self.on_lustre and len(fresh) > 1:
            fresh = spread_by_ost(fresh, self.ost_of, max(limit, 1))
        for i in fresh:
            if limit <= 0:
                return
            self._advised.add(i)
            limit -= 1
            try:
                reader = self._probe(i)
                if reader is not None:
                    reader.willneed()
            except (*FAULTS, UnrepairableError, OSError):
                pass  # the real read meets the fault again and handles it

    def locate(self, i: int) -> tuple[int, int]:
        """``(shard, position in shard)`` of global sample ``i``, taken as a list takes an
        index: any integer (numpy's too), negative ones from the end.

        Raises:
            TypeError: ``i`` is not an integer (a float, a string, a slice).
            IndexError: ``i`` is out of range (the message shows the valid range).
        """
        i = list_position(i, len(self), f"the dataset {self.root}")
        s = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return s, i - int(self.offsets[s])

    def __getitem__(self, i: int) -> dict[str, Any]:
        """Sample ``i`` (see :meth:`locate` for what ``i`` may be)."""
        s, j = self.locate(i)
        for sample in self._read_run(s, j, j + 1):
            return sample
        # (on_corrupt="skip": iteration leaves the sample out, random access has nothing to
        # return in its place)
        tried = self.ladder.gave_up.pop(s, None) or [("all copies", "skipped")]
        raise UnrepairableError(
            self.manifest.shards[s].path, tried,
            hint="on_corrupt='skip' leaves a sample out of an iteration, but random access "
                 "has nothing to return in its place: add a replica (replicas=[...]) or "
                 "repair the shard (`shardio repair`)")

    def _locate(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(shard, index in shard, cut)`` of non-empty ``ids``: ``cut[k]`` is True where
        ``ids[k + 1]`` does not continue the run of ``ids[k]`` (consecutive, one shard)."""
        shards = np.searchsorted(self.offsets, ids, side="right") - 1
        cut = (np.diff(ids) != 1) | (np.diff(shards) != 0)
        return shards, ids - self.offsets[shards], cut

    def read_bytes(self, ids: np.ndarray) -> int | None:
        """Arena bytes that :meth:`read_ids` takes for ``ids`` when it meets no fault: each run
        of consecutive ids in one shard is read whole (the tar headers between its samples
        included), in blocks of at most ``read_block``, each 64-byte aligned.  None when a shard
        it needs cannot be opened now (the read itself will meet the fault and deal with it:
        opened with :meth:`_probe`, which leaves the ladder and its counters alone, so a fault
        is counted once, by the read)."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return 0
        shards, local, cut = self._locate(ids)
        lo = np.empty(len(ids), dtype=np.int64)
        hi = np.empty(len(ids), dtype=np.int64)
        order = np.argsort(shards, kind="stable")
        bounds = np.flatnonzero(np.diff(shards[order])) + 1
        for group in np.split(order, bounds):
            s = int(shards[group[0]])
            try:
                reader = self._probe(s)
            except (*FAULTS, UnrepairableError, OSError):
                return None
            if reader is None:
                return None
            a, b = reader.index.spans()
            lo[group] = a[local[group]]
            hi[group] = b[local[group]]
        ends = np.flatnonzero(cut)
        last = np.append(ends, len(ids) - 1)
        first = np.insert(ends + 1, 0, 0)
        runs = hi[last] - lo[first]
        total = int(runs.sum())
        return total + 64 * (2 * len(runs) + total // self.read_block + 1)

    def read_ids(self, ids: np.ndarray) -> Iterator[dict[str, Any]]:
        """Samples with global ids ``ids``, in that order; runs of consecutive ids in one shard
        are read with one large ``pread``, single ids with one small one."""
        ids = np.asarray(ids, dtype=np.int64)
        if len(ids) == 0:
            return
        shards_a, local_a, cut_a = self._locate(ids)
        local, shard_list, cut = local_a.tolist(), shards_a.tolist(), cut_a.tolist()
        if self.ladder.cache is not None:
            self._leave_removed()
        n = len(local)
        k = 0
        seen, refreshes = self._reopened, 0
        many = self._read_many_args(shards_a)
        # Where runs begin (or go on): read_many stops there and the run is read whole below.
        in_run = np.flatnonzero(~cut_a).tolist()
        r = 0
        while k < n:
            while r < len(in_run) and in_run[r] < k:
                r += 1
            end = in_run[r] if r < len(in_run) else n
            if many is not None and end > k:
                # Single samples in one C call (shardio/_sampleio.c read_many) up to the next
                # run or the first sample it leaves to the general path below (which then reads
                # that one: a fault, a sample that is not plain, the arena's room used up).
                room = self.arena.room()
                if room is not None:
                    view, voff, mv = room
                    out: list[dict[str, Any]] = []
                    k, used = _read_many(many[0], many[1], local_a, k, end, mv, view, voff,
                                         self.arena.min_bytes, out)
                    del mv, view
                    self.arena.advance(used)
                    yield from out
                    del out
                    if k >= n:
                        return
            j = k
            while j < n - 1 and not cut[j]:
                j += 1
            s = shard_list[k]
            got = self._readers.get(s) if j == k else None
            sample = None
            if got is not None:
                try:
                    sample = got[1].get(local[k])
                except FAULTS as exc:
                    # Move down the ladder now, so the retry reads the next copy (not this one
                    # again, which would count the same fault twice).
                    self._fault(s, exc, local[k])
            if sample is not None:
                yield sample
            else:
                # A run, a shard not open yet, or a retry: _read_run opens down the ladder and
                # applies on_corrupt when no copy is left.
                yield from self._read_run(s, local[k], local[j] + 1)
            k = j + 1
            if self._reopened != seen and k < n:
                # A shard was opened (the batch reads can start), or one moved down its copy
                # ladder or was evicted: read_many must not read through a descriptor that now
                # means another file.  (At most 16 times a call: a batch over more shards than
                # max_open_shards would otherwise redo this after every sample.)
                seen = self._reopened
                refreshes += 1
                many = self._read_many_args(shards_a) if refreshes <= 16 else None

    def _read_many_args(self, shards: np.ndarray
                        ) -> tuple[tuple[tuple[Any, int, Any, Any], ...], np.ndarray] | None:
        """``(readers, slots)`` for :func:`shardio._sampleio.read_many` when the samples of
        ``shards`` are read into an arena and every one of those shards is open now with a C
        index; else None (the per-sample reads)."""
        arena = self.arena
        if _read_many is None or arena is None or _inject.ACTIVE or not hasattr(arena, "room"):
            return None
        uniq, slots = np.unique(shards, return_inverse=True)
        readers = []
        for s in uniq.tolist():
            got = self._readers.get(s)
            if got is None:
                return None
            r = got[1]
            r._views()
            if r._cidx is None:
                return None
            readers.append((r._cidx, r._fd(), r._check if r.verify else None, r.on_read))
        return tuple(readers), slots.astype(np.int64, copy=False)

    def _read_run(self, s: int, first: int, stop: int) -> Iterator[dict[str, Any]]:
        """Samples ``first..stop-1`` of shard ``s``, moving down the copy ladder on a fault and
        re-reading from the sample that failed; with ``on_corrupt="skip"`` a sample no copy can
        deliver is dropped and counted."""
        k = first
        while k < stop:
            try:
                _copy, reader = self._readers.get(s) or self._open(s, k)
            except (*FAULTS, UnrepairableError):
                if self.ladder.on_corrupt == "raise":
                    raise
                self.counters.add("skipped_samples")
                k += 1
                continue
            try:
                for sample in reader.iter_range(k, stop):
                    yield sample
                    k += 1
            except FAULTS as exc:
                self._fault(s, exc, k)  # the next _open moves down the ladder (and restores)
                continue

    def iter_shard(self, i: int) -> Iterator[dict[str, Any]]:
        return self._read_run(i, 0, int(self.offsets[i + 1] - self.offsets[i]))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for s in range(self.num_shards):
            yield from self.iter_shard(s)

    def close(self) -> None:
        for _, r in self._readers.values():
            r.close()
        self._readers.clear()
        self._reopened += 1
        self._indexes.clear()
        self._advised.clear()

    def __enter__(self) -> DatasetReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_readers"], state["_indexes"], state["_advised"] = OrderedDict(), OrderedDict(), set()
        state["_fs"], state["_osts"] = None, {}
        return state


def _same_file(reader: ShardReader, path: str) -> bool:
    """Whether the copy ``reader`` reads (its open descriptor, when it has one) is the file
    at ``path`` now."""
    try:
        now = os.stat(path)
    except OSError:
        return False
    fd = reader.open_fd()
    if fd is None:
        return True
    try:
        held = os.fstat(fd)
    except OSError:
        return False
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


def open_dataset(root: str | os.PathLike[str], *, verify: bool = True,
                 max_open_shards: int = 256, replicas: Sequence[str] = (),
                 quarantine: bool = False, on_corrupt: str = "raise") -> DatasetReader:
    """Open a packed dataset for random access; see :class:`DatasetReader`."""
    return DatasetReader(root, verify=verify, max_open_shards=max_open_shards,
                         replicas=replicas, quarantine=quarantine, on_corrupt=on_corrupt)
