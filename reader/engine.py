"""The backing I/O engine: large reads of the source shards in worker threads, ahead of demand, in
the order the loaders consume the views, within a byte budget.

The FUSE layer asks for a chunk's bytes with `await engine.get(chunk)`; everything about disks,
threads, prefetch order and memory lives here. Chunks are anonymous memory maps: page-aligned for
O_DIRECT, and returned to the kernel as soon as the last reference goes (no allocator arena keeps
them).
"""

from __future__ import annotations

import bisect
import collections
import logging
import mmap
import os
import sys
import threading
from dataclasses import dataclass, field

import numpy as np
import trio

from plan.checkpoint import SourceFile
from plan.layout import FILL_BYTE, Extent

log = logging.getLogger("rankfs.reader")

PAGE = 4096
DEFAULT_CHUNK_BYTES = 8 << 20
ON_DEMAND_CHUNK_BYTES = 1 << 20


class BackingError(OSError):
    """A source file that cannot be read as planned; the message names it."""


class BufferPool:
    """Anonymous maps for chunks, reused: a fresh map costs a page fault per 4 KiB, which cuts
    the read rate to a third. A buffer goes back to the pool only once no memoryview of it is left (a reply
    still being written holds one), which its reference count tells. Idle buffers are few, so the
    daemon's memory stays within the budget plus IDLE_MAX buffers."""

    IDLE_MAX = 8

    def __init__(self):
        self._idle: list[mmap.mmap] = []
        self._retired: list[mmap.mmap] = []
        self.created = 0

    def reuse(self, nbytes: int) -> mmap.mmap | None:
        """An idle buffer that fits without wasting more than a quarter (event-loop thread)."""
        self._reclaim()
        for i, buffer in enumerate(self._idle):
            if nbytes <= len(buffer) <= nbytes + nbytes // 4 + PAGE:
                return self._idle.pop(i)
        return None

    def new(self, nbytes: int) -> mmap.mmap:
        """A new buffer (worker thread: mmap releases the GIL while it populates the pages)."""
        self.created += 1
        # No MAP_POPULATE: CPython maps with the GIL held, so the pages fault in during the read
        # instead, in this worker thread, without it.
        return mmap.mmap(-1, -(-nbytes // PAGE) * PAGE)

    def give(self, buffer: mmap.mmap):
        self._retired.append(buffer)

    def _reclaim(self):
        still_viewed = []
        for buffer in self._retired:
            # references: the list, the loop variable, getrefcount's argument
            if sys.getrefcount(buffer) > 3:
                still_viewed.append(buffer)
            elif len(self._idle) < self.IDLE_MAX:
                self._idle.append(buffer)
        self._retired = still_viewed


class Chunk:
    """A piece of a data extent, read from the source in one go."""

    __slots__ = ("start", "length", "source", "source_offset", "row_bytes", "keep_start", "keep_stop",
                 "tensor", "order", "on_demand", "buffer", "backing", "loading", "served", "prefetched",
                 "stream_pos", "error")

    def __init__(self, extent: Extent, start: int, length: int):
        self.start = start  # virtual offset
        self.length = length
        self.source = extent.source
        self.source_offset = extent.source_offset + (start - extent.offset)
        self.row_bytes = extent.row_bytes  # chunks of masked extents hold whole rows
        self.keep_start, self.keep_stop = extent.keep_start, extent.keep_stop
        self.tensor = extent.tensor
        self.order = extent.order
        self.on_demand = extent.on_demand
        self.buffer: memoryview | None = None
        self.backing: mmap.mmap | None = None  # the pool buffer `buffer` views
        self.loading: trio.Event | None = None
        self.served = 0
        self.prefetched = -1  # the prefetch pass that last read it
        self.stream_pos = -1
        self.error: str | None = None  # the last failed read's reason: served as EIO, never as data

    @property
    def end(self) -> int:
        return self.start + self.length

    def read_span(self, direct_io: bool) -> int:
        """Bytes one read of it takes: O_DIRECT widens it to whole pages."""
        if not direct_io:
            return self.length
        return -(-(self.source_offset + self.length) // PAGE) * PAGE - self.source_offset // PAGE * PAGE


def split_extent(extent: Extent, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Chunk]:
    """Chunks of at most chunk_bytes (whole rows for masked extents). On-demand extents (row
    stores) are read in small pieces: their readers touch a few rows, not the whole table."""
    step = ON_DEMAND_CHUNK_BYTES if extent.on_demand else chunk_bytes
    if extent.row_bytes:
        step = max(extent.row_bytes, chunk_bytes // extent.row_bytes * extent.row_bytes)
    return [Chunk(extent, start, min(step, extent.end - start))
            for start in range(extent.offset, extent.end, step)]


@dataclass
class Stream:
    """One view's chunks in the loaders' consumption order; prefetch walks it from `cursor`."""

    name: str
    chunks: list[Chunk]
    cursor: int = 0
    active: bool = False  # the view has been opened
    running: bool = False  # a prefetch pass is under way
    passes: int = 0
    planned_bytes: int = 0
    served_bytes: int = 0


@dataclass
class Stats:
    read_bytes: collections.Counter = field(default_factory=collections.Counter)  # per source index
    on_demand_read_bytes: int = 0  # row stores and plain files, read only when asked
    held_bytes: int = 0
    peak_held_bytes: int = 0
    demand_loads: int = 0
    prefetch_loads: int = 0
    errors: int = 0


class ReadEngine:
    def __init__(self, sources: tuple[SourceFile, ...], budget_bytes: int, workers: int = 8,
                 direct_io: bool = False):
        self.sources = sources
        self.budget = budget_bytes
        self.direct_io = direct_io
        self.stats = Stats()
        self.streams: dict[str, Stream] = {}
        self._limiter = trio.CapacityLimiter(workers)
        self._fds: dict[int, int] = {}
        self._fds_lock = threading.Lock()
        self._pool = BufferPool()
        self._loaded: collections.OrderedDict[int, Chunk] = collections.OrderedDict()  # by load time
        self._budget_freed = trio.Event()
        self._nursery: trio.Nursery | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def add_stream(self, name: str, files_chunks: list[list[Chunk]]) -> Stream:
        """Register a view: its files' chunks, files in the view's order."""
        ordered = sorted((c for chunks in files_chunks for c in chunks), key=lambda c: c.order)
        prefetchable = [c for c in ordered if not c.on_demand]
        for pos, chunk in enumerate(prefetchable):
            chunk.stream_pos = pos
        stream = Stream(name, prefetchable, planned_bytes=sum(c.length for c in prefetchable))
        self.streams[name] = stream
        return stream

    def activate(self, stream: Stream):
        """Start prefetching a view (called when the loader first opens one of its files)."""
        stream.active = True
        if not stream.running and stream.cursor < len(stream.chunks):
            self._start_pass(stream, stream.cursor)

    def _start_pass(self, stream: Stream, position: int):
        stream.running, stream.cursor, stream.passes = True, position, stream.passes + 1
        self._nursery.start_soon(self._prefetch, stream)

    async def run(self, task_status=trio.TASK_STATUS_IGNORED):
        """Own the prefetch tasks until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # -- serving --------------------------------------------------------------------------------

    async def get(self, chunk: Chunk, stream: Stream | None) -> memoryview:
        """The chunk's bytes: from memory, from a read in flight, or read now."""
        buffer = chunk.buffer
        while buffer is None:
            if chunk.loading is None:
                self.stats.demand_loads += 1
                if stream is not None and chunk.stream_pos >= 0:
                    self._follow_demand(stream, chunk)
                self._make_room(chunk.length)
                chunk.loading = trio.Event()
                await self._load(chunk)
            else:
                await chunk.loading.wait()
            if chunk.error is not None:
                raise BackingError(f"{chunk.error} (tensor {chunk.tensor})")
            # Another reader may have consumed and released it meanwhile: then read it again.
            buffer = chunk.buffer
        return buffer

    def served(self, chunk: Chunk, nbytes: int, stream: Stream | None):
        """Account bytes handed to the kernel; a chunk served whole is released."""
        chunk.served += nbytes
        if stream is not None and not chunk.on_demand:
            stream.served_bytes += nbytes
        if chunk.served >= chunk.length and chunk.buffer is not None:
            self._release(chunk)

    def buffer_stats(self) -> dict:
        return {"created": self._pool.created, "idle": len(self._pool._idle),
                "awaiting_replies": len(self._pool._retired)}

    def drop(self):
        """Release every chunk in memory (after the load, or on request). A view read again after
        a drop (another engine, a restart) is prefetched from its start again."""
        for chunk in list(self._loaded.values()):
            self._release(chunk)
        for stream in self.streams.values():
            stream.cursor = 0
            for chunk in stream.chunks:
                chunk.served = 0

    # -- internals ------------------------------------------------------------------------------

    def _follow_demand(self, stream: Stream, chunk: Chunk):
        # A loader far ahead of the prefetcher: skip to where it reads rather than fill the budget
        # with bytes it has passed.
        window = max(1, self.budget // DEFAULT_CHUNK_BYTES)
        if stream.running and chunk.stream_pos - stream.cursor > window:
            stream.cursor = chunk.stream_pos + 1

    async def _prefetch(self, stream: Stream):
        try:
            await self._prefetch_pass(stream)
        finally:
            stream.running = False

    async def _prefetch_pass(self, stream: Stream):
        while stream.cursor < len(stream.chunks):
            chunk = stream.chunks[stream.cursor]
            stream.cursor += 1
            if chunk.buffer is not None or chunk.loading is not None or chunk.prefetched == stream.passes:
                continue
            while self.stats.held_bytes and self.stats.held_bytes + chunk.length > self.budget:
                await self._budget_freed.wait()
            if chunk.buffer is not None or chunk.loading is not None:
                continue
            chunk.prefetched = stream.passes
            self.stats.prefetch_loads += 1
            self._reserve(chunk.length)
            chunk.loading = trio.Event()  # before the task starts: a demand read must wait for it
            self._nursery.start_soon(self._load, chunk)

    def _reserve(self, nbytes: int):
        self.stats.held_bytes += nbytes
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self.stats.held_bytes)

    def _make_room(self, nbytes: int):
        """Demand reads may not wait for the budget: evict the oldest unconsumed chunks instead."""
        self._reserve(nbytes)
        while self.stats.held_bytes > self.budget and self._loaded:
            self._release(next(iter(self._loaded.values())))

    def _unreserve(self, nbytes: int):
        self.stats.held_bytes -= nbytes
        self._budget_freed.set()  # wake a prefetcher waiting for room
        self._budget_freed = trio.Event()

    def _release(self, chunk: Chunk):
        if self._loaded.pop(id(chunk), None) is not None:
            chunk.buffer = None
            self._pool.give(chunk.backing)
            chunk.backing = None
            self._unreserve(chunk.length)

    async def _load(self, chunk: Chunk):
        """Read a chunk whose `loading` event is set, and wake whoever waits on it."""
        try:
            reused = self._pool.reuse(chunk.read_span(self.direct_io))
            chunk.backing, chunk.buffer = await trio.to_thread.run_sync(self._read_chunk, chunk, reused,
                                                                        limiter=self._limiter)
            chunk.error = None
            if chunk.on_demand:
                self.stats.on_demand_read_bytes += chunk.length
            else:
                self.stats.read_bytes[chunk.source] += chunk.length
            self._loaded[id(chunk)] = chunk
        except Exception as exc:  # any failure: the readers get EIO, the daemon keeps serving
            self.stats.errors += 1
            self._unreserve(chunk.length)
            chunk.error = str(exc)
            log.error("backing read failed: %s (tensor %s)", exc, chunk.tensor,
                      exc_info=not isinstance(exc, OSError))
        finally:
            event, chunk.loading = chunk.loading, None
            event.set()

    def _fd(self, index: int) -> int:
        with self._fds_lock:  # worker threads
            if index not in self._fds:
                flags = os.O_RDONLY | (os.O_DIRECT if self.direct_io else 0)
                self._fds[index] = os.open(self.sources[index].path, flags)
            return self._fds[index]

    def _check_unchanged(self, source: SourceFile):
        try:
            st = os.stat(source.path)
        except OSError as exc:
            raise BackingError(f"{source.path}: {exc.strerror}") from None
        now = (st.st_size, st.st_mtime_ns, st.st_ino)
        if now != (source.size, source.mtime_ns, source.inode):
            raise BackingError(f"{source.path}: changed since it was mounted "
                               f"(size {source.size} -> {st.st_size}, mtime or inode differ); "
                               "remount to serve the new file")

    def _read_chunk(self, chunk: Chunk, buffer: mmap.mmap | None) -> tuple[mmap.mmap, memoryview]:
        """Runs in a worker thread: one large read, fill outside the slice, drop the source's cache."""
        source = self.sources[chunk.source]
        self._check_unchanged(source)
        fd = self._fd(chunk.source)
        begin, end = chunk.source_offset, chunk.source_offset + chunk.length
        if self.direct_io:  # O_DIRECT reads whole aligned pages
            begin, skip = begin - begin % PAGE, begin % PAGE
            end = -(-end // PAGE) * PAGE
        else:
            skip = 0
        if buffer is None:
            buffer = self._pool.new(end - begin)
        view = memoryview(buffer)[:end - begin]
        done = 0
        while done < end - begin:
            try:
                n = os.preadv(fd, [view[done:]], begin + done)
            except OSError as exc:
                raise BackingError(f"{source.path}: read at offset {begin + done} failed: "
                                   f"{exc.strerror}") from None
            if n == 0:
                break
            done += n
        if done < skip + chunk.length:
            raise BackingError(f"{source.path}: short read at offset {chunk.source_offset} "
                               f"({done - skip} of {chunk.length} bytes); the file was truncated")
        if not self.direct_io:
            os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_DONTNEED)
        data = view[skip:skip + chunk.length]
        if chunk.row_bytes:
            rows = np.frombuffer(data, np.uint8).reshape(-1, chunk.row_bytes)
            rows[:, :chunk.keep_start] = FILL_BYTE
            rows[:, chunk.keep_stop:] = FILL_BYTE
        return buffer, data


def overlapping(runs, starts: list[int], offset: int, end: int):
    """The runs (sorted, adjacent, each with .end; `starts` their first offsets) overlapping
    [offset, end)."""
    i = max(0, bisect.bisect_right(starts, offset) - 1)
    while i < len(runs) and starts[i] < end:
        if runs[i].end > offset:
            yield runs[i]
        i += 1


class ChunkRun:
    """The chunks of one data extent, found by offset."""

    def __init__(self, extent: Extent, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.chunks = split_extent(extent, chunk_bytes)
        self._starts = [c.start for c in self.chunks]

    def overlapping(self, offset: int, end: int):
        return overlapping(self.chunks, self._starts, offset, end)
