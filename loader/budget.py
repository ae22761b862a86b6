"""The bytes the hook holds ahead of the loader (RANKFS_HOOK_INFLIGHT_GB): reserved when a read
ahead is admitted, released when the loader has let go of what was read. Nothing ever waits on it:
the read threads admit reads in the loaders' order as it has room (rankfs.loader.ordered)."""

from __future__ import annotations

import threading
from typing import Callable


class Budget:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self.peak = 0
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def fits(self, nbytes: int) -> bool:
        return self.used == 0 or self.used + nbytes <= self.limit

    def reserve(self, nbytes: int):
        with self._lock:
            self.used += nbytes
            self.peak = max(self.peak, self.used)

    def release(self, nbytes: int):
        with self._lock:
            self.used -= nbytes
        for listener in self._listeners:
            listener()

    def on_release(self, listener: Callable[[], None]):
        """listener() after every release (any thread)."""
        self._listeners.append(listener)
