"""A virtual file's bytes as runs: its header, fill outside the rank's slices, and source bytes.

Runs of source bytes and of fill carry when the loaders first need each tensor in them (its
consumption position), so that prefetch and pushes follow the loaders' order rather than the file's.
"""

from __future__ import annotations

import bisect
import math
from typing import Iterator, NamedTuple


class Extent(NamedTuple):
    offset: int
    length: int
    kind: str  # "header" | "fill" | "data" | "shared" (a shard of the local ranks' shared view)
    source: int = -1
    source_offset: int = 0
    row_bytes: int = 0  # > 0: only bytes at (pos - offset) % row_bytes in [keep_start, keep_stop) are real
    keep_start: int = 0
    keep_stop: int = 0
    on_demand: bool = False
    tensor: str = ""  # first tensor in the run, for messages
    # (offset, consumption position) of each tensor starting in the run: a run merged from tensors
    # of different dtypes holds tensors the loaders read far apart
    marks: tuple[tuple[int, int], ...] = ()

    def order_of(self, offset: int, end: int) -> int:
        """When the loaders first need bytes [offset, end) of the run: the earliest consumption
        position of the tensors overlapping them."""
        first = max(0, bisect.bisect_right(self.marks, (offset, math.inf)) - 1)
        last = bisect.bisect_left(self.marks, (end, -1))
        return min((order for _, order in self.marks[first:max(last, first + 1)]), default=-1)

    @property
    def end(self) -> int:
        return self.offset + self.length


def tensor_extents(t, order: int) -> Iterator[Extent]:
    """The runs of one VirtualTensor: its bytes, or its slice and the fill around it."""
    data = dict(kind="data", source=t.source, on_demand=t.on_demand, tensor=t.name)
    if t.slice is None:
        yield Extent(t.offset, t.nbytes, source_offset=t.source_offset, marks=((t.offset, order),), **data)
        return
    rows = t.slice.rows(t.dtype, t.shape)
    if rows.is_block:
        yield Extent(t.offset, rows.keep_start, "fill", tensor=t.name, marks=((t.offset, order),))
        yield Extent(t.offset + rows.keep_start, rows.kept_bytes, source_offset=t.source_offset + rows.keep_start,
                     marks=((t.offset + rows.keep_start, order),), **data)
        yield Extent(t.offset + rows.keep_stop, t.nbytes - rows.keep_stop, "fill", tensor=t.name,
                     marks=((t.offset + rows.keep_stop, order),))
    else:
        yield Extent(t.offset, t.nbytes, source_offset=t.source_offset, row_bytes=rows.row_bytes,
                     keep_start=rows.keep_start, keep_stop=rows.keep_stop, marks=((t.offset, order),), **data)


def merged(extents: list[Extent]) -> list[Extent]:
    """Adjacent fill, and adjacent data that is adjacent in the same source too, as single runs."""
    runs: list[tuple[Extent, int, list]] = []  # (first, length so far, marks)
    for e in extents:
        if runs:
            first, length, marks = runs[-1]
            mergeable = (first.kind == e.kind == "data" and not first.row_bytes and not e.row_bytes
                         and first.source == e.source and first.on_demand == e.on_demand
                         and first.source_offset + length == e.source_offset)
            if (mergeable or first.kind == e.kind == "fill") and first.offset + length == e.offset:
                marks.extend(e.marks)
                runs[-1] = (first, length + e.length, marks)
                continue
        runs.append((e, e.length, list(e.marks)))
    return [first._replace(length=length, marks=tuple(marks)) for first, length, marks in runs]


def tensors_at(starts, names, begin: int, end: int) -> str:
    """The tensors with bytes in [begin, end), for messages ('a', 'b'): of tensors `names` that
    start at `starts` (sorted) and lie side by side."""
    first = max(0, bisect.bisect_right(starts, begin) - 1)
    last = max(bisect.bisect_left(starts, end), first + 1)
    return ", ".join(repr(name) for name in names[first:last])
