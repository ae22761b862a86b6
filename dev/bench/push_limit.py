"""The view's ceiling on this host: how fast the kernel takes pushes (`notify_store`) into the page
cache of FUSE files when pushing is all a daemon does. The rank's bytes, as `rank_ranges` lists
them, are pushed from populated maps of their sources, as rankfs' daemon pushes them: one virtual
file per source holding the rank's ranges of it, 16 threads (twice the cores where that is fewer),
8 MiB pieces taken from every file in turn (on the GPU host one file's page cache stopped near
6-7 GB/s, several took 20+ GB/s). Cold, the maps read the disk first. Run by `dev.bench.paths push`,
which mounts the files at `mountpoint` for the run.
"""

from __future__ import annotations

import errno
import itertools
import mmap
import os
import stat
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyfuse3
import trio

from dev.bench.engine_like import Progress
from rankfs.reader.io import MADV_POPULATE_READ, covering_pages, madvise, willneed_pieces, willneed_reach

PIECE_BYTES = 8 << 20
THREADS = min(16, 2 * (os.cpu_count() or 1))


class PushedFiles(pyfuse3.Operations):
    """Read-only files named 0, 1, ... of the given sizes, whose bytes only ever arrive by pushes."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.sizes = sizes

    @staticmethod
    def inode(index: int) -> int:
        return pyfuse3.ROOT_INODE + 1 + index

    async def getattr(self, inode, ctx=None):
        attrs = pyfuse3.EntryAttributes()
        if inode == pyfuse3.ROOT_INODE:
            attrs.st_mode, attrs.st_size = stat.S_IFDIR | 0o555, 0
        else:
            attrs.st_mode, attrs.st_size = stat.S_IFREG | 0o444, self.sizes[inode - pyfuse3.ROOT_INODE - 1]
        attrs.st_ino = inode
        attrs.attr_timeout = attrs.entry_timeout = 3600
        return attrs

    async def lookup(self, parent_inode, name, ctx=None):
        if not name.isdigit() or int(name) >= len(self.sizes):
            raise pyfuse3.FUSEError(errno.ENOENT)
        return await self.getattr(self.inode(int(name)))

    async def open(self, inode, flags, ctx):
        return pyfuse3.FileInfo(fh=inode, keep_cache=True)

    async def read(self, fh, off, size):
        raise pyfuse3.FUSEError(errno.EIO)  # nothing reads them: the run only pushes


def push_pieces(ranges: list[tuple[str, int, int]]) -> tuple[list[int], list[tuple[int, int, str, int, int]]]:
    """The files' sizes, and (file, file offset, source, source offset, length) of each piece, the
    files taken in turn."""
    by_source: dict[str, list[tuple[int, int]]] = {}
    for path, offset, length in ranges:
        by_source.setdefault(path, []).append((offset, length))
    sizes, per_file = [], []
    for index, (path, spans) in enumerate(by_source.items()):
        pieces, at = [], 0
        for offset, length in spans:
            for step in range(0, length, PIECE_BYTES):
                size = min(PIECE_BYTES, length - step)
                pieces.append((index, at + step, path, offset + step, size))
            at += length
        sizes.append(at)
        per_file.append(pieces)
    turns = [p for turn in itertools.zip_longest(*per_file) for p in turn if p is not None]
    return sizes, turns


def _push_all(mountpoint: str, ranges, timed) -> dict:
    """Runs in a thread beside the FUSE loop: opens the files (the kernel must know them before a
    push), then pushes every piece from THREADS threads, timed by `timed` (the benchmark's clock,
    dev.bench.paths). The maps stay until the process ends."""
    sizes, pieces = push_pieces(ranges)
    handles = [os.open(os.path.join(mountpoint, str(i)), os.O_RDONLY) for i in range(len(sizes))]
    sources = {}
    for path in dict.fromkeys(p[2] for p in pieces):
        fd = os.open(path, os.O_RDONLY)
        source = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        source.madvise(mmap.MADV_RANDOM)  # the populate faults in what WILLNEED read, nothing around
        sources[path] = (fd, np.frombuffer(source, np.uint8), willneed_reach(path))
    progress = Progress()

    def push(piece):
        index, at, path, offset, length = piece
        fd, source, reach = sources[path]
        for start, size in willneed_pieces(offset, length, reach):
            os.posix_fadvise(fd, start, size, os.POSIX_FADV_WILLNEED)
        begin, end = covering_pages(offset, offset + length)
        end = min(end, len(source))
        madvise(source.ctypes.data + begin, end - begin, MADV_POPULATE_READ)
        pyfuse3.notify_store(PushedFiles.inode(index), at, source[offset:offset + length])
        madvise(source.ctypes.data + begin, end - begin, mmap.MADV_DONTNEED)
        progress.add(length)

    def work():
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(push, pieces))
    try:
        return timed(work, progress)
    finally:
        for fd in handles:
            os.close(fd)


def run_push(args: dict, timed) -> dict:
    """Mount the files at args["mountpoint"], push args["ranges"] into them, unmount."""
    sizes, _ = push_pieces(args["ranges"])
    pyfuse3.init(PushedFiles(sizes), args["mountpoint"], {"fsname=rankfs-push-limit", "ro"})
    result = {}

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pyfuse3.main)
            try:
                result.update(await trio.to_thread.run_sync(_push_all, args["mountpoint"], args["ranges"], timed))
            finally:
                pyfuse3.terminate()
    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)
    return result
