"""A minimal io_uring for reads, through the system calls (standard library only): a thread hands
several reads to the kernel at once and the kernel's workers copy them (IOSQE_ASYNC), where N
threads of preadv would each make their copy themselves and take the GIL back after each.

    ring = Ring(8)
    ring.read(fd, address, nbytes, offset, tag)     # queued
    ring.submit(wait=1)                             # handed to the kernel; waits for one to complete
    for tag, result in ring.completed(): ...        # result: bytes read, or -errno

One ring per thread: nothing here is locked. x86-64 only: the rings are shared memory with the
kernel, read and written here with plain loads and stores, whose order x86-64 keeps; aarch64 would
need barriers that Python cannot make.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform

_SYSCALLS = {"x86_64": (425, 426)}  # io_uring_setup, io_uring_enter
_OP_READ = 22
_SQE_ASYNC = 1 << 4  # run in a kernel worker even where the data is cached: copies in parallel
_ENTER_GETEVENTS = 1
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _SqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped",
                                               "array", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _CqOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes",
                                               "flags", "resv1")] + [("user_addr", ctypes.c_uint64)]


class _Params(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("sq_entries", "cq_entries", "flags", "sq_thread_cpu",
                                               "sq_thread_idle", "features", "wq_fd")] + [
        ("resv", ctypes.c_uint32 * 3), ("sq_off", _SqOffsets), ("cq_off", _CqOffsets)]


class _Sqe(ctypes.Structure):
    _fields_ = [("opcode", ctypes.c_uint8), ("flags", ctypes.c_uint8), ("ioprio", ctypes.c_uint16),
                ("fd", ctypes.c_int32), ("off", ctypes.c_uint64), ("addr", ctypes.c_uint64),
                ("len", ctypes.c_uint32), ("rw_flags", ctypes.c_uint32), ("user_data", ctypes.c_uint64),
                ("buf_index", ctypes.c_uint16), ("personality", ctypes.c_uint16), ("splice_fd_in", ctypes.c_int32),
                ("addr3", ctypes.c_uint64), ("pad", ctypes.c_uint64)]


class _Cqe(ctypes.Structure):
    _fields_ = [("user_data", ctypes.c_uint64), ("res", ctypes.c_int32), ("flags", ctypes.c_uint32)]


def available() -> bool:
    """Whether this kernel and machine give io_uring to this process (it may be disabled by
    sysctl, or by a container's seccomp profile)."""
    try:
        Ring(2).close()
    except OSError:
        return False
    return True


class Ring:
    """An io_uring of `entries` reads in flight at most (rounded up to a power of two)."""

    def __init__(self, entries: int):
        calls = _SYSCALLS.get(platform.machine())
        if calls is None:
            raise OSError(f"io_uring: no system call numbers for {platform.machine()}")
        self._setup, self._enter = calls
        params = _Params()
        self.fd = _libc.syscall(ctypes.c_long(self._setup), ctypes.c_long(entries), ctypes.byref(params))
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "io_uring_setup failed")
        sq_off, cq_off = params.sq_off, params.cq_off
        self._sq = mmap.mmap(self.fd, sq_off.array + params.sq_entries * 4, offset=_OFF_SQ_RING)
        self._cq = mmap.mmap(self.fd, cq_off.cqes + params.cq_entries * ctypes.sizeof(_Cqe), offset=_OFF_CQ_RING)
        self._sqe_map = mmap.mmap(self.fd, params.sq_entries * ctypes.sizeof(_Sqe), offset=_OFF_SQES)
        self._sq_tail = ctypes.c_uint32.from_buffer(self._sq, sq_off.tail)
        self._sq_mask = ctypes.c_uint32.from_buffer(self._sq, sq_off.ring_mask).value
        self._sq_array = (ctypes.c_uint32 * params.sq_entries).from_buffer(self._sq, sq_off.array)
        self._sqes = (_Sqe * params.sq_entries).from_buffer(self._sqe_map)
        self._cq_head = ctypes.c_uint32.from_buffer(self._cq, cq_off.head)
        self._cq_tail = ctypes.c_uint32.from_buffer(self._cq, cq_off.tail)
        self._cq_mask = ctypes.c_uint32.from_buffer(self._cq, cq_off.ring_mask).value
        self._cqes = (_Cqe * params.cq_entries).from_buffer(self._cq, cq_off.cqes)
        self.entries = params.sq_entries
        self._queued = 0  # written to the submission ring, not yet handed to the kernel
        self.in_flight = 0  # handed to the kernel (or queued), not yet completed

    def read(self, fd: int, address: int, nbytes: int, offset: int, tag: int):
        """Queue a read of nbytes at offset into memory at address; its completion carries tag."""
        if self.in_flight >= self.entries:
            raise RuntimeError("io_uring: more reads in flight than the ring has entries")
        tail = self._sq_tail.value
        index = tail & self._sq_mask
        sqe = self._sqes[index]
        ctypes.memset(ctypes.addressof(sqe), 0, ctypes.sizeof(_Sqe))
        sqe.opcode, sqe.flags, sqe.fd, sqe.off, sqe.addr, sqe.len, sqe.user_data = (
            _OP_READ, _SQE_ASYNC, fd, offset, address, nbytes, tag)
        self._sq_array[index] = index
        self._sq_tail.value = (tail + 1) & 0xFFFFFFFF  # the kernel reads the entry once the tail moves
        self._queued += 1
        self.in_flight += 1

    def submit(self, wait: int = 0):
        """Hand the queued reads to the kernel; wait until `wait` reads have completed (the GIL let go)."""
        wait = min(wait, self.in_flight)
        if not self._queued and not wait:
            return
        while True:
            done = _libc.syscall(ctypes.c_long(self._enter), ctypes.c_long(self.fd), ctypes.c_long(self._queued),
                                 ctypes.c_long(wait), ctypes.c_long(_ENTER_GETEVENTS if wait else 0), None,
                                 ctypes.c_long(0))
            if done >= 0 or ctypes.get_errno() != errno.EINTR:  # a signal: ask again
                break
        if done < 0:
            raise OSError(ctypes.get_errno(), "io_uring_enter failed")
        self._queued -= done

    def completed(self) -> list[tuple[int, int]]:
        """The reads completed since the last call: (tag, bytes read or -errno)."""
        head, tail = self._cq_head.value, self._cq_tail.value
        results = []
        while head != tail:
            cqe = self._cqes[head & self._cq_mask]
            results.append((cqe.user_data, cqe.res))
            head = (head + 1) & 0xFFFFFFFF
        self._cq_head.value = head
        self.in_flight -= len(results)
        return results

    def close(self):
        """Wait for what is in flight (the kernel writes into memory the caller owns), then let go."""
        while self.in_flight:
            self.submit(wait=1)
            self.completed()
        for view in ("_sq_tail", "_sq_array", "_sqes", "_cq_head", "_cq_tail", "_cqes"):
            setattr(self, view, None)  # the maps cannot close while ctypes objects view them
        for ring in (self._sq, self._cq, self._sqe_map):
            ring.close()
        os.close(self.fd)
        self.fd = -1
