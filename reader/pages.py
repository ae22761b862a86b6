"""Calls on memory maps that Python's mmap module lacks (MADV_POPULATE_READ) or makes holding the
GIL (its madvise does): through ctypes, which lets the GIL go for the length of the call."""

from __future__ import annotations

import ctypes
import mmap
import os

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux 5.14: fault a range in (reading it if needed), or fail with EFAULT

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def madvise(address: int, length: int, advice: int):
    if _libc.madvise(address, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def inner_pages(begin: int, end: int) -> tuple[int, int]:
    """The whole pages inside [begin, end): a neighbour may still use the pages it shares."""
    return -(-begin // PAGE) * PAGE, end // PAGE * PAGE


def covering_pages(begin: int, end: int) -> tuple[int, int]:
    return begin // PAGE * PAGE, -(-end // PAGE) * PAGE
