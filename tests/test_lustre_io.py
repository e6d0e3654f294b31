"""Lustre in the data path, through the fake probe of tests/fake_lfs.py: ``shardio pack`` creates
each shard with the requested layout (and refuses to publish when Lustre ignores it), readers
size their reads from the stripe size and spread read-ahead over OSTs."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

import shardio
import shardio.lustre
from shardio import Manifest, PackOptions, pack
from shardio.errors import LayoutNotAppliedError, UsageError
from shardio.lustre import parse_lov
from shardio.reader import DatasetReader
from shardio.repair import repair_dataset
from tests.fake_lfs import EXT4_MAGIC, LL_SUPER_MAGIC, LOV_MAGIC_V1, FakeProbe, pack_lmm


def fake_lustre(monkeypatch: pytest.MonkeyPatch, root: Path, cls: type = FakeProbe) -> FakeProbe:
    """Make ``root`` look like a Lustre mount to every probe shardio creates."""
    probe = cls({"/": EXT4_MAGIC, os.path.realpath(root): LL_SUPER_MAGIC}, "", n_osts=8)
    monkeypatch.setattr(shardio.lustre, "FsProbe", lambda: probe)
    return probe


def test_pack_sets_and_confirms_the_layout_on_lustre(image_tree: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "lustre" / "ds"
    out.mkdir(parents=True)
    probe = fake_lustre(monkeypatch, tmp_path / "lustre")
    m = pack(image_tree, out, PackOptions(samples_per_shard=20, stripe_count=2,
                                          stripe_size="1MiB", fsync=False))
    assert m.stats["layout"].startswith("Lustre: each shard created with 2 stripe(s) of 1024 KiB")
    assert probe.calls.count("open_delay_create") == len(m.shards) == 3
    layouts = [parse_lov(x["lustre.lov"]) for x in probe.xattrs.values() if "lustre.lov" in x]
    assert len(layouts) == 3
    assert all(lay.stripe_count == 2 and lay.stripe_size == 1 << 20 for lay in layouts)
    assert shardio.verify_dataset(str(out)) == []


class _NoDelay(FakeProbe):
    """A client that forgets O_LOV_DELAY_CREATE: objects exist before the layout is set."""

    def open_delay_create(self, path: str, mode: int = 0o644) -> int:
        self.calls.append("open (no delay)")
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)


def test_layout_ignored_by_lustre_publishes_nothing(image_tree: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "lustre" / "ds"
    out.mkdir(parents=True)
    fake_lustre(monkeypatch, tmp_path / "lustre", _NoDelay)
    with pytest.raises(LayoutNotAppliedError, match="stripe"):
        pack(image_tree, out, PackOptions(samples_per_shard=20, stripe_count=4, fsync=False))
    left = sorted(p.name for p in out.iterdir())
    assert not any(n.endswith((".tar", ".idx")) or ".shardio-tmp" in n for n in left), left
    assert "manifest.json" not in left


def test_pack_off_lustre_reports_the_layout_ignored(image_tree: Path, tmp_path: Path, cli) -> None:
    rc, out, err = cli("pack", image_tree, tmp_path / "ds", "--samples-per-shard", "30",
                       "--stripe-count", "4", "--no-fsync")
    assert rc == 0, err
    assert "not Lustre: layout (4 stripe(s) of 4096 KiB) not set" in out


def test_layout_options_are_validated() -> None:
    """Every value Lustre would refuse is refused at once, on any filesystem (a stripe count
    of 5000, a stripe size of 8 GiB, a pool name too long were taken off Lustre, and on
    Lustre refused only after the source scan)."""
    with pytest.raises(UsageError, match="64 KiB"):
        PackOptions(stripe_size="100KB")
    for kwargs, match in (({"stripe_count": 0}, "stripe count"),
                          ({"stripe_count": 5000}, "stripe count 5000 must be 1..2000"),
                          ({"stripe_size": "8GiB"}, "below 4 GiB"),
                          ({"stripe_pool": "a pool name too long"}, "OST pool name")):
        with pytest.raises(UsageError, match=match):
            PackOptions(**kwargs)
    PackOptions(stripe_count=-1, stripe_size="1MiB", stripe_pool="flash")


def striped_dataset(image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                    stripe: int, ost_of: Callable[[int], int]) -> tuple[Path, Manifest]:
    """A dataset packed under a faked Lustre mount, shard ``i`` one stripe of ``stripe`` bytes
    on OST ``ost_of(i)``."""
    root = tmp_path / "lustre" / "ds"
    pack(image_tree, root, PackOptions(samples_per_shard=6, fsync=False))
    probe = fake_lustre(monkeypatch, tmp_path / "lustre")
    m = Manifest.load(root)
    for i, entry in enumerate(m.shards):
        probe.xattrs[os.path.realpath(root / entry.path)] = {"lustre.lov": pack_lmm(
            LOV_MAGIC_V1, stripe, 1, oi=(i + 1, 1), offset=0, osts=[ost_of(i)])}
    return root, m


def test_reader_uses_stripe_multiples_and_spreads_over_osts(
        image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Shards 0-9: OSTs 0,0,0,1,1,1,2,2,2,3 (stripe 3 MiB -> reads in 6 MiB, >= 4 MiB minimum).
    root, m = striped_dataset(image_tree, tmp_path, monkeypatch, 3 << 20, lambda i: i // 3)
    r = DatasetReader(root)
    assert r.on_lustre
    assert r.read_block % (3 << 20) == 0 and r.read_block >= 4 << 20
    assert [r.ost_of(i) for i in range(4)] == [0, 0, 0, 1]
    r.willneed(range(len(m.shards)), limit=3)
    assert sorted(r.ost_of(i) for i in r._advised) == [0, 1, 2]  # three shards, three OSTs
    assert len(list(r)) == m.num_samples


def test_reader_bounds_its_reads_on_huge_stripes(
        image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 2 GiB stripe made every coalesced read (and each worker's read buffer) 2 GiB."""
    root, m = striped_dataset(image_tree, tmp_path, monkeypatch, 2 << 30, lambda i: 0)
    with DatasetReader(root) as r:
        assert r.on_lustre
        assert r.read_block == 64 << 20  # a divisor of the stripe: reads never cross one
        assert len(list(r)) == m.num_samples


@pytest.mark.parametrize("stripe,asked,want", [
    (96 << 20, 100 << 20, 96 << 20),   # asked more than the bound: the stripe, not 144 MiB
    (96 << 20, 8 << 20, 48 << 20),     # the default: a divisor of the stripe
    (3 << 20, 8 << 20, 9 << 20),       # the smallest stripe multiple at least what was asked
    (256 << 20, 128 << 20, 128 << 20),  # a divisor, as large as asked
])
def test_reader_read_block_divides_or_multiplies_the_stripe(
        image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stripe: int,
        asked: int, want: int) -> None:
    """read_block was rounded up to a multiple of the stripe's divisor, which for stripes over
    64 MiB need not divide the stripe (reads across its boundaries) and could pass the bound."""
    root, _m = striped_dataset(image_tree, tmp_path, monkeypatch, stripe, lambda i: 0)
    with DatasetReader(root, read_block=asked) as r:
        assert r.on_lustre and r.read_block == want
        assert stripe % r.read_block == 0 or r.read_block % stripe == 0


def test_a_missing_shard_is_not_blamed_on_another_during_the_lustre_probe(
        image_tree: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stripe size is probed on the first shard that answers and OST spreading treats an
    unreadable layout as unknown: shard 0 missing once made reading intact shard 5 fail (or
    count a fault of shard 5 and fail over), and made willneed() raise."""
    root, replica = tmp_path / "lustre" / "ds", tmp_path / "replica"
    pack(image_tree, root, PackOptions(samples_per_shard=6, fsync=False))
    shutil.copytree(root, replica)
    fake_lustre(monkeypatch, tmp_path / "lustre")
    m = Manifest.load(root)
    (root / m.shards[0].path).unlink()
    first5 = sum(s.samples for s in m.shards[:5])
    with DatasetReader(root) as r:
        assert r[first5]["__key__"]  # no replica: a fault here would have raised
        assert r.read_block % (1 << 20) == 0
    with DatasetReader(root, replicas=[str(replica)]) as r:
        r[first5]
        r.willneed([1, 0, 2], limit=3)
        c = r.counters.snapshot()
        assert c["io_error"] == c["missing"] == c["failovers"] == 0
        assert r[0] == DatasetReader(replica)[0]  # the real read handles the missing shard
        assert r.counters.get("missing") == 1


def test_repair_keeps_the_layout_pack_gave_the_shard(image_tree: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`shardio repair` republished a shard through a plain copy: on Lustre the repaired shard
    silently lost the layout `pack --stripe-count` had given it (4 stripes became the
    directory's 1).  It is now created with the layout of the shard it replaces."""
    out = tmp_path / "lustre" / "ds"
    out.mkdir(parents=True)
    probe = fake_lustre(monkeypatch, tmp_path / "lustre")
    for name in ("replace", "rename"):  # the fake keeps xattrs by path: move them as Lustre does
        real = getattr(os, name)

        def moved(src, dst, *a, _real=real, **kw):  # type: ignore[no-untyped-def]
            _real(src, dst, *a, **kw)
            held = probe.xattrs.pop(os.path.realpath(src), None)
            probe.xattrs.pop(os.path.realpath(dst), None)
            if held is not None:
                probe.xattrs[os.path.realpath(dst)] = held

        monkeypatch.setattr(os, name, moved)
    pack(image_tree, out, PackOptions(samples_per_shard=20, stripe_count=4, stripe_size="1MiB",
                                      fsync=False))
    shard = str(out / "shard-000000.tar")
    assert shardio.lustre.get_layout(shard).stripe_count == 4
    replica = tmp_path / "replica"
    shutil.copytree(out, replica)
    with open(shard, "r+b") as f:
        f.seek(700)
        f.write(b"\xff")
    report = repair_dataset(str(out), replicas=[str(replica)])
    assert [p for p, _src in report.repaired] == ["shard-000000.tar"]
    layout = shardio.lustre.get_layout(shard)
    assert (layout.stripe_count, layout.stripe_size) == (4, 1 << 20)
    assert shardio.verify_dataset(str(out)) == []
