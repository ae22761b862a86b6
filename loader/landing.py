"""Where a group's reads land: in a host slab in place, or in the read thread's bounce buffers,
uploaded a piece at a time to their place in a GPU slab (rankfs.loader.device_slabs). A landing's spots
are written before its next `place` or `flush`."""

from __future__ import annotations

from typing import NamedTuple

import torch

from rankfs.loader.bounce import PIECE_BYTES
from rankfs.loader.device_slabs import DeviceSlabs
from rankfs.loader.slabs import Slab
from rankfs.plan.spec import Rows


class Spot(NamedTuple):
    """Where bytes bound for slab[slab_at:slab_at + nbytes] are written: buffer[at:], `at`
    congruent to slab_at modulo PAGE (and so to their offset in the file, as direct reads need).
    For whole rows (`place_rows`), nbytes of rows, `at` congruent to their offset in the file."""
    buffer: memoryview
    at: int
    slab_at: int
    nbytes: int


class HostLanding:
    """Reads land in a host slab in place; it is page-locked once full, where the pool pins."""

    piece = None  # a run in one read
    picks_columns = False  # rows of slices are compacted before they land

    def __init__(self, slab: Slab, pool):
        self.slab, self.pool = slab, pool
        self.buffer = memoryview(slab.tensor.numpy())

    def place(self, at: int, nbytes: int) -> Spot:
        return Spot(self.buffer, at, at, nbytes)

    def flush(self):
        pass

    def filled(self):
        self.pool.filled(self.slab)


class DeviceLanding:
    """Reads land in the read thread's bounce buffers, a piece at most at a time, and are uploaded
    to their place in a GPU slab (rankfs.loader.device_slabs)."""

    piece = PIECE_BYTES
    picks_columns = True  # whole rows land in a bounce buffer; only the rank's columns go up

    def __init__(self, slab: Slab, device: DeviceSlabs):
        self.slab, self.device = slab, device
        self._sent: list[torch.cuda.Event] = []  # each job's uploads, from the thread that ran it

    def place(self, at: int, nbytes: int) -> Spot:
        buffer, position = self.device.bounce().place(self.slab.tensor, at, nbytes)
        return Spot(buffer, position, at, nbytes)

    def place_rows(self, at: int, rows: Rows, offset: int) -> Spot:
        """Where whole rows from `offset` in a source are written; their kept columns land at
        slab[at:]."""
        buffer, position = self.device.bounce().place_rows(self.slab.tensor, at, rows, offset)
        return Spot(buffer, position, at, rows.count * rows.row_bytes)

    def flush(self):
        sent = self.device.bounce().send()
        if sent is not None:
            self._sent.append(sent)

    def filled(self):
        for sent in self._sent:
            sent.synchronize()
