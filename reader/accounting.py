"""What the read engine holds and has done: its byte budgets (loaded chunks, --inflight-gb; reads in
flight), and its counters (the status shows the first and the last)."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import trio


class Budget:
    """Bytes against a limit, reserved before they are taken and released once let go: the loaded
    chunks the daemon holds (--inflight-gb), and the read-ahead's reads in flight."""

    def __init__(self, limit: int):
        self.ceiling = limit  # as configured
        self.limit = limit  # now: paced down from the ceiling where what it held was lost (`shrink`)
        self.used = 0
        self.peak = 0
        self._room = trio.Event()

    def shrink(self, floor: int):
        """Halve the limit, to `floor` at least: what the budget held was lost before it was used
        (pushed pages the kernel evicted under memory pressure, a cgroup's limit)."""
        self.limit = max(floor, min(self.limit, self.ceiling) // 2)

    def grow(self, nbytes: int):
        """What the budget held was used: the limit grows back towards the ceiling by that much."""
        if self.limit < self.ceiling:
            self.limit = min(self.ceiling, self.limit + nbytes)
            self._room.set()
            self._room = trio.Event()

    def reserve(self, nbytes: int):
        self.used += nbytes
        self.peak = max(self.peak, self.used)

    def release(self, nbytes: int):
        self.used -= nbytes
        self._room.set()  # wake a prefetcher waiting for room
        self._room = trio.Event()

    async def wait_for_room(self, nbytes: int):
        while self.used and self.used + nbytes > self.limit:
            await self._room.wait()


@dataclass
class Stats:
    read_bytes: collections.Counter = field(default_factory=collections.Counter)  # per source index
    on_demand_read_bytes: int = 0  # row stores and plain files, read only when asked
    demand_loads: int = 0
    prefetch_loads: int = 0
    pushed_bytes: int = 0
    pushed_fill_bytes: int = 0  # fill outside the rank's slices, pushed on the pages a chunk shares with it
    listing_pages: int = 0  # pushed as a file was first opened: what a safetensors listing reads
    listing_pages_left: int = 0  # those a listing reads left to requests: a source unreadable, or not stored
    listing_pages_refused: int = 0  # of those left, the ones the kernel would not store
    remnant_bytes: int = 0  # read again for what the loader had not read of a chunk let go
    reread_bytes: int = 0  # whole chunks read again: the kernel asked for them after they were let go
    evicted_reread_bytes: int = 0  # of them, chunks the kernel asked again for pages it had been handed: it evicted them
    evictions: int = 0  # chunks (or the remnants of ones let go) read again for that
    read_ahead_halvings: int = 0  # times the read-ahead went half as far for them: once per loss
    uncache_pending_bytes: int = 0  # served source pages not yet dropped from the page cache
    dropped_bytes: int = 0  # the view's pages the loader was done with, dropped from its page cache
    errors: int = 0
