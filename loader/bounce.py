"""The read threads' page-locked bounce buffers, made ahead: two per read thread, a piece (16 MiB)
each, faulted in and page-locked once per load by MAKERS threads of their own while the loader opens
its first files. Locking one is a driver call of about 10 ms, and made one after another on one
thread they held the read threads' second pieces back."""

from __future__ import annotations

import logging
import queue
import threading
import time

from rankfs.common.disk import PAGE
from rankfs.common.threads import start_thread
from rankfs.common.trace import Trace
from rankfs.loader.slabs import HostBuffer

log = logging.getLogger("rankfs.hook")

PIECE_BYTES = 16 << 20  # a bounce buffer: a run of a slab (rankfs.loader.packing.RUN_BYTES), or rows of many slices


def buffer_bytes() -> int:
    """A bounce buffer's size: a piece, and the partial pages around it a direct read fills."""
    return PIECE_BYTES + 2 * PAGE


class BounceBuffers:
    MAKERS = 4

    def __init__(self, count: int, pin: bool, trace: Trace | None = None):
        self.pin = pin
        self._trace = trace or Trace()
        self.nbytes = buffer_bytes()
        # Buffers made ahead, or for each one a maker could not make, why (its taker raises it).
        self._ready: queue.SimpleQueue[HostBuffer | BaseException] = queue.SimpleQueue()
        self._left = count  # not yet taken
        self._idle = 0  # made and not taken
        self._lock = threading.Lock()
        shares = [count // self.MAKERS + (i < count % self.MAKERS) for i in range(min(self.MAKERS, count))]
        self._makers = [start_thread(self._make, "rankfs-bounce", share) for share in shares]

    def _make(self, count: int):
        for made in range(count):
            began = time.monotonic()
            try:
                buffer = self.new(self.nbytes)
            except BaseException as exc:  # every taker waiting for this maker's share hears why
                for _ in range(count - made):
                    self._ready.put(exc)
                return
            with self._lock:
                self._idle += 1
            self._ready.put(buffer)
            self._trace.event("bounce", began=began, pinned=buffer.pinned_at is not None)

    def new(self, nbytes: int) -> HostBuffer:
        """A buffer, page-locked where it can be: where the kernel or the driver refuses
        (RLIMIT_MEMLOCK, the driver's own limit), the bounce buffers stay pageable from then on,
        uploads from them slower, not wrong."""
        buffer = HostBuffer(nbytes)
        if self.pin:
            try:
                buffer.fault_in()
                buffer.pin()
            except RuntimeError as exc:
                with self._lock:
                    refused, self.pin = self.pin, False
                if refused:
                    log.warning("rankfs hook: bounce buffers cannot be page-locked (%s); they stay pageable: "
                                "slower uploads (raise RLIMIT_MEMLOCK, e.g. docker --ulimit memlock=-1)", exc)
            except BaseException:
                buffer.close()
                raise
        return buffer

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer of nbytes at least: one made ahead (waiting for it if it is being made), or a
        new one for a row larger than a piece or once those made ahead are taken (the disk
        threads' read too)."""
        with self._lock:
            made_ahead = nbytes <= self.nbytes and self._left > 0
            self._left -= made_ahead
        if not made_ahead:
            return self.new(max(nbytes, self.nbytes))
        began = time.monotonic()
        made = self._ready.get()
        self._trace.event("bounce-taken", began=began)
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
