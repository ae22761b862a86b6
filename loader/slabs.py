"""Slabs: large host buffers shared by many tensors, so that a load makes a few hundred allocations
instead of one per tensor and copies to the GPU are plain DMA from page-locked memory (pageable
sources leave driver staging behind, which shrinks MemAvailable on unified memory).

A slab's buffer is an anonymous map in huge pages, page-locked with cudaHostRegister once the read
threads have filled it (registering an empty map would fault it in on one thread). A slab lives as
long as some tensor views it: torch holds the memoryview a slab's tensor was made from until the last
view dies, and that memoryview's finalizer releases the slab's budget and keeps its buffer for the
next slab (the first use of fresh memory, faulting and page-locking it, costs several times a read
from the page cache). A tensor larger than a slab gets a buffer of its own.
"""

from __future__ import annotations

import itertools
import mmap
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch

from rankfs.loader.budget import Budget
from rankfs.reader.io import PAGE

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
    file_bytes: dict[str, int] = field(default_factory=dict)  # per file: its slabs' buffers, together


class SlabPool:
    def __init__(self, slab_bytes: int, budget: Budget, pin: bool,
                 wanted: Callable[[], bool] = lambda: True, retire: Callable[[HostBuffer], None] = HostBuffer.close):
        """wanted(): whether more slabs will be asked for (else a dead slab's buffer goes at once);
        retire(buffer): unpin and unmap it, off the loader's threads where it can."""
        self.wanted, self.retire = wanted, retire
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

    def allocate(self, nbytes: int, names: list[str], file: str, on_death: Callable[[], None] | None = None) -> Slab:
        """A new slab of nbytes; its footprint is reserved already (by the read threads' admission),
        and released by its death (then on_death() runs too)."""
        slab_id = next(self._ids)
        size = self.footprint(nbytes)
        buffer = self._reuse(size) or HostBuffer(size)
        with self._lock:
            self._live[slab_id] = (file, names, buffer)
            self.stats.slabs += 1
            self.stats.requests += len(names)
            self.stats.file_bytes[file] = self.stats.file_bytes.get(file, 0) + size

        def died():
            self._died(slab_id, size, buffer)
            if on_death is not None:
                on_death()
        return Slab(buffer, nbytes, died)

    def filled(self, slab: Slab):
        """A slab's reads are done: page-lock it for DMA when the pool pins."""
        if self.pin:
            slab.buffer.pin()

    def _died(self, slab_id: int, nbytes: int, buffer: HostBuffer):
        """The last tensor viewing a slab is gone (any thread, often one of the loader's): its buffer
        waits for the next slab, unless no more are wanted (the load's last reads are done: unmapping
        now spares the release) or the buffers would hold more than the budget (after a file larger
        than it)."""
        with self._lock:
            del self._live[slab_id]
            keep = self.budget.used - nbytes + sum(len(b) for b in self._idle) + len(buffer) <= self.budget.limit
        keep = keep and self.wanted()
        if keep:
            with self._lock:
                self._idle.append(buffer)
        else:
            self.retire(buffer)
        self.budget.release(nbytes)

    def _reuse(self, nbytes: int) -> HostBuffer | None:
        """An idle buffer that holds nbytes without wasting more than a quarter of it (a slab's: one
        of the slab's size)."""
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if nbytes <= len(buffer) <= nbytes + nbytes // 4 + PAGE:
                    return self._idle.pop(i)
        return None

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
