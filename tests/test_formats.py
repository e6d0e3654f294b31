"""Shard format conformance: one suite, run against every shard format.

``ShardFormatTests`` holds every behaviour a shard format must have (byte-exact round trip,
random access, key order, 0-byte fields, compression, labels, reproducible output, and a
hypothesis round-trip property); ``TestTarFormat`` and ``TestHdf5Format`` bind it to ``tar`` and
``hdf5``.  Everything runs on real files with the real packer and reader.

Helpers defined here (``source_samples``, ``pack_into``, ``read_all``, ``dir_bytes``,
``rewrite_manifest``) and the ``text_tree`` fixture are shared with ``test_formats_interop.py``
and ``test_formats_corruption.py``.
"""

from __future__ import annotations

import json
import os
import posixpath
import random
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import shardio
from shardio.checksum import digest_bytes
from shardio.codec import FLAG_ZSTD
from shardio.manifest import Manifest, _body_digest

Fields = dict[str, bytes]


# --- helpers ---------------------------------------------------------------------------------
def source_samples(src: Path, *, label_from_dir: bool = False) -> dict[str, Fields]:
    """What a source tree should pack into, computed independently of shardio's scanner.

    Key = path relative to ``src`` up to the first dot of the file name; field = the rest.
    """
    samples: dict[str, Fields] = {}
    for dirpath, _dirs, files in os.walk(src):
        for name in files:
            rel = Path(dirpath, name).relative_to(src).as_posix()
            d, base = posixpath.split(rel)
            stem, ext = base.split(".", 1)
            key = f"{d}/{stem}" if d else stem
            samples.setdefault(key, {})[ext] = Path(dirpath, name).read_bytes()
    if label_from_dir:
        classes = sorted({k.split("/", 1)[0] for k in samples})
        for key, fields in samples.items():
            fields["cls"] = str(classes.index(key.split("/", 1)[0])).encode()
    return samples


def split_sample(sample: dict[str, Any]) -> tuple[str, Fields]:
    return sample["__key__"], {k: v for k, v in sample.items() if k != "__key__"}


def read_all(root: str | os.PathLike[str]) -> list[tuple[str, Fields]]:
    """Every sample of a dataset, in dataset order, as ``(key, fields)``."""
    with shardio.open_dataset(root) as reader:
        return [split_sample(s) for s in reader]


def pack_into(src: Path, out: Path, fmt: str, **options: Any) -> Manifest:
    options.setdefault("fsync", False)  # throwaway output; fsync does not change the bytes
    return shardio.pack(src, out, format=fmt, progress=False, **options)


def dir_bytes(root: Path) -> dict[str, bytes]:
    """Every file below ``root`` (relative path -> content)."""
    return {p.relative_to(root).as_posix(): p.read_bytes()
            for p in sorted(root.rglob("*")) if p.is_file()}


def rewrite_manifest(root: Path, edit: Callable[[dict[str, Any]], None], *,
                     redigest: bool) -> None:
    """Edit ``root/manifest.json``; with ``redigest`` recompute its own digest so only the edit
    itself (not the digest check) can trigger an error."""
    path = root / "manifest.json"
    data = json.loads(path.read_bytes())
    edit(data)
    if redigest:
        data["manifest_digest"] = _body_digest(data)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")


def write_tree(src: Path, samples: dict[str, Fields]) -> None:
    for key, fields in samples.items():
        for ext, data in fields.items():
            path = src / f"{key}.{ext}"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


@pytest.fixture
def text_tree(tmp_path: Path) -> Path:
    """240 samples of small, similar JSON and text records (what a zstd dictionary is for)."""
    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "kappa"]
    samples: dict[str, Fields] = {}
    for i in range(240):
        record = {"id": i, "name": f"record {i}", "kind": "observation",
                  "tags": rng.sample(words, 3), "score": round(rng.random(), 4),
                  "source": {"site": f"site-{i % 5}", "sensor": "thermometer", "unit": "celsius"}}
        caption = " ".join(rng.choice(words) for _ in range(12 + i % 9))
        samples[f"g{i % 4}/rec{i:04d}"] = {
            "json": json.dumps(record).encode(),
            "txt": f"The reading of record {i} is {caption}.".encode(),
        }
    src = tmp_path / "text"
    write_tree(src, samples)
    return src


# --- hypothesis strategies -------------------------------------------------------------------
_SAFE = st.sampled_from("abcxyzABCXYZ0189_-")
_LETTER = st.characters(categories=("Lu", "Ll", "Lo"), max_codepoint=0x2FFFF)
_COMPONENT = st.text(st.one_of(_SAFE, _LETTER), min_size=1, max_size=8)  # no dots, no '/'
_KEY = st.builds(lambda dirs, stem: "/".join([*dirs, stem]),
                 st.lists(_COMPONENT, max_size=2), _COMPONENT)
_EXT = st.builds(".".join, st.lists(st.text(st.sampled_from("abjnpstxyz0123"), min_size=1,
                                            max_size=4), min_size=1, max_size=2))
_PAYLOAD = st.one_of(st.just(b""), st.binary(max_size=64),
                     st.binary(max_size=3000), st.binary(max_size=16).map(lambda b: b * 100))
_DATASETS = st.dictionaries(_KEY, st.dictionaries(_EXT, _PAYLOAD, min_size=1, max_size=3),
                            min_size=1, max_size=10)


# --- the conformance suite -------------------------------------------------------------------
class ShardFormatTests:
    """Behaviour every shard format must have; subclasses set ``fmt``."""

    fmt: str

    def pack(self, src: Path, out: Path, **options: Any) -> Manifest:
        return pack_into(src, out, self.fmt, **options)

    # round trip ---------------------------------------------------------------------------
    def test_round_trip_is_byte_exact(self, mixed_tree: Path, tmp_path: Path) -> None:
        out = tmp_path / "out"
        manifest = self.pack(mixed_tree, out, samples_per_shard=7)
        expected = source_samples(mixed_tree)
        got = read_all(out)

        assert len(manifest.shards) == 6
        assert all(s.path.endswith(".tar" if self.fmt == "tar" else ".h5")
                   for s in manifest.shards)
        assert manifest.shard_format == self.fmt
        assert [k for k, _ in got] == sorted(expected)
        assert dict(got) == expected
        assert manifest.num_samples == len(expected) == 40
        assert manifest.fields == dict(Counter(f for fs in expected.values() for f in fs))
        assert manifest.compression is None
        assert Manifest.load(str(out)).to_json() == (out / "manifest.json").read_bytes()

    def test_random_access_agrees_with_iteration(self, mixed_tree: Path, tmp_path: Path) -> None:
        out = tmp_path / "out"
        self.pack(mixed_tree, out, samples_per_shard=6)
        with shardio.open_dataset(out) as reader:
            in_order = list(reader)
            n = len(reader)
            assert n == len(in_order) == 40
            order = list(range(n))
            random.Random(3).shuffle(order)
            for i in order:  # random order, so every shard is reopened out of sequence
                assert reader[i] == in_order[i]
            assert reader[-1] == in_order[-1]
            per_shard = [s for k in range(reader.num_shards) for s in reader.iter_shard(k)]
            assert per_shard == in_order
            with pytest.raises(IndexError):
                reader[n]
        with shardio.open_dataset(out) as fresh:  # random access first, no iteration before
            assert [fresh[i] for i in reversed(range(n))] == in_order[::-1]

    def test_keys_are_sorted_within_and_across_shards(self, mixed_tree: Path,
                                                      tmp_path: Path) -> None:
        out = tmp_path / "out"
        self.pack(mixed_tree, out, samples_per_shard=5)
        with shardio.open_dataset(out) as reader:
            assert reader.num_shards == 8
            keys = []
            for k in range(reader.num_shards):
                shard_keys = reader.shard_index(k).keys()
                assert shard_keys == sorted(shard_keys)
                keys += shard_keys
        assert keys == sorted(source_samples(mixed_tree)) == [k for k, _ in read_all(out)]

    def test_zero_byte_fields(self, tmp_path: Path) -> None:
        src = tmp_path / "src"
        samples = {
            "a/all_empty": {"bin": b"", "txt": b""},   # first sample of shard 0, nothing stored
            "a/mixed": {"bin": b"", "txt": b"x" * 700},
            "a/tail": {"bin": b""},                    # last sample of shard 0
            "b/only": {"bin": b""},                    # first sample of shard 1
            "c/after": {"bin": b"\0", "txt": b""},
        }
        write_tree(src, samples)
        out = tmp_path / "out"
        manifest = self.pack(src, out, samples_per_shard=3, compress="zstd")
        assert [s.samples for s in manifest.shards] == [3, 2]
        assert dict(read_all(out)) == samples
        with shardio.open_dataset(out) as reader:
            assert reader[0] == {"__key__": "a/all_empty", "bin": b"", "txt": b""}
            assert reader[3] == {"__key__": "b/only", "bin": b""}
            idx = reader.shard_index(0)
            assert int(idx.f_length[0]) == int(idx.f_raw_length[0]) == 0
            assert int(idx.f_flags[0]) == 0  # an empty field is never "compressed"

        only_empty = tmp_path / "only_empty"  # shards without one stored byte
        write_tree(only_empty, {"k1": {"bin": b""}, "k2": {"bin": b"", "txt": b""}})
        self.pack(only_empty, tmp_path / "out2", samples_per_shard=1)
        assert read_all(tmp_path / "out2") == [("k1", {"bin": b""}),
                                                ("k2", {"bin": b"", "txt": b""})]

    def test_many_fields_in_one_shard(self, text_tree: Path, tmp_path: Path) -> None:
        """480 fields in one shard: more than one writev batch for the tar writer."""
        out = tmp_path / "out"
        manifest = self.pack(text_tree, out)
        assert len(manifest.shards) == 1
        assert dict(read_all(out)) == source_samples(text_tree)
        assert shardio.verify_dataset(out) == []

    def test_fields_larger_than_the_read_block(self, tmp_path: Path) -> None:
        """Samples bigger than the reader's 8 MiB block, next to tiny ones, in one shard."""
        rng = np.random.default_rng(0)
        samples = {f"s{i}": {"bin": rng.bytes(size), "txt": b"t" * i}
                   for i, size in enumerate([3 << 20, 9 << 20, 1, 0, 5 << 20, 4 << 20])}
        src = tmp_path / "src"
        write_tree(src, samples)
        out = tmp_path / "out"
        manifest = self.pack(src, out, shard_size="64MB")
        assert len(manifest.shards) == 1
        got = read_all(out)
        assert dict(got) == samples
        with shardio.open_dataset(out) as reader:
            assert [split_sample(reader[i]) for i in (5, 1, 3, 0)] == [got[i] for i in (5, 1, 3, 0)]
        assert shardio.verify_dataset(out) == []

    # compression --------------------------------------------------------------------------
    @pytest.mark.parametrize(("compress", "level"), [("zstd", 3), ("zstd:19", 19)])
    def test_zstd_round_trip_and_manifest(self, compress: str, level: int, text_tree: Path,
                                          mixed_tree: Path, tmp_path: Path) -> None:
        for src in (text_tree, mixed_tree):
            out = tmp_path / f"out-{src.name}"
            manifest = self.pack(src, out, samples_per_shard=64, compress=compress)
            assert dict(read_all(out)) == source_samples(src)
            assert manifest.compression == {"codec": "zstd", "level": level,
                                            "dictionary": None, "dictionary_digest": None}
            on_disk = Manifest.load(str(out))
            assert on_disk.compression == manifest.compression
            raw = sum(s.raw_bytes for s in on_disk.shards)
            stored = sum(s.stored_bytes for s in on_disk.shards)
            assert on_disk.stats["raw_bytes"] == raw
            assert on_disk.stats["stored_bytes"] == stored
            assert on_disk.stats["compression_ratio"] == round(raw / stored, 4)
            with shardio.open_dataset(out) as reader:
                flags = np.concatenate([reader.shard_index(k).f_flags
                                        for k in range(reader.num_shards)])
                assert (flags & FLAG_ZSTD).any()
        text = Manifest.load(str(tmp_path / "out-text"))
        assert text.stats["compression_ratio"] > 1.2

    def test_zstd_dictionary_round_trip(self, text_tree: Path, tmp_path: Path) -> None:
        plain = self.pack(text_tree, tmp_path / "plain", samples_per_shard=80, compress="zstd")
        out = tmp_path / "dict"
        manifest = self.pack(text_tree, out, samples_per_shard=80, compress="zstd",
                             zstd_dict=True)
        comp = Manifest.load(str(out)).compression
        assert comp is not None and comp["codec"] == "zstd" and comp["level"] == 3
        assert comp["dictionary"] == "zstd.dict"
        assert comp["dictionary_digest"] == digest_bytes((out / "zstd.dict").read_bytes())
        assert dict(read_all(out)) == source_samples(text_tree)
        # The point of a dictionary: many small similar records compress far better with one.
        assert manifest.stats["compression_ratio"] > plain.stats["compression_ratio"]

    # labels -------------------------------------------------------------------------------
    def test_label_from_dir(self, image_tree: Path, tmp_path: Path) -> None:
        out = tmp_path / "out"
        manifest = self.pack(image_tree, out, samples_per_shard=16, label_from_dir=True)
        names = ["class_000", "class_001", "class_002"]
        assert manifest.labels == {"field": "cls", "names": names}
        assert Manifest.load(str(out)).label_names == names
        assert manifest.fields == {"jpg": 60, "cls": 60}
        got = read_all(out)
        assert dict(got) == source_samples(image_tree, label_from_dir=True)
        for key, fields in got:
            assert names[int(fields["cls"])] == key.split("/", 1)[0]

    # reproducibility ----------------------------------------------------------------------
    @pytest.mark.parametrize("case", ["plain", "zstd_dict", "labels"])
    def test_output_is_byte_identical_across_runs_and_workers(
        self, case: str, mixed_tree: Path, text_tree: Path, image_tree: Path, tmp_path: Path,
    ) -> None:
        src, options = {
            "plain": (mixed_tree, {}),
            "zstd_dict": (text_tree, {"compress": "zstd:5", "zstd_dict": True}),
            "labels": (image_tree, {"label_from_dir": True}),
        }[case]
        runs = {}
        for name, workers in [("first", 1), ("again", 1), ("parallel", 2)]:
            self.pack(src, tmp_path / name, samples_per_shard=9, workers=workers, **options)
            runs[name] = dir_bytes(tmp_path / name)
        assert len([n for n in runs["first"] if n.startswith("shard-")]) >= 3
        assert "manifest.json" in runs["first"]
        for name in ("again", "parallel"):
            assert runs[name].keys() == runs["first"].keys()
            differ = [n for n in runs["first"] if runs[name][n] != runs["first"][n]]
            assert differ == [], f"{name} run differs in {differ}"

    # property -----------------------------------------------------------------------------
    # One test body inherited by each format class counts as "differing executors"; harmless
    # here: examples are derandomized and there is no example database to replay across them.
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.differing_executors])
    @given(samples=_DATASETS, per_shard=st.integers(1, 4),
           compress=st.sampled_from([None, "zstd"]))
    def test_property_pack_then_read_equals_input(self, samples: dict[str, Fields],
                                                  per_shard: int, compress: str | None) -> None:
        with tempfile.TemporaryDirectory(prefix="shardio-prop-") as tmp:
            src, out = Path(tmp, "src"), Path(tmp, "out")
            write_tree(src, samples)
            manifest = self.pack(src, out, samples_per_shard=per_shard, compress=compress)
            got = read_all(out)
            assert [k for k, _ in got] == sorted(samples)
            assert dict(got) == samples
            assert manifest.num_samples == len(samples)
            assert manifest.fields == dict(Counter(f for fs in samples.values() for f in fs))
            with shardio.open_dataset(out) as reader:
                assert [reader[i] for i in range(len(reader))] == [
                    {"__key__": k, **fs} for k, fs in got]


class TestTarFormat(ShardFormatTests):
    fmt = "tar"


class TestHdf5Format(ShardFormatTests):
    fmt = "hdf5"


# --- a dataset packed again in place under a live reader ----------------------------------------
def _versioned_tree(src: Path, tag: str) -> None:
    """12 samples whose keys and field sizes are the same for every ``tag``, their bytes not:
    the old index points at valid ranges of the new shards (the worst case: wrong bytes)."""
    write_tree(src, {f"s{i:03d}": {"txt": f"{tag}{i:03d}-".encode() * 30,
                                   "bin": bytes([ord(tag) ^ i]) * (64 + i)} for i in range(12)})


def _outcome(fn: Callable[[], Any]) -> tuple[str, Any]:
    try:
        return "ok", fn()
    except Exception as exc:  # (the type crosses the process boundary by name)
        return type(exc).__name__, str(exc)


def _in_forked_child(fn: Callable[[], Any]) -> tuple[str, Any]:
    """``fn()``'s result or error in a forked child: it inherits the parent's readers, with
    their cached indexes, and opens its own descriptors (as a loader worker does)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    child = ctx.Process(target=lambda: queue.put(_outcome(fn)))
    child.start()
    try:
        return queue.get()
    finally:
        child.join(60)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_a_dataset_packed_again_in_place_is_not_read_through_the_old_index(
        fmt: str, verify: bool, tmp_path: Path) -> None:
    import pickle

    from shardio.errors import DatasetChangedError

    old_src, new_src, out = tmp_path / "old", tmp_path / "new", tmp_path / "ds"
    _versioned_tree(old_src, "a")
    _versioned_tree(new_src, "b")
    pack_into(old_src, out, fmt, samples_per_shard=4)
    new = source_samples(new_src)
    reader = shardio.open_dataset(out, verify=verify)
    try:
        assert split_sample(reader[0]) == ("s000", source_samples(old_src)["s000"])
        assert split_sample(reader[1])[0] == "s001"  # shard 0 open, its index cached
        pack_into(new_src, out, fmt, samples_per_shard=4, overwrite=True)
        assert dict(read_all(out)) == new  # what a new reader sees

        # A forked worker reopens shard 0 (the new file) with the index it inherited.
        kind, why = _in_forked_child(lambda: reader[2])
        assert kind == "DatasetChangedError", (kind, why)
        assert "make a new reader/dataset" in why
        # So does this process once its descriptor is closed (after a fault, an eviction).
        reader.shard(0).close()
        with pytest.raises(DatasetChangedError, match="packed again in place"):
            reader[3]
        # A shard this reader never opened: the manifest on disk lists other shards now.
        with pytest.raises(DatasetChangedError, match="make a new reader/dataset"):
            reader[5]
        # A reader pickled into another process, with the manifest it was made from.
        with pytest.raises(DatasetChangedError):
            pickle.loads(pickle.dumps(reader))[0]
    finally:
        reader.close()
    with shardio.open_dataset(out, verify=verify) as fresh:
        assert [split_sample(fresh[i]) for i in range(len(fresh))] == sorted(new.items())


@pytest.mark.parametrize("fmt", ["tar", "hdf5"])
def test_a_shard_copied_over_itself_is_read_on(fmt: str, tmp_path: Path) -> None:
    src, out = tmp_path / "src", tmp_path / "ds"
    _versioned_tree(src, "a")
    pack_into(src, out, fmt, samples_per_shard=4)
    want = sorted(source_samples(src).items())
    with shardio.open_dataset(out) as reader:
        assert split_sample(reader[0]) == want[0]  # shard 0 open, its index cached
        path = reader.shard_path(0)
        before = os.stat(path).st_ino
        copy = tmp_path / "copy"
        copy.write_bytes(Path(path).read_bytes())
        os.replace(copy, path)  # same bytes, another file (a restore from a backup, say)
        assert os.stat(path).st_ino != before
        assert _in_forked_child(lambda: split_sample(reader[1])) == ("ok", want[1])
        reader.shard(0).close()
        assert [split_sample(reader[i]) for i in range(len(reader))] == want
        assert [split_sample(s) for s in reader] == want
