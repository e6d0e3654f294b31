"""A fake Lustre for tests: layout blobs packed from the C structs, and a :class:`FakeProbe`.

The packers follow ``lustre_user.h`` / ``lustre_idl.h`` directly (they do not use
``shardio.lustre``), so the parser is checked against the structures, not against itself::

    lov_user_md_v1   u32 magic, u32 pattern, u64 oi_id, u64 oi_seq, u32 stripe_size,
                     u16 stripe_count, u16 stripe_offset|layout_gen            -> 32 bytes
    lov_user_md_v3   v1 header + char pool_name[16]                           -> 48 bytes
    lov_ost_data_v1  u64 oi_id, u64 oi_seq, u32 ost_gen, u32 ost_idx          -> 24 bytes
    lov_comp_md_v1   u32 magic, u32 size, u32 layout_gen, u16 flags, u16 entry_count,
                     u16 mirror_count, u16 padding1[3], u64 padding2          -> 32 bytes
    lov_comp_md_entry_v1  u32 id, u32 flags, u64 e_start, u64 e_end, u32 offset, u32 size,
                     u32 layout_gen, u64 timestamp, u32 padding               -> 48 bytes

:class:`FakeProbe` answers statfs from per-prefix magics, mountinfo from injected text, and keeps
xattrs in memory over real files.  It reproduces Lustre's set-after-create quirk: a ``lustre.lov``
set on a file that was not opened with O_LOV_DELAY_CREATE (or already holds bytes) is silently
ignored, and the file reads back the filesystem default layout (1 stripe of 1 MiB on OST 0).
"""

from __future__ import annotations

import errno
import itertools
import os
import struct
from collections.abc import Sequence

from shardio.lustre import FsProbe

LL_SUPER_MAGIC = 0x0BD00BD0
GPFS_MAGIC = 0x47504653
BEEGFS_MAGIC = 0x19830326
NFS_MAGIC = 0x6969
TMPFS_MAGIC = 0x01021994
EXT4_MAGIC = 0xEF53
FUSE_MAGIC = 0x65735546

LOV_MAGIC_V1 = 0x0BD10BD0
LOV_MAGIC_V3 = 0x0BD30BD0
LOV_MAGIC_COMP_V1 = 0x0BD60BD0
LOV_PATTERN_RAID0 = 0x001
LOV_PATTERN_MDT = 0x100
LOV_PATTERN_F_RELEASED = 0x80000000
LCME_FL_INIT = 0x10
LUSTRE_EOF = 0xFFFFFFFFFFFFFFFF
MDT_SEQ = 0x200000401  # FID sequence of files on MDT0000


def pack_lmm(magic: int, stripe_size: int, stripe_count: int, *, pattern: int = LOV_PATTERN_RAID0,
             oi: tuple[int, int] = (0, 0), offset: int = 0xFFFF, pool: str | None = None,
             osts: Sequence[int] = (), e: str = "<") -> bytes:
    """lov_user_md_v1/v3 followed by one lov_ost_data_v1 per OST in ``osts``."""
    blob = struct.pack(e + "IIQQIHH", magic, pattern, oi[0], oi[1], stripe_size,
                       stripe_count & 0xFFFF, offset & 0xFFFF)
    if magic == LOV_MAGIC_V3:
        blob += struct.pack("16s", (pool or "").encode())
    for i, ost in enumerate(osts):
        blob += struct.pack(e + "QQII", 0x1000 + i, 0x100000000 + (ost << 16), 0, ost)
    return blob


def pack_comp(entries: Sequence[tuple[int, int, int, int, bytes]], *, layout_gen: int = 3,
              mirror_count: int = 0, e: str = "<") -> bytes:
    """lov_comp_md_v1 with ``(id, flags, start, end, sub_blob)`` entries, sub-blobs appended."""
    offset = 32 + 48 * len(entries)
    table, subs = b"", b""
    for cid, flags, start, end, sub in entries:
        table += struct.pack(e + "IIQQIIIQI", cid, flags, start, end, offset + len(subs),
                             len(sub), 0, 0, 0)
        subs += sub
    size = offset + len(subs)
    head = struct.pack(e + "IIIHHH6xQ", LOV_MAGIC_COMP_V1, size, layout_gen, 0, len(entries),
                       mirror_count, 0)
    return head + table + subs


def mountinfo_line(mount_id: int, point: str, fstype: str, source: str) -> str:
    """One /proc/self/mountinfo line, with the kernel's octal escapes."""
    def esc(s: str) -> str:
        return (s.replace("\\", "\\134").replace(" ", "\\040").replace("\t", "\\011")
                .replace("\n", "\\012"))
    return (f"{mount_id} 1 0:{mount_id} / {esc(point)} rw,relatime shared:{mount_id} - "
            f"{fstype} {esc(source)} rw\n")


class FakeProbe(FsProbe):
    """FsProbe over real files, with injected statfs magics, mountinfo and an xattr store.

    Args:
        statfs: path prefix -> statfs magic; the longest matching prefix answers.  A path no
            prefix covers fails with EOPNOTSUPP.
        mountinfo: text returned as /proc/self/mountinfo.
        n_osts: OSTs of the fake Lustre; stripe counts above it are capped, as Lustre does.
        pools: OST pool name -> its OST indices.
        default_layout: whether a file on Lustre without a stored layout reads back the default.
    """

    def __init__(self, statfs: dict[str, int], mountinfo: str = "", *, n_osts: int = 8,
                 pools: dict[str, tuple[int, ...]] | None = None,
                 default_layout: bool = True) -> None:
        self.prefixes = {os.path.realpath(p): m for p, m in statfs.items()}
        self.text = mountinfo
        self.n_osts = n_osts
        self.pools = pools if pools is not None else {"flash": (4, 5, 6, 7)}
        self.default_layout = default_layout
        self.xattrs: dict[str, dict[str, bytes]] = {}
        self.delayed: dict[int, tuple[int, int]] = {}  # fd -> (st_dev, st_ino)
        self.calls: list[str] = []
        self._next_ost = itertools.count()
        self._next_oid = itertools.count(0x1000)

    # -- FsProbe --------------------------------------------------------------------------------

    def statfs_type(self, path: str) -> int:
        best = None
        for prefix in self.prefixes:
            inside = prefix == "/" or path == prefix or path.startswith(prefix + "/")
            if inside and (best is None or len(prefix) > len(best)):
                best = prefix
        if best is None:
            raise OSError(errno.EOPNOTSUPP, "no fake statfs for this path", path)
        return self.prefixes[best]

    def mountinfo(self) -> str:
        return self.text

    def getxattr(self, path: str, name: str) -> bytes | None:
        self.calls.append(f"getxattr {name}")
        real = os.path.realpath(path)
        if not os.path.lexists(path):  # as os.getxattr fails on a missing file
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
        stored = self.xattrs.get(real, {}).get(name)
        if stored is None and name == "lustre.lov" and self.default_layout \
                and self._on_lustre(real) and os.path.exists(real):
            stored = self._instantiate(real, 1 << 20, 1, None, 0)
        return stored

    def fsetxattr(self, fd: int, name: str, value: bytes) -> None:
        self.calls.append(f"fsetxattr {name}")
        real = os.readlink(f"/proc/self/fd/{fd}")
        if name != "lustre.lov":
            self.xattrs.setdefault(real, {})[name] = value
            return
        magic, _pattern, _id, _seq, size, count, offset = struct.unpack_from("<IIQQIHH", value)
        pool = None
        if magic == LOV_MAGIC_V3:
            pool = struct.unpack_from("16s", value, 32)[0].rstrip(b"\0").decode() or None
        if size % 65536 or (pool is not None and pool not in self.pools):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), real)
        st = os.fstat(fd)
        delayed = self.delayed.get(fd) == (st.st_dev, st.st_ino)
        if not delayed or st.st_size > 0 or "lustre.lov" in self.xattrs.get(real, {}):
            # Objects exist already: Lustre accepts the call and keeps the layout it has.
            self._instantiate(real, 1 << 20, 1, None, 0)
            return
        self._instantiate(real, size, -1 if count == 0xFFFF else count, pool,
                          -1 if offset == 0xFFFF else offset)

    def open_delay_create(self, path: str, mode: int = 0o644) -> int:
        self.calls.append("open_delay_create")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        st = os.fstat(fd)
        self.delayed[fd] = (st.st_dev, st.st_ino)
        return fd

    # -- the fake MDS ---------------------------------------------------------------------------

    def _on_lustre(self, real: str) -> bool:
        try:
            return self.statfs_type(real) == LL_SUPER_MAGIC
        except OSError:
            return False

    def _instantiate(self, real: str, size: int, count: int, pool: str | None,
                     offset: int) -> bytes:
        """Create objects (once) and store the mds-form layout Lustre would return."""
        have = self.xattrs.setdefault(real, {})
        if "lustre.lov" in have:
            return have["lustre.lov"]
        candidates = list(self.pools[pool]) if pool else list(range(self.n_osts))
        count = len(candidates) if count == -1 else min(count, len(candidates))
        start = candidates.index(offset) if offset in candidates else next(self._next_ost)
        osts = [candidates[(start + i) % len(candidates)] for i in range(count)]
        magic = LOV_MAGIC_V1 if pool is None else LOV_MAGIC_V3
        have["lustre.lov"] = pack_lmm(magic, size, count, oi=(next(self._next_oid), MDT_SEQ),
                                      offset=0, pool=pool, osts=osts)
        return have["lustre.lov"]
