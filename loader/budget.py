"""The bytes the hook holds ahead of the loader (RANKFS_HOOK_INFLIGHT_GB): reserved before a read,
released when the loader has let go of what was read. Shared by the read threads."""

from __future__ import annotations

import threading
from typing import Callable

RESERVE_TIMEOUT = 60.0  # a read ahead gives up waiting for room after this long (seconds) and goes on


class Budget:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.waiting = 0  # reads waiting for room
        self._changed = threading.Condition()

    def reserve(self, nbytes: int, may_wait: Callable[[], bool] = lambda: True):
        """Count nbytes, once they fit (or nothing else is held). Waits only while may_wait()
        holds: once the loader asks for what is being read, it must not wait behind what that
        loader itself still holds."""
        with self._changed:
            self.waiting += 1
            self._changed.wait_for(lambda: self.used == 0 or self.used + nbytes <= self.limit or not may_wait(),
                                   RESERVE_TIMEOUT)
            self.waiting -= 1
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int):
        with self._changed:
            self.used -= nbytes
            self._changed.notify_all()

    def wake(self):
        """Something a waiter's may_wait() reads has changed."""
        with self._changed:
            self._changed.notify_all()
