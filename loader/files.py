"""What `safe_open` returns, through the hook, for a file on a rankfs view: the safe_open interface
over the file's tensors, read where the mount says they lie in the source shards (so their bytes do
not pass through FUSE), or from the view file itself where it cannot say.

The file's tensors, in the loaders' order (sorted names), are packed into groups of a slab's size,
read ahead group by group; how is up to the subclass: `StagedFile` (slabs, for copies to a GPU) or
`MappedFile` (maps of the sources, for loads into host memory). Sliced experts are handed out as a
guarded full-shape stand-in holding only the slice; row-store tables are left to the stock reader.
"""

from __future__ import annotations

import json

import numpy as np
import torch

from rankfs.common import contract
from rankfs.loader.context import FileContext
from rankfs.loader.guard import SlicedTensor
from rankfs.plan.safetensors import read_header
from rankfs.plan.spec import Rows, Slice
from rankfs.common.disk import PAGE, OpenFile

TORCH_DTYPES = {
    "BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "U16": torch.uint16,
    "I32": torch.int32, "U32": torch.uint32, "I64": torch.int64, "U64": torch.uint64,
    "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", torch.uint8),
}


class RankfsFile:
    def __init__(self, path: str, context: FileContext, placement: dict | None):
        self.path = path
        self._files = context
        self._stock = None  # the stock reader over the view file, for row-store tables
        header = read_header(path, direct=True)
        self._data_start = header.data_start
        self._entries = header.tensors
        self._metadata = header.metadata
        meta = header.metadata or {}
        self._slices = {name: Slice(*s) for name, s in json.loads(meta.get(contract.SLICES_KEY, "{}")).items()}
        # Worked out once: planning and every hand-out ask (on the open threads, which share the GIL).
        self._rows = {name: slc.rows(self._entries[name].dtype, self._entries[name].shape)
                      for name, slc in self._slices.items() if name in self._entries}
        self._on_demand = set(json.loads(meta.get(contract.ON_DEMAND_KEY, "[]")))
        self._placement = placement  # {tensor: (source OpenFile, offset)}, or None: read the view file
        # The view itself only where something is read from it (its open is a FUSE round trip).
        from_view = placement is None or bool(self._on_demand)
        self._view = OpenFile(path, direct=False) if from_view else None
        # Bytes read from the sources bypass the mount: the daemon hears of them from the hook.
        self._progress = context.link.progress(path) if placement is not None else None
        eager = [n for n in sorted(self._entries) if n not in self._on_demand]
        # Two pages more per tensor: a slab places each tensor's bytes at their place within a page.
        self.groups = pack([(n, self.resident_bytes(n) + 2 * PAGE) for n in eager], context.slab_bytes)
        self._group_of = {name: g for g, group in enumerate(self.groups) for name in group}

    # -- the safe_open interface ----------------------------------------------------------------

    def keys(self):
        return sorted(self._entries)

    def metadata(self):
        return self._metadata

    def get_slice(self, name):
        return self._stock_read(name, "get_slice")

    def get_tensor(self, name: str) -> torch.Tensor:
        if name in self._on_demand:
            return self._row_store(name)
        if name not in self._group_of:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        entry = self._entries[name]
        dtype = TORCH_DTYPES[entry.dtype]
        resident = self.resident(name, self._group_of[name], dtype)
        slc = self._slices.get(name)
        if slc is None:
            return resident
        return SlicedTensor(name, entry.shape, dtype, slc.dim, slc.start, slc.stop, resident)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._progress is not None:
            self._progress.flush()
        if self._view is not None:
            self._view.close()

    # -- for the strategies ---------------------------------------------------------------------

    def resident(self, name: str, group: int, dtype: torch.dtype) -> torch.Tensor:
        """The tensor's bytes this rank keeps, shaped (the slice's shape for a sliced tensor)."""
        raise NotImplementedError

    def rows(self, name: str) -> Rows | None:
        """Where a sliced tensor's kept bytes lie in it; None for whole tensors."""
        return self._rows.get(name)

    def resident_shape(self, name: str) -> list[int]:
        shape = list(self._entries[name].shape)
        slc = self._slices.get(name)
        if slc is not None:
            shape[slc.dim] = slc.stop - slc.start
        return shape

    def resident_bytes(self, name: str) -> int:
        rows = self.rows(name)
        return self._entries[name].nbytes if rows is None else rows.kept_bytes

    def locate(self, name: str) -> tuple[OpenFile, int]:
        """(file, offset of the tensor's first byte): in its source shard when the mount says
        where, else in the view."""
        if self._placement is not None:
            return self._placement[name]
        return self._view, self._data_start + self._entries[name].begin

    def block(self, name: str) -> int | None:
        """Where the tensor's resident bytes start in their file, when they are one block (whole
        tensors, slices of one row); None for slices spread over rows."""
        begin = self.locate(name)[1]
        rows = self.rows(name)
        if rows is None:
            return begin
        return begin + rows.keep_start if rows.is_block else None

    def span(self, name: str) -> tuple[int, int]:
        """(offset, length) in its file of what is read for a tensor: its resident block, or its whole
        rows for a slice spread over rows (what the view serves for it, too)."""
        begin = self.block(name)
        if begin is None:
            return self.locate(name)[1], self._entries[name].nbytes
        return begin, self.resident_bytes(name)

    def count_loaded(self, nbytes: int):
        """Tell the daemon tensors are loaded, by the bytes the view serves for them (their spans)."""
        if self._progress is not None:
            self._progress.add(nbytes)

    def _row_store(self, name: str) -> torch.Tensor:
        """A row-store table, which the engine's row store reads rows of later, and a load only
        checks the shape of: a view of a map of its source, so that nothing is read until touched
        and only the pages touched (the map reads around nothing: the stock reader read megabytes
        around the table, other ranks' bytes among them). Through the view where the mount does
        not say where it lies."""
        if self._placement is None or name not in self._placement:
            return self._stock_read(name, "get_tensor")
        source, offset = self._placement[name]
        entry = self._entries[name]
        self._files.note_mapped(source.path, offset, entry.nbytes)
        array = np.frombuffer(self._files.source_map(source.path), np.uint8)[offset:offset + entry.nbytes]
        return torch.from_numpy(array).view(TORCH_DTYPES[entry.dtype]).reshape(entry.shape)

    def _stock_read(self, name: str, method: str):
        """What the hook leaves to the stock reader: the view file itself (its page cache is
        dropped at the release)."""
        if self._stock is None:
            self._stock = self._files.stock_open(self.path, framework="pt")
        return getattr(self._stock, method)(name)


def pack(sizes: list[tuple[str, int]], slab_bytes: int) -> list[list[str]]:
    """Names in the given order, greedily grouped into at most slab_bytes each (a larger one alone)."""
    groups: list[list[str]] = []
    used = 0
    for name, nbytes in sizes:
        if not groups or used + nbytes > slab_bytes:
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += nbytes
    return groups
