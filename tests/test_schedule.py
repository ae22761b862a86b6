"""The prefetch order: the file the loader consumes first, all of it, then the next ones; several
files side by side only when a loader reads them side by side. The frontier follows what the loader
read in order, not the furthest chunk the kernel's read-around touched. A view's streams are made
once, by its layout in the background or by an open that comes sooner."""

from __future__ import annotations

import trio

from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.extents import Extent
from rankfs.plan.layout import plan_rank
from rankfs.plan.spec import RankSpec
from rankfs.reader.chunks import CHUNK_BYTES, Chunk, Fill, listing_pages, split_extent
from rankfs.common.disk import PAGE, align_down, align_up
from rankfs.plan.layout import FILL_BYTE
from rankfs.reader.engine import ReadEngine
from rankfs.reader.schedule import CONSUMING_BYTES, SIGNAL_EVERY_CHUNKS, ViewStream
from rankfs.vfs.tree import LazyView

CHUNKS = 6


def view_of(files: int) -> ViewStream:
    """A view of `files` files, each CHUNKS chunks of source bytes, consumed in file order."""
    extents = [Extent(0, CHUNKS * CHUNK_BYTES, "data", source=f, marks=((0, f * CHUNKS),)) for f in range(files)]
    return ViewStream.of("target", [[Chunk(extent, i * CHUNK_BYTES, CHUNK_BYTES) for i in range(CHUNKS)]
                                    for extent in extents])


def read(view: ViewStream, file: int, position: int):
    """A loader's read of a whole chunk, accounted by the engine (whose read of it, before, marks
    the file read)."""
    stream = view.files[file]
    chunk = stream.chunks[position]
    stream.reading = True
    ReadEngine((), 1 << 30).answered(chunk, chunk.start, chunk.end)


def next_chunk(view: ViewStream) -> Chunk:
    """The next chunk the read-ahead takes: one chunk's bytes in a group."""
    chunks, _ = view.next_chunks(CHUNK_BYTES, view.passes)
    return chunks[0]


def order(view: ViewStream, n: int) -> list[tuple[int, int]]:
    picked = [next_chunk(view) for _ in range(n)]
    return [(c.source, c.stream_pos) for c in picked]


def test_open_files_whose_headers_alone_were_read_do_not_split_the_prefetch():
    view = view_of(3)
    for stream in view.files:  # a loader opened all three: headers and read-around only
        stream.reading = True
        stream.requested_bytes = CONSUMING_BYTES - 1
    read(view, 0, 0)
    read(view, 0, 1)
    assert view.files[0].consuming and not view.files[1].consuming
    assert order(view, 6) == [(0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 1)]


def test_files_read_side_by_side_are_prefetched_side_by_side():
    view = view_of(2)
    for f in range(2):
        for position in range(3):
            read(view, f, position)
    assert order(view, 4) == [(0, 3), (1, 3), (0, 4), (1, 4)]


def test_the_frontier_ignores_chunks_read_out_of_order():
    view = view_of(1)
    stream = view.files[0]
    read(view, 0, 4)  # the kernel read around a tensor's first page: a chunk needed last
    assert stream.frontier == 0 and order(view, 1) == [(0, 0)]
    read(view, 0, 0)
    read(view, 0, 1)
    assert stream.frontier == 2  # 2 and 3 are still to come; 4 was read
    read(view, 0, 2)
    read(view, 0, 3)
    assert stream.frontier == 5 and next_chunk(view).stream_pos == 5 and view.prefetched()


def test_an_open_during_the_background_layout_finishes_it_and_the_view_is_registered_once(tiny_checkpoint):
    layout = plan_rank(Checkpoint.open(tiny_checkpoint), RankSpec(4, 1, 1))
    view = layout.view("target")
    engine = ReadEngine(layout.sources, 64 << 20)
    lazy = LazyView("target", view, engine)
    lazy.inodes = list(range(100, 100 + len(view.files)))

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lazy.lay_out)
            await trio.sleep(0)  # the layout takes a file, then lets requests in
            last = lazy.content(len(view.files) - 1)  # an open: the rest laid out at once
            streams = engine.views["target"]
        return last, streams

    last, streams = trio.run(main)
    assert engine.views == {"target": streams} and len(streams.files) == len(view.files) > 1
    assert lazy.content(len(view.files) - 1) is last and last.stream is streams.files[-1]


def test_a_listing_reads_the_header_and_each_tensors_first_page():
    tensors = [10_000, 10_000 + 5 * PAGE + 7, 10_000 + CHUNK_BYTES + 100]
    assert listing_pages(10_000, tensors) == [0, PAGE, 2 * PAGE, 7 * PAGE, (10_000 + CHUNK_BYTES) // PAGE * PAGE]


def test_chunks_are_cut_on_pages_so_that_no_page_lies_across_two():
    extent = Extent(10_000, 3 * CHUNK_BYTES, "data", source=0)
    chunks = split_extent(extent)
    assert chunks[0].start == 10_000 and all(c.start % PAGE == 0 for c in chunks[1:])
    assert [c.end for c in chunks[:-1]] == [c.start for c in chunks[1:]]
    assert chunks[-1].end == extent.offset + extent.length


def test_a_slice_is_pushed_with_the_fill_on_its_first_and_last_pages():
    """A sliced tensor's loader reads its slice's first and last page: pushed with the fill around
    the slice on them, they are no request; a page shared with another tensor's bytes stays one."""
    data = bytes(range(256)) * (3 * PAGE // 256)
    for before, after in [(True, True), (True, False), (False, True), (False, False)]:
        chunk = split_extent(Extent(10_000, len(data), "data", source=0))[0]
        chunk.place(None, 1, signal=False)
        chunk.take(memoryview(data), None)
        chunk.set_fill_edges(before=before, after=after)
        start, end = chunk.push_range()
        assert start == (align_down(10_000) if before else align_up(10_000))
        assert end == (align_up(10_000 + len(data)) if after else align_down(10_000 + len(data)))
        pieces = chunk.push_pieces(start, end, Fill())
        assert [offset for offset, _ in pieces] == sorted(offset for offset, _ in pieces)
        assert all(a + len(b) == c for (a, b), (c, _) in zip(pieces, pieces[1:])) and pieces[0][0] == start
        served = bytes([FILL_BYTE]) * (10_000 - align_down(10_000)) + data + bytes([FILL_BYTE]) * PAGE
        view_from = align_down(10_000)
        assert b"".join(bytes(b) for _, b in pieces) == served[start - view_from:end - view_from]


def test_one_chunk_in_eight_keeps_its_first_page_for_a_request_and_the_others_are_passed_once_a_later_one_is_read():
    view = ViewStream.of("target", [split_extent(Extent(0, 20 * CHUNK_BYTES, "data", source=0))])
    chunks = view.files[0].chunks
    assert [c.signal for c in chunks] == [i % SIGNAL_EVERY_CHUNKS == 0 for i in range(20)]
    assert chunks[0].push_range() == (PAGE, CHUNK_BYTES) and chunks[1].push_range() == (CHUNK_BYTES, 2 * CHUNK_BYTES)
    chunks[1].pushed = chunks[2].pushed = True
    stream = view.files[0]
    read(view, 0, 0)
    assert not stream.passed(chunks[1]) and not stream.passed(chunks[2])
    read(view, 0, SIGNAL_EVERY_CHUNKS)  # the next signal page: the pushed chunks before it were read
    assert stream.passed(chunks[1]) and stream.passed(chunks[2]) and not stream.passed(chunks[SIGNAL_EVERY_CHUNKS + 1])
