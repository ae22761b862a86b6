"""The daemon's read engine: large reads of the source shards in worker threads, ahead of demand, in
the order the loaders consume the views, within a byte budget.

The serving layer asks for a chunk's bytes with `await engine.read(chunk, lo, hi)`, which returns
them with the `Backing` they lie in, owned until the reply is written (`engine.replied`).
Everything about disks, threads, prefetch order and memory lives here.

Prefetched chunks well ahead of the loader are offered on `pushable` to whoever can put them into the
kernel's page cache (the serving layer's pusher), with the pages they share with fill (outside a
rank's slices); a pushed chunk keeps only its edges, the bytes on pages shared with other tensors,
and one chunk in eight its first page too: the loader's read of that page is the signal of how far
it has consumed the file, which is when the bytes pushed before it stop counting against the
budget. Fill itself is never pushed: a loader reads only its slices, and the kernel's read-around of
fill, where a loader gets ahead of the pushes, is answered from memory.
"""

from __future__ import annotations

import logging
import math
import os
import time

import trio

from rankfs.common.contract import Source
from rankfs.common.disk import joined_pages
from rankfs.plan.extents import Extent
from rankfs.reader.accounting import Budget, Stats
from rankfs.reader.buffers import Backing
from rankfs.reader.chunks import CHUNK_BYTES, Chunk, Fill
from rankfs.reader.holdings import DEMAND_SLACK, Holdings
from rankfs.reader.source_reader import BackingError, SourceReader
from rankfs.reader.schedule import FileStream, ViewStream
from rankfs.common.trace import Trace

log = logging.getLogger("rankfs.reader")

# Chunks this close after the loader's frontier in a file it reads are about to be read: they are
# answered from memory, not pushed (a push would wait on the page locks of those reads). In a file
# it has not begun, they are pushed: otherwise the first of every file came as requests.
PUSH_GAP_CHUNKS = 4
# A pushed chunk not known to be consumed (no later chunk of its file asked for: a signal page evicted
# or skipped) stops counting against the budget once the loader's frontier is this many chunks past it.
PUSH_LAG_CHUNKS = 32
MIN_PUSH_BYTES = 64 << 10
# Chunks read ahead together, in one worker call, up to this many bytes: a sliced rank's chunks are
# a few hundred KB to a few MB (the rank's block of each expert), and each hop to a thread and back
# costs milliseconds while the event loop answers requests.
AHEAD_GROUP_BYTES = CHUNK_BYTES
# A view is prefetched once it has served this much: a loader, not a look at a header.
PREFETCH_AFTER_BYTES = 4 * CHUNK_BYTES

__all__ = ["BackingError", "ReadEngine", "DEMAND_SLACK"]


class ReadEngine:
    def __init__(self, sources: tuple[Source, ...], budget_bytes: int, workers: int = 8,
                 direct_io: bool = False, trace: Trace | None = None):
        self.stats = Stats()
        self.trace = trace or Trace()
        self.views: dict[str, ViewStream] = {}
        self._reader = SourceReader(sources, direct_io)
        # Read-ahead has its threads, and reads a request waits on theirs: never queued behind it.
        self._ahead_threads = trio.CapacityLimiter(workers)
        self._waited_threads = trio.CapacityLimiter(workers)
        # Read-ahead keeps the workers' number of whole chunks' bytes in flight at most: that many
        # reads of whole chunks, more of smaller ones (a sliced expert's rows), which a count of
        # reads held to a few MB in flight, most of each read's time spent in hops.
        self._ahead_bytes = Budget(workers * CHUNK_BYTES)
        self.held = Holdings(budget_bytes, self._reader, self.stats)
        self.budget = self.held.budget
        self._nursery: trio.Nursery | None = None
        self._pushable_send, self.pushable = trio.open_memory_channel(math.inf)
        self._replied_send, self._replied = trio.open_memory_channel(math.inf)
        self._droppable_send, self.droppable = trio.open_memory_channel(math.inf)
        self._dropping = False
        self.pushing = False
        self.fill = Fill()
        self.drops = 0  # a push begun before a drop must not leave its pages behind after it

    # -- set-up ---------------------------------------------------------------------------------

    def add_view(self, name: str, files_chunks: list[list[Chunk]]) -> list[FileStream]:
        """Register a view: its files' chunks, files in the view's order. Returns their streams."""
        self.views[name] = ViewStream.of(name, files_chunks)
        return self.views[name].files

    def opened(self, file: FileStream, direct: bool = False, reader: int | None = None) -> bool:
        """A handle of the file opened (`direct`: with O_DIRECT, bypassing the page cache, as the
        hook reads headers) by the process `reader`. Whether the pages a listing of it reads are to
        be pushed now: its first buffered open, with pushes on, in a view no engine hook loads, by a
        process that has not read its headers past the page cache (a hook, before it says so: it
        reads the tensors its own way).

        A view read before, none of whose files is open, opened by another process once the one
        that read it has exited has a new reader (an engine restarted on the mount, a peer after
        it): it is read ahead from its start again, not left to reads on demand. The same process opening it
        again is the same reader (loaders that open one file at a time close each before the
        next), and one still running may yet read on (another process looking at a header in
        between must not send the read-ahead back to the start)."""
        view = file.view
        if reader != view.reader and (view.reader is None or not os.path.exists(f"/proc/{view.reader}")):
            if view.active and not any(f.handles for f in view.files):
                view.new_reader()
                self._start_over(view)
            view.reader = reader  # not while the last one runs: a look at a header is not a reader
        file.handles += 1
        file.direct_handles += direct
        file.view.opened_direct = direct
        if direct:
            view.direct_opener = reader
        return not direct and (reader is None or reader != view.direct_opener) and file.take_listing(self.pushing)

    def closed(self, file: FileStream, direct: bool = False):
        """A handle of the file closed (`direct`: one opened with O_DIRECT). Once a loader that
        consumed it lets go of it, what was read ahead in it is behind that loader, whatever it
        skipped: a loader that narrows whole experts never reads half of each, whose chunks held
        the budget until a drop (the frontier stops at the first of them)."""
        file.handles -= 1
        file.direct_handles -= direct
        if file.handles == 0 and file.consuming:
            for chunk in [c for c in self.held.loaded.values() if c.file is file]:
                self.held.let_pass(chunk)
        if file.handles == 0 and file.consumed_some:
            self._drop_read(file)
        file.reading = file.reading and file.handles > 0

    async def run(self, task_status=trio.TASK_STATUS_IGNORED):
        """Own the prefetch tasks until cancelled."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = self.held.nursery = nursery
                nursery.start_soon(self._free_replied)
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._reader.close()

    # -- serving --------------------------------------------------------------------------------

    async def read(self, chunk: Chunk, lo: int, hi: int, direct: bool = False) -> tuple[memoryview, Backing | None]:
        """Bytes [lo, hi) (file offsets) of the chunk, from memory, from a read in flight, or read
        now; and the backing they lie in, owned by the caller until `replied`. `direct`: the
        request bypasses the page cache (an O_DIRECT handle's), so asks whatever was handed."""
        file = chunk.file
        if file is not None:
            self._note_reading(file)
        if chunk.buffer is None:
            edge = chunk.edge(lo, hi)
            if edge is not None:
                return edge, None
        while chunk.buffer is None:
            # Asked for bytes it handed: the kernel evicted them (a page-cache read asks only for
            # pages it lacks), or a reader past the page cache reads them again. A listing's pages
            # alone say nothing of the read-ahead's room: whoever opened the file may have dropped them.
            asked_again = chunk.had_handed(lo, hi)
            read_ahead = chunk.handed_bytes > chunk.listed
            evicted = asked_again and read_ahead and chunk.reads and not chunk.on_demand and not direct
            if (chunk.loading is None and read_ahead and self._reader.serves_ranges(chunk)
                    and (evicted or self._reader.maps_chunk(chunk, on_event_loop=True))):
                remnant = await self._read_remnant(chunk, lo, hi, evicted)
                if remnant is not None:
                    return remnant
            if chunk.loading is None:
                self.stats.demand_loads += 1
                if evicted:
                    self._evicted(chunk, chunk.length)
                self.held.free(chunk)
                if asked_again:
                    chunk.handed_anew()
                self.held.make_room(chunk)
                chunk.loading = trio.Event()
                await self._load([chunk])
            else:
                await chunk.loading.wait()
            if chunk.error is not None:
                raise BackingError(chunk.error)
            # Another reader may have consumed and freed it meanwhile: then read it again.
        chunk.backing.own()
        return chunk.buffer[lo - chunk.start:hi - chunk.start], chunk.backing

    @property
    def sources(self) -> SourceReader:  # for a listing's few pages, read in a worker thread
        return self._reader

    @staticmethod
    def replied(backings: list[Backing]):
        """The replies that were written from these backings are done with them."""
        for backing in backings:
            backing.done()

    def replying(self, backings: list[Backing]):
        """A reply from these backings is written once the handler returns, before its task yields
        (pyfuse3 writes it then): they are done with in a task that runs after, not through
        `run_sync_soon`, whose wake-up socket's write lets the GIL go on every reply."""
        self._replied_send.send_nowait(backings)

    async def _free_replied(self):
        async for backings in self._replied:
            self.replied(backings)

    async def _read_remnant(self, chunk: Chunk, lo: int, hi: int,
                            evicted: bool) -> tuple[memoryview, Backing] | None:
        """Bytes of a chunk that was let go before the loader read all of it (pushed, then passed),
        or whose pages the kernel evicted (`evicted`): only those, from the source's map, not the
        whole chunk again. None where the map cannot serve them (the chunk read then says why)."""
        begin = chunk.source_offset + (lo - chunk.start)
        mapped = await trio.to_thread.run_sync(self._reader.mapped_range, chunk.source, begin, begin + hi - lo,
                                               limiter=self._waited_threads)
        if mapped is None:
            return None
        if evicted:
            self.stats.reread_bytes += hi - lo
            self._evicted(chunk, hi - lo)
        else:
            self.stats.remnant_bytes += hi - lo
        self.stats.read_bytes[chunk.source] += hi - lo
        return memoryview(mapped), self.held.map_range(chunk.source, begin, begin + hi - lo)

    def _evicted(self, chunk: Chunk, nbytes: int):
        """Bytes of the chunk handed were evicted before the loader read them (memory pressure, a
        cgroup's limit): counted, and the read-ahead goes less far, so that pushes stay cached."""
        self.stats.evicted_reread_bytes += nbytes
        self.stats.evictions += 1
        self.held.shrink_read_ahead(chunk)

    def answered(self, chunk: Chunk, lo: int, hi: int):
        """Account bytes [lo, hi) of the chunk that a loader's request was answered with."""
        if not chunk.requested:
            self.trace.chunk("first", chunk)
        chunk.requested = True
        if chunk.file is not None:
            chunk.file.requested_bytes += hi - lo
            chunk.file.reached = max(chunk.file.reached, chunk.stream_pos)
            if chunk.file.advance():
                self._release_passed(chunk.file)
        self._handed(chunk, lo, hi)

    def _handed(self, chunk: Chunk, lo: int, hi: int, free: bool = True) -> int:
        """Account bytes [lo, hi) of the chunk handed to the kernel (read, pushed or listed); a
        chunk handed whole is freed, unless told not to be. Returns how many were not handed before."""
        new = chunk.hand(lo, hi)
        if chunk.file is not None:
            chunk.file.view.served_bytes += new
            chunk.file.view.reader_bytes += new
        if free and chunk.handed_bytes >= chunk.length:
            self.held.used(chunk)
        return new

    # -- pushing into the kernel's page cache ---------------------------------------------------

    def listed(self, pieces: list[tuple[Chunk, int, int]]):
        """(chunk, lo, hi): bytes of chunks pushed with a listing's pages, handed to the kernel."""
        for chunk, lo, hi in pieces:
            chunk.listed += self._handed(chunk, lo, hi)
            if chunk.listed >= chunk.length and not chunk.reads:  # read whole, here: no chunk read follows
                self._count_read(chunk)

    def enable_push(self):
        """Offer prefetched chunks on `pushable` from now on."""
        self.pushing = True

    def push_range(self, chunk: Chunk) -> tuple[int, int] | None:
        """What to push of an offered chunk now, or None: it was read meanwhile, the loader is about
        to read it, its file's readers read past the page cache, or too little of it lies on whole
        pages."""
        if not self.still_pushable(chunk):
            return None
        start, end = chunk.push_range()
        return (start, end) if end - start >= MIN_PUSH_BYTES else None

    @staticmethod
    def still_pushable(chunk: Chunk) -> bool:
        """In memory, neither asked for nor about to be, in a file read through the page cache. It
        only reads state: a push thread asks it too, just before it stores."""
        file = chunk.file
        return not (file.read_direct or chunk.buffer is None or chunk.requested
                    or (file.reading and chunk.stream_pos <= file.frontier + PUSH_GAP_CHUNKS))

    def push_memory(self, chunk: Chunk, start: int, end: int) -> tuple[list[tuple[int, memoryview]], Backing]:
        """Pages [start, end) of an offered chunk to push, as (offset, bytes) pieces, and the
        backing they lie in (owned by the caller until the push returns)."""
        chunk.backing.own()
        return chunk.push_pieces(start, end, self.fill), chunk.backing

    def pushed(self, chunk: Chunk, backing: Backing, start: int, end: int,
               times: tuple[float, float, float]):
        """[start, end) of the chunk, pushed from `backing`, is in the kernel's page cache: keep only
        the edges. The chunk still counts against the budget until the loader is past it (`FileStream.passed`).
        `times`: when the push was asked of a thread, began and ended, for the trace."""
        if chunk.backing is not backing:
            return  # freed while it was being pushed (and maybe loaded again since)
        lo, hi = max(start, chunk.start), min(end, chunk.end)
        self.trace.chunk("pushed", chunk, times, pushed=hi - lo, pushed_fill=end - start - (hi - lo))
        chunk.keep_edges(start, end)
        self.held.pushed[id(chunk)] = chunk
        self.stats.pushed_bytes += hi - lo
        self.stats.pushed_fill_bytes += end - start - (hi - lo)
        # A chunk with no signal page is never asked for: it counts until the loader asks for a later one.
        self._handed(chunk, lo, hi, free=chunk.signal)

    def _release_passed(self, file: FileStream):
        # Pushed chunks the loader is past, so no longer budgeted: behind its frontier and a chunk it
        # asked for (a chunk with no signal page is never asked for), or far behind the frontier
        # (their first page was already cached, or evicted and skipped, or read out of order).
        for chunk in [c for c in self.held.pushed.values() if c.file is file and c.stream_pos < file.frontier
                      - (0 if c.stream_pos < file.reached else PUSH_LAG_CHUNKS)]:
            self.held.let_pass(chunk)

    def enable_dropping(self):
        """Offer the view's pages the loader is done with on `droppable` from now on."""
        self._dropping = True

    def _drop_read(self, file: FileStream):
        """A file the loader read, that nothing holds open or maps any more, leaves the page cache:
        the loader copied it into its own memory, and kept it would take that much again. A chunk
        read again (a new reader) is read anew, not as evicted."""
        if not self._dropping or file.read_direct:
            return
        chunks = [c for c in file.not_dropped() if id(c) not in self.held.loaded]
        for chunk in chunks:
            chunk.handed_anew()
            self.stats.dropped_bytes += chunk.length
        for begin, end in joined_pages([(c.start, c.end) for c in chunks]):  # a few ranges, not a chunk each
            self._droppable_send.send_nowait((chunks[0].file_id, begin, end))

    async def uncache(self, ranges: list[tuple[int, int, int]]):
        """(source, begin, end) ranges leave the sources' page cache (in a worker thread)."""
        if ranges:
            await trio.to_thread.run_sync(self._reader.maps.uncache_all, ranges)

    def drop(self):
        """Free every chunk in memory (after a load, or on request). A view read again after a drop
        is prefetched from its start again."""
        self.drops += 1
        self.held.free_all()
        self._reader.maps.forget()
        for view in self.views.values():
            view.restart()

    # -- prefetch -------------------------------------------------------------------------------

    def _note_reading(self, file: FileStream):
        """A loader reads a file: once its view has served its reader PREFETCH_AFTER_BYTES, prefetch
        it (and the view's next files). Reads of a header and the kernel's readahead around it (an
        engine probing a dtype) start nothing, nor does opening a file; nor reads of a view an
        engine hook loads."""
        view = file.view
        file.reading = view.active = True
        if (not view.running and not view.hooked and view.reader_bytes >= PREFETCH_AFTER_BYTES
                and not view.prefetched()):
            view.running, view.passes = True, view.passes + 1
            self._nursery.start_soon(self._prefetch, view)

    def hooked(self, name: str):
        """An engine hook loads this view straight from the sources: prefetching it would read
        every byte twice. What was read ahead for it is freed."""
        view = self.views.get(name)
        if view is None or view.hooked:
            return
        view.hooked = True
        self._start_over(view)

    def _start_over(self, view: ViewStream):
        """The view is read from its start again (`ViewStream.restart`); what was read ahead in it
        is freed."""
        view.restart()
        for chunk in [c for c in self.held.loaded.values() if c.file is not None and c.file.view is view]:
            self.held.free(chunk)

    async def _prefetch(self, view: ViewStream):
        this_pass = view.passes
        try:
            while view.passes == this_pass:
                self.held.pace_to_room()
                await self.budget.wait_for_room(CHUNK_BYTES)
                # Chosen once a read can start: files' consumption may have changed meanwhile.
                await self._ahead_bytes.wait_for_room(CHUNK_BYTES)
                chunks, last = view.next_chunks(AHEAD_GROUP_BYTES, this_pass)
                if chunks:
                    for chunk in chunks:
                        self.trace.chunk("queued", chunk)
                        self.budget.reserve(self.held.cost(chunk))
                        chunk.loading = trio.Event()  # before the task starts: a demand read must wait for it
                    self.stats.prefetch_loads += len(chunks)
                    self._ahead_bytes.reserve(sum(c.length for c in chunks))
                    self._nursery.start_soon(self._load, chunks, True)
                if last:
                    return
        finally:
            if view.passes == this_pass:
                view.running = False

    # -- loading --------------------------------------------------------------------------------

    async def _load(self, chunks: list[Chunk], prefetched: bool = False):
        """Read chunks whose `loading` events are set, in one worker call, and wake whoever waits on
        each. Prefetched chunks are then offered for pushing."""
        drops = self.drops
        mapped = [self._reader.maps_chunk(chunk, on_event_loop=True) for chunk in chunks]
        buffers = [None if m else self.held.pool.take(self.held.cost(c)) for c, m in zip(chunks, mapped)]
        asked = time.monotonic()
        try:
            try:
                results = await trio.to_thread.run_sync(
                    self._reader.read_chunks, chunks, buffers, mapped, self.held.pool.new,
                    limiter=self._ahead_threads if prefetched else self._waited_threads)
            except Exception as exc:
                results = [exc] * len(chunks)
            for chunk, buffer, result in zip(chunks, buffers, results):
                try:
                    if isinstance(result, Exception):
                        raise result
                    (buffer, view), began, ended = result
                    chunk.take(view, self.held.backing(chunk, buffer))
                    self._count_read(chunk)
                    self.trace.chunk("read", chunk, (asked, began, ended), demand=not prefetched)
                    self.held.add(chunk)
                    if prefetched and self.pushing and drops == self.drops:
                        self._pushable_send.send_nowait(chunk)
                except Exception as exc:  # any failure: its readers get EIO, the daemon keeps serving
                    self._failed(chunk, buffer, exc)
        finally:
            for chunk in chunks:
                event, chunk.loading = chunk.loading, None
                event.set()
            if prefetched:
                self._ahead_bytes.release(sum(c.length for c in chunks))

    def _failed(self, chunk: Chunk, buffer, exc: Exception):
        """A chunk could not be read: what it held goes back, and its error is what its readers get."""
        self.stats.errors += 1
        self.budget.release(self.held.cost(chunk))
        if buffer is not None:
            self.held.pool.give_back(buffer)
        chunk.error = str(exc)
        log.error("backing read failed: %s (tensor %s)", exc, chunk.tensor, exc_info=not isinstance(exc, OSError))

    def _count_read(self, chunk: Chunk):
        """The chunk's bytes were read from its source: as the plan's, or on demand (row stores)."""
        if chunk.on_demand:
            self.stats.on_demand_read_bytes += chunk.length
        else:
            self.stats.read_bytes[chunk.source] += chunk.length
            self.stats.reread_bytes += chunk.length if chunk.reads else 0
        chunk.reads += 1
