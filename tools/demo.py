"""The built-in example (``make demo``): generate a small ImageFolder tree, pack it, verify it,
read every sample back through the shard index, train-load it with the ShardLoader, then stage it
to a node-local cache and read through injected corruption (self-repair), and print the figures.

``python tools/demo.py [--out DIR]`` works in ``DIR`` (default ``$SHARDIO_DEMO_DIR``, else
``demo-out``).  A folder a previous demo wrote is emptied first; any other folder that is not
empty is refused (exit 2), so the demo never deletes files it did not write.  Exit status: 0
every step checked out, 1 a step found a problem, 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shardio  # noqa: E402
from tools.make_dataset import make_images  # noqa: E402

# Written into the output folder before anything else: the folder is a demo's to empty again.
# Nothing else makes a folder the demo's (not even holding only images/ and dataset/: a tree
# made with tools/make_dataset.py looks like that), so a demo-out/ written before the marker
# existed is refused too, with the fix (remove it: make clean).
MARKER = ".shardio-demo"


def _prepare_out(p: argparse.ArgumentParser, root: str) -> None:
    """Make ``root`` an empty folder marked as the demo's, or refuse (exit 2) to touch it."""
    if os.path.lexists(root) and not os.path.isdir(root):
        p.error(f"--out {root}: exists and is not a directory; name a folder for the demo")
    if os.path.isdir(root) and os.listdir(root):
        if not os.path.lexists(os.path.join(root, MARKER)):
            p.error(f"--out {root}: folder is not empty and is not a previous demo's output "
                    f"(no {MARKER} file); the demo empties its folder, so name a new or empty "
                    "one (an older demo's output: remove it, e.g. make clean)")
        for name in os.listdir(root):  # the folder itself stays (it may be a link)
            path = os.path.join(root, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
    try:
        os.makedirs(root, exist_ok=True)
        with open(os.path.join(root, MARKER), "w") as f:
            f.write("written by tools/demo.py; the next demo run here empties this folder\n")
    except OSError as exc:
        p.error(f"--out {root}: cannot write there ({exc.strerror or exc}); name a folder you "
                "can write")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", metavar="DIR",
                   default=os.environ.get("SHARDIO_DEMO_DIR") or "demo-out",
                   help="folder to work in (default $SHARDIO_DEMO_DIR, else demo-out); a "
                        "previous demo's output is replaced, another non-empty folder refused")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    root = p.parse_args(argv).out
    if not root:
        p.error("--out: empty path; name a folder, e.g. --out demo-out")
    _prepare_out(p, root)
    src, out = os.path.join(root, "images"), os.path.join(root, "dataset")
    t0 = time.perf_counter()
    total = make_images(src, files=2000, classes=10, seed=0)
    print(f"1. generated 2000 JPEGs in 10 class folders ({total / 1e6:.1f} MB) under {src} "
          f"in {time.perf_counter() - t0:.1f}s")

    t0 = time.perf_counter()
    m = shardio.pack(src, out, label_from_dir=True, shard_size="8MB", workers=2)
    dt = time.perf_counter() - t0
    st = m.stats
    print(f"2. packed {st['files_in']} files into {st['shards']} tar shards in {dt:.2f}s "
          f"({st['files_in'] / dt:.0f} files/s, {st['raw_bytes'] / dt / 1e6:.0f} MB/s); metadata "
          f"operations per epoch {st['metadata_ops_small_files']} -> {st['metadata_ops_shards']}")

    t0 = time.perf_counter()
    problems = shardio.verify_dataset(out, workers=2)
    print(f"3. verified every checksum in {time.perf_counter() - t0:.2f}s: "
          + ("clean" if not problems else f"{len(problems)} problems"))
    if problems:
        for problem in problems:
            print("   ", problem)
        return 1

    t0 = time.perf_counter()
    names = m.label_names or []
    n = mismatched = 0
    with shardio.open_dataset(out) as ds:
        for sample in ds:
            cls_name = names[int(sample["cls"])]
            with open(os.path.join(src, sample["__key__"] + ".jpg"), "rb") as f:
                mismatched += f.read() != sample["jpg"] or not sample["__key__"].startswith(cls_name)
            n += 1
        dt = time.perf_counter() - t0
        first = ds[0]
    print(f"4. read back {n} samples in {dt:.2f}s ({n / dt:.0f} samples/s), "
          f"{mismatched} mismatches; ds[0] = {first['__key__']!r} "
          f"({len(first['jpg'])} bytes, class {names[int(first['cls'])]!r})")
    t0 = time.perf_counter()
    ds_train = shardio.ShardDataset(out, decode=True, seed=0,
                                    transform=lambda s: {"image": s["jpg"][:64, :64],
                                                         "label": s["cls"]})
    with shardio.ShardLoader(ds_train, batch_size=128, num_workers=2) as loader:
        seen = 0
        for batch in loader:
            seen += len(batch["label"])
        st = loader.stats()
    dt = time.perf_counter() - t0
    print(f"5. ShardLoader decoded one shuffled epoch ({seen} samples, batches of "
          f"{tuple(batch['image'].shape)} uint8 tensors in shared memory) in {dt:.2f}s "
          f"({seen / dt:.0f} samples/s); the loop waited for data "
          f"{100 * st['wait_fraction']:.0f}% of the time")
    bad = _staging_and_repair(root, out)
    print(f"\n`shardio inspect {out}` describes the dataset; `tar -tf {out}/shard-000000.tar | head` "
          "lists it with GNU tar.")
    return 1 if mismatched or bad else 0


def _staging_and_repair(root: str, out: str) -> int:
    """Steps 6-7: stage to a node-local cache; corrupt shards and read through the damage."""
    from tools.faults import corrupt_dataset

    cache = os.path.join(root, "node-cache")
    os.makedirs(cache)
    ds = shardio.ShardDataset(out, seed=0, cache_dir=cache, cache_reserve=0)
    t0 = time.perf_counter()
    c = ds.stage([0])
    keys = [s["__key__"] for s in ds]
    io = ds.io_stats()["repair"]
    print(f"6. staged {c['shards_staged']} shards ({c['bytes_staged'] / 1e6:.1f} MB, verified) to "
          f"{cache} and read the epoch from there in {time.perf_counter() - t0:.2f}s: "
          f"{io['bytes_cache'] / 1e6:.1f} MB from the cache, {io['bytes_original']} bytes from "
          "the dataset")
    replica = os.path.join(root, "replica")
    shutil.copytree(out, replica)
    shutil.rmtree(os.path.join(cache))  # read the originals again, then damage them
    damage = corrupt_dataset(out, [0], "flip", seed=1) + corrupt_dataset(out, [1], "truncate")
    logging.getLogger("shardio.repair").setLevel(logging.ERROR)  # counted below instead
    reader = shardio.ShardDataset(out, seed=0, replicas=[replica], quarantine=True)
    again = [s["__key__"] for s in reader]
    r = reader.io_stats()["repair"]
    ok = again == keys and not shardio.verify_dataset(out)
    print(f"7. damaged two shards ({'; '.join(damage)}); one epoch still delivered the same "
          f"{len(again)} samples in the same order ({'yes' if again == keys else 'NO'}): "
          f"{r['checksum_mismatch']} checksum mismatch, {r['truncated']} truncation, "
          f"{r['failovers']} fail-overs to the replica, {r['originals_restored']} originals "
          f"restored (bad ones in {out}/.quarantine); verify now: "
          f"{'clean' if ok else 'PROBLEMS'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
