"""Every exception shardio raises, in one tree.

Each class mixes in the builtin a caller would already catch, so ``except FileNotFoundError`` or
``except OSError`` keeps working around shardio calls.  Messages name the shard, key and offset
involved and say what to change.

::

    ShardioError
    ├── UsageError (ValueError)                 bad arguments or options; CLI exit code 2
    │   ├── OutputNotEmptyError                  OUT holds other data; pass --overwrite / --resume
    │   └── OutputInsideSourceError              OUT lies inside SRC
    ├── SourceError                              a problem with the input tree (pack, index)
    │   ├── EmptySourceError
    │   ├── UnreadableFileError (OSError)
    │   │   └── FileChangedError                 a file grew between the scan and its copy
    │   ├── BrokenSymlinkError (OSError)
    │   ├── SymlinkLoopError (OSError)
    │   ├── NonUtf8NameError (UnicodeError)
    │   ├── DuplicateKeyError
    │   ├── SampleTooLargeError
    │   └── NotATarError
    ├── ManifestError                            the manifest is missing, unreadable or inconsistent
    │   ├── ManifestNotFoundError (FileNotFoundError)
    │   ├── ManifestCorruptError
    │   ├── ManifestVersionError                 written by a newer shardio
    │   └── UnsafePathError                      a shard path escapes the dataset directory
    ├── PartInProgressError (BlockingIOError)    another run of this pack part writes to OUT now
    ├── DatasetChangedError                      the dataset was packed again in place under a
    │                                            live reader; make a new reader/dataset
    ├── ShardNotFoundError (FileNotFoundError)
    ├── ShardCorruptError                        a shard's bytes are not what the manifest says
    │   ├── ShardTruncatedError
    │   ├── IndexCorruptError
    │   └── ChecksumMismatchError                one sample field failed its checksum
    ├── DecodeError (ValueError)                 a field's bytes do not decode (malformed source)
    ├── ShardIOError (OSError)                   the OS failed a read or write (EIO, ...)
    │   └── StorageFullError                     ENOSPC / EDQUOT while writing
    ├── UnrepairableError (ShardCorruptError)    every copy of a shard (cache, original, replicas,
    │                                            parity) is bad or missing; policy "raise"
    ├── LayoutError                              a Lustre layout blob is malformed, or a layout
    │   │                                        could not be set (or was ignored)
    │   └── LayoutNotAppliedError                Lustre kept another layout than the one asked for
    ├── StagingError                             the node-local cache cannot be used as configured
    │   └── CacheNotWritableError (PermissionError) another user's or a read-only cache
    ├── ParityError                              parity files are missing, corrupt or cannot rebuild
    ├── ShmSpaceError (OSError)                  /dev/shm or the memory cgroup cannot hold the rings
    ├── SharedFieldError (OSError)               a zero_copy batch's shared memory cannot be mapped
    ├── RingError                                a shared-memory ring (shardio.ring) failed
    │   ├── RingClosedError (EOFError)           the peer closed the ring (and it is drained)
    │   ├── RingTimeoutError (TimeoutError)      send/recv did not complete within its timeout
    │   │   └── RingFullError                    recv(until_full=True): the producer waits for room
    │   ├── RingNotFoundError (FileNotFoundError) the ring's file is gone (unlinked or swept)
    │   ├── RingCorruptError                     bad header or record in the ring's memory
    │   ├── MessageTooLargeError (ValueError)    a message does not fit in the ring's capacity
    │   └── MessageInUseError (BufferError)      released while arrays still view its payload
    ├── WorkerError (RuntimeError)               a loader worker raised (traceback attached)
    │   ├── WorkerCrashedError                   a worker kept dying (over max_restarts)
    │   └── WorkerTimeoutError (TimeoutError)    no batch within ShardLoader(timeout=...)
    └── MissingDependencyError (ImportError)     an optional package is needed for this feature
"""

from __future__ import annotations

__all__ = [
    "BrokenSymlinkError",
    "CacheNotWritableError",
    "ChecksumMismatchError",
    "DatasetChangedError",
    "DecodeError",
    "DuplicateKeyError",
    "EmptySourceError",
    "IndexCorruptError",
    "LayoutError",
    "LayoutNotAppliedError",
    "ManifestCorruptError",
    "ManifestError",
    "ManifestNotFoundError",
    "ManifestVersionError",
    "MessageInUseError",
    "MessageTooLargeError",
    "MissingDependencyError",
    "NonUtf8NameError",
    "NotATarError",
    "OutputInsideSourceError",
    "OutputNotEmptyError",
    "ParityError",
    "PartInProgressError",
    "RingClosedError",
    "RingCorruptError",
    "RingError",
    "RingFullError",
    "RingNotFoundError",
    "RingTimeoutError",
    "SampleTooLargeError",
    "ShardCorruptError",
    "ShardIOError",
    "ShardNotFoundError",
    "ShardTruncatedError",
    "ShardioError",
    "SharedFieldError",
    "ShmSpaceError",
    "SourceError",
    "StagingError",
    "StorageFullError",
    "SymlinkLoopError",
    "UnreadableFileError",
    "FileChangedError",
    "UnrepairableError",
    "UnsafePathError",
    "UsageError",
    "WorkerCrashedError",
    "WorkerError",
    "WorkerTimeoutError",
]


class ShardioError(Exception):
    """Root of every error shardio raises."""


class UsageError(ShardioError, ValueError):
    """An argument or option is invalid; the message says which value to pass instead."""


class OutputNotEmptyError(UsageError):
    """The output directory holds data that is not a resumable run of the same job."""


class OutputInsideSourceError(UsageError):
    """The output directory lies inside the source tree, so the pack would read its own shards."""


class SourceError(ShardioError):
    """A problem with the input files of ``pack`` or the tars given to ``index``."""


class EmptySourceError(SourceError):
    """The source holds no sample files."""


class UnreadableFileError(SourceError, OSError):
    """A source file could not be opened or read."""


class FileChangedError(UnreadableFileError):
    """A source file grew between the scan and its copy (it is still being written)."""


class BrokenSymlinkError(SourceError, OSError):
    """A symbolic link in the source points at nothing."""


class SymlinkLoopError(SourceError, OSError):
    """Following symbolic links in the source leads back to a directory already visited."""


class NonUtf8NameError(SourceError, UnicodeError):
    """A source path is not valid UTF-8, so it cannot become a portable sample key."""


class DuplicateKeyError(SourceError):
    """Two source files map to the same sample key and field."""


class SampleTooLargeError(SourceError):
    """One sample is larger than the shard size limit."""


class NotATarError(SourceError):
    """A file given to ``shardio index`` is not a readable tar archive."""


class ManifestError(ShardioError):
    """The dataset manifest is missing, unreadable or inconsistent."""


class ManifestNotFoundError(ManifestError, FileNotFoundError):
    """No manifest where a dataset was expected."""


class ManifestCorruptError(ManifestError):
    """The manifest is not valid JSON, misses fields, or fails its own digest."""


class ManifestVersionError(ManifestError):
    """The manifest was written by a newer format version than this shardio reads."""


class UnsafePathError(ManifestError):
    """A path in the manifest is absolute or leaves the dataset directory."""


class PartInProgressError(ShardioError, BlockingIOError):
    """Another run of the same part of a multi-node pack (``--part I/N``) is writing to OUT now,
    such as a requeued job while the first one still runs: two runs of one part delete each
    other's files.  ``pid`` and ``host`` name that run when known (``0`` / ``""`` otherwise)."""

    pid = 0
    host = ""


class DatasetChangedError(ShardioError):
    """The dataset was packed again in place (``pack --overwrite`` into the same directory)
    while a reader still held the index of its old shards: reading on through that index would
    deliver wrong bytes.  Make a new reader or dataset (``shardio.open_dataset``,
    ``ShardDataset``, ``ShardLoader``) after repacking.  Not a fault of one copy of a shard, so
    the repair ladder does not act on it."""


class ShardNotFoundError(ShardioError, FileNotFoundError):
    """A shard named by the manifest does not exist."""


class ShardCorruptError(ShardioError):
    """A shard's bytes differ from what the manifest and index record."""


class ShardTruncatedError(ShardCorruptError):
    """A shard is shorter than the manifest records."""


class IndexCorruptError(ShardCorruptError):
    """A shard's index is unreadable or fails its checksum."""


def _restore(cls: type[BaseException], args: tuple[object, ...],
             state: dict[str, object]) -> BaseException:
    """Unpickle an error whose ``__init__`` takes other arguments than its message (pickle
    calls ``cls(*args)``, which such an ``__init__`` refuses: a worker's error then reached the
    main process as a RuntimeError, not as itself)."""
    exc = cls.__new__(cls, *args)
    exc.__dict__.update(state)
    return exc


def _message_only(exc: Exception, message: str, names: tuple[str, ...]) -> None:
    """Make ``exc`` (an error whose ``__init__`` takes its parts) from a finished message, its
    attributes None: torch's DataLoader re-raises a worker's error in the main process as
    ``type(exc)(text)``, and one that refuses that arrives as a plain RuntimeError, which
    ``except ShardCorruptError`` misses."""
    exc.__dict__.update(dict.fromkeys(names))
    Exception.__init__(exc, message)


class ChecksumMismatchError(ShardCorruptError):
    """A sample field failed its checksum.

    Attributes:
        shard: path of the shard.
        key: sample key.
        field: field name.
        offset: byte offset of the field's stored bytes in the shard.
        expected: checksum recorded in the index (hex).
        found: checksum of the bytes read (hex).

    Made from a message alone (torch's DataLoader re-raising a worker's error), its
    attributes are None.
    """

    def __init__(
        self, shard: str, key: str | None = None, field: str | None = None,
        offset: int | None = None, expected: str | None = None, found: str | None = None
    ) -> None:
        if key is None:  # (the message alone: see _message_only)
            _message_only(self, shard, ("shard", "key", "field", "offset", "expected", "found"))
            return
        self.shard, self.key, self.field, self.offset = shard, key, field, offset
        self.expected, self.found = expected, found
        super().__init__(
            f"{shard}: sample {key!r} field {field!r} at offset {offset}: checksum expected "
            f"{expected}, found {found}; the shard is corrupt: run `shardio verify` and restore "
            "the shard from a good copy (or repack)"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return _restore, (type(self), self.args, self.__dict__)


class DecodeError(ShardioError, ValueError):
    """A field's bytes passed their checksum but do not decode: the source file was malformed."""


class ShardIOError(ShardioError, OSError):
    """The operating system failed a read or write on a shard."""


class StorageFullError(ShardIOError):
    """The target filesystem ran out of space or quota while writing."""


class UnrepairableError(ShardCorruptError):
    """Every copy of a shard (node cache, original, replicas, parity) was bad or missing.

    Attributes:
        shard: the shard's manifest path.
        attempts: ``(source, reason)`` for each copy tried, in order.

    Made from a message alone (torch's DataLoader re-raising a worker's error), ``shard`` is
    None and ``attempts`` empty.
    """

    def __init__(self, shard: str, attempts: list[tuple[str, str]] | None = None, *,
                 hint: str | None = None) -> None:
        if attempts is None:  # (the message alone: see _message_only)
            _message_only(self, shard, ("shard",))
            self.attempts = []
            return
        self.shard, self.attempts = shard, list(attempts)
        tried = "; ".join(f"{src}: {why}" for src, why in self.attempts) or "no copy configured"
        super().__init__(
            f"shard {shard}: no good copy left ({tried}); " + (hint or (
                "add a replica (replicas=[...] or `shardio repair --replica DIR`), pack with "
                "--parity, or set on_corrupt='skip'"))
        )

    def __reduce__(self) -> tuple[object, ...]:
        return _restore, (type(self), self.args, self.__dict__)


class LayoutError(ShardioError):
    """A Lustre layout (``lustre.lov`` xattr) is malformed, or setting one failed."""


class LayoutNotAppliedError(LayoutError):
    """Lustre kept a different layout than the one requested (set after the file had objects)."""


class StagingError(ShardioError):
    """The node-local cache directory cannot be used as configured (missing, not writable, ...).

    ``full`` is True when the cause is a full filesystem (or quota): a condition of the moment,
    which a reader meets by reading without staging rather than failing."""

    full = False


class CacheNotWritableError(StagingError, PermissionError):
    """This process may not write the node-local cache directory it was given, or this
    dataset's ``shardio-<digest>`` directory in it (created by another user, such as root in a
    job prolog, or a read-only mount).  ``cache_dir="auto"`` falls back to a per-user directory
    instead of raising; a ``cache_dir`` named explicitly raises it.  ``path`` is the directory
    (or file) that may not be written."""

    path = ""


class ParityError(ShardioError):
    """Parity data is missing or corrupt, or too many shards of a group are lost to rebuild."""


class ShmSpaceError(ShardioError, OSError):
    """Shared memory for the rings would not fit in the directory's free space or the memory cgroup.

    The message says how much is needed, how much is free, and which option to lower or which
    directory to use instead.
    """


class SharedFieldError(ShardioError, OSError):
    """A batch of ``zero_copy`` fields arrived but its shared memory could not be opened through
    ``/proc/<worker>/fd`` (the worker is gone, or ptrace rules forbid it); the message says to
    pass ``zero_copy=False``."""


class RingError(ShardioError):
    """A shared-memory ring between processes failed (see ``shardio.ring``)."""


class RingClosedError(RingError, EOFError):
    """The ring was closed: no more sends, and every message sent before the close was received."""


class RingTimeoutError(RingError, TimeoutError):
    """A ring send or receive did not complete within its timeout."""


class RingFullError(RingTimeoutError):
    """``Ring.recv(until_full=True)`` stopped waiting: nothing to receive, and the producer waits
    for room that only the consumer can give back (release or detach what it holds)."""


class RingNotFoundError(RingError, FileNotFoundError):
    """The ring's backing file no longer exists (unlinked by its creator or swept as stale)."""


class RingCorruptError(RingError):
    """The ring's memory holds a bad header or record: not a shardio ring, or overwritten."""


class MessageTooLargeError(RingError, ValueError):
    """A message is larger than the ring can ever hold; the message names the capacity to use."""


class MessageInUseError(RingError, BufferError):
    """A received message was released while arrays made from its payload still exist."""


class WorkerError(ShardioError, RuntimeError):
    """A loader worker raised; the message carries the worker's traceback, ``__cause__`` the
    original exception."""


class WorkerCrashedError(WorkerError):
    """A loader worker died (signal, crash) more often than ``max_restarts`` allows."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A batch did not arrive within ``ShardLoader(timeout=...)`` seconds (a ``RuntimeError``,
    as DataLoader's timeout is); the message names the worker and the step it owed."""


class MissingDependencyError(ShardioError, ImportError):
    """An optional dependency is needed for the feature in use; the message gives the pip command."""
