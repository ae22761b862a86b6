"""Memory state a test or a benchmark owns: a process's resident memory, a file's pages in the page
cache."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from rankfs.common.disk import RESIDENT_BIT

MIB = 1 << 20


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def page_residency(path) -> bytes:
    """Per page of a file, 1 where the page cache holds it: mincore over a private read-only map
    (faults nothing in)."""
    libc = _libc()
    size = os.path.getsize(path)
    pages = -(-size // mmap.PAGESIZE)
    if not pages:
        return b""
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_PRIVATE, fd, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        vec = (ctypes.c_ubyte * pages)()
        try:
            if libc.mincore(address, size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            libc.munmap(address, size)
        return bytes(vec).translate(RESIDENT_BIT)
    finally:
        os.close(fd)


def resident_pages(path) -> int:
    """Pages of a file in the page cache."""
    return page_residency(path).count(1)


def cached_bytes_in(path, spans) -> int:
    """Bytes of the pages of `spans` ((begin, end) in the file) the page cache holds."""
    residency = page_residency(path)
    pages = {page for begin, end in spans for page in range(begin // mmap.PAGESIZE, -(-end // mmap.PAGESIZE))}
    return sum(residency[page] for page in pages if page < len(residency)) * mmap.PAGESIZE


@contextlib.contextmanager
def pinned(paths):
    """Every page of these files in the page cache, held there (mlock) until the block ends: the
    2-core VMs run DAMON, which pages cold page cache out on its own, whatever the free memory."""
    libc = _libc()
    maps = []
    try:
        for path in paths:
            size = os.path.getsize(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            finally:
                os.close(fd)
            if address in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            maps.append((address, size))
            if libc.mlock(address, size) != 0:
                raise OSError(ctypes.get_errno(), f"mlock {path}")
        yield
    finally:
        for address, size in maps:
            libc.munmap(address, size)  # unlocks too


def cached_bytes(paths) -> int:
    return sum(resident_pages(p) for p in paths) * mmap.PAGESIZE


def uncache(paths, direct: bool = False):
    """Nothing of these files in the page cache (written back first: dirty pages stay cached).
    `direct`: each opened with O_DIRECT, which a rankfs view takes for a reader of its own that
    reads past the page cache (a buffered open is a listing's: the daemon pushes its pages)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def rss_bytes(pid: int | str = "self") -> int:
    """A process's resident memory, anonymous and file-backed (smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("Rss:"))


def cpu_seconds(pid: int | str = "self") -> float:
    """The CPU time a process has used, user and system, all its threads."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def vm_hwm(pid: int | str = "self") -> int:
    """A process's peak resident memory."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


def disk_read_bytes(pid: int | str = "self") -> int:
    """The bytes a process has caused to be read from storage, all its threads (/proc/PID/io:
    buffered reads and readahead, direct reads and page faults alike; none from the page cache)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("read_bytes:"))


def drop_caches() -> bool:
    if os.geteuid() != 0:
        return False
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return True


def warm(files):
    """The files into the page cache, eight at a time."""
    def read(path):
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(read, files))
