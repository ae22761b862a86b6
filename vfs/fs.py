"""The FUSE operations: a thin layer that turns the kernel's requests into extents of the tree and
asks the read engine for the bytes. Read-only: the mount is `ro`, so the kernel answers writes
with EROFS before they reach us.
"""

from __future__ import annotations

import errno
import logging
import os

import pyfuse3

from plan.layout import FILL_BYTE
from reader.engine import BackingError, ReadEngine
from vfs.tree import Node, ServedFile, Tree, memory_file

log = logging.getLogger("rankfs.fs")


class _Fill:
    """A read-only run of FILL_BYTE, grown on demand, shared by every reply."""

    def __init__(self):
        self._bytes = b""

    def take(self, n: int) -> memoryview:
        if len(self._bytes) < n:
            self._bytes = bytes([FILL_BYTE]) * max(n, 1 << 20)
        return memoryview(self._bytes)[:n]


class RankFS(pyfuse3.Operations):
    def __init__(self, tree: Tree, engine: ReadEngine):
        super().__init__()
        self.tree = tree
        self.engine = engine
        self._handles: dict[int, ServedFile] = {}
        self._next_fh = 1
        self._fill = _Fill()
        self.requests = 0  # reads answered, and their bytes: the average tells the request size
        self.request_bytes = 0
        self.fill_bytes = 0  # of them, bytes outside a rank's slices: read-around, not the loader

    # -- names and attributes -------------------------------------------------------------------

    def _node(self, inode: int) -> Node:
        node = self.tree.nodes.get(inode)
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return node

    def _attributes(self, node: Node) -> pyfuse3.EntryAttributes:
        attrs = pyfuse3.EntryAttributes()
        attrs.st_ino = node.inode
        attrs.st_mode = node.mode
        attrs.st_nlink = 2 if node.is_dir else 1
        attrs.st_size = node.size
        attrs.st_blksize = 1 << 20
        attrs.st_blocks = -(-node.size // 512)
        attrs.st_uid, attrs.st_gid = os.getuid(), os.getgid()
        attrs.st_atime_ns = attrs.st_mtime_ns = attrs.st_ctime_ns = node.mtime_ns
        attrs.entry_timeout = attrs.attr_timeout = 3600 if node.render is None else 0
        return attrs

    async def lookup(self, parent_inode, name, ctx=None):
        node = self.tree.lookup(parent_inode, os.fsdecode(name))
        if node is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attributes(node)

    async def getattr(self, inode, ctx=None):
        return self._attributes(self._node(inode))

    async def setattr(self, inode, attr, fields, fh, ctx):
        raise pyfuse3.FUSEError(errno.EROFS)

    async def getxattr(self, inode, name, ctx):
        raise pyfuse3.FUSEError(pyfuse3.ENOATTR)

    async def listxattr(self, inode, ctx):
        return []

    async def statfs(self, ctx):
        st = pyfuse3.StatvfsData()
        st.f_bsize = st.f_frsize = 4096
        st.f_blocks = sum(-(-n.size // 4096) for n in self.tree.files())
        st.f_files = len(self.tree.nodes)
        st.f_namemax = 255
        return st

    # -- directories ----------------------------------------------------------------------------

    async def opendir(self, inode, ctx):
        if not self._node(inode).is_dir:
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return inode

    async def readdir(self, fh, start_id, token):
        names = sorted(self.tree.nodes[fh].children.items())
        for position, (name, inode) in enumerate(names[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, os.fsencode(name),
                                         self._attributes(self.tree.nodes[inode]), position):
                break

    async def releasedir(self, fh):
        pass

    # -- files ----------------------------------------------------------------------------------

    async def open(self, inode, flags, ctx):
        node = self._node(inode)
        if node.is_dir:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        # Generated files are snapshot at open and never cached; the rest stay cached across opens.
        served = memory_file(node.render()) if node.render else node.served()
        if served.stream is not None:
            self.engine.opened(served.stream)
        fh, self._next_fh = self._next_fh, self._next_fh + 1
        self._handles[fh] = served
        return pyfuse3.FileInfo(fh=fh, direct_io=node.render is not None, keep_cache=node.render is None)

    async def read(self, fh, off, size):
        served = self._handles[fh]
        end = min(off + size, served.size)
        pieces = []
        try:
            for extent in served.extents_at(off, end):
                lo, hi = max(off, extent.offset), min(end, extent.end)
                if extent.kind == "header":
                    pieces.append(memoryview(served.memory)[lo:hi])
                elif extent.kind == "fill":
                    pieces.append(self._fill.take(hi - lo))
                    self.fill_bytes += hi - lo
                elif extent.kind == "shared":
                    log.error("%s: EIO: this is the view shared by the local ranks; load it through "
                              "the rankfs hook (rankfs run), which sends each rank to its rank-R/ view",
                              served.view)
                    raise pyfuse3.FUSEError(errno.EIO)
                else:
                    await self._read_data(served, extent, lo, hi, pieces)
        except BackingError as exc:
            log.error("%s: EIO for bytes %d-%d: %s", served.view, off, end, exc)
            raise pyfuse3.FUSEError(errno.EIO) from None
        self.requests += 1
        self.request_bytes += end - off
        if len(pieces) == 1:
            return pieces[0]
        return b"".join(pieces)

    async def _read_data(self, served: ServedFile, extent, lo: int, hi: int, pieces: list):
        for chunk in served.runs[extent.offset].overlapping(lo, hi):
            a, b = max(lo, chunk.start), min(hi, chunk.end)
            pieces.append(await self.engine.read(chunk, a, b))
            self.engine.served(chunk, b - a)

    async def release(self, fh):
        served = self._handles.pop(fh, None)
        if served is not None and served.stream is not None:
            self.engine.closed(served.stream)
