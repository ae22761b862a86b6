"""The FUSE operations: a thin layer that turns the kernel's requests into extents of the tree and
asks the read engine for the bytes.

Caveats:
- Everything runs on pyfuse3's one trio thread; replies are copied there too. A reply made of one
  piece is the engine's memory itself, owned until the reply is written: pyfuse3 writes it right
  after the handler returns, before the task yields, so the ownership ends in a task that runs after
  (`ReadEngine.replying`).
- The mount is not `ro` (the control file takes commands), so every handler that would change the
  tree refuses with EROFS, as a read-only mount would.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from typing import Awaitable, Callable

import pyfuse3

from rankfs.reader.engine import BackingError, ReadEngine
from rankfs.vfs.push import Listings
from rankfs.vfs.tree import Content, Node, Tree, memory_content

log = logging.getLogger("rankfs.fs")

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND


class RankFS(pyfuse3.Operations):
    def __init__(self, tree: Tree, engine: ReadEngine, command: Callable[[str, int], Awaitable[None]]):
        super().__init__()
        self.tree = tree
        self.engine = engine
        self.command = command  # carries out a control-file command written by process `pid`
        self.listings = Listings(engine)  # its `push_ahead` runs beside the mount
        self._handles: dict[int, Content | int] = {}  # fh -> its file, or the writer's pid (control)
        self._direct: set[int] = set()  # the handles opened with O_DIRECT
        self._next_fh = 1
        self.requests = 0  # reads answered, and their bytes: the average tells the request size
        self.request_bytes = 0
        self.fill_bytes = 0  # of them, bytes outside a rank's slices: read-around, not the loader

    def counters(self) -> dict:
        return {"requests": self.requests, "request_bytes": self.request_bytes, "fill_bytes": self.fill_bytes}

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
        node = self._node(inode)
        if node is not self.tree.command:  # the control file takes the truncation of `echo drop >`
            raise pyfuse3.FUSEError(errno.EROFS)
        return self._attributes(node)

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

    # What a read-only mount refuses.
    async def _read_only(self, *args, **kwargs):
        raise pyfuse3.FUSEError(errno.EROFS)

    setxattr = removexattr = mknod = mkdir = unlink = rmdir = symlink = rename = link = create = _read_only

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
        fh, self._next_fh = self._next_fh, self._next_fh + 1
        if node is self.tree.command:
            if flags & os.O_ACCMODE != os.O_WRONLY:
                raise pyfuse3.FUSEError(errno.EACCES)
            self._handles[fh] = ctx.pid
            return pyfuse3.FileInfo(fh=fh, direct_io=True)
        if flags & WRITE_FLAGS:
            raise pyfuse3.FUSEError(errno.EROFS)
        # Generated files are snapshot at open and never cached; the rest stay cached across opens.
        content = memory_content(node.render()) if node.render else node.content()
        direct = bool(flags & os.O_DIRECT)
        if direct:
            self._direct.add(fh)
        if content.stream is not None:
            push = self.engine.opened(content.stream, direct, process_of(ctx.pid))
            if not direct:  # a direct reader never reads through the pages a listing's push is for
                await self.listings.opened(inode, content, node.shard, push)
        self._handles[fh] = content
        return pyfuse3.FileInfo(fh=fh, direct_io=node.render is not None, keep_cache=node.render is None)

    async def write(self, fh, off, buf):
        pid = self._handles[fh]
        try:
            await self.command(buf.decode("utf-8", "replace"), pid)
        except ValueError as exc:
            log.warning("control: process %d: %s", pid, exc)
            raise pyfuse3.FUSEError(errno.EINVAL) from None
        return len(buf)

    async def read(self, fh, off, size):
        began = time.monotonic()
        content = self._handles[fh]
        direct = fh in self._direct
        end = min(off + size, content.size)
        pieces, owned = [], []
        try:
            for extent in content.extents_at(off, end):
                lo, hi = max(off, extent.offset), min(end, extent.end)
                if extent.kind == "header":
                    pieces.append(memoryview(content.memory)[lo:hi])
                elif extent.kind == "fill":
                    pieces.append(self.engine.fill.take(hi - lo))
                    self.fill_bytes += hi - lo
                elif extent.kind == "shared":
                    log.error("%s: EIO: this is the view shared by the local ranks; load it through "
                              "the rankfs hook (rankfs run), which sends each rank to its rank-R/ view",
                              content.path)
                    raise pyfuse3.FUSEError(errno.EIO)
                else:
                    for chunk in content.runs[extent.offset].overlapping(lo, hi):
                        a, b = max(lo, chunk.start), min(hi, chunk.end)
                        piece, backing = await self.engine.read(chunk, a, b, direct)
                        pieces.append(piece)
                        if backing is not None:
                            owned.append(backing)
                        self.engine.answered(chunk, a, b)
        except BaseException as exc:  # nothing is replied from what was gathered
            self.engine.replied(owned)
            if isinstance(exc, BackingError):
                log.error("%s: EIO for bytes %d-%d (tensor %s): %s", content.path, off, end,
                          content.tensors_at(off, end), exc)
                raise pyfuse3.FUSEError(errno.EIO) from None
            raise
        self.requests += 1
        self.request_bytes += end - off
        self.engine.trace.request(content.path, off, end - off, time.monotonic() - began)
        if len(pieces) == 1:  # the reply may be the engine's memory: owned until it is written
            if owned:
                self.engine.replying(owned)
            return pieces[0]
        reply = b"".join(pieces)
        self.engine.replied(owned)
        return reply

    async def release(self, fh):
        content = self._handles.pop(fh, None)
        direct = fh in self._direct
        self._direct.discard(fh)
        if isinstance(content, Content) and content.stream is not None:
            self.engine.closed(content.stream, direct)


def process_of(thread_id: int) -> int:
    """The process of the thread a request came from (FUSE names the thread); the thread's own id
    where /proc cannot say (one outside the daemon's pid namespace is 0)."""
    try:
        with open(f"/proc/{thread_id}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("Tgid:"))
    except (OSError, StopIteration, ValueError):
        return thread_id
