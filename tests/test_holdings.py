"""The daemon's holdings: a pushed chunk the loader has passed gives its budget back but keeps its
edges (its first page, which was never pushed), within a cap, the oldest dropped first; freeing a
chunk drops them. What was read ahead in a file gives its budget back once the loader that consumed
the file closes it, read to its end or not. A new reader process starts the view over."""

from __future__ import annotations

import os
import subprocess
import sys

from rankfs.plan.extents import Extent
from rankfs.reader import holdings
from rankfs.reader.accounting import Stats
from rankfs.reader.chunks import CHUNK_BYTES, Chunk
from rankfs.reader.engine import ReadEngine
from rankfs.reader.holdings import Holdings
from rankfs.common.disk import PAGE
from rankfs.reader.schedule import CONSUMING_BYTES, FileStream


def pushed_chunk(held: Holdings, index: int, chunk: Chunk | None = None) -> Chunk:
    """A chunk read ahead and pushed: it counts against the budget and keeps its first page."""
    chunk = chunk or Chunk(Extent(0, 64 * CHUNK_BYTES, "data", source=0), index * CHUNK_BYTES, CHUNK_BYTES)
    held.budget.reserve(held.cost(chunk))
    held.add(chunk)
    held.pushed[id(chunk)] = chunk
    chunk.head = bytes([index]) * PAGE
    chunk.hand(chunk.start + PAGE, chunk.end)
    return chunk


def test_a_chunk_counts_each_byte_it_handed_once():
    """A push, a listing's pages and replies may hand the same bytes: each counts once, and a chunk
    is handed whole once every byte of it was (a listing's pages of a pushed chunk, counted again,
    had one freed a page early and read again for it: 09d98b9)."""
    chunk = Chunk(Extent(0, CHUNK_BYTES, "data", source=0), 0, CHUNK_BYTES)
    assert chunk.hand(PAGE, CHUNK_BYTES - PAGE) == CHUNK_BYTES - 2 * PAGE  # pushed
    assert chunk.hand(0, 2 * PAGE) == PAGE  # a listing's pages: the first, and one pushed
    assert chunk.handed_bytes == CHUNK_BYTES - PAGE and not chunk.had_handed(CHUNK_BYTES - PAGE, CHUNK_BYTES)
    assert chunk.hand(CHUNK_BYTES - 2 * PAGE, CHUNK_BYTES) == PAGE  # a reply
    assert chunk.handed_bytes == CHUNK_BYTES and chunk.handed == [(0, CHUNK_BYTES)]
    chunk.handed_anew()
    assert chunk.handed_bytes == 0 and not chunk.had_handed(0, CHUNK_BYTES)


def test_passed_chunks_keep_their_first_page_within_the_cap(monkeypatch):
    monkeypatch.setattr(holdings, "PASSED_EDGE_BYTES", 2 * PAGE)
    held = Holdings(16 * CHUNK_BYTES, reader=None, stats=Stats())
    chunks = [pushed_chunk(held, i) for i in range(3)]
    for chunk in chunks:
        held.let_pass(chunk)
    assert held.budget.used == 0 and not held.loaded and not held.pushed
    assert [bytes(c.edge(c.start, c.start + 1)) if c.head else None for c in chunks] == [None, b"\x01", b"\x02"]
    held.free(chunks[1])  # its first page was read: nothing more to keep
    assert chunks[1].head == b"" and list(held.passed.values()) == [chunks[2]]
    held.free_all()
    assert chunks[2].head == b"" and not held.passed


def test_the_evictions_of_one_loss_halve_the_read_ahead_once_and_its_use_grows_it_back():
    """The kernel evicts the pages of every chunk pushed ahead at once (a cgroup's reclaim, these
    VMs' DAMON), and the loader's requests find them one by one. Halved for each, the read-ahead
    fell to a chunk, which pushes nothing, and stayed there (the 2-core VM, a cold EP1 sliced view:
    7.6 s against 4.1-4.5 s, every chunk read for a waiting request after the first 1.5 s)."""
    held = Holdings(64 * CHUNK_BYTES, reader=None, stats=Stats())
    ahead = [pushed_chunk(held, i) for i in range(16)]
    for chunk in ahead:
        held.shrink_read_ahead(chunk)
    assert held.budget.limit == 32 * CHUNK_BYTES and held.stats.read_ahead_halvings == 1
    later = pushed_chunk(held, 16)  # read after the halving: its eviction is a loss of its own
    held.shrink_read_ahead(later)
    assert held.budget.limit == 16 * CHUNK_BYTES and held.stats.read_ahead_halvings == 2
    for chunk in ahead:  # handed whole: what was read ahead was used
        held.used(chunk)
    assert held.budget.limit == 18 * CHUNK_BYTES and not set(map(id, ahead)) & held.loaded.keys()
    for index in range(17, 24):
        held.shrink_read_ahead(pushed_chunk(held, index))
    assert held.budget.limit == holdings.READ_AHEAD_FLOOR_BYTES
    held.used(later)
    assert held.budget.limit > holdings.READ_AHEAD_FLOOR_BYTES


def engine_with_a_file() -> tuple[ReadEngine, FileStream]:
    extent = Extent(0, 8 * CHUNK_BYTES, "data", source=0)
    engine = ReadEngine((), 64 * CHUNK_BYTES)
    [file] = engine.add_view("target", [[Chunk(extent, i * CHUNK_BYTES, CHUNK_BYTES) for i in range(8)]])
    return engine, file


def test_a_file_closed_by_the_loader_that_consumed_it_gives_back_what_was_read_ahead_in_it():
    # An engine that narrows whole experts never reads half of w1 and w3: those chunks, pushed, are
    # never read to their end, and the frontier stops at the first of them. On the 2-core VM (8 GB,
    # EP2 rank 0, experts whole) they held 808-904 MiB of a 2.7-2.9 GiB budget after the load.
    engine, file = engine_with_a_file()
    for chunk in file.chunks[2:6]:
        pushed_chunk(engine.held, chunk.stream_pos, chunk)
    engine.opened(file)
    engine.opened(file)
    file.reading, file.requested_bytes = True, CONSUMING_BYTES
    engine.closed(file)
    assert engine.budget.used == 4 * CHUNK_BYTES  # another handle still reads it
    engine.closed(file)
    assert engine.budget.used == 0 and not engine.held.loaded and not engine.held.pushed


def test_a_file_only_looked_at_keeps_what_was_read_ahead_in_it():
    engine, file = engine_with_a_file()
    pushed_chunk(engine.held, 3, file.chunks[3])
    engine.opened(file)
    file.reading, file.requested_bytes = True, PAGE  # a header read: the loader has not begun on it
    engine.closed(file)
    assert engine.budget.used == CHUNK_BYTES


def test_the_first_chunks_of_a_file_the_loader_has_not_begun_are_pushed():
    # The push gap keeps chunks just after the loader's frontier out of the pushes, for the loader
    # is about to read them. A file it has not begun has its frontier at 0: with the listing
    # pushed, the gap left its first 40 MiB to requests, which the copy threads read in fragments
    # (H200 host, 24 GB EP2: 2,300-2,900 of 8 KiB-1 MiB in those chunks).
    engine, file = engine_with_a_file()
    first = file.chunks[1]
    first.buffer = memoryview(bytearray(CHUNK_BYTES))
    assert engine.push_range(first) is not None
    file.reading = True
    assert engine.push_range(first) is None


def test_a_view_starts_over_for_a_new_reader_once_the_last_one_has_exited():
    engine, file = engine_with_a_file()
    view = file.view
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    exited, alive = int(gone.stdout), os.getpid()

    def read_by(reader: int):
        engine.opened(file, reader=reader)
        view.active, view.hooked, view.reader_bytes, file.listed = True, True, CHUNK_BYTES, True
        if not engine.held.loaded:
            pushed_chunk(engine.held, 0, file.chunks[0])  # something read ahead for it
        engine.closed(file)

    read_by(exited)
    read_by(exited)  # the same process: the same reader
    assert view.hooked and engine.held.loaded
    engine.opened(file, reader=alive)  # a new reader, the last one gone
    assert not view.hooked and view.reader_bytes == 0 and not engine.held.loaded and not file.listed
    engine.closed(file)
    read_by(alive)
    engine.opened(file, reader=exited)  # the last reader still runs: it may read on
    assert view.hooked and engine.held.loaded and file.listed and view.reader == alive
    engine.closed(file)
    read_by(alive)  # the reader again, after another process looked: no new reader
    assert view.hooked and engine.held.loaded
