"""The memory loaded chunks lie in, and who owns it.

A `Backing` is a pool buffer or a range of a source's map. The chunk owns it while loaded, and so
does every reply or push being written from it; it is freed (the buffer back to the pool, the
range out of the map) when the last owner is done. The event-loop thread does all of this.
"""

from __future__ import annotations

import mmap
from typing import Callable

from rankfs.common.disk import PAGE


class Backing:
    __slots__ = ("_free", "owners", "mapped")

    def __init__(self, free: Callable[[], None], mapped: bool = False):
        self._free = free
        self.owners = 1  # the chunk that loaded it (or the one reply a remnant is read for)
        self.mapped = mapped  # a range of a source's map, not a pool buffer

    def own(self):
        self.owners += 1

    def done(self):
        self.owners -= 1
        if self.owners == 0:
            self._free()


class BufferPool:
    """Anonymous maps for chunks read into memory, reused: a fresh map costs a page fault per 4 KiB,
    which cuts the read rate to a third. Sizes come in classes a quarter octave apart, so that a
    chunk of any size finds an idle buffer at most a quarter larger than it needs; the budget counts
    class sizes. Idle buffers are kept while they and the memory in use fit in the budget's limit
    plus IDLE_SLACK, which bounds the daemon's memory (the buffers are shared memory, which only
    swap could reclaim)."""

    IDLE_SLACK = 64 << 20

    def __init__(self, budget):
        self.budget = budget  # the engine's (rankfs.reader.accounting.Budget): idle buffers fit beside its use
        self.idle: list[mmap.mmap] = []
        self.created = 0

    @staticmethod
    def size_class(nbytes: int) -> int:
        step = max(PAGE, 1 << max(0, nbytes.bit_length() - 3))
        return -(-nbytes // step) * step

    def take(self, nbytes: int) -> mmap.mmap | None:
        """An idle buffer of nbytes' class, if there is one."""
        size = self.size_class(nbytes)
        for i, buffer in enumerate(self.idle):
            if len(buffer) == size:
                return self.idle.pop(i)
        return None

    def new(self, nbytes: int) -> mmap.mmap:
        """A new buffer (in a worker thread: its pages fault in during the read, without the GIL;
        with MAP_POPULATE CPython would fault them in holding it). Shared memory, not the hook's
        private huge pages (rankfs.common.disk.anonymous_map): those double the daemon's RSS for
        no faster view."""
        self.created += 1
        return mmap.mmap(-1, self.size_class(nbytes))

    def give_back(self, buffer: mmap.mmap):
        """A buffer no one uses any more: kept for reuse while it fits."""
        self.idle.append(buffer)
        self.fit()

    def fit(self):
        """Unmap the oldest idle buffers until the idle ones fit beside what the budget holds, under
        its limit as paced now."""
        room = self.budget.limit + self.IDLE_SLACK - self.budget.used
        idle_bytes = sum(len(b) for b in self.idle)
        while self.idle and idle_bytes > room:
            idle_bytes -= len(self.idle.pop(0))

    def trim(self):
        """Give every idle buffer back to the kernel (after a load)."""
        self.idle.clear()

    @property
    def idle_bytes(self) -> int:
        return sum(len(b) for b in self.idle)
