"""The source shards as shared read-only maps, for chunks served as they lie on disk.

A chunk read with pread into a buffer is copied twice on its way out (page cache to buffer, buffer to
the reply or the push); served from a map it is copied once. A worker thread asks the kernel to read
the chunk's pages (WILLNEED, in pieces as large as one call reads) and waits until they are in this
process's page tables (MADV_POPULATE_READ), so that the reply, copied on the event-loop thread, never
waits on the disk. Once served, the pages leave the map and the page cache (nothing cached twice).
"""

from __future__ import annotations

import errno
import mmap
import os
import threading

import numpy as np

from reader.device import willneed_reach
from reader.pages import MADV_POPULATE_READ, covering_pages, inner_pages, madvise


class MappedSources:
    def __init__(self, paths: list, fd_of):
        self._paths = paths
        self._fd_of = fd_of  # source index -> an open fd (the engine's)
        self._maps: dict[int, np.ndarray] = {}
        self._reach: dict[int, int] = {}
        self._lock = threading.Lock()

    def _map(self, index: int) -> np.ndarray:
        with self._lock:
            if index not in self._maps:
                fd = self._fd_of(index)
                self._reach[index] = willneed_reach(self._paths[index])
                source = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
                # Faults read only the page asked for: `view` has read ahead exactly what it needs,
                # and the kernel's read-around would add other ranks' bytes.
                source.madvise(mmap.MADV_RANDOM)
                self._maps[index] = np.frombuffer(source, np.uint8)
            return self._maps[index]

    def view(self, index: int, begin: int, end: int) -> np.ndarray:
        """Bytes [begin, end) of a source, resident (worker thread: this waits for the disk)."""
        source = self._map(index)
        if end > len(source):
            raise OSError(errno.EFAULT, "beyond the end of the file")
        fd, reach = self._fd_of(index), self._reach[index]
        for piece in range(begin, end, reach):
            os.posix_fadvise(fd, piece, min(reach, end - piece), os.POSIX_FADV_WILLNEED)
        start, stop = covering_pages(begin, end)
        madvise(source.ctypes.data + start, min(stop, len(source)) - start, MADV_POPULATE_READ)
        return source[begin:end]

    def let_go(self, index: int, begin: int, end: int):
        """Bytes [begin, end) are served: their pages leave the map, then the page cache (worker
        thread). A page shared with a neighbour stays mapped for it (and so cached) until `forget`."""
        source = self._maps[index]
        start, stop = inner_pages(begin, end)
        if stop > start:
            madvise(source.ctypes.data + start, stop - start, mmap.MADV_DONTNEED)
        start, stop = covering_pages(begin, end)
        os.posix_fadvise(self._fd_of(index), start, stop - start, os.POSIX_FADV_DONTNEED)

    def forget(self):
        """Nothing stays mapped (after a load)."""
        with self._lock:
            maps = list(self._maps.values())
        for source in maps:
            madvise(source.ctypes.data, len(source), mmap.MADV_DONTNEED)
