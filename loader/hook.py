"""The hook itself, created at the first rankfs file a process opens: it opens rankfs files the
hook's way, and when a load ends it frees everything the load held and reports the memory figures.

Only files on a rankfs mount come here (rankfs.loader.routing); of those, calls that ask for
anything but plain torch tensors on the CPU go to the stock `safe_open`.
"""

from __future__ import annotations

import gc
import logging
import mmap
import os
import sys
import threading
import time

import torch

from rankfs.common import contract
from rankfs.loader import memory, routing
from rankfs.loader.budget import Budget
from rankfs.loader.daemon_link import DaemonLink, drop_daemons
from rankfs.loader.device import DeviceSlabs, loading_device
from rankfs.loader.mapped import MappedFile
from rankfs.loader.ordered import OrderedExecutor
from rankfs.loader.settings import HookSettings, rank_override
from rankfs.loader.slabs import SlabPool
from rankfs.loader.staged import StagedFile
from rankfs.common.disk import PAGE, align_down
from rankfs.common.trace import Trace

log = logging.getLogger("rankfs.hook")

# A WILLNEED piece in flight per map reader: enough to keep the disk busy, few enough that what is
# in flight is what the loader asks for next.
MAP_READERS = 16


class LeftoverSlabs(RuntimeError):
    pass


class Hook:
    def __init__(self, settings: HookSettings, stock_open, load_start: dict | None):
        self.settings = settings
        self.mode = settings.mode
        self.stock_open = stock_open
        self.load_start = load_start or memory.snapshot()  # of the first load (the target's)
        cuda = torch.cuda.is_available()
        device = None if settings.map_sources == "on" else loading_device(settings.device)
        # Maps of the sources instead of slabs (RANKFS_HOOK_MAP): always, never, or, by default,
        # for loads into host memory (no CUDA) file by file, where the page cache holds them.
        auto_off = settings.map_sources == "auto" and (cuda or device is not None)
        self.map_sources = "off" if auto_off else settings.map_sources
        self.budget = Budget(settings.budget_for(host_slabs=device is None))
        self.slabs = SlabPool(settings.slab_bytes, self.budget, pin=cuda, wanted=self._slabs_wanted,
                              retire=self._retire)
        self.on_device = None if device is None else DeviceSlabs(device, settings.slab_bytes, self.budget,
                                                                 wanted=self._slabs_wanted, retire=self._retire)
        self.link = DaemonLink()
        self.trace = Trace(settings.trace_file)
        self.executor: OrderedExecutor | None = None  # reads into slabs
        self.map_executor: OrderedExecutor | None = None  # reads mapped tensors ahead
        self.paths: set[str] = set()  # rankfs files the current load opened
        self.opening: list[str] = []  # rankfs files being opened now (a path twice where two threads open it)
        self.consuming: set = set()  # staged files open with tensors not yet handed out
        self.holding: set = set()  # staged files with a slab alive
        self.releases: list[dict] = []
        self._source_maps: dict[str, mmap.mmap] = {}
        self._collector_was_on: bool | None = None  # during a load: whether gc was enabled before it
        self._lock = threading.Lock()
        if self.mode == "on":
            from rankfs.loader.guard import warm_up
            warm_up()

    @property
    def load_views(self) -> set[str]:
        """The view directories the current load has read."""
        return {os.path.dirname(path) for path in self.paths}

    def safe_open(self, filename, framework="pt", device="cpu", **kwargs):
        began = time.monotonic()
        path = os.path.abspath(os.fspath(filename))
        if framework not in ("pt", "torch") or str(device) != "cpu" or kwargs:
            return self.stock_open(filename, framework=framework, device=device, **kwargs)
        path = self.link.own_rank_path(path, current_rank)
        if path is None:  # this rank has nothing in that shard
            return EmptyFile()
        with self._lock:
            self.paths.add(path)
        if self.mode == "observe":
            return self.stock_open(path, framework=framework, device=device)
        with self._lock:
            self.opening.append(path)
        try:
            opened = self._open(path)
        finally:
            with self._lock:
                self.opening.remove(path)
            self.wake_readers()
        self.trace.event("open", path=path, began=began, groups=len(opened.groups))
        return opened

    def _open(self, path: str):
        """A rankfs file opened the hook's way, mapped or staged, with the threads its kind needs."""
        placement = self.link.placement(path)
        mapped = placement is not None and self._maps_file(placement)
        with self._lock:  # the threads this kind of file needs, at its first (or its first after a release)
            if self._collector_was_on is None and not routing.outside_engine_load():
                # A full collection stops every thread while it walks every object the engine holds
                # (0.13 s each with torch imported on the 2-core VM; an 8 GB EP1 sliced load, whose
                # tensors and futures make the objects that trigger them, ran one besides the
                # release's own). Cycles left meanwhile are collected at the release.
                self._collector_was_on = gc.isenabled()
                gc.disable()
            if mapped:
                self.map_executor = self.map_executor or OrderedExecutor(MAP_READERS, "rankfs-map", self.budget)
            elif self.executor is None:
                self.executor = OrderedExecutor(self.settings.threads, "rankfs-read", self.budget,
                                                hold=self._earlier_file_opening,
                                                cpu_threads=self.settings.cpu_work_threads(),
                                                disk_nice=self.settings.read_nice)
                if self.on_device is not None:
                    self.on_device.prepare_bounces(self.settings.threads)
        return MappedFile(path, self, placement) if mapped else StagedFile(path, self, placement)

    def _earlier_file_opening(self, key: tuple) -> bool:
        """Whether a file the loader takes before the one a read ahead is for (keyed (path, group))
        is being opened: the read waits for that open. Loaders open several files at once, and
        whichever opened first had the disk to itself (on the 2-core VM, cold, the fourth file's
        reads began at 0.07 s while the first file's open, whose reads then queued behind them,
        took 1.1 s)."""
        opening = list(self.opening)  # copied at once: other threads add and remove
        return bool(opening) and min(opening) < key[0]

    def _maps_file(self, placement: dict) -> bool:
        """Whether a file's tensors view maps of its sources. For loads into host memory, by
        default where the page cache holds three quarters of them (judged by each one's first
        page): a map then costs no read and no copy, where from the disk reads into slabs outrun
        the loader's page faults (2-core VM, 8 GB, cold: 3.6-5.0 s against 6.6-7.8 s; warm, maps
        1.3-2.0 s against 1.8-3.8 s)."""
        if self.map_sources != "auto":
            return self.map_sources == "on"
        cached = sum(source.resident(align_down(offset), align_down(offset) + PAGE)
                     for source, offset in placement.values())
        return cached * 4 >= len(placement) * 3

    def _slabs_wanted(self) -> bool:
        executor = self.executor
        return executor is not None and executor.costly_queued()

    def _retire(self, buffer):
        """Unpin and unmap a buffer on a read thread with nothing else to do (the loader's copy
        threads let slabs go, and are what the load waits for at its end)."""
        executor = self.executor
        try:
            if executor is not None:
                return executor.chore(buffer.close)
        except RuntimeError:  # shut down meanwhile
            pass
        buffer.close()

    def wake_readers(self):
        """What the read threads admit may have changed (rankfs.loader.ordered)."""
        executor = self.executor
        if executor is not None:
            executor.wake()

    def consumed_now(self):
        """The staged file the loader consumes now: the loaders take files in name order, so the
        first open one with tensors not yet handed out."""
        return min(list(self.consuming), key=lambda f: f.path, default=None)

    def source_map(self, path: str) -> mmap.mmap:
        """A private map of a source shard (opened by the daemon link): mapped tensors view it."""
        with self._lock:
            source = self._source_maps.get(path)
            if source is None:
                source = self._source_maps[path] = mmap.mmap(self.link.source(path).fd, 0, access=mmap.ACCESS_COPY)
                # No read-around on the loader's faults: it would read other ranks' rows of sliced
                # experts. The read-ahead asks for exactly the rest.
                source.madvise(mmap.MADV_RANDOM)
            return source

    def release(self, phase: str | None = None) -> dict:
        """Stop the readers, free what the load held, drop the page cache it filled, report, and
        ask the daemons loaded from to drop theirs. After the target load a slab still alive is an
        error, since the engine is about to size its KV pool."""
        phase = phase or "+".join(sorted({contract.phase(v) for v in self.load_views})) or "load"
        clock = _StepClock()
        before = memory.snapshot()
        with self._lock:
            executors, self.executor, self.map_executor = (self.executor, self.map_executor), None, None
            paths, self.paths = self.paths, set()
        for executor in executors:
            if executor is not None:
                executor.shutdown()
        with self._lock:
            collector_was_on, self._collector_was_on = self._collector_was_on, None
        if collector_was_on:
            gc.enable()
        # What the load made, cycles it dropped included, is all young (the collector was paused):
        # a full collection walks the engine's whole heap (0.17 s for a bare torch process on the
        # 2-core VM), so it runs only where a slab is still alive after the young one.
        gc.collect(0)
        pools = [self.slabs] + ([self.on_device.pool] if self.on_device else [])
        if any(pool.alive() for pool in pools):
            gc.collect()
        leftovers = [slab for pool in pools for slab in pool.alive()]
        clock.step("stop")
        for pool in pools:
            pool.drop_idle()
        if self.on_device is not None:
            self.on_device.close_bounces()
        memory.malloc_trim()
        memory.return_pinned_and_cached()
        clock.step("memory")
        for path in paths:
            _drop_page_cache(path)
        with self._lock:
            maps, self._source_maps = self._source_maps, {}
        for source in maps.values():  # its pages leave this process (a tensor still viewing it refaults them)
            source.madvise(mmap.MADV_DONTNEED)
        self.link.close(uncache=set(maps))  # the mapped sources' pages, once unmapped (staged reads add none)
        clock.step("page_cache")
        drop_daemons(paths)
        clock.step("daemons")
        after = memory.snapshot(with_nvml=True)
        clock.step("figures")
        start = self.load_start
        figures = {
            "phase": phase,
            **after,
            "mem_available_before": before["memavailable"],
            "pinned": self.slabs.pin,
            "pinned_bytes": self.slabs.pinned_bytes() + (self.on_device.pinned_bytes() if self.on_device else 0),
            "staged_on": "host" if self.on_device is None else self.on_device.staged_on,
            "slab_requests": sum(pool.stats.requests for pool in pools),
            "slabs": sum(pool.stats.slabs for pool in pools),
            "windows": self.slabs.stats.windows, "window_bytes": self.slabs.stats.window_bytes,
            "peak_slab_bytes": self.budget.peak, "slabs_alive": len(leftovers),
            # Host buffers (page-locked where pinned; bounce buffers too) and GPU buffers at their most,
            # idle ones included.
            "peak_host_bytes": self.slabs.stats.peak_bytes + (self.on_device.bounce_bytes if self.on_device else 0),
            "peak_device_bytes": self.on_device.pool.stats.peak_bytes if self.on_device else 0,
            "torch_host_allocs": memory.host_alloc_count(),
            "release_seconds": clock.total(), "release_steps": clock.steps,
            # MemAvailable lost since the first load began, less what CUDA's allocator grew by where
            # that is host memory (unified memory).
            "nontorch_since_load_start": (start["memavailable"] - after["memavailable"])
            - ((after["cuda_reserved"] - start["cuda_reserved"]) if memory.unified_memory() else 0),
        }
        print(memory.format_line(figures), file=sys.stderr, flush=True)  # one line, whatever logging the engine set up
        self.trace.event("release", phase=phase, began=clock.began)
        self.trace.flush()
        self.releases.append(figures)
        for file, names in leftovers:
            message = (f"rankfs: a slab of {file} is still alive after the {phase} load, held by "
                       f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
            log.error("%s", message)
            if phase == "target":
                raise LeftoverSlabs(message)
        return figures


class _StepClock:
    """Seconds per step of a release (in the figures: where a slow release spends its time)."""

    def __init__(self):
        self.steps: dict[str, float] = {}
        self.began = self._last = time.monotonic()

    def step(self, name: str):
        now = time.monotonic()
        self.steps[name] = round(now - self._last, 3)
        self._last = now

    def total(self) -> float:
        return round(self._last - self.began, 3)


def _drop_page_cache(path: str):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # unmounted already: nothing cached
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def current_rank() -> int:
    """This process's rank: RANKFS_RANK, else torch.distributed's, else 0 (the engine's main
    process, which only reads config and headers)."""
    override = rank_override()
    if override is not None:
        return override
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class EmptyFile:
    """safe_open's answer for a shard in which this rank keeps no tensor."""

    def keys(self):
        return []

    def metadata(self):
        return {}

    def get_tensor(self, name):
        raise KeyError(name)

    get_slice = get_tensor

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None
