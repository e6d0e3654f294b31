"""Fault injection for shardio datasets: flip bits, truncate or delete files, in place.

Stand-alone script (standard library only; the ``dataset`` command also imports shardio)::

    python tools/faults.py flip PATH [--offset N | --random --seed S] [--bits K]
    python tools/faults.py truncate PATH (--to N | --by N)
    python tools/faults.py delete PATH
    python tools/faults.py dataset ROOT SHARD... --how flip|truncate|delete [--seed S]

and importable module (``from tools.faults import flip_bits, corrupt_dataset``) for tests.

A bit flip models silent corruption (bit rot, a bad DIMM on the way to disk): the file keeps its
size and its modification time, so only checksums can catch it.  :func:`corrupt_dataset` aims at
the stored bytes of sample fields, found through each shard's index, so the damage is also caught
by per-sample checksums on read and not only by the whole-shard digest.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Sequence

__all__ = ["HOW", "corrupt_dataset", "delete", "flip_bits", "main", "truncate"]

HOW = ("flip", "truncate", "delete")


def flip_bits(path: str | os.PathLike[str], offset: int | None = None, bits: int = 1,
              seed: int = 0, *, span: int | None = None, keep_mtime: bool = True) -> list[int]:
    """Flip ``bits`` bits of a file in place, one per byte, keeping its size (and mtime).

    Args:
        path: the file.
        offset: first byte to damage; the bytes ``offset .. offset+bits-1`` each get one bit
            flipped.  ``None`` picks ``bits`` distinct bytes at random (seeded).
        bits: how many bits (and bytes) to flip.
        seed: seed of the random choices (byte offsets, and which bit of each byte).
        span: with ``offset``, pick the bytes at random inside ``offset .. offset+span-1``
            instead of consecutively.
        keep_mtime: restore the modification time afterwards, like real bit rot.

    Returns:
        The byte offsets changed, sorted.

    Raises:
        ValueError: ``bits`` < 1, or the requested bytes lie outside the file.
    """
    size = os.path.getsize(path)
    rng = random.Random(seed)
    if bits < 1:
        raise ValueError(f"bits must be >= 1, got {bits}")
    if offset is None:
        lo, width = 0, size
    else:
        lo, width = offset, span if span is not None else bits
    if lo < 0 or width < bits or lo + width > size:
        raise ValueError(f"cannot flip {bits} byte(s) in [{lo}, {lo + width}) of {path} "
                         f"({size} bytes)")
    if offset is not None and span is None:
        offsets = list(range(offset, offset + bits))
    else:
        offsets = sorted(rng.sample(range(lo, lo + width), bits))
    st = os.stat(path)
    with open(path, "r+b") as f:
        for off in offsets:
            f.seek(off)
            byte = f.read(1)[0]
            f.seek(off)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    return offsets


def truncate(path: str | os.PathLike[str], to: int | None = None, by: int | None = None) -> int:
    """Cut a file to ``to`` bytes, or shorten it ``by`` bytes; return the new size.

    Raises:
        ValueError: neither or both of ``to``/``by`` given, or the new size would not be shorter.
    """
    if (to is None) == (by is None):
        raise ValueError("give exactly one of to= or by=")
    size = os.path.getsize(path)
    new = to if to is not None else size - int(by or 0)
    if not 0 <= new < size:
        raise ValueError(f"cannot truncate {path} ({size} bytes) to {new} bytes")
    os.truncate(path, new)
    return new


def delete(path: str | os.PathLike[str]) -> None:
    """Remove a file (a lost shard).

    Raises:
        FileNotFoundError: it is already gone.
    """
    os.unlink(path)


def _pick_field(root: str, fmt: str, rel: str, rng: random.Random) -> tuple[int, int, str]:
    """``(offset, length, 'sample KEY field NAME')`` of a random non-empty stored field."""
    from shardio.formats import load_index

    index = load_index(fmt, os.path.join(root, rel))
    rows = [r for r in range(len(index.f_length)) if int(index.f_length[r]) > 0]
    if not rows:
        raise ValueError(f"{rel} holds no non-empty field to damage")
    row = rng.choice(rows)
    sample = max(i for i in range(len(index)) if int(index.sample_start[i]) <= row)
    what = f"sample {index.key(sample)!r} field {index.field_names[int(index.f_name[row])]!r}"
    return int(index.f_offset[row]), int(index.f_length[row]), what


def corrupt_dataset(root: str | os.PathLike[str], shards: Sequence[int], how: str,
                    seed: int = 0, *, bits: int = 1) -> list[str]:
    """Damage shard files of a shardio dataset, chosen by manifest index.

    ``flip`` flips ``bits`` bits inside one sample field's stored bytes; ``truncate`` cuts the
    shard in the middle of a sample field; ``delete`` removes the shard file (its ``.idx``, if
    any, stays).  Fields are picked at random from the shard index (seeded per shard).

    Returns:
        One line per shard describing the fault.

    Raises:
        ValueError: unknown ``how`` or a shard index out of range.
    """
    from shardio.manifest import Manifest

    if how not in HOW:
        raise ValueError(f"how must be one of {HOW}, got {how!r}")
    root = os.fspath(root)
    manifest = Manifest.load(root)
    done = []
    for i in shards:
        if not 0 <= i < len(manifest.shards):
            raise ValueError(f"shard {i} out of range (dataset has {len(manifest.shards)})")
        rel = manifest.shards[i].path
        path = os.path.join(root, rel)
        if how == "delete":
            delete(path)
            done.append(f"{rel}: deleted")
            continue
        rng = random.Random(f"{seed}:{i}")
        offset, length, what = _pick_field(root, manifest.shard_format, rel, rng)
        if how == "flip":
            flipped = flip_bits(path, offset, min(bits, length), seed=rng.randrange(1 << 30),
                                span=length)
            done.append(f"{rel}: flipped {len(flipped)} bit(s) at {flipped} in {what}")
        else:
            new = truncate(path, to=offset + length // 2)
            done.append(f"{rel}: truncated to {new} bytes, inside {what}")
    return done


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="faults.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("flip", help="flip bits in place (size and mtime kept)")
    f.add_argument("path")
    where = f.add_mutually_exclusive_group(required=True)
    where.add_argument("--offset", type=int, help="first byte to damage")
    where.add_argument("--random", action="store_true", help="random bytes (see --seed)")
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--bits", type=int, default=1)
    t = sub.add_parser("truncate", help="cut a file short")
    t.add_argument("path")
    size = t.add_mutually_exclusive_group(required=True)
    size.add_argument("--to", type=int, help="new size in bytes")
    size.add_argument("--by", type=int, help="bytes to cut off the end")
    d = sub.add_parser("delete", help="remove a file")
    d.add_argument("path")
    ds = sub.add_parser("dataset", help="damage shards of a dataset by manifest index")
    ds.add_argument("root")
    ds.add_argument("shards", type=int, nargs="+")
    ds.add_argument("--how", choices=HOW, required=True)
    ds.add_argument("--seed", type=int, default=0)
    ds.add_argument("--bits", type=int, default=1)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return 0 on success, 2 on a bad request."""
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "flip":
            offsets = flip_bits(args.path, args.offset, args.bits, args.seed)
            print(f"{args.path}: flipped bits at offsets {offsets}")
        elif args.cmd == "truncate":
            print(f"{args.path}: truncated to {truncate(args.path, args.to, args.by)} bytes")
        elif args.cmd == "delete":
            delete(args.path)
            print(f"{args.path}: deleted")
        else:
            for line in corrupt_dataset(args.root, args.shards, args.how, args.seed,
                                        bits=args.bits):
                print(line)
    except (OSError, ValueError) as exc:
        print(f"faults.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
