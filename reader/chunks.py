"""Chunks: the pieces of a virtual file's source runs that the daemon reads in one go, and how a
read of the file finds them."""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from rankfs.plan.extents import Extent
from rankfs.plan.layout import FILL_BYTE
from rankfs.common.disk import PAGE, align_down, align_up, covering_pages, inner_pages

if TYPE_CHECKING:
    import trio

    from rankfs.reader.buffers import Backing
    from rankfs.reader.schedule import FileStream

CHUNK_BYTES = 8 << 20
ON_DEMAND_CHUNK_BYTES = 1 << 20


class Chunk:
    """A piece of a data extent, read from its source in one go; or of a fill extent, never read
    (only pushed)."""

    __slots__ = ("start", "length", "source", "source_offset", "row_bytes", "keep_start", "keep_stop",
                 "tensor", "order", "on_demand", "fill", "buffer", "backing", "loading", "requested",
                 "stream_pos", "error", "file_id", "head", "tail", "file", "reads", "listed",
                 "handed", "signal", "pushed", "fill_before", "fill_after", "halvings_before")

    def __init__(self, extent: Extent, start: int, length: int, file_id: int = 0):
        self.start = start  # offset in the virtual file
        self.length = length
        self.source = extent.source
        self.source_offset = extent.source_offset + (start - extent.offset)
        self.row_bytes = extent.row_bytes  # chunks of masked extents hold whole rows
        self.keep_start, self.keep_stop = extent.keep_start, extent.keep_stop
        self.tensor = extent.tensor
        self.order = extent.order_of(start, start + length)
        self.on_demand = extent.on_demand
        self.fill = extent.kind == "fill"
        self.buffer: memoryview | None = None  # its bytes, while loaded
        self.backing: Backing | None = None  # the memory `buffer` lies in
        self.loading: trio.Event | None = None
        self.requested = False  # a loader has read some of it (not only pushes)
        self.reads = 0  # times read from its source
        self.stream_pos = -1  # position in its file's stream (`place`)
        self.file: FileStream | None = None
        self.error: str | None = None  # the last failed read's reason: served as EIO, never as data
        self.file_id = file_id  # the virtual file it belongs to (the serving layer's inode)
        self.head = b""  # once pushed: the bytes before the pushed pages, and after them
        self.tail = b""
        self.listed = 0  # of them, handed first with a listing's pages
        self.handed: list[tuple[int, int]] = []  # the ranges handed (file offsets), disjoint, in order
        self.signal = not self.fill  # a push leaves its first page out (`push_range`); see SIGNAL_EVERY_CHUNKS
        self.pushed = False  # its pages were pushed into the view's page cache
        # Fill sharing its first and last page, which a push completes those pages with (`set_fill_edges`).
        self.fill_before = self.fill_after = 0
        self.halvings_before = 0  # the read-ahead's halvings before it was last read (`Holdings.shrink_read_ahead`)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def as_on_disk(self) -> bool:
        """Its bytes lie in the source as served (no fill between rows)."""
        return not self.row_bytes

    def edge(self, lo: int, hi: int) -> memoryview | None:
        """Bytes [lo, hi) from the edges a push left, if they hold them."""
        if self.head and hi <= self.start + len(self.head):
            return memoryview(self.head)[lo - self.start:hi - self.start]
        tail_start = self.end - len(self.tail)
        if self.tail and lo >= tail_start:
            return memoryview(self.tail)[lo - tail_start:hi - tail_start]
        return None

    def hand(self, lo: int, hi: int) -> int:
        """Bytes [lo, hi) were handed to the kernel (a reply, a push, a listing's page): how many of
        them had not been. Ranges, not a count: counted, a listing's pages of a chunk pushed already
        were counted twice, and the chunk was freed before its last page was handed."""
        new, kept, start, end = hi - lo, [], lo, hi
        for a, b in self.handed:
            if b < lo or a > hi:
                kept.append((a, b))
            else:  # overlapping or touching: merged into one
                new -= max(0, min(b, hi) - max(a, lo))
                start, end = min(start, a), max(end, b)
        bisect.insort(kept, (start, end))
        self.handed = kept
        return new

    @property
    def handed_bytes(self) -> int:
        """The bytes handed to the kernel."""
        return sum(b - a for a, b in self.handed)

    def had_handed(self, lo: int, hi: int) -> bool:
        """Some of bytes [lo, hi) were handed to the kernel: a page-cache read asking for them
        again means the kernel evicted them."""
        return any(a < hi and lo < b for a, b in self.handed)

    def place(self, file: FileStream, position: int, signal: bool):
        """Its place in its file's stream, once the stream is made (rankfs.reader.schedule)."""
        self.file, self.stream_pos, self.signal = file, position, signal

    def take(self, buffer: memoryview, backing: Backing):
        """It was read: its bytes lie in `buffer`, within `backing`."""
        self.buffer, self.backing, self.error = buffer, backing, None

    def set_fill_edges(self, before: bool = False, after: bool = False):
        """Fill lies before it (`before`) on the page it starts on, or after it (`after`) on the
        page it ends on."""
        if before:
            self.fill_before = self.start - align_down(self.start)
        if after:
            self.fill_after = align_up(self.end) - self.end

    def keep_edges(self, start: int, end: int):
        """Its pages [start, end) are in the view's page cache: it keeps the bytes around them and
        lets go of the rest of its memory."""
        a, b = max(0, start - self.start), min(self.length, end - self.start)
        self.head, self.tail = bytes(self.buffer[:a]), bytes(self.buffer[b:])
        self.buffer = None
        self.backing.done()
        self.backing = None
        self.pushed = True

    def forget_edges(self):
        self.head = self.tail = b""

    def unload(self):
        """It lets go of its memory, edges included."""
        if self.backing is not None:
            self.backing.done()
        self.backing, self.buffer = None, None
        self.forget_edges()

    def restart(self):
        """A new reader of its view starts from nothing handed or requested."""
        self.handed_anew()
        self.requested = False

    def handed_anew(self):
        """It is read again for bytes the kernel was handed and lacks now (a second reader of the
        view, or pushed pages evicted): this copy is freed once it has been handed whole, not at its
        first request (counted from the first copy, every request of a view read twice would read
        the whole chunk again)."""
        self.listed = 0
        self.handed = []
        self.pushed = False  # this copy is not

    def push_range(self) -> tuple[int, int]:
        """The pages a push stores: its whole pages, and those it shares with fill, completed with
        it (a sliced tensor's loader reads the first and last page of its slice: left out, each
        would be a request, with the kernel's read-around of fill behind it); of a signal chunk,
        not its first whole page nor a partial one before it (the loader's read of them tells the
        engine how far the file is consumed)."""
        start, end = inner_pages(self.start, self.end)
        if self.signal:
            start += PAGE
        elif self.fill_before:
            start = self.start - self.fill_before
        return start, (self.end + self.fill_after if self.fill_after else end)

    def push_pieces(self, start: int, end: int, fill: "Fill") -> list[tuple[int, memoryview]]:
        """Its pages [start, end) (`push_range`) as (offset, bytes) to store: a page it shares with
        fill joined from both, the pages between straight from its buffer."""
        head, tail = start < self.start, end > self.end
        first, last = (start + PAGE if head else start), (end - PAGE if tail else end)
        pieces = [(first, self.buffer[first - self.start:last - self.start])] if first < last else []
        if head:
            pieces.insert(0, (start, self._served(start, min(start + PAGE, end), fill)))
        if tail and last >= first:
            pieces.append((last, self._served(last, end, fill)))
        return pieces

    def _served(self, lo: int, hi: int, fill: "Fill") -> memoryview:
        """Bytes [lo, hi) of the file as served: its buffer's, and the fill's around it."""
        a, b = max(lo, self.start), min(hi, self.end)
        parts = [fill.take(max(0, min(hi, self.start) - lo)), self.buffer[a - self.start:max(a, b) - self.start],
                 fill.take(max(0, hi - max(lo, self.end)))]
        return memoryview(b"".join(parts))

    def read_span(self) -> tuple[int, int]:
        """[begin, end) in its source of one read of it: whole pages, which a direct read fills."""
        return covering_pages(self.source_offset, self.source_offset + self.length)


def listing_pages(header_bytes: int, tensor_starts) -> list[int]:
    """The pages a safetensors reader reads as it lists a file, before it copies anything: the
    header's, and the one holding each tensor's first byte (safetensors reads it as it makes the
    tensor). A signal page among them is pushed too: the chunk is passed once the loader reads a
    later one (`FileStream.passed`). Sorted."""
    return sorted(set(range(0, align_up(header_bytes), PAGE)) | {align_down(start) for start in tensor_starts})


class Fill:
    """A read-only run of FILL_BYTE, grown on demand, shared by every reply and push of fill."""

    def __init__(self):
        self._bytes = b""

    def take(self, n: int) -> memoryview:
        if len(self._bytes) < n:
            self._bytes = bytes([FILL_BYTE]) * max(n, CHUNK_BYTES)
        return memoryview(self._bytes)[:n]


def split_extent(extent: Extent, chunk_bytes: int = CHUNK_BYTES, file_id: int = 0) -> list[Chunk]:
    """Chunks of at most chunk_bytes, cut on pages (a page across two chunks is one neither push
    stores: a request the loader waits on), or whole rows for masked extents. On-demand extents
    (row stores) are read in small pieces: their readers touch a few rows, not the whole table."""
    if extent.row_bytes:
        step = max(extent.row_bytes, chunk_bytes // extent.row_bytes * extent.row_bytes)
        cuts = list(range(extent.offset, extent.end, step))
    else:
        step = ON_DEMAND_CHUNK_BYTES if extent.on_demand else chunk_bytes
        cuts = [extent.offset, *range(align_down(extent.offset) + step, extent.end, step)]
    return [Chunk(extent, start, end - start, file_id) for start, end in zip(cuts, [*cuts[1:], extent.end])]


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

    def __init__(self, extent: Extent, chunk_bytes: int = CHUNK_BYTES, file_id: int = 0):
        self.chunks = split_extent(extent, chunk_bytes, file_id)
        self._starts = [c.start for c in self.chunks]

    def overlapping(self, offset: int, end: int):
        return overlapping(self.chunks, self._starts, offset, end)
