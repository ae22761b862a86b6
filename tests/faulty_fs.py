"""A small FUSE filesystem for the tests: a directory's files as they are, read only, but reads of one
file that touch [OFFSET, OFFSET + LENGTH) fail with EIO, as a disk's bad sectors would. A checkpoint
seen through it is a source shard that fails mid-load.

    python3 tests/faulty_fs.py SOURCE_DIR MOUNTPOINT FILE OFFSET LENGTH [MEET]

With MEET, those reads are served instead once MEET of them are in flight at once, or after a
fifth of a second alone: a disk that only a reader with reads in flight together keeps busy. At
the unmount it prints how many met and how many were served alone.

Prints "ready" once mounted; serves until unmounted."""

from __future__ import annotations

import errno
import os
import stat
import sys

import pyfuse3
import trio

ROOT = pyfuse3.ROOT_INODE


class Faulty(pyfuse3.Operations):
    def __init__(self, source: str, bad_file: str, offset: int, length: int, meet: int = 0):
        super().__init__()
        self.meet = meet
        self.waiting: list[trio.Event] = []  # reads of the range waiting to meet others
        self.met = self.alone = 0
        self.source = source
        self.names = sorted(os.listdir(source))
        self.inodes = {name: ROOT + 1 + i for i, name in enumerate(self.names)}
        self.bad = (self.inodes[bad_file], offset, offset + length)
        self.fds: dict[int, int] = {}

    def _path(self, inode: int) -> str:
        return os.path.join(self.source, self.names[inode - ROOT - 1])

    async def getattr(self, inode, ctx=None):
        attrs = pyfuse3.EntryAttributes()
        st = os.stat(self.source if inode == ROOT else self._path(inode))
        attrs.st_ino, attrs.st_size, attrs.st_nlink = inode, st.st_size, 1
        attrs.st_mode = (stat.S_IFDIR | 0o755) if inode == ROOT else (stat.S_IFREG | 0o444)
        attrs.st_mtime_ns = attrs.st_ctime_ns = attrs.st_atime_ns = st.st_mtime_ns
        attrs.st_uid, attrs.st_gid = os.getuid(), os.getgid()
        return attrs

    async def lookup(self, parent_inode, name, ctx=None):
        inode = self.inodes.get(os.fsdecode(name))
        if parent_inode != ROOT or inode is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(inode)

    async def opendir(self, inode, ctx):
        return inode

    async def readdir(self, fh, start_id, token):
        for i, name in enumerate(self.names[start_id:], start_id + 1):
            if not pyfuse3.readdir_reply(token, os.fsencode(name), await self.getattr(self.inodes[name]), i):
                break

    async def open(self, inode, flags, ctx):
        fd = os.open(self._path(inode), os.O_RDONLY)
        self.fds[fd] = inode
        return pyfuse3.FileInfo(fh=fd)

    async def read(self, fh, off, size):
        inode, begin, end = self.bad
        if self.fds[fh] == inode and off < end and begin < off + size:
            if not self.meet:
                raise pyfuse3.FUSEError(errno.EIO)
            await self._meet()
        return os.pread(fh, size, off)

    async def _meet(self):
        """Served once MEET reads are in flight together (all of them then count as met), or
        alone after a fifth of a second."""
        if len(self.waiting) + 1 >= self.meet:
            for event in self.waiting:
                event.set()
            self.met += len(self.waiting) + 1
            self.waiting = []
            return
        event = trio.Event()
        self.waiting.append(event)
        with trio.move_on_after(0.2):
            await event.wait()
        if not event.is_set():
            self.waiting.remove(event)
            self.alone += 1

    async def release(self, fh):
        del self.fds[fh]
        os.close(fh)


def main(source: str, mountpoint: str, bad_file: str, offset: str, length: str, meet: str = "0"):
    faulty = Faulty(source, bad_file, int(offset), int(length), int(meet))
    pyfuse3.init(faulty, mountpoint, {"fsname=faulty", "ro"})
    print("ready", flush=True)
    try:
        trio.run(pyfuse3.main)
    finally:
        pyfuse3.close(unmount=True)
        print(f"met {faulty.met} alone {faulty.alone}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
