"""A read thread's uploads to GPU slabs: its two bounce buffers, reads landing in one while the
other uploads, across jobs too (a job's last upload is waited for by its group, not by the thread).
Reads that come next to each other in a slab share an upload while they fit: each upload takes the
GIL a few times, which the loader's loop waits for. Whole rows of a slice read from the disk land
as they are and only the rank's columns go up, by one pitched copy (the page cache's rows have
their columns picked on the CPU, out of maps: rankfs.loader.jobs).

How the bytes go up is a `Transfer`: `CudaTransfer`, a stream of the thread's own and the runtime's
pitched copies. The bookkeeping around it is the same whatever the transfer (the tests run it with
host memory for the GPU's)."""

from __future__ import annotations

from typing import Protocol

import torch

from rankfs.common.disk import PAGE, align_down, align_up
from rankfs.loader import cuda
from rankfs.loader.bounce import BounceBuffers
from rankfs.loader.slabs import HostBuffer
from rankfs.plan.spec import Rows


class Upload:
    """Bytes in a bounce buffer bound for a slab: `height` rows of `width` bytes, `pitch` apart from
    `position` in the buffer, landing packed at target[at:]. A run of bytes is one row, as wide as
    the bytes joined into it."""
    __slots__ = ("position", "at", "width", "height", "row_bytes")

    def __init__(self, position: int, at: int, width: int, height: int = 1, row_bytes: int | None = None):
        self.position, self.at, self.width, self.height, self.row_bytes = position, at, width, height, row_bytes

    @property
    def pitch(self) -> int:
        return self.row_bytes or self.width

    @property
    def end(self) -> int:
        """Where the bytes it uploads end in its target."""
        return self.at + self.width * self.height


class Transfer(Protocol):
    """How a read thread's uploads reach a GPU slab (made on that thread)."""

    def copy(self, index: int, uploads: list[Upload], source: torch.Tensor, target: torch.Tensor):
        """Queue the uploads from bounce buffer `index` (viewed by `source`) to `target`."""

    def wait(self, index: int):
        """Until bounce buffer `index`'s last uploads are done (it is written again next)."""

    def mark(self) -> torch.cuda.Event | None:
        """An event that completes with every upload queued so far (None: they are done)."""


class CudaTransfer:
    """A stream of the read thread's own, made its current one (no stream context per upload:
    fewer calls that take the GIL), each bounce buffer's last upload as an event, and the runtime's
    pitched copy."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        torch.cuda.set_stream(self.stream)
        self._done = [torch.cuda.Event(), torch.cuda.Event()]  # waiting on one never recorded returns at once

    def copy(self, index: int, uploads: list[Upload], source: torch.Tensor, target: torch.Tensor):
        # Asked once per buffer, not per upload: each is a call that holds the GIL.
        copy, stream = cuda.memcpy_2d_async(), self.stream.cuda_stream
        target_at, source_at = target.data_ptr(), source.data_ptr()
        for upload in uploads:
            error = copy(target_at + upload.at, upload.width, source_at + upload.position, upload.pitch,
                         upload.width, upload.height, cuda.HOST_TO_DEVICE, stream)
            if error:
                raise RuntimeError(f"rankfs hook: an upload to {target.device} failed (CUDA error {error})")
        self._done[index].record(self.stream)

    def wait(self, index: int):
        self._done[index].synchronize()

    def mark(self) -> torch.cuda.Event:
        sent = torch.cuda.Event()
        sent.record(self.stream)
        return sent


class Bounce:
    """A read thread's two bounce buffers and its transfer."""

    def __init__(self, transfer: Transfer, buffers: BounceBuffers):
        """Made on the read thread it serves."""
        self.supply = buffers  # where its buffers come from
        self.transfer = transfer
        self.buffers: list[HostBuffer | None] = [None, None]
        self.tensors: list[torch.Tensor | None] = [None, None]  # uint8 views of the buffers, to copy from
        self.turn = 0
        self._index: int | None = None  # the buffer being filled
        self._target: torch.Tensor | None = None  # the slab it is bound for
        self._pending: list[Upload] = []  # what it holds, in the order placed
        self._used = 0  # its bytes from 0 that the pending uploads' reads may write

    def place(self, target: torch.Tensor, at: int, nbytes: int) -> tuple[memoryview, int]:
        """Where bytes bound for target[at:at + nbytes] are written: (buffer, position), the
        position congruent to `at` modulo PAGE, with room for the whole pages around them (a
        direct read fills those). They join the bytes placed last where nothing else of the slab
        lies between: a slab gives every read its own pages (rankfs.loader.packing)."""
        last = self._pending[-1] if self._pending and self._target is target else None
        if last is not None and last.height == 1 and last.end <= at and align_down(at) <= align_up(last.end):
            position = last.position + at - last.at
            if align_up(position + nbytes) <= len(self.buffers[self._index]):
                last.width = at + nbytes - last.at
                self._used = align_up(position + nbytes)
                return memoryview(self.buffers[self._index].map), position
        position = self._reserve(target, at % PAGE, nbytes)
        self._pending.append(Upload(position, at, nbytes))
        return memoryview(self.buffers[self._index].map), position

    def place_rows(self, target: torch.Tensor, at: int, rows: Rows, offset: int) -> tuple[memoryview, int]:
        """Where `rows.count` whole rows from `offset` in a source are written (congruent to it
        modulo PAGE, as a direct read needs): (buffer, position). Their kept columns land packed at
        target[at:]."""
        position = self._reserve(target, offset % PAGE, rows.count * rows.row_bytes)
        self._pending.append(Upload(position + rows.keep_start, at, rows.keep_stop - rows.keep_start,
                                    rows.count, rows.row_bytes))
        return memoryview(self.buffers[self._index].map), position

    def _reserve(self, target: torch.Tensor, in_page: int, nbytes: int) -> int:
        """A position in the buffer being filled, `in_page` into a page of its own, for nbytes:
        after what it holds, or in the next buffer once this one is full (or bound elsewhere)."""
        position = self._used + in_page
        if (self._index is None or self._target is not target
                or align_up(position + nbytes) > len(self.buffers[self._index])):
            self._upload()
            self._index, self._target = self._take(align_up(in_page + nbytes)), target
            position = in_page
        self._used = align_up(position + nbytes)
        return position

    def send(self) -> torch.cuda.Event | None:
        """Upload what waits; returns an event that completes with every upload queued so far
        (None where the transfer made them at once)."""
        self._upload()
        return self.transfer.mark()

    def _take(self, nbytes: int) -> int:
        """The next buffer, of nbytes at least, once its last upload is done."""
        i, self.turn = self.turn, 1 - self.turn
        self.transfer.wait(i)
        if self.buffers[i] is None or len(self.buffers[i]) < nbytes:  # a row of a slice larger than a piece
            self._close(i)
            self.buffers[i] = self.supply.take(nbytes)
            self.tensors[i] = torch.frombuffer(self.buffers[i].map, dtype=torch.uint8)
        return i

    def _upload(self):
        index, target, pending = self._index, self._target, self._pending
        self._index, self._target, self._pending, self._used = None, None, [], 0
        if pending:
            self.transfer.copy(index, pending, self.tensors[index], target)

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.buffers if b is not None)

    def _close(self, i: int):
        self.tensors[i] = None  # the map cannot close while a tensor views it
        if self.buffers[i] is not None:
            self.buffers[i].close()
            self.buffers[i] = None

    def close(self):
        """Upload what waits, wait for every upload, and let the buffers go."""
        sent = self.send()
        if sent is not None:
            sent.synchronize()
        self._close(0)
        self._close(1)
