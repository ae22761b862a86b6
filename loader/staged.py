"""Tensors staged in slabs (for copies to a GPU: DMA from page-locked memory). Each group of a
file's tensors fills one slab, read ahead by the hook's threads in the loaders' order as the budget
has room, every free thread helping with the group the loader needs first; `get_tensor` waits for
its group and returns a view into the slab.

Bytes adjacent in a source are read together, straight from the disk (O_DIRECT) unless the page
cache holds them already: a load adds nothing to the page cache, so there is nothing to drop after
it, and a direct read is one copy by the device instead of two. A slab lays out each run of
adjacent bytes at its file offset's place within a page, with its first and last pages to itself,
as direct reads need.

Reads ahead are admitted in the loaders' order while the budget has room. The file the loader
consumes now goes beyond it only when files before it hold one slab at most (the loader takes a
file's tensors all at once before it copies any, and files read ahead wait for this one, so nothing
would free room): the pinned memory stays within the budget plus a slab, plus that file where it is
larger than the budget."""

from __future__ import annotations

import functools
import mmap
import threading
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np
import torch

from rankfs.loader.files import RankfsFile
from rankfs.loader.slabs import Slab
from rankfs.reader.io import PAGE, OpenFile, align_up

BOUNCE_BYTES = 8 << 20
RUN_BYTES = 16 << 20  # one read: large enough for the disk's full rate, small enough to spread over threads

_thread = threading.local()


class Run(NamedTuple):
    """Bytes adjacent in one file, read together into a slab at `at` (congruent to `offset`
    modulo PAGE); `first` names its first tensor, for messages."""
    source: OpenFile
    offset: int
    length: int
    at: int
    first: str


def lay_out(blocks: list[tuple[str, OpenFile, int, int]], rows: list[tuple[str, int]]):
    """A group's slab: `blocks` (name, file, offset, length) joined into runs of adjacent bytes,
    each at its offset's place within a page; `rows` (name, kept bytes) each from a page boundary.
    Returns (runs, {name: slab offset}, slab bytes). At most the tensors' bytes plus two pages
    each."""
    runs: list[Run] = []
    offsets: dict[str, int] = {}
    pos = 0
    current: list = []  # [file, offset, end, [(name, offset)]]

    def close_run():
        nonlocal pos
        source, begin, end, members = current
        at = align_up(pos) + begin % PAGE
        runs.append(Run(source, begin, end - begin, at, members[0][0]))
        offsets.update((name, at + offset - begin) for name, offset in members)
        pos = at + end - begin
    for name, source, offset, length in sorted(blocks, key=lambda b: (b[1].path, b[2])):
        if current and (current[0] is not source or current[2] != offset or current[2] - current[1] >= RUN_BYTES):
            close_run()
            current = []
        if not current:
            current = [source, offset, offset, []]
        current[2] = offset + length
        current[3].append((name, offset))
    if current:
        close_run()
    for name, nbytes in rows:
        offsets[name] = align_up(pos)
        pos = offsets[name] + nbytes
    return runs, offsets, align_up(pos)


def _batches(reads: list) -> list:
    """Reads (path, offset, bytes, read) in file order, as jobs of RUN_BYTES or more each: a job per
    small read would cost more in hand-offs between threads than the read (sliced experts' blocks
    are a few MB)."""
    jobs, batch, size = [], [], 0
    for *_, nbytes, read in reads:
        batch.append(read)
        size += nbytes
        if size >= RUN_BYTES:
            jobs.append(batch)
            batch, size = [], 0
    if batch:
        jobs.append(batch)
    return [functools.partial(_run_each, batch) for batch in jobs]


def _run_each(reads: list):
    for read in reads:
        read()


def _bounce(nbytes: int) -> memoryview:
    """This thread's page-aligned buffer for whole rows (a fresh one per tensor would cost a
    zero-filled page fault per page of it)."""
    buffer = getattr(_thread, "bounce", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _thread.bounce = mmap.mmap(-1, nbytes)
    return memoryview(buffer)


def _short(where: str, name: str, offset: int) -> OSError:
    return OSError(f"{where}: tensor {name!r}: short read at offset {offset}; the file was truncated")


class StagedFile(RankfsFile):
    def __init__(self, path: str, hook, placement: dict | None):
        super().__init__(path, hook, placement)
        self._demanded: set[int] = set()  # groups the loader waits for
        self._handed: list[set[str]] = [set() for _ in self.groups]  # per group: tensors handed out
        self._layouts = [self._lay_out(group) for group in self.groups]
        self._costs = [hook.slabs.footprint(size) for _, _, size in self._layouts]
        self.slabs_alive = 0
        self.handing_out = bool(self.groups)  # some tensor not yet handed out: it may be the loader's now
        self._lock = threading.Lock()
        hook.consuming.add(self)
        self._futures: list[Future | None] = [self._submit(g) for g in range(len(self.groups))]

    def resident(self, name: str, group: int, dtype: torch.dtype) -> torch.Tensor:
        if group not in self._demanded:
            self._demanded.add(group)
            self._hook.wake_readers()  # it may be the one that must go beyond the budget
        slab = (self._futures[group] or self._submit(group)).result()
        self._handed[group].add(name)
        if len(self._handed[group]) == len(self.groups[group]):  # the slab lives exactly as long as its tensors
            self._futures[group] = None
            if all(len(handed) == len(names) for handed, names in zip(self._handed, self.groups)):
                self._done_handing_out()
        self.count_loaded(self.span(name)[1])
        at = self._layouts[group][1][name]
        data = slab.tensor[at:at + self.resident_bytes(name)]
        if at % dtype.itemsize:  # a tensor not aligned to its type in the file (legal, rare)
            data = data.clone()
        return data.view(dtype).reshape(self.resident_shape(name))

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

    def _lay_out(self, group: list[str]):
        blocks, rows = [], []
        for name in group:
            begin = self.block(name)
            if begin is None:
                rows.append((name, self.resident_bytes(name)))
            else:
                blocks.append((name, self.locate(name)[0], begin, self.resident_bytes(name)))
        return lay_out(blocks, rows)

    def _submit(self, group: int) -> Future:
        """Read a group ahead: the loaders take files in sorted order, each file's groups in order."""
        return self._hook.executor.submit((self.path, group), self._load, group, cost=self._costs[group],
                                          urgent=lambda: self._must_exceed_budget(group))

    def _must_exceed_budget(self, group: int) -> bool:
        """The loader waits for this group of the file it consumes now, and files before it hold one
        slab at most: nothing else will free room (files after it, read ahead, wait for this one;
        the loader's loop keeps the last tensor it took, and its slab, until it gets the next)."""
        return (group in self._demanded and self._hook.consumed_now() is self
                and sum(f.slabs_alive for f in list(self._hook.holding) if f.path < self.path) <= 1)

    def _load(self, group: int) -> Slab:
        """Runs in a hook thread, its cost reserved: fill one slab, every free read thread helping."""
        runs, _, size = self._layouts[group]
        slab = self._hook.slabs.allocate(size, self.groups[group], self.path, on_death=self._slab_died)
        with self._lock:
            self.slabs_alive += 1
            self._hook.holding.add(self)
        buffer = memoryview(slab.tensor.numpy())
        reads = [(run.source.path, run.offset, run.length, functools.partial(self._read_run, run, buffer))
                 for run in runs]
        reads += [(*self._where(name), self.span(name)[1], functools.partial(self._read_rows, name, buffer))
                  for name in self.groups[group] if self.block(name) is None]
        self._hook.executor.run_all((self.path, group), _batches(sorted(reads, key=lambda r: r[:2])))
        self._hook.slabs.filled(slab)
        return slab

    def _where(self, name: str) -> tuple[str, int]:
        source, offset = self.locate(name)
        return source.path, offset

    def _slab_died(self):
        with self._lock:
            self.slabs_alive -= 1
            if not self.slabs_alive:
                self._hook.holding.discard(self)

    @staticmethod
    def _read_run(run: Run, buffer: memoryview):
        where = f"{run.source.path}: tensor {run.first!r}"
        done = run.source.read_into(buffer, run.at, run.offset, run.length, where)
        if done < run.length:
            raise _short(run.source.path, run.first, run.offset + done)

    def _read_rows(self, name: str, buffer: memoryview):
        """A slice spread over rows: whole rows through a bounded buffer, the rank's columns copied
        out (every page of the rows holds kept bytes)."""
        source, begin = self.locate(name)
        rows = self.rows(name)
        group = self._group_of[name]
        at = self._layouts[group][1][name]
        per_read = min(rows.count, max(1, BOUNCE_BYTES // rows.row_bytes))
        out = np.frombuffer(buffer[at:at + self.resident_bytes(name)], np.uint8).reshape(
            rows.count, rows.keep_stop - rows.keep_start)
        bounce = _bounce(align_up(per_read * rows.row_bytes) + 2 * PAGE)
        for first in range(0, rows.count, per_read):
            count = min(per_read, rows.count - first)
            offset = begin + first * rows.row_bytes
            skip = offset % PAGE
            if source.read_into(bounce, skip, offset, count * rows.row_bytes, f"{source.path}: tensor {name!r}") \
                    < count * rows.row_bytes:
                raise _short(source.path, name, offset)
            out[first:first + count] = np.frombuffer(bounce[skip:skip + count * rows.row_bytes], np.uint8).reshape(
                count, rows.row_bytes)[:, rows.keep_start:rows.keep_stop]
