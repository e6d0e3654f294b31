"""The ``shardio`` command: argument parsing only; every action is a library call.

Exit codes: 0 success; 1 a problem was found (verify findings, bad input data, I/O failure);
2 usage error (bad arguments or options); 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .parts import PartResult

__all__ = ["main"]


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def _parser(with_bench: bool = True) -> argparse.ArgumentParser:
    """The argument parser; ``with_bench=False`` leaves out the options of ``shardio bench``
    (building them imports the benchmark modules: ~50 ms that every ``pack`` would pay)."""
    from . import __version__

    p = argparse.ArgumentParser(prog="shardio", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"shardio {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    pk = sub.add_parser("pack", help="pack a tree of small files into checksummed shards")
    pk.add_argument("src", help="source directory (keys are paths relative to it)")
    pk.add_argument("out", help="output dataset directory")
    pk.add_argument("--files-from", metavar="LIST",
                    help="pack only the paths listed, one per line, as they are (no comments; "
                         "blank lines are ignored)")
    pk.add_argument("--format", default="tar", choices=["tar", "hdf5"])
    pk.add_argument("--shard-size", default=None, help="max shard size, e.g. 256MB (default 256MB)")
    pk.add_argument("--samples-per-shard", type=int, default=None)
    pk.add_argument("--workers", type=int, default=1, help="writer processes (default 1)")
    pk.add_argument("--scan-threads", type=int, default=None, metavar="N",
                    help="threads that stat the source files, and then read them (default: 16 "
                    "when the first stats are slow, as on a parallel filesystem, else none; 1: "
                    "never)")
    pk.add_argument("--compress", default=None, help="none | zstd | zstd:LEVEL")
    pk.add_argument("--zstd-dict", action="store_true", help="train and store a zstd dictionary")
    pk.add_argument("--label-from-dir", action="store_true",
                    help="add a 'cls' label from the first directory level (ImageFolder layout)")
    pk.add_argument("--checksum", default="xxh3_64", help="xxh3_64 (default) | crc32 | crc32c")
    pk.add_argument("--on-error", default="raise", choices=["raise", "skip"])
    pk.add_argument("--overwrite", action="store_true", help="replace shardio files in OUT")
    pk.add_argument("--resume", action="store_true",
                    help="require OUT to hold a run of this same pack, and finish it (a "
                         "finished one is left as it is)")
    pk.add_argument("--no-fsync", action="store_true", help="skip fsync (throwaway output only)")
    pk.add_argument("--prefix", default="shard", help="shard file name prefix")
    pk.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                    help="progress bar (default: when stderr is a terminal)")
    pk.add_argument("--json", action="store_true", help="print the summary as JSON")
    pk.add_argument("--parity", metavar="K+M", default=None,
                    help="erasure-coded parity: rebuild up to M lost shards per group of K")
    pk.add_argument("--stripe-count", type=int, default=1,
                    help="Lustre stripes per shard (-1: all OSTs; default 1)")
    pk.add_argument("--stripe-size", default="4MiB", help="Lustre stripe size (default 4MiB)")
    pk.add_argument("--stripe-pool", default=None, help="Lustre OST pool")
    pk.add_argument("--part", metavar="I/N|auto", default=None,
                    help="multi-node pack: write only part I of N (from 0) of the shards into "
                    "OUT, which all parts share ('auto': from Slurm/torchrun/MPI rank variables); "
                    "run `shardio merge OUT` once every part has finished")

    mg = sub.add_parser("merge", help="publish the manifest of a multi-node pack (pack --part) "
                        "once every part has finished")
    mg.add_argument("out", help="the output directory the parts packed into")
    mg.add_argument("--verify", action="store_true",
                    help="also hash every shard against the digest its part recorded")
    mg.add_argument("--json", action="store_true", help="print the summary as JSON")

    vf = sub.add_parser("verify", help="recompute every checksum of a dataset")
    vf.add_argument("dataset")
    vf.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    vf.add_argument("--repair", action="store_true",
                    help="replace damaged shards from --replica copies or parity")
    vf.add_argument("--replica", action="append", default=[], metavar="DIR",
                    help="a byte-identical copy of the dataset (repeatable)")

    rp = sub.add_parser("repair", help="replace damaged shards from replicas or parity")
    rp.add_argument("dataset")
    rp.add_argument("--replica", action="append", default=[], metavar="DIR",
                    help="a byte-identical copy of the dataset (repeatable)")
    rp.add_argument("--no-parity", action="store_true", help="do not rebuild from parity")
    rp.add_argument("--json", action="store_true")

    sg = sub.add_parser("stage", help="copy the shards this node will read to node-local storage "
                        "(job prologs: srun --ntasks-per-node=1 shardio stage ...)")
    sg.add_argument("dataset")
    sg.add_argument("--cache", required=True, metavar="DIR",
                    help="node-local directory, or 'auto' ($SHARDIO_CACHE_DIR, $SLURM_TMPDIR, ...)")
    sg.add_argument("--epochs", default="0", metavar="E[..F]", help="epochs to stage (default 0)")
    sg.add_argument("--seed", type=int, default=0, help="the training job's shuffle seed")
    sg.add_argument("--batch-size", type=int, default=1, help="the training job's batch size")
    sg.add_argument("--no-shuffle", action="store_true")
    sg.add_argument("--shuffle-block", type=int, default=1 << 18)
    sg.add_argument("--order", default="global", choices=["global", "node"],
                    help="the training job's ReadOptions.order")
    sg.add_argument("--canonical-nodes", type=int, default=None,
                    help="the training job's canonical_nodes (order=node; default: node count)")
    sg.add_argument("--world-size", type=int, default=None,
                    help="ranks of the training job (default: from Slurm/torchrun variables)")
    sg.add_argument("--ranks-per-node", type=int, default=None)
    sg.add_argument("--node", type=int, default=None, help="this node's index in the job")
    sg.add_argument("--budget", default=None, help="bytes the cache may use (default: free space)")
    sg.add_argument("--reserve", default="1GiB", help="free space to leave (default 1GiB)")
    sg.add_argument("--bandwidth", default=None, help="cap on reads from the shared filesystem")

    bench = sub.add_parser("bench", help="measure storage before choosing shard size, "
                           "striping, workers and staging depth")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    if with_bench:
        from . import loaderbench, storagebench

        storagebench.add_arguments(bench_sub.add_parser(
            "storage",
            help="bandwidth, IOPS, latency and metadata rates of a directory's filesystem"))
        loaderbench.add_arguments(bench_sub.add_parser(
            "loader", help="data wait vs a simulated step, per worker count; fewest workers needed"))

    ins = sub.add_parser("inspect", help="summarise a dataset")
    ins.add_argument("dataset")
    ins.add_argument("--json", action="store_true")
    ins.add_argument("--no-shards", action="store_true", help="omit the per-shard listing")

    ix = sub.add_parser("index", help="index existing WebDataset tars in place")
    ix.add_argument("tars", nargs="+")
    ix.add_argument("--root", default=None, help="dataset directory (default: common directory)")
    ix.add_argument("--workers", type=int, default=1)
    ix.add_argument("--checksum", default="xxh3_64")
    ix.add_argument("--overwrite", action="store_true",
                    help="replace a manifest already there (a packed or indexed dataset)")
    return p


def _cmd_pack(a: argparse.Namespace) -> int:
    from .config import PackOptions
    from .manifest import Manifest
    from .packer import pack

    shard_size = a.shard_size
    if shard_size is None and a.samples_per_shard is None:
        shard_size = "256MB"
    opts = PackOptions(
        format=a.format, shard_size=shard_size, samples_per_shard=a.samples_per_shard,
        workers=a.workers, compress=a.compress, zstd_dict=a.zstd_dict,
        label_from_dir=a.label_from_dir, checksum=a.checksum, on_error=a.on_error,
        overwrite=a.overwrite, resume=a.resume, fsync=not a.no_fsync, prefix=a.prefix,
        parity=a.parity, stripe_count=a.stripe_count, stripe_size=a.stripe_size,
        stripe_pool=a.stripe_pool, part=a.part, scan_threads=a.scan_threads,
    )
    t0 = time.perf_counter()
    m = pack(a.src, a.out, opts, files_from=a.files_from, progress=a.progress)
    dt = max(time.perf_counter() - t0, 1e-9)
    if not isinstance(m, Manifest):
        return _print_part(m, dt, a.json)
    st = dict(m.stats)
    st["seconds"] = round(dt, 3)
    st["files_per_s"] = round(st["files_in"] / dt, 1)
    st["mb_per_s"] = round(st["raw_bytes"] / dt / 1e6, 1)
    if a.json:
        print(json.dumps(st, sort_keys=True))
        return 0
    small, shards = st["metadata_ops_small_files"], st["metadata_ops_shards"]
    skipped = sum(st["skipped"].values())
    scanned = f"{st['files_in']} files" + (f", {skipped} skipped" if skipped else "")
    print(f"packed {st['samples']} samples ({_human(st['raw_bytes'])}; {scanned}) "
          f"into {st['shards']} {m.shard_format} shards ({_human(st['shard_bytes'])}) in "
          f"{dt:.2f}s: {st['files_per_s']:.0f} files/s, {st['mb_per_s']:.1f} MB/s")
    ratio = small / max(shards, 1)
    fewer = (f"{ratio:.0f}x fewer" if ratio >= 1.95 else f"{ratio:.1f}x fewer" if ratio > 1
             else "no fewer: a dataset this small gains nothing from shards")
    print(f"compression ratio {st['compression_ratio']:.2f}x; metadata operations per epoch "
          f"{small} -> {shards} ({fewer})")
    if st.get("parity_bytes"):
        print(f"parity {a.parity}: {_human(st['parity_bytes'])} in {m.shard_format} groups")
    if st.get("layout"):
        print(f"layout: {st['layout']}")
    if st["skipped"]:
        print("skipped: " + ", ".join(f"{k}={v}" for k, v in st["skipped"].items()))
    print(f"manifest: {os.path.join(a.out, 'manifest.json')}")
    return 0


def _print_part(r: PartResult, dt: float, as_json: bool) -> int:
    from dataclasses import asdict

    if as_json:
        print(json.dumps({**asdict(r), "seconds": round(dt, 3)}, sort_keys=True))
        return 0
    head = f"part {r.part}/{r.parts}"
    if r.merged:
        print(f"{head}: the job is already merged; nothing to do")
    elif r.first == r.stop:
        print(f"{head}: no shards to write (more parts than the job's {r.total_shards} shards)")
    else:
        kept = f"; kept {r.kept} finished earlier" if r.kept else ""
        print(f"{head}: wrote shards {r.first}..{r.stop - 1} of {r.total_shards} "
              f"({r.shards[0]} .. {r.shards[-1]}), {r.samples} samples, {_human(r.bytes)} in "
              f"{dt:.2f}s{kept}")
    if not r.merged:
        print(f"once all {r.parts} parts have finished, run: {r.merge_command}")
    return 0


def _cmd_merge(a: argparse.Namespace) -> int:
    from .parts import merge

    m = merge(a.out, verify=a.verify)
    st = m.stats
    if a.json:
        print(json.dumps(st, sort_keys=True))
        return 0
    print(f"merged {st['shards']} {m.shard_format} shards ({st['samples']} samples, "
          f"{_human(st['shard_bytes'])}) from {st['files_in']} files")
    print(f"manifest: {os.path.join(a.out, 'manifest.json')}")
    return 0


def _cmd_verify(a: argparse.Namespace) -> int:
    from .verify import verify_dataset

    if not os.path.isdir(a.dataset):
        print(f"shardio verify: {a.dataset} is not a directory", file=sys.stderr)
        return 2
    if a.workers < 1:
        print(f"shardio verify: --workers must be >= 1, got {a.workers}", file=sys.stderr)
        return 2
    problems = verify_dataset(a.dataset, workers=a.workers)
    for p in problems:
        print(p)
    if problems and a.repair:
        damaged, others = _damaged_shards(a.dataset, problems)
        rc = _repair(a.dataset, a.replica, True, False, damaged=damaged)
        if others:  # the manifest, parity files, extra files: not shards repair can restore
            print(f"{len(others)} problem(s) that repair does not fix (listed above)",
                  file=sys.stderr)
            return 1
        return rc
    if problems:
        print(f"{len(problems)} problem(s) found", file=sys.stderr)
        return 1
    print("ok", file=sys.stderr)
    return 0


def _damaged_shards(root: str, problems: list) -> tuple[list[int], list]:
    """The shards the problems name (repair restores them), and the other problems."""
    from .manifest import Manifest

    m = Manifest.load(root)
    by_path = {}
    for i, e in enumerate(m.shards):
        by_path[e.path] = i
        if e.index:
            by_path[e.index] = i
    # The zstd dictionary: repair_dataset restores it from a replica whenever it is bad.
    dictionary = (m.compression or {}).get("dictionary")
    return (sorted({by_path[p.path] for p in problems if p.path in by_path}),
            [p for p in problems if p.path not in by_path and p.path != dictionary])


def _repair(root: str, replicas: list[str], parity: bool, as_json: bool,
            damaged: list[int] | None = None) -> int:
    from .repair import repair_dataset

    r = repair_dataset(root, replicas=replicas, use_parity=parity, damaged=damaged)
    if as_json:
        print(json.dumps({"checked": r.checked, "damaged": r.damaged, "repaired": r.repaired,
                          "unrepaired": r.unrepaired}, sort_keys=True))
    else:
        for path, source in r.repaired or []:
            print(f"repaired {path} from {source}")
        for path in r.unrepaired or []:
            print(f"NOT repaired {path}: no good copy (add --replica DIR or pack with --parity)")
        print(f"{r.checked} shard(s) checked, {len(r.damaged or [])} damaged, "
              f"{len(r.repaired or [])} repaired", file=sys.stderr)
    return 0 if r.ok else 1


def _cmd_repair(a: argparse.Namespace) -> int:
    if not os.path.isdir(a.dataset):
        print(f"shardio repair: {a.dataset} is not a directory", file=sys.stderr)
        return 2
    return _repair(a.dataset, a.replica, not a.no_parity, a.json)


def _epochs(text: str) -> range:
    from .errors import UsageError

    lo, _, hi = text.partition("..")
    try:
        first = int(lo)
        last = int(hi) if hi else first
    except ValueError as exc:
        raise UsageError(f"--epochs {text!r}: write E or E..F (e.g. 0..2)") from exc
    if first < 0 or last < first:
        raise UsageError(f"--epochs {text!r}: need 0 <= E <= F")
    return range(first, last + 1)


def _cmd_stage(a: argparse.Namespace) -> int:
    import numpy as np

    from .errors import UsageError
    from .manifest import Manifest
    from .order import EpochOrder, NodeAffineOrder, node_schedule
    from .stage import NodeCache, StageOptions, Stager
    from .topology import Topology

    epochs = _epochs(a.epochs)
    if not 0 <= a.seed < 1 << 63:
        raise UsageError(f"--seed {a.seed}: the training job's seed, an integer in [0, 2**63)")
    # A prolog step (srun --ntasks-per-node=1) is one process per node: the node count and this
    # node's index come from it (or Slurm's node variables); the training job's world is that
    # many nodes of --ranks-per-node ranks.  (The prolog's own world, one rank per node, is not.)
    env = Topology.from_env()
    nodes = _env_int("SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    if nodes is None:
        nodes = max(1, env.world_size // env.local_world_size)
    local = a.ranks_per_node if a.ranks_per_node is not None else env.local_world_size
    world = a.world_size if a.world_size is not None else nodes * local
    slurm_node = _env_int("SLURM_NODEID")
    node = a.node if a.node is not None else slurm_node if slurm_node is not None else env.node
    if world < 1 or not 1 <= local <= world:
        raise UsageError(f"--world-size {world} with --ranks-per-node {local}: need "
                         "1 <= ranks per node <= world size")
    if not 0 <= node < -(-world // local):
        raise UsageError(f"--node {node}: a job of {world} ranks, {local} per node, has nodes "
                         f"0..{-(-world // local) - 1}")
    options = StageOptions(cache_dir=a.cache, budget=a.budget, reserve=a.reserve,
                           bandwidth=a.bandwidth, lookahead=0)
    manifest = Manifest.load(a.dataset)
    cache = NodeCache.from_options(a.dataset, manifest, options)
    if cache is None:
        print("shardio stage: --cache auto found no usable node-local directory; set "
              "$SHARDIO_CACHE_DIR or pass --cache DIR", file=sys.stderr)
        return 2
    counts = np.array([s.samples for s in manifest.shards], dtype=np.int64)

    def schedule(epoch: int):  # type: ignore[no-untyped-def]
        if a.order == "node":
            order = NodeAffineOrder.for_job(
                counts, world_size=world, local_world_size=local, batch_size=a.batch_size,
                canonical_nodes=a.canonical_nodes, seed=a.seed, epoch=epoch,
                shuffle=not a.no_shuffle, shuffle_block=a.shuffle_block)
        else:
            order = EpochOrder(counts, seed=a.seed, epoch=epoch, shuffle=not a.no_shuffle,
                               shuffle_block=a.shuffle_block)
        return node_schedule(order, world_size=world, local_world_size=local, node=node,
                             batch_size=a.batch_size)

    t0 = time.perf_counter()
    before = cache.counters()
    after = Stager(cache, schedule, options).stage(epochs)
    dt = time.perf_counter() - t0
    c = {k: v - before.get(k, 0) for k, v in after.items()}
    present = sum(cache.lookup(i, wait=0) is not None
                  for i in set().union(*(schedule(e).shards.tolist() for e in epochs)))
    print(f"node {node}: copied {c['shards_staged']} shard(s), {_human(c['bytes_staged'])} in "
          f"{dt:.1f}s; {present} shard(s) of epochs {epochs.start}..{epochs.stop - 1} now in "
          f"{cache.data_dir}; {c.get('verify_failures', 0)} verify failure(s)")
    return 1 if c.get("verify_failures") else 0


def _env_int(*names: str) -> int | None:
    """The first of the environment variables ``names`` that holds an integer."""
    for name in names:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return None


def _cmd_bench(a: argparse.Namespace) -> int:
    if a.bench_command == "loader":
        from .loaderbench import run_cli as run_loader

        return run_loader(a)
    from .storagebench import run_cli

    return run_cli(a)


def _cmd_inspect(a: argparse.Namespace) -> int:
    from .summary import describe, format_description

    d = describe(a.dataset)
    if a.no_shards:
        d.pop("shard_list")
    print(json.dumps(d, indent=1) if a.json else format_description(d, not a.no_shards))
    return 0


def _cmd_index(a: argparse.Namespace) -> int:
    from .indexer import index_tars

    m = index_tars(a.tars, root=a.root, checksum=a.checksum, workers=max(1, a.workers),
                   overwrite=a.overwrite)
    print(f"indexed {len(m.shards)} tar(s), {m.num_samples} samples; fields: "
          + ", ".join(sorted(m.fields)))
    return 0


_COMMANDS = {"pack": _cmd_pack, "merge": _cmd_merge, "verify": _cmd_verify, "inspect": _cmd_inspect,
             "index": _cmd_index, "repair": _cmd_repair, "stage": _cmd_stage, "bench": _cmd_bench}


@contextlib.contextmanager
def _sticky_interrupt() -> Iterator[list[bool]]:
    """Ctrl-C raises KeyboardInterrupt as usual, and is also remembered: one that lands in a
    weakref callback or a ``__del__`` is printed as "Exception ignored" and swallowed by
    Python, and a pack then went on to exit 0 as if never interrupted.  The command still
    ends as interrupted (exit 130).  Only where SIGINT has Python's default handler."""
    hit: list[bool] = []
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):
        yield hit
        return

    def handler(signum: int, frame: Any) -> None:
        hit.append(True)
        raise KeyboardInterrupt

    hook = sys.unraisablehook

    def quiet(unraisable: Any) -> None:  # (the swallowed one is not an error to print)
        if not (hit and isinstance(unraisable.exc_value, KeyboardInterrupt)):
            hook(unraisable)

    signal.signal(signal.SIGINT, handler)
    sys.unraisablehook = quiet
    try:
        yield hit
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.unraisablehook = hook


_RESUMABLE = frozenset({"pack", "merge", "stage"})


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (tests call ``main([...])``)."""
    from .errors import ShardioError, UsageError

    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser(with_bench="bench" in argv).parse_args(argv)
    try:
        with _sticky_interrupt() as interrupted:
            rc = _COMMANDS[args.command](args)
        if interrupted and rc != 130:  # (a command that reports its own interruption: 130)
            raise KeyboardInterrupt
        return rc
    except UsageError as exc:
        print(f"shardio {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ShardioError as exc:
        print(f"shardio {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Only these pick up where an interrupted run stopped; the others start over.
        resume = "; rerun the same command to resume" if args.command in _RESUMABLE else ""
        print(f"shardio {args.command}: interrupted{resume}", file=sys.stderr)
        return 130
