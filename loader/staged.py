"""Tensors staged in slabs (for copies to a GPU: DMA from page-locked memory). Each group of a
file's tensors is staged by the hook's threads in the loaders' order as the budget has room, every
free thread helping with the group the loader needs first; `get_tensor` waits for its group and
returns a view into its slab: host memory, or GPU memory that the reads were uploaded to piece by
piece through each read thread's bounce buffers (rankfs.loader.device).

Bytes adjacent in a source form a run. Where slabs are handed out from host memory, a group's runs
that the page cache holds (checked when the file is opened), those that touch joined, are windows
where those of a 32nd of a slab (8 MiB) or more hold three quarters of the group's bytes: their
pages mapped in place and page-locked (with CUDA), so the GPU copies from the page cache with no
read and no copy by the CPU, which the loader's own threads need then. The rest (rows of slices,
runs not cached, groups not windowed, every group staged on the GPU) fills one slab per group: each
run read in pieces of 16 MiB at most, on every free thread, straight from the disk (O_DIRECT)
unless the page cache holds it, at its file offset's place within a page, with its first and last
pages to itself, as direct reads need (a bounce buffer keeps that place within a page); slices
spread over rows read row by row, or, where the page cache holds them, their columns copied out of
its mapped pages. A group of small reads whose sources the page cache holds (a warm sliced rank's
experts) is copied out of maps instead, a piece of the slab per job, alike copies at one step in
one numpy call. Either way a load adds nothing to the page cache.

Reads ahead are admitted in the loaders' order while the budget has room. The file the loader
consumes now goes beyond it only when files before it hold one slab at most (the loader takes a
file's tensors all at once before it copies any, and files read ahead wait for this one, so nothing
would free room): the memory handed out stays within the budget plus a slab, plus that file where it
is larger than the budget."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from typing import Callable, NamedTuple

import numpy as np
import torch

from rankfs.loader.device import PIECE_BYTES, DeviceSlabs
from rankfs.loader.files import RankfsFile
from rankfs.loader.slabs import Slab
from rankfs.plan.spec import Rows
from rankfs.reader.io import PAGE, OpenFile, align_down, align_up, anonymous_map, covering_pages

ROWS_BYTES = 8 << 20  # whole rows of a slice read at once
RUN_BYTES = 16 << 20  # one read: large enough for the disk's full rate, small enough to spread over threads
WINDOW_SHARE = 32  # a window holds a 32nd of a slab at least: 8 MiB of the default 256
SMALL_READ_BYTES = 4 << 20  # a group's reads under this on average are CPU work when cached

_thread = threading.local()


class Run(NamedTuple):
    """Bytes adjacent in one file, read together into a slab at `at` (congruent to `offset`
    modulo PAGE), or mapped as a window; `names` are its tensors, the first for messages."""
    source: OpenFile
    offset: int
    length: int
    at: int
    names: tuple[str, ...]

    @property
    def first(self) -> str:
        return self.names[0]

    def pieces(self, nbytes: int = RUN_BYTES) -> list["Run"]:
        """The run as reads of nbytes at most, cut at pages of the file (a direct read of one
        piece fills none of the next one's pages). One thread read a tensor larger than a read
        alone, and its group, and the loader, waited for it: a 160 MiB embedding on the 2-core
        VM took 0.15 s against 0.03-0.07 s for each read of 16 MiB beside it (DeepSeek V3's
        embedding is 1.85 GB)."""
        end = self.offset + self.length
        cuts = [self.offset, *range(align_down(self.offset) + nbytes, end, nbytes), end]
        return [self._replace(offset=a, length=b - a, at=self.at + a - self.offset) for a, b in zip(cuts, cuts[1:])]


class Copy(NamedTuple):
    """A read into a slab at `at` of `length` bytes of a source from `offset`: a block, or the
    whole rows of a slice spread over them (`rows`), of which the rank's columns land. `read`
    does it on its own (from the disk, or the page cache); where a group's sources are cached,
    jobs of copies are made out of maps instead (`_copy_out_of_cache`)."""
    source: OpenFile
    offset: int
    length: int
    at: int
    rows: Rows | None
    read: Callable[[], None]

    @property
    def landed(self) -> int:
        """The bytes it writes to the slab."""
        return self.length if self.rows is None else self.rows.kept_bytes


class Span(NamedTuple):
    """Runs of a group that share or touch pages, as the whole pages [begin, end) a window maps."""
    source: OpenFile
    begin: int
    end: int
    names: tuple[str, ...]


class Staging(NamedTuple):
    """How a group is staged: `windows`, and the other tensors (`in_slab`) read into one slab as
    `runs` and rows laid out at `offsets`, `size` bytes in all."""
    windows: list[Span]
    in_slab: list[str]
    runs: list[Run]
    offsets: dict[str, int]
    size: int


class Spot(NamedTuple):
    """Where bytes bound for slab[slab_at:slab_at + nbytes] are written: buffer[at:], `at`
    congruent to slab_at modulo PAGE (and so to their offset in the file, as direct reads need)."""
    buffer: memoryview
    at: int
    slab_at: int
    nbytes: int


class HostLanding:
    """Reads land in a host slab in place; it is page-locked once full, where the pool pins."""

    piece = None  # a run in one read

    def __init__(self, slab: Slab, pool):
        self.slab, self.pool = slab, pool
        self.buffer = memoryview(slab.tensor.numpy())

    def place(self, at: int, nbytes: int) -> Spot:
        return Spot(self.buffer, at, at, nbytes)

    def landed(self, spot: Spot):
        pass

    def flush(self):
        pass

    def filled(self):
        self.pool.filled(self.slab)


class DeviceLanding:
    """Reads land in the read thread's bounce buffers, a piece at most at a time, and are uploaded
    to their place in a GPU slab (rankfs.loader.device)."""

    piece = PIECE_BYTES

    def __init__(self, slab: Slab, device: DeviceSlabs):
        self.slab, self.device = slab, device
        self._sent: list[torch.cuda.Event] = []  # each job's uploads, from the thread that ran it

    def place(self, at: int, nbytes: int) -> Spot:
        buffer, position = self.device.bounce().place(self.slab.tensor, at, nbytes)
        return Spot(buffer, position, at, nbytes)

    def landed(self, spot: Spot):
        self.device.bounce().landed(spot.slab_at, spot.nbytes)

    def flush(self):
        sent = self.device.bounce().send()
        if sent is not None:
            self._sent.append(sent)

    def filled(self):
        for sent in self._sent:
            sent.synchronize()


def join_touching(runs: list[Run]) -> list[Span]:
    """Runs in file order, those that share or touch pages joined, as whole pages."""
    spans: list[Span] = []
    for run in runs:
        begin, end = covering_pages(run.offset, run.offset + run.length)
        if spans and spans[-1].source is run.source and begin <= spans[-1].end:
            spans[-1] = spans[-1]._replace(end=max(end, spans[-1].end), names=spans[-1].names + run.names)
        else:
            spans.append(Span(run.source, begin, end, run.names))
    return spans


def lay_out(blocks: list[tuple[str, OpenFile, int, int]], rows: list[tuple[str, OpenFile, int, int]]):
    """A group's slab, in file order: `blocks` (name, file, offset, length) joined into runs of
    adjacent bytes, each at its offset's place within a page; `rows` (name, file, offset, kept
    bytes) each from a page boundary. The reads go in file order too, so what one thread reads in
    turn lies side by side in the slab and goes to the GPU in one upload (rows laid out after every
    block made a sliced expert's reads three uploads). Returns (runs, {name: slab offset}, slab
    bytes). At most the tensors' bytes plus two pages each."""
    runs: list[Run] = []
    offsets: dict[str, int] = {}
    pos = 0
    current: list = []  # [file, offset, end, [(name, offset)]]

    def close_run():
        nonlocal pos, current
        if current:
            source, begin, end, members = current
            at = align_up(pos) + begin % PAGE
            runs.append(Run(source, begin, end - begin, at, tuple(name for name, _ in members)))
            offsets.update((name, at + offset - begin) for name, offset in members)
            pos = at + end - begin
            current = []
    items = [(False, block) for block in blocks] + [(True, row) for row in rows]
    for is_rows, (name, source, offset, length) in sorted(items, key=lambda item: (item[1][1].path, item[1][2])):
        if is_rows:
            close_run()
            offsets[name] = align_up(pos)
            pos = offsets[name] + length
            continue
        if current and (current[0] is not source or current[2] != offset or current[2] - current[1] >= RUN_BYTES):
            close_run()
        if not current:
            current = [source, offset, offset, []]
        current[2] = offset + length
        current[3].append((name, offset))
    close_run()
    return runs, offsets, align_up(pos)


def _batches(reads: list[tuple[str, int, int, functools.partial]], landing, trace) -> list:
    """Reads (path, offset, bytes, read) in file order, as jobs of RUN_BYTES or more each: a job per
    small read would cost more in hand-offs between threads than the read (sliced experts' blocks
    are a few MB). A job ends once what it read has landed or, on the GPU, its uploads are queued:
    the group's end waits for them (`filled`)."""
    jobs, batch, size = [], [], 0
    for *_, nbytes, read in reads:
        batch.append(read)
        size += nbytes
        if size >= RUN_BYTES:
            jobs.append((batch, size))
            batch, size = [], 0
    if batch:
        jobs.append((batch, size))
    return [_job(trace, size, len(batch), _run_each, batch, landing) for batch, size in jobs]


def _run_each(reads: list, landing):
    for read in reads:
        read()
    if landing is not None:
        landing.flush()


def _job(trace, nbytes: int, reads: int, work, *args) -> functools.partial:
    """work(*args) as a read thread's job; traced, it says how much of its time its thread ran on
    a CPU: the rest it waited (for the GIL, a bounce buffer, the disk)."""
    return functools.partial(_run_job, trace, nbytes, reads, work, args)


def _run_job(trace, nbytes: int, reads: int, work, args: tuple):
    if not trace.on:
        work(*args)
        return
    began, cpu = time.monotonic(), time.thread_time()
    work(*args)
    trace.event("job", began=began, ended=time.monotonic(), cpu=round(time.thread_time() - cpu, 6),
                bytes=nbytes, reads=reads)


def _cpu_work(copies: list[Copy]) -> bool:
    """Whether a group's slab is filled by copies out of the page cache, reads of a few MB on
    average (sliced experts, their sources cached): work for the CPU alone, on as many read threads
    as half the cores (rankfs.loader.ordered). Read from the disk, every thread keeps a read in
    flight. One cachestat per source, over all of the group's reads from it: so every page between
    a group's first and last read of a source is cached."""
    if not copies or sum(copy.length for copy in copies) >= len(copies) * SMALL_READ_BYTES:
        return False
    return all(source.cached(begin, end) for source, (begin, end) in _covering(copies).items())


def _covering(copies: list[Copy]) -> dict[OpenFile, tuple[int, int]]:
    """Per source, the bytes from the first of the copies' reads to the end of the last."""
    spans: dict[OpenFile, tuple[int, int]] = {}
    for copy in copies:
        begin, end = spans.get(copy.source, (copy.offset, copy.offset + copy.length))
        spans[copy.source] = (min(begin, copy.offset), max(end, copy.offset + copy.length))
    return spans


def _cached_jobs(copies: list[Copy], landing, trace) -> list:
    """Copies out of the page cache in slab order, as jobs of a landing's piece of the slab at most
    (RUN_BYTES in a host slab). One larger alone is a job of its own read."""
    cap = landing.piece or RUN_BYTES
    jobs, job = [], []
    for copy in sorted(copies, key=lambda c: c.at):
        if copy.landed > cap:
            jobs.append(_job(trace, copy.length, 1, _run_each, [copy.read], landing))
            continue
        if job and copy.at + copy.landed - job[0].at > cap:
            jobs.append(_job(trace, sum(c.length for c in job), len(job), _copy_out_of_cache, job, landing))
            job = []
        job.append(copy)
    if job:
        jobs.append(_job(trace, sum(c.length for c in job), len(job), _copy_out_of_cache, job, landing))
    return jobs


def _copy_out_of_cache(copies: list[Copy], landing):
    """Copies whose sources the page cache holds (`_cpu_work`), made out of one map of each source
    into one place of the slab, those alike at constant steps in a single numpy call each
    (`_strided`). Read one by one, a sliced expert was six reads of its own, each taking the GIL
    back a few times: a warm EP1 sliced load's read threads ran 31-38 % of their jobs' time on the
    H200 host, waiting the rest. Only the pages the copies read are mapped in: mapping in a job's
    whole span, the other ranks' rows too, cost a warm sliced load on the 2-core VM 4.9-7.5 CPU
    seconds against 3.7-4.7. Where a
    source cannot be mapped, each copy is read instead."""
    maps: dict[OpenFile, tuple[int, memoryview]] = {}
    try:
        for source, (begin, end) in _covering(copies).items():
            whole = source.mapped(begin, end - begin, [(c.offset, c.offset + c.length) for c in copies
                                                      if c.source is source])
            if whole is None:
                break
            maps[source] = (begin, whole)
        else:
            first = copies[0].at
            spot = landing.place(first, max(c.at + c.landed for c in copies) - first)
            for copy, count, step, slab_step in _strided(copies):
                begin, whole = maps[copy.source]
                _copy_strided(copy.rows or Rows(1, copy.length, 0, copy.length), count, step, slab_step,
                              whole, copy.offset - begin, spot.buffer, spot.at + copy.at - first)
            landing.landed(spot)
            landing.flush()
            return
    finally:
        for source, (begin, whole) in maps.items():
            source.unmap(begin, len(whole))
    _run_each([copy.read for copy in copies], landing)  # a source could not be mapped


def _strided(copies: list[Copy]):
    """Copies of one shape from one source at constant steps, in the source and in the slab alike,
    as (first copy, count, source step, slab step): where experts lie at one step in the source
    and the slab, the w2 of all of a job's experts is one numpy call."""
    alike: dict[tuple, list[Copy]] = {}
    for copy in copies:
        alike.setdefault((copy.source, copy.rows or copy.length), []).append(copy)
    for same in alike.values():
        i = 0
        while i < len(same):
            j, step, slab_step = i + 1, 0, 0
            if j < len(same):
                step, slab_step = same[j].offset - same[i].offset, same[j].at - same[i].at
                while (j < len(same) and same[j].offset - same[j - 1].offset == step
                       and same[j].at - same[j - 1].at == slab_step):
                    j += 1
            yield same[i], j - i, step, slab_step
            i = j


_UNITS = ((8, np.uint64), (4, np.uint32), (2, np.uint16), (1, np.uint8))


def _copy_strided(rows: Rows, count: int, step: int, slab_step: int, source: memoryview, at: int,
                  target: memoryview, target_at: int):
    """The rank's columns of `rows` (a block: one row kept whole) from source[at:], their first
    row's first byte, packed into target[target_at:]; `count` times, `step` bytes apart in the
    source and `slab_step` in the target. In the widest unit that every address, step and length
    divides: eight-byte elements copy columns 2.5x as fast as bytes on the H200 host. numpy
    checks that every element lies within both buffers."""
    kept = rows.keep_stop - rows.keep_start
    source_bytes, target_bytes = np.frombuffer(source, np.uint8), np.frombuffer(target, np.uint8)
    at += rows.keep_start
    unit, dtype = next((unit, dtype) for unit, dtype in _UNITS
                       if not (source_bytes.ctypes.data + at) % unit | (target_bytes.ctypes.data + target_at) % unit
                       | step % unit | slab_step % unit | rows.row_bytes % unit | kept % unit)
    shape = (count, rows.count, kept // unit)
    np.copyto(np.ndarray(shape, dtype, buffer=target_bytes, offset=target_at, strides=(slab_step, kept, unit)),
              np.ndarray(shape, dtype, buffer=source_bytes, offset=at, strides=(step, rows.row_bytes, unit)))


def _rows_buffer(nbytes: int) -> memoryview:
    """This thread's page-aligned buffer for whole rows (a fresh one per tensor would cost a
    zero-filled page fault per page of it)."""
    buffer = getattr(_thread, "rows", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _thread.rows = anonymous_map(nbytes)
    return memoryview(buffer)


def contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]


def _short(where: str, name: str, offset: int) -> OSError:
    return OSError(f"{where}: tensor {name!r}: short read at offset {offset}; the file was truncated")


class StagedFile(RankfsFile):
    def __init__(self, path: str, hook, placement: dict | None):
        super().__init__(path, hook, placement)
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
        hook.consuming.add(self)
        self._futures: list[Future | None] = [self._submit(g) for g in range(len(self.groups))]

    def resident(self, name: str, group: int, dtype: torch.dtype) -> torch.Tensor:
        if group not in self._demanded:
            self._demanded.add(group)
            self._hook.wake_readers()  # it may be the one that must go beyond the budget
        future = self._futures[group] or self._submit(group)
        if self._hook.trace.on and not future.done():  # traced: nothing more on each hand-out otherwise
            began = time.monotonic()
            placed = future.result()
            self._hook.trace.event("wait", path=self.path, group=group, began=began)
        else:
            placed = future.result()
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
        super().close()

    def _done_handing_out(self):
        if self.handing_out:
            self.handing_out = False
            self._hook.consuming.discard(self)
            self._hook.wake_readers()  # the next file is now the one the loader consumes

    def _plan(self, names: list[str]) -> Staging:
        """A group's runs the page cache holds are windows where, joined, those of a 32nd of a slab
        or more hold three quarters of the group's bytes: each page-lock is a driver call that the
        loader's own CUDA calls wait behind (sliced experts' blocks of a few MB are read instead),
        and a slab for a group's few small tensors would cost a whole buffer to fault in and
        page-lock. The rest (rows of slices, runs not cached) is read into a slab."""
        runs, offsets, size = self._lay_out(names)
        spans = join_touching(runs) if self._hook.slabs.windows_pinnable and self._hook.on_device is None else []
        least = self._hook.settings.slab_bytes // WINDOW_SHARE
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
        slab = self._hook.slabs.footprint(staging.size) if staging.in_slab else 0
        return sum(span.end - span.begin for span in staging.windows) + slab

    def _submit(self, group: int) -> Future:
        """Stage a group ahead: the loaders take files in sorted order, each file's groups in order."""
        return self._hook.executor.submit((self.path, group), self._load, group, time.monotonic(),
                                          cost=self._costs[group],
                                          urgent=lambda: self._must_exceed_budget(group))

    def _must_exceed_budget(self, group: int) -> bool:
        """The loader waits for this group of the file it consumes now, and files before it hold one
        slab at most: nothing else will free room (files after it, read ahead, wait for this one;
        the loader's loop keeps the last tensor it took, and its slab, until it gets the next)."""
        return (group in self._demanded and self._hook.consumed_now() is self
                and sum(f.slabs_alive for f in list(self._hook.holding) if f.path < self.path) <= 1)

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
        trace = self._hook.trace
        try:
            copies = []
            if staging.in_slab:
                landing = self._allocate(staging.size, staging.in_slab)
                placed.update((name, (landing.slab, staging.offsets[name])) for name in staging.in_slab)
                copies = self._copies(staging, landing)
            cpu = _cpu_work(copies)
            if cpu:
                jobs = _batches(windows, landing, trace) + _cached_jobs(copies, landing, trace)
            else:
                reads = windows + [(copy.source.path, copy.offset, copy.length, copy.read) for copy in copies]
                jobs = _batches(sorted(reads, key=lambda r: r[:2]), landing, trace)
            self._hook.executor.run_all((self.path, group), jobs, cpu=cpu)
        except BaseException:  # the slabs made release their part of the cost as they die; this, the rest
            made = {id(s): s.reserved for s, _ in placed.values()}
            self._hook.budget.release(self._costs[group] - sum(made.values()))
            raise
        if landing is not None:
            landing.filled()
        self._hook.trace.event("group", path=self.path, group=group, bytes=self._group_spans[group], asked=asked,
                               began=began, ended=time.monotonic(), thread=threading.current_thread().name)
        return placed

    def _copies(self, staging: Staging, landing: HostLanding | DeviceLanding) -> list[Copy]:
        """What fills a group's slab: its runs in pieces, and the whole rows of its slices spread
        over rows."""
        copies = [Copy(piece.source, piece.offset, piece.length, piece.at, None,
                       functools.partial(self._read_run, piece, landing))
                  for run in staging.runs for piece in run.pieces()]
        for name in staging.in_slab:
            if self.block(name) is None:
                at = staging.offsets[name]
                copies.append(Copy(self.locate(name)[0], *self.span(name), at, self.rows(name),
                                   functools.partial(self._read_rows, name, landing, at)))
        return copies

    def _allocate(self, size: int, names: list[str]) -> HostLanding | DeviceLanding:
        """A slab for a group, in GPU memory where the hook stages there and the device has room."""
        on_device = self._hook.on_device
        slab = on_device.allocate(size, names, self.path, self._slab_died) if on_device is not None else None
        if slab is not None:
            landing = DeviceLanding(slab, on_device)
        else:
            landing = HostLanding(self._hook.slabs.allocate(size, names, self.path, on_death=self._slab_died),
                                  self._hook.slabs)
        self._slab_born()
        return landing

    def _map_window(self, span: Span, placed: dict[str, tuple[Slab, int]]):
        window = self._hook.slabs.window(span.source, span.begin, span.end, list(span.names), self.path,
                                         on_death=self._slab_died)
        self._slab_born()
        for name in span.names:
            placed[name] = (window, self.block(name) - span.begin)

    def _slab_born(self):
        with self._lock:
            self.slabs_alive += 1
            self._hook.holding.add(self)

    def _slab_died(self):
        with self._lock:
            self.slabs_alive -= 1
            if not self.slabs_alive:
                self._hook.holding.discard(self)

    @staticmethod
    def _read_run(run: Run, landing: HostLanding | DeviceLanding):
        where = f"{run.source.path}: tensor {run.first!r}"
        piece = landing.piece or run.length
        for begin in range(0, run.length, piece):
            nbytes = min(piece, run.length - begin)
            spot = landing.place(run.at + begin, nbytes)
            if run.source.read_into(spot.buffer, spot.at, run.offset + begin, nbytes, where) < nbytes:
                raise _short(run.source.path, run.first, run.offset + begin)
            landing.landed(spot)

    @staticmethod
    def _copy_cached_rows(source: OpenFile, begin: int, rows: Rows, landing: HostLanding | DeviceLanding,
                          at: int) -> bool:
        """Rows the page cache holds: the rank's columns copied straight out of the source's pages,
        mapped, to the slab from `at`; whether it could. A read of whole rows would move every
        row's bytes twice for a quarter of them kept (TP4): a warm sliced load's read threads spent
        most of their time in reads from the page cache, at 1.4 GB/s a thread on the H200 host."""
        nbytes = rows.count * rows.row_bytes
        if not source.cached(begin, begin + nbytes):
            return False  # read from the disk (direct), not faulted into the page cache
        whole = source.mapped(begin, nbytes)
        if whole is None:
            return False
        try:
            kept = rows.keep_stop - rows.keep_start
            per_spot = rows.count if landing.piece is None else max(1, landing.piece // kept)
            for first in range(0, rows.count, per_spot):
                count = min(per_spot, rows.count - first)
                spot = landing.place(at + first * kept, count * kept)
                _copy_strided(rows._replace(count=count), 1, 0, 0, whole, first * rows.row_bytes, spot.buffer, spot.at)
                landing.landed(spot)
        finally:
            source.unmap(begin, nbytes)
        return True

    def _read_rows(self, name: str, landing: HostLanding | DeviceLanding, at: int):
        """A slice spread over rows: whole rows through a bounded buffer, the rank's columns copied
        out to the slab from `at` (every page of the rows holds kept bytes), a landing's piece of
        them at a time (the whole slice in a host slab)."""
        source, begin = self.locate(name)
        rows = self.rows(name)
        if self._copy_cached_rows(source, begin, rows, landing, at):
            return
        kept = rows.keep_stop - rows.keep_start
        per_read = min(rows.count, max(1, ROWS_BYTES // rows.row_bytes))
        per_spot = rows.count if landing.piece is None else per_read * max(1, landing.piece // (per_read * kept))
        whole_rows = _rows_buffer(align_up(per_read * rows.row_bytes) + 2 * PAGE)
        spot = None
        for first in range(0, rows.count, per_read):
            count = min(per_read, rows.count - first)
            offset = begin + first * rows.row_bytes
            skip = offset % PAGE
            if source.read_into(whole_rows, skip, offset, count * rows.row_bytes, f"{source.path}: tensor {name!r}") \
                    < count * rows.row_bytes:
                raise _short(source.path, name, offset)
            if first % per_spot == 0:
                if spot is not None:
                    landing.landed(spot)
                spot = landing.place(at + first * kept, min(per_spot, rows.count - first) * kept)
            _copy_strided(rows._replace(count=count), 1, 0, 0, whole_rows, skip, spot.buffer,
                          spot.at + first * kept - (spot.slab_at - at))
        landing.landed(spot)
