"""Frozen, keyword-only option objects, validated on construction."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

from ._fsutil import parse_size
from .checksum import DEFAULT_SAMPLE, sample_checksum_fn
from .codec import parse_compress
from .errors import UsageError

__all__ = ["FORMATS", "ON_ERROR", "LoaderOptions", "PackOptions", "ReadOptions", "check_format",
           "check_km", "parse_parity"]

ON_ERROR = ("raise", "skip")
FORMATS = ("tar", "hdf5")


PARITY_MAX_BLOCKS = 256  # zfec's limit on K + M
# Seconds a process forked from the training process (loader worker, node stager) may take to
# reach its own code before it is taken for stuck inside fork and replaced: the "Stuck start"
# section of shardio.pool says why.
START_TIMEOUT = 30.0


def check_km(k: int, m: int) -> None:
    """Raise UsageError unless ``K >= 1``, ``M >= 1`` and ``K + M <= 256``."""
    if not (isinstance(k, int) and isinstance(m, int)) or k < 1 or m < 1 \
            or k + m > PARITY_MAX_BLOCKS:
        raise UsageError(
            f"invalid parity K+M = {k}+{m}; need K >= 1 data shards, M >= 1 parity files and "
            f"K+M <= {PARITY_MAX_BLOCKS}, e.g. --parity 8+2"
        )


def parse_parity(spec: str) -> tuple[int, int]:
    """Parse ``"K+M"`` (e.g. ``"4+2"``) into ``(K, M)``.

    Raises:
        UsageError: not of the form K+M, or K/M out of range.
    """
    match = re.fullmatch(r"\s*(\d+)\s*\+\s*(\d+)\s*", spec) if isinstance(spec, str) else None
    if match is None:
        raise UsageError(
            f"invalid parity spec {spec!r}; write it as K+M (data shards + parity files per "
            "group), e.g. --parity 8+2"
        )
    k, m = int(match.group(1)), int(match.group(2))
    check_km(k, m)
    return k, m


def check_format(name: str) -> str:
    """Return ``name`` if it is a known shard format (``shardio.formats`` implements each).

    Raises:
        UsageError: unknown format.
    """
    if name not in FORMATS:
        raise UsageError(f"unknown shard format {name!r}; choose one of: {', '.join(FORMATS)}")
    return name


def _parse_part(spec: object) -> tuple[int, int] | str:
    """``"I/N"`` or ``(I, N)`` to ``(I, N)`` with ``0 <= I < N``; ``"auto"`` stays as is."""
    if spec == "auto":
        return "auto"
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec) if isinstance(spec, str) else None
    part = (int(match.group(1)), int(match.group(2))) if match is not None else spec
    if (isinstance(part, tuple) and len(part) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in part)
            and 0 <= part[0] < part[1]):
        return part
    raise UsageError(
        f"invalid part {spec!r}; write it as I/N with 0 <= I < N (part I of N, counted from 0), "
        "e.g. --part 0/4, or --part auto to take it from Slurm/torchrun/MPI variables"
    )


# Limits Lustre puts on a layout (lustre_user.h): checked wherever a layout is asked for
# (PackOptions here, shardio.lustre.LayoutRequest), before any work.
LOV_MIN_STRIPE_SIZE = 64 << 10
LOV_MAX_STRIPE_COUNT = 2000
LOV_MAXPOOLNAME = 15


def check_layout_args(stripe_size: int, stripe_count: int, pool: str | None) -> None:
    """Refuse a layout Lustre would refuse (lustre_user.h's limits), with the option to fix."""
    if (not isinstance(stripe_size, int) or stripe_size <= 0 or stripe_size >= 1 << 32
            or stripe_size % LOV_MIN_STRIPE_SIZE):
        raise UsageError(f"stripe size {stripe_size!r} must be a positive multiple of 64 KiB "
                         "below 4 GiB; pass e.g. --stripe-size 4MiB")
    if not isinstance(stripe_count, int) or not (
            stripe_count == -1 or 1 <= stripe_count <= LOV_MAX_STRIPE_COUNT):
        raise UsageError(f"stripe count {stripe_count!r} must be 1..{LOV_MAX_STRIPE_COUNT}, or "
                         "-1 for all OSTs; pass e.g. --stripe-count 4")
    if pool is not None and not (isinstance(pool, str) and 1 <= len(pool) <= LOV_MAXPOOLNAME
                                 and pool.isascii() and pool.isprintable() and " " not in pool):
        raise UsageError(f"OST pool name {pool!r} must be 1-{LOV_MAXPOOLNAME} printable ASCII "
                         "characters without spaces; pass --stripe-pool NAME (see "
                         "`lfs pool_list FSNAME`) or leave it out")


@dataclass(frozen=True, kw_only=True)
class PackOptions:
    """How ``shardio pack`` shards a source.

    Args:
        format: ``"tar"`` (WebDataset-compatible) or ``"hdf5"``.
        shard_size: upper bound on a shard's size in bytes (``"256MB"`` accepted); counted on the
            uncompressed payload plus tar framing (HDF5: plus the file's metadata and index),
            so compressed shards come out smaller.
            ``None`` with ``samples_per_shard`` set means no byte limit.
        samples_per_shard: upper bound on samples per shard, or ``None``.
        workers: processes writing shards in parallel; the output does not depend on it.
        compress: ``None``/``"none"``, ``"zstd"`` or ``"zstd:LEVEL"``.
        zstd_dict: train a zstd dictionary on the dataset (for small samples) and store it.
        label_from_dir: add a ``cls`` field from the first directory level (ImageFolder layout).
        checksum: per-sample checksum algorithm (``xxh3_64``, ``crc32``, ``crc32c``).
        on_error: ``"raise"`` stops at the first bad input file; ``"skip"`` counts and skips it.
            Not part of the job fingerprint (:meth:`job_key`): after a ``"raise"`` run stopped on
            a bad file, the rerun with ``"skip"`` resumes it.
        overwrite: replace whatever OUT holds.
        resume: require a resumable partial run of the same job in OUT.
        fsync: fsync shards before publishing them (turn off only for throwaway output).
        prefix: shard file name prefix.
        parity: ``"K+M"`` writes erasure-coded parity over groups of K shards so that up to M
            lost or corrupt shards per group can be rebuilt (:mod:`shardio.parity`, needs zfec).
        stripe_count: Lustre stripe count of each shard (``-1``: all OSTs); on other
            filesystems layout options are reported and ignored.
        stripe_size: Lustre stripe size (``"4MiB"`` accepted; a multiple of 64 KiB).
        stripe_pool: Lustre OST pool, or ``None``.
        part: pack only part ``I`` of ``N`` of a multi-node job: ``(I, N)``, ``"I/N"``, or
            ``"auto"`` (rank and world size from Slurm, torchrun or MPI variables, read by
            :meth:`~shardio.Topology.from_env` when the pack starts).  Every part computes the
            same global shard plan and writes a contiguous, byte-balanced share of its shards
            under their global names; ``shardio merge`` then publishes the manifest.  Not part of
            the job fingerprint: the merged dataset is the same for any ``N``.
        scan_threads: threads that fetch the scan's stats (a parallel filesystem answers
            each one in ~0.1-1 ms); ``None`` (default): the scan times its first stats and uses
            16 threads when they average 50 us or more, else none (and times them again every
            4096 stats); ``1``: never.  A shard cut while the scan uses threads has its files
            read by as many threads too (each small file's open and read is a round trip
            there); otherwise a worker times its first reads and goes on in threads if they
            are slow.  Not part of the job fingerprint.
    """

    format: str = "tar"
    shard_size: int | str | None = "256MB"
    samples_per_shard: int | None = None
    workers: int = 1
    compress: str | None = None
    zstd_dict: bool = False
    label_from_dir: bool = False
    checksum: str = DEFAULT_SAMPLE
    on_error: str = "raise"
    overwrite: bool = False
    resume: bool = False
    fsync: bool = True
    prefix: str = "shard"
    parity: str | None = None
    stripe_count: int = 1
    stripe_size: int | str = 4 << 20
    stripe_pool: str | None = None
    part: tuple[int, int] | str | None = None
    scan_threads: int | None = None

    def __post_init__(self) -> None:
        check_format(self.format)
        if self.part is not None:
            object.__setattr__(self, "part", _parse_part(self.part))
        object.__setattr__(self, "stripe_size", parse_size(self.stripe_size))
        # Every value Lustre would refuse, refused here, before any work (a stripe count above
        # 2000, a stripe size of 4 GiB or more, a pool name too long were taken off Lustre,
        # and refused on Lustre only after the scan).
        check_layout_args(self.stripe_size, self.stripe_count, self.stripe_pool)
        if self.parity is not None:
            parse_parity(self.parity)
        if self.shard_size is not None:
            object.__setattr__(self, "shard_size", parse_size(self.shard_size))
        n = self.samples_per_shard
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise UsageError(f"samples_per_shard must be an integer >= 1, got {n!r}")
        if self.shard_size is None and self.samples_per_shard is None:
            raise UsageError("give --shard-size and/or --samples-per-shard")
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise UsageError(f"workers must be an integer >= 1, got {self.workers!r}")
        if self.scan_threads is not None and (not isinstance(self.scan_threads, int)
                                              or self.scan_threads < 1):
            raise UsageError(f"scan_threads must be an integer >= 1 (or None: automatic), got "
                             f"{self.scan_threads!r}")
        codec, _ = parse_compress(self.compress)
        if self.zstd_dict and codec is None:
            raise UsageError("--zstd-dict needs compression: add --compress zstd")
        sample_checksum_fn(self.checksum)
        if self.on_error not in ON_ERROR:
            raise UsageError(f"on_error must be one of {ON_ERROR}, got {self.on_error!r}")
        if self.overwrite and self.resume:
            raise UsageError("--overwrite and --resume contradict each other; pass one")
        if not self.prefix or "/" in self.prefix or self.prefix.startswith("."):
            raise UsageError(f"invalid shard prefix {self.prefix!r}")

    @property
    def shard_bytes(self) -> int | None:
        return self.shard_size  # type: ignore[return-value]

    @property
    def codec_name(self) -> str | None:
        return parse_compress(self.compress)[0]

    @property
    def codec_level(self) -> int:
        return parse_compress(self.compress)[1]

    def _compress_key(self) -> str | None:
        """``compress`` spelled one way for each setting: ``None`` (``"none"``, ``""``), ``"zstd"``
        (level 3, also ``"zstd:3"``) or ``"zstd:LEVEL"``.  (Spelled as given, ``zstd`` and
        ``zstd:3`` made two jobs: parts launched with each were refused as foreign at merge,
        and a resume with the other spelling did not take the shards already written.)"""
        name, level = parse_compress(self.compress)
        if name is None:
            return None
        return name if level == 3 else f"{name}:{level}"

    def output_key(self) -> dict[str, object]:
        """The options a multi-node part records to rebuild its command: :meth:`job_key` and
        ``on_error`` (workers, overwrite, resume, fsync and part are not recorded)."""
        return {**self.job_key(), "on_error": self.on_error}

    def job_key(self) -> dict[str, object]:
        """The options that shape the output, which the job and shard fingerprints hold.

        ``on_error`` is not one: it only decides whether a bad input raises or is left out, and
        what is left out is in the fingerprints already.  A sample the scan drops is not among
        the job's (or its shard's) entries; a file skipped while a shard is written is counted
        in that shard's index, which a resume with ``on_error="raise"`` does not keep.  So a
        shard written under either policy has the bytes the other one would write.
        """
        return {
            "format": self.format, "shard_size": self.shard_size,
            "samples_per_shard": self.samples_per_shard, "compress": self._compress_key(),
            "zstd_dict": self.zstd_dict, "label_from_dir": self.label_from_dir,
            "checksum": self.checksum, "prefix": self.prefix, "parity": self.parity,
        }


@dataclass(frozen=True, kw_only=True)
class ReadOptions:
    """How :class:`~shardio.ShardDataset` orders, splits and decodes a dataset.

    Args:
        shuffle: shuffle every epoch (deterministically from ``seed`` and the epoch).
        seed: shuffle seed; the same seed gives the same order on any number of ranks/workers.
        decode: ``False`` yields raw bytes; ``True`` uses the built-in decoders
            (:mod:`shardio.decode`).
        batch_size: the batch size of the DataLoader that consumes the dataset. Work is split
            across workers in whole batches so that resume is exact; it must match.
        remainder: ``"pad"`` (repeat samples so every rank gets ceil(N/R)) or ``"drop"``.
        shuffle_block: samples shuffled together; bounds the memory of the shuffle.
        verify: check the per-field checksum of every sample read.
        allow_pickle: let ``decode=True`` unpickle ``pickle``/``pyd`` fields and ``npy`` arrays
            of ``object`` dtype (untrusted code).
        image_mode: Pillow mode images decode to (``"RGB"``, ``"L"``, ...).
        max_open_shards: shard readers (descriptor + index) kept open per process.  A shuffle
            block spans about ``shuffle_block / samples per shard`` shards read in random order:
            keep this above that, or shards are reopened (a stat and an index load) all epoch.
        prefetch_shards: upcoming shards a reader asks the kernel to read ahead
            (``POSIX_FADV_WILLNEED``), chosen from distinct Lustre OSTs where possible; 0: off.
        read_block: size of coalesced sequential reads (raised to a multiple of the Lustre
            stripe size on Lustre).
        replicas: directories holding byte-identical copies of the dataset, tried in order when
            a shard's copy is corrupt or unreadable (:mod:`shardio.repair`).
        quarantine: allow moving a corrupt original shard aside and replacing it with a
            verified good copy (the dataset directory must be writable).
        on_corrupt: when no good copy of a sample exists: ``"raise"``
            (:class:`~shardio.errors.UnrepairableError`) or ``"skip"`` (dropped and counted).
        cache_dir: node-local cache directory for staged shards (:mod:`shardio.stage`);
            ``"auto"`` finds one from ``$SHARDIO_CACHE_DIR``, ``$SLURM_TMPDIR``, ``$TMPDIR``, ...
            ``None``: no staging.
        cache_budget: bytes of the cache this dataset may use (``None``: free space minus
            ``cache_reserve``).
        cache_reserve: free space always left on the cache filesystem.
        stage_bandwidth: cap on the stager's reads from the shared filesystem (bytes/s).
        stage_lookahead: epochs beyond the current one the stager prepares.
        order: ``"global"`` (default): one block-shuffled order over the whole dataset,
            independent of the job's size.  ``"node"``: node-affine
            (:class:`~shardio.order.NodeAffineOrder`): every epoch the shards are dealt to
            ``canonical_nodes`` groups and each node reads its own group, so node-local staging
            copies each shard to one node instead of every node reading a sample of nearly every
            shard (use it with ``cache_dir`` on many nodes).  A batch then mixes samples from
            1/C of the dataset per epoch.
        canonical_nodes: C for ``order="node"`` (default: the job's node count when first
            iterated; kept in ``state_dict`` so a resumed job of another size continues the
            same order).
        zero_copy: under torch's DataLoader, read samples into shared-memory chunks and yield
            uncompressed fields of 4 KiB or more as read-only ``uint8`` numpy arrays viewing
            them instead of ``bytes``, so a batch reaches the training process as a
            shared-memory descriptor instead of being pickled through a pipe (small tensors of
            the batch travel in the message; :mod:`shardio.sharedbytes`).  Under
            ``ShardLoader`` (whose workers write batches into shared-memory rings anyway), the
            workers read samples straight into the ring message, the transform gets the same
            kind of arrays, and the default collate's columns of byte fields reach the
            training loop as read-only ``uint8`` arrays viewing the ring instead of being
            copied (:mod:`shardio.loader`).
    """

    shuffle: bool = True
    seed: int = 0
    decode: bool = False
    batch_size: int = 1
    remainder: str = "pad"
    shuffle_block: int = 1 << 18
    verify: bool = True
    allow_pickle: bool = False
    image_mode: str = "RGB"
    max_open_shards: int = 256
    prefetch_shards: int = 4
    read_block: int | str = 8 << 20
    replicas: tuple[str, ...] = ()
    quarantine: bool = False
    on_corrupt: str = "raise"
    cache_dir: str | None = None
    cache_budget: int | str | None = None
    cache_reserve: int | str = "1GiB"
    stage_bandwidth: int | str | None = None
    stage_lookahead: int = 1
    order: str = "global"
    canonical_nodes: int | None = None
    zero_copy: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "read_block", parse_size(self.read_block))
        if self.order not in ("global", "node"):
            raise UsageError(f"order must be 'global' or 'node', got {self.order!r}")
        if self.canonical_nodes is not None and self.canonical_nodes < 1:
            raise UsageError(f"canonical_nodes must be >= 1, got {self.canonical_nodes}")
        if isinstance(self.replicas, (str, bytes)):
            raise UsageError("replicas must be a list of directories, not one string")
        object.__setattr__(self, "replicas", tuple(str(r) for r in self.replicas))
        if self.on_corrupt not in ON_ERROR:
            raise UsageError(f"on_corrupt must be one of {ON_ERROR}, got {self.on_corrupt!r}")
        if self.prefetch_shards < 0:
            raise UsageError(f"prefetch_shards must be >= 0, got {self.prefetch_shards}")
        if self.stage_lookahead < 0:
            raise UsageError(f"stage_lookahead must be >= 0, got {self.stage_lookahead}")
        if self.cache_reserve is None:
            raise UsageError("cache_reserve must be a size such as '1GiB' (0 for none), not None")
        for name in ("cache_budget", "cache_reserve", "stage_bandwidth"):
            value = getattr(self, name)
            if value is not None:
                # (0 as a number or a string, as StageOptions and `shardio stage` take it)
                object.__setattr__(self, name, 0 if value in (0, "0") else parse_size(value))
        for name in ("seed", "batch_size", "shuffle_block", "max_open_shards"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise UsageError(f"{name} must be an integer, got {value!r}")
        if not 0 <= self.seed < 1 << 63:
            raise UsageError(f"seed must be an integer in [0, 2**63), got {self.seed}")
        if self.batch_size < 1:
            raise UsageError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.image_mode not in IMAGE_MODES:
            raise UsageError(f"image_mode {self.image_mode!r} is not a Pillow image mode; use "
                             "'RGB' (default), 'L', 'RGBA', 'I;16', ... (PIL.Image.MODES)")
        if self.remainder not in ("pad", "drop"):
            raise UsageError(f"remainder must be 'pad' or 'drop', got {self.remainder!r}")
        if self.shuffle_block < 1:
            raise UsageError(f"shuffle_block must be >= 1, got {self.shuffle_block}")
        if self.max_open_shards < 1:
            raise UsageError(f"max_open_shards must be >= 1, got {self.max_open_shards}")


#: Pillow's image modes (``PIL.Image.MODES``): what ``image_mode`` may name.
IMAGE_MODES = frozenset({"1", "L", "P", "RGB", "RGBA", "RGBX", "RGBa", "CMYK", "YCbCr", "LAB",
                         "HSV", "I", "F", "LA", "La", "PA", "I;16", "I;16L", "I;16B", "I;16N"})


MIN_RING_BYTES = 128  # the smallest ring (shardio.ring takes it from here)


def _is_real(value: object) -> bool:
    """A plain number (not a bool, not a string)."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _cpu_numbers(cpus: object) -> tuple[int, ...]:
    """``LoaderOptions.cpus`` as a tuple of CPU numbers (integers >= 0, or their digits)."""
    fix = "pass a list of CPU numbers (integers >= 0, e.g. cpus=[2, 3]) or cpus='auto'"
    try:
        items = list(cpus)  # type: ignore[call-overload]
    except TypeError:
        raise UsageError(f"cpus must be a list of CPU numbers, got {cpus!r}; {fix}") from None
    out = []
    for c in items:
        if isinstance(c, str) and c.strip().isdigit():
            c = int(c)
        if isinstance(c, bool) or not isinstance(c, numbers.Integral) or c < 0:
            raise UsageError(f"cpus: {c!r} is not a CPU number; {fix}")
        out.append(int(c))
    if not out:
        raise UsageError(f"cpus must name at least one CPU; {fix}")
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class LoaderOptions:
    """Worker-pool and shared-memory settings of :class:`~shardio.ShardLoader`.

    Args:
        ring_bytes: shared memory per worker (``"128MiB"`` accepted); ``"auto"`` (default):
            room for ``prefetch_factor + 1`` batches the size of the epoch's first batch
            (as the worker that made it reports; see "Ring sizing" in :mod:`shardio.pool`),
            plus one for larger batches and the ring's wrap, 8-256 MiB.
            A batch larger than the ring travels through a pipe (one copy, one warning)
            instead of failing.
        prefetch_factor: batches each worker prepares ahead of the training loop, as
            DataLoader's argument of that name (default 2).  A worker writes batches into its
            ring until it is full, so this sets the ring's size with ``ring_bytes="auto"``:
            the batch the loop holds plus these.  An explicit ``ring_bytes`` sets the depth
            itself (``ring_bytes`` / batch bytes, minus the one held and one of slack).  Each
            batch more is a batch of resident shared memory per worker once the ring has
            wrapped (~5 MB per worker on the raw-mode benchmark set).
        shm_dir: directory for the rings (default ``/dev/shm``); any file-backed directory works
            where ``/dev/shm`` is small.
        cpus: CPUs to pin workers to, one each, round-robin (e.g. the cores of one NUMA node);
            ``"auto"``: :func:`shardio.topology.discover_cpus` (affinity mask from the cgroup
            and Slurm binding, ``SLURM_CPUS_PER_TASK``, NUMA node first), leaving the first for
            the training process when there are more CPUs than workers.
        poll_interval: seconds between liveness checks of a worker main is waiting on; bounds the
            time to notice a dead worker, and how long a worker whose ring stays full waits before
            it sends the batch main is waiting for through its overflow pipe instead.
        max_restarts: worker deaths tolerated per worker before WorkerCrashedError.
        start_timeout: seconds a freshly forked worker may take to reach its own code; one
            that has not is stuck inside ``fork`` (see "Stuck start" in :mod:`shardio.pool`)
            and is killed and started again, counted as a restart.
        max_held_fraction: when batches the user still holds (not counting the one arriving)
            occupy more than this fraction of a ring, new batches are copied out of the ring
            instead (with a warning).  (A batch still held when a later one is handed out is
            moved out of its ring whatever this is: its pages made private, one copy,
            ``stats()["detached"]``, so that it does not stop the ring.)
        log_every: log data-wait statistics every this many steps (an integer >= 0; 0: never).
        warn_window: steps over which persistent data starvation is judged (an integer >= 1;
            each iteration's first step, its start-up, is not judged).
        warn_wait_ratio: warn when waiting exceeds this multiple of computing over the window
            (a finite number > 0): once per episode of starvation, again only after it
            recovered or in a later epoch, and at most once per window.
    """

    ring_bytes: int | str = "auto"
    prefetch_factor: int = 2
    shm_dir: str | None = None
    cpus: tuple[int, ...] | str | None = None
    poll_interval: float = 0.2
    max_restarts: int = 3
    start_timeout: float = START_TIMEOUT
    max_held_fraction: float = 0.5
    log_every: int = 0
    warn_window: int = 50
    warn_wait_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.ring_bytes != "auto":
            try:
                size = parse_size(self.ring_bytes)
            except UsageError as exc:
                raise UsageError(f"ring_bytes: {exc} (or 'auto': sized for the batches)") from None
            if size < MIN_RING_BYTES:
                raise UsageError(f"ring_bytes must be at least {MIN_RING_BYTES} bytes, or 'auto' "
                                 f"(sized for the batches), got {self.ring_bytes!r}")
            object.__setattr__(self, "ring_bytes", size)
        if self.cpus == "auto":
            pass
        elif isinstance(self.cpus, str):
            raise UsageError(f"cpus must be a list of CPU numbers or 'auto', got {self.cpus!r}")
        elif self.cpus is not None:
            object.__setattr__(self, "cpus", _cpu_numbers(self.cpus))
        if (isinstance(self.prefetch_factor, bool) or not isinstance(self.prefetch_factor, int)
                or self.prefetch_factor < 1):
            raise UsageError(f"prefetch_factor must be an integer >= 1, got "
                             f"{self.prefetch_factor!r}")
        if not _is_real(self.poll_interval) or not 0 < self.poll_interval < math.inf:
            # (nan or inf: refused by the ring's waits only once the workers run)
            raise UsageError(f"poll_interval must be a finite number of seconds > 0, got "
                             f"{self.poll_interval!r}")
        if (isinstance(self.max_restarts, bool)
                or not isinstance(self.max_restarts, numbers.Integral) or self.max_restarts < 0):
            raise UsageError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not _is_real(self.start_timeout) or not self.start_timeout > 0:
            raise UsageError(f"start_timeout must be a number of seconds > 0, got "
                             f"{self.start_timeout!r}")
        if not _is_real(self.max_held_fraction) or not 0 < self.max_held_fraction <= 1:
            raise UsageError(f"max_held_fraction must be in (0, 1], got "
                             f"{self.max_held_fraction!r}")
        if (isinstance(self.log_every, bool) or not isinstance(self.log_every, numbers.Integral)
                or self.log_every < 0):
            raise UsageError(f"log_every must be an integer >= 0 (steps between log lines; 0: "
                             f"never), got {self.log_every!r}")
        if (isinstance(self.warn_window, bool)
                or not isinstance(self.warn_window, numbers.Integral) or self.warn_window < 1):
            raise UsageError(f"warn_window must be an integer >= 1 (steps), got "
                             f"{self.warn_window!r}")
        ratio = self.warn_wait_ratio
        if (isinstance(ratio, bool) or not isinstance(ratio, numbers.Real)
                or not 0 < ratio < math.inf):
            raise UsageError(f"warn_wait_ratio must be a finite number > 0 (warn when waiting "
                             f"exceeds this multiple of computing), got {ratio!r}")
        object.__setattr__(self, "log_every", int(self.log_every))
        object.__setattr__(self, "warn_window", int(self.warn_window))
        object.__setattr__(self, "warn_wait_ratio", float(ratio))
