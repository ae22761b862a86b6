"""Tensors staged in slabs (for copies to a GPU: DMA from page-locked memory). Each group of a
file's tensors fills one slab, read ahead by the hook's threads in the loaders' order as the budget
has room, every free thread helping with the group the loader needs first; `get_tensor` waits for
its group and returns a view into the slab.

A group the loader waits for in the file it consumes now (the first open file, in name order, with
tensors not yet handed out) is read whatever the budget: that file's tensors are what frees the
budget once the loader has copied them. Other files' groups wait for room, so the pinned memory
stays within the budget plus what that one file needs beyond it."""

from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import Future

import numpy as np
import torch

from rankfs.loader.files import RankfsFile
from rankfs.loader.slabs import Slab, pack
from rankfs.reader.io import merge_adjacent, read_exactly

BOUNCE_BYTES = 8 << 20
IOV_MAX = 1024
RUN_BYTES = 16 << 20

_thread = threading.local()


def _bounce(nbytes: int) -> bytearray:
    """This thread's buffer for whole rows: a fresh one per tensor costs a zero-filled page fault
    per 4 KiB of it."""
    buffer = getattr(_thread, "bounce", None)
    if buffer is None or len(buffer) < nbytes:
        buffer = _thread.bounce = bytearray(nbytes)
    return buffer


def _read_fully(fd: int, target: memoryview, offset: int, where: str, name: str):
    if read_exactly(fd, target, offset, f"{where}: tensor {name!r}") < len(target):
        raise OSError(f"{where}: tensor {name!r}: short read at offset {offset}; the file was truncated")


def _runs(blocks: list):
    """Blocks (fd, offset, target, where, name), sorted by fd and offset, in runs adjacent in the
    file: at most IOV_MAX blocks and about RUN_BYTES each, for one preadv."""
    run: list = []
    for block in blocks:
        fd, offset = block[0], block[1]
        if run and (run[-1][0] != fd or run[-1][1] + len(run[-1][2]) != offset
                    or len(run) == IOV_MAX or offset - run[0][1] >= RUN_BYTES):
            yield run
            run = []
        run.append(block)
    if run:
        yield run


def _read_run(run: list):
    fd, offset = run[0][0], run[0][1]
    try:
        done = os.preadv(fd, [block[2] for block in run], offset)
    except OSError as exc:
        raise OSError(exc.errno, f"{run[0][3]}: tensor {run[0][4]!r}: read at offset {offset} failed: "
                                 f"{exc.strerror}") from None
    for _, begin, target, where, name in run:  # what a short read left, block by block
        if done >= len(target):
            done -= len(target)
            continue
        _read_fully(fd, target[done:], begin + done, where, name)
        done = 0


class StagedFile(RankfsFile):
    def __init__(self, path: str, hook, placement: dict | None):
        super().__init__(path, hook, placement)
        self._demanded: set[int] = set()  # groups the loader waits for
        self._handed: list[set[str]] = [set() for _ in self.groups]  # per group: tensors handed out
        self._offsets = [dict(pack([(n, self.resident_bytes(n)) for n in group], 1 << 62)[0]) for group in self.groups]
        self._sizes = [offsets[group[-1]] + self.resident_bytes(group[-1])
                       for offsets, group in zip(self._offsets, self.groups)]
        self._costs = [hook.slabs.footprint(size) for size in self._sizes]
        self.handing_out = bool(self.groups)  # some tensor not yet handed out: it may be the loader's now
        self._lock = threading.Lock()
        self._read_spans: list[tuple[int, int, int]] = []  # (offset, length, fd) read, not yet dropped
        self._groups_read: set[int] = set()
        hook.consuming.add(self)
        self._futures: list[Future | None] = [self._submit(g) for g in range(len(self.groups))]

    def resident(self, name: str, group: int, dtype: torch.dtype) -> torch.Tensor:
        if group not in self._demanded:
            self._demanded.add(group)
            self._hook.wake_readers()  # its read may now go ahead whatever the budget
        slab, offsets = (self._futures[group] or self._submit(group)).result()
        self._handed[group].add(name)
        if len(self._handed[group]) == len(self.groups[group]):  # the slab lives exactly as long as its tensors
            self._futures[group] = None
            if all(len(handed) == len(names) for handed, names in zip(self._handed, self.groups)):
                self._done_handing_out()
        self.count_loaded(self.span(name)[1])
        data = slab.tensor[offsets[name]:offsets[name] + self.resident_bytes(name)]
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

    def _submit(self, group: int) -> Future:
        """Read a group ahead: the loaders take files in sorted order, each file's groups in order."""
        return self._hook.executor.submit((self.path, group), self._load, group, cost=self._costs[group],
                                          urgent=lambda: group in self._demanded and self._hook.consumed_now() is self)

    def _load(self, group: int) -> tuple[Slab, dict[str, int]]:
        """Runs in a hook thread, its size reserved: fill one slab. Tensors whose bytes are adjacent
        in the file are read together, in file order, with one scattering preadv each run. Returns
        the slab and each tensor's offset in it."""
        names, offsets = self.groups[group], self._offsets[group]
        slab = self._hook.slabs.allocate(self._sizes[group], names, self.path)
        blocks = []  # (fd, file offset, slab target, file name, tensor): contiguous pieces to read
        reads = []  # (fd, file offset, read): what fills the slab, each read by one thread
        for name in names:
            fd, _, where = self.locate(name)
            target = slab.target(offsets[name], self.resident_bytes(name))
            begin = self.block(name)
            if begin is None:
                reads.append((fd, self.locate(name)[1], functools.partial(self._read_rows, name, target)))
            else:
                blocks.append((fd, begin, target, where, name))
        blocks.sort(key=lambda b: (b[0], b[1]))
        reads.extend((run[0][0], run[0][1], functools.partial(_read_run, run)) for run in _runs(blocks))
        # Every free read thread helps: the group the loader needs first is filled first.
        self._hook.executor.run_all((self.path, group), [read for _, _, read in sorted(reads, key=lambda r: r[:2])])
        self._hook.slabs.filled(slab)
        self._read_done(group, [self.span(name) + (self.locate(name)[0],) for name in names])
        return slab, offsets

    def _read_done(self, group: int, spans: list[tuple[int, int, int]]):
        """A group's (offset, length, fd) spans are read. Once the file's last group is, its pages
        leave the page cache (they are not needed twice: keep them out of MemAvailable's way), in
        one call per run of adjacent spans: dropping ranges as each group was read, beside reads of
        their neighbours, cost each call a drain of every CPU's page lists. Only what was read:
        between the spans lie other ranks' tensors, which a rank beside this one may be reading."""
        with self._lock:
            self._read_spans.extend(spans)
            self._groups_read.add(group)
            if len(self._groups_read) < len(self.groups):
                return
            spans, self._read_spans = self._read_spans, []
        for fd, begin, end in merge_adjacent((fd, offset, offset + length) for offset, length, fd in spans):
            os.posix_fadvise(fd, begin, end - begin, os.POSIX_FADV_DONTNEED)

    def _read_rows(self, name: str, target: memoryview):
        """A slice spread over rows: whole rows through a bounded buffer, the rank's columns copied
        out (every page of the rows holds kept bytes)."""
        fd, begin, where = self.locate(name)
        rows = self.rows(name)
        per_read = min(rows.count, max(1, BOUNCE_BYTES // rows.row_bytes))
        out = np.frombuffer(target, np.uint8).reshape(rows.count, rows.keep_stop - rows.keep_start)
        bounce = _bounce(per_read * rows.row_bytes)
        for first in range(0, rows.count, per_read):
            count = min(per_read, rows.count - first)
            chunk = memoryview(bounce)[:count * rows.row_bytes]
            _read_fully(fd, chunk, begin + first * rows.row_bytes, where, name)
            out[first:first + count] = np.frombuffer(chunk, np.uint8).reshape(count, rows.row_bytes)[
                :, rows.keep_start:rows.keep_stop]
