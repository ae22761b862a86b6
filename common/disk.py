"""Disk and page-cache primitives that both readers use, the daemon's and the engine hook's: exact
reads, WILLNEED pieces as large as the device reads in one call, and madvise with the GIL let go.
Standard library only."""

from __future__ import annotations

import bisect
import ctypes
import errno
import mmap
import os
import re
import threading
from pathlib import Path

PAGE = mmap.PAGESIZE
MADV_POPULATE_READ = 22  # Linux 5.14: fault a range in (reading it if needed), or fail with EFAULT
MADV_POPULATE_WRITE = 23  # Linux 5.14: fault a range in writable (anonymous memory: zero-filled)
DEFAULT_WILLNEED_REACH = 128 << 10  # the smallest readahead one meets (DGX Spark's)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc_holding_gil = ctypes.PyDLL(None, use_errno=True)  # for calls shorter than taking the GIL back
_libc_holding_gil.madvise.argtypes = _libc.madvise.argtypes
_libc_holding_gil.mincore.argtypes = _libc.mincore.argtypes
_libc_holding_gil.pread.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_long]
_libc_holding_gil.pread.restype = ctypes.c_ssize_t
CACHED_SHORT_BYTES = 1 << 20  # cached pages mapped in with the GIL held: tens of microseconds
_MAP_FAILED = ctypes.c_void_p(-1).value
RESIDENT_BIT = bytes(b & 1 for b in range(256))  # mincore: bit 0 of each byte, the rest reserved
_SYS_CACHESTAT = 451  # Linux 6.5, the same number on x86_64 and aarch64
_libc.syscall.restype = _libc_holding_gil.syscall.restype = ctypes.c_long


class _CachestatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
    _fields_ = [("nr_cache", ctypes.c_uint64), ("nr_dirty", ctypes.c_uint64), ("nr_writeback", ctypes.c_uint64),
                ("nr_evicted", ctypes.c_uint64), ("nr_recently_evicted", ctypes.c_uint64)]


_cachestat_works = True  # until a kernel says it has no cachestat


def _libc_for(holding_gil: bool) -> ctypes.CDLL:
    """libc through a handle that keeps the GIL for the call, or one that lets it go."""
    return _libc_holding_gil if holding_gil else _libc


def page_cache_holds(fd: int, begin: int, end: int, holding_gil: bool = False) -> bool | None:
    """Whether the page cache holds every page of [begin, end) of a file (cachestat, the GIL let
    go unless `holding_gil`: see `madvise`); None where the kernel cannot say (older than 6.5, or a
    file cachestat refuses)."""
    global _cachestat_works
    if not _cachestat_works:
        return None
    begin, end = covering_pages(begin, end)
    stat = _Cachestat()
    # syscall(2) is variadic: every argument a full register's width.
    asked = _CachestatRange(begin, end - begin)
    if _libc_for(holding_gil).syscall(ctypes.c_long(_SYS_CACHESTAT), ctypes.c_long(fd), ctypes.byref(asked),
                                      ctypes.byref(stat), ctypes.c_long(0)) == 0:
        return stat.nr_cache == (end - begin) // PAGE
    _cachestat_works = ctypes.get_errno() != errno.ENOSYS  # else a file it refuses (hugetlbfs)
    return None


def read_cached(fd: int, buffer: bytearray, offset: int, what: str) -> int:
    """pread(2) into `buffer` of bytes the page cache holds, the GIL kept for the call (a copy of a
    few pages): a thread that lets it go for each of hundreds of small reads waits to take it back
    behind every busy thread of the process, each time. Returns the bytes read."""
    address = ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))
    n = _libc_holding_gil.pread(fd, address, len(buffer), offset)
    if n < 0:
        raise _os_error(f"{what}: read at offset {offset}")
    return n


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def madvise(address: int, length: int, advice: int, holding_gil: bool = False):
    """madvise(2) through ctypes, which lets the GIL go for the call (Python's mmap.madvise holds
    it, and has no MADV_POPULATE_READ) unless `holding_gil`: for calls shorter than the wait to
    take the GIL back behind the loader's threads."""
    if _libc_for(holding_gil).madvise(address, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def map_pages(fd: int, offset: int, length: int, what: str) -> int:
    """The address of a shared read-only map of a file's [offset, offset + length) (offset on a
    page): through libc, since Python's mmap exposes no address and reads nothing faster."""
    address = _libc.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
    if address in (None, _MAP_FAILED):
        raise _os_error(f"{what}: mmap")
    return address


def unmap_pages(address: int, length: int):
    _libc.munmap(address, length)


def anonymous_map(nbytes: int) -> mmap.mmap:
    """Zero-filled memory of this process's own, in huge pages where the kernel gives them: a fault
    per 2 MiB and a TLB entry for it, which the copies out of it feel too. Python's
    mmap.mmap(-1, n) alone maps shared memory (shmem), which never takes huge pages."""
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    memory.madvise(mmap.MADV_HUGEPAGE)
    return memory


def align_down(n: int) -> int:
    return n // PAGE * PAGE


def align_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def inner_pages(begin: int, end: int) -> tuple[int, int]:
    """The whole pages inside [begin, end): a neighbour may still use the pages it shares."""
    return align_up(begin), align_down(end)


def covering_pages(begin: int, end: int) -> tuple[int, int]:
    return align_down(begin), align_up(end)


def open_for_exact_reads(path, flags: int = os.O_RDONLY) -> int:
    """A file opened for large reads of exactly the bytes wanted: without kernel readahead, which
    would only add other ranks' bytes."""
    fd = os.open(path, flags)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def joined_pages(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The whole pages of byte spans (begin, end), those that share or touch pages joined."""
    joined: list[tuple[int, int]] = []
    for begin, end in sorted(covering_pages(b, e) for b, e in spans):
        if joined and begin <= joined[-1][1]:
            joined[-1] = (joined[-1][0], max(end, joined[-1][1]))
        else:
            joined.append((begin, end))
    return joined


class OpenFile:
    """A file opened for exact reads of large ranges: buffered without readahead, and, where the
    filesystem allows, direct (O_DIRECT) for ranges the page cache does not hold, so that a read
    neither adds pages to the cache nor pays for a copy out of it. Where something reads it through
    the page cache all the same, `drop_added` drops afterwards the pages that were not cached before.

    Direct reads fill whole pages: the bytes wanted must sit in the buffer at an offset congruent to
    their file offset modulo PAGE, with the rest of their first and last pages free to be
    overwritten (`read_into`).

    `shared`: the pages [(begin, end), ...] other processes on the host read too (local ranks of one
    mount): a read of any of them goes through the page cache and leaves its pages there, for them;
    someone else drops them (the mount's daemon, once every rank is done with them). The rest is
    read direct, as alone. None: no other process reads the file."""

    def __init__(self, path: str, direct: bool = True, shared: list[tuple[int, int]] | None = None):
        self.path = path
        self.shared = shared is not None
        self._shared_pages: tuple[list[int], list[tuple[int, int]]] = ([], [])  # (starts, runs), swapped whole
        self.share(shared or [])
        self.fd = open_for_exact_reads(path)
        self.direct_fd: int | None = None
        self._retired_fd: int | None = None  # a direct fd given up on (closed with the file)
        self._cached_before: list[tuple[int, bytes]] = []  # (offset, per page: cached) before reads through it
        self._lock = threading.Lock()
        self.direct_read_bytes = 0  # bytes read past the page cache, and through it
        self.cached_read_bytes = 0
        self._size = os.fstat(self.fd).st_size
        self._map: int | None = None  # a map of the file: for mincore, and to copy cached bytes out of
        if self._size:
            try:
                self._map = map_pages(self.fd, 0, self._size, path)
                # A fault reads only its page: the kernel's read-around would add other ranks' bytes.
                madvise(self._map, self._size, mmap.MADV_RANDOM, holding_gil=True)
            except OSError:
                pass
        if direct and self._size:
            try:
                self.direct_fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: a filesystem without direct I/O (tmpfs, FUSE)
                    raise

    def share(self, runs: list[tuple[int, int]]):
        """More pages other processes read too (see `shared`)."""
        joined = joined_pages(self._shared_pages[1] + list(runs))
        self._shared_pages = ([begin for begin, _ in joined], joined)

    def cached(self, begin: int, end: int, holding_gil: bool = False) -> bool:
        """Whether the page cache holds every page of [begin, end), up to the file's end."""
        return self.resident(begin, min(end, self._size), holding_gil)

    def resident(self, begin: int, end: int, holding_gil: bool = False) -> bool:
        """Whether the page cache holds every page of [begin, end), asked with the GIL let go
        unless `holding_gil` (see `madvise`): cachestat counts the file's cached pages without the
        process's memory map, whose lock a mincore shares with every page fault, map and page-lock
        of the loader's threads. mincore where the kernel is older than 6.5 or refuses the file."""
        if self._map is None or end > self._size or end <= begin:
            return False
        begin, end = covering_pages(begin, end)
        holds = page_cache_holds(self.fd, begin, end, holding_gil)
        return holds if holds is not None else 0 not in self._residency(begin, end, holding_gil)

    def readable(self, begin: int, end: int) -> bool:
        """Whether every page of [begin, end) is in the page cache and up to date (mincore), so that
        touching it cannot fail: cachestat counts a page whose read failed too."""
        if self._map is None or end > self._size or end <= begin:
            return False
        begin, end = covering_pages(begin, end)
        return 0 not in self._residency(begin, end, holding_gil=end - begin <= CACHED_SHORT_BYTES)

    def _residency(self, begin: int, end: int, holding_gil: bool = False) -> bytes:
        """Per page of [begin, end) (whole pages): 1 if it is in the page cache, up to date (the GIL
        kept for the call where `holding_gil`: see `madvise`)."""
        pages = (end - begin) // PAGE
        vector = ctypes.create_string_buffer(pages)
        if _libc_for(holding_gil).mincore(self._map + begin, pages * PAGE, vector) != 0:
            raise _os_error(f"{self.path}: mincore")
        return vector.raw.translate(RESIDENT_BIT)

    def mapped(self, offset: int, length: int, parts: list[tuple[int, int]] | None = None) -> memoryview | None:
        """Bytes [offset, offset + length) as the page cache holds them, mapped into this process,
        read only, for bytes the page cache held when last asked. Its pages are mapped in first
        (only those of `parts`, (begin, end) within it, where given: what will be read of it), so
        that a page missing past the file's end fails here, not with SIGBUS at the copy; up to
        CACHED_SHORT_BYTES at a time with the GIL held. None where they cannot be: no map, a kernel
        before 5.14, a file cut short. Let go with `unmap`."""
        if self._map is None or offset + length > self._size or length <= 0:
            return None
        try:
            for begin, end in joined_pages(parts or [(offset, offset + length)]):
                madvise(self._map + begin, end - begin, MADV_POPULATE_READ, end - begin <= CACHED_SHORT_BYTES)
        except OSError:
            return None
        return memoryview((ctypes.c_ubyte * length).from_address(self._map + offset)).cast("B").toreadonly()

    def unmap(self, offset: int, length: int):
        """The pages `mapped` mapped leave this process (not the page cache)."""
        begin, end = covering_pages(offset, offset + length)
        madvise(self._map + begin, end - begin, mmap.MADV_DONTNEED)

    def reading_through_cache(self, begin: int, end: int, around: int = 0):
        """Called before a read of [begin, end) through the page cache (ours, or a reader's we
        hand the file to, whose readahead may take `around` bytes more on each side): what the
        cache holds there now, so that `drop_added` drops only what comes after."""
        if self._map is None:
            return
        begin, end = covering_pages(max(0, begin - around), min(end + around, self._size))
        if end > begin:
            with self._lock:
                self._cached_before.append((begin, self._residency(begin, end)))

    def read_into(self, buffer: memoryview, at: int, offset: int, length: int, what: str,
                  cached: bool = False) -> int:
        """Bytes [offset, offset + length) of the file into buffer[at:at + length]; returns how
        many, fewer only at the end of the file. Direct unless the page cache holds them all
        (`cached`: the caller has just asked, for many reads at once, and a page evicted since
        comes back into the cache), except the pages other processes read too (`shared`); a direct
        read fills buffer[align_down(at):align_up(at + length)], so `at` must be congruent to
        `offset` modulo PAGE and the buffer start on a page."""
        cached = cached or self.cached(offset, offset + length)
        if cached or self.direct_fd is None or not self.shared:
            return self._read(buffer, at, offset, length, what, cached, through_cache=cached)
        done = 0
        for begin, end, theirs in self._pieces(offset, offset + length):
            n = self._read(buffer, at + begin - offset, begin, end - begin, what, False, through_cache=theirs)
            done += n
            if n < end - begin:
                break
        return done

    def _pieces(self, begin: int, end: int):
        """[begin, end) cut where the pages other processes read too begin and end: (begin, end,
        whether theirs), in order; the cuts fall on pages."""
        starts, runs = self._shared_pages
        i = max(0, bisect.bisect_right(starts, begin) - 1)
        at = begin
        for k in range(i, len(runs)):  # not a slice: a view's runs number 100,000s at full scale
            run_begin, run_end = runs[k]
            if run_begin >= end:
                break
            if run_end <= at:
                continue
            if run_begin > at:
                yield at, run_begin, False
            yield max(at, run_begin), min(end, run_end), True
            at = min(end, run_end)
        if at < end:
            yield at, end, False

    def _read(self, buffer: memoryview, at: int, offset: int, length: int, what: str, cached: bool,
              through_cache: bool) -> int:
        """`read_into` of one piece: through the page cache, or direct where the file allows."""
        direct_fd = self.direct_fd
        if through_cache or direct_fd is None:
            if not cached and not self.shared:  # pages this read may add to the cache
                self.reading_through_cache(offset, offset + length)
            n = read_exactly(self.fd, buffer[at:at + length], offset, what)
            with self._lock:
                self.cached_read_bytes += n
            return n
        skip = offset - align_down(offset)
        window = buffer[at - skip:align_up(at + length)]
        done = 0
        while done < len(window):
            try:
                n = os.preadv(direct_fd, [window[done:]], offset - skip + done)
            except OSError as exc:
                if exc.errno == errno.EINVAL and not done:  # a device whose blocks are larger than a page
                    self._stop_direct(direct_fd)
                    return self._read(buffer, at, offset, length, what, cached, through_cache)
                raise OSError(exc.errno, f"{what}: read at offset {offset - skip + done} failed: "
                                         f"{exc.strerror}") from None
            done += n
            if n == 0 or n % PAGE:  # the end of the file
                break
        got = max(0, min(done - skip, length))
        with self._lock:
            self.direct_read_bytes += got
        return got

    def read_whole(self, buffer: memoryview, at: int, offset: int, length: int, what: str, cached: bool = False):
        """`read_into`, every byte or an error: a file cut short since it was opened names `what`."""
        if self.read_into(buffer, at, offset, length, what, cached) < length:
            raise OSError(f"{what}: short read at offset {offset}; the file was truncated")

    def _stop_direct(self, direct_fd: int):
        """Read buffered from now on. The fd stays open until `close`: another thread may be
        reading through it, and a closed fd's number can name another file."""
        with self._lock:
            if self.direct_fd == direct_fd:
                self.direct_fd = None
                self._retired_fd = direct_fd

    def drop_added(self):
        """Drop the pages that came into the page cache where reads through it were announced."""
        with self._lock:
            windows, self._cached_before = self._cached_before, []
        for begin, before in windows:
            now = self._residency(begin, begin + len(before) * PAGE)
            added = (int.from_bytes(now, "little") & ~int.from_bytes(before, "little")).to_bytes(len(now), "little")
            for run in re.finditer(rb"[^\x00]+", added):
                os.posix_fadvise(self.fd, begin + run.start() * PAGE, (run.end() - run.start()) * PAGE,
                                 os.POSIX_FADV_DONTNEED)

    def close(self):
        if self._map is not None:
            unmap_pages(self._map, self._size)
            self._map = None
        for fd in (self.fd, self.direct_fd, self._retired_fd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.direct_fd, self._retired_fd = -1, None, None


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
    """(key, begin, end) spans, sorted, with those that touch or overlap (same key) joined: one
    call for adjacent ranges."""
    merged: list[list] = []
    for key, begin, end in sorted(spans):
        if merged and merged[-1][0] == key and begin <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
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
