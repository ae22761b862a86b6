"""Planning: a checkpoint's headers and one rank's parallel layout in, the rank's views out.

A `RankLayout` is plain data: which virtual files each view holds, where each tensor lies in them,
which source bytes fill it, and which bytes are never read. It can be printed, compared and tested
without FUSE; the filesystem only serves it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

from rankfs.common import contract
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.errors import LayoutError
from rankfs.plan.extents import Extent, merged, tensor_extents
from rankfs.plan.profiles import BY_NAME, Profile, detect
from rankfs.plan.safetensors import TensorEntry, encode_header
from rankfs.plan.selection import Selection, ShardTensors, classify, owned_experts, select
from rankfs.plan.spec import RankSpec, Slice

FILL_BYTE = 0xFF  # outside a slice: NaN in every float dtype, so a misread is loud downstream too


class VirtualTensor(NamedTuple):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # in the virtual file
    nbytes: int
    source: int  # index into RankLayout.sources
    source_offset: int  # in the source file
    slice: Slice | None = None
    on_demand: bool = False


class Kept(NamedTuple):
    """A source tensor the view keeps, and how."""

    entry: TensorEntry
    slice: Slice | None
    on_demand: bool


@dataclass(frozen=True, eq=False)
class VirtualFile:
    """One virtual safetensors file of a view. Byte counts are known at once; the kept tensors, the
    header and the placements are built on first use, since planning every rank of a 100k-tensor
    checkpoint needs only the counts."""

    name: str
    source: int  # index into RankLayout.sources
    first_order: int  # consumption position of this file's first tensor within the view
    metadata: dict = field(repr=False)
    _shard: ShardTensors = field(repr=False)
    _selection: Selection = field(repr=False)
    _spec: RankSpec = field(repr=False)

    @property
    def read_bytes(self) -> int:
        return self._selection.read_bytes

    @property
    def kept_bytes(self) -> int:
        return self._selection.kept_bytes

    @property
    def on_demand_bytes(self) -> int:
        return self._selection.on_demand_bytes

    @property
    def tensor_count(self) -> int:
        return len(self._selection.indices)

    @cached_property
    def kept(self) -> tuple[Kept, ...]:
        """The kept tensors in the writer's order (element size, then name)."""
        shard = self._shard
        return tuple(Kept(shard.entries[i],
                          self._spec.expert_slice(shard.entries[i].shape, int(shard.dim[i])) if sliced else None,
                          bool(shard.on_demand[i]))
                     for i, sliced in zip(self._selection.indices.tolist(), self._selection.sliced.tolist()))

    @property
    def tensor_names(self) -> list[str]:
        entries = self._shard.entries
        return [entries[i].name for i in self._selection.indices.tolist()]

    @property
    def data_bytes(self) -> int:
        return int(self._shard.nbytes[self._selection.indices].sum())

    def _identity(self):
        return self.name, self.source, self.kept, self.metadata, self.first_order

    def __eq__(self, other):
        return isinstance(other, VirtualFile) and self._identity() == other._identity()

    __hash__ = None

    @cached_property
    def header(self) -> bytes:
        entries, offset = [], 0
        for entry, _, _ in self.kept:
            entries.append((entry.name, entry.dtype, entry.shape, offset, offset + entry.nbytes))
            offset += entry.nbytes
        metadata = dict(self.metadata)
        slices = {k.entry.name: list(k.slice) for k in self.kept if k.slice}
        if slices:  # for the engine hook's guard, which refuses narrows outside these
            metadata[contract.SLICES_KEY] = json.dumps(slices, separators=(",", ":"))
        on_demand = [k.entry.name for k in self.kept if k.on_demand]
        if on_demand:  # the hook leaves these to the stock mmap path
            metadata[contract.ON_DEMAND_KEY] = json.dumps(on_demand, separators=(",", ":"))
        return encode_header(entries, metadata)

    @cached_property
    def tensors(self) -> tuple[VirtualTensor, ...]:
        out, offset = [], len(self.header)
        for entry, slc, on_demand in self.kept:
            out.append(VirtualTensor(entry.name, entry.dtype, entry.shape, offset, entry.nbytes, self.source,
                                     self._shard.data_start + entry.begin, slc, on_demand))
            offset += entry.nbytes
        return tuple(out)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes

    def source_reads(self) -> list[tuple[int, int]]:
        """[begin, end) in its source of what a reader of the sources takes for each tensor, in file
        order, row-store tables left out: a whole tensor, a slice's block, or the whole rows of a
        slice spread over them."""
        spans = []
        for t in self.tensors:
            if t.on_demand:
                continue
            begin, length = t.source_offset, t.nbytes
            rows = t.slice.rows(t.dtype, t.shape) if t.slice is not None else None
            if rows is not None and rows.is_block:
                begin, length = begin + rows.keep_start, rows.kept_bytes
            spans.append((begin, begin + length))
        return spans

    def extents(self) -> list[Extent]:
        """The file's bytes from start to end, adjacent source runs merged."""
        order = {name: i for i, name in enumerate(sorted(t.name for t in self.tensors))}
        pieces = [e for t in self.tensors for e in tensor_extents(t, self.first_order + order[t.name])
                  if e.length]
        return [Extent(0, len(self.header), "header")] + merged(pieces)


@dataclass(frozen=True)
class View:
    """One virtual model directory: `target` (the rank's model) or `draft` (the draft tensors)."""

    name: str
    files: tuple[VirtualFile, ...]
    plain_files: tuple[tuple[str, int], ...]  # (name, source index): config.json, tokenizer, ...

    @property
    def index(self) -> bytes:
        return index_json([self])

    def summary(self) -> dict:
        return {
            "view": self.name,
            "files": len(self.files),
            "tensors": sum(f.tensor_count for f in self.files),
            "read_bytes": sum(f.read_bytes for f in self.files),
            "kept_bytes": sum(f.kept_bytes for f in self.files),
            "on_demand_bytes": sum(f.on_demand_bytes for f in self.files),
            # What the rank keeps from its largest file: the window a loader holds per open file.
            "largest_file_bytes": max((f.kept_bytes for f in self.files), default=0),
        }


def index_json(views: list[View]) -> bytes:
    """model.safetensors.index.json for one view, or for the union of several ranks' views (the
    engines take only the file names from it, and SGLang probes one expert's dtype)."""
    weight_map = {name: f.name for view in views for f in view.files for name in f.tensor_names}
    total = max(sum(f.data_bytes for f in view.files) for view in views)
    body = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(body).encode() + b"\n"  # no indent: the C encoder, 5x faster at 100k


def sources_json(view: View, sources: tuple[contract.Source, ...],
                 shared: dict[int, list[tuple[int, int]]] | None = None) -> bytes:
    """The view's sources map (see rankfs.common.contract): what the engine hook reads directly;
    `shared`: {source: pages}, the pages other local ranks read too."""
    used = sorted({f.source for f in view.files})
    position = {index: i for i, index in enumerate(used)}
    return contract.encode_sources(
        [sources[i] for i in used],
        {f.name: {t.name: (position[t.source], t.source_offset) for t in f.tensors} for f in view.files},
        {position[i]: runs for i, runs in (shared or {}).items() if i in position})


@dataclass(frozen=True)
class RankLayout:
    spec: RankSpec
    profile: str
    sources: tuple[contract.Source, ...]
    views: tuple[View, ...]
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def view(self, name: str) -> View:
        return next(v for v in self.views if v.name == name)

    def summary(self) -> list[dict]:
        return [{"rank": self.spec.tp_rank, **v.summary()} for v in self.views]


def plan_rank(checkpoint: Checkpoint, spec: RankSpec, profile: str | None = None) -> RankLayout:
    """The rank's views of the checkpoint. Pure: reads nothing beyond the parsed checkpoint."""
    return plan_ranks(checkpoint, [spec], profile)[0]


def plan_ranks(checkpoint: Checkpoint, specs, profile: str | None = None) -> list[RankLayout]:
    """Layouts for several ranks; the tensors are classified once for all of them."""
    prof = _choose_profile(checkpoint, profile)
    warnings = () if prof.name != "generic" else (
        "no model profile matches config.json; serving every tensor whole (see --profile)",)
    classified = classify(checkpoint, prof)
    sources = checkpoint.shard_sources + tuple(f for _, f in checkpoint.other_files)
    plain = tuple((name, len(checkpoint.shards) + i) for i, (name, _) in enumerate(checkpoint.other_files))
    layouts = []
    for spec in specs:
        owned = owned_experts(classified, checkpoint, spec, prof)
        views = []
        for view_name in ("target", "draft"):
            files, order = [], 0
            for source_index, shard in enumerate(classified.shards):
                selection = select(shard, view_name == "draft", owned, spec)
                if selection is None:
                    continue
                metadata = {**shard.metadata, contract.VIEW_KEY: f"{view_name} {spec.describe()} profile {prof.name}"}
                files.append(VirtualFile(shard.name, source_index, order, metadata, shard, selection, spec))
                order += len(selection.indices)
            if files or view_name == "target":
                views.append(View(view_name, tuple(files), plain))
        layouts.append(RankLayout(spec, prof.name, sources, tuple(views), warnings))
    return layouts


def _choose_profile(checkpoint: Checkpoint, name: str | None) -> Profile:
    if name is None:
        return detect(checkpoint.config)
    if name not in BY_NAME:
        raise LayoutError(f"unknown profile {name!r}; known: {', '.join(BY_NAME)}")
    return BY_NAME[name]
