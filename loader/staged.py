"""Tensors staged in slabs (for copies to a GPU: DMA from page-locked memory). Each group of a
file's tensors is staged by the hook's threads in the loaders' order as the budget has room, every
free thread helping with the group the loader needs first; `get_tensor` waits for its group and
returns a view into its slab: host memory, or GPU memory that the reads were uploaded to piece by
piece through each read thread's bounce buffers (rankfs.loader.device_slabs).

Bytes adjacent in a source form a run. Where slabs are handed out from host memory, a group's runs
that the page cache holds (checked when the file is opened), those that touch joined, are windows
where those of a 32nd of a slab (8 MiB) or more hold three quarters of the group's bytes: their
pages mapped in place and page-locked (with CUDA), so the GPU copies from the page cache with no
read and no copy by the CPU, which the loader's own threads need then. The rest (rows of slices,
runs not cached, groups not windowed, every group staged on the GPU) fills one slab per group: each
run read in pieces of 16 MiB at most, on every free thread, straight from the disk (O_DIRECT)
unless the page cache holds it, at its file offset's place within a page, with its first and last
pages to itself, as direct reads need (a bounce buffer keeps that place within a page); slices
spread over rows read whole, only the rank's columns uploaded to a GPU slab; into a host slab their
columns are copied out of the page cache's mapped pages where it holds them. A group of small reads
whose sources the page cache holds (a warm sliced rank's experts) is copied out of maps instead,
a piece of the slab (or of a bounce buffer, for a GPU slab) per job, alike copies at one step in
one numpy call. Either way a load adds nothing to the page cache.

Reads ahead are admitted in the loaders' order while the budget has room. The file the loader
consumes now goes beyond it only when files before it hold one slab at most (the loader takes a
file's tensors all at once before it copies any, and files read ahead wait for this one, so nothing
would free room): the memory handed out stays within the budget plus a slab, plus that file where it
is larger than the budget. A loader that keeps what it was handed (a state dict of the whole view),
or takes files out of order, would wait for good behind slabs it will never free: once it has
waited with no slab freed and no group staged, each group it asks for goes past the budget.

Here: a file's groups planned, admitted and handed out. A group's slab laid out:
rankfs.loader.packing; its reads and copies as the read threads' jobs: rankfs.loader.jobs; where
they land: rankfs.loader.landing."""

from __future__ import annotations

import functools
import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from rankfs.common.contract import GIB
from rankfs.loader.context import StagingContext
from rankfs.loader.files import RankfsFile
from rankfs.loader.jobs import Copy, all_cached, batches, cached_jobs, cpu_work, read_rows, read_run
from rankfs.loader.landing import DeviceLanding, HostLanding
from rankfs.loader.packing import Span, Staging, join_touching, lay_out
from rankfs.loader.slabs import Slab

log = logging.getLogger("rankfs.hook")

WINDOW_SHARE = 32  # a window holds a 32nd of a slab at least: 8 MiB of the default 256
# Seconds a loader waits for a group held back by the budget, with no slab dying and no group staged,
# before it is taken to wait on slabs only it could free: one that copies frees a slab in milliseconds.
STALL_SECONDS = 2.0


def contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


class StagedFile(RankfsFile):
    def __init__(self, path: str, context: StagingContext, placement: dict | None):
        super().__init__(path, context.file, placement)
        self._load_context = context
        self._demanded: set[int] = set()  # groups the loader waits for
        self._handed: list[set[str]] = [set() for _ in self.groups]  # per group: tensors handed out
        # Worked out once, not on each hand-out: the loader's loop waits for the GIL behind this.
        self._shapes = {name: (self.resident_bytes(name), self.resident_shape(name)) for group in self.groups
                        for name in group}
        self._strides = {name: contiguous_strides(shape) for name, (_, shape) in self._shapes.items()}
        self._group_spans = [sum(self.span(name)[1] for name in group) for group in self.groups]
        self._stagings = [self._plan(group) for group in self.groups]
        self._costs = [self._cost(staging) for staging in self._stagings]
        self.slabs_alive = 0
        self.handing_out = bool(self.groups)  # some tensor not yet handed out: it may be the loader's now
        self._lock = threading.Lock()
        context.order.consuming.add(self)
        self._futures: list[Future | None] = [self._submit(g) for g in range(len(self.groups))]

    def resident(self, name: str, group: int, dtype: torch.dtype) -> torch.Tensor:
        if group not in self._demanded:
            self._demanded.add(group)
            self._load_context.order.wake()  # it may be the one that must go beyond the budget
        future = self._futures[group] or self._submit(group)
        if self._load_context.trace.on and not future.done():  # traced: nothing more on each hand-out otherwise
            began = time.monotonic()
            placed = self._wait(future, group)
            self._load_context.trace.event("wait", path=self.path, group=group, began=began)
        else:
            placed = self._wait(future, group)
        self._handed[group].add(name)
        if len(self._handed[group]) == len(self.groups[group]):  # slabs live exactly as long as their tensors
            self._futures[group] = None
            self.count_loaded(self._group_spans[group])
            if all(len(handed) == len(names) for handed, names in zip(self._handed, self.groups)):
                self._done_handing_out()
        slab, at = placed[name]
        nbytes, shape = self._shapes[name]
        if at % dtype.itemsize:  # a tensor not aligned to its type in the file (legal, rare)
            return slab.tensor[at:at + nbytes].clone().view(dtype).reshape(shape)
        return slab.view(at, dtype, shape, self._strides[name])

    def close(self):
        # An unrequested slab would stay alive with its future: drop them all.
        for future in self._futures:
            if future is not None:
                future.cancel()
        self._futures = [None] * len(self._futures)
        self._done_handing_out()
        if not any(staging.windows for staging in self._stagings):  # else at the release: windows map pages
            self._files.link.consumed(self.path)  # every group is read: its sources' pages are no longer wanted
        super().close()

    def _wait(self, future: Future, group: int) -> dict[str, tuple[Slab, int]]:
        """A group's placement, once staged. A loader that keeps the tensors it was handed (a state
        dict of the whole view), or takes files out of order, can wait for good behind slabs only it
        could free: where its group has not started after STALL_SECONDS in which no slab died and no
        group was staged, and no read is in flight (a slow disk's would stage one), every group it
        waits for goes past the budget from then on."""
        order, budget = self._load_context.order, self._load_context.budget
        while True:
            try:
                return future.result(timeout=STALL_SECONDS)
            except FutureTimeout:
                if (future.running() or order.stalled or budget.fits(self._costs[group])
                        or not order.stalled_for(STALL_SECONDS) or self._load_context.executor.busy()):
                    continue
                order.stalled = True
                log.warning("rankfs hook: %s: the loader waits for tensors the budget holds back while nothing "
                            "frees room (it keeps what it was handed, or takes files out of order; %.2f GiB "
                            "held, RANKFS_HOOK_INFLIGHT_GB is %.2f): each group it asks for is read past the "
                            "budget from now on", self.path, budget.used / GIB, budget.limit / GIB)
                order.wake()

    def _done_handing_out(self):
        if self.handing_out:
            self.handing_out = False
            self._load_context.order.consuming.discard(self)
            self._load_context.order.wake()  # the next file is now the one the loader consumes

    def _plan(self, names: list[str]) -> Staging:
        """A group's runs the page cache holds are windows where, joined, those of a 32nd of a slab
        or more hold three quarters of the group's bytes: each page-lock is a driver call that the
        loader's own CUDA calls wait behind (sliced experts' blocks of a few MB are read instead),
        and a slab for a group's few small tensors would cost a whole buffer to fault in and
        page-lock. The rest (rows of slices, runs not cached) is read into a slab."""
        runs, offsets, size = self._lay_out(names)
        spans = join_touching(runs) if self._load_context.slabs.windows_pinnable and self._load_context.on_device is None else []
        least = self._files.slab_bytes // WINDOW_SHARE
        cached = [span for span in spans if span.source.resident(span.begin, span.end)]
        if sum(span.end - span.begin for span in cached if span.end - span.begin >= least) * 4 < size * 3:
            return Staging([], names, runs, offsets, size)
        windowed = {name for span in cached for name in span.names}
        in_slab = [name for name in names if name not in windowed]
        return Staging(cached, in_slab, *self._lay_out(in_slab))

    def _lay_out(self, names: list[str]):
        blocks, rows = [], []
        for name in names:
            begin = self.block(name)
            if begin is None:
                rows.append((name, *self.locate(name), self.resident_bytes(name)))
            else:
                blocks.append((name, self.locate(name)[0], begin, self.resident_bytes(name)))
        return lay_out(blocks, rows)

    def _cost(self, staging: Staging) -> int:
        """The budget a group takes: its windows, and its slab's footprint."""
        slab = self._load_context.slabs.footprint(staging.size) if staging.in_slab else 0
        return sum(span.end - span.begin for span in staging.windows) + slab

    def _submit(self, group: int) -> Future:
        """Stage a group ahead: the loaders take files in sorted order, each file's groups in order."""
        return self._load_context.executor.submit((self.path, group), self._load, group, time.monotonic(),
                                          cost=self._costs[group],
                                          urgent=lambda: self._must_exceed_budget(group))

    def _must_exceed_budget(self, group: int) -> bool:
        """The loader waits for this group of the file it consumes now, and files before it hold one
        slab at most: nothing else will free room (files after it, read ahead, wait for this one;
        the loader's loop keeps the last tensor it took, and its slab, until it gets the next); or
        the loader has stalled (`_wait`)."""
        order = self._load_context.order
        return group in self._demanded and (order.stalled or order.consumed_now() is self and sum(
            f.slabs_alive for f in list(order.holding) if f.path < self.path) <= 1)

    def _load(self, group: int, asked: float) -> dict[str, tuple[Slab, int]]:
        """Runs in a hook thread, its cost reserved: stage one group, every free read thread
        helping (`asked`: when it was submitted, for the trace). Returns {tensor: (slab, offset in
        it)}."""
        began = time.monotonic()
        staging = self._stagings[group]
        placed: dict[str, tuple[Slab, int]] = {}
        windows = [(span.source.path, span.begin, span.end - span.begin, functools.partial(self._map_window, span, placed))
                   for span in staging.windows]  # (path, offset, bytes, callable)
        landing = None
        trace = self._load_context.trace
        try:
            copies = []
            if staging.in_slab:
                landing = self._allocate(staging.size, staging.in_slab)
                placed.update((name, (landing.slab, staging.offsets[name])) for name in staging.in_slab)
                copies = self._copies(staging, landing)
            cached = all_cached(copies)
            cpu = cpu_work(copies, cached)
            if cpu:
                jobs = batches(windows, landing, trace) + cached_jobs(copies, landing, trace)
            else:
                reads = windows + [(copy.source.path, copy.offset, copy.length, copy.read_as(cached)) for copy in copies]
                jobs = batches(sorted(reads, key=lambda r: r[:2]), landing, trace)
            self._load_context.executor.run_all((self.path, group), jobs, cpu=cpu, disk=not cached)
        except BaseException:  # the slabs made release their part of the cost as they die; this, the rest
            made = {id(s): s.reserved for s, _ in placed.values()}
            self._load_context.budget.release(self._costs[group] - sum(made.values()))
            raise
        if landing is not None:
            landing.filled()
        self._load_context.order.progressed()
        self._load_context.trace.event("group", path=self.path, group=group, bytes=self._group_spans[group], asked=asked,
                               began=began, ended=time.monotonic(), thread=threading.current_thread().name)
        return placed

    def _copies(self, staging: Staging, landing: HostLanding | DeviceLanding) -> list[Copy]:
        """What fills a group's slab: its runs in pieces, and the whole rows of its slices spread
        over rows."""
        copies = [Copy(piece.source, piece.offset, piece.length, piece.at, None,
                       functools.partial(read_run, piece, landing))
                  for run in staging.runs for piece in run.pieces()]
        for name in staging.in_slab:
            if self.block(name) is None:
                at = staging.offsets[name]
                source, begin = self.locate(name)
                copies.append(Copy(source, *self.span(name), at, self.rows(name),
                                   functools.partial(read_rows, source, begin, self.rows(name), name, landing, at)))
        return copies

    def _allocate(self, size: int, names: list[str]) -> HostLanding | DeviceLanding:
        """A slab for a group, in GPU memory where the hook stages there and the device has room."""
        on_device = self._load_context.on_device
        slab = on_device.allocate(size, names, self.path, self._slab_died) if on_device is not None else None
        if slab is not None:
            landing = DeviceLanding(slab, on_device)
        else:
            landing = HostLanding(self._load_context.slabs.allocate(size, names, self.path, on_death=self._slab_died),
                                  self._load_context.slabs)
        self._slab_born()
        return landing

    def _map_window(self, span: Span, placed: dict[str, tuple[Slab, int]]):
        window = self._load_context.slabs.window(span.source, span.begin, span.end, list(span.names), self.path,
                                         on_death=self._slab_died)
        self._slab_born()
        for name in span.names:
            placed[name] = (window, self.block(name) - span.begin)

    def _slab_born(self):
        with self._lock:
            self.slabs_alive += 1
            self._load_context.order.holding.add(self)

    def _slab_died(self):
        self._load_context.order.progressed()
        with self._lock:
            self.slabs_alive -= 1
            if not self.slabs_alive:
                self._load_context.order.holding.discard(self)
