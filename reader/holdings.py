"""What the read engine holds in memory: loaded chunks against the byte budget, the buffers and map
ranges their bytes lie in, and freeing them (a buffer back to the pool, a map range out of the map
now and out of the page cache soon, from a worker thread). The event-loop thread does all of this."""

from __future__ import annotations

import collections
import functools
import logging
import time

import trio

from rankfs.reader.accounting import Budget, Stats
from rankfs.reader.buffers import Backing, BufferPool
from rankfs.common.limits import cgroups, memory_room
from rankfs.reader.chunks import CHUNK_BYTES, Chunk
from rankfs.reader.source_reader import SourceReader

log = logging.getLogger("rankfs.reader")

# What reads the loader waits on may hold beyond the budget before prefetched chunks are evicted
# for them: a few of them at a time, answered and freed right away.
DEMAND_SLACK = 64 << 20
# Edges of pushed chunks the loader is well past, kept (this much at most, the oldest dropped first)
# after their budget went: a reader out of the stream's order (cp, a read by offset) then reads a
# chunk's edges from memory, not the whole chunk again.
PASSED_EDGE_BYTES = 16 << 20
# The read-ahead's budget halves each time the kernel evicts what was handed, down to this.
READ_AHEAD_FLOOR_BYTES = CHUNK_BYTES
# How often the read-ahead asks how much room the process's cgroup leaves it.
PACE_SECONDS = 0.1


class Holdings:
    def __init__(self, budget_bytes: int, reader: SourceReader, stats: Stats):
        self.budget = Budget(budget_bytes)
        self.pool = BufferPool(self.budget)
        self.stats = stats
        self.nursery: trio.Nursery | None = None  # the engine's, for the uncaching task
        self._reader = reader
        self.loaded: collections.OrderedDict[int, Chunk] = collections.OrderedDict()  # by load time
        self.pushed: dict[int, Chunk] = {}  # those of them whose memory went after a push
        self.passed: collections.OrderedDict[int, Chunk] = collections.OrderedDict()  # edges kept, unbudgeted
        self._passed_bytes = 0
        self._to_uncache: list[tuple[int, int, int]] = []
        self._cgroups = cgroups()  # this process's, for the room its read-ahead may take
        self._paced_at = 0.0

    def pace_to_room(self):
        """Where a cgroup limits the daemon's memory, read ahead a quarter of what it leaves at
        most, asked every PACE_SECONDS: the loader in the same cgroup takes more as it goes (its
        mapped pages), and what is pushed past the room is evicted before it is read."""
        now = time.monotonic()
        if now - self._paced_at < PACE_SECONDS:
            return
        self._paced_at = now
        room = memory_room(self._cgroups)
        if room is not None:
            self.budget.limit = max(READ_AHEAD_FLOOR_BYTES, min(self.budget.limit, room // 4))

    def shrink_read_ahead(self, chunk: Chunk):
        """The kernel evicted pages of the chunk it was handed: the read-ahead goes half as far,
        once per loss. Chunks read before it last halved were read as far ahead as it went then:
        evictions among them (a request each) are that loss; halved for each, the read-ahead fell
        to a chunk, which pushes nothing, and stayed there."""
        if chunk.halvings_before < self.stats.read_ahead_halvings:
            return
        self.budget.shrink(floor=READ_AHEAD_FLOOR_BYTES)
        self.stats.read_ahead_halvings += 1

    def cost(self, chunk: Chunk) -> int:
        """What a chunk in memory counts against the budget: its buffer's size."""
        begin, end = chunk.read_span()
        return self.pool.size_class(end - begin)

    def add(self, chunk: Chunk):
        self.loaded[id(chunk)] = chunk
        chunk.halvings_before = self.stats.read_ahead_halvings

    def make_room(self, chunk: Chunk):
        """Demand reads may not wait for the budget. They may overdraw it by DEMAND_SLACK (they are
        freed once answered); past that the oldest unconsumed chunks are evicted."""
        self.budget.reserve(self.cost(chunk))
        while self.budget.used > self.budget.ceiling + DEMAND_SLACK and self.loaded:
            self.free(next(iter(self.loaded.values())))

    def let_pass(self, chunk: Chunk):
        """A chunk the loader is well past stops counting against the budget: a pushed one keeps its
        edges, within PASSED_EDGE_BYTES; one still in memory is freed."""
        if id(chunk) not in self.pushed:
            self.free(chunk)
            return
        self.loaded.pop(id(chunk), None)
        self.pushed.pop(id(chunk), None)
        self.budget.release(self.cost(chunk))
        self.budget.grow(self.cost(chunk) // 8)  # its push was used, not evicted: pushes go further again, slowly
        self.passed[id(chunk)] = chunk
        self._passed_bytes += len(chunk.head) + len(chunk.tail)
        while self._passed_bytes > PASSED_EDGE_BYTES:
            self._forget_edges(next(iter(self.passed.values())))

    def _forget_edges(self, chunk: Chunk):
        if self.passed.pop(id(chunk), None) is not None:
            self._passed_bytes -= len(chunk.head) + len(chunk.tail)
            chunk.forget_edges()

    def used(self, chunk: Chunk):
        """A chunk handed whole: it lets go of its memory, and the read-ahead goes further again,
        slowly, as for a pushed chunk the loader passed (a read-ahead of a chunk pushes nothing:
        that alone would never grow it back)."""
        if id(chunk) in self.loaded:
            self.budget.grow(self.cost(chunk) // 8)
        self.free(chunk)

    def free(self, chunk: Chunk):
        """A loaded chunk lets go of its memory and its part of the budget."""
        self._forget_edges(chunk)
        if self.loaded.pop(id(chunk), None) is not None:
            self.pushed.pop(id(chunk), None)
            chunk.unload()
            self.budget.release(self.cost(chunk))

    def free_all(self):
        for chunk in list(self.loaded.values()) + list(self.passed.values()):
            self.free(chunk)
        self.pool.trim()

    def backing(self, chunk: Chunk, buffer) -> Backing:
        """The backing of a chunk just read: a pool buffer, or (buffer None) its source's map range."""
        if buffer is None:
            return self.map_range(chunk.source, chunk.source_offset, chunk.source_offset + chunk.length)
        return Backing(lambda: self.pool.give_back(buffer))

    def map_range(self, source: int, begin: int, end: int) -> Backing:
        return Backing(functools.partial(self._unmap, source, begin, end), mapped=True)

    def _unmap(self, source: int, begin: int, end: int):
        """A served range of a source's map leaves the map now, and the page cache soon."""
        try:
            self._reader.maps.unmap(source, begin, end)
        except OSError as exc:  # only memory left behind: worth a warning, not the mount
            log.warning("could not unmap served source pages: %s", exc)
        self.stats.uncache_pending_bytes += end - begin
        self._to_uncache.append((source, begin, end))
        if len(self._to_uncache) == 1:
            self.nursery.start_soon(self._uncache)

    async def _uncache(self):
        while self._to_uncache:
            ranges, self._to_uncache = self._to_uncache, []
            await trio.to_thread.run_sync(self._reader.maps.uncache_all, ranges)
            self.stats.uncache_pending_bytes -= sum(end - begin for _, begin, end in ranges)

    def figures(self) -> dict:
        """What the memory is in, for the status."""
        loaded = [c for c in self.loaded.values() if c.backing is not None]
        return {"created": self.pool.created, "idle": len(self.pool.idle),
                "replies_owning": sum(c.backing.owners - 1 for c in loaded),
                "pushed_held": len(self.pushed),
                "mapped_bytes": sum(c.length for c in loaded if c.backing.mapped),
                "buffered_bytes": sum(self.cost(c) for c in loaded if not c.backing.mapped),
                "idle_bytes": self.pool.idle_bytes}
