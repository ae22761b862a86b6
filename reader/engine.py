"""The backing I/O engine: large reads of the source shards in worker threads, ahead of demand, in
the order the loaders consume the views, within a byte budget.

The FUSE layer asks for a chunk's bytes with `await engine.read(chunk, lo, hi)`; everything
about disks, threads, prefetch order and memory lives here. A chunk served as it lies on disk is a
range of its source's map (`reader.mapped`: one copy on its way out, not two); the others (sliced
rows filled outside the slice, O_DIRECT reads) are read into anonymous memory maps: page-aligned for
O_DIRECT, and returned to the kernel as soon as the last reference goes (no allocator arena keeps
them).

Prefetched chunks well ahead of the loader are offered on `pushable` to whoever can put them into the
kernel's page cache (the serving layer's pusher); a pushed chunk keeps only its edges, the bytes
outside whole pages and its first page. That first page is left out on purpose: the loader's read of
it is the signal that the chunk is being consumed, which is when its bytes stop counting against the
budget.
"""

from __future__ import annotations

import bisect
import collections
import logging
import math
import mmap
import os
import sys
import threading
from dataclasses import dataclass, field

import numpy as np
import trio

from plan.checkpoint import SourceFile
from plan.layout import FILL_BYTE, Extent
from reader.device import open_for_exact_reads
from reader.mapped import MappedSources
from reader.pages import PAGE

log = logging.getLogger("rankfs.reader")

DEFAULT_CHUNK_BYTES = 8 << 20
ON_DEMAND_CHUNK_BYTES = 1 << 20
# Chunks this close after the loader's furthest read are about to be read: they are answered from
# their buffers, not pushed (a push would wait on the page locks of those reads).
PUSH_GAP_CHUNKS = 4
# A pushed chunk whose first page was never read (evicted, or skipped) stops counting against the
# budget once the loader is this many chunks past it.
PUSH_LAG_CHUNKS = 32
MIN_PUSH_BYTES = 64 << 10
# What reads the loader waits on may hold beyond the budget before prefetched chunks are evicted
# for them: a few of them at a time, answered and released right away.
DEMAND_SLACK = 64 << 20


class BackingError(OSError):
    """A source file that cannot be read as planned; the message names it."""


class BufferPool:
    """Anonymous maps for chunks, reused: a fresh map costs a page fault per 4 KiB, which cuts
    the read rate to a third. Sizes come in classes a quarter octave apart, so that chunks of any
    size find an idle buffer at most a quarter larger than they need; the budget counts class sizes.
    A buffer goes back to the pool only once no memoryview of it is left (a reply still being
    written holds one), which its reference count tells. Idle buffers are kept while they and the
    buffers in use fit in the budget plus IDLE_SLACK, which bounds the daemon's memory."""

    IDLE_SLACK = 64 << 20

    def __init__(self, budget_bytes: int):
        self.budget = budget_bytes
        self._idle: list[mmap.mmap] = []
        self._retired: list[mmap.mmap] = []
        self.created = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        step = max(PAGE, 1 << max(0, nbytes.bit_length() - 3))
        return -(-nbytes // step) * step

    def take(self, nbytes: int, held_bytes: int) -> mmap.mmap | None:
        """An idle buffer of nbytes' class, if there is one (event-loop thread)."""
        self.fit(held_bytes)
        size = self.size_class(nbytes)
        for i, buffer in enumerate(self._idle):
            if len(buffer) == size:
                return self._idle.pop(i)
        return None

    def new(self, nbytes: int) -> mmap.mmap:
        """A new buffer (worker thread: the pages fault in during the read, without the GIL; with
        MAP_POPULATE CPython would fault them in holding it)."""
        self.created += 1
        return mmap.mmap(-1, self.size_class(nbytes))

    def trim(self):
        """Give the idle buffers back to the kernel (after a load)."""
        self._idle.clear()

    def give(self, buffer: mmap.mmap):
        self._retired.append(buffer)

    def fit(self, held_bytes: int):
        """Take back buffers no reply views; keep idle ones only while they fit (event-loop thread)."""
        still_viewed = []
        for buffer in self._retired:
            # references: the list, the loop variable, getrefcount's argument
            if sys.getrefcount(buffer) > 3:
                still_viewed.append(buffer)
            else:
                self._idle.append(buffer)
        self._retired = still_viewed
        room = self.budget + self.IDLE_SLACK - held_bytes
        idle_bytes = sum(len(b) for b in self._idle)
        while self._idle and idle_bytes > room:
            idle_bytes -= len(self._idle.pop(0))  # the oldest go back to the kernel


class Chunk:
    """A piece of a data extent, read from the source in one go."""

    __slots__ = ("start", "length", "source", "source_offset", "row_bytes", "keep_start", "keep_stop",
                 "tensor", "order", "on_demand", "buffer", "backing", "loading", "served", "prefetched",
                 "stream_pos", "error", "file_id", "head", "tail", "file")

    def __init__(self, extent: Extent, start: int, length: int):
        self.start = start  # virtual offset
        self.length = length
        self.source = extent.source
        self.source_offset = extent.source_offset + (start - extent.offset)
        self.row_bytes = extent.row_bytes  # chunks of masked extents hold whole rows
        self.keep_start, self.keep_stop = extent.keep_start, extent.keep_stop
        self.tensor = extent.tensor
        self.order = extent.order_of(start, start + length)
        self.on_demand = extent.on_demand
        self.buffer: memoryview | None = None
        self.backing: mmap.mmap | np.ndarray | None = None  # what `buffer` views: a pool buffer or a map's range
        self.loading: trio.Event | None = None
        self.served = 0
        self.prefetched = -1  # the prefetch pass that last read it
        self.stream_pos = -1  # position in its file's stream
        self.file: FileStream | None = None
        self.error: str | None = None  # the last failed read's reason: served as EIO, never as data
        self.file_id = 0  # the virtual file it belongs to (the serving layer's inode)
        self.head = b""  # once pushed: the bytes before the pushed pages, and after them
        self.tail = b""

    @property
    def end(self) -> int:
        return self.start + self.length

    def edge(self, lo: int, hi: int) -> memoryview | None:
        """Bytes [lo, hi) from the edges a push left, if they hold them."""
        if self.head and hi <= self.start + len(self.head):
            return memoryview(self.head)[lo - self.start:hi - self.start]
        if self.tail and lo >= self.end - len(self.tail):
            return memoryview(self.tail)[lo - (self.end - len(self.tail)):hi - (self.end - len(self.tail))]
        return None

    def push_range(self) -> tuple[int, int]:
        """The whole pages a push stores: all but the first page and the partial ones."""
        return -(-self.start // PAGE) * PAGE + PAGE, self.end // PAGE * PAGE

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
class FileStream:
    """One virtual file's prefetchable chunks in the loaders' consumption order. Loaders read
    several files at once (SGLang's iterator eight), each in its own order, so each file has its
    own prefetch cursor and its own frontier: the furthest position the loader has read."""

    view: "Stream"
    chunks: list[Chunk]
    cursor: int = 0
    frontier: int = -1
    handles: int = 0  # open file handles
    reading: bool = False  # read since it was opened: a loader is consuming it

    def lead(self) -> int:
        return self.cursor - self.frontier


@dataclass
class Stream:
    """One view: its files in the order the loaders open them."""

    name: str
    files: list[FileStream] = field(default_factory=list)
    active: bool = False  # a file of the view has been opened
    running: bool = False  # a prefetch pass is under way
    passes: int = 0
    planned_bytes: int = 0
    served_bytes: int = 0

    def next_chunk(self) -> Chunk | None:
        """What to prefetch next: in the open file the prefetcher is least ahead in, else in the
        first file not read yet (loaders that open one file at a time)."""
        being_read = [f for f in self.files if f.reading and f.cursor < len(f.chunks)]
        candidates = being_read or [f for f in self.files if f.cursor < len(f.chunks)][:1]
        if not candidates:
            return None
        file = min(candidates, key=FileStream.lead)
        file.cursor += 1
        return file.chunks[file.cursor - 1]


@dataclass
class Stats:
    read_bytes: collections.Counter = field(default_factory=collections.Counter)  # per source index
    on_demand_read_bytes: int = 0  # row stores and plain files, read only when asked
    held_bytes: int = 0
    peak_held_bytes: int = 0
    demand_loads: int = 0
    prefetch_loads: int = 0
    pushed_bytes: int = 0
    remnant_bytes: int = 0  # read again for what the loader had not read of a chunk let go
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
        self._pool = BufferPool(budget_bytes)
        self._maps = MappedSources([s.path for s in sources], self._fd)
        self._served_ranges: list[tuple[np.ndarray, int, int, int]] = []  # mapped, maybe still in replies
        self._loaded: collections.OrderedDict[int, Chunk] = collections.OrderedDict()  # by load time
        self._pushed: dict[int, Chunk] = {}  # those of them whose buffer went after a push
        self._budget_freed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._pushable_send, self.pushable = trio.open_memory_channel(math.inf)
        self._pushing = False
        self.drops = 0  # a push begun before a drop must not leave its pages behind after it

    # -- set-up ---------------------------------------------------------------------------------

    def add_stream(self, name: str, files_chunks: list[list[Chunk]]) -> list[FileStream]:
        """Register a view: its files' chunks, files in the view's order. Returns their streams."""
        stream = Stream(name)
        for chunks in files_chunks:
            prefetchable = sorted((c for c in chunks if not c.on_demand), key=lambda c: c.order)
            file = FileStream(stream, prefetchable)
            for pos, chunk in enumerate(prefetchable):
                chunk.stream_pos, chunk.file = pos, file
            stream.files.append(file)
            stream.planned_bytes += sum(c.length for c in prefetchable)
        self.streams[name] = stream
        return stream.files

    def opened(self, file: FileStream):
        file.handles += 1

    def closed(self, file: FileStream):
        file.handles -= 1
        file.reading = file.reading and file.handles > 0
        self._let_go_of_served_ranges()

    def _reading(self, file: FileStream):
        """A loader reads a file: prefetch it (and the view's next files) from now on. Only reads
        count: opening a file to drop its cache, or to look at it, starts nothing."""
        file.reading = file.view.active = True
        if not file.view.running:
            file.view.running, file.view.passes = True, file.view.passes + 1
            self._nursery.start_soon(self._prefetch, file.view)

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

    async def read(self, chunk: Chunk, lo: int, hi: int) -> memoryview:
        """Bytes [lo, hi) (file offsets) of the chunk: from memory, from a read in flight, or read now."""
        self._let_go_of_served_ranges()  # what earlier replies were copied from
        file = chunk.file
        if file is not None and not file.reading:
            self._reading(file)
        if file is not None and chunk.stream_pos > file.frontier:
            file.frontier = chunk.stream_pos
            self._retire_passed(file)
        edge = chunk.edge(lo, hi) if chunk.buffer is None else None
        if edge is not None:
            return edge
        buffer = chunk.buffer
        while buffer is None:
            if chunk.loading is None and chunk.served and self._served_as_on_disk(chunk):
                remnant = await self._read_remnant(chunk, lo, hi)
                if remnant is not None:
                    return remnant
            if chunk.loading is None:
                self.stats.demand_loads += 1
                if file is not None:
                    self._follow_demand(file, chunk)
                self._release(chunk)  # pushed, and its pages since evicted: read it anew
                self._make_room(self._cost(chunk))
                chunk.loading = trio.Event()
                await self._load(chunk)
            else:
                await chunk.loading.wait()
            if chunk.error is not None:
                raise BackingError(f"{chunk.error} (tensor {chunk.tensor})")
            # Another reader may have consumed and released it meanwhile: then read it again.
            buffer = chunk.buffer
        return buffer[lo - chunk.start:hi - chunk.start]

    async def _read_remnant(self, chunk: Chunk, lo: int, hi: int) -> memoryview | None:
        """Bytes of a chunk that was let go before the loader read all of it (pushed, then passed,
        or evicted): only those, from the source's map, not the whole chunk again. None where the
        map cannot serve them (the chunk read then says why)."""
        begin = chunk.source_offset + (lo - chunk.start)
        mapped = await trio.to_thread.run_sync(self._mapped_range, chunk.source, begin, begin + hi - lo,
                                               limiter=self._limiter)
        if mapped is None:
            return None
        self.stats.remnant_bytes += hi - lo
        self.stats.read_bytes[chunk.source] += hi - lo
        self._served_ranges.append((mapped, chunk.source, begin, begin + hi - lo))
        return memoryview(mapped)

    def served(self, chunk: Chunk, nbytes: int):
        """Account bytes handed to the kernel; a chunk served whole is released."""
        chunk.served += nbytes
        if chunk.file is not None:
            chunk.file.view.served_bytes += nbytes
        if chunk.served >= chunk.length:
            self._release(chunk)

    # -- pushing into the kernel's page cache ---------------------------------------------------

    def enable_push(self):
        """Offer prefetched chunks on `pushable` from now on."""
        self._pushing = True

    def push_range(self, chunk: Chunk) -> tuple[int, int] | None:
        """What to push of an offered chunk now, or None: it was read meanwhile, the loader is about
        to read it, or too little of it lies on whole pages."""
        if chunk.buffer is None or chunk.served or chunk.stream_pos <= chunk.file.frontier + PUSH_GAP_CHUNKS:
            return None
        start, end = chunk.push_range()
        return (start, end) if end - start >= MIN_PUSH_BYTES else None

    def pushed(self, chunk: Chunk, start: int, end: int):
        """[start, end) of the chunk is in the kernel's page cache: keep only the edges. The chunk
        still counts against the budget until the loader reads its first page."""
        if chunk.buffer is None:
            return  # dropped while it was being pushed
        a, b = start - chunk.start, end - chunk.start
        chunk.head, chunk.tail = bytes(chunk.buffer[:a]), bytes(chunk.buffer[b:])
        chunk.buffer = None
        self._give_back(chunk)
        self._pushed[id(chunk)] = chunk
        self.stats.pushed_bytes += end - start
        self.served(chunk, end - start)

    def _retire_passed(self, file: FileStream):
        # Pushed chunks far behind the loader whose first page it never asked for (their pages were
        # already cached, or evicted and skipped): no longer ahead of it, so no longer budgeted.
        for chunk in [c for c in self._pushed.values()
                      if c.file is file and c.stream_pos < file.frontier - PUSH_LAG_CHUNKS]:
            self._release(chunk)

    def buffer_stats(self) -> dict:
        return {"created": self._pool.created, "idle": len(self._pool._idle),
                "awaiting_replies": len(self._pool._retired) + len(self._served_ranges),
                "pushed_held": len(self._pushed),
                "mapped_bytes": sum(c.length for c in self._loaded.values() if isinstance(c.backing, np.ndarray)),
                "buffered_bytes": sum(len(c.backing) for c in self._loaded.values() if isinstance(c.backing, mmap.mmap)),
                "idle_bytes": sum(len(b) for b in self._pool._idle)}

    def drop(self):
        """Release every chunk in memory (after the load, or on request). A view read again after
        a drop (another engine, a restart) is prefetched from its start again."""
        self.drops += 1
        for chunk in list(self._loaded.values()):
            self._release(chunk)
        self._pool.trim()
        self._let_go_of_served_ranges()
        self._maps.forget()
        for stream in self.streams.values():
            stream.running, stream.passes = False, stream.passes + 1  # ends the pass under way
            for file in stream.files:
                file.cursor, file.frontier, file.reading = 0, -1, False
                for chunk in file.chunks:
                    chunk.served = 0

    # -- internals ------------------------------------------------------------------------------

    def _follow_demand(self, file: FileStream, chunk: Chunk):
        # A loader far ahead of the prefetcher: skip to where it reads rather than fill the budget
        # with bytes it has passed.
        window = max(1, self.budget // DEFAULT_CHUNK_BYTES // max(1, file.handles))
        if chunk.stream_pos - file.cursor > window:
            file.cursor = chunk.stream_pos + 1

    async def _prefetch(self, stream: Stream):
        this_pass = stream.passes
        try:
            await self._prefetch_pass(stream, this_pass)
        finally:
            if stream.passes == this_pass:
                stream.running = False

    async def _prefetch_pass(self, stream: Stream, this_pass: int):
        while stream.passes == this_pass:
            while self.stats.held_bytes and self.stats.held_bytes + DEFAULT_CHUNK_BYTES > self.budget:
                await self._budget_freed.wait()
            chunk = stream.next_chunk() if stream.passes == this_pass else None
            if chunk is None:
                return
            if (chunk.buffer is not None or chunk.loading is not None or chunk.served
                    or chunk.prefetched == stream.passes):
                continue  # in memory, being read, or already read by the loader
            chunk.prefetched = stream.passes
            self.stats.prefetch_loads += 1
            self._reserve(self._cost(chunk))
            chunk.loading = trio.Event()  # before the task starts: a demand read must wait for it
            self._nursery.start_soon(self._load, chunk, True)

    def _cost(self, chunk: Chunk) -> int:
        """What a chunk in memory counts against the budget: its buffer's size."""
        return self._pool.size_class(chunk.read_span(self.direct_io))

    def _reserve(self, nbytes: int):
        self.stats.held_bytes += nbytes
        self.stats.peak_held_bytes = max(self.stats.peak_held_bytes, self.stats.held_bytes)

    def _make_room(self, nbytes: int):
        """Demand reads may not wait for the budget. They may overdraw it by DEMAND_SLACK (they are
        released once answered); past that the oldest unconsumed chunks are evicted."""
        self._reserve(nbytes)
        while self.stats.held_bytes > self.budget + DEMAND_SLACK and self._loaded:
            self._release(next(iter(self._loaded.values())))

    def _unreserve(self, nbytes: int):
        self.stats.held_bytes -= nbytes
        self._budget_freed.set()  # wake a prefetcher waiting for room
        self._budget_freed = trio.Event()

    def _release(self, chunk: Chunk):
        if self._loaded.pop(id(chunk), None) is not None:
            self._pushed.pop(id(chunk), None)
            self._give_back(chunk)
            chunk.buffer = None
            chunk.head = chunk.tail = b""
            self._unreserve(self._cost(chunk))

    def _give_back(self, chunk: Chunk):
        """The chunk's memory goes back once no reply views it any more: a buffer to the pool, a
        map's range out of the map and the page cache."""
        if isinstance(chunk.backing, np.ndarray):
            self._served_ranges.append((chunk.backing, chunk.source, chunk.source_offset,
                                        chunk.source_offset + chunk.length))
        elif chunk.backing is not None:
            self._pool.give(chunk.backing)
        chunk.backing = None

    def _let_go_of_served_ranges(self):
        still_viewed, unviewed = [], []
        for entry in self._served_ranges:
            # references: the tuple and getrefcount's argument; a reply's memoryview adds one
            if sys.getrefcount(entry[0]) > 2:
                still_viewed.append(entry)
            else:
                unviewed.append(entry[1:])
        self._served_ranges = still_viewed
        try:
            for source, begin, end in unviewed:
                self._maps.unmap(source, begin, end)
        except OSError as exc:  # only memory left behind: worth a warning, not the mount
            log.warning("could not unmap served source pages: %s", exc)
        if unviewed:
            self._nursery.start_soon(trio.to_thread.run_sync, self._uncache, unviewed)

    def _uncache(self, ranges: list[tuple[int, int, int]]):
        for source, begin, end in ranges:
            self._maps.uncache(source, begin, end)

    def _served_as_on_disk(self, chunk: Chunk) -> bool:
        return not self.direct_io and not chunk.row_bytes

    async def _load(self, chunk: Chunk, prefetched: bool = False):
        """Read a chunk whose `loading` event is set, and wake whoever waits on it. A prefetched
        chunk is then offered for pushing."""
        drops = self.drops
        try:
            if self._served_as_on_disk(chunk):
                reused = None
                self._pool.fit(self.stats.held_bytes)  # buffers replies let go of: idle, or back
            else:
                reused = self._pool.take(chunk.read_span(self.direct_io), self.stats.held_bytes)
            chunk.backing, chunk.buffer = await trio.to_thread.run_sync(self._read_chunk, chunk, reused,
                                                                        limiter=self._limiter)
            chunk.error = None
            if chunk.on_demand:
                self.stats.on_demand_read_bytes += chunk.length
            else:
                self.stats.read_bytes[chunk.source] += chunk.length
            self._loaded[id(chunk)] = chunk
            if prefetched and self._pushing and drops == self.drops:
                self._pushable_send.send_nowait(chunk)
        except Exception as exc:  # any failure: the readers get EIO, the daemon keeps serving
            self.stats.errors += 1
            self._unreserve(self._cost(chunk))
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
                self._fds[index] = open_for_exact_reads(self.sources[index].path, flags)
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

    def _mapped_range(self, index: int, begin: int, end: int) -> np.ndarray | None:
        """Bytes [begin, end) of a source, resident in its map (worker thread); None when the
        file cannot be mapped or a page could not be read: a pread then says what went wrong."""
        self._check_unchanged(self.sources[index])
        try:
            return self._maps.view(index, begin, end)
        except (OSError, ValueError):
            return None

    def _read_chunk(self, chunk: Chunk, buffer: mmap.mmap | None) -> tuple[mmap.mmap | np.ndarray, memoryview]:
        """Runs in a worker thread: the chunk's range of its source's map, resident; or one large
        read, the fill outside the slice, and the source's cache dropped."""
        if self._served_as_on_disk(chunk):
            mapped = self._mapped_range(chunk.source, chunk.source_offset, chunk.source_offset + chunk.length)
            if mapped is not None:
                return mapped, memoryview(mapped)
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
