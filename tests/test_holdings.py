"""The daemon's holdings: a pushed chunk the loader has passed gives its budget back but keeps its
edges (its first page, which was never pushed), within a cap, the oldest dropped first; freeing a
chunk drops them."""

from __future__ import annotations

from rankfs.plan.extents import Extent
from rankfs.reader import holdings
from rankfs.reader.budget import Stats
from rankfs.reader.chunks import CHUNK_BYTES, Chunk
from rankfs.reader.holdings import Holdings
from rankfs.reader.io import PAGE


def pushed_chunk(held: Holdings, index: int) -> Chunk:
    """A chunk read ahead and pushed: it counts against the budget and keeps its first page."""
    chunk = Chunk(Extent(0, 64 * CHUNK_BYTES, "data", source=0), index * CHUNK_BYTES, CHUNK_BYTES)
    held.budget.reserve(held.cost(chunk))
    held.add(chunk)
    held.pushed[id(chunk)] = chunk
    chunk.head, chunk.served = bytes([index]) * PAGE, CHUNK_BYTES - PAGE
    return chunk


def test_passed_chunks_keep_their_first_page_within_the_cap(monkeypatch):
    monkeypatch.setattr(holdings, "PASSED_EDGE_BYTES", 2 * PAGE)
    held = Holdings(16 * CHUNK_BYTES, reader=None, direct_io=False, stats=Stats())
    chunks = [pushed_chunk(held, i) for i in range(3)]
    for chunk in chunks:
        held.let_pass(chunk)
    assert held.budget.used == 0 and not held.loaded and not held.pushed
    assert [bytes(c.edge(c.start, c.start + 1)) if c.head else None for c in chunks] == [None, b"\x01", b"\x02"]
    held.free(chunks[1])  # its first page was read: nothing more to keep
    assert chunks[1].head == b"" and list(held.passed.values()) == [chunks[2]]
    held.free_all()
    assert chunks[2].head == b"" and not held.passed
