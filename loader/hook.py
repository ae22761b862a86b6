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
from typing import Callable

import torch

from rankfs.common import contract, limits
from rankfs.common.disk import PAGE, align_down
from rankfs.common.trace import Trace
from rankfs.loader import bounce, memory, staging
from rankfs.loader.budget import Budget
from rankfs.loader.context import FileContext, LoadOrder, MappingContext, StagingContext
from rankfs.loader.daemon_link import DaemonLink, drop_daemons
from rankfs.loader.device_slabs import DeviceSlabs
from rankfs.loader.mapped import MappedFile
from rankfs.loader.ordered import OrderedExecutor
from rankfs.loader.settings import HookSettings, rank_override
from rankfs.loader.slabs import SlabPool
from rankfs.loader.staged import StagedFile

log = logging.getLogger("rankfs.hook")

# A WILLNEED piece in flight per map reader: enough to keep the disk busy, few enough that what is
# in flight is what the loader asks for next.
MAP_READERS = 16


class LeftoverSlabs(RuntimeError):
    pass


class Hook:
    def __init__(self, settings: HookSettings, stock_open, load_start: dict | None,
                 outside_engine_load: Callable[[], bool] = lambda: False):
        """outside_engine_load(): whether a file is opened where an engine delimits its loads but
        none is under way (rankfs.loader.routing)."""
        self.settings = settings
        self.mode = settings.mode
        self.stock_open = stock_open
        self.outside_engine_load = outside_engine_load
        self.load_start = load_start or memory.snapshot()  # of the first load (the target's)
        cuda = torch.cuda.is_available()
        stage = None if settings.map_sources == "on" else staging.stage_on(settings.device)
        self.budget = Budget(settings.budget_for(host_slabs=stage is None, room=limits.available_memory()))
        slab_bytes = settings.slab_for(self.budget.limit) if stage is None else settings.slab_bytes
        self.map_sources = self._map_sources(settings.map_sources, cuda or stage is not None, slab_bytes)
        self.slabs = SlabPool(slab_bytes, self.budget, pin=cuda, wanted=self._slabs_wanted, retire=self._retire)
        self.on_device = None if stage is None else DeviceSlabs(stage, settings.slab_bytes, self.budget,
                                                                wanted=self._slabs_wanted, retire=self._retire)
        self.link = DaemonLink()
        self.trace = Trace(settings.trace_file)
        self.order = LoadOrder(self.wake_readers)
        self.files = FileContext(self.link, slab_bytes, stock_open, self.source_map, self.note_mapped)
        self.executor: OrderedExecutor | None = None  # reads into slabs
        self.map_executor: OrderedExecutor | None = None  # reads mapped tensors ahead
        self.disk_threads = 0  # the executor's threads that only read from the disk
        self.paths: set[str] = set()  # rankfs files the current load opened
        self.releases: list[dict] = []
        self._source_maps: dict[str, mmap.mmap] = {}
        self._mapped_spans: dict[str, list[tuple[int, int]]] = {}  # source path -> what its map read or viewed
        self._collector_was_on: bool | None = None  # during a load: whether gc was enabled before it
        self._lock = threading.Lock()
        if self.mode == "on":
            from rankfs.loader.guard import warm_up
            warm_up()

    def _map_sources(self, setting: str, to_gpu: bool, slab_bytes: int) -> str:
        """Maps of the sources instead of slabs (RANKFS_HOOK_MAP): always, never, or, by default,
        for loads into host memory (no CUDA) file by file, where the page cache holds them, and for
        every file where the budget holds less than two slabs: maps read into the page cache, which
        the kernel reclaims, not into memory of the process's own that its cgroup would count."""
        if setting != "auto":
            return setting
        if to_gpu:
            return "off"
        return "on" if self.budget.limit < 2 * slab_bytes else "auto"

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
        self.order.begin_open(path)
        try:
            opened = self._open(path)
        finally:
            self.order.end_open(path)
        self.trace.event("open", path=path, began=began, groups=len(opened.groups))
        return opened

    def _open(self, path: str):
        """A rankfs file opened the hook's way, mapped or staged, with the threads its kind needs."""
        placement = self.link.placement(path)
        mapped = placement is not None and self._maps_file(placement)
        with self._lock:  # the threads this kind of file needs, at its first (or its first after a release)
            self._pause_collector()
            if mapped:
                self.map_executor = self.map_executor or OrderedExecutor(MAP_READERS, "rankfs-map", self.budget)
                context = MappingContext(self.files, self.map_executor, self.budget)
            else:
                if self.executor is None:
                    self.disk_threads = self._disk_threads()
                    self.executor = OrderedExecutor(self.settings.threads, "rankfs-read", self.budget,
                                                    hold=self.order.earlier_file_opening,
                                                    cpu_threads=self.settings.cpu_work_threads(),
                                                    disk_nice=self.settings.read_nice,
                                                    disk_threads=self.disk_threads)
                    if self.on_device is not None:
                        self.on_device.prepare_bounces(self.settings.threads, self.trace)
                context = StagingContext(self.files, self.executor, self.budget, self.slabs, self.on_device,
                                         self.trace, self.order)
        return MappedFile(path, context, placement) if mapped else StagedFile(path, context, placement)

    def _disk_threads(self) -> int:
        """The read threads more that only read from the disk, each with two bounce buffers of its
        own where groups are staged on a GPU."""
        buffers = 0 if self.on_device is None else 2 * bounce.buffer_bytes()
        return self.settings.disk_threads_for(buffers, limits.available_memory())

    def _pause_collector(self):
        """A full collection stops every thread while it walks every object the engine holds, and
        the tensors and futures a load makes trigger them: paused from a load's first open to its
        release, which collects the cycles left meanwhile. Not for a file opened outside an
        engine's load (a look at a header): no release may follow soon."""
        if self._collector_was_on is None and not self.outside_engine_load():
            self._collector_was_on = gc.isenabled()
            gc.disable()

    def _maps_file(self, placement: dict) -> bool:
        """Whether a file's tensors view maps of its sources. For loads into host memory, by
        default where the page cache holds three quarters of them (judged by each one's first
        page): a map then costs no read and no copy, where from the disk reads into slabs outrun
        the loader's page faults."""
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

    def note_mapped(self, path: str, offset: int, length: int):
        """Bytes of a source a map reads ahead or a tensor views: the release drops their pages from
        the page cache, and only theirs (a whole source's would cost a warm load its other pages, and
        time)."""
        with self._lock:
            self._mapped_spans.setdefault(path, []).append((offset, offset + length))

    # -- the release ------------------------------------------------------------------------------

    def release(self, phase: str | None = None) -> dict:
        """Stop the readers, free what the load held, drop the page cache it filled, report, and
        ask the daemons loaded from to drop theirs. After the target load a slab still alive is an
        error, since the engine is about to size its KV pool."""
        phase = phase or "+".join(sorted({contract.phase(v) for v in self.load_views})) or "load"
        clock = _StepClock()
        before = memory.snapshot()
        with self._lock:
            paths, self.paths = self.paths, set()
        leftovers = self._stop()
        clock.step("stop")
        self._free_memory()
        clock.step("memory")
        self._drop_page_cache(paths, clock)
        drop_daemons(paths)
        clock.step("daemons")
        after = memory.snapshot(with_nvml=True)
        clock.step("figures")
        figures = self._figures(phase, before, after, leftovers, clock)
        print(memory.format_line(figures), file=sys.stderr, flush=True)  # one line, whatever logging the engine set up
        self.trace.event("release", phase=phase, began=clock.began)
        self.trace.flush()
        self.releases.append(figures)
        self._refuse_leftovers(phase, leftovers)
        return figures

    def _pools(self) -> list[SlabPool]:
        return [self.slabs] + ([self.on_device.pool] if self.on_device else [])

    def _stop(self) -> list[tuple[str, list[str]]]:
        """Stop the read threads, run the collector again and collect what the load left; returns
        (file, tensor names) of every slab still alive. What the load made, cycles it dropped
        included, is all young (the collector was paused): a full collection, which walks the
        engine's whole heap, runs only where a slab is still alive after the young one."""
        with self._lock:
            executors, self.executor, self.map_executor = (self.executor, self.map_executor), None, None
            collector_was_on, self._collector_was_on = self._collector_was_on, None
            self.order.stalled = False  # the next load's loader may well take files in order and copy
        for executor in executors:
            if executor is not None:
                executor.shutdown()
        if collector_was_on:
            gc.enable()
        gc.collect(0)
        if any(pool.alive() for pool in self._pools()):
            gc.collect()
        return [slab for pool in self._pools() for slab in pool.alive()]

    def _free_memory(self):
        for pool in self._pools():
            pool.drop_idle()
        if self.on_device is not None:
            self.on_device.close_bounces()
        memory.malloc_trim()
        memory.return_pinned_and_cached()

    def _drop_page_cache(self, paths: set[str], clock: "_StepClock"):
        """The views' pages, the mapped sources' pages in this process, and what the load added to
        the sources' page cache (rankfs.loader.daemon_link.DaemonLink.close)."""
        for path in paths:
            _drop_view_cache(path)
        clock.step("view_pages")
        with self._lock:
            maps, self._source_maps = self._source_maps, {}
            spans, self._mapped_spans = self._mapped_spans, {}
        for source in maps.values():  # its pages leave this process (a tensor still viewing it refaults them)
            source.madvise(mmap.MADV_DONTNEED)
        clock.step("mapped_pages")
        self.link.close(paths, uncache=spans, step=clock.step)  # what the maps read, once unmapped

    def _figures(self, phase: str, before: dict, after: dict, leftovers: list, clock: "_StepClock") -> dict:
        pools, device = self._pools(), self.on_device
        start = self.load_start
        return {
            "phase": phase,
            **after,
            "mem_available_before": before["memavailable"],
            "pinned": self.slabs.pin,
            "pinned_bytes": self.slabs.pinned_bytes() + (device.pinned_bytes() if device else 0),
            "staged_on": "host" if device is None else device.staged_on,
            "slab_requests": sum(pool.stats.requests for pool in pools),
            "slabs": sum(pool.stats.slabs for pool in pools),
            "windows": self.slabs.stats.windows, "window_bytes": self.slabs.stats.window_bytes,
            # Read from the sources past the page cache, and through it (where it held them, or other
            # local ranks read them too); the windows' bytes and the maps' are neither.
            "source_direct_bytes": self.link.source_reads["direct"],
            "source_cached_bytes": self.link.source_reads["cached"],
            "peak_slab_bytes": self.budget.peak, "slabs_alive": len(leftovers),
            # What the budget and the threads were sized from (the CPU quota, the cgroup's room).
            "cores": limits.cpu_count(), "budget_bytes": self.budget.limit, "read_threads": self.settings.threads,
            "disk_threads": self.disk_threads,
            "copy_threads": self.settings.cpu_work_threads(),
            # Host buffers (page-locked where pinned; bounce buffers too) and GPU buffers at their most,
            # idle ones included.
            "peak_host_bytes": self.slabs.stats.peak_bytes + (device.bounce_bytes if device else 0),
            "peak_device_bytes": device.pool.stats.peak_bytes if device else 0,
            "torch_host_allocs": memory.host_alloc_count(),
            "release_seconds": clock.total(), "release_steps": clock.steps,
            # MemAvailable lost since the first load began, less what CUDA's allocator grew by where
            # that is host memory (unified memory).
            "nontorch_since_load_start": (start["memavailable"] - after["memavailable"])
            - ((after["cuda_reserved"] - start["cuda_reserved"]) if memory.unified_memory() else 0),
        }

    @staticmethod
    def _refuse_leftovers(phase: str, leftovers: list):
        for file, names in leftovers:
            message = (f"rankfs: a slab of {file} is still alive after the {phase} load, held by "
                       f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}")
            log.error("%s", message)
            if phase == "target":
                raise LeftoverSlabs(message)


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


def _drop_view_cache(path: str):
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
