"""Reading a chunk's bytes from its source shard, in a worker thread: a resident range of the
source's map when the chunk lies on disk as served and the page cache holds it (one copy on its way
out, not two), otherwise one large read into a buffer, direct (O_DIRECT) where the page cache does
not hold it, with the fill written over the other ranks' columns. A source that is no longer the
file that was planned is refused, by name.

A cold chunk read direct costs the daemon less CPU than one faulted in through the map: where the
daemon's CPU bounds a cold view, that is the view's speed."""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np

from rankfs.common.contract import Source
from rankfs.plan.extents import Extent
from rankfs.plan.layout import FILL_BYTE
from rankfs.reader.chunks import Chunk
from rankfs.common.disk import PAGE, OpenFile, covering_pages, page_cache_holds, read_cached
from rankfs.common.trace import timed
from rankfs.reader.source_maps import MappedSources


class BackingError(OSError):
    """A source file that cannot be read as planned; the message names it."""


class SourceReader:
    def __init__(self, sources: tuple[Source, ...], direct_io: bool):
        """direct_io: every chunk read into a buffer, none served from a map (`--direct-io`)."""
        self.sources = sources
        self.direct_io = direct_io
        self._files: dict[int, OpenFile] = {}
        self._files_lock = threading.Lock()
        self.maps = MappedSources([s.path for s in sources], self.fd)

    def _file(self, index: int) -> OpenFile:
        with self._files_lock:
            if index not in self._files:
                self._files[index] = OpenFile(self.sources[index].path)
            return self._files[index]

    def fd(self, index: int) -> int:
        """The source opened for buffered reads, without readahead (maps, reads of cached bytes)."""
        return self._file(index).fd

    def close(self):
        with self._files_lock:
            for opened in self._files.values():
                opened.close()
            self._files.clear()

    def serves_ranges(self, chunk: Chunk) -> bool:
        """Whether a range of a chunk may be served from its source's map (read there if need be):
        one that lies on disk as served, unless every chunk is read into a buffer (--direct-io)."""
        return chunk.as_on_disk and not self.direct_io

    def maps_chunk(self, chunk: Chunk, on_event_loop: bool = False) -> bool:
        """Whether a chunk is served from its source's map (else read into a buffer): one that lies
        on disk as served, where the page cache holds it (or the kernel cannot say). On the event
        loop's thread the GIL is kept for the call (microseconds): letting it go, that thread
        would wait to take it back behind the workers, and every request with it."""
        if not self.serves_ranges(chunk):
            return False
        begin, end = chunk.source_offset, chunk.source_offset + chunk.length
        return page_cache_holds(self.fd(chunk.source), begin, end, holding_gil=on_event_loop) is not False

    def check_unchanged(self, index: int):
        source = self.sources[index]
        try:
            st = os.stat(source.path)
        except OSError as exc:
            raise BackingError(f"{source.path}: {exc.strerror}") from None
        if not source.unchanged(st):
            raise BackingError(f"{source.path}: changed since it was mounted "
                               f"(size {source.size} -> {st.st_size}, mtime or inode differ); "
                               "remount to serve the new file")

    def mapped_range(self, index: int, begin: int, end: int) -> np.ndarray | None:
        """Bytes [begin, end) of a source, resident in its map; None when the file cannot be mapped
        or a page could not be read: a read into a buffer then says what went wrong."""
        self.check_unchanged(index)
        try:
            return self.maps.view(index, begin, end)
        except (OSError, ValueError):
            return None

    def read_chunks(self, chunks: list[Chunk], buffers: list, mapped: list[bool], new_buffer) -> list:
        """Runs in a worker thread: each chunk's bytes (`read_chunk`) with the times its read began
        and ended, or the exception it raised: a failed read is that chunk's alone."""
        results = []
        for chunk, buffer, maps in zip(chunks, buffers, mapped):
            try:
                results.append(timed(self.read_chunk, chunk, buffer, maps, new_buffer))
            except Exception as exc:
                results.append(exc)
        return results

    def read_chunk(self, chunk: Chunk, buffer, mapped: bool, new_buffer) -> tuple:
        """The chunk's range of its source's map, resident, where the caller found it may be mapped
        (`maps_chunk`, asked once); or a read into `buffer` (`new_buffer(nbytes)` where it is
        None). Returns (the buffer, or None for a map range; the chunk's bytes)."""
        if mapped:
            view = self.mapped_range(chunk.source, chunk.source_offset, chunk.source_offset + chunk.length)
            if view is not None:
                return None, memoryview(view)
        if buffer is None:
            begin, end = chunk.read_span()
            buffer = new_buffer(end - begin)
        return buffer, self.read_into(chunk, buffer)

    def read_into(self, chunk: Chunk, buffer: mmap.mmap) -> memoryview:
        """One large read of the chunk into `buffer` (of its whole pages' size at least), direct
        unless the page cache holds it, the fill written outside its slice, and the source's cache
        of it dropped (the view's page cache holds it next). Returns the chunk's bytes."""
        data = self._read(chunk.source, chunk.source_offset, chunk.length, buffer, chunk)
        os.posix_fadvise(self.fd(chunk.source), chunk.source_offset, chunk.length, os.POSIX_FADV_DONTNEED)
        return data

    def read_pages(self, extent: Extent, lo: int, hi: int, cached: bool = False) -> bytes:
        """Bytes [lo, hi) (file offsets, a few pages) of a data extent as served: copied from the
        page cache where it holds them, else read direct (a listing's pages are read before their
        chunks, and waiting for those would make every tensor a request). Runs in a worker thread.
        `cached`: the caller has just found them cached and checked the source unchanged
        (`ask_for_pages`): read with the GIL kept."""
        first, last, begin = _span_read(extent, lo, hi)
        if not cached:
            buffer = mmap.mmap(-1, -(-(begin % PAGE + last - first) // PAGE) * PAGE)
            return bytes(self._read(extent.source, begin, last - first, buffer, extent)[lo - first:hi - first])
        data, path = memoryview(bytearray(last - first)), self.sources[extent.source].path
        done = read_cached(self.fd(extent.source), data.obj, begin, path)
        return bytes(_as_served(data, done, extent, path, begin)[lo - first:hi - first])

    def ask_for_pages(self, spans: list[tuple[Extent, int, int]]) -> tuple[list[tuple[int, int, int]], list[bool]]:
        """Ask the disk at once for what `read_pages` of each (extent, lo, hi) reads, where the
        page cache does not hold it (WILLNEED): a few hundred reads of a page, one after the
        other, wait that many times on the disk's latency; in flight together, about once.
        Returns (source, begin, end) of the pages asked for, for `drop_pages` once read, and for
        each span whether its source is unchanged and the page cache held it."""
        asked, held, checked = [], [], set()
        for extent, lo, hi in spans:
            first, last, begin = _span_read(extent, lo, hi)
            begin, end = covering_pages(begin, begin + last - first)
            held.append(False)
            try:
                if extent.source not in checked:
                    self.check_unchanged(extent.source)
                    checked.add(extent.source)
                opened = self._file(extent.source)
                if opened.cached(begin, end, holding_gil=True):
                    held[-1] = True
                else:
                    os.posix_fadvise(opened.fd, begin, end - begin, os.POSIX_FADV_WILLNEED)
                    asked.append((extent.source, begin, end))
            except OSError:  # a source gone or changed: its read says so, by name
                continue
        return asked, held

    def drop_pages(self, asked: list[tuple[int, int, int]]):
        """The pages `ask_for_pages` brought into the page cache leave it (the view's holds them)."""
        for source, begin, end in asked:
            os.posix_fadvise(self.fd(source), begin, end - begin, os.POSIX_FADV_DONTNEED)

    def _read(self, index: int, offset: int, length: int, buffer: mmap.mmap, run) -> memoryview:
        """Bytes [offset, offset + length) of a source into `buffer` at their offset within a page,
        direct unless the page cache holds them, what a read through it added dropped, the fill
        written outside the slice of a masked run (a chunk or an extent)."""
        self.check_unchanged(index)
        path = self.sources[index].path
        opened = self._file(index)
        skip = offset % PAGE
        try:
            done = opened.read_into(memoryview(buffer), skip, offset, length, path)
        except OSError as exc:
            raise BackingError(str(exc)) from None
        data = _as_served(memoryview(buffer)[skip:skip + length], done, run, path, offset)
        opened.drop_added()  # where it could not read direct (tmpfs): what it cached
        return data


def _as_served(data: memoryview, done: int, run, path: str, offset: int) -> memoryview:
    """`done` bytes read of a source into `data` as served: every byte, or an error naming the
    file; the fill written outside the slice of a masked run (a chunk or an extent)."""
    if done < len(data):
        raise BackingError(f"{path}: short read at offset {offset} ({done} of {len(data)} bytes); "
                           "the file was truncated")
    if run.row_bytes:
        fill_outside_slice(data, run)
    return data


def _span_read(extent: Extent, lo: int, hi: int) -> tuple[int, int, int]:
    """What a read of [lo, hi) of a data extent takes: (first, last) in the file, whole rows of a
    sliced one for the fill over the other ranks' columns, and the source offset of `first`."""
    if extent.row_bytes:
        first = lo - (lo - extent.offset) % extent.row_bytes
        last = min(extent.end, hi + (extent.offset - hi) % extent.row_bytes)
    else:
        first, last = lo, hi
    return first, last, extent.source_offset + (first - extent.offset)


def fill_outside_slice(rows: memoryview, run):
    """The fill over the other ranks' columns of whole rows of a masked run (a chunk or an extent:
    `row_bytes` each, keeping [`keep_start`, `keep_stop`) of each)."""
    table = np.frombuffer(rows, np.uint8).reshape(-1, run.row_bytes)
    table[:, :run.keep_start] = FILL_BYTE
    table[:, run.keep_stop:] = FILL_BYTE
