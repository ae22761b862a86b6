"""Staging on the GPU (RANKFS_HOOK_DEVICE): each group is read straight into GPU memory, and the
loader gets views of that. Its own copies are then device to device: a few microseconds each, where
a host-to-device copy per tensor kept the loader's threads (and the GIL) busy for most of a load on
fast storage. SGLang runs the weight loaders of device tensors on its loop, with no thread pool.

A read thread reads a group's bytes into one of its two page-locked buffers and uploads them to
their place in the group's GPU slab on its own stream, reading the next into the other buffer
meanwhile. So page-locked memory is two pieces per thread, locked once: slabs of fresh
page-locked memory cost more to fault in and lock (0.35 s of a 1.2 s load of 13.5 GB on the H200
host) than reading the first file. The GPU memory read ahead is the budget (RANKFS_HOOK_INFLIGHT_GB),
handed back to the driver at release, before the engine sizes its KV pool.

A GPU slab's tensor is a view of a buffer exported through DLPack and imported back, a storage of
its own that holds the exported view until the last tensor viewing the slab dies: the exported
view's finalizer is how the pool hears of it, as a host slab's memoryview finalizer does. The
loader's copies from it are queued on the device then, not done, so a dead slab's buffer is written
again, or handed back to CUDA's allocator, only after a device synchronization that followed its
death.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import queue
import threading
import weakref
from typing import Callable

import torch

from rankfs.loader.slabs import HostBuffer, Slab, SlabPool
from rankfs.plan.spec import Rows
from rankfs.common.disk import PAGE, align_down, align_up

log = logging.getLogger("rankfs.hook")

PIECE_BYTES = 16 << 20  # a bounce buffer: a run of a slab (rankfs.loader.packing.RUN_BYTES), or rows of many slices


def alias(memory: torch.Tensor, nbytes: int, died: Callable[[], None]) -> torch.Tensor:
    """A uint8 tensor over memory[:nbytes] with a storage of its own: died() runs when torch frees
    it, with the last tensor viewing it (on whichever thread drops that). The storage holds the
    exported view until then, and the view's finalizer is the signal: Python runs finalizers with
    any exception in flight set aside, so a slab whose last view goes as a loader's error unwinds
    still tells the pool. A ctypes DLPack deleter cannot be called then, and lost both the death
    and the error (a SystemError in its place)."""
    exported = memory[:nbytes]
    tensor = torch.utils.dlpack.from_dlpack(exported.__dlpack__())
    weakref.finalize(exported, died)
    return tensor


class Fence:
    """Device synchronizations, counted: a buffer freed before the last one is no longer read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.count = 0
        self._lock = threading.Lock()

    def after(self, count: int):
        """Make sure a synchronization began after `count` was read (the count moves first: a slab
        that dies while one runs reads the new count, and waits for the next)."""
        with self._lock:
            if self.count == count:
                self.count += 1
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)


class DeviceBuffer:
    """A buffer in GPU memory (a torch allocation), written by uploads, viewed by the slabs made of it."""

    reusable = True
    pinned_at = None

    def __init__(self, nbytes: int, fence: Fence):
        self.memory = torch.empty(nbytes, dtype=torch.uint8, device=fence.device)
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


class BounceBuffers:
    """The read threads' bounce buffers, made and page-locked ahead while the loader opens its first
    files: locking one is a driver call of about 10 ms on the H200 host, and sixteen of them, made
    one after another on one thread, held the read threads' second pieces back for 0.16-0.29 s.
    MAKERS threads fault them in and lock them side by side instead (a warm EP2 load's first
    tensor 0.15-0.17 s after the loop starts, against 0.25-0.30 s)."""

    MAKERS = 4

    def __init__(self, count: int, pin: bool):
        self.pin = pin
        self.nbytes = PIECE_BYTES + 2 * PAGE  # a piece, and the partial pages around it a direct read fills
        # Buffers made ahead, or for each one a maker could not make, why (its taker raises it).
        self._ready: queue.SimpleQueue[HostBuffer | BaseException] = queue.SimpleQueue()
        self._left = count  # not yet taken
        self._idle = 0  # made and not taken
        self._lock = threading.Lock()
        shares = [count // self.MAKERS + (i < count % self.MAKERS) for i in range(min(self.MAKERS, count))]
        self._makers = [threading.Thread(target=self._make, args=(share,), name="rankfs-bounce", daemon=True)
                        for share in shares]
        for maker in self._makers:
            maker.start()

    def _make(self, count: int):
        for made in range(count):
            try:
                buffer = self.new(self.nbytes)
            except BaseException as exc:  # every taker waiting for this maker's share hears why
                for _ in range(count - made):
                    self._ready.put(exc)
                return
            with self._lock:
                self._idle += 1
            self._ready.put(buffer)

    def new(self, nbytes: int) -> HostBuffer:
        buffer = HostBuffer(nbytes)
        if self.pin:
            try:
                buffer.fault_in()
                buffer.pin()
            except BaseException:
                buffer.close()
                raise
        return buffer

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer of nbytes at least: one made ahead (waiting for it if it is being made), or a
        new one for a row larger than a piece."""
        with self._lock:
            made_ahead = nbytes <= self.nbytes and self._left > 0
            self._left -= made_ahead
        if not made_ahead:
            return self.new(max(nbytes, self.nbytes))
        made = self._ready.get()
        if isinstance(made, BaseException):
            raise RuntimeError(f"rankfs hook: no page-locked bounce buffer of {self.nbytes} bytes: {made}") from made
        with self._lock:
            self._idle -= 1
        return made

    @property
    def idle_bytes(self) -> int:
        """Made and not taken yet."""
        return self._idle * self.nbytes

    def close(self):
        """Unpin and unmap those never taken."""
        for maker in self._makers:
            maker.join()
        while not self._ready.empty():
            made = self._ready.get()
            if not isinstance(made, BaseException):
                made.close()
        self._idle = 0


class _Upload:
    """Bytes in a bounce buffer bound for a slab: `height` rows of `width` bytes, `pitch` apart from
    `position` in the buffer, landing packed at target[at:]. A run of bytes is one row, as wide as
    the bytes joined into it."""
    __slots__ = ("position", "at", "width", "height", "row_bytes")

    def __init__(self, position: int, at: int, width: int, height: int = 1, row_bytes: int | None = None):
        self.position, self.at, self.width, self.height, self.row_bytes = position, at, width, height, row_bytes

    @property
    def pitch(self) -> int:
        return self.row_bytes or self.width

    @property
    def end(self) -> int:
        """Where the bytes it uploads end in its target."""
        return self.at + self.width * self.height


@functools.cache
def _cudart() -> ctypes.PyDLL:
    """The CUDA runtime torch loaded (its streams are that runtime's), for the copies torch makes
    only through a CPU copy: the columns of whole rows uploaded by one pitched copy. Its calls
    queue a copy and return in microseconds, so they keep the GIL: a call that lets it go waits
    to take it back behind every other thread that wants it."""
    with open("/proc/self/maps") as maps:
        paths = [line.split(maxsplit=5)[-1].strip() for line in maps]
    path = next((p for p in paths if os.path.basename(p).startswith("libcudart.so")),
                f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    runtime = ctypes.PyDLL(path)
    runtime.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return runtime


_HOST_TO_DEVICE = 1  # cudaMemcpyKind


class Bounce:
    """A read thread's two page-locked buffers and its stream: reads land in one while the other
    uploads, across jobs too (a job's last upload is waited for by its group, not by the thread).
    Reads that come next to each other in a slab share an upload while they fit: each upload takes
    the GIL a few times, which the loader's loop waits for. Whole rows of a slice land as they are
    and only the rank's columns go up, by one pitched copy: picking them on the CPU ran at 0.7 GB/s
    for a sliced w2's scales (18 of each 72-byte row kept) on the H200 host, the pitched copy at 3."""

    def __init__(self, device: torch.device, buffers: BounceBuffers):
        """Made on the read thread it serves: its stream becomes the thread's current one."""
        self.supply = buffers  # where its buffers come from
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)  # no stream context per upload: fewer calls that take the GIL
        self.buffers: list[HostBuffer | None] = [None, None]
        self.tensors: list[torch.Tensor | None] = [None, None]  # uint8 views of the buffers, to copy from
        # Each buffer's last upload (waiting on one never recorded returns at once).
        self.uploads = [torch.cuda.Event(), torch.cuda.Event()] if self.stream is not None else []
        self.turn = 0
        self._index: int | None = None  # the buffer being filled
        self._target: torch.Tensor | None = None  # the slab it is bound for
        self._pending: list[_Upload] = []  # what it holds, in the order placed
        self._used = 0  # its bytes from 0 that the pending uploads' reads may write

    def place(self, target: torch.Tensor, at: int, nbytes: int) -> tuple[memoryview, int]:
        """Where bytes bound for target[at:at + nbytes] are written: (buffer, position), the
        position congruent to `at` modulo PAGE, with room for the whole pages around them (a
        direct read fills those). They join the bytes placed last where nothing else of the slab
        lies between: a slab gives every read its own pages (rankfs.loader.packing)."""
        last = self._pending[-1] if self._pending and self._target is target else None
        if last is not None and last.height == 1 and last.end <= at and align_down(at) <= align_up(last.end):
            position = last.position + at - last.at
            if align_up(position + nbytes) <= len(self.buffers[self._index]):
                last.width = at + nbytes - last.at
                self._used = align_up(position + nbytes)
                return memoryview(self.buffers[self._index].map), position
        position = self._reserve(target, at % PAGE, nbytes)
        self._pending.append(_Upload(position, at, nbytes))
        return memoryview(self.buffers[self._index].map), position

    def place_rows(self, target: torch.Tensor, at: int, rows: Rows, offset: int) -> tuple[memoryview, int]:
        """Where `rows.count` whole rows from `offset` in a source are written (congruent to it
        modulo PAGE, as a direct read needs): (buffer, position). Their kept columns land packed at
        target[at:]."""
        position = self._reserve(target, offset % PAGE, rows.count * rows.row_bytes)
        self._pending.append(_Upload(position + rows.keep_start, at, rows.keep_stop - rows.keep_start,
                                     rows.count, rows.row_bytes))
        return memoryview(self.buffers[self._index].map), position

    def _reserve(self, target: torch.Tensor, in_page: int, nbytes: int) -> int:
        """A position in the buffer being filled, `in_page` into a page of its own, for nbytes:
        after what it holds, or in the next buffer once this one is full (or bound elsewhere)."""
        position = self._used + in_page
        if (self._index is None or self._target is not target
                or align_up(position + nbytes) > len(self.buffers[self._index])):
            self._upload()
            self._index, self._target = self._take(align_up(in_page + nbytes)), target
            position = in_page
        self._used = align_up(position + nbytes)
        return position

    def send(self) -> torch.cuda.Event | None:
        """Upload what waits; returns an event that completes with every upload queued so far
        (None where there is no stream: the copy was made)."""
        self._upload()
        if self.stream is None:
            return None
        sent = torch.cuda.Event()
        sent.record(self.stream)
        return sent

    def _take(self, nbytes: int) -> int:
        """The next buffer, of nbytes at least, once its last upload is done."""
        i, self.turn = self.turn, 1 - self.turn
        if self.uploads:
            self.uploads[i].synchronize()
        if self.buffers[i] is None or len(self.buffers[i]) < nbytes:  # a row of a slice larger than a piece
            self._close(i)
            self.buffers[i] = self.supply.take(nbytes)
            self.tensors[i] = torch.frombuffer(self.buffers[i].map, dtype=torch.uint8)
        return i

    def _upload(self):
        index, target, pending = self._index, self._target, self._pending
        self._index, self._target, self._pending, self._used = None, None, [], 0
        if not pending:
            return
        source = self.tensors[index]
        if self.stream is None:  # host memory standing in for the GPU's (tests)
            for upload in pending:
                rows = source.as_strided((upload.height, upload.width), (upload.pitch, 1), upload.position)
                target[upload.at:upload.end].view(upload.height, upload.width).copy_(rows)
            return
        # Asked once per buffer, not per upload: each is a call that holds the GIL.
        copy, stream = _cudart().cudaMemcpy2DAsync, self.stream.cuda_stream
        target_at, source_at = target.data_ptr(), source.data_ptr()
        for upload in pending:
            error = copy(target_at + upload.at, upload.width, source_at + upload.position, upload.pitch,
                         upload.width, upload.height, _HOST_TO_DEVICE, stream)
            if error:
                raise RuntimeError(f"rankfs hook: an upload to {target.device} failed (CUDA error {error})")
        self.uploads[index].record(self.stream)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers if b is not None)

    def _close(self, i: int):
        self.tensors[i] = None  # the map cannot close while a tensor views it
        if self.buffers[i] is not None:
            self.buffers[i].close()
            self.buffers[i] = None

    def close(self):
        """Upload what waits, wait for every upload, and let the buffers go."""
        sent = self.send()
        if sent is not None:
            sent.synchronize()
        self._close(0)
        self._close(1)


class DeviceSlabs:
    """GPU slabs, filled through the read threads' bounce buffers; their buffers are reused as host
    buffers are (rankfs.loader.slabs)."""

    def __init__(self, device: torch.device, slab_bytes: int, budget, wanted, retire):
        self.device = device
        self.fence = Fence(device)
        self.pool = SlabPool(slab_bytes, budget, pin=False, wanted=wanted, retire=retire,
                             make=lambda nbytes: DeviceBuffer(nbytes, self.fence))
        self.failed = False  # the device ran out of memory once: groups stay in host slabs from then on
        self.bounce_bytes = 0  # page-locked in bounce buffers, at the most
        self._bounces: dict[int, Bounce] = {}  # per read thread
        self._buffers: BounceBuffers | None = None
        self._lock = threading.Lock()

    def prepare_bounces(self, threads: int):
        """A load starts: make its read threads' bounce buffers (two each) ahead."""
        with self._lock:
            if self._buffers is None:
                self._buffers = BounceBuffers(2 * threads, pin=self.device.type == "cuda")

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
        if bounce is None:
            bounce = Bounce(self.device, self._buffers)  # made outside the lock: the threads start together
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
            idle = self._buffers.idle_bytes if self._buffers is not None and self._buffers.pin else 0
            return idle + sum(b.nbytes for b in self._bounces.values() if b.stream is not None)


def loading_device(setting: str) -> torch.device | None:
    """Where staged tensors are handed out (RANKFS_HOOK_DEVICE): a CUDA device, or None for
    page-locked host memory. auto: the CUDA device holding most of this process's allocations (the
    engine builds its model there before it loads the weights), else the current one."""
    if setting == "cpu" or not torch.cuda.is_available():
        return None
    if setting != "auto":
        return torch.device(setting)
    count = torch.cuda.device_count()
    allocated = [torch.cuda.memory_allocated(i) for i in range(count)] if count > 1 else [0]
    most = max(range(len(allocated)), key=allocated.__getitem__)
    return torch.device("cuda", most if allocated[most] else torch.cuda.current_device())
