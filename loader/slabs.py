"""Slabs: large host buffers shared by many tensors, so that a load makes a few hundred allocations
instead of one per tensor and copies to the GPU are plain DMA from page-locked memory (pageable
sources leave driver staging behind, which shrinks MemAvailable on unified memory).

A slab's buffer is an anonymous map in huge pages, page-locked with cudaHostRegister once the read
threads have filled it (registering an empty map would fault it in on one thread). A slab lives as
long as some tensor views it: torch holds the memoryview a slab's tensor was made from until the last
view dies, and that memoryview's finalizer releases the slab's budget and keeps its buffer for the
next slab while the budget has room. Each tensor starts 4 KiB aligned; a tensor larger than a slab
gets a buffer of its own.
"""

from __future__ import annotations

import itertools
import mmap
import threading
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from rankfs.loader.budget import Budget

ALIGN = 4096


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def pack(sizes: list[tuple[str, int]], slab_bytes: int) -> list[list[tuple[str, int]]]:
    """Greedy packing in the given order: [[(name, offset), ...] per slab]."""
    slabs, current, used = [], [], 0
    for name, nbytes in sizes:
        if current and used + nbytes > slab_bytes:
            slabs.append(current)
            current, used = [], 0
        current.append((name, used))
        used += _align(nbytes)
    if current:
        slabs.append(current)
    return slabs


class HostBuffer:
    """An anonymous map in huge pages (a fault per 2 MiB, not per 4 KiB), page-locked for DMA once
    filled (`pin`)."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, max(nbytes, 1))
        self.map.madvise(mmap.MADV_HUGEPAGE)
        self.pinned_at: int | None = None

    def pin(self):
        """cudaHostRegister, once: after the reads, whose threads faulted the pages in together."""
        if self.pinned_at is not None:
            return
        view = torch.frombuffer(self.map, dtype=torch.uint8)
        address = view.data_ptr()
        del view  # a view left alive would keep the map from closing
        error = torch.cuda.cudart().cudaHostRegister(address, len(self.map), 0)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of a {len(self.map)}-byte slab failed: {error}")
        self.pinned_at = address

    def __len__(self) -> int:
        return len(self.map)

    def close(self):
        if self.pinned_at is not None:
            torch.cuda.cudart().cudaHostUnregister(self.pinned_at)
            self.pinned_at = None
        self.map.close()


class Slab:
    """A buffer, the tensors placed in it (for the report of leftovers) and a uint8 tensor over it
    that every tensor handed out views."""

    def __init__(self, buffer: HostBuffer, nbytes: int, on_death: Callable[[], None]):
        self.buffer = buffer
        memory = memoryview(buffer.map)[:nbytes]
        weakref.finalize(memory, on_death).atexit = False
        self.tensor = torch.frombuffer(memory, dtype=torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)

    def target(self, offset: int, nbytes: int) -> memoryview:
        """Where a read fills bytes [offset, offset + nbytes) of the slab."""
        return memoryview(self.tensor.numpy())[offset:offset + nbytes]


@dataclass
class SlabStats:
    requests: int = 0  # tensors placed in slabs
    slabs: int = 0


class SlabPool:
    def __init__(self, slab_bytes: int, budget: Budget, pin: bool):
        self.slab_bytes = slab_bytes
        self.budget = budget
        self.pin = pin
        self.stats = SlabStats()
        self._ids = itertools.count()
        self._live: dict[int, tuple[str, list[str], HostBuffer]] = {}  # slab id -> (file, tensor names, buffer)
        self._idle: list[HostBuffer] = []  # buffers of dead slabs, for the next ones
        self._lock = threading.Lock()

    def footprint(self, nbytes: int) -> int:
        """The buffer a slab of nbytes takes: a whole slab at least, so that every dead buffer fits
        the next slab (no new map to fault in and page-lock, nothing to unregister mid-load)."""
        return max(nbytes, self.slab_bytes)

    def allocate(self, nbytes: int, names: list[str], file: str) -> Slab:
        """A new slab of nbytes; its footprint is reserved already (by the read threads' admission),
        and released by its death."""
        slab_id = next(self._ids)
        size = self.footprint(nbytes)
        buffer = self._reuse(size) or HostBuffer(size)
        with self._lock:
            self._live[slab_id] = (file, names, buffer)
            self.stats.slabs += 1
            self.stats.requests += len(names)
        return Slab(buffer, nbytes, lambda: self._died(slab_id, size, buffer))

    def filled(self, slab: Slab):
        """A slab's reads are done: page-lock it for DMA when the pool pins."""
        if self.pin:
            slab.buffer.pin()

    def _died(self, slab_id: int, nbytes: int, buffer: HostBuffer):
        """The last tensor viewing a slab is gone (any thread): its buffer is idle, its bytes free."""
        with self._lock:
            del self._live[slab_id]
            self._idle.append(buffer)
        self.budget.release(nbytes)

    def _reuse(self, nbytes: int) -> HostBuffer | None:
        """An idle buffer that holds nbytes without wasting more than a quarter of it (a slab's: one
        of the slab's size); idle buffers that no longer fit beside the budget in use are unmapped."""
        evicted, found = [], None
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if nbytes <= len(buffer) <= nbytes + nbytes // 4 + ALIGN:
                    found = self._idle.pop(i)
                    break
            idle_bytes = sum(len(b) for b in self._idle)
            while self._idle and self.budget.used + idle_bytes > self.budget.limit:
                evicted.append(self._idle.pop(0))
                idle_bytes -= len(evicted[-1])
        for buffer in evicted:
            buffer.close()
        return found

    def drop_idle(self):
        """Unpin and unmap the buffers kept for reuse (after the load)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for buffer in idle:
            buffer.close()

    def alive(self) -> list[tuple[str, list[str]]]:
        """(file, tensor names) of every slab some tensor still holds."""
        with self._lock:
            return [(file, names) for file, names, _ in self._live.values()]

    def pinned_bytes(self) -> int:
        """Page-locked bytes held: of live slabs, and of idle buffers kept for reuse."""
        with self._lock:
            buffers = [buffer for _, _, buffer in self._live.values()] + self._idle
        return sum(len(b) for b in buffers if b.pinned_at is not None)
