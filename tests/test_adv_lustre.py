"""Adversarial checks of shardio.lustre against behaviours of real Lustre that the basic fake in
tests/fake_lfs.py does not model (a directory default pool, FLR mirrors, ...)."""

from __future__ import annotations

import os
import shutil
import struct
import sys
from pathlib import Path

import pytest

import shardio
import shardio.lustre
from shardio import PackOptions, pack
from shardio.lustre import (
    MAX_READ_BLOCK,
    LayoutRequest,
    create_striped,
    parse_getstripe,
    parse_lov,
    read_block_size,
)
from shardio.repair import repair_dataset
from tests.fake_lfs import (
    EXT4_MAGIC,
    LCME_FL_INIT,
    LL_SUPER_MAGIC,
    LOV_MAGIC_V1,
    LOV_MAGIC_V3,
    LUSTRE_EOF,
    MDT_SEQ,
    FakeProbe,
    pack_comp,
    pack_lmm,
)

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


# --- FLR mirrors -------------------------------------------------------------------------------

LCME_FL_STALE, LCME_FL_PREF_RD = 0x1, 0x2
OI = (0x2A, MDT_SEQ)


def _flr(m1_flags: int, m2_flags: int) -> bytes:
    """Two mirrors of [0, EOF): mirror 1 one stripe of 1 MiB on OST 3, mirror 2 two stripes of
    4 MiB on OSTs 6, 7 (lcme_id = mirror id << 16 | component number)."""
    return pack_comp([
        (0x10001, LCME_FL_INIT | m1_flags, 0, LUSTRE_EOF,
         pack_lmm(LOV_MAGIC_V1, MiB, 1, oi=OI, offset=0, osts=[3])),
        (0x20002, LCME_FL_INIT | m2_flags, 0, LUSTRE_EOF,
         pack_lmm(LOV_MAGIC_V1, 4 * MiB, 2, oi=OI, offset=0, osts=[6, 7])),
    ], mirror_count=1)


@pytest.mark.parametrize("m1,m2,ost,size", [
    (0, 0, 3, MiB),                             # no preference: the first mirror
    (LCME_FL_STALE, 0, 6, 4 * MiB),             # a stale mirror is not read
    (0, LCME_FL_PREF_RD, 6, 4 * MiB),           # the preferred mirror is read
    (LCME_FL_PREF_RD | LCME_FL_STALE, 0, 6, 4 * MiB),  # ... unless it is stale
])
def test_flr_first_ost_and_stripe_come_from_the_mirror_that_is_read(
        m1: int, m2: int, ost: int, size: int) -> None:
    """Mirrors cover the same extent; clients read a non-stale mirror, the one flagged
    ``prefer`` if any.  first_ost (how the reader spreads read-ahead over OSTs) and the stripe
    size (its read block) named the first mirror in the blob even when it was stale or another
    was preferred."""
    layout = parse_lov(_flr(m1, m2))
    assert layout.first_ost == ost and layout.stripe_size == size
    assert set(layout.osts) == {3, 6, 7}  # every object still listed


FLR_YAML = """\
  lcm_layout_gen:    4
  lcm_mirror_count:  2
  lcm_entry_count:   2
  component0:
    lcme_id:             65537
    lcme_mirror_id:      1
    lcme_flags:          init,stale
    lcme_extent.e_start: 0
    lcme_extent.e_end:   EOF
    sub_layout:
      lmm_stripe_count:  1
      lmm_stripe_size:   1048576
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 3
      lmm_objects:
      - l_ost_idx: 3
        l_fid:     0x100030000:0x2:0x0

  component1:
    lcme_id:             131074
    lcme_mirror_id:      2
    lcme_flags:          init
    lcme_extent.e_start: 0
    lcme_extent.e_end:   EOF
    sub_layout:
      lmm_stripe_count:  2
      lmm_stripe_size:   4194304
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 6
      lmm_objects:
      - l_ost_idx: 6
        l_fid:     0x100060000:0x2:0x0
      - l_ost_idx: 7
        l_fid:     0x100070000:0x2:0x0
"""


def test_flr_from_lfs_getstripe_yaml() -> None:
    layout = parse_getstripe(FLR_YAML)
    assert layout is not None and [c.mirror for c in layout.components] == [1, 2]
    assert layout.first_ost == 6 and layout.stripe_size == 4 * MiB


@pytest.mark.parametrize("stripe", [0xFFFFFFFF, (2 << 30) + 4096, 64 * MiB + 1])
def test_a_stripe_size_lustre_cannot_have_still_gives_a_bounded_read(stripe: int) -> None:
    """A stripe size that is not a multiple of 64 KiB (a damaged xattr, odd `lfs` output) and
    above the read maximum was returned as the read block whole: up to 4 GiB per coalesced
    read and per worker buffer."""
    layout = parse_lov(pack_lmm(LOV_MAGIC_V1, stripe, 1, oi=OI, offset=0, osts=[0]))
    assert layout.stripe_size == stripe
    assert read_block_size(layout) <= MAX_READ_BLOCK
    assert read_block_size(layout, maximum=8 * MiB) <= 8 * MiB


def test_repair_of_a_shard_in_a_pool_no_request_can_name(image_tree: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Lustre does not restrict pool names to ASCII; a shard in pool "café" read back with a
    pool LayoutRequest refuses, and repair crashed with UsageError ("pass --stripe-pool NAME")
    instead of restoring the shard with the directory's default layout."""
    out = tmp_path / "lustre" / "ds"
    pack(image_tree, out, PackOptions(samples_per_shard=20, fsync=False))
    probe = _probe(tmp_path / "lustre")
    monkeypatch.setattr(shardio.lustre, "FsProbe", lambda: probe)
    blob = pack_lmm(LOV_MAGIC_V3, MiB, 1, oi=OI, offset=0, osts=[2])
    blob = blob[:32] + "café".encode().ljust(16, b"\0") + blob[48:]
    for p in out.iterdir():
        probe.xattrs[os.path.realpath(p)] = {"lustre.lov": blob}
    assert shardio.lustre.get_layout(str(out / "shard-000000.tar")).pool == "caf\ufffd\ufffd"
    replica = tmp_path / "replica"
    shutil.copytree(out, replica)
    with open(out / "shard-000000.tar", "r+b") as f:
        f.seek(700)
        f.write(b"\xff")
    report = repair_dataset(str(out), replicas=[str(replica)])
    assert [p for p, _src in report.repaired] == ["shard-000000.tar"]
    assert shardio.verify_dataset(str(out)) == []


def test_lfs_output_that_is_not_utf8_is_parsed(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """`lfs getstripe -y` prints a pool name as its raw bytes; one that is not UTF-8 (a Latin-1
    name) made FsProbe.lfs raise UnicodeDecodeError out of get_layout, which readers do not
    catch (they expect ShardIOError or LayoutError)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "lfs"
    text = (b"lmm_stripe_count:  1\nlmm_stripe_size:   1048576\nlmm_pattern:       raid0\n"
            b"lmm_layout_gen:    0\nlmm_stripe_offset: 3\nlmm_pool:          caf\xe9\n"
            b"lmm_objects:\n      - l_ost_idx: 3\n        l_fid:     0x100030000:0x2:0x0\n")
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.stdout.buffer.write({text!r})\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    root = tmp_path / "lustre"
    root.mkdir()
    (root / "f").write_bytes(b"")
    probe = _probe(root, default_layout=False)
    layout = shardio.lustre.get_layout(str(root / "f"), probe)
    assert layout is not None and layout.first_ost == 3 and layout.stripe_size == MiB
    assert layout.pool is not None and layout.pool.startswith("caf")
