"""shardio.lustre: layout blobs against the C structs, filesystem detection, the delayed-create
protocol on a fake Lustre (tests/fake_lfs.py), ``lfs getstripe`` parsing, read sizes, OST spread.

Set SHARDIO_LUSTRE_DIR to a writable directory on Lustre to also run against a real one.
"""

from __future__ import annotations

import itertools
import errno
import os
import struct
import sys
import uuid
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardio.errors import LayoutError, LayoutNotAppliedError, UsageError
from shardio.lustre import (
    FsProbe,
    Layout,
    LayoutRequest,
    align_down,
    aligned_span,
    build_lov,
    create_striped,
    detect_fs,
    get_layout,
    parse_getstripe,
    parse_lov,
    MAX_READ_BLOCK,
    read_block_size,
    spread_by_ost,
)
from tests.fake_lfs import (
    BEEGFS_MAGIC,
    EXT4_MAGIC,
    FUSE_MAGIC,
    GPFS_MAGIC,
    LCME_FL_INIT,
    LL_SUPER_MAGIC,
    LOV_MAGIC_V1,
    LOV_MAGIC_V3,
    LOV_PATTERN_F_RELEASED,
    LOV_PATTERN_MDT,
    LUSTRE_EOF,
    MDT_SEQ,
    NFS_MAGIC,
    TMPFS_MAGIC,
    FakeProbe,
    mountinfo_line,
    pack_comp,
    pack_lmm,
)

MiB, GiB = 1 << 20, 1 << 30
OI = (0x2A, MDT_SEQ)  # an instantiated file names its MDT object


def v1_four() -> bytes:
    return pack_lmm(LOV_MAGIC_V1, MiB, 4, oi=OI, offset=0, osts=[3, 7, 1, 0])


def v3_flash() -> bytes:
    return pack_lmm(LOV_MAGIC_V3, 4 * MiB, 2, oi=OI, offset=0, pool="flash", osts=[5, 6])


def pfl(e: str = "<") -> bytes:
    return pack_comp([
        (1, LCME_FL_INIT, 0, MiB, pack_lmm(LOV_MAGIC_V1, MiB, 1, oi=OI, offset=0, osts=[5], e=e)),
        (2, LCME_FL_INIT, MiB, GiB,
         pack_lmm(LOV_MAGIC_V1, 4 * MiB, 4, oi=OI, offset=0, osts=[6, 7, 0, 1], e=e)),
        (3, 0, GiB, LUSTRE_EOF, pack_lmm(LOV_MAGIC_V1, 16 * MiB, -1, oi=OI, e=e)),
    ], e=e)


def dom_composite() -> bytes:
    return pack_comp([
        (1, LCME_FL_INIT, 0, 64 << 10,
         pack_lmm(LOV_MAGIC_V1, 64 << 10, 0, pattern=LOV_PATTERN_MDT, oi=OI, offset=0)),
        (2, LCME_FL_INIT, 64 << 10, LUSTRE_EOF,
         pack_lmm(LOV_MAGIC_V3, MiB, 2, oi=OI, offset=0, pool="flash", osts=[2, 3])),
    ])


# --- parse_lov ---------------------------------------------------------------------------------


def test_v1_with_four_objects() -> None:
    layout = parse_lov(v1_four())
    assert not layout.composite and len(layout.components) == 1
    comp = layout.components[0]
    assert (comp.start, comp.end, comp.dom, comp.instantiated) == (0, LUSTRE_EOF, False, True)
    assert comp.stripe.osts == (3, 7, 1, 0) and comp.stripe.stripe_offset == 3
    assert (layout.stripe_size, layout.stripe_count, layout.pool) == (MiB, 4, None)
    assert layout.osts == (3, 7, 1, 0) and layout.first_ost == 3 and layout.dom_size == 0


def test_v3_with_pool() -> None:
    layout = parse_lov(v3_flash())
    assert layout.pool == "flash" and layout.osts == (5, 6) and layout.stripe_size == 4 * MiB


def test_pfl_composite_with_uninstantiated_tail() -> None:
    layout = parse_lov(pfl())
    assert layout.composite
    extents = [(c.start, c.end, c.id, c.instantiated) for c in layout.components]
    assert extents == [(0, MiB, 1, True), (MiB, GiB, 2, True), (GiB, LUSTRE_EOF, 3, False)]
    tail = layout.components[2].stripe
    assert (tail.stripe_count, tail.stripe_offset, tail.osts) == (-1, -1, ())
    # The summary describes the last instantiated component: where a large shard's bytes live.
    assert layout.main is layout.components[1]
    assert (layout.stripe_count, layout.stripe_size) == (4, 4 * MiB)
    assert layout.osts == (5, 6, 7, 0, 1) and layout.first_ost == 5
    assert layout.component_at(0) is layout.components[0]
    assert layout.component_at(MiB) is layout.components[1]
    assert layout.component_at(5 * GiB) is layout.components[2]


def test_dom_plus_ost_components() -> None:
    layout = parse_lov(dom_composite())
    dom, data = layout.components
    assert dom.dom and dom.stripe.osts == () and dom.stripe.stripe_count == 0
    assert not data.dom and data.stripe.pool == "flash"
    assert layout.dom_size == 64 << 10 and layout.osts == (2, 3) and layout.first_ost == 2
    assert (layout.stripe_count, layout.stripe_size, layout.pool) == (2, MiB, "flash")


def test_byte_swapped_blobs_parse_like_native_ones() -> None:
    be_v1 = pack_lmm(LOV_MAGIC_V1, MiB, 4, oi=OI, offset=0, osts=[3, 7, 1, 0], e=">")
    assert struct.unpack_from("<I", be_v1)[0] == 0xD00BD10B
    assert parse_lov(be_v1) == parse_lov(v1_four())
    assert parse_lov(pfl(">")) == parse_lov(pfl())


def test_uninstantiated_and_released_layouts() -> None:
    template = pack_lmm(LOV_MAGIC_V1, 4 * MiB, -1)  # what a client sets: no objects, any OST
    stripe = parse_lov(template).components[0].stripe
    assert (stripe.stripe_count, stripe.stripe_offset, stripe.osts) == (-1, -1, ())
    released = pack_lmm(LOV_MAGIC_V1, MiB, 2, oi=OI, offset=0,
                        pattern=0x1 | LOV_PATTERN_F_RELEASED)
    layout = parse_lov(released)
    assert layout.osts == () and layout.first_ost is None and layout.stripe_count == 2
    assert not layout.components[0].instantiated


@pytest.mark.parametrize("blob", [v1_four(), v3_flash(), pfl(), dom_composite(), pfl(">")],
                         ids=["v1", "v3", "pfl", "dom", "pfl-swapped"])
def test_every_prefix_raises_layout_error(blob: bytes) -> None:
    for n in range(len(blob)):
        with pytest.raises(LayoutError):
            parse_lov(blob[:n])


def test_truncation_message_says_how_many_bytes() -> None:
    blob = v1_four()[:32 + 2 * 24]
    with pytest.raises(LayoutError, match=r"stripe_count 4 needs 128 bytes .* only 80"):
        parse_lov(blob)
    with pytest.raises(LayoutError, match="too short"):
        parse_lov(b"\xd0\x0b")


def test_unknown_and_foreign_magic() -> None:
    with pytest.raises(LayoutError, match=r"unknown layout magic 0x0bd90bd0"):
        parse_lov(struct.pack("<I", 0x0BD90BD0) + bytes(28))
    with pytest.raises(LayoutError, match="foreign"):
        parse_lov(struct.pack("<I", 0x0BD70BD0) + bytes(60))


def test_component_offsets_out_of_range() -> None:
    blob = bytearray(pfl())
    struct.pack_into("<I", blob, 32 + 48 + 24, len(blob) - 8)  # entry 1's lcme_offset
    with pytest.raises(LayoutError, match="outside"):
        parse_lov(bytes(blob))
    blob = bytearray(pfl())
    struct.pack_into("<I", blob, 4, len(blob) + 100)  # lcm_size past the end
    with pytest.raises(LayoutError, match="truncated"):
        parse_lov(bytes(blob))
    blob = bytearray(pfl())
    struct.pack_into("<I", blob, 32 + 24, 8)  # entry 0 points into the header
    with pytest.raises(LayoutError, match="outside"):
        parse_lov(bytes(blob))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400), st.sampled_from([b"", v1_four(), v3_flash(), pfl()]),
       st.integers(0, 400))
def test_garbage_raises_only_layout_error(noise: bytes, base: bytes, at: int) -> None:
    blob = base[:at] + noise + base[at + len(noise):] if base else noise
    try:
        layout = parse_lov(blob)
    except LayoutError:
        return
    assert isinstance(layout, Layout)


# --- build_lov ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("size", "count", "pool", "offset"), [
    (4 * MiB, 1, None, -1), (MiB, 8, "flash", 3), (64 << 10, -1, None, -1),
    (4 * GiB - (64 << 10), 2000, "p" * 15, 65534)])
def test_build_lov_matches_the_c_struct_and_round_trips(size: int, count: int, pool: str | None,
                                                        offset: int) -> None:
    blob = build_lov(size, count, pool, offset)
    magic = LOV_MAGIC_V1 if pool is None else LOV_MAGIC_V3
    assert blob == pack_lmm(magic, size, count, offset=offset, pool=pool)
    stripe = parse_lov(blob).components[0].stripe
    assert (stripe.stripe_size, stripe.stripe_count, stripe.pool, stripe.stripe_offset,
            stripe.pattern, stripe.osts) == (size, count, pool, offset, 1, ())


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"stripe_size": 0}, "--stripe-size"), ({"stripe_size": 100_000}, "64 KiB"),
    ({"stripe_size": 4 * GiB}, "below 4 GiB"), ({"stripe_size": -MiB}, "positive"),
    ({"stripe_count": 0}, "--stripe-count"), ({"stripe_count": -2}, "-1 for all"),
    ({"stripe_count": 2001}, "1..2000"), ({"pool": ""}, "--stripe-pool"),
    ({"pool": "x" * 16}, "1-15"), ({"pool": "fl\u00e2sh"}, "ASCII"), ({"pool": "a b"}, "spaces"),
    ({"stripe_offset": -2}, "OST index"), ({"stripe_offset": 65535}, "OST index")])
def test_build_lov_validation(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {"stripe_size": MiB, "stripe_count": 1, **kwargs}
    with pytest.raises(UsageError, match=match):
        build_lov(**args)  # type: ignore[arg-type]
    if "stripe_offset" not in kwargs:
        with pytest.raises(UsageError, match=match):
            LayoutRequest(stripe_size=args["stripe_size"],  # type: ignore[arg-type]
                          stripe_count=args["stripe_count"],  # type: ignore[arg-type]
                          pool=kwargs.get("pool"))  # type: ignore[arg-type]


# --- detect_fs ---------------------------------------------------------------------------------

MOUNTS = "".join([
    mountinfo_line(20, "/", "ext4", "/dev/nvme0n1p2"),
    mountinfo_line(21, "/dev/shm", "tmpfs", "tmpfs"),
    mountinfo_line(22, "/lustre/scratch", "lustre", "10.0.0.1@o2ib:10.0.0.2@o2ib:/scratch"),
    mountinfo_line(23, "/gpfs/work", "gpfs", "work"),
    mountinfo_line(24, "/mnt/beegfs", "beegfs", "beegfs_nodev"),
    mountinfo_line(25, "/home", "nfs4", "nas01:/export/home"),
    mountinfo_line(26, "/lustre/my project", "lustre", "mgs@tcp:/proj"),
])

CASES = [("/lustre/scratch/u/new.tar", LL_SUPER_MAGIC, "lustre", "/lustre/scratch", True),
         ("/gpfs/work/a", GPFS_MAGIC, "gpfs", "/gpfs/work", True),
         ("/mnt/beegfs/a/b", BEEGFS_MAGIC, "beegfs", "/mnt/beegfs", True),
         ("/home/me", NFS_MAGIC, "nfs", "/home", True),
         ("/var/tmp/x", EXT4_MAGIC, "local", "/", False),
         ("/dev/shm/ring", TMPFS_MAGIC, "tmpfs", "/dev/shm", False)]


@pytest.mark.parametrize(("path", "magic", "kind", "mount", "shared"), CASES)
def test_detect_fs_from_statfs(path: str, magic: int, kind: str, mount: str,
                               shared: bool) -> None:
    prefix = mount if mount != "/" else "/var"
    info = detect_fs(path, FakeProbe({prefix: magic}, MOUNTS))
    assert (info.kind, info.mount_point, info.shared) == (kind, mount, shared)
    # statfs alone decides the kind even when mountinfo is unreadable.
    assert detect_fs(path, FakeProbe({prefix: magic}, "")).kind == kind


@pytest.mark.parametrize(("path", "magic", "kind", "mount", "shared"), CASES)
@pytest.mark.parametrize("statfs", ["fails", "fuse"])
def test_detect_fs_from_mountinfo_only(path: str, magic: int, kind: str, mount: str,
                                       shared: bool, statfs: str) -> None:
    probe = FakeProbe({} if statfs == "fails" else {"/": FUSE_MAGIC}, MOUNTS)
    info = detect_fs(path, probe)
    assert (info.kind, info.mount_point, info.shared) == (kind, mount, shared)


def test_detect_fs_decodes_escaped_mount_points_and_matches_whole_components() -> None:
    probe = FakeProbe({}, MOUNTS)
    info = detect_fs("/lustre/my project/run1/shard-0.tar", probe)
    assert (info.kind, info.mount_point, info.source) == ("lustre", "/lustre/my project",
                                                          "mgs@tcp:/proj")
    # /lustre/scratchy is not under /lustre/scratch: it falls back to the root mount.
    assert detect_fs("/lustre/scratchy/x", probe).mount_point == "/"
    assert detect_fs("/lustre/scratch", probe).kind == "lustre"


def test_detect_fs_on_this_machine(tmp_path: Path) -> None:
    info = detect_fs(str(tmp_path))
    assert info.shared is False
    assert info.kind in {"local", "tmpfs", "unknown"}
    # A path that does not exist yet is judged by its nearest existing parent.
    assert detect_fs(str(tmp_path / "not" / "yet" / "there.tar")) == info


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="statfs f_type is Linux only")
def test_real_statfs_reads_f_type(tmp_path: Path) -> None:
    probe = FsProbe()
    assert probe.statfs_type("/proc") == 0x9FA0  # PROC_SUPER_MAGIC: checks the struct offset
    assert isinstance(probe.statfs_type(str(tmp_path)), int)
    with pytest.raises(FileNotFoundError):
        probe.statfs_type(str(tmp_path / "missing"))
    assert "/proc" in probe.mountinfo()


# --- create_striped on the fake Lustre ---------------------------------------------------------


@pytest.fixture
def lustre_dir(tmp_path: Path) -> Path:
    d = tmp_path / "lustre"
    d.mkdir()
    return d


def lustre_probe(d: Path, cls: type[FakeProbe] = FakeProbe, **kwargs: object) -> FakeProbe:
    """A fake whose Lustre is the real directory ``d``; the rest of the machine is ext4."""
    real = os.path.realpath(d)
    mounts = MOUNTS + mountinfo_line(40, real, "lustre", "mgs@o2ib:/fs")
    return cls({"/": EXT4_MAGIC, real: LL_SUPER_MAGIC}, mounts, **kwargs)  # type: ignore[arg-type]


def test_create_striped_uses_delayed_create_then_set_then_read_back(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir)
    path = str(lustre_dir / "shard-000.tar")
    fd, report = create_striped(path, LayoutRequest(stripe_count=4, stripe_size=4 * MiB), probe)
    try:
        os.write(fd, b"payload")
    finally:
        os.close(fd)
    assert probe.calls == ["open_delay_create", "fsetxattr lustre.lov", "getxattr lustre.lov"]
    assert report.applied and report.fs.kind == "lustre" and report.layout is not None
    assert (report.layout.stripe_count, report.layout.stripe_size) == (4, 4 * MiB)
    assert len(set(report.layout.osts)) == 4 and "applied" in report.reason
    assert Path(path).read_bytes() == b"payload"
    assert get_layout(path, probe) == report.layout


def test_create_striped_with_pool_and_all_osts(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir)
    _, report = create_striped(str(lustre_dir / "a"), LayoutRequest(stripe_count=-1,
                                                                    pool="flash"), probe)
    assert report.layout is not None and report.layout.pool == "flash"
    assert sorted(report.layout.osts) == [4, 5, 6, 7]


class PlainOpenProbe(FakeProbe):
    """The wrong sequence: the file is created without O_LOV_DELAY_CREATE."""

    def open_delay_create(self, path: str, mode: int = 0o644) -> int:
        self.calls.append("open")
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)


def test_layout_set_after_create_is_caught_and_the_file_removed(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir, PlainOpenProbe)
    path = lustre_dir / "shard-001.tar"
    with pytest.raises(LayoutNotAppliedError, match=r"asked for 4 stripes of 4 MiB, Lustre kept "
                       r"1 stripe of 1 MiB.*--stripe-count") as info:
        create_striped(str(path), LayoutRequest(stripe_count=4), probe)
    assert "O_LOV_DELAY_CREATE" in str(info.value)
    assert not path.exists() and os.listdir(lustre_dir) == []


def test_fake_ignores_a_layout_set_after_bytes_were_written(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir)
    path = str(lustre_dir / "f")
    fd = probe.open_delay_create(path)
    os.write(fd, b"x")
    probe.fsetxattr(fd, "lustre.lov", build_lov(4 * MiB, 4))  # accepted, silently ignored
    os.close(fd)
    layout = get_layout(path, probe)
    assert layout is not None
    assert (layout.stripe_count, layout.stripe_size, layout.osts) == (1, MiB, (0,))


class NoLayoutProbe(FakeProbe):
    """A Lustre that accepts the set and then shows no layout at all."""

    def fsetxattr(self, fd: int, name: str, value: bytes) -> None:
        self.calls.append(f"fsetxattr {name}")


def test_no_layout_read_back_is_not_applied(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir, NoLayoutProbe, default_layout=False)
    with pytest.raises(LayoutNotAppliedError, match="no readable layout"):
        create_striped(str(lustre_dir / "x"), LayoutRequest(stripe_count=2), probe)
    assert os.listdir(lustre_dir) == []


def test_more_stripes_than_osts_is_not_applied(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir, n_osts=2)
    with pytest.raises(LayoutNotAppliedError, match="lfs df"):
        create_striped(str(lustre_dir / "x"), LayoutRequest(stripe_count=4), probe)
    assert os.listdir(lustre_dir) == []


def test_refused_layout_is_a_layout_error(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir)
    with pytest.raises(LayoutError, match="pool_list") as info:
        create_striped(str(lustre_dir / "x"), LayoutRequest(pool="nosuch"), probe)
    assert not isinstance(info.value, LayoutNotAppliedError)
    assert os.listdir(lustre_dir) == []


class FailingProbe(FakeProbe):
    """Setting the layout refused (EPERM), reading it back refused (EACCES), or a read-back
    blob cut short, as ``mode`` says."""

    mode = ""

    def fsetxattr(self, fd: int, name: str, value: bytes) -> None:
        if self.mode == "eperm":
            raise OSError(errno.EPERM, os.strerror(errno.EPERM))
        super().fsetxattr(fd, name, value)

    def getxattr(self, path: str, name: str) -> bytes | None:
        if name == "lustre.lov" and self.mode == "eacces":
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), path)
        if name == "lustre.lov" and self.mode == "short":
            return b"\xd0\x0b\xd1\x0b" + bytes(10)
        return super().getxattr(path, name)


@pytest.mark.parametrize("mode,says,not_says", [
    ("eperm", "Operation not permitted; check that the values suit", "pool exists"),
    ("eacces", "lfs getstripe", "check=False"),  # (no such option in the CLI)
    ("short", "the layout read back is malformed", None),
])
def test_layout_failures_name_the_file_and_a_fix_that_exists(
        lustre_dir: Path, mode: str, says: str, not_says: str | None) -> None:
    """Three messages that misled: a refused set without a pool said "check that the pool
    exists", a refused read-back advised check=False (not a CLI option), and a malformed
    read-back named no file."""
    probe = lustre_probe(lustre_dir, FailingProbe)
    probe.mode = mode
    path = lustre_dir / "shard-000000.tar"
    with pytest.raises(LayoutError) as info:
        create_striped(str(path), LayoutRequest(stripe_count=2), probe)
    text = str(info.value)
    assert says in text and str(path) in text
    assert not_says is None or not_says not in text
    assert os.listdir(lustre_dir) == []


def test_unchecked_create_reports_unverified(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir)
    fd, report = create_striped(str(lustre_dir / "x"), LayoutRequest(), probe, check=False)
    os.close(fd)
    assert report.applied and report.layout is None and "not verified" in report.reason
    assert "getxattr lustre.lov" not in probe.calls


def test_create_striped_elsewhere_ignores_the_request(tmp_path: Path) -> None:
    path = tmp_path / "shard-000.tar"
    fd, report = create_striped(str(path), LayoutRequest(stripe_count=4))
    os.write(fd, b"abc")
    os.close(fd)
    assert path.read_bytes() == b"abc"
    assert not report.applied and report.layout is None and "not Lustre" in report.reason
    assert report.fs.shared is False
    with pytest.raises(FileExistsError):
        create_striped(str(path), LayoutRequest())
    assert path.read_bytes() == b"abc"


def test_real_open_delay_create_is_harmless_off_lustre(tmp_path: Path) -> None:
    path = tmp_path / "f"
    fd = FsProbe().open_delay_create(str(path))
    os.write(fd, b"ok")
    os.close(fd)
    assert path.read_bytes() == b"ok"
    with pytest.raises(FileExistsError):
        FsProbe().open_delay_create(str(path))


# --- get_layout and lfs getstripe --------------------------------------------------------------

PLAIN_YAML = """\
lmm_stripe_count:  2
lmm_stripe_size:   4194304
lmm_pattern:       raid0
lmm_layout_gen:    0
lmm_stripe_offset: 6
lmm_pool:          flash
lmm_objects:
      - l_ost_idx: 6
        l_fid:     0x100060000:0x2a:0x0
      - l_ost_idx: 7
        l_fid:     0x100070000:0x2a:0x0

"""

PFL_YAML = """\
  lcm_layout_gen:    3
  lcm_mirror_count:  1
  lcm_entry_count:   3
  component0:
    lcme_id:             1
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 0
    lcme_extent.e_end:   1048576
    sub_layout:
      lmm_stripe_count:  0
      lmm_stripe_size:   1048576
      lmm_pattern:       mdt
      lmm_layout_gen:    0
      lmm_stripe_offset: 0

  component1:
    lcme_id:             2
    lcme_mirror_id:      0
    lcme_flags:          init
    lcme_extent.e_start: 1048576
    lcme_extent.e_end:   1073741824
    sub_layout:
      lmm_stripe_count:  2
      lmm_stripe_size:   4194304
      lmm_pattern:       raid0
      lmm_layout_gen:    0
      lmm_stripe_offset: 1
      lmm_objects:
      - l_ost_idx: 1
        l_fid:     0x100010000:0x2:0x0
      - l_ost_idx: 0
        l_fid:     0x100000000:0x3:0x0

  component2:
    lcme_id:             3
    lcme_mirror_id:      0
    lcme_flags:          0
    lcme_extent.e_start: 1073741824
    lcme_extent.e_end:   EOF
    sub_layout:
      lmm_stripe_count:  -1
      lmm_stripe_size:   4194304
      lmm_pattern:       raid0
      lmm_layout_gen:    65535
      lmm_stripe_offset: -1

"""

# `lfs getstripe` (not -y) of a PFL file, as the Lustre manual shows it.
PFL_TEXT = """\
/mnt/lustre/test.txt
  lcm_layout_gen:  3
  lcm_entry_count: 2
    lcme_id:             1
    lcme_flags:          init
    lcme_extent.e_start: 0
    lcme_extent.e_end:   4194304
      lmm_stripe_count:  2
      lmm_stripe_size:   4194304
      lmm_pattern:       1
      lmm_layout_gen:    0
      lmm_stripe_offset: 0
      lmm_objects:
      - 0: { l_ost_idx: 0, l_fid: [0x100000000:0x45:0x0] }
      - 1: { l_ost_idx: 1, l_fid: [0x100010000:0x45:0x0] }

    lcme_id:             2
    lcme_flags:          init
    lcme_extent.e_start: 4194304
    lcme_extent.e_end:   EOF
      lmm_stripe_count:  1
      lmm_stripe_size:   1048576
      lmm_pattern:       1
      lmm_layout_gen:    0
      lmm_stripe_offset: 0
      lmm_objects:
      - 0: { l_ost_idx: 0, l_fid: [0x100000000:0x46:0x0] }
"""

DIR_DEFAULT_TEXT = """\
testdir1
  lcm_layout_gen:    0
  lcm_mirror_count:  1
  lcm_entry_count:   2
    lcme_id:             N/A
    lcme_mirror_id:      N/A
    lcme_flags:          0
    lcme_extent.e_start: 0
    lcme_extent.e_end:   65536
      stripe_count:  0       stripe_size:   65536       pattern:       mdt       stripe_offset: -1

    lcme_id:             N/A
    lcme_mirror_id:      N/A
    lcme_flags:          0
    lcme_extent.e_start: 65536
    lcme_extent.e_end:   EOF
      stripe_count:  -1       stripe_size:   1048576       pattern:       raid0       stripe_offset: -1
"""


def test_parse_getstripe_plain_yaml() -> None:
    layout = parse_getstripe(PLAIN_YAML)
    assert layout is not None and not layout.composite
    assert (layout.stripe_count, layout.stripe_size, layout.pool, layout.osts) == (
        2, 4 * MiB, "flash", (6, 7))
    assert layout.components[0].instantiated


def test_parse_getstripe_pfl_yaml_with_dom() -> None:
    layout = parse_getstripe(PFL_YAML)
    assert layout is not None and layout.composite
    assert [(c.start, c.end, c.dom, c.instantiated) for c in layout.components] == [
        (0, MiB, True, True), (MiB, GiB, False, True), (GiB, LUSTRE_EOF, False, False)]
    assert layout.dom_size == MiB and layout.osts == (1, 0) and layout.stripe_count == 2
    assert layout.components[2].stripe.stripe_count == -1


def test_parse_getstripe_plain_text_and_directory_defaults() -> None:
    layout = parse_getstripe(PFL_TEXT)
    assert layout is not None
    assert [c.stripe.osts for c in layout.components] == [(0, 1), (0,)]
    assert [c.stripe.pattern for c in layout.components] == [1, 1]
    assert layout.main is layout.components[1] and layout.osts == (0, 1)
    default = parse_getstripe(DIR_DEFAULT_TEXT)
    assert default is not None
    assert [(c.stripe.stripe_count, c.stripe.stripe_size, c.dom, c.id)
            for c in default.components] == [(0, 65536, True, 0), (-1, MiB, False, 0)]
    assert parse_getstripe("error: not a lustre file\n") is None


def fake_lfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outputs: dict[str, str]) -> Path:
    """Put an `lfs` that answers `getstripe -y PATH` from ``outputs`` first on PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "lfs"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nOUT = {outputs!r}\n"
        "args = sys.argv[1:]\n"
        "if args[:2] != ['getstripe', '-y'] or args[2] not in OUT:\n"
        "    sys.stderr.write('lfs: unsupported\\n'); sys.exit(2)\n"
        "sys.stdout.write(OUT[args[2]])\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return script


def test_get_layout_falls_back_to_lfs(lustre_dir: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    plain, comp = lustre_dir / "plain", lustre_dir / "pfl"
    plain.write_bytes(b"")
    comp.write_bytes(b"")
    fake_lfs(tmp_path, monkeypatch, {str(plain): PLAIN_YAML, str(comp): PFL_YAML})
    probe = lustre_probe(lustre_dir, default_layout=False)
    layout = get_layout(str(plain), probe)
    assert layout is not None and layout.pool == "flash" and layout.osts == (6, 7)
    pfl_layout = get_layout(str(comp), probe)
    assert pfl_layout is not None and pfl_layout.composite and pfl_layout.dom_size == MiB
    assert probe.calls.count("getxattr trusted.lov") == 2
    other = lustre_dir / "other"
    other.write_bytes(b"")
    assert get_layout(str(other), probe) is None  # lfs fails for it


def test_get_layout_prefers_xattrs(lustre_dir: Path) -> None:
    probe = lustre_probe(lustre_dir, default_layout=False)
    path = lustre_dir / "f"
    path.write_bytes(b"")
    probe.xattrs[os.path.realpath(path)] = {"trusted.lov": pfl()}
    assert get_layout(str(path), probe) == parse_lov(pfl())
    probe.xattrs[os.path.realpath(path)]["lustre.lov"] = v1_four()
    assert get_layout(str(path), probe) == parse_lov(v1_four())


def test_get_layout_off_lustre_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = fake_lfs(tmp_path, monkeypatch, {str(tmp_path / "f"): PLAIN_YAML})
    (tmp_path / "f").write_bytes(b"")
    assert get_layout(str(tmp_path / "f")) is None  # real probe: this disk is not Lustre
    assert FsProbe().lfs("getstripe", "-y", str(tmp_path / "f")) == PLAIN_YAML
    assert FsProbe().lfs("getstripe", "-y", "/nope") is None
    script.unlink()
    assert FsProbe().lfs("getstripe", "-y", str(tmp_path / "f")) is None


# --- read sizes and OST spread -----------------------------------------------------------------


def test_read_block_size_and_alignment() -> None:
    assert read_block_size(None) == 4 * MiB
    assert read_block_size(parse_lov(v1_four())) == 4 * MiB  # 1 MiB stripes
    assert read_block_size(parse_lov(pack_lmm(LOV_MAGIC_V1, 3 * MiB, 1))) == 6 * MiB
    assert read_block_size(parse_lov(pack_lmm(LOV_MAGIC_V1, 16 * MiB, 1))) == 16 * MiB
    assert read_block_size(parse_lov(v1_four()), minimum=1) == MiB
    assert align_down(9, 4) == 8 and align_down(8, 4) == 8
    assert aligned_span(5, 10, 4) == (4, 12) and aligned_span(0, 0, 4) == (0, 0)
    assert aligned_span(MiB + 1, 3 * MiB - 1, MiB) == (MiB, 3 * MiB)
    for bad in (lambda: read_block_size(None, 0), lambda: align_down(1, 0),
                lambda: aligned_span(4, 2, 4)):
        with pytest.raises(UsageError):
            bad()


UNIT = 64 << 10  # Lustre stripe sizes are multiples of 64 KiB


@pytest.mark.parametrize("units,want_units", [
    (1024, 1024),    # 64 MiB: the largest stripe read whole
    (4096, 1024),    # 256 MiB: a quarter at a time
    (49152, 1024),   # 3 GiB = 48 x 64 MiB
    (1536, 768),     # 96 MiB: its largest divisor up to 1024 units is 768 (48 MiB)
    (1009, 1009),    # a prime number of units up to the maximum: whole
    (1031, 1024),    # a prime above it: no divisor of 4 MiB or more, so 64 MiB reads that
                     # cross its boundaries (not 64 KiB ones)
    (65535, 771),    # the largest stripe Lustre allows, 4 GiB - 64 KiB: 65535 = 3*5*17*257
])
def test_read_block_size_bounded_for_huge_stripes(units: int, want_units: int) -> None:
    """A stripe of up to 4 GiB is not read (and buffered, in every worker) whole: the block is
    the largest 64 KiB-multiple divisor of the stripe up to 64 MiB, so aligned blocks still
    never cross a stripe boundary."""
    layout = parse_lov(pack_lmm(LOV_MAGIC_V1, units * UNIT, 1))
    block = read_block_size(layout)
    assert block == want_units * UNIT
    assert block <= MAX_READ_BLOCK == 64 * MiB
    assert (units * UNIT) % block == 0 or units == 1031
    assert read_block_size(layout, minimum=units * UNIT) == block


def test_read_block_size_maximum() -> None:
    # a minimum above the maximum with small stripes stops at the maximum (a multiple of them)
    assert read_block_size(parse_lov(v1_four()), minimum=GiB) == MAX_READ_BLOCK
    assert read_block_size(parse_lov(pack_lmm(LOV_MAGIC_V1, 3 * MiB, 1)), minimum=GiB) == 63 * MiB
    assert read_block_size(None, minimum=8 * MiB, maximum=MiB) == 8 * MiB  # no stripe: as asked
    with pytest.raises(UsageError, match="maximum"):
        read_block_size(None, maximum=0)


def test_spread_by_ost_example() -> None:
    shards = [("a", 0), ("b", 0), ("c", 0), ("d", 1), ("e", 1), ("f", 2)]
    out = spread_by_ost(shards, lambda s: s[1], 3)
    assert [s[0] for s in out] == ["a", "d", "f", "b", "e", "c"]
    assert spread_by_ost(shards, lambda s: s[1], 1) == shards
    unknown = [("x", None), ("y", None), ("z", 5)]
    assert [s[0] for s in spread_by_ost(unknown, lambda s: s[1], 2)] == ["x", "z", "y"]


def _windows_distinct(osts: list[int | None], width: int) -> bool:
    return all(len(set(osts[i:i + width])) == len(osts[i:i + width])
               for i in range(max(1, len(osts) - width + 1)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.none(), st.integers(0, 4)), max_size=7), st.integers(1, 4))
def test_spread_by_ost_properties(osts: list[int | None], width: int) -> None:
    items = list(enumerate(osts))
    out = spread_by_ost(items, lambda it: it[1], width)
    assert sorted(out) == items  # a permutation
    assert spread_by_ost(items, lambda it: it[1], width) == out  # deterministic
    for key in set(osts):  # stable within each OST
        picked = [i for i, o in out if o == key]
        assert picked == sorted(picked)
    got = [o for _, o in out]
    feasible = any(_windows_distinct(list(p), width)
                   for p in set(itertools.permutations(osts)))
    assert _windows_distinct(got, width) == feasible


# --- a real Lustre (opt-in) --------------------------------------------------------------------


@pytest.mark.lustre
@pytest.mark.skipif(not os.environ.get("SHARDIO_LUSTRE_DIR"),
                    reason="set SHARDIO_LUSTRE_DIR to a writable Lustre directory with >= 2 OSTs")
def test_real_lustre_round_trip() -> None:
    base = os.environ["SHARDIO_LUSTRE_DIR"]
    info = detect_fs(base)
    assert info.kind == "lustre" and info.shared, info
    path = os.path.join(base, f"shardio-layout-test-{uuid.uuid4().hex}")
    request = LayoutRequest(stripe_count=2, stripe_size=MiB)
    fd, report = create_striped(path, request)
    try:
        os.write(fd, os.urandom(3 * MiB))
        os.close(fd)
        assert report.applied and report.layout is not None, report
        layout = get_layout(path)
        assert layout is not None
        assert (layout.stripe_count, layout.stripe_size) == (2, MiB)
        assert len(layout.osts) == 2 and layout.osts == report.layout.osts
        assert read_block_size(layout) == 4 * MiB
    finally:
        os.unlink(path)
