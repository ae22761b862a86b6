"""What a rankfs file opened the hook's way uses of the load it belongs to: narrow views of the
hook, so that a file depends on what it touches. `LoadOrder` is which of the open files the loader
consumes now, what the staged files' read-ahead follows."""

from __future__ import annotations

import mmap
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from rankfs.common.trace import Trace
    from rankfs.loader.budget import Budget
    from rankfs.loader.daemon_link import DaemonLink
    from rankfs.loader.device_slabs import DeviceSlabs
    from rankfs.loader.ordered import OrderedExecutor
    from rankfs.loader.slabs import SlabPool


class LoadOrder:
    """The loaders take files in name order, several open at once: the files being opened (a path
    twice where two threads open it), those with tensors not yet handed out (`consuming`), and
    those with a slab alive (`holding`). `wake` tells the read threads what they may admit has
    changed. `stalled`: the loader once waited for a group the budget held back while nothing freed
    room (`progressed`)."""

    def __init__(self, wake: Callable[[], None]):
        self.wake = wake
        self.opening: list[str] = []
        self.consuming: set = set()
        self.holding: set = set()
        self.stalled = False
        self._progressed_at = time.monotonic()
        self._lock = threading.Lock()

    def progressed(self):
        """A slab died or a group was staged. A loader that waits while neither happens for a while
        keeps the tensors it was handed (a state dict of the whole view), or takes files out of
        order (groups read ahead of files it has not reached hold the budget): nothing it does will
        give the budget back (rankfs.loader.staged)."""
        self._progressed_at = time.monotonic()

    def stalled_for(self, seconds: float) -> bool:
        return time.monotonic() - self._progressed_at >= seconds

    def begin_open(self, path: str):
        with self._lock:
            self.opening.append(path)

    def end_open(self, path: str):
        with self._lock:
            self.opening.remove(path)
        self.wake()

    def earlier_file_opening(self, key: tuple) -> bool:
        """Whether a file the loader takes before the one a read ahead is for (keyed (path, group))
        is being opened: the read waits for that open, whose own reads would queue behind it (an
        open never waits on reads, so the hold lasts one open)."""
        opening = list(self.opening)  # copied at once: other threads add and remove
        return bool(opening) and min(opening) < key[0]

    def consumed_now(self):
        """The staged file the loader consumes now: the first open one with tensors not yet handed out."""
        return min(list(self.consuming), key=lambda f: f.path, default=None)


@dataclass(frozen=True)
class FileContext:
    """What every rankfs file opened the hook's way uses."""
    link: DaemonLink
    slab_bytes: int
    stock_open: Callable
    source_map: Callable[[str], mmap.mmap]  # a private map of a source shard, by path
    note_mapped: Callable[[str, int, int], None]  # (path, offset, length) of a source read or viewed through a map


@dataclass(frozen=True)
class StagingContext:
    """What a staged file uses (rankfs.loader.staged)."""
    file: FileContext
    executor: OrderedExecutor
    budget: Budget
    slabs: SlabPool
    on_device: DeviceSlabs | None
    trace: Trace
    order: LoadOrder


@dataclass(frozen=True)
class MappingContext:
    """What a mapped file uses (rankfs.loader.mapped)."""
    file: FileContext
    executor: OrderedExecutor
    budget: Budget
