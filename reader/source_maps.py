"""The source shards as shared read-only maps, for chunks served as they lie on disk.

A chunk read with pread into a buffer is copied twice on its way out (page cache to buffer, buffer to
the reply or the push); served from a map it is copied once. A worker thread asks the kernel to read
the chunk's pages (WILLNEED, in pieces as large as one call reads) and waits until they are in this
process's page tables (MADV_POPULATE_READ), so that the reply, copied on the event-loop thread, never
waits on the disk. Once served, the pages leave the map and the page cache (nothing cached twice).
"""

from __future__ import annotations

import collections
import errno
import mmap
import os
import threading

import numpy as np

from rankfs.common.disk import MADV_POPULATE_READ, covering_pages, madvise, willneed_pieces, willneed_reach


LARGEST_FOLIO = 2 << 20  # the page cache's largest folio on x86-64 (a PMD)


class MappedSources:
    def __init__(self, paths: list, fd_of):
        self._paths = paths
        self._fd_of = fd_of  # source index -> an open fd (the engine's)
        self._maps: dict[int, np.ndarray] = {}
        self._reach: dict[int, int] = {}
        self._live: dict[int, list[tuple[int, int]]] = collections.defaultdict(list)  # viewed, not unmapped
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
        for piece, size in willneed_pieces(begin, end - begin, reach):
            os.posix_fadvise(fd, piece, size, os.POSIX_FADV_WILLNEED)
        with self._lock:
            self._live[index].append((begin, end))
        start, stop = covering_pages(begin, end)
        madvise(source.ctypes.data + start, min(stop, len(source)) - start, MADV_POPULATE_READ)
        # A fault maps the whole (large) folio around the page, beyond what was asked: other ranks'
        # bytes, which would sit in this process's RSS.
        self._unmap_around(index, begin, end)
        return source[begin:end]

    def unmap(self, index: int, begin: int, end: int):
        """Bytes [begin, end) are served: they leave the map, with every page mapped around them
        out to the largest folio's bounds (a fault maps whole folios, so once each range is let go
        nothing stays mapped). Quick: the event-loop thread calls it, so that what is mapped never
        lags behind the budget."""
        with self._lock:
            self._live[index].remove((begin, end))
        self._unmap_around(index, begin, end, holding_gil=True)

    def _unmap_around(self, index: int, begin: int, end: int, holding_gil: bool = False):
        """Unmap the largest-folio-aligned range around [begin, end), but for the pages of ranges
        still viewed: those stay mapped, so that neither a fault nor an eviction slows their reply.
        `holding_gil` on the event loop's thread (see rankfs.common.disk.madvise)."""
        source = self._maps[index]
        around = (begin // LARGEST_FOLIO * LARGEST_FOLIO, min(len(source), -(-end // LARGEST_FOLIO) * LARGEST_FOLIO))
        with self._lock:
            live = [covering_pages(b, e) for b, e in self._live[index] if b < around[1] and e > around[0]]
        pieces = [around]
        for keep_start, keep_stop in live:  # what lies before and after each kept range
            pieces = [(s, t) for start, stop in pieces
                      for s, t in ((start, min(stop, keep_start)), (max(start, keep_stop), stop)) if t > s]
        for start, stop in pieces:
            madvise(source.ctypes.data + start, stop - start, mmap.MADV_DONTNEED, holding_gil)

    def uncache_all(self, ranges: list[tuple[int, int, int]]):
        """(source, begin, end) ranges, unmapped, leave the page cache (slower: a worker thread)."""
        for index, begin, end in ranges:
            start, stop = covering_pages(begin, end)
            os.posix_fadvise(self._fd_of(index), start, stop - start, os.POSIX_FADV_DONTNEED)

    def forget(self):
        """Nothing stays mapped (after a load)."""
        with self._lock:
            maps = list(self._maps.values())
        for source in maps:
            madvise(source.ctypes.data, len(source), mmap.MADV_DONTNEED)
