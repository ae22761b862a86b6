"""A group's slab laid out, from where its tensors lie (no reads): runs of bytes adjacent in one
source, each at its file offset's place within a page with its first and last pages to itself (as
direct reads need), and the rows of slices each from a page boundary, in file order; and the spans
of runs that share or touch pages, as the whole pages a window maps (rankfs.loader.staged)."""

from __future__ import annotations

from typing import NamedTuple

from rankfs.common.disk import PAGE, OpenFile, align_down, align_up, covering_pages
from rankfs.plan.extents import tensors_at

RUN_BYTES = 16 << 20  # one read: large enough for the disk's full rate, small enough to spread over threads


class Run(NamedTuple):
    """Bytes adjacent in one file, read together into a slab at `at` (congruent to `offset`
    modulo PAGE), or mapped as a window; `names` are its tensors, each starting at its `starts`."""
    source: OpenFile
    offset: int  # in the source
    length: int
    at: int  # in the slab
    names: tuple[str, ...]
    starts: tuple[int, ...]  # file offsets

    def tensors_at(self, begin: int, end: int) -> str:
        """Its tensors with bytes in [begin, end) of the file, for messages: 'a', 'b'."""
        return tensors_at(self.starts, self.names, begin, end)

    def pieces(self, nbytes: int = RUN_BYTES) -> list["Run"]:
        """The run as reads of nbytes at most, cut at pages of the file (a direct read of one
        piece fills none of the next one's pages), so that a tensor larger than a read (DeepSeek
        V3's embedding is 1.85 GB) is read by every free thread, not one that its group and the
        loader wait for."""
        end = self.offset + self.length
        cuts = [self.offset, *range(align_down(self.offset) + nbytes, end, nbytes), end]
        return [self._replace(offset=a, length=b - a, at=self.at + a - self.offset) for a, b in zip(cuts, cuts[1:])]


class Span(NamedTuple):
    """Runs of a group that share or touch pages, as the whole pages [begin, end) a window maps."""
    source: OpenFile
    begin: int
    end: int
    names: tuple[str, ...]


class Staging(NamedTuple):
    """How a group is staged: `windows`, and the other tensors (`in_slab`) read into one slab as
    `runs` and rows laid out at `offsets`, `size` bytes in all."""
    windows: list[Span]
    in_slab: list[str]
    runs: list[Run]
    offsets: dict[str, int]
    size: int


def join_touching(runs: list[Run]) -> list[Span]:
    """Runs in file order, those that share or touch pages joined, as whole pages."""
    spans: list[Span] = []
    for run in runs:
        begin, end = covering_pages(run.offset, run.offset + run.length)
        if spans and spans[-1].source is run.source and begin <= spans[-1].end:
            spans[-1] = spans[-1]._replace(end=max(end, spans[-1].end), names=spans[-1].names + run.names)
        else:
            spans.append(Span(run.source, begin, end, run.names))
    return spans


def lay_out(blocks: list[tuple[str, OpenFile, int, int]], rows: list[tuple[str, OpenFile, int, int]]):
    """A group's slab, in file order: `blocks` (name, file, offset, length) joined into runs of
    adjacent bytes, each at its offset's place within a page; `rows` (name, file, offset, kept
    bytes) each from a page boundary. The reads go in file order too, so what one thread reads in
    turn lies side by side in the slab and goes to the GPU in one upload (rows laid out after every
    block made a sliced expert's reads three uploads). Returns (runs, {name: slab offset}, slab
    bytes). At most the tensors' bytes plus two pages each."""
    runs: list[Run] = []
    offsets: dict[str, int] = {}
    pos = 0
    current: list = []  # [file, offset, end, [(name, offset)]]

    def close_run():
        nonlocal pos, current
        if current:
            source, begin, end, members = current
            at = align_up(pos) + begin % PAGE
            runs.append(Run(source, begin, end - begin, at, tuple(name for name, _ in members),
                            tuple(offset for _, offset in members)))
            offsets.update((name, at + offset - begin) for name, offset in members)
            pos = at + end - begin
            current = []
    items = [(False, block) for block in blocks] + [(True, row) for row in rows]
    for is_rows, (name, source, offset, length) in sorted(items, key=lambda item: (item[1][1].path, item[1][2])):
        if is_rows:
            close_run()
            offsets[name] = align_up(pos)
            pos = offsets[name] + length
            continue
        if current and (current[0] is not source or current[2] != offset or current[2] - current[1] >= RUN_BYTES):
            close_run()
        if not current:
            current = [source, offset, offset, []]
        current[2] = offset + length
        current[3].append((name, offset))
    close_run()
    return runs, offsets, align_up(pos)
