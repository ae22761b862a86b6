"""A group's reads as the read threads' jobs, and the reads themselves: runs in pieces, from the
disk (direct) unless the page cache holds them; slices spread over rows read whole, their columns
picked by the landing (a GPU slab's pitched upload) or copied out on the CPU, where the page cache
holds them straight out of its mapped pages; and a group of small reads whose sources the page
cache holds all, a piece of the slab per job, copied out of maps of them into a host slab or a
read thread's bounce buffer. Short reads name the file and the tensor. rankfs.loader.staged
decides which a group takes."""

from __future__ import annotations

import functools
import threading
import time
from typing import Callable, NamedTuple

import numpy as np

from rankfs.loader.landing import DeviceLanding, HostLanding, Spot
from rankfs.loader.packing import RUN_BYTES, Run
from rankfs.plan.spec import Rows
from rankfs.common.disk import PAGE, OpenFile, align_up, anonymous_map

ROWS_BYTES = 8 << 20  # whole rows of a slice read at once
SMALL_READ_BYTES = 4 << 20  # a group's reads under this on average are CPU work when cached

_thread = threading.local()


class Copy(NamedTuple):
    """A read into a slab at `at` of `length` bytes of a source from `offset`: a block, or the
    whole rows of a slice spread over them (`rows`), of which the rank's columns land. `read`
    does it on its own (from the disk, or the page cache; `read_as(True)` where the group's
    sources were found cached); where a group's small reads' sources are all cached, jobs of copies
    are made out of maps instead (`_copy_out_of_cache`)."""
    source: OpenFile
    offset: int
    length: int
    at: int
    rows: Rows | None
    read: Callable[..., None]

    def read_as(self, cached: bool) -> functools.partial:
        """Its read, told whether the group's sources were found cached (`all_cached`): one told
        so does not ask the page cache again, a call that lets the GIL go and waits to take it
        back."""
        return functools.partial(self.read, cached=cached)

    @property
    def landed(self) -> int:
        """The bytes it writes to the slab."""
        return self.length if self.rows is None else self.rows.kept_bytes


def batches(reads: list[tuple[str, int, int, functools.partial]], landing, trace) -> list:
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
    began, cpu, scheduled = time.monotonic(), time.thread_time(), _scheduled()
    work(*args)
    waited, switches = (after - before for after, before in zip(_scheduled(), scheduled))
    trace.event("job", began=began, ended=time.monotonic(), cpu=round(time.thread_time() - cpu, 6),
                bytes=nbytes, reads=reads, thread=threading.current_thread().name,
                runnable=round(waited, 6), switches=switches)


def _scheduled() -> tuple[float, int]:
    """This thread's seconds waiting for a CPU while runnable, and how many times it was switched
    in (/proc/thread-self/schedstat; zeros where the kernel keeps none): a job's time neither on a
    CPU nor runnable it slept (the GIL, a bounce buffer's upload, the disk)."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            _, runnable, switches = stat.read().split()
    except (OSError, ValueError):
        return 0.0, 0
    return int(runnable) / 1e9, int(switches)


def all_cached(copies: list[Copy]) -> bool:
    """Whether the page cache holds every page between a group's first and last read of each
    source: one cachestat per source, over all of its reads."""
    return all(source.cached(begin, end) for source, (begin, end) in _covering(copies).items())


def cpu_work(copies: list[Copy], cached: bool) -> bool:
    """Whether a group's slab is filled by copies out of the page cache (`cached`: all_cached),
    reads of a few MB on average (sliced experts, their sources cached): work for the CPU alone,
    on as many read threads as half the cores (rankfs.loader.ordered). Read from the disk, every
    thread keeps a read in flight."""
    return cached and sum(copy.length for copy in copies) < len(copies) * SMALL_READ_BYTES


def _covering(copies: list[Copy]) -> dict[OpenFile, tuple[int, int]]:
    """Per source, the bytes from the first of the copies' reads to the end of the last."""
    spans: dict[OpenFile, tuple[int, int]] = {}
    for copy in copies:
        begin, end = spans.get(copy.source, (copy.offset, copy.offset + copy.length))
        spans[copy.source] = (min(begin, copy.offset), max(end, copy.offset + copy.length))
    return spans


def cached_jobs(copies: list[Copy], landing, trace) -> list:
    """Copies out of the page cache in slab order, as jobs of a landing's piece of the slab at most
    (RUN_BYTES in a host slab, a bounce buffer's piece for a GPU slab), each copied out of maps of
    its sources: a sliced w2 moves only the rank's columns, where a read of its whole rows into a
    bounce buffer moved four times its bytes. One larger than a piece alone is a job of its own
    read, which does not ask the page cache again (`Copy.read_as`)."""
    cap = landing.piece or RUN_BYTES
    jobs, job = [], []

    def close_job():
        jobs.append(_job(trace, sum(c.length for c in job), len(job), _copy_out_of_cache, job, landing))
    for copy in sorted(copies, key=lambda c: c.at):
        if copy.landed > cap:
            jobs.append(_job(trace, copy.length, 1, _run_each, [copy.read_as(True)], landing))
            continue
        if job and copy.at + copy.landed - job[0].at > cap:
            close_job()
            job = []
        job.append(copy)
    if job:
        close_job()
    return jobs


def _copy_out_of_cache(copies: list[Copy], landing):
    """Copies whose sources the page cache holds (`all_cached`), made out of one map of each source
    into one place of the slab, those alike at constant steps in a single numpy call each
    (`_strided`): read one by one, a sliced expert is six reads of its own, each taking the GIL
    back a few times. Only the pages the copies read are mapped in, not the other ranks' rows
    between them. Where a source cannot be mapped, each copy is read instead."""
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
            landing.flush()
            return
    finally:
        for source, (begin, whole) in maps.items():
            source.unmap(begin, len(whole))
    _run_each([copy.read_as(True) for copy in copies], landing)  # a source could not be mapped


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
    divides: eight-byte elements copy columns several times as fast as bytes. numpy checks that
    every element lies within both buffers."""
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


def read_run(run: Run, landing: HostLanding | DeviceLanding, cached: bool = False):
    """A run into its place in the slab, a landing's piece at a time (`cached`: OpenFile.read_into)."""
    piece = landing.piece or run.length
    for begin in range(0, run.length, piece):
        nbytes = min(piece, run.length - begin)
        spot = landing.place(run.at + begin, nbytes)
        offset = run.offset + begin
        where = f"{run.source.path}: tensor {run.tensors_at(offset, offset + nbytes)}"
        run.source.read_whole(spot.buffer, spot.at, offset, nbytes, where, cached)


def _copy_cached_rows(source: OpenFile, begin: int, rows: Rows, spot: Spot, cached: bool) -> bool:
    """Rows the page cache holds (`cached`: known to): the rank's columns copied straight out of
    the source's pages, mapped, to `spot`; whether it could. A read of whole rows would move every
    row's bytes twice for a quarter of them kept (TP4)."""
    nbytes = rows.count * rows.row_bytes
    if not (cached or source.cached(begin, begin + nbytes)):
        return False  # read from the disk (direct), not faulted into the page cache
    whole = source.mapped(begin, nbytes)
    if whole is None:
        return False
    try:
        _copy_strided(rows, 1, 0, 0, whole, 0, spot.buffer, spot.at)
    finally:
        source.unmap(begin, nbytes)
    return True


def read_rows(source: OpenFile, begin: int, rows: Rows, name: str, landing: HostLanding | DeviceLanding,
              at: int, cached: bool = False):
    """A slice spread over rows, its kept columns to the slab from `at`: whole rows read into a
    bounce buffer, a piece of them at a time, where the landing picks the columns (the GPU's);
    else the columns copied out of the page cache's pages, or out of whole rows read through a
    bounded buffer (every page of the rows holds kept bytes)."""
    what = f"{source.path}: tensor {name!r}"
    kept = rows.keep_stop - rows.keep_start
    if landing.picks_columns:
        per_read = max(1, landing.piece // rows.row_bytes)
        for first in range(0, rows.count, per_read):
            part = rows._replace(count=min(per_read, rows.count - first))
            offset = begin + first * rows.row_bytes
            spot = landing.place_rows(at + first * kept, part, offset)
            source.read_whole(spot.buffer, spot.at, offset, spot.nbytes, what, cached)
        return
    spot = landing.place(at, rows.kept_bytes)  # a host slab: the whole slice in place
    if _copy_cached_rows(source, begin, rows, spot, cached):
        return
    per_read = min(rows.count, max(1, ROWS_BYTES // rows.row_bytes))
    whole_rows = _rows_buffer(align_up(per_read * rows.row_bytes) + 2 * PAGE)
    for first in range(0, rows.count, per_read):
        count = min(per_read, rows.count - first)
        offset = begin + first * rows.row_bytes
        skip = offset % PAGE
        source.read_whole(whole_rows, skip, offset, count * rows.row_bytes, what, cached)
        _copy_strided(rows._replace(count=count), 1, 0, 0, whole_rows, skip, spot.buffer, spot.at + first * kept)
