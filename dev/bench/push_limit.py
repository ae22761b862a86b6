"""The view's ceiling on this host: how fast the kernel takes pushes (`notify_store`) into the page
cache of FUSE files when pushing is all a daemon does. The rank's bytes, as `rank_ranges` lists
them, are pushed as the daemon pushes them: from maps of their sources where the page cache holds
them (`reader.source_maps`), else read direct (O_DIRECT) into a buffer first; one virtual file per
source holding the rank's ranges of it, 16 threads (twice the cores where that is fewer), 8 MiB
pieces taken from every file in turn (one file's page cache takes pushes more slowly than several
do). Run by `dev.bench.paths push`, which mounts the files at `mountpoint` for the run.
"""

from __future__ import annotations

import errno
import itertools
import os
import stat
import threading
from concurrent.futures import ThreadPoolExecutor

import pyfuse3
import trio

from dev.bench.engine_like import Progress
from rankfs.common.disk import PAGE, OpenFile, anonymous_map
from rankfs.reader.source_maps import MappedSources

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


def _push_all(mountpoint: str, sizes: list[int], pieces: list[tuple], timed) -> dict:
    """Runs in a thread beside the FUSE loop: opens the files (the kernel must know them before a
    push), then pushes every piece from THREADS threads, timed by `timed` (the benchmark's clock,
    dev.bench.paths): a piece the page cache holds from a map of its source, as the daemon
    serves it; one it does not read direct into the thread's buffer first (faulted in through a
    map it would cost the CPU a page cache fill too, which the daemon's cold reads do not). Adds
    the bytes read direct to the figures."""
    handles = [os.open(os.path.join(mountpoint, str(i)), os.O_RDONLY) for i in range(len(sizes))]
    paths = [path for _, path in sorted({index: path for index, _, path, _, _ in pieces}.items())]
    sources = [OpenFile(path) for path in paths]
    maps = MappedSources(paths, lambda index: sources[index].fd)
    progress = Progress()
    buffers = threading.local()

    def push(piece):
        index, at, path, offset, length = piece
        source = sources[index]
        if source.cached(offset, offset + length):
            pyfuse3.notify_store(PushedFiles.inode(index), at, maps.view(index, offset, offset + length))
            maps.unmap(index, offset, offset + length)
        else:
            if not hasattr(buffers, "memory"):
                buffers.memory = memoryview(anonymous_map(PIECE_BYTES + 2 * PAGE))
            skip = offset % PAGE
            source.read_whole(buffers.memory, skip, offset, length, path)
            pyfuse3.notify_store(PushedFiles.inode(index), at, buffers.memory[skip:skip + length])
        progress.add(length)

    def work():
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(push, pieces))
    try:
        return {**timed(work, progress), "direct_read_bytes": sum(source.direct_read_bytes for source in sources)}
    finally:
        for fd in handles:
            os.close(fd)
        for source in sources:
            source.close()


def run_push(args: dict, timed) -> dict:
    """Mount the files at args["mountpoint"], push args["ranges"] into them, unmount."""
    sizes, pieces = push_pieces(args["ranges"])
    pyfuse3.init(PushedFiles(sizes), args["mountpoint"], {"fsname=rankfs-push-limit", "ro"})
    result = {}

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pyfuse3.main)
            try:
                result.update(await trio.to_thread.run_sync(_push_all, args["mountpoint"], sizes, pieces, timed))
            finally:
                pyfuse3.terminate()
    try:
        trio.run(main)
    finally:
        pyfuse3.close(unmount=True)
    return result
