"""``ShardDataset(zero_copy=True)``: fields read into shared-memory chunks (shardio.sharedbytes).

Real components only: datasets packed by ``shardio.pack``, real DataLoader worker processes,
memfd-backed torch storages.  Checked: the same bytes as the plain path, arrays for large
fields and ``bytes`` for small ones, the transfer to the main process through shared memory
(not pickled bytes), the chunk-recycling protocol (a chunk is never reused while a field of it
is alive in any process or in a pipe), checksums and self-repair unchanged, nothing left in
``/dev/shm``.
"""

from __future__ import annotations

import gc
import os
import pickle
import shutil
import time
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from shardio._atomics import buffer_offset
from torch.utils.data import DataLoader

import shardio
from shardio import sharedbytes as sb
from shardio.decode import decode_field
from shardio.errors import ChecksumMismatchError, ShardTruncatedError, UnrepairableError
from tests.conftest import pack_bin_dataset
from tools.faults import flip_bits

pytestmark = pytest.mark.timeout(120)

N = 48


def _payload(i: int) -> bytes:
    """Deterministic bytes; sizes straddle sharedbytes.MIN_BYTES."""
    size = 1000 + (i * 997) % 9000
    return bytes((i * 31 + k * 7) & 0xFF for k in range(size))


@pytest.fixture(scope="module")
def ds_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pack_bin_dataset(tmp_path_factory.mktemp("zc"), N, _payload, classes=3,
                            samples_per_shard=7)


def _reference(path: Path) -> dict[str, dict[str, bytes]]:
    return {s["__key__"]: {k: v for k, v in s.items() if k != "__key__"}
            for s in shardio.ShardDataset(path, shuffle=False)}


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else bytes(value)


class KeepArrays:
    """Transform run in the worker: report what type each field has there, keep the sample."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        sample["__worker_types__"] = {k: type(v).__name__ for k, v in sample.items()
                                      if not k.startswith("__")}
        return sample


def _collate(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return items


def test_dataloader_workers_deliver_the_same_bytes_through_shared_memory(ds_path: Path) -> None:
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, batch_size=8, seed=3, zero_copy=True,
                              transform=KeepArrays())
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=_collate)
    seen: dict[str, dict[str, Any]] = {}
    for batch in loader:
        for s in batch:
            assert s["__key__"] not in seen
            seen[s["__key__"]] = s
    assert set(seen) == set(ref)  # N = 48 = 6 batches of 8: no padding
    big = small = 0
    for key, s in seen.items():
        for name, want in ref[key].items():
            got = s[name]
            assert _as_bytes(got) == want, (key, name)
            if name == "bin" and len(want) >= sb.MIN_BYTES:
                big += 1
                assert s["__worker_types__"][name] == "ndarray"
                assert isinstance(got, np.ndarray) and got.dtype == np.uint8
                assert not got.flags.writeable
                # It crossed as a view of the worker's chunk, not as pickled bytes.
                assert sb.is_arena_field(got)
            else:
                small += 1
                assert type(got) is bytes
    assert big > 10 and small > 10


def test_batch_pickles_to_a_handle_not_the_payload() -> None:
    arena = sb.Arena(shared=True, chunk_bytes=1 << 20)
    fields = []
    for i in range(20):
        data = _payload(i + 100)
        view, off, mv = arena.take(len(data))
        mv[:] = data
        fields.append(view[off:off + len(data)])
    payload = sum(len(f) for f in fields)
    blob = bytes(ForkingPickler.dumps(fields))
    assert len(blob) < payload // 20  # one descriptor for the chunk, (offset, length) per field
    back = pickle.loads(blob)
    assert [bytes(f) for f in back] == [bytes(f) for f in fields]
    assert all(sb.is_arena_field(f) for f in back)
    # Plain pickle (to a file, say) copies, and the copy is an ordinary array.
    copied = pickle.loads(pickle.dumps(fields[0]))
    assert bytes(copied) == bytes(fields[0]) and not sb.is_arena_field(copied)
    # A slice of a field is a field too (its offset travels); a strided or reshaped view of
    # one pickles by copy.
    part = fields[3][5:50]
    again = pickle.loads(bytes(ForkingPickler.dumps(part)))
    assert bytes(again) == bytes(part) and sb.is_arena_field(again)
    for view in (fields[4][::2], fields[5][:1000].reshape(10, 100)):
        again = pickle.loads(bytes(ForkingPickler.dumps(view)))
        assert np.array_equal(again, view) and not sb.is_arena_field(again)
    # An unrelated array takes numpy's own path through the same pickler.
    other = np.arange(10, dtype=np.float32)
    assert np.array_equal(pickle.loads(bytes(ForkingPickler.dumps(other))), other)


def test_a_chunk_is_reused_only_when_nothing_holds_it() -> None:
    arena = sb.Arena(shared=True, chunk_bytes=64 << 10)

    def fill(n: int) -> list[np.ndarray]:
        out = []
        for k in range(n):
            view, off, mv = arena.take(20 << 10)
            mv[:] = bytes([k & 0xFF]) * (20 << 10)
            out.append(view[off:off + (20 << 10)])
        return out

    first = fill(3)  # one 64 KiB chunk holds three 20 KiB spans
    assert arena.allocated == 1
    blob = bytes(ForkingPickler.dumps(first))  # a message naming the chunk: "sent"
    del first
    gc.collect()
    second = fill(3)  # the first chunk is in a pipe: a second chunk
    assert arena.allocated == 2
    received = pickle.loads(blob)  # arrived, and alive in the "receiver"
    third = fill(3)  # chunk 1 viewed by `received`, chunk 2 by `second`: a third one
    assert arena.allocated == 3
    expect = [bytes([k]) * (20 << 10) for k in range(3)]
    assert [bytes(f) for f in received] == expect  # untouched by the later fills
    assert [bytes(f) for f in second] == expect
    del received, second, third
    gc.collect()
    for _ in range(4):
        fill(3)
    assert arena.allocated == 3  # chunks freed everywhere are reused, not reallocated


def test_a_short_read_into_the_arena_is_a_truncated_shard(ds_path: Path, tmp_path: Path) -> None:
    """A shard cut under a live reader: the one-pread read of a single sample into the arena
    comes back short, and that is a ShardTruncatedError (no partial sample)."""
    root = tmp_path / "ds"
    shutil.copytree(ds_path, root)
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(root, shuffle=True, zero_copy=True)
    reader = ds.reader
    n0 = int(reader.offsets[1])
    first = list(reader.read_ids(np.array([0, 2])))  # single-sample reads: the shard opens
    assert [_as_bytes(s["bin"]) for s in first] == [ref[s["__key__"]]["bin"] for s in first]
    start, _end = reader.shard_index(0).span(n0 - 1)
    os.truncate(root / shardio.Manifest.load(root).shards[0].path, start + 1)
    with pytest.raises((ShardTruncatedError, UnrepairableError)) as err:
        list(reader.read_ids(np.array([n0 - 1])))
    assert "truncated" in str(err.value)
    assert reader.counters.get("truncated") >= 1


def test_fields_of_a_run_survive_later_reads(ds_path: Path) -> None:
    """Fields kept by the caller are never overwritten by the reads after them (chunk reuse)."""
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, shuffle=True, seed=1, zero_copy=True)
    ds.reader.arena.chunk_bytes = 16 << 10  # many small chunks, so reuse happens often
    kept = list(ds) + list(ds)
    for s in kept:
        assert _as_bytes(s["bin"]) == ref[s["__key__"]]["bin"]
    assert ds.reader.arena.allocated >= 2


def test_nothing_left_in_dev_shm(ds_path: Path) -> None:
    before = set(os.listdir("/dev/shm"))
    ds = shardio.ShardDataset(ds_path, batch_size=4, zero_copy=True)
    for _ in DataLoader(ds, batch_size=4, num_workers=2, collate_fn=_collate):
        pass
    assert set(os.listdir("/dev/shm")) - before == set()


@pytest.mark.parametrize("shuffle", [False, True])
def test_checksums_and_repair_hold(ds_path: Path, tmp_path: Path, shuffle: bool) -> None:
    """Runs of samples (in order) and single samples (shuffled: shardio/_sampleio.c's
    ``get_into``, one pread into the arena) are both checked, and repaired from a replica."""
    root = tmp_path / "ds"
    shutil.copytree(ds_path, root)
    replica = tmp_path / "replica"
    shutil.copytree(ds_path, replica)
    ref = _reference(ds_path)
    shard = root / shardio.Manifest.load(root).shards[2].path
    flip_bits(str(shard), 700)  # inside the payload of the shard's first sample (>= 1000 B at 512)
    bad = shardio.ShardDataset(root, shuffle=shuffle, zero_copy=True)
    with pytest.raises((ChecksumMismatchError, UnrepairableError)):
        list(bad)
    good = shardio.ShardDataset(root, shuffle=shuffle, zero_copy=True, replicas=[str(replica)])
    got = {s["__key__"]: _as_bytes(s["bin"]) for s in good}
    assert got == {k: v["bin"] for k, v in ref.items()}
    assert good.reader.counters.get("checksum_mismatch") >= 1
    assert good.reader.counters.get("failovers") >= 1


@pytest.mark.filterwarnings("ignore:the training loop holds on to so many batches")
def test_shard_loader_delivers_bytes_columns_as_views_of_its_ring(ds_path: Path) -> None:
    """Under ShardLoader, ``zero_copy`` makes the default collate's bytes columns read-only
    ``uint8`` arrays viewing the ring message (no copy out); a batch kept across later epochs
    keeps its bytes (its place in the ring is not reused).  A user collate gets the fields as
    the reader cut them (arrays from 4 KiB up, as under DataLoader), and they arrive with their
    bytes; without ``zero_copy`` everything stays ``bytes``."""
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, batch_size=8, zero_copy=True)
    with shardio.ShardLoader(ds, batch_size=8, num_workers=2, ring_bytes="128KiB") as loader:
        kept = None
        for epoch in range(3):
            loader.set_epoch(epoch)
            seen = 0
            for batch in loader:
                assert all(type(x) is np.ndarray and x.dtype == np.uint8
                           and not x.flags.writeable for x in batch["bin"])
                for key, x in zip(batch["__key__"], batch["bin"]):
                    assert bytes(x) == ref[key]["bin"]
                if kept is None:
                    kept = [(k, x) for k, x in zip(batch["__key__"], batch["bin"])]
                seen += len(batch["__key__"])
            assert seen == N
    assert kept is not None
    for key, x in kept:  # written over by no later batch
        assert bytes(x) == ref[key]["bin"]
    plain = shardio.ShardDataset(ds_path, batch_size=8)
    with shardio.ShardLoader(plain, batch_size=8, num_workers=1) as loader:
        assert all(type(x) is bytes for b in loader for x in b["bin"])
    with shardio.ShardLoader(ds, batch_size=8, num_workers=1, collate_fn=_collate) as loader:
        got = [s for b in loader for s in b]
    assert len(got) == N
    for s in got:
        want = ref[s["__key__"]]["bin"]
        assert type(s["bin"]) is (bytes if len(want) < sb.MIN_BYTES else np.ndarray)
        assert _as_bytes(s["bin"]) == want


def test_decoders_take_arrays() -> None:
    def arr(b: bytes) -> np.ndarray:
        return np.frombuffer(b, np.uint8)

    assert decode_field("cls", arr(b"42")) == 42
    assert decode_field("txt", arr("héllo".encode())) == "héllo"
    assert decode_field("json", arr(b'{"a": [1, 2]}')) == {"a": [1, 2]}


def test_buffer_offset() -> None:
    a = np.zeros(1000, np.uint8)
    assert buffer_offset(a[10:20], a) == 10
    assert buffer_offset(a, a) == 0
    with pytest.raises(ValueError):
        buffer_offset(a, a[10:20])
    with pytest.raises(ValueError):
        buffer_offset(np.zeros(4, np.uint8), a)


def test_dataset_pickles_with_its_arena(ds_path: Path) -> None:
    """A spawned worker gets the dataset by pickle: the arena travels without its chunks."""
    ds = shardio.ShardDataset(ds_path, shuffle=False, zero_copy=True)
    first = next(iter(ds))
    clone = pickle.loads(pickle.dumps(ds))
    again = next(iter(clone))
    assert again["__key__"] == first["__key__"]
    assert bytes(again["bin"]) == bytes(first["bin"])


def _send_fields_and_exit(conn: Any) -> None:
    arena = sb.Arena(shared=True, chunk_bytes=1 << 16)
    view, off, mv = arena.take(5000)
    mv[:] = b"z" * 5000
    conn.send_bytes(bytes(ForkingPickler.dumps([view[off:off + 5000]])))
    conn.close()


def test_a_batch_whose_worker_is_gone_raises_a_typed_error() -> None:
    import multiprocessing as mp

    from shardio.errors import SharedFieldError

    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_send_fields_and_exit, args=(child,))
    proc.start()
    blob = parent.recv_bytes()
    proc.join(30)
    assert proc.exitcode == 0
    with pytest.raises(SharedFieldError, match="zero_copy=False"):
        pickle.loads(blob)


def test_spawned_and_persistent_workers(ds_path: Path) -> None:
    """Workers started by spawn get the dataset (and its arena) by pickle; persistent workers
    keep their chunks across epochs; every epoch still delivers the same bytes, once each."""
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, batch_size=8, seed=5, zero_copy=True)
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=_collate,
                        multiprocessing_context="spawn", persistent_workers=True)
    for epoch in range(2):
        ds.set_epoch(epoch)
        got = {s["__key__"]: _as_bytes(s["bin"]) for batch in loader for s in batch}
        assert got == {k: v["bin"] for k, v in ref.items()}


class FreezeCount:
    def __call__(self, sample: dict[str, Any]) -> int:
        return gc.get_freeze_count()


def test_dataloader_workers_freeze_inherited_objects(ds_path: Path) -> None:
    """A full collection in a worker would traverse (and copy-on-write) the training process's
    heap: the dataset moves what the worker inherited out of the GC's reach."""
    ds = shardio.ShardDataset(ds_path, batch_size=8, transform=FreezeCount())
    counts = [c for batch in DataLoader(ds, batch_size=8, num_workers=2) for c in batch.tolist()]
    assert len(counts) == N and min(counts) > 1000


def test_modules_workers_would_import_are_loaded_before_they_fork(ds_path: Path) -> None:
    """numpy.random (imported lazily by numpy 2) and the shard format's index module are
    loaded when the dataset is built, so forked workers do not import them again each epoch;
    and `shardio pack` does not import the benchmark modules."""
    import subprocess
    import sys

    code = ("import sys, shardio; shardio.ShardDataset(sys.argv[1]); "
            "print('numpy.random' in sys.modules, 'shardio.formats.tar' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(ds_path)], capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    assert out == ["True", "True"]
    code = ("import sys\n"
            "try:\n    from shardio import cli; cli.main(['pack', sys.argv[1], sys.argv[2]])\n"
            "finally:\n    print(sorted(m for m in sys.modules if m.endswith('bench')))")
    src = Path(ds_path).parent / "src"
    out_dir = Path(ds_path).parent / "pack-probe"
    proc = subprocess.run([sys.executable, "-c", code, str(src), str(out_dir)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
    shutil.rmtree(out_dir, ignore_errors=True)


class TensorBatch:
    """collate_fn run in the worker: small tensors of several kinds beside a large one."""

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        labels = torch.tensor([int(s["cls"]) for s in items], dtype=torch.int64)
        base = torch.arange(64, dtype=torch.float32)
        return {
            "keys": [s["__key__"] for s in items],
            "labels": labels,
            "strided": base[3:40:3],  # a view: offset and stride into a shared storage
            "alias": base[:8],  # the same storage again
            "half": torch.linspace(0, 1, 17, dtype=torch.bfloat16),
            "empty": torch.empty(0, 5),
            "grad": torch.ones(3, requires_grad=True),
            "large": torch.zeros(1 << 15, dtype=torch.float64),  # 256 KiB: torch's path
            "shared": torch.ones(4).share_memory_(),  # already shared: torch's path
            "parameter": torch.nn.Parameter(torch.ones(2)),
            "in_worker_reducer": ForkingPickler._extra_reducers[torch.Tensor].__name__,
        }


def test_small_tensors_of_a_worker_batch_travel_by_value(ds_path: Path) -> None:
    import torch

    torch_reducer = ForkingPickler._extra_reducers[torch.Tensor]
    ds = shardio.ShardDataset(ds_path, shuffle=False, zero_copy=True, batch_size=8)
    batches = list(DataLoader(ds, batch_size=8, num_workers=2, collate_fn=TensorBatch()))
    assert len(batches) == N // 8
    ref = _reference(ds_path)
    base = torch.arange(64, dtype=torch.float32)
    for b in batches:
        # The worker sent its batch with shardio's reducer; this process kept torch's.
        assert b["in_worker_reducer"] == "_reduce_tensor"
        assert torch.equal(b["labels"], torch.tensor([int(ref[k]["cls"]) for k in b["keys"]]))
        assert torch.equal(b["strided"], base[3:40:3])
        assert b["strided"].stride() == (3,) and b["strided"].storage_offset() == 3
        # Each small tensor carries its own copy of the storage (documented): equal values,
        # but no longer the same storage as "strided".
        assert torch.equal(b["alias"], base[:8])
        assert b["half"].dtype == torch.bfloat16
        assert torch.equal(b["half"], torch.linspace(0, 1, 17, dtype=torch.bfloat16))
        assert b["empty"].shape == (0, 5)
        assert b["grad"].requires_grad and b["grad"].is_leaf
        for small in ("labels", "strided", "half", "grad"):
            assert not b[small].is_shared(), small  # copied into the message
        for big in ("large", "shared", "parameter"):
            assert b[big].is_shared(), big  # torch's shared-memory path
        assert isinstance(b["parameter"], torch.nn.Parameter)
        assert torch.equal(b["large"], torch.zeros(1 << 15, dtype=torch.float64))
        assert b["large"].untyped_storage().nbytes() > sb.SMALL_TENSOR_BYTES
    assert ForkingPickler._extra_reducers[torch.Tensor] is torch_reducer
    assert sb._TORCH_REDUCE == []  # nothing registered in the training process


def _fill(arena: sb.Arena, byte: int, n: int = 3) -> list[np.ndarray]:
    """``n`` fields of 20 KiB of ``byte`` (three fill one 64 KiB chunk)."""
    out = []
    for _ in range(n):
        view, off, mv = arena.take(20 << 10)
        mv[:] = bytes([byte]) * (20 << 10)
        out.append(view[off:off + (20 << 10)])
    return out


def _live(chunk: Any) -> int:
    return int(sb.load_u64(chunk.array, sb._LIVE))


def test_a_chunk_is_held_from_the_moment_its_message_is_unpickled() -> None:
    """At no step of unpickling a message (before, between and after the lease and its
    fields are built) does the owner see the chunk free; a lease unpickled without any
    field holds it too; once everything is dropped, the counters balance and it is reused."""
    import sys

    arena = sb.Arena(shared=True, chunk_bytes=64 << 10)
    first = _fill(arena, 1)
    chunk = arena._chunk
    blob = bytes(ForkingPickler.dumps(first))
    del first
    gc.collect()
    assert not chunk.reusable()  # in a pipe
    free_at: list[tuple[str, str]] = []

    def probe(frame: Any, event: str, arg: Any) -> None:
        # A worker on another CPU may look at any instant: look at every call and return.
        if chunk.reusable():
            free_at.append((event, getattr(arg, "__name__", frame.f_code.co_name)))

    sys.setprofile(probe)
    try:
        received = pickle.loads(blob)
    finally:
        sys.setprofile(None)
    assert free_at == []
    assert _live(chunk) == 1
    later = _fill(arena, 2) + _fill(arena, 3)  # the owner reads on: other chunks
    assert arena.allocated == 3
    assert all(bytes(f) == b"\x01" * (20 << 10) for f in received)
    del received, later
    gc.collect()
    assert chunk.reusable() and _live(chunk) == 0
    # A message naming the chunk but no field of it (only the lease): held while it lives.
    fields = _fill(arena, 4)
    chunk = arena._chunk
    lease = sb._LEASE_OF[id(fields[0].base)]
    blob = bytes(ForkingPickler.dumps(lease))
    del fields, lease
    gc.collect()
    bare = pickle.loads(blob)
    assert not chunk.reusable() and _live(chunk) == 1
    del bare
    assert chunk.reusable() and _live(chunk) == 0
    for k in range(4):
        _fill(arena, k)
    assert arena.allocated == 3  # nothing leaked a count: every chunk came back


def _pass_on_between_reads(arena: sb.Arena, at: int) -> None:
    import sys

    first = _fill(arena, at)
    chunk = arena._chunk
    holder = [pickle.loads(bytes(ForkingPickler.dumps(first)))]
    del first
    gc.collect()
    onward: list[bytes] = []
    reads = [0]

    def probe(frame: Any, event: str, arg: Any) -> None:
        if event == "c_return" and arg is sb.load_u64:
            reads[0] += 1
            if reads[0] == at:  # the receiver passes its fields on, then drops them
                onward.append(bytes(ForkingPickler.dumps(holder[0])))
                holder.clear()

    sys.setprofile(probe)
    try:
        free = chunk.reusable()
    finally:
        sys.setprofile(None)
    assert onward and not holder and not free, at
    again = pickle.loads(onward[0])
    assert all(bytes(f) == bytes([at]) * (20 << 10) for f in again)
    del again
    gc.collect()
    assert chunk.reusable() and _live(chunk) == 0


def test_a_message_passed_on_by_a_receiver_keeps_the_chunk_held() -> None:
    """A receiver may pickle its fields again (to another process) and drop its own: at
    whatever instant between the owner's reads of the counters that happens, the owner does
    not see the chunk free while the new message is in a pipe."""
    arena = sb.Arena(shared=True, chunk_bytes=64 << 10)
    for at in (1, 2):  # after the owner's first or second counter read (of three at most)
        _pass_on_between_reads(arena, at)


def _drop_inherited(held: list[Any]) -> None:
    held.clear()
    gc.collect()


def test_a_forked_child_dropping_inherited_fields_does_not_free_the_chunk() -> None:
    """A child forked while this process holds received fields (the user's fork, a worker of
    another loader) and that drops them gives back no ``live`` count it did not take."""
    import multiprocessing as mp

    arena = sb.Arena(shared=True, chunk_bytes=64 << 10)
    first = _fill(arena, 1)
    chunk = arena._chunk
    held = [pickle.loads(bytes(ForkingPickler.dumps(first)))]
    del first
    gc.collect()
    assert _live(chunk) == 1 and not chunk.reusable()
    proc = mp.get_context("fork").Process(target=_drop_inherited, args=(held,))
    proc.start()
    proc.join(60)
    if proc.is_alive():
        proc.kill()
        pytest.fail("the forked child did not exit within 60 s")
    assert proc.exitcode == 0
    assert _live(chunk) == 1 and not chunk.reusable()
    later = _fill(arena, 2) + _fill(arena, 3)
    assert all(bytes(f) == b"\x01" * (20 << 10) for f in held[0])
    del later
    held.clear()
    gc.collect()
    assert _live(chunk) == 0 and chunk.reusable()


class OddTensors:
    """collate_fn run in the worker: tensor kinds the by-value copy must leave to torch."""

    def __call__(self, items: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        return {
            "labels": torch.tensor([int(s["cls"]) for s in items]),
            # A plain strided CPU Tensor by type and layout, but without sizes or strides.
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.arange(3.0)]),
            "jagged": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)],
                                                 layout=torch.jagged),
            "coo": torch.eye(3).to_sparse(),
            "csr": torch.eye(3).to_sparse_csr(),
            "quantized": torch.quantize_per_tensor(torch.ones(3), 0.5, 0, torch.quint8),
            "meta": torch.empty(2, 3, device="meta"),
        }


def _check_odd_tensors(b: dict[str, Any]) -> None:
    import torch

    assert b["labels"].shape == (8,)
    assert b["nested"].is_nested
    assert [t.tolist() for t in b["nested"].unbind()] == [[1.0, 1.0], [0.0, 1.0, 2.0]]
    assert b["jagged"].is_nested and b["jagged"].layout is torch.jagged
    assert torch.equal(b["coo"].to_dense(), torch.eye(3)) and b["coo"].is_sparse
    assert torch.equal(b["csr"].to_dense(), torch.eye(3)) and b["csr"].layout is torch.sparse_csr
    # (torch's own path loses the quantizer: only its kind is checked)
    assert b["quantized"].is_quantized and b["quantized"].dtype == torch.quint8
    assert b["meta"].is_meta and b["meta"].shape == (2, 3)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tensor_kinds_the_by_value_copy_cannot_take_go_torchs_way(ds_path: Path) -> None:
    """A nested tensor (once lost in the worker's queue feeder thread: the loop waited
    forever), sparse, quantized and meta tensors of a zero_copy worker's batch
    arrive as torch sends them.  ``timeout`` bounds the wait for a batch never sent."""
    ds = shardio.ShardDataset(ds_path, shuffle=False, zero_copy=True, batch_size=8)
    loader = DataLoader(ds, batch_size=8, num_workers=1, collate_fn=OddTensors(), timeout=60)
    batches = list(loader)
    assert len(batches) == N // 8
    for b in batches:
        _check_odd_tensors(b)
        assert not b["labels"].is_shared()  # small and plain: still by value


def _copy_fails(t: Any) -> Any:
    raise RuntimeError("a tensor kind the by-value copy does not know")


def test_a_tensor_the_by_value_copy_fails_on_goes_torchs_way(
        ds_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the copy raises, the batch is sent (by torch's reducer), not lost."""
    monkeypatch.setattr(sb, "_tensor_by_value", _copy_fails)  # the forked worker inherits it
    ds = shardio.ShardDataset(ds_path, shuffle=False, zero_copy=True, batch_size=8)
    loader = DataLoader(ds, batch_size=8, num_workers=1, collate_fn=TensorBatch(), timeout=60,
                        multiprocessing_context="fork")
    batches = list(loader)
    assert len(batches) == N // 8
    for b in batches:
        assert b["in_worker_reducer"] == "_reduce_tensor"
        assert b["labels"].shape == (8,) and b["labels"].is_shared()  # torch's path


# --- ShardLoader: zero_copy batches read straight into the worker's ring ------------------------


class RingProbe:
    """Worker transform: the field as given, and whether it lies in the batch's ring message
    (an array field that is not from the worker's private arena)."""

    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        x = sample["bin"]
        in_ring = type(x) is np.ndarray and not sb.is_arena_field(x)
        return {"key": sample["__key__"], "bin": x, "big": type(x) is np.ndarray,
                "in_ring": in_ring}


def test_shard_loader_reads_zero_copy_batches_into_its_ring(ds_path: Path) -> None:
    """With zero_copy the worker reads a batch's samples straight into its ring message and the
    batch points at them: after each worker's first batch (made before its ring exists), every
    field of 4 KiB or more is read into the ring, and every field arrives with its bytes, over
    shuffled epochs that go round the rings many times."""
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, batch_size=8, zero_copy=True, transform=RingProbe())
    with shardio.ShardLoader(ds, batch_size=8, num_workers=2) as loader:
        for epoch in range(4):
            loader.set_epoch(epoch)
            seen, in_ring, big = 0, 0, 0
            for step, batch in enumerate(loader):
                for key, x in zip(batch["key"], batch["bin"]):
                    assert _as_bytes(x) == ref[key]["bin"]
                    assert type(x) is np.ndarray and not x.flags.writeable
                    seen += 1
                big += int(batch["big"].sum())
                in_ring += int(batch["in_ring"].sum())
                if epoch or step >= 2:
                    assert bool((batch["in_ring"] == batch["big"]).all()), (epoch, step)
            assert seen == N and big > N // 3
            assert in_ring == big or epoch == 0


_KEPT: list[tuple[str, Any]] = []


class KeepFirstField:
    """Worker transform that keeps a view of the first field it is given that was read into the
    ring (a cache of samples, say) and sends its bytes along with every later sample."""

    def __call__(self, sample: dict[str, Any]) -> tuple[str, Any, str, bytes, bool]:
        x = sample["bin"]
        in_ring = type(x) is np.ndarray and not sb.is_arena_field(x)
        if not _KEPT and in_ring:
            _KEPT.append((sample["__key__"], x))
        kept_key, kept = _KEPT[0] if _KEPT else ("", b"")
        return sample["__key__"], x, kept_key, bytes(kept), in_ring


def test_a_field_kept_by_the_transform_keeps_its_bytes(ds_path: Path) -> None:
    """A transform that keeps a view of a field read into the ring: the worker finds the view
    alive before it sends the batch and makes those pages private to itself, so the kept field
    still holds its bytes after the ring has gone round many times (without that, later
    batches would be written over it), and every batch still arrives intact."""
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, batch_size=4, zero_copy=True, transform=KeepFirstField())
    with shardio.ShardLoader(ds, batch_size=4, num_workers=1, ring_bytes="96KiB") as loader:
        kept_seen = in_ring = 0
        for epoch in range(6):  # 72 batches of ~20 KB through a 96 KiB ring
            loader.set_epoch(epoch)
            for keys, fields, kept_keys, kept, ring in loader:
                in_ring += int(ring.sum())
                for key, x in zip(keys, fields):
                    assert _as_bytes(x) == ref[key]["bin"]
                for kept_key, data in zip(kept_keys, kept):
                    if kept_key:
                        assert _as_bytes(data) == ref[kept_key]["bin"], (epoch, kept_key)
                        kept_seen += 1
        assert kept_seen > 200
        # Read into the ring until the kept view was found, then into the worker's memory.
        assert 0 < in_ring < 40


class SometimesBig:
    """Worker transform: the field, plus an extra array that is large for a few samples (their
    batches need far more room after the samples than the worker reserved), and for some keys
    a copy of the field rather than the field (their batches carry no field in place)."""

    def __call__(self, sample: dict[str, Any]) -> tuple[str, Any, Any]:
        key, x = sample["__key__"], sample["bin"]
        n = int(key[-3:])
        extra = np.full(150_000 if n % 13 == 5 else 3, n, dtype=np.uint8)
        if n % 8 >= 6 and type(x) is np.ndarray:
            x = np.array(x)  # a private copy: not a field any more
        return key, x, extra


def test_batches_that_outgrow_the_room_reserved_for_them_arrive_intact(ds_path: Path) -> None:
    """A batch whose other arrays do not fit beside its samples in the room the worker
    reserved is made again outside the ring; one whose collate copied its fields is written
    over the samples it read; both arrive with the right bytes, as do the batches around them."""
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, batch_size=4, zero_copy=True, transform=SometimesBig())
    with shardio.ShardLoader(ds, batch_size=4, num_workers=2) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            seen = 0
            for keys, fields, extras in loader:
                for key, x, extra in zip(keys, fields, extras):
                    n = int(key[-3:])
                    assert _as_bytes(x) == ref[key]["bin"]
                    assert len(extra) == (150_000 if n % 13 == 5 else 3)
                    assert bool((np.asarray(extra) == n).all())
                    seen += 1
            assert seen == N


@pytest.mark.parametrize("replica", [False, True])
def test_shard_loader_reads_into_its_ring_and_repairs_or_skips(
        ds_path: Path, tmp_path: Path, replica: bool) -> None:
    """A corrupt sample met while reading a batch into the ring is repaired from a replica
    (its good bytes delivered) or, with ``on_corrupt="skip"`` and no good copy, replaced by a
    repeat of another sample, itself intact in every later batch (the repeat outlives the
    batch it was read in, so it is kept out of the ring); the corrupt bytes never arrive."""
    root = tmp_path / "ds"
    shutil.copytree(ds_path, root)
    ref = _reference(ds_path)
    man = shardio.Manifest.load(root)
    shard = root / man.shards[2].path
    flip_bits(str(shard), 700)  # the payload of the shard's first sample
    bad_key = shardio.open_dataset(ds_path).shard(2).index.key(0)
    extra: dict[str, Any] = {"replicas": [str(ds_path)]} if replica else {"on_corrupt": "skip"}
    ds = shardio.ShardDataset(root, batch_size=4, zero_copy=True, transform=RingProbe(),
                              **extra)
    with shardio.ShardLoader(ds, batch_size=4, num_workers=2, ring_bytes="256KiB") as loader:
        in_ring = 0
        for epoch in range(4):
            loader.set_epoch(epoch)
            keys = []
            for batch in loader:
                for key, x in zip(batch["key"], batch["bin"]):
                    assert _as_bytes(x) == ref[key]["bin"], (epoch, key)
                    keys.append(key)
                in_ring += int(batch["in_ring"].sum())
            assert len(keys) == N
            assert (bad_key in keys) == replica
        assert in_ring > 8  # (a claim fails, and the batch is read aside, when the ring is full)
        counters = loader.stats()["repair"]
    assert counters.get("checksum_mismatch", 0) >= 1
    assert counters.get("skipped_samples", 0) >= (0 if replica else 4)


class Shrink:
    """Worker transform that replaces the field by something small (as a decode does)."""

    def __call__(self, sample: dict[str, Any]) -> Any:
        return np.full(4, len(sample["bin"]), dtype=np.int64)


def test_ring_of_a_transform_that_replaces_its_fields_is_sized_for_its_batches(
        tmp_path: Path) -> None:
    """A transform that does not pass the fields through (a decode) gets no reservation for its
    samples, so its ring is sized for its (small) batches, not for the bytes it reads: 16
    samples of 600 KB a batch would need a 38 MiB ring, and the batches of 4 numbers get the
    smallest auto ring."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(32):
        (src / f"s{i:03d}.bin").write_bytes(os.urandom(600_000))
    shardio.pack(src, tmp_path / "ds", fsync=False, progress=False)
    ds = shardio.ShardDataset(tmp_path / "ds", batch_size=16, zero_copy=True, transform=Shrink())
    with shardio.ShardLoader(ds, batch_size=16, num_workers=1) as loader:
        got = [int(x) for b in loader for x in b[:, 0]]
        assert loader._pool is not None
        ring = loader._pool._workers[0].ring
        assert ring is not None and ring.capacity <= (8 << 20) + 4096
    assert got == [600_000] * 32


def test_arena_rewind_reuses_the_chunk_once_nothing_cut_from_it_is_alive() -> None:
    """rewind() starts the next take at the beginning of the current chunk when every field cut
    from it is gone (a ShardLoader worker's private reads then reuse one chunk's pages from
    batch to batch), and does nothing while one is alive."""
    arena = sb.Arena(shared=False, chunk_bytes=1 << 16)
    view, first, mv = arena.take(5000)
    mv[:] = b"a" * 5000
    field = view[first : first + 5000]
    del view, mv
    arena.take(5000)
    arena.rewind()  # the field is alive: no rewind
    view, off, mv = arena.take(100)
    assert off > first + 5000 and bytes(field) == b"a" * 5000
    del view, mv, field
    arena.rewind()
    view, off, mv = arena.take(100)
    assert off == first and arena.allocated == 1


class SlowProbe(RingProbe):
    def __call__(self, sample: dict[str, Any]) -> dict[str, Any]:
        time.sleep(0.003)
        return super().__call__(sample)


def test_a_worker_killed_while_reading_into_its_ring_is_replaced(ds_path: Path) -> None:
    """SIGKILL of a worker that reads its batches into its ring: the worker forked in its place
    inherits the ring (and the descriptor that Ring.keep_written would map it through), redoes
    the batches that were never sent, and reads into the ring again; every sample arrives
    exactly once with its bytes, in this epoch and the next."""
    import signal

    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, batch_size=4, seed=5, zero_copy=True,
                              transform=SlowProbe())
    with shardio.ShardLoader(ds, batch_size=4, num_workers=2, poll_interval=0.05) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            keys: list[str] = []
            in_ring = 0
            for step, batch in enumerate(loader):
                for key, x in zip(batch["key"], batch["bin"]):
                    assert _as_bytes(x) == ref[key]["bin"]
                    keys.append(key)
                in_ring += int(batch["in_ring"].sum())
                if epoch == 0 and step == 2:
                    assert loader._pool is not None
                    os.kill(loader._pool.pids()[0], signal.SIGKILL)
            assert sorted(keys) == sorted(ref), epoch
            assert in_ring > 0
        assert loader.stats()["restarts"] == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_zero_copy_collate_keeps_ring_fields_as_lists_under_shard_loader(
        ds_path: Path, workers: int) -> None:
    """Under ShardLoader the worker reads the samples into its ring, so the fields that
    ``zero_copy_collate`` gets are views of the ring (not of an arena): of different sizes, they
    stay a list per field as under DataLoader, rather than failing to stack."""
    ref = _reference(ds_path)
    ds = shardio.ShardDataset(ds_path, batch_size=8, zero_copy=True)
    with shardio.ShardLoader(ds, batch_size=8, num_workers=workers,
                             collate_fn=shardio.zero_copy_collate) as loader:
        for epoch in range(2):
            loader.set_epoch(epoch)
            seen = 0
            for batch in loader:
                assert isinstance(batch["bin"], list)
                for key, x in zip(batch["__key__"], batch["bin"]):
                    assert _as_bytes(x) == ref[key]["bin"]
                    assert type(x) is (bytes if len(ref[key]["bin"]) < sb.MIN_BYTES
                                       else np.ndarray)
                seen += len(batch["__key__"])
            assert seen == N
