"""Zero-copy sample fields for torch's DataLoader: ``ShardDataset(zero_copy=True)``.

Under ``torch.utils.data.DataLoader`` a worker hands every batch to the training process by
pickling it into a pipe: a list of 256 JPEGs of 20 KB is copied four or five times (pickle
buffer, pipe write, pipe read, unpickle) and costs the two processes ~40 µs of CPU per sample,
more than reading it from the shard.  Tensors do not take that path: torch's reductions move
their storage to shared memory and send a file descriptor.  This module lets raw fields ride
the same way.

* A reader with an :class:`Arena` reads each span of shard bytes (one sample, or a coalesced
  run of samples) straight into a *chunk* of the arena with ``preadv``: one copy, page cache to
  chunk.  Inside a DataLoader worker a chunk is a ``memfd`` (anonymous shared memory: it never
  appears in ``/dev/shm``, is not limited by a small ``/dev/shm`` mount, and vanishes with the
  last mapping, so a crash leaves nothing behind) wrapped as a torch storage.
* Uncompressed fields of at least :data:`MIN_BYTES` bytes become read-only ``uint8`` numpy
  arrays viewing the chunk (``bytes(x)``, ``io.BytesIO(x)``, ``np.frombuffer(x)``,
  ``torch.frombuffer(x, dtype=torch.uint8)``, ``hashlib`` and Pillow through ``BytesIO`` all
  take them).  Smaller fields (labels, short text) stay ``bytes``: pickling them is cheap.
* A reducer registered with ``multiprocessing``'s ``ForkingPickler`` (the pickler of
  DataLoader's queues, and only that one) sends such an array as ``(chunk, offset, length)``;
  pickle sends a chunk shared by a whole batch once, as ``(worker pid, fd, inode, size)``: the
  receiver opens ``/proc/<pid>/fd/<fd>`` and maps it (once while it holds any field of it),
  instead of torch's fd round trip through the worker's ``resource_sharer`` thread.  A batch
  crosses in a few hundred bytes of pickle.  Any other array pickles as numpy pickles it; so
  does a field pickled with plain ``pickle``.
* The fields are plain ``ndarray`` objects, which the cyclic GC does not track (instances of any
  ndarray subclass it does: 256 more tracked objects a batch bring a full collection of a torch
  process, ~0.1 s, every few epochs).  They find their chunk through their ``base``, a
  read-only view of it.
* Chunks are recycled, because the first write to a fresh shared page costs more than the
  read itself (allocate, zero, charge, map).  The first 64 bytes of a chunk hold three counters,
  updated with atomic adds (:mod:`shardio._atomics`) by whichever process pickles or unpickles
  it.  Each message naming a chunk moves them in this order: ``sent`` +1 when it is pickled (by
  a process holding a field of the chunk), ``live`` +1 when its lease is unpickled, *then*
  ``arrived`` +1, and ``live`` -1 when that lease dies (with the last field cut from it, at once
  if none was), in the process that counted it and no other: a forked child that inherits
  fields inherits no count, so a finalizer it runs gives nothing back.  Hence, at any instant,
  ``sent - arrived`` messages are in a pipe and ``live`` are held, or being unpickled, by a
  receiver.  The owning worker reuses a chunk once no field or span of it is alive there (a
  weak reference to the *lease* they hold), and then reads ``arrived``, ``live``, ``sent`` in
  that order and finds ``live == 0`` and ``arrived >= sent``: every message sent before the
  last read had arrived before the first one, so had counted ``live`` and then given it back;
  and only a holder sends, so none was sent in between.  A message pickled and never unpickled
  pins its chunk until the worker exits.  Fields a forked child inherited stay intact only
  while the parent holds them too (copy them, ``bytes(x)``, to keep them longer).

* Small tensors of a worker's batch (a storage of at most :data:`SMALL_TENSOR_BYTES`: labels,
  indices) travel inside the message too, rather than through torch's fresh shared-memory
  segment and descriptor hand-over per tensor (see :func:`_send_small_tensors_by_value`).

Memory stays bounded: a chunk lives while any field viewing it does, so at most the chunks of
the batches in flight (``prefetch_factor x num_workers`` plus those the loop holds) are alive.
Outside a worker (``num_workers=0``) chunks are private memory and fields pickle by copy.
"""

from __future__ import annotations

import os
import pickle
import weakref
from collections import deque
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np

from ._atomics import buffer_offset, fetch_add_u64, load_u64
from .errors import SharedFieldError

__all__ = ["MIN_BYTES", "Arena"]

#: Uncompressed fields at least this large come out as arrays under ``zero_copy``.
MIN_BYTES = 4096

#: Default chunk size; a span larger than this gets a chunk of its own.
CHUNK_BYTES = 8 << 20

# Counters at the start of every chunk (u64 each); data starts at HEADER.
_SENT, _ARRIVED, _LIVE, HEADER = 0, 8, 16, 64
_MINUS_ONE = (1 << 64) - 1
_U8 = np.dtype(np.uint8)

_PID = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _PID.__setitem__(0, os.getpid()))


# id(view) -> lease, for the views alive in this process (an entry leaves with its view).
_LEASE_OF: dict[int, _Lease] = {}


class _Lease:
    """One use of a chunk, and what a message pickles for the fields cut from it.

    Fields are slices of the lease's *view*: a plain read-only ``uint8`` array over the chunk
    whose base is a memoryview, so numpy makes the view (not the chunk) every field's ``base``.
    The lease holds the view only weakly: the view, and with it the lease's registration, dies
    with the last field (or span) cut from it; the owner's arena then sees the chunk free of
    local users.  Pickling counts ``sent``; the lease unpickled in another process counts
    ``live`` then ``arrived``, and gives ``live`` back when it dies (see :func:`_received`).
    """

    __slots__ = ("__weakref__", "_readonly", "_view", "handle", "header", "tensor")

    def __init__(self, tensor: Any, array: np.ndarray, handle: tuple[int, ...] | None = None
                 ) -> None:
        self.tensor = tensor  # None: private memory; fields pickle by copy
        self.handle = handle  # (pid, fd, inode, size) of the chunk's memfd, if it has one
        self.header = array[:HEADER]
        self._readonly = memoryview(array).toreadonly()
        self._view: weakref.ref[np.ndarray] | None = None

    def view(self) -> np.ndarray:
        """The read-only array fields are sliced from (a new one once every field is gone).

        The view holds the lease (through ``_LEASE_OF``), so a lease outlives its fields."""
        view = self._view() if self._view is not None else None
        if view is None:
            view = np.frombuffer(self._readonly, _U8)
            self._view = weakref.ref(view)
            key = id(view)
            _LEASE_OF[key] = self
            weakref.finalize(view, _LEASE_OF.pop, key, None)
        return view

    def __reduce__(self) -> tuple[Any, ...]:
        if self.tensor is None:
            raise TypeError("a private arena chunk is not pickled (its fields pickle by copy)")
        fetch_add_u64(self.header, _SENT, 1)
        if self.handle is not None:
            return _lease_attach, self.handle
        return _received, (self.tensor,)


def _received(tensor: Any) -> _Lease:
    """The lease of a message being unpickled here, over ``tensor`` (the chunk mapped here).

    ``live`` is counted before ``arrived``: the other order would show the owner, in between,
    a chunk with nothing in a pipe and no user, which it would fill with a later read under
    the fields about to be cut from it.  ``live`` is given back when the lease dies, which is
    after its last field (its view holds it), and only by this process: a forked child runs
    inherited finalizers too, but counted nothing.
    """
    lease = _Lease(tensor, tensor.numpy())
    fetch_add_u64(lease.header, _LIVE, 1)
    weakref.finalize(lease, _give_back, lease.header, os.getpid())
    fetch_add_u64(lease.header, _ARRIVED, 1)
    return lease


def _give_back(header: np.ndarray, pid: int) -> None:
    if os.getpid() == pid:
        fetch_add_u64(header, _LIVE, _MINUS_ONE)


# (pid, inode) -> the tensor mapping that memfd here, while any lease of it is alive.
_ATTACHED: weakref.WeakValueDictionary[tuple[int, int], Any] = weakref.WeakValueDictionary()


def _lease_attach(pid: int, fd: int, inode: int, size: int) -> _Lease:
    """Unpickle a lease by opening the sender's memfd through ``/proc/<pid>/fd/<fd>``.

    torch's own path (``multiprocessing.resource_sharer``) asks the sender for the descriptor
    over a socket: a round trip per chunk per batch that needs the worker's sharer thread (and
    its GIL) and cost the training process ~0.5 ms of CPU each.  The sender keeps the chunk,
    and so the descriptor, open until the message is counted as arrived; the inode check
    guards against a descriptor number reused by a restarted process.
    """
    tensor = _ATTACHED.get((pid, inode))
    if tensor is None:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            nfd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise SharedFieldError(
                exc.errno, f"cannot open the shared memory of a zero_copy batch ({path}: "
                f"{exc.strerror}); the worker exited, or this system forbids opening another "
                "process's descriptors: pass zero_copy=False") from exc
        try:
            if os.fstat(nfd).st_ino != inode:
                raise SharedFieldError(
                    f"{path} is no longer the zero_copy chunk it was (the worker was replaced); "
                    "pass zero_copy=False if this repeats")
            import torch

            storage = torch.UntypedStorage._new_shared_fd_cpu(nfd, size)
        finally:
            os.close(nfd)
        tensor = torch.empty(0, dtype=torch.uint8).set_(storage)
        _ATTACHED[pid, inode] = tensor
    return _received(tensor)


def _rebuild(lease: _Lease, offset: int, length: int) -> np.ndarray:
    return lease.view()[offset:offset + length]


def _reduce_ndarray(arr: np.ndarray) -> tuple[Any, ...]:
    """``ForkingPickler`` reducer of ``ndarray``: a field cut from a shared chunk travels as
    (lease, offset, length); any other array as numpy pickles it."""
    base = arr.base
    lease = _LEASE_OF.get(id(base)) if base is not None else None
    # A field, or a slice of one (numpy makes the view the base of both); a reshaped or strided
    # view of a field pickles by copy, like any other array.
    if (lease is not None and lease.tensor is not None and lease._view is not None
            and lease._view() is base and arr.ndim == 1 and arr.dtype == _U8
            and arr.flags.c_contiguous):
        return _rebuild, (lease, buffer_offset(arr, base), len(arr))
    return arr.__reduce_ex__(pickle.DEFAULT_PROTOCOL)  # type: ignore[no-any-return]


ForkingPickler.register(np.ndarray, _reduce_ndarray)


#: Tensors whose storage holds at most this many bytes travel inside the message from a worker.
SMALL_TENSOR_BYTES = 64 << 10
_TORCH_REDUCE: list[Any] = []  # torch's own Tensor reducer, once ours is registered


def _rebuild_small_tensor(data: bytes, dtype: Any, size: tuple[int, ...],
                          stride: tuple[int, ...], offset: int, requires_grad: bool) -> Any:
    import torch

    storage = (torch.frombuffer(bytearray(data), dtype=torch.uint8).untyped_storage() if data
               else torch.UntypedStorage(0))
    t = torch.empty(0, dtype=dtype).set_(storage, offset, size, stride)
    return t.requires_grad_() if requires_grad else t


def _tensor_by_value(t: Any) -> tuple[Any, ...] | None:
    """``(rebuild, args)`` carrying a copy of a small plain CPU tensor, or None: not one."""
    import torch

    # A nested tensor is a plain strided CPU Tensor too, but has no sizes or strides to copy;
    # sparse, mkldnn, meta, quantized, conj/neg-bit and shared tensors, and subclasses, go
    # torch's way as well.
    if (type(t) is not torch.Tensor or t.is_nested or t.device.type != "cpu"
            or t.layout is not torch.strided or t.is_quantized or t.is_conj() or t.is_neg()
            or (t.requires_grad and not t.is_leaf) or t.is_shared()):
        return None
    st = t.untyped_storage()
    if st.nbytes() > SMALL_TENSOR_BYTES:
        return None
    raw = torch.empty(0, dtype=torch.uint8).set_(st).numpy().tobytes()
    return _rebuild_small_tensor, (raw, t.dtype, tuple(t.size()), tuple(t.stride()),
                                   t.storage_offset(), t.requires_grad)


def _reduce_tensor(t: Any) -> tuple[Any, ...]:
    """``ForkingPickler`` reducer of ``torch.Tensor`` inside a DataLoader worker: a small CPU
    tensor of the batch (labels, indices) is sent by value; anything else as torch sends it."""
    # An error raised here would stop the worker queue's feeder thread and leave the training
    # loop waiting for the batch: whatever the copy trips on, torch's reducer sends instead.
    try:
        by_value = _tensor_by_value(t)
    except Exception:  # noqa: BLE001
        by_value = None
    if by_value is not None:
        return by_value
    return _TORCH_REDUCE[0](t)  # type: ignore[no-any-return]


def _send_small_tensors_by_value() -> None:
    """In this DataLoader worker, pickle small tensors into the message (see :class:`Arena`).

    torch's reducer moves every tensor's storage to a fresh shared-memory segment and hands its
    descriptor over a socket to the training process, which connects back to fetch it (raw
    epochs of 20,000 JPEGs with one 2 KB label tensor a batch: 0.255 s that way, 0.230 s by
    value, 0.207 s with a plain list of labels).  A storage of at most
    :data:`SMALL_TENSOR_BYTES` is copied into the message instead, with its dtype, size,
    stride, offset and ``requires_grad``.  Tensors already in shared memory, larger ones,
    subclasses (``Parameter``), non-CPU, nested, sparse and quantized tensors keep torch's
    path, and so does any tensor the copy fails on.  Only worker processes register this, and
    only their batches go through it: nothing reads a worker's copy after it is sent, so no
    caller can tell that the storage was not shared, except that two small tensors of one
    batch viewing one storage arrive as two copies of it.
    """
    if _TORCH_REDUCE:
        return
    import torch
    import torch.multiprocessing  # noqa: F401  (registers torch's reducers first)

    _TORCH_REDUCE.append(ForkingPickler._extra_reducers[torch.Tensor])
    ForkingPickler.register(torch.Tensor, _reduce_tensor)


def is_arena_field(value: Any) -> bool:
    """Whether ``value`` is a field cut from an arena chunk (shared or private)."""
    if not isinstance(value, np.ndarray) or value.base is None:
        return False
    lease = _LEASE_OF.get(id(value.base))
    return lease is not None and lease._view is not None and lease._view() is value.base


class _Chunk:
    """One block of arena memory (``HEADER`` bytes of counters, then data)."""

    __slots__ = ("array", "handle", "lease", "mv", "size", "tensor")

    def __init__(self, size: int, shared: bool) -> None:
        self.size = size + HEADER
        self.handle: tuple[int, ...] | None = None
        if shared:
            self.tensor, self.handle = _shared_tensor(self.size)
            self.array = self.tensor.numpy()
        else:
            self.tensor, self.array = None, np.zeros(self.size, np.uint8)
        self.mv = memoryview(self.array)
        self.lease: _Lease | None = None

    def lend(self) -> _Lease:
        """A fresh lease for the fields about to be cut from this chunk."""
        lease = _Lease(self.tensor, self.array, self.handle)
        self.lease = lease
        return lease

    def reusable(self) -> bool:
        """No field or span of the last lease is alive here, and none is in a pipe or held in
        another process."""
        lease = self.lease
        if lease is not None and lease._view is not None and lease._view() is not None:
            return False
        if self.tensor is None:
            return True
        a = self.array
        # This order of loads (acquire) is what makes the check sound: see the module docstring.
        arrived = load_u64(a, _ARRIVED)
        return load_u64(a, _LIVE) == 0 and arrived >= load_u64(a, _SENT)


def _shared_tensor(size: int) -> tuple[Any, tuple[int, ...] | None]:
    """A 1-D ``uint8`` tensor over ``size`` bytes of fresh shared memory, and the
    ``(pid, fd, inode, size)`` other processes open it by (None: torch's own path).

    With torch's default ``file_descriptor`` strategy: a ``memfd`` handed to torch as an
    fd-backed shared storage (~15 µs; ``UntypedStorage._new_shared`` zero-fills and costs ms per
    8 MiB).  Under the ``file_system`` strategy torch must own the segment's name, so its own
    allocator is used and pickling goes through torch's reductions.
    """
    import torch
    import torch.multiprocessing as tmp

    storage = handle = None
    if tmp.get_sharing_strategy() == "file_descriptor" and hasattr(os, "memfd_create"):
        fd = os.memfd_create("shardio-arena", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)
            own, _ = storage._share_fd_cpu_()  # the descriptor torch keeps (a dup of ours)
            handle = (os.getpid(), own, os.fstat(own).st_ino, size)
        finally:
            os.close(fd)
    if storage is None:
        storage = torch.UntypedStorage._new_shared(size)
    return torch.empty(0, dtype=torch.uint8).set_(storage), handle


class Arena:
    """Bump allocator over recycled chunks that shard readers read spans into (see the module
    docstring).

    Args:
        chunk_bytes: size of a chunk; a larger span gets a chunk of exactly its size.
        min_bytes: fields smaller than this are returned as ``bytes``.
        shared: ``True``/``False`` forces shared memory on/off; ``None`` (default) uses shared
            memory only inside a torch DataLoader worker, where a batch is pickled to the main
            process.
        keep: retired chunks kept for reuse; beyond that the oldest free ones are released.
    """

    def __init__(self, chunk_bytes: int = CHUNK_BYTES, min_bytes: int = MIN_BYTES,
                 shared: bool | None = None, keep: int = 16) -> None:
        self.chunk_bytes = int(chunk_bytes)
        self.min_bytes = int(min_bytes)
        self.shared = shared
        self.keep = keep
        self._chunk: _Chunk | None = None
        self._lease: _Lease | None = None
        self._used = 0
        self._retired: deque[_Chunk] = deque()
        self._pid = _PID[0]
        self.allocated = 0  # chunks created in this process (reuse keeps it small)

    def _is_shared(self) -> bool:
        """Whether chunks must be shared memory: inside a DataLoader worker (unless forced).

        The first time it finds itself in a worker it also switches that worker's pickler to
        sending small tensors by value: this runs before the worker's first read, so before
        its first batch is pickled, and in no process other than a zero_copy worker."""
        if self.shared is not None:
            return self.shared
        from torch.utils.data import get_worker_info

        if get_worker_info() is None:
            return False
        _send_small_tensors_by_value()
        return True

    def _next_chunk(self, n: int) -> _Chunk:
        if self._pid != _PID[0]:
            # A forked child never writes into its parent's chunks (shared pages would change
            # under fields the parent still holds).
            self._retired, self._chunk, self._pid = deque(), None, _PID[0]
        if self._chunk is not None:
            self._retired.append(self._chunk)
        shared = self._is_shared()
        found = None
        for chunk in self._retired:
            if (chunk.size - HEADER >= n and (chunk.tensor is not None) == shared
                    and chunk.reusable()):
                found = chunk
                break
        if found is not None:
            self._retired.remove(found)
            return found
        if len(self._retired) > self.keep:
            # Release free chunks beyond ``keep`` (a chunk still in use elsewhere stays).
            free = [c for c in self._retired if c.reusable()]
            for c in free[:len(self._retired) - self.keep]:
                self._retired.remove(c)
        self.allocated += 1
        return _Chunk(max(n, self.chunk_bytes), shared)

    def rewind(self) -> None:
        """Start the next :meth:`take` at the beginning of the current chunk again when nothing
        cut from it is alive any more (and the chunk is this process's): a process whose
        fields never outlive a batch then reuses one chunk's pages instead of moving on to the
        next chunk (a ``ShardLoader`` worker's private reads)."""
        chunk = self._chunk
        if (chunk is not None and self._pid == _PID[0] and self._used > HEADER
                and chunk.reusable()):
            self._used = HEADER
            self._lease = chunk.lend()

    def take(self, n: int) -> tuple[np.ndarray, int, memoryview]:
        """Room for ``n`` bytes: ``(view, offset, writable memoryview of the n bytes)``; cut
        fields with ``view[offset:offset + length]``.  The chunk is not reused while the view
        (held by the caller and by every field) is alive."""
        chunk = self._chunk
        if chunk is None or self._used + n > chunk.size or self._pid != _PID[0]:
            chunk = self._chunk = self._next_chunk(n)
            self._lease = chunk.lend()
            self._used = HEADER
        assert self._lease is not None
        off = self._used
        self._used = (off + n + 63) & ~63
        return self._lease.view(), off, chunk.mv[off:off + n]

    def room(self) -> tuple[np.ndarray, int, memoryview] | None:
        """The current chunk's free room as :meth:`take` would hand it out piecewise:
        ``(view, offset, writable memoryview of the rest of the chunk)``, or None when there is
        no chunk of this process to fill.  Fill it from the start, each piece 64-byte aligned,
        and report the bytes used with :meth:`advance` (``DatasetReader.read_ids``' batch
        reads: one call for a run of samples instead of one take each)."""
        chunk = self._chunk
        if chunk is None or self._pid != _PID[0] or self._used >= chunk.size:
            return None
        assert self._lease is not None
        off = self._used
        return self._lease.view(), off, chunk.mv[off:chunk.size]

    def advance(self, used: int) -> None:
        """``used`` bytes (a multiple of 64) of the last :meth:`room` were filled."""
        self._used += used

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_chunk=None, _lease=None, _used=0, _retired=deque())
        return state
