"""Disk and page-cache primitives that both readers use, the daemon's and the engine hook's: exact
reads, WILLNEED pieces as large as the device reads in one call, and madvise with the GIL let go.
Standard library only."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux 5.14: fault a range in (reading it if needed), or fail with EFAULT
DEFAULT_WILLNEED_REACH = 128 << 10  # the smallest readahead one meets (DGX Spark's)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def madvise(address: int, length: int, advice: int):
    """madvise(2) through ctypes, which lets the GIL go for the call (Python's mmap.madvise holds
    it, and has no MADV_POPULATE_READ)."""
    if _libc.madvise(address, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def inner_pages(begin: int, end: int) -> tuple[int, int]:
    """The whole pages inside [begin, end): a neighbour may still use the pages it shares."""
    return -(-begin // PAGE) * PAGE, end // PAGE * PAGE


def covering_pages(begin: int, end: int) -> tuple[int, int]:
    return begin // PAGE * PAGE, -(-end // PAGE) * PAGE


def open_for_exact_reads(path, flags: int = os.O_RDONLY) -> int:
    """A file opened for large reads of exactly the bytes wanted: without kernel readahead, which
    would only add other ranks' bytes."""
    fd = os.open(path, flags)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def read_exactly(fd: int, target: memoryview, offset: int, what: str) -> int:
    """Fill `target` from `offset`; returns the bytes read, fewer only at the end of the file.
    `what` names the file (and tensor) in the error."""
    done = 0
    while done < len(target):
        try:
            n = os.preadv(fd, [target[done:]], offset + done)
        except OSError as exc:
            raise OSError(exc.errno, f"{what}: read at offset {offset + done} failed: {exc.strerror}") from None
        if n == 0:
            break
        done += n
    return done


def merge_adjacent(spans) -> list[list]:
    """(key, begin, end) spans, sorted, with those that touch (same key, one's end the next's
    begin) joined: one call for adjacent ranges."""
    merged: list[list] = []
    for key, begin, end in sorted(spans):
        if merged and merged[-1][0] == key and merged[-1][2] == begin:
            merged[-1][2] = end
        else:
            merged.append([key, begin, end])
    return merged


def block_queue(path) -> Path | None:
    """The sysfs queue directory of the disk under `path` (a partition's: its disk's); None off
    block devices (tmpfs, network and overlay filesystems)."""
    st = os.stat(path)
    device = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if not device.exists():
        return None
    queue = device / "queue"
    return queue if queue.exists() else device.resolve().parent / "queue"


def willneed_pieces(offset: int, length: int, reach: int):
    """(offset, length) of the WILLNEED calls that ask for [offset, offset + length): each as much
    as one call reads, since the kernel caps each call at that."""
    for piece in range(offset, offset + length, reach):
        yield piece, min(reach, offset + length - piece)


def willneed_reach(path) -> int:
    """How many bytes one posix_fadvise(WILLNEED) reads of a file: the kernel caps each call at
    the larger of the device's readahead and its largest request."""
    queue = block_queue(path)
    try:
        kib = max(int((queue / "read_ahead_kb").read_text()), int((queue / "max_sectors_kb").read_text()))
    except (OSError, TypeError, ValueError):
        return DEFAULT_WILLNEED_REACH
    return max(kib << 10, DEFAULT_WILLNEED_REACH)
