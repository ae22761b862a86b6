"""The source pages a mount's local ranks read, and when they may leave the page cache.

Ranks of one host that load from one mount (`--local-ranks`) share bytes: two ranks of one EP rank
read the same experts, every rank of a sliced layout reads whole rows of each w2, and every rank
reads the tensors outside the experts. Their hooks read the sources through the page cache, so that
the disk reads a shared page once for the host, and each tells the daemon when it is done with a
view file (`consumed`). A page leaves the page cache once every view that reads it is done with it:
the first rank to finish never takes a page from one still loading.
"""

from __future__ import annotations

import bisect
from typing import Iterable

from rankfs.common.disk import joined_pages
from rankfs.plan.layout import RankLayout


class HostPages:
    def __init__(self, reads: dict[tuple[str, str], list[tuple[int, int, int]]]):
        """reads: {(view directory, file name): [(source, begin, end), ...]}: what each view file's
        reader takes from the sources."""
        bits = {view: 1 << i for i, view in enumerate(sorted({view for view, _ in reads}))}
        edges: dict[int, set[int]] = {}
        self._pages: dict[tuple[str, str], list[tuple[int, int, int]]] = {}
        for key, spans in reads.items():
            pages = [(source, *page) for source in {s for s, _, _ in spans}
                     for page in joined_pages([(b, e) for s, b, e in spans if s == source])]
            self._pages[key] = pages
            for source, begin, end in pages:
                edges.setdefault(source, set()).update((begin, end))
        self._bits = bits
        self._starts = {source: sorted(points) for source, points in edges.items()}
        # Per source, per segment [starts[i], starts[i + 1]): the views that still need it, as bits.
        self._readers = {source: [0] * (len(starts) - 1) for source, starts in self._starts.items()}
        for (view, _), pages in self._pages.items():
            for source, i, j in self._segments(pages):
                readers = self._readers[source]
                for k in range(i, j):
                    readers[k] |= bits[view]

    @classmethod
    def of(cls, layouts: list[RankLayout]) -> "HostPages":
        """The pages each view of each local rank reads (views named as the mount serves them)."""
        return cls({(f"rank-{layout.spec.tp_rank}/{view.name}", vfile.name): [(vfile.source, b, e) for b, e in
                                                                             vfile.source_reads()]
                    for layout in layouts for view in layout.views for vfile in view.files})

    def _segments(self, pages: Iterable[tuple[int, int, int]]):
        for source, begin, end in pages:
            starts = self._starts[source]
            yield source, bisect.bisect_left(starts, begin), bisect.bisect_left(starts, end)

    def shared_bytes(self) -> int:
        """The bytes more than one view reads."""
        return sum(starts[k + 1] - starts[k] for source, starts in self._starts.items()
                   for k, readers in enumerate(self._readers[source]) if readers & (readers - 1))

    def shared_pages(self, view: str) -> dict[int, list[tuple[int, int]]]:
        """{source: [(begin, end), ...]}: the pages `view` reads that a view of another rank still
        needs, joined. Its hook reads those through the page cache and the rest direct."""
        rank = view.split("/")[0]
        others = sum(bit for name, bit in self._bits.items() if name.split("/")[0] != rank)
        shared: dict[int, list[tuple[int, int]]] = {}
        for (name, _), pages in self._pages.items():
            if name != view:
                continue
            for source, i, j in self._segments(pages):
                starts, readers = self._starts[source], self._readers[source]
                shared.setdefault(source, []).extend((starts[k], starts[k + 1]) for k in range(i, j)
                                                     if readers[k] & others)
        return {source: joined_pages(runs) for source, runs in shared.items() if runs}

    def consumed(self, view: str, file: str) -> list[tuple[int, int, int]]:
        """A view is done with a file: (source, begin, end) of the pages no view needs any more,
        joined. An unknown view or file frees nothing."""
        pages = self._pages.pop((view, file), [])
        bit = self._bits.get(view, 0)
        freed: list[tuple[int, int, int]] = []
        for source, i, j in self._segments(pages):
            starts, readers = self._starts[source], self._readers[source]
            for k in range(i, j):
                if not readers[k] & bit:
                    continue
                readers[k] &= ~bit
                if readers[k]:
                    continue
                if freed and freed[-1][0] == source and freed[-1][2] == starts[k]:
                    freed[-1] = (source, freed[-1][1], starts[k + 1])
                else:
                    freed.append((source, starts[k], starts[k + 1]))
        return freed
