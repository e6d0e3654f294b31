"""Filesystem probe and Lustre file layouts: detect the filesystem, read, build and set layouts.

Everything that asks the OS about a filesystem goes through one narrow interface,
:class:`FsProbe`, so tests substitute a fake built from the same byte layouts::

    statfs_type(path) -> int             f_type of statfs(2) (libc via ctypes; first field, a long)
    mountinfo() -> str                   /proc/self/mountinfo ("" if unreadable)
    getxattr(path, name) -> bytes|None   None on ENODATA / ENOTSUP
    fsetxattr(fd, name, value)
    lfs(*args, timeout) -> str|None      `lfs` from PATH; None if absent or failing
    open_delay_create(path, mode) -> fd  O_CREAT|O_EXCL|O_LOV_DELAY_CREATE

Layout blobs (``lustre.lov`` / ``trusted.lov`` xattr, ``lustre_user.h`` and ``lustre_idl.h``;
all fields packed, little-endian on disk, host-endian in the user form; a blob whose magic reads
byte-swapped is parsed big-endian)::

    lov_user_md_v1 / lov_mds_md_v1, magic 0x0BD10BD0, 32-byte header
      0 u32 lmm_magic   4 u32 lmm_pattern   8 u64 lmm_oi.oi_id   16 u64 lmm_oi.oi_seq
     24 u32 lmm_stripe_size   28 u16 lmm_stripe_count   30 u16 lmm_stripe_offset (layout_gen
        in the mds form; 0xFFFF = -1)   32 lov_ost_data_v1[stripe_count]
    lov_user_md_v3, magic 0x0BD30BD0 (0x0BD50BD0 "specific OSTs" has the same shape)
     32 char lmm_pool_name[16] (LOV_MAXPOOLNAME 15 + NUL)   48 lov_ost_data_v1[stripe_count]
    lov_ost_data_v1, 24 bytes
      0 u64 l_ost_oi.oi_id   8 u64 l_ost_oi.oi_seq   16 u32 l_ost_gen   20 u32 l_ost_idx
    lov_comp_md_v1, magic 0x0BD60BD0 (Lustre 2.10+ PFL, 2.11+ FLR/DoM), 32-byte header
      0 u32 lcm_magic   4 u32 lcm_size (whole blob)   8 u32 lcm_layout_gen   12 u16 lcm_flags
     14 u16 lcm_entry_count   16 u16 lcm_mirror_count (mirrors - 1)   18 u8 lcm_ec_count
        (erasure-coded releases; padding before)   19..31 padding   32 entries
    lov_comp_md_entry_v1, 48 bytes
      0 u32 lcme_id (mirror id in bits 16-30)   4 u32 lcme_flags (LCME_FL_INIT 0x10 =
        instantiated)   8 u64 e_start   16 u64 e_end (2**64-1 = EOF)   24 u32 lcme_offset
     28 u32 lcme_size (sub-layout v1/v3 at [offset, offset+size) of the blob)
     32 u32 lcme_layout_gen   36 u64 lcme_timestamp   44 u32 lcme_padding_1 (newer releases
        keep EC stripe counts and compression settings in these 4 bytes; not read here)

A sub-layout with pattern LOV_PATTERN_MDT (0x100) is Data-on-MDT (2.11+): no objects, its stripe
size is the DoM size.  Objects follow a v1/v3 header only once the layout is instantiated: for a
component that is LCME_FL_INIT; for a plain layout when the header names its MDT object (lmm_oi
set) or bytes follow it.  A user blob (what :func:`build_lov` makes, a directory default) has
none, nor does a released (LOV_PATTERN_F_RELEASED, HSM) file.  A plain layout is modelled as one
component [0, EOF) with id 0, flagged LCME_FL_INIT when it has objects, as ``lfs`` itself does
(``lov_forge_comp_v1``).

Setting a layout.  Lustre fixes a file's layout when its objects are created: at open(O_CREAT)
unless the open carries O_LOV_DELAY_CREATE, else at the first write.  The flag is O_NOCTTY|FASYNC
(LU-4209, what current clients and liblustreapi pass; both are no-ops on a new regular file
elsewhere); the 1.8-era 0100000000 bit is dropped by kernels since 2.6.36 and is not sent.  A
``lustre.lov`` set after the objects exist is silently ignored (the call succeeds), so
:func:`create_striped` opens with the delay flag, sets the layout on the still object-less file,
then reads it back and compares; a mismatch removes the file and raises
:class:`~shardio.errors.LayoutNotAppliedError`.  On any other filesystem it creates the file
plainly and says the request was ignored.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import math
import os
import re
import struct
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from ._fsutil import translate_oserror
from .config import LOV_MAX_STRIPE_COUNT, LOV_MAXPOOLNAME, LOV_MIN_STRIPE_SIZE  # noqa: F401
from .config import check_layout_args as _check_layout_args
from .errors import LayoutError, LayoutNotAppliedError, UsageError

__all__ = [
    "FS_MAGIC", "Component", "FsInfo", "FsProbe", "Layout", "LayoutReport", "LayoutRequest",
    "Stripe", "align_down", "aligned_span", "build_lov", "create_striped", "detect_fs",
    "get_layout", "parse_getstripe", "parse_lov", "read_block_size", "spread_by_ost",
]

T = TypeVar("T")
KiB, MiB = 1 << 10, 1 << 20
# The most one coalesced read takes at once on Lustre (read_block_size), whatever the stripe.
MAX_READ_BLOCK = 64 * MiB
LUSTRE_EOF = (1 << 64) - 1
LOV_MAGIC_V1, LOV_MAGIC_V3, LOV_MAGIC_SPECIFIC = 0x0BD10BD0, 0x0BD30BD0, 0x0BD50BD0
LOV_MAGIC_COMP_V1, LOV_MAGIC_FOREIGN = 0x0BD60BD0, 0x0BD70BD0
LOV_PATTERN_RAID0, LOV_PATTERN_MDT = 0x001, 0x100
LOV_PATTERN_F_MASK, LOV_PATTERN_F_RELEASED = 0xFFFF0000, 0x80000000
LCME_FL_STALE, LCME_FL_PREF_RD, LCME_FL_INIT = 0x1, 0x2, 0x10
MIRROR_ID_MASK, MIRROR_ID_SHIFT = 0x7FFF0000, 16
O_LOV_DELAY_CREATE = os.O_NOCTTY | getattr(os, "O_ASYNC", 0o20000)  # FASYNC on x86-64/aarch64
_ALL = 0xFFFF  # u16 -1: "all OSTs" as a count, "any OST" as an offset

_V3_HEADER, _OST = 48, 24  # v3 header bytes, lov_ost_data_v1 bytes
_POOL = struct.Struct("16s")


@dataclass(frozen=True)
class _Structs:
    v1: struct.Struct  # lov_user_md_v1 header (32)
    comp: struct.Struct  # lov_comp_md_v1 header (32)
    entry: struct.Struct  # lov_comp_md_entry_v1 (48)
    u32: struct.Struct


_BYTE_ORDER = {e: _Structs(struct.Struct(e + "IIQQIHH"), struct.Struct(e + "IIIHHHB13x"),
                           struct.Struct(e + "IIQQIIIQ4x"), struct.Struct(e + "I"))
               for e in "<>"}
_LE = _BYTE_ORDER["<"]
_LMM_MAGICS = (LOV_MAGIC_V1, LOV_MAGIC_V3, LOV_MAGIC_SPECIFIC)
_MAGICS = (*_LMM_MAGICS, LOV_MAGIC_COMP_V1, LOV_MAGIC_FOREIGN)

FS_MAGIC: dict[int, str] = {
    0x0BD00BD0: "lustre", 0x47504653: "gpfs", 0x19830326: "beegfs", 0x6969: "nfs",
    0x01021994: "tmpfs", 0x858458F6: "ramfs", 0xEF53: "ext4", 0x58465342: "xfs",
    0x9123683E: "btrfs", 0x794C7630: "overlay", 0x2FC12FC1: "zfs", 0xF2F52010: "f2fs",
    0x73717368: "squashfs", 0x00C36400: "ceph", 0xFF534D42: "cifs", 0xFE534D42: "smb2",
    0x65735546: "fuse",
}
"""statfs(2) ``f_type`` -> filesystem name (``linux/magic.h``; LL_SUPER_MAGIC; GPFS; BeeGFS)."""

_KIND = {"lustre": "lustre", "gpfs": "gpfs", "beegfs": "beegfs", "nfs": "nfs", "nfs4": "nfs",
         "tmpfs": "tmpfs", "ramfs": "tmpfs"}
_LOCAL = {"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "overlay", "f2fs", "squashfs", "jfs",
          "bcachefs", "vfat", "exfat", "ntfs", "ntfs3", "fuseblk"}
_SHARED = {"lustre", "gpfs", "beegfs", "nfs"}
# Network filesystems without a kind of their own: still shared between nodes.
_SHARED_OTHER = {"ceph", "cifs", "smb2", "smb3", "fuse.glusterfs", "glusterfs", "fuse.cephfs"}


# --- the probe ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _libc_statfs() -> Callable[..., int]:
    fn = ctypes.CDLL(None, use_errno=True).statfs
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_void_p], ctypes.c_int
    return fn  # type: ignore[no-any-return]


class FsProbe:
    """The only place that asks the OS about filesystems; tests subclass it with a fake."""

    def statfs_type(self, path: str) -> int:
        """Return ``f_type`` of ``statfs(2)`` for ``path``.

        Raises:
            OSError: statfs failed (``FileNotFoundError`` for a missing path) or not Linux.
        """
        if not sys.platform.startswith("linux"):
            raise OSError(errno.ENOSYS, "statfs f_type is read on Linux only", path)
        buf = ctypes.create_string_buffer(512)  # struct statfs is 120 bytes on 64-bit Linux
        if _libc_statfs()(os.fsencode(path), buf) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err), path)
        return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF

    def mountinfo(self) -> str:
        """Return the text of ``/proc/self/mountinfo``, or "" when it cannot be read."""
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                return f.read()
        except OSError:
            return ""

    def getxattr(self, path: str, name: str) -> bytes | None:
        """Return the extended attribute ``name`` of ``path``; None if absent or unsupported.

        Raises:
            OSError: any other failure (missing file, permission).
        """
        try:
            return os.getxattr(path, name)
        except OSError as exc:
            if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
                return None
            raise

    def fsetxattr(self, fd: int, name: str, value: bytes) -> None:
        """Set the extended attribute ``name`` on the open file ``fd``."""
        os.setxattr(fd, name, value)

    def lfs(self, *args: str, timeout: float = 10) -> str | None:
        """Run ``lfs ARGS`` and return its stdout; None if ``lfs`` is not on PATH or fails."""
        # Imported here: off Lustre nothing runs lfs, and a pack would pay ~4 ms to import them.
        import shutil
        import subprocess

        exe = shutil.which("lfs")
        if exe is None:
            return None
        try:
            # (errors=: lfs prints pool names as raw bytes, which need not be UTF-8)
            proc = subprocess.run([exe, *args], capture_output=True, text=True,
                                  errors="replace", timeout=timeout, check=False)
        except (OSError, subprocess.SubprocessError):
            return None
        return proc.stdout if proc.returncode == 0 else None

    def open_delay_create(self, path: str, mode: int = 0o644) -> int:
        """Create the new file ``path`` for writing without objects (O_LOV_DELAY_CREATE).

        Other filesystems ignore the flag on a regular file.

        Raises:
            FileExistsError: ``path`` exists.
        """
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | O_LOV_DELAY_CREATE
        return os.open(path, flags, mode)


# --- filesystem detection ----------------------------------------------------------------------


@dataclass(frozen=True)
class FsInfo:
    """What filesystem a path lives on.

    Attributes:
        kind: "lustre", "gpfs", "beegfs", "nfs", "local", "tmpfs" or "unknown".
        mount_point: the mount point holding the path ("" if mountinfo did not say).
        fstype: filesystem type as mountinfo names it (else the statfs magic's name, or "").
        source: the mount source (device, ``mgs@tcp:/fsname``, ``server:/export``).
        shared: True for filesystems every node sees (lustre, gpfs, beegfs, nfs, ceph, cifs).
    """

    kind: str
    mount_point: str
    fstype: str
    source: str
    shared: bool


def _kind_of(fstype: str) -> str:
    if fstype in _KIND:
        return _KIND[fstype]
    return "local" if fstype in _LOCAL else "unknown"


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _find_mount(mountinfo: str, path: str) -> tuple[str, str, str] | None:
    """(mount point, fstype, source) of the deepest mount holding ``path``; later lines win."""
    best: tuple[str, str, str] | None = None
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:] or len(fields) < 5:
            continue
        sep = fields.index("-", 6)
        point = _unescape(fields[4])
        inside = point == "/" or path == point or path.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):
            rest = fields[sep + 1:]
            best = (point, _unescape(rest[0]) if rest else "",
                    _unescape(rest[1]) if len(rest) > 1 else "")
    return best


def detect_fs(path: str, probe: FsProbe | None = None) -> FsInfo:
    """Tell which filesystem ``path`` (which need not exist yet) lives on.

    The statfs magic decides the kind; the deepest mountinfo entry holding the real path names
    the mount point, type and source, and decides the kind when the magic is unknown (FUSE, a
    failed statfs).  A missing path is looked up through its nearest existing parent.
    """
    probe = probe or FsProbe()
    real = os.path.realpath(path)
    where, magic = real, None
    while True:
        try:
            magic = probe.statfs_type(where)
            break
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(where)
            if parent == where:
                break
            where = parent
        except OSError:
            break  # no permission, not Linux: mountinfo alone decides
    mount = _find_mount(probe.mountinfo(), real)
    magic_name = FS_MAGIC.get(magic, "") if magic is not None else ""
    fstype = mount[1] if mount else magic_name
    kind = _kind_of(magic_name)
    if kind == "unknown":
        kind = _kind_of(fstype)
    shared = kind in _SHARED or (kind == "unknown" and (fstype in _SHARED_OTHER
                                                        or magic_name in _SHARED_OTHER))
    return FsInfo(kind=kind, mount_point=mount[0] if mount else "", fstype=fstype,
                  source=mount[2] if mount else "", shared=shared)


# --- layout model ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stripe:
    """One RAID0 (or DoM) sub-layout.

    Attributes:
        stripe_size: bytes per stripe (the DoM size for a DoM component).
        stripe_count: number of stripes; -1 = all OSTs (not yet instantiated); 0 for DoM.
        stripe_offset: OST of the first object once instantiated, else the requested start
            OST (-1 = any).
        pool: OST pool name, or None.
        osts: OST index of each object, in stripe order (empty until instantiated).
        pattern: ``lmm_pattern`` (LOV_PATTERN_RAID0 = 1, MDT = 0x100, flags in the high bits).
    """

    stripe_size: int
    stripe_count: int
    stripe_offset: int
    pool: str | None
    osts: tuple[int, ...]
    pattern: int


@dataclass(frozen=True)
class Component:
    """The part [start, end) of a file laid out by one sub-layout (end 2**64-1 = EOF)."""

    start: int
    end: int
    stripe: Stripe
    dom: bool
    id: int
    flags: int

    @property
    def instantiated(self) -> bool:
        """Whether Lustre created this component's objects (LCME_FL_INIT)."""
        return bool(self.flags & LCME_FL_INIT)

    @property
    def mirror(self) -> int:
        """FLR mirror id (bits 16-30 of ``lcme_id``; 0 for a file without mirrors)."""
        return (self.id & MIRROR_ID_MASK) >> MIRROR_ID_SHIFT


@dataclass(frozen=True)
class Layout:
    """A file's layout: its components in blob order (one for a plain layout).

    The summary properties describe the *main* component: the instantiated non-DoM component
    that starts last (shards are large, so it holds most of their bytes; the first component of
    a PFL layout is typically a small one-stripe head), or the last non-DoM component when none
    is instantiated yet.  For a plain layout that is its only component.  In a mirrored (FLR)
    file, where several components cover the same extent, the summary and :attr:`first_ost`
    describe the mirror clients read: the first one with no stale component, preferring one
    flagged ``prefer`` (LCME_FL_PREF_RD).
    """

    components: tuple[Component, ...]
    composite: bool

    @property
    def read_mirror(self) -> tuple[Component, ...]:
        """The components of the mirror a client reads (all of them without FLR mirrors)."""
        mirrors: dict[int, list[Component]] = {}
        for c in self.components:
            mirrors.setdefault(c.mirror, []).append(c)
        if len(mirrors) <= 1:
            return self.components
        fresh = [m for m in mirrors.values() if not any(c.flags & LCME_FL_STALE for c in m)]
        preferred = [m for m in fresh if any(c.flags & LCME_FL_PREF_RD for c in m)]
        return tuple((preferred or fresh or list(mirrors.values()))[0])

    @property
    def main(self) -> Component | None:
        """The component the summary properties describe (see the class docstring)."""
        data = [c for c in self.read_mirror if not c.dom]
        chosen = [c for c in data if c.instantiated] or data
        return max(chosen, key=lambda c: c.start) if chosen else None

    @property
    def stripe_size(self) -> int:
        """Stripe size of the main component (0 when the file is DoM only)."""
        return self.main.stripe.stripe_size if self.main else 0

    @property
    def stripe_count(self) -> int:
        """Stripe count of the main component (-1 = all OSTs, 0 when DoM only)."""
        return self.main.stripe.stripe_count if self.main else 0

    @property
    def pool(self) -> str | None:
        """OST pool of the main component, or None."""
        return self.main.stripe.pool if self.main else None

    @property
    def osts(self) -> tuple[int, ...]:
        """OST indices of every instantiated stripe, in component and stripe order, once each."""
        return tuple(dict.fromkeys(o for c in self.components for o in c.stripe.osts))

    @property
    def first_ost(self) -> int | None:
        """The OST holding the file's first OST-backed bytes (in the mirror read), or None."""
        osts = [c.stripe.osts[0] for c in sorted(self.read_mirror, key=lambda c: c.start)
                if c.stripe.osts]
        return osts[0] if osts else None

    @property
    def dom_size(self) -> int:
        """Bytes stored on the MDT (Data-on-MDT), 0 if none."""
        return next((c.stripe.stripe_size for c in self.components if c.dom), 0)

    def component_at(self, offset: int) -> Component | None:
        """The first component whose extent holds byte ``offset``."""
        return next((c for c in self.components
                     if c.start <= offset and (offset < c.end or c.end == LUSTRE_EOF)), None)


# --- parsing -----------------------------------------------------------------------------------


def _unpack(fmt: struct.Struct, data: bytes, off: int, end: int, what: str) -> tuple[int, ...]:
    if off + fmt.size > end:
        raise LayoutError(f"{what} is truncated: it needs bytes [{off}, {off + fmt.size}) but "
                          f"only {max(end - off, 0)} of {fmt.size} are there; the layout blob "
                          "is damaged or was cut short (read it again)")
    return fmt.unpack_from(data, off)


def _parse_lmm(data: bytes, off: int, end: int, st: _Structs, init: bool | None,
               what: str) -> Stripe:
    """Parse a v1/v3 (lov_user_md/lov_mds_md) layout in data[off:end]."""
    v1 = st.v1
    magic, pattern, oi_id, oi_seq, size, count, offset = _unpack(v1, data, off, end, what)
    if magic not in _LMM_MAGICS:
        raise LayoutError(f"{what}: magic {magic:#010x} is not a v1/v3 layout "
                          f"({LOV_MAGIC_V1:#010x}/{LOV_MAGIC_V3:#010x}); the blob is damaged")
    header = v1.size if magic == LOV_MAGIC_V1 else _V3_HEADER
    pool = None
    if magic != LOV_MAGIC_V1:
        raw = _unpack(_POOL, data, off + v1.size, end, f"{what} pool name")[0].split(b"\0")[0]
        pool = raw.decode("ascii", "replace") or None
    dom = (pattern & ~LOV_PATTERN_F_MASK) == LOV_PATTERN_MDT
    if dom or pattern & LOV_PATTERN_F_RELEASED or count in (0, _ALL):
        n = 0
    elif init is not None:  # a component: LCME_FL_INIT says whether objects exist
        n = count if init else 0
    else:  # plain: instantiated when it names its MDT object, or when objects follow
        n = count if (oi_id or oi_seq or magic == LOV_MAGIC_SPECIFIC or end - off > header) else 0
    if off + header + n * _OST > end:
        raise LayoutError(
            f"{what}: stripe_count {count} needs {header + n * _OST} bytes ({header}-byte header "
            f"+ {n} x {_OST}-byte objects) but only {end - off} are there; the blob is truncated")
    osts = tuple(st.u32.unpack_from(data, off + header + i * _OST + 20)[0] for i in range(n))
    return Stripe(stripe_size=size, stripe_count=-1 if count == _ALL else count,
                  stripe_offset=osts[0] if osts else (-1 if offset == _ALL else offset),
                  pool=pool, osts=osts, pattern=pattern)


def _parse_comp(data: bytes, st: _Structs) -> Layout:
    hdr, ent = st.comp, st.entry
    _magic, size, _gen, _flags, count, _mirrors, _ec = _unpack(hdr, data, 0, len(data),
                                                               "composite layout header")
    table = hdr.size + count * ent.size
    if size < table:
        raise LayoutError(f"composite layout: lcm_size {size} is smaller than its header and "
                          f"{count} entries ({table} bytes); the blob is damaged")
    if size > len(data):
        raise LayoutError(f"composite layout is truncated: lcm_size says {size} bytes, the blob "
                          f"has {len(data)}; read the layout again")
    comps = []
    for i in range(count):
        cid, flags, start, end, off, sub_size, _lgen, _ts = _unpack(
            ent, data, hdr.size + i * ent.size, size, f"component entry {i}")
        what = f"component {i} (id {cid})"
        if off < table or off + sub_size > size:
            raise LayoutError(f"{what}: its sub-layout at [{off}, {off + sub_size}) lies outside "
                              f"the {size}-byte blob past the {table}-byte entry table")
        if start > end:
            raise LayoutError(f"{what}: extent [{start}, {end}) ends before it starts")
        stripe = _parse_lmm(data, off, off + sub_size, st, bool(flags & LCME_FL_INIT), what)
        dom = (stripe.pattern & ~LOV_PATTERN_F_MASK) == LOV_PATTERN_MDT
        comps.append(Component(start, end, stripe, dom, cid, flags))
    return Layout(tuple(comps), composite=True)


def parse_lov(blob: bytes) -> Layout:
    """Parse a ``lustre.lov``/``trusted.lov`` blob: v1, v3 or composite, either byte order.

    Raises:
        LayoutError: unknown magic, a foreign layout, truncated data, a stripe count the blob
            cannot hold, or component offsets outside the blob.
    """
    data = bytes(blob)
    if len(data) < 4:
        raise LayoutError(f"layout blob of {len(data)} bytes is too short: a layout needs at "
                          f"least {_LE.v1.size} bytes; the xattr is damaged")
    orders = [st for st in _BYTE_ORDER.values() if st.u32.unpack_from(data)[0] in _MAGICS]
    if not orders:
        raise LayoutError(f"unknown layout magic {struct.unpack_from('<I', data)[0]:#010x}; "
                          "expected a LOV v1/v3/composite magic (0x0BD?0BD0): not a Lustre file "
                          "layout, or a newer layout format than this shardio reads")
    st = orders[0]
    magic = st.u32.unpack_from(data)[0]
    if magic == LOV_MAGIC_FOREIGN:
        raise LayoutError("foreign layout (LOV_MAGIC_FOREIGN): the file's data is not on "
                          "Lustre OSTs, so it has no striping to read")
    if magic == LOV_MAGIC_COMP_V1:
        return _parse_comp(data, st)
    stripe = _parse_lmm(data, 0, len(data), st, None, "layout")
    dom = (stripe.pattern & ~LOV_PATTERN_F_MASK) == LOV_PATTERN_MDT
    flags = LCME_FL_INIT if stripe.osts else 0
    return Layout((Component(0, LUSTRE_EOF, stripe, dom, 0, flags),), composite=False)


_PATTERNS = {"raid0": 0x1, "raid1": 0x2, "parity": 0x4, "mdt": 0x100, "overstriped": 0x200,
             "foreign": 0x400, "compress": 0x800, "hole": 0x40000000, "released": 0x80000000}
_FLAGS = {"stale": 0x1, "prefrd": 0x2, "prefwr": 0x4, "prefer": 0x6, "offline": 0x8,
          "init": 0x10, "nosync": 0x20, "extension": 0x40}


def _bits(text: str, names: dict[str, int], base: int) -> int:
    value = 0
    for tok in filter(None, (t.strip() for t in text.split(","))):
        if tok in names:
            value |= names[tok]
        else:
            try:
                value |= int(tok, 0) if tok.startswith("0x") else int(tok, base)
            except ValueError:
                continue  # a flag name newer than this table; it does not change the striping
    return value


def _int(text: str, default: int = 0) -> int:
    try:
        return int(text, 0)
    except ValueError:
        return LUSTRE_EOF if text == "EOF" else default


def _text_component(keys: dict[str, str], osts: tuple[int, ...], composite: bool) -> Component:
    pattern = _bits(keys.get("pattern") or "raid0", _PATTERNS, 16)
    flags = _bits(keys.get("lcme_flags", ""), _FLAGS, 0) if composite else LCME_FL_INIT * bool(osts)
    stripe = Stripe(stripe_size=_int(keys.get("stripe_size", "")),
                    stripe_count=_int(keys.get("stripe_count", "")),
                    stripe_offset=osts[0] if osts else _int(keys.get("stripe_offset", ""), -1),
                    pool=keys.get("pool") or None, osts=osts, pattern=pattern)
    return Component(_int(keys.get("lcme_extent.e_start", "")),
                     _int(keys.get("lcme_extent.e_end", "EOF")), stripe,
                     (pattern & ~LOV_PATTERN_F_MASK) == LOV_PATTERN_MDT,
                     _int(keys.get("lcme_id", "")), flags)


_TEXT_KEYS = {"stripe_count", "stripe_size", "pattern", "stripe_offset", "pool"}


def parse_getstripe(text: str) -> Layout | None:
    """Parse ``lfs getstripe -y`` (or plain ``lfs getstripe``) output; None if it has no layout.

    Reads the ``lmm_*`` keys (or the directory form without the prefix, several on a line), the
    ``lcme_*`` keys of each component and the ``l_ost_idx`` of each object.  A bare number in
    ``lmm_pattern`` is hex, as ``lfs`` prints it.
    """
    comps: list[tuple[dict[str, str], list[int]]] = []
    composite = False
    for raw in text.splitlines():
        line = raw.strip().removeprefix("- ").strip()
        if re.fullmatch(r"component\d+:", line):
            comps.append(({}, []))
            composite = True
            continue
        ost = re.search(r"l_ost_idx:\s*(\d+)", line)
        if ost:
            if not comps:
                comps.append(({}, []))
            comps[-1][1].append(int(ost.group(1)))
            continue
        for key, value in re.findall(r"([A-Za-z_][\w.]*):[ \t]*(\S*)", line):
            key = key.removeprefix("lmm_")
            composite = composite or key.startswith(("lcm_", "lcme_"))
            if not (key.startswith("lcme_") or key in _TEXT_KEYS):
                continue
            if not comps or (key == "lcme_id" and "lcme_id" in comps[-1][0]):
                comps.append(({}, []))
            comps[-1][0][key] = value
    found = [_text_component(k, tuple(o), composite) for k, o in comps
             if "stripe_count" in k or "stripe_size" in k]
    return Layout(tuple(found), composite=composite) if found else None


# --- building and setting ----------------------------------------------------------------------


def build_lov(stripe_size: int, stripe_count: int, pool: str | None = None,
              stripe_offset: int = -1) -> bytes:
    """The ``lov_user_md`` blob a client sets: v1 without a pool, v3 with one (little-endian).

    Args:
        stripe_size: bytes per stripe, a multiple of 64 KiB.
        stripe_count: stripes, or -1 for all OSTs.
        pool: OST pool name (at most 15 ASCII characters).
        stripe_offset: index of the first OST, or -1 to let the MDS choose.

    Raises:
        UsageError: a value Lustre would refuse.
    """
    _check_layout_args(stripe_size, stripe_count, pool)
    if not isinstance(stripe_offset, int) or not -1 <= stripe_offset < _ALL:
        raise UsageError(f"stripe offset {stripe_offset!r} must be an OST index 0..65534 or -1 "
                         "(any OST)")
    magic = LOV_MAGIC_V1 if pool is None else LOV_MAGIC_V3
    blob = _LE.v1.pack(magic, LOV_PATTERN_RAID0, 0, 0, stripe_size, stripe_count & _ALL,
                    stripe_offset & _ALL)
    return blob if pool is None else blob + pool.encode("ascii").ljust(16, b"\0")


@dataclass(frozen=True, kw_only=True)
class LayoutRequest:
    """The striping to give new shard files (honoured on Lustre only).

    Args:
        stripe_count: OSTs per file, or -1 for all.
        stripe_size: bytes per stripe, a multiple of 64 KiB.
        pool: OST pool, or None for the filesystem default.

    Raises:
        UsageError: a value Lustre would refuse.
    """

    stripe_count: int = 1
    stripe_size: int = 4 * MiB
    pool: str | None = None

    def __post_init__(self) -> None:
        _check_layout_args(self.stripe_size, self.stripe_count, self.pool)


@dataclass(frozen=True)
class LayoutReport:
    """What :func:`create_striped` did.

    Attributes:
        fs: the filesystem of the file's directory.
        requested: the layout asked for.
        applied: True when Lustre took the layout (verified unless ``check=False``).
        layout: the layout read back, or None (not Lustre, or not checked).
        reason: one line for logs: what was applied, or why nothing was.
    """

    fs: FsInfo
    requested: LayoutRequest
    applied: bool
    layout: Layout | None
    reason: str


def _size(n: int) -> str:
    for unit, name in ((MiB, "MiB"), (KiB, "KiB")):
        if n and n % unit == 0:
            return f"{n // unit} {name}"
    return f"{n} bytes"


def _describe(count: int, size: int, pool: str | None) -> str:
    stripes = "all OSTs" if count == -1 else f"{count} stripe{'s' * (count != 1)}"
    return f"{stripes} of {_size(size)}" + (f" in pool {pool!r}" if pool else "")


def _mismatch(request: LayoutRequest, layout: Layout) -> bool:
    count_ok = (layout.stripe_count >= 1 if request.stripe_count == -1
                else layout.stripe_count == request.stripe_count)
    # No pool asked for: Lustre gives a plain layout the parent (or root) directory's default
    # pool (lfs-setstripe(1)), so any pool read back is what was asked.
    pool_ok = request.pool is None or layout.pool == request.pool
    return not (count_ok and layout.stripe_size == request.stripe_size and pool_ok)


def _discard(fd: int, path: str) -> None:
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _set_layout(fd: int, path: str, request: LayoutRequest, probe: FsProbe,
                check: bool) -> tuple[Layout | None, str]:
    """Set the layout on the object-less file ``fd``; read it back if ``check``."""
    want = _describe(request.stripe_count, request.stripe_size, request.pool)
    try:
        probe.fsetxattr(fd, "lustre.lov",
                        build_lov(request.stripe_size, request.stripe_count, request.pool))
    except OSError as exc:
        pool = ("check that the pool exists (`lfs pool_list`) and " if request.pool else
                "check that ")
        raise LayoutError(
            f"{path}: setting the layout ({want}) failed: {exc.strerror or exc}; {pool}the "
            "values suit this filesystem (`lfs df`), or pass other "
            "--stripe-count/--stripe-size/--stripe-pool values") from exc
    if not check:
        return None, f"layout set ({want}), not verified"
    try:
        back = probe.getxattr(path, "lustre.lov")
    except OSError as exc:
        raise LayoutError(f"{path}: reading the layout back failed: {exc.strerror or exc}; "
                          "retry; if it keeps failing, check the Lustre client with "
                          f"`lfs getstripe {path}`") from exc
    try:
        layout = parse_lov(back) if back else None
    except LayoutError as exc:
        raise LayoutError(f"{path}: the layout read back is malformed: {exc}") from exc
    if layout is None or _mismatch(request, layout):
        got = (_describe(layout.stripe_count, layout.stripe_size, layout.pool)
               if layout else "no readable layout")
        raise LayoutNotAppliedError(
            f"{path}: asked for {want}, Lustre kept {got}. Lustre takes a layout only while the "
            "file has no objects (opened with O_LOV_DELAY_CREATE, nothing written) and silently "
            "ignores one set later; it also caps the stripe count at the OSTs available "
            "(`lfs df`, `lfs pool_list`). The file was removed; pass values this filesystem can "
            "hold with --stripe-count/--stripe-size/--stripe-pool")
    return layout, f"layout applied: {want} on OSTs [{', '.join(map(str, layout.osts))}]"


def create_striped(path: str, request: LayoutRequest, probe: FsProbe | None = None, *,
                   check: bool = True) -> tuple[int, LayoutReport]:
    """Create the new file ``path`` with the requested Lustre layout; return (fd, report).

    The fd is open for writing; the caller closes it.  On Lustre the file is created without
    objects (O_LOV_DELAY_CREATE), given the layout, and (``check``) the layout is read back and
    compared; elsewhere the file is created plainly and the report says the request was ignored.
    With ``check=False`` the report says ``applied=True`` with no layout: set, not verified.

    Raises:
        FileExistsError: ``path`` exists (the file is created with O_EXCL).
        LayoutNotAppliedError: Lustre kept another layout; the file was removed.
        LayoutError: setting or reading back the layout failed, or what was read back is
            malformed; the file was removed.
        ShardIOError: any other failure to create the file.
    """
    probe = probe or FsProbe()
    fs = detect_fs(os.path.dirname(os.path.abspath(path)), probe)
    lustre = fs.kind == "lustre"
    try:
        if lustre:
            fd = probe.open_delay_create(path)
        else:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise
    except OSError as exc:
        raise translate_oserror(exc, path, "creating") from exc
    if not lustre:
        where = f"{fs.fstype or fs.kind} at {fs.mount_point}" if fs.mount_point else fs.kind
        return fd, LayoutReport(fs, request, False, None,
                                f"not Lustre ({where}): layout request ignored")
    try:
        layout, reason = _set_layout(fd, path, request, probe, check)
    except BaseException:
        _discard(fd, path)
        raise
    return fd, LayoutReport(fs, request, True, layout, reason)


def get_layout(path: str, probe: FsProbe | None = None) -> Layout | None:
    """The Lustre layout of ``path``; None when it is not on Lustre or has no layout.

    Reads the ``lustre.lov`` xattr, then ``trusted.lov``, then parses ``lfs getstripe -y``.

    Raises:
        LayoutError: the layout blob is malformed.
        ShardIOError: the file cannot be read (missing, permission).
    """
    probe = probe or FsProbe()
    if detect_fs(path, probe).kind != "lustre":
        return None
    for name in ("lustre.lov", "trusted.lov"):
        try:
            blob = probe.getxattr(path, name)
        except OSError as exc:
            raise translate_oserror(exc, path, "reading the Lustre layout of") from exc
        if blob:
            return parse_lov(blob)
    text = probe.lfs("getstripe", "-y", path)
    return parse_getstripe(text) if text else None


# --- reading and ordering ----------------------------------------------------------------------


def read_block_size(layout: Layout | None, minimum: int = 4 * MiB,
                    maximum: int = MAX_READ_BLOCK) -> int:
    """The read size for a file: the smallest multiple of its stripe size >= ``minimum``.

    A stripe larger than ``maximum`` (Lustre allows up to 4 GiB - 64 KiB) is not read whole:
    the block is then the largest divisor of the stripe that is a multiple of 64 KiB and at
    most ``maximum``, so aligned reads still never cross a stripe boundary while one read (and
    the buffer that holds it, in every worker) stays bounded; where that divisor is below
    4 MiB (and ``minimum``: a stripe of a prime number of 64 KiB units), ``maximum``.

    Raises:
        UsageError: ``minimum`` or ``maximum`` is not positive.
    """
    if minimum <= 0 or maximum <= 0:
        raise UsageError(f"read sizes must be positive, got minimum {minimum}, maximum {maximum}")
    stripe = layout.stripe_size if layout is not None else 0
    if stripe <= 0:
        return minimum
    block = -(-minimum // stripe) * stripe
    if block <= maximum:
        return block
    if stripe <= maximum:
        return maximum // stripe * stripe
    if stripe % LOV_MIN_STRIPE_SIZE:
        return maximum  # not a valid Lustre stripe size (damaged): no boundary to keep
    units, most = stripe // LOV_MIN_STRIPE_SIZE, max(1, maximum // LOV_MIN_STRIPE_SIZE)
    block = LOV_MIN_STRIPE_SIZE * max(d for d in _divisors(units) if d <= most)
    # (A stripe with no divisor of 4 MiB or more, 1031 x 64 KiB say, would read 64 KiB at a
    # time: large reads that cross its boundaries are the lesser cost.)
    return block if block >= min(minimum, 4 * MiB) else maximum


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in small]


def align_down(offset: int, block: int) -> int:
    """``offset`` rounded down to a multiple of ``block``.

    Raises:
        UsageError: ``block`` is not positive.
    """
    if block <= 0:
        raise UsageError(f"block size must be positive, got {block}")
    return offset - offset % block


def aligned_span(start: int, end: int, block: int) -> tuple[int, int]:
    """The smallest block-aligned range [start', end') covering [start, end).

    Raises:
        UsageError: ``block`` is not positive or ``end < start``.
    """
    if end < start:
        raise UsageError(f"range [{start}, {end}) ends before it starts")
    return align_down(start, block), -(-end // block) * block


def spread_by_ost(items: Sequence[T], ost_of: Callable[[T], int | None], width: int) -> list[T]:
    """Reorder ``items`` so that any ``width`` consecutive ones sit on distinct OSTs if possible.

    Items are queued per OST (None, an unknown OST, is one queue of its own) keeping their order
    in each queue.  Each pick takes the head of a queue whose OST is not among the previous
    ``width - 1`` picks, preferring the queue with most items left (a plain round-robin spends
    the rare OSTs first and piles the common one up at the end), then the earliest head.  When
    every queue is blocked, the least recently used one goes.  Deterministic; ``width <= 1``
    keeps the order.
    """
    if width <= 1 or len(items) <= 1:
        return list(items)
    queues: dict[int | None, deque[tuple[int, T]]] = {}
    for i, item in enumerate(items):
        queues.setdefault(ost_of(item), deque()).append((i, item))
    recent: deque[int | None] = deque(maxlen=width - 1)
    last_used: dict[int | None, int] = {}
    out: list[T] = []
    for step in range(len(items)):
        live = [k for k, q in queues.items() if q]
        free = [k for k in live if k not in recent]
        if free:
            key = min(free, key=lambda k: (-len(queues[k]), queues[k][0][0]))
        else:
            key = min(live, key=lambda k: (last_used.get(k, -1), queues[k][0][0]))
        out.append(queues[key].popleft()[1])
        recent.append(key)
        last_used[key] = step
    return out
