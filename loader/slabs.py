"""Pinned host slabs: large buffers shared by many tensors, so a load makes a few hundred pinned
allocations instead of one per tensor, and copies to the GPU are plain DMA from pinned memory
(pageable sources leave driver staging behind, which shrinks MemAvailable on unified memory).

A slab is an anonymous memory map in huge pages; with CUDA it is page-locked with cudaHostRegister
once the read threads have filled it (5 ms per 256 MiB on an H200 host). cudaHostAlloc took 100 ms
per 256 MiB there, one thread at a time however many asked, and a warm load spent most of its time
in it. Once its last view dies a slab's buffer is kept for the next one (still registered) while
the budget has room, and unregistered and unmapped at release.
A slab lives exactly as long as some tensor views it; its storage's weak reference tells.
Each tensor starts 4 KiB aligned; a tensor larger than a slab gets a buffer of its own.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from dataclasses import dataclass

import torch

log = logging.getLogger("rankfs.hook")

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


@dataclass
class SlabStats:
    requests: int = 0  # tensors placed in slabs
    slabs: int = 0
    live_bytes: int = 0
    peak_live_bytes: int = 0


class HostBuffer:
    """An anonymous map in huge pages (a fault per 2 MiB, not per 4 KiB), page-locked for DMA
    once filled (`pin`)."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, max(nbytes, 1))
        self.map.madvise(mmap.MADV_HUGEPAGE)
        self.pinned_at: int | None = None

    def pin(self):
        """cudaHostRegister, once: after the reads, whose threads faulted the pages in together
        (5 ms per 256 MiB then; registering an empty map faults them in on one thread: 41 ms)."""
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
    """One buffer and the names of the tensors placed in it (for the report of leftovers)."""

    def __init__(self, nbytes: int, names: list[str], buffer: HostBuffer | None = None):
        self.nbytes = nbytes
        self.names = names
        self.buffer = buffer or HostBuffer(nbytes)
        self.tensor = torch.frombuffer(self.buffer.map, dtype=torch.uint8, count=nbytes) if nbytes else \
            torch.empty(0, dtype=torch.uint8)

    def memoryview(self) -> memoryview:
        return memoryview(self.tensor.numpy()).cast("B")


class SlabPool:
    def __init__(self, slab_bytes: int, budget_bytes: int, pin: bool):
        self.slab_bytes = slab_bytes
        self.budget_bytes = budget_bytes
        self.pin = pin
        self.stats = SlabStats()
        self._live: list[tuple[int, int, str, list[str], HostBuffer]] = []  # (storage weak ref, bytes, file, names, buffer)
        self._idle: list[HostBuffer] = []  # buffers of dead slabs, for the next ones
        self._lock = threading.Lock()

    def allocate(self, nbytes: int, names: list[str], file: str, may_wait=lambda: True) -> Slab:
        """A new slab. A read ahead waits (up to a minute) until the budget has room, as long as
        may_wait() holds: once the loader asks for one of its tensors it waits no more, since the
        tensors that fill the budget may be the ones that loader holds."""
        self._wait_for_room(nbytes, may_wait)
        slab = Slab(nbytes, names, self._reuse(nbytes))
        with self._lock:
            self._live.append((slab.tensor.untyped_storage()._weak_ref(), nbytes, file, names, slab.buffer))
            self.stats.live_bytes += nbytes
            self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, self.stats.live_bytes)
            self.stats.slabs += 1
            self.stats.requests += len(names)
        return slab

    def filled(self, slab: Slab):
        """A slab's reads are done: page-lock it for DMA when the pool pins."""
        if self.pin:
            slab.buffer.pin()

    def hold(self, nbytes: int, may_wait=lambda: True):
        """Count bytes read ahead outside slabs (mapped from the sources) against the budget."""
        self._wait_for_room(nbytes, may_wait)
        with self._lock:
            self.stats.live_bytes += nbytes
            self.stats.peak_live_bytes = max(self.stats.peak_live_bytes, self.stats.live_bytes)

    def let_go(self, nbytes: int):
        with self._lock:
            self.stats.live_bytes -= nbytes

    def _wait_for_room(self, nbytes: int, may_wait):
        deadline = time.monotonic() + 60
        while self._reap() + nbytes > self.budget_bytes and self.stats.live_bytes and may_wait() \
                and time.monotonic() < deadline:
            time.sleep(0.005)

    def _reuse(self, nbytes: int) -> HostBuffer | None:
        """An idle buffer that holds nbytes without wasting more than a quarter of it."""
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if nbytes <= len(buffer) <= nbytes + nbytes // 4 + ALIGN:
                    return self._idle.pop(i)
        return None

    def _reap(self) -> int:
        """Forget slabs no tensor views any more, keeping their buffers while the budget has room;
        returns the bytes still live."""
        evicted = []
        with self._lock:
            kept = []
            for entry in self._live:
                if torch.UntypedStorage._expired(entry[0]):
                    torch.UntypedStorage._free_weak_ref(entry[0])
                    self.stats.live_bytes -= entry[1]
                    self._idle.append(entry[4])
                else:
                    kept.append(entry)
            self._live = kept
            idle_bytes = sum(len(b) for b in self._idle)
            while self._idle and self.stats.live_bytes + idle_bytes > self.budget_bytes:
                evicted.append(self._idle.pop(0))
                idle_bytes -= len(evicted[-1])
            live = self.stats.live_bytes
        for buffer in evicted:
            buffer.close()
        return live

    def drop_idle(self):
        """Unpin and unmap the buffers kept for reuse (after the load)."""
        self._reap()
        with self._lock:
            idle, self._idle = self._idle, []
        for buffer in idle:
            buffer.close()

    def alive(self) -> list[tuple[str, list[str]]]:
        """(file, tensor names) of every slab some tensor still holds."""
        self._reap()
        with self._lock:
            return [(file, names) for _, _, file, names, _ in self._live]
