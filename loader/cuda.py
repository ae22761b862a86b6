"""The CUDA runtime calls the hook makes itself: page-locking host memory, and the pitched copy of
whole rows' kept columns that torch exposes only through a CPU copy. Torch's own runtime in both:
its binding for the page-lock, and for the copy the library it loaded, found through ctypes (torch
binds no 2D copy), so that the copy runs on torch's streams."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

HOST_REGISTER_READ_ONLY = 8  # cudaHostRegisterReadOnly: the only way to page-lock a read-only map
HOST_TO_DEVICE = 1  # cudaMemcpyKind


def page_lock(address: int, nbytes: int, flags: int = 0):
    error = torch.cuda.cudart().cudaHostRegister(address, nbytes, flags)
    if int(error) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {error}")


def page_unlock(address: int | None):
    if address is not None:
        torch.cuda.cudart().cudaHostUnregister(address)


@functools.cache
def _runtime() -> ctypes.PyDLL:
    """The CUDA runtime library torch loaded. Through PyDLL, whose calls keep the GIL: a copy is
    queued in microseconds, and a call that lets the GIL go waits to take it back behind every
    other thread that wants it."""
    with open("/proc/self/maps") as maps:
        paths = [line.split(maxsplit=5)[-1].strip() for line in maps]
    path = next((p for p in paths if os.path.basename(p).startswith("libcudart.so")),
                f"libcudart.so.{torch.version.cuda.split('.')[0]}")
    runtime = ctypes.PyDLL(path)
    runtime.cudaMemcpy2DAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                          ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return runtime


def memcpy_2d_async():
    """cudaMemcpy2DAsync(target, target pitch, source, source pitch, width, height, kind, stream):
    looked up once by its caller, called per copy; returns a cudaError_t."""
    return _runtime().cudaMemcpy2DAsync
