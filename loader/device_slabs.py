"""Staging on the GPU (RANKFS_HOOK_DEVICE): each group is read straight into GPU memory, and the
loader gets views of that. Its own copies are then device to device: a few microseconds each, where
a host-to-device copy per tensor kept the loader's threads (and the GIL) busy for most of a load on
fast storage. SGLang runs the weight loaders of device tensors on its loop, with no thread pool.

Page-locked memory is the read threads' bounce buffers alone (rankfs.loader.bounce): slabs of
fresh page-locked memory cost more to fault in and lock than reading the first file. The GPU memory
read ahead is the budget (RANKFS_HOOK_INFLIGHT_GB), handed back to the driver at release, before the
engine sizes its KV pool.

A GPU slab's tensor is a view of a buffer exported through DLPack and imported back, a storage of
its own that holds the exported view until the last tensor viewing the slab dies: the exported
view's finalizer is how the pool hears of it, as a host slab's memoryview finalizer does. The
loader's copies from it are queued on the device then, not done, so a dead slab's buffer is written
again, or handed back to CUDA's allocator, only after a device synchronization that followed its
death (`Fence`).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable

import torch

from rankfs.common.trace import Trace
from rankfs.loader.bounce import BounceBuffers
from rankfs.loader.slabs import Slab, SlabPool
from rankfs.loader.staging import Staging
from rankfs.loader.uploads import Bounce

log = logging.getLogger("rankfs.hook")


def alias(memory: torch.Tensor, nbytes: int, died: Callable[[], None]) -> torch.Tensor:
    """A uint8 tensor over memory[:nbytes] with a storage of its own: died() runs when torch frees
    it, with the last tensor viewing it (on whichever thread drops that). The storage holds the
    exported view until then, and the view's finalizer is the signal: Python runs finalizers with
    any exception in flight set aside, so a slab whose last view goes as a loader's error unwinds
    still tells the pool (a ctypes DLPack deleter cannot be called then, and would lose both the
    death and the error)."""
    exported = memory[:nbytes]
    tensor = torch.utils.dlpack.from_dlpack(exported.__dlpack__())
    weakref.finalize(exported, died)
    return tensor


class Fence:
    """Device synchronizations, counted: a buffer freed before the last one is no longer read."""

    def __init__(self, synchronize: Callable[[], None]):
        self.synchronize = synchronize
        self.count = 0
        self._lock = threading.Lock()

    def after(self, count: int):
        """Make sure a synchronization began after `count` was read (the count moves first: a slab
        that dies while one runs reads the new count, and waits for the next)."""
        with self._lock:
            if self.count == count:
                self.count += 1
                self.synchronize()


class DeviceBuffer:
    """A buffer in GPU memory (a torch allocation), written by uploads, viewed by the slabs made of it."""

    reusable = True
    pinned_at = None

    def __init__(self, nbytes: int, device: torch.device, fence: Fence):
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.fence = fence
        self.freed_at = None  # the fence's count when its last slab died

    def view(self, nbytes: int, died: Callable[[], None]) -> torch.Tensor:
        def freed():
            self.freed_at = self.fence.count
            died()
        return alias(self.memory, nbytes, freed)

    def writable(self):
        """Wait, where it must, until the copies queued from a dead slab of it are done."""
        if self.freed_at is not None:
            self.fence.after(self.freed_at)
            self.freed_at = None

    def __len__(self) -> int:
        return self.memory.numel()

    def close(self):
        self.writable()
        self.memory = None


class DeviceSlabs:
    """GPU slabs, filled through the read threads' bounce buffers; their buffers are reused as host
    buffers are (rankfs.loader.slabs)."""

    def __init__(self, staging: Staging, slab_bytes: int, budget, wanted, retire):
        self.staging = staging
        self.device = staging.device
        self.fence = Fence(staging.synchronize)
        self.pool = SlabPool(slab_bytes, budget, pin=False, wanted=wanted, retire=retire,
                             make=lambda nbytes: DeviceBuffer(nbytes, self.device, self.fence))
        self.failed = False  # the device ran out of memory once: groups stay in host slabs from then on
        self.bounce_bytes = 0  # page-locked in bounce buffers, at the most
        self._bounces: dict[int, Bounce] = {}  # per read thread
        self._buffers: BounceBuffers | None = None
        self._lock = threading.Lock()

    def prepare_bounces(self, threads: int, trace: Trace | None = None):
        """A load starts: make its read threads' bounce buffers (two each) ahead."""
        with self._lock:
            if self._buffers is None:
                self._buffers = BounceBuffers(2 * threads, pin=self.staging.pinned, trace=trace)

    @property
    def staged_on(self) -> str:
        """Where groups were handed out from: the device, and the host once it ran out of memory."""
        return str(self.device) + ("+host" if self.failed else "")

    def allocate(self, nbytes: int, names: list[str], file: str, on_death) -> Slab | None:
        """A GPU slab to read a group into, its footprint reserved already; None where the device
        has no memory for it (the group goes into a host slab)."""
        if self.failed:
            return None
        try:
            slab = self.pool.allocate(nbytes, names, file, on_death=on_death)
        except torch.OutOfMemoryError as exc:
            self.failed = True
            log.warning("rankfs hook: %s: no GPU memory to stage on %s (%s); handing out page-locked host "
                        "memory for the rest of the load", file, self.device, str(exc).splitlines()[0])
            return None
        slab.buffer.writable()
        return slab

    def bounce(self) -> Bounce:
        """This read thread's bounce buffers (the load's are prepared)."""
        key = threading.get_ident()
        bounce = self._bounces.get(key)
        if bounce is None:  # made outside the lock: the threads start together
            bounce = Bounce(self.staging.transfer(self.device), self._buffers)
            with self._lock:
                self._bounces[key] = bounce
        return bounce

    def close_bounces(self):
        """Unpin and unmap the bounce buffers (the read threads are stopped)."""
        with self._lock:
            bounces, self._bounces = list(self._bounces.values()), {}
            buffers, self._buffers = self._buffers, None
            self.bounce_bytes = max(self.bounce_bytes, sum(b.nbytes for b in bounces)
                                    + (buffers.idle_bytes if buffers is not None else 0))
        for bounce in bounces:
            bounce.close()
        if buffers is not None:
            buffers.close()

    def pinned_bytes(self) -> int:
        with self._lock:
            buffers = self._buffers
            idle = buffers.idle_bytes if buffers is not None and buffers.pin else 0
            return idle + sum(b.nbytes for b in self._bounces.values() if b.supply.pin)
