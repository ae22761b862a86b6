"""What the block device under a file says about reads (sysfs)."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_WILLNEED_REACH = 128 << 10  # the smallest readahead one meets (DGX Spark's)


def open_for_exact_reads(path, flags: int = os.O_RDONLY) -> int:
    """A file opened for large preads of exactly the bytes wanted: without kernel readahead, which
    would only add other ranks' bytes."""
    fd = os.open(path, flags)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


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
    as one call reads (a call per 128 KiB cost a warm load a third of its speed)."""
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
