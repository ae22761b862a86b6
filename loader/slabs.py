"""Slabs: large buffers shared by many tensors, so that a load makes a few hundred allocations
instead of one per tensor and copies to the GPU are plain DMA from page-locked memory (pageable
sources leave driver staging behind, which shrinks MemAvailable on unified memory).

A slab's buffer is a `HostBuffer`, an anonymous map in huge pages filled by the read threads, or a
`FileWindow`, pages of a source the page cache already holds, mapped in place (nothing read,
nothing copied: the GPU copies straight from the page cache); either is page-locked with
cudaHostRegister once it holds its bytes. The same pool keeps the GPU buffers that groups are
uploaded to (rankfs.loader.device_slabs). A slab lives as long as some tensor views it: torch holds
the memoryview a slab's tensor was made from until the last view dies, and that memoryview's
finalizer releases the slab's budget and keeps a host buffer for the next slab (the first use of
fresh memory, faulting and page-locking it, costs several times a read from the page cache); a
window is unpinned and unmapped. A tensor larger than a slab gets a buffer of its own.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from rankfs.loader import cuda
from rankfs.loader.budget import Budget
from rankfs.common.disk import (MADV_POPULATE_READ, MADV_POPULATE_WRITE, PAGE, OpenFile, anonymous_map, madvise,
                              map_pages, unmap_pages)

log = logging.getLogger("rankfs.hook")

def host_view(memory: memoryview, died: Callable[[], None]) -> torch.Tensor:
    """A uint8 tensor over host memory; died() runs when torch lets go of the memoryview, with the
    last tensor viewing it."""
    weakref.finalize(memory, died).atexit = False
    return torch.frombuffer(memory, dtype=torch.uint8) if len(memory) else torch.empty(0, dtype=torch.uint8)


class HostBuffer:
    """Anonymous memory in huge pages (rankfs.common.disk.anonymous_map), page-locked for DMA once
    filled (`pin`): registering it empty would fault it in on one thread."""

    reusable = True

    def __init__(self, nbytes: int):
        self.map = anonymous_map(max(nbytes, 1))
        self.pinned_at: int | None = None

    def view(self, nbytes: int, died: Callable[[], None]) -> torch.Tensor:
        return host_view(memoryview(self.map)[:nbytes], died)

    def _address(self) -> int:
        return torch.frombuffer(self.map, dtype=torch.uint8).data_ptr()  # the view dies here: the map can close

    def fault_in(self):
        """Fault every page in here, zero-filled, so that page-locking it has nothing to fault (a
        no-op before Linux 5.14, where the page-lock does it)."""
        try:
            madvise(self._address(), len(self.map), MADV_POPULATE_WRITE)
        except OSError:
            pass

    def pin(self):
        if self.pinned_at is not None:
            return
        address = self._address()
        cuda.page_lock(address, len(self.map))
        self.pinned_at = address

    def __len__(self) -> int:
        return len(self.map)

    def close(self):
        cuda.page_unlock(self.pinned_at)
        self.pinned_at = None
        self.map.close()


class FileWindow:
    """Whole pages [begin, end) of a source, mapped shared and read-only: the page cache's own pages,
    which a tensor views with no read and no copy. Page-locking them (`pin`) lets the GPU copy
    straight from the page cache. A loader writing into such a tensor faults (SIGSEGV) rather than
    changing what the GPU gets or the source."""

    reusable = False

    def __init__(self, source: OpenFile, begin: int, end: int):
        self.address = map_pages(source.fd, begin, end - begin, f"{source.path}: map of [{begin}, {end})")
        self.nbytes = end - begin
        self.pinned_at: int | None = None

    def view(self, nbytes: int, died: Callable[[], None]) -> torch.Tensor:
        return host_view(memoryview((ctypes.c_ubyte * self.nbytes).from_address(self.address))[:nbytes], died)

    def pin(self):
        if self.pinned_at is None:
            cuda.page_lock(self.address, self.nbytes, cuda.HOST_REGISTER_READ_ONLY)
            self.pinned_at = self.address

    def populate(self):
        """Map the pages in here (a read thread), not in the loader's page faults, where nothing
        page-locks them (loads into host memory). Before Linux 5.14 the loader's faults do it."""
        try:
            madvise(self.address, self.nbytes, MADV_POPULATE_READ)
        except OSError:
            pass

    def __len__(self) -> int:
        return self.nbytes

    def close(self):
        if self.address is None:
            return
        cuda.page_unlock(self.pinned_at)
        self.pinned_at = None
        unmap_pages(self.address, self.nbytes)
        self.address = None


class Buffer(Protocol):
    """What a slab's memory is: a HostBuffer, a FileWindow, or a buffer in GPU memory
    (rankfs.loader.device_slabs)."""
    reusable: bool
    pinned_at: int | None

    def view(self, nbytes: int, died: Callable[[], None]) -> torch.Tensor: ...
    def __len__(self) -> int: ...
    def close(self): ...


class Slab:
    """A uint8 tensor that every tensor handed out from a buffer views, the budget its death
    releases (`reserved`), and the buffer (the names are kept by the pool, for the report of
    leftovers)."""

    def __init__(self, tensor: torch.Tensor, reserved: int, buffer: Buffer):
        self.tensor, self.reserved, self.buffer = tensor, reserved, buffer
        self._typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # the slab as each dtype handed out

    def view(self, at: int, dtype: torch.dtype, shape: list[int], strides: list[int]) -> torch.Tensor:
        """The contiguous tensor whose bytes start at `at` (a multiple of the dtype's size): one
        torch call on a view of the whole slab as that dtype, not three on its bytes. Each torch
        call on the hook's threads lets the GIL go and waits to take it back, behind the loader's
        loop and every other thread."""
        typed = self._typed.get(dtype)
        if typed is None:
            whole = self.tensor.numel() - self.tensor.numel() % dtype.itemsize
            as_dtype = self.tensor[:whole].view(dtype)
            typed = self._typed[dtype] = (as_dtype, as_dtype.storage_offset())
        as_dtype, origin = typed
        return as_dtype.as_strided(shape, strides, origin + at // dtype.itemsize)


@dataclass
class SlabStats:
    requests: int = 0  # tensors placed in slabs
    slabs: int = 0
    windows: int = 0  # of which windows of the page cache
    window_bytes: int = 0
    file_bytes: dict[str, int] = field(default_factory=dict)  # per file: its slabs' buffers, together
    held_bytes: int = 0  # buffers mapped (or allocated) now: of live slabs, and idle ones
    peak_bytes: int = 0


class SlabPool:
    def __init__(self, slab_bytes: int, budget: Budget, pin: bool, wanted: Callable[[], bool] = lambda: True,
                 retire: Callable[[Buffer], None] = lambda buffer: buffer.close(),
                 make: Callable[[int], Buffer] = HostBuffer):
        """wanted(): whether more slabs will be asked for (else a dead slab's buffer goes at once);
        retire(buffer): unpin and unmap it, off the loader's threads where it can; make(nbytes): a
        new buffer."""
        self.wanted, self.retire, self.make = wanted, retire, make
        self.slab_bytes = slab_bytes
        self.budget = budget
        self.pin = pin
        self.stats = SlabStats()
        self._ids = itertools.count()
        self.windows_pinnable = True  # until the kernel refuses to page-lock a window
        self._live: dict[int, tuple[str, list[str], Buffer]] = {}  # slab id -> (file, tensor names, buffer)
        self._idle: list[Buffer] = []  # buffers of dead slabs, for the next ones
        self._lock = threading.Lock()

    def footprint(self, nbytes: int) -> int:
        """The buffer a slab of nbytes takes: a whole slab at least, so that every dead buffer fits
        the next slab (no new map to fault in and page-lock, nothing to unregister mid-load)."""
        return max(nbytes, self.slab_bytes)

    def allocate(self, nbytes: int, names: list[str], file: str, on_death: Callable[[], None] | None = None) -> Slab:
        """A new slab of nbytes; its footprint is reserved already (by the read threads' admission),
        and released by its death (then on_death() runs too)."""
        size = self.footprint(nbytes)
        buffer = self._reuse(size) or self._held(self.make(size))
        return self._slab(buffer, nbytes, size, names, file, on_death)

    def window(self, source: OpenFile, begin: int, end: int, names: list[str], file: str,
               on_death: Callable[[], None] | None = None) -> Slab:
        """A slab of the source's whole pages [begin, end), which the page cache holds, mapped in
        place and page-locked when the pool pins; its end - begin bytes are reserved already. A
        window the kernel will not page-lock stays pageable (copies from it are slower, not
        wrong), and later groups are read into host buffers (`windows_pinnable`)."""
        window = self._held(FileWindow(source, begin, end))
        if not self.pin:
            window.populate()
        else:
            try:
                window.pin()
            except RuntimeError as exc:
                if self.windows_pinnable:
                    log.warning("rankfs hook: %s: page-cache pages cannot be page-locked (%s); reading "
                                "into pinned buffers instead", source.path, exc)
                self.windows_pinnable = False
        with self._lock:
            self.stats.windows += 1
            self.stats.window_bytes += len(window)
        return self._slab(window, len(window), len(window), names, file, on_death)

    def _held(self, buffer: Buffer, sign: int = 1) -> Buffer:
        with self._lock:
            self.stats.held_bytes += sign * len(buffer)
            self.stats.peak_bytes = max(self.stats.peak_bytes, self.stats.held_bytes)
        return buffer

    def _slab(self, buffer: Buffer, nbytes: int, size: int, names: list[str], file: str,
              on_death: Callable[[], None] | None) -> Slab:
        slab_id = next(self._ids)
        with self._lock:
            self._live[slab_id] = (file, names, buffer)
            self.stats.slabs += 1
            self.stats.requests += len(names)
            self.stats.file_bytes[file] = self.stats.file_bytes.get(file, 0) + size

        def died():
            self._died(slab_id, buffer, size)
            if on_death is not None:
                on_death()
        return Slab(buffer.view(nbytes, died), size, buffer)

    def filled(self, slab: Slab):
        """A slab's reads are done: page-lock it for DMA when the pool pins. Where the kernel or the
        driver refuses (RLIMIT_MEMLOCK, the driver's own limit), the slabs stay pageable from then
        on: copies from them are slower, not wrong, and the load goes on."""
        if not self.pin:
            return
        try:
            slab.buffer.pin()
        except RuntimeError as exc:
            self.pin = False
            log.warning("rankfs hook: slabs cannot be page-locked (%s); they stay pageable: slower copies "
                        "to the GPU (raise RLIMIT_MEMLOCK, e.g. docker --ulimit memlock=-1)", exc)

    def _died(self, slab_id: int, buffer: Buffer, reserved: int):
        """The last tensor viewing a slab is gone (any thread, often one of the loader's): its
        buffer waits for the next slab, unless no more are wanted (the load's last reads are done:
        unmapping now spares the release) or the buffers would hold more than the budget (after a
        file larger than it); a window goes. `reserved` is released."""
        with self._lock:
            del self._live[slab_id]
            held = self.budget.used - reserved
            keep = buffer.reusable and held + sum(len(b) for b in self._idle) + len(buffer) <= self.budget.limit
        keep = keep and self.wanted()
        if keep:
            with self._lock:
                self._idle.append(buffer)
        else:
            self.retire(self._held(buffer, -1))
        self.budget.release(reserved)

    def _reuse(self, nbytes: int) -> Buffer | None:
        """An idle buffer that holds nbytes without wasting more than a quarter of it (a slab's: one
        of the slab's size)."""
        with self._lock:
            for i, buffer in enumerate(self._idle):
                if nbytes <= len(buffer) <= nbytes + nbytes // 4 + PAGE:
                    return self._idle.pop(i)
        return None

    @property
    def idle(self) -> tuple[Buffer, ...]:
        """The buffers of dead slabs kept for the next ones."""
        with self._lock:
            return tuple(self._idle)

    def drop_idle(self):
        """Unpin and unmap the buffers kept for reuse (after the load)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for buffer in idle:
            self._held(buffer, -1).close()

    def alive(self) -> list[tuple[str, list[str]]]:
        """(file, tensor names) of every slab some tensor still holds."""
        with self._lock:
            return [(file, names) for file, names, _ in self._live.values()]

    def pinned_bytes(self) -> int:
        """Page-locked bytes held: of live slabs, and of idle buffers kept for reuse."""
        with self._lock:
            buffers = [buffer for _, _, buffer in self._live.values()] + self._idle
        return sum(len(b) for b in buffers if b.pinned_at is not None)
