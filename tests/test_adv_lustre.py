"""Adversarial checks of shardio.lustre against behaviours of real Lustre that the basic fake in
tests/fake_lfs.py does not model (a directory default pool, FLR mirrors, ...)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

import shardio.lustre
from shardio import PackOptions, pack
from shardio.lustre import LayoutRequest, create_striped, parse_lov
from tests.fake_lfs import EXT4_MAGIC, LL_SUPER_MAGIC, LOV_MAGIC_V3, FakeProbe

MiB = 1 << 20


class DirPoolProbe(FakeProbe):
    """A Lustre whose directory default layout names an OST pool: a plain layout set without a
    pool inherits the parent's pool (lfs-setstripe(1): "If no pool is specified, it will be
    inherited from ... the parent or root directory (for plain raid0 layouts ...)")."""

    dir_pool = "flash"

    def fsetxattr(self, fd: int, name: str, value: bytes) -> None:
        magic = struct.unpack_from("<I", value)[0]
        if name == "lustre.lov" and magic != LOV_MAGIC_V3:
            head = value[:32]
            value = struct.pack("<I", LOV_MAGIC_V3) + head[4:] + self.dir_pool.encode().ljust(16,
                                                                                          b"\0")
        super().fsetxattr(fd, name, value)


def _probe(root: Path, cls: type[FakeProbe] = FakeProbe, **kw: object) -> FakeProbe:
    return cls({"/": EXT4_MAGIC, os.path.realpath(root): LL_SUPER_MAGIC}, "", **kw)  # type: ignore


def test_a_pool_inherited_from_the_directory_is_not_a_refused_layout(tmp_path: Path) -> None:
    """A request without a pool, in a directory whose default layout has one: Lustre applies
    the stripe count and size and keeps the directory's pool.  That was reported as
    LayoutNotAppliedError ("asked for 2 stripes of 4 MiB, Lustre kept 2 stripes of 4 MiB in
    pool 'flash'"), so every default `shardio pack` into such a directory failed."""
    probe = _probe(tmp_path, DirPoolProbe)
    path = tmp_path / "shard-000.tar"
    fd, report = create_striped(str(path), LayoutRequest(stripe_count=2, stripe_size=4 * MiB),
                                probe)
    os.close(fd)
    assert report.applied and report.layout is not None
    assert (report.layout.stripe_count, report.layout.stripe_size, report.layout.pool) == (
        2, 4 * MiB, "flash")
    assert path.exists()


def test_pack_into_a_directory_with_a_default_pool(image_tree: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "lustre"
    out = root / "ds"
    out.mkdir(parents=True)
    probe = _probe(root, DirPoolProbe, n_osts=8)
    monkeypatch.setattr(shardio.lustre, "FsProbe", lambda: probe)
    m = pack(image_tree, out, PackOptions(samples_per_shard=20, fsync=False))
    assert len(m.shards) == 3
    layouts = [parse_lov(x["lustre.lov"]) for x in probe.xattrs.values() if "lustre.lov" in x]
    assert len(layouts) == 3  # (the fake keeps xattrs by the temp name the shard was made as)
    assert all(lay.pool == "flash" and lay.stripe_count == 1 for lay in layouts)
    assert shardio.verify_dataset(str(out)) == []
