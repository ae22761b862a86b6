"""Staging on the GPU (RANKFS_HOOK_DEVICE): each group, read into a page-locked slab, is uploaded to
GPU memory in one copy, and the loader gets views of that. Its own copies are then device to device:
a few microseconds each, where a host-to-device copy per tensor kept the loader's threads (and the
GIL) busy for most of a load on fast storage. SGLang runs the weight loaders of device tensors on
its loop, with no thread pool. The host slab is free for the next group as soon as its upload is
done; the GPU memory read ahead is the budget (RANKFS_HOOK_INFLIGHT_GB), handed back to the driver
at release, before the engine sizes its KV pool.

A GPU slab's tensor is imported through DLPack, so torch calls its deleter when the last view dies:
that is how the pool hears of it, as a host slab's memoryview finalizer does. The loader's copies
from it are queued on the device then, not done, so a dead slab's buffer is written again, or handed
back to CUDA's allocator, only after a device synchronization that followed its death.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from typing import Callable

import torch

from rankfs.loader.slabs import Lease, Slab, SlabPool

log = logging.getLogger("rankfs.hook")

_thread = threading.local()


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int), ("dtype", _DLDataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
_DL_CPU, _DL_CUDA, _DL_UINT = 1, 2, 1
_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype, _capsule_new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_exported: dict[int, tuple] = {}  # what a DLPack export keeps alive until torch calls its deleter


def alias(memory: torch.Tensor, nbytes: int, died: Callable[[], None]) -> torch.Tensor:
    """A uint8 tensor over memory[:nbytes] (contiguous) that is not a view of it: died() runs when
    torch frees it, with the last tensor viewing it (on whichever thread drops that)."""
    managed = _DLManagedTensor()
    shape = (ctypes.c_int64 * 1)(nbytes)
    device = memory.device
    managed.dl_tensor = _DLTensor(memory.data_ptr(), _DLDevice(_DL_CUDA if device.type == "cuda" else _DL_CPU,
                                                                device.index or 0),
                                  1, _DLDataType(_DL_UINT, 8, 1), shape, None, 0)
    key = ctypes.addressof(managed)

    def deleter(_):
        del _exported[key]
        died()
    managed.deleter = _DELETER(deleter)
    _exported[key] = (managed, shape, managed.deleter, memory)
    return torch.utils.dlpack.from_dlpack(_capsule_new(key, b"dltensor", None))


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


class DeviceSlabs:
    """GPU slabs, each the upload of a host slab: their budget is the group's (handed over from the
    host slab), their buffers are reused as host buffers are (rankfs.loader.slabs)."""

    def __init__(self, device: torch.device, slab_bytes: int, budget, wanted, retire):
        self.device = device
        self.fence = Fence(device)
        self.pool = SlabPool(slab_bytes, budget, pin=False, wanted=wanted, retire=retire,
                             make=lambda nbytes: DeviceBuffer(nbytes, self.fence))
        self.failed = False  # the device ran out of memory once: groups stay in host slabs from then on

    @property
    def staged_on(self) -> str:
        """Where groups were handed out from: the device, and the host once it ran out of memory."""
        return str(self.device) + ("+host" if self.failed else "")

    def upload(self, host: Slab, nbytes: int, names: list[str], file: str) -> Slab | None:
        """host.tensor[:nbytes] copied into a new GPU slab, which takes over the host slab's lease
        once it holds the bytes; None (the host slab stays the group's) where the device has no
        memory for it."""
        if self.failed:
            return None
        try:
            slab = self.pool.allocate(nbytes, names, file, lease=Lease())
        except torch.OutOfMemoryError as exc:
            self.failed = True
            log.warning("rankfs hook: %s: no GPU memory to stage on %s (%s); handing out page-locked host "
                        "memory for the rest of the load", file, self.device, str(exc).splitlines()[0])
            return None
        slab.buffer.writable()
        stream = self._stream()
        if stream is None:
            slab.tensor.copy_(host.tensor[:nbytes])
        else:
            with torch.cuda.stream(stream):
                slab.tensor.copy_(host.tensor[:nbytes], non_blocking=True)
            stream.synchronize()
        slab.lease.take_over(host.lease)
        return slab

    def _stream(self):
        """This read thread's stream for uploads (none off CUDA)."""
        if self.device.type != "cuda":
            return None
        stream = getattr(_thread, "stream", None)
        if stream is None:
            stream = _thread.stream = torch.cuda.Stream(self.device)
        return stream


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
