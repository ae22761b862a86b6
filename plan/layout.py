"""Planning: a checkpoint's headers and one rank's parallel layout in, the rank's views out.

A `RankLayout` is plain data: which virtual files each view holds, where each tensor lies in them,
which source bytes fill it, and which bytes are never read. It can be printed, compared and tested
without FUSE; the filesystem only serves it.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, NamedTuple

import numpy as np

from plan.checkpoint import Checkpoint, SourceFile
from plan.errors import LayoutError
from plan.profiles import BY_NAME, Profile, detect
from plan.safetensors import DTYPE_SIZES, TensorEntry, encode_header, writer_order

TP_SLICE_MODES = ("auto", "on", "off")
PLACEMENTS = ("sglang", "vllm")
FILL_BYTE = 0xFF  # outside a slice: NaN in every float dtype, so a misread is loud downstream too
SLICES_METADATA_KEY = "rankfs.slices"  # {name: [dim, start, stop]} of the sliced tensors
ON_DEMAND_METADATA_KEY = "rankfs.on_demand"  # [name, ...] of the row-store tensors


@dataclass(frozen=True)
class RankSpec:
    """One rank's parallel layout, with the engines' meaning of the flags."""

    tp_size: int = 1
    tp_rank: int = 0
    ep_size: int = 1
    tp_slice: str = "auto"
    placement: str = "sglang"
    n_experts: int | None = None  # overrides config.json

    def __post_init__(self):
        if self.tp_size < 1 or self.ep_size < 1:
            raise LayoutError("--tp-size and --ep-size must be at least 1")
        if not 0 <= self.tp_rank < self.tp_size:
            raise LayoutError(f"--tp-rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
        if self.tp_size % self.ep_size:
            raise LayoutError(f"--ep-size {self.ep_size} does not divide --tp-size {self.tp_size}")
        if self.tp_slice not in TP_SLICE_MODES:
            raise LayoutError(f"--tp-slice must be one of {', '.join(TP_SLICE_MODES)}")
        if self.placement not in PLACEMENTS:
            raise LayoutError(f"--placement must be one of {', '.join(PLACEMENTS)}")

    @property
    def moe_tp_size(self) -> int:
        return self.tp_size // self.ep_size

    @property
    def ep_rank(self) -> int:
        return self.tp_rank // self.moe_tp_size

    @property
    def moe_tp_rank(self) -> int:
        return self.tp_rank % self.moe_tp_size

    @property
    def slices_experts(self) -> bool:
        if self.moe_tp_size == 1 or self.tp_slice == "off":
            return False
        return self.tp_slice == "on" or self.ep_size == 1

    def owned_experts(self, n_experts: int) -> range:
        """The contiguous block of experts this rank's EP rank owns, as the engine places them."""
        if self.placement == "sglang":
            if n_experts % self.ep_size:
                raise LayoutError(f"{n_experts} routed experts are not divisible by --ep-size {self.ep_size}")
            per_rank = n_experts // self.ep_size
            return range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank)
        base, remainder = divmod(n_experts, self.ep_size)
        start = self.ep_rank * base + min(self.ep_rank, remainder)
        return range(start, start + base + (self.ep_rank < remainder))

    def describe(self) -> str:
        return (f"tp{self.tp_size}/ep{self.ep_size} rank {self.tp_rank} (ep rank {self.ep_rank}, "
                f"moe-tp rank {self.moe_tp_rank}/{self.moe_tp_size}, "
                f"experts {'sliced' if self.slices_experts else 'whole'})")


class Slice(NamedTuple):
    """The part of a tensor the rank keeps: [start, stop) along `dim`."""

    dim: int
    start: int
    stop: int


def kept_bytes(nbytes: int, shape, slc: Slice | None) -> int:
    return nbytes if slc is None else nbytes // shape[slc.dim] * (slc.stop - slc.start)


def read_bytes(nbytes: int, shape, slc: Slice | None, on_demand: bool) -> int:
    """Bytes read from disk to serve a tensor: a dim-0 slice is one block; any other slice needs
    whole rows, since every page of them holds kept bytes. On-demand tensors are not read ahead."""
    if on_demand:
        return 0
    return kept_bytes(nbytes, shape, slc) if slc is not None and slc.dim == 0 else nbytes


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

    def slice_geometry(self) -> tuple[int, int, int]:
        """(row_bytes, keep_start, keep_stop): the slice repeats in every row of row_bytes."""
        dim = self.slice.dim
        inner = DTYPE_SIZES[self.dtype] * math.prod(self.shape[dim + 1:])
        return inner * self.shape[dim], inner * self.slice.start, inner * self.slice.stop

    @property
    def kept_bytes(self) -> int:
        return kept_bytes(self.nbytes, self.shape, self.slice)

    @property
    def read_bytes(self) -> int:
        return read_bytes(self.nbytes, self.shape, self.slice, self.on_demand)


class Kept(NamedTuple):
    """A source tensor the view keeps, and how."""

    entry: TensorEntry
    slice: Slice | None
    on_demand: bool


class Extent(NamedTuple):
    """A run of a virtual file: header bytes, fill, or source bytes (optionally masked by rows)."""

    offset: int
    length: int
    kind: str  # "header" | "fill" | "data" | "shared" (a shard of the local ranks' shared view)
    source: int = -1
    source_offset: int = 0
    row_bytes: int = 0  # > 0: only bytes at (pos - offset) % row_bytes in [keep_start, keep_stop) are real
    keep_start: int = 0
    keep_stop: int = 0
    on_demand: bool = False
    tensor: str = ""  # first tensor in the run, for messages
    # (offset, consumption position) of each tensor starting in the run: a run merged from tensors
    # of different dtypes holds tensors the loaders read far apart
    marks: tuple[tuple[int, int], ...] = ()

    def order_of(self, offset: int, end: int) -> int:
        """When the loaders first need bytes [offset, end) of the run: the earliest consumption
        position of the tensors overlapping them."""
        first = max(0, bisect.bisect_right(self.marks, (offset, math.inf)) - 1)
        last = bisect.bisect_left(self.marks, (end, -1))
        return min((order for _, order in self.marks[first:max(last, first + 1)]), default=-1)

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class VirtualFile:
    """One virtual safetensors file of a view. Byte counts are known at once; the kept tensors, the
    header and the placements are built on first use, since planning every rank of a 100k-tensor
    checkpoint needs only the counts."""

    name: str
    source: int  # index into RankLayout.sources
    read_bytes: int
    kept_bytes: int
    on_demand_bytes: int
    tensor_count: int
    first_order: int  # consumption position of this file's first tensor within the view
    metadata: dict = field(repr=False)
    _shard: "_ShardTensors" = field(repr=False)
    _indices: object = field(repr=False)  # positions in _shard of the kept tensors
    _slice: object = field(repr=False)  # (parts, rank) when experts are sliced, else None

    @cached_property
    def kept(self) -> tuple[Kept, ...]:
        """The kept tensors in the writer's order (element size, then name)."""
        shard, out = self._shard, []
        for i in self._indices.tolist():
            entry, dim = shard.entries[i], int(shard.dim[i])
            slc = None
            if self._slice and dim >= 0:
                parts, rank = self._slice
                size = entry.shape[dim] // parts
                slc = Slice(dim, size * rank, size * (rank + 1))
            out.append(Kept(entry, slc, bool(shard.on_demand[i])))
        return tuple(out)

    @property
    def tensor_names(self) -> list[str]:
        entries = self._shard.entries
        return [entries[i].name for i in self._indices.tolist()]

    @property
    def data_bytes(self) -> int:
        return int(self._shard.nbytes[self._indices].sum())

    def _identity(self):
        return self.name, self.source, self.kept, self.metadata, self.first_order

    def __eq__(self, other):
        return isinstance(other, VirtualFile) and self._identity() == other._identity()

    __hash__ = None

    @cached_property
    def header(self) -> bytes:
        entries, offset = [], 0
        for entry, _, _ in self.kept:
            nbytes = entry.end - entry.begin
            entries.append((entry.name, entry.dtype, entry.shape, offset, offset + nbytes))
            offset += nbytes
        metadata = dict(self.metadata)
        slices = {k.entry.name: list(k.slice) for k in self.kept if k.slice}
        if slices:  # for the engine hook's guard, which refuses narrows outside these
            metadata[SLICES_METADATA_KEY] = json.dumps(slices, separators=(",", ":"))
        on_demand = [k.entry.name for k in self.kept if k.on_demand]
        if on_demand:  # the hook leaves these to the stock mmap path
            metadata[ON_DEMAND_METADATA_KEY] = json.dumps(on_demand, separators=(",", ":"))
        return encode_header(entries, metadata)

    @cached_property
    def tensors(self) -> tuple[VirtualTensor, ...]:
        out, offset = [], len(self.header)
        for entry, slc, on_demand in self.kept:
            nbytes = entry.end - entry.begin
            out.append(VirtualTensor(entry.name, entry.dtype, entry.shape, offset, nbytes, self.source,
                                     self._shard.data_start + entry.begin, slc, on_demand))
            offset += nbytes
        return tuple(out)

    @property
    def size(self) -> int:
        return len(self.header) + self.data_bytes

    def extents(self) -> list[Extent]:
        """The file's bytes from start to end, adjacent source runs merged."""
        order = {name: i for i, name in enumerate(sorted(t.name for t in self.tensors))}
        pieces = [e for t in self.tensors for e in _tensor_extents(t, self.first_order + order[t.name])
                  if e.length]
        return [Extent(0, len(self.header), "header")] + _merged(pieces)


def _tensor_extents(t: VirtualTensor, order: int) -> Iterator[Extent]:
    data = dict(kind="data", source=t.source, on_demand=t.on_demand, tensor=t.name)
    if t.slice is None:
        yield Extent(t.offset, t.nbytes, source_offset=t.source_offset, marks=((t.offset, order),), **data)
        return
    row_bytes, keep_start, keep_stop = t.slice_geometry()
    if t.slice.dim == 0:
        yield Extent(t.offset, keep_start, "fill", tensor=t.name)
        yield Extent(t.offset + keep_start, keep_stop - keep_start, source_offset=t.source_offset + keep_start,
                     marks=((t.offset + keep_start, order),), **data)
        yield Extent(t.offset + keep_stop, t.nbytes - keep_stop, "fill", tensor=t.name)
    else:
        yield Extent(t.offset, t.nbytes, source_offset=t.source_offset, row_bytes=row_bytes,
                     keep_start=keep_start, keep_stop=keep_stop, marks=((t.offset, order),), **data)


def _merged(extents: list[Extent]) -> list[Extent]:
    """Adjacent fill, and adjacent data that is adjacent in the same source too, as single runs."""
    runs: list[tuple[Extent, int, list]] = []  # (first, length so far, marks)
    for e in extents:
        if runs:
            first, length, marks = runs[-1]
            mergeable = (first.kind == e.kind == "data" and not first.row_bytes and not e.row_bytes
                         and first.source == e.source and first.on_demand == e.on_demand
                         and first.source_offset + length == e.source_offset)
            if (mergeable or first.kind == e.kind == "fill") and first.offset + length == e.offset:
                marks.extend(e.marks)
                runs[-1] = (first, length + e.length, marks)
                continue
        runs.append((e, e.length, list(e.marks)))
    return [first._replace(length=length, marks=tuple(marks)) for first, length, marks in runs]


@dataclass(frozen=True)
class View:
    """One virtual model directory: `target` (the rank's model) or `draft` (the mtp.* tensors)."""

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


def source_map(view: View, sources: tuple[SourceFile, ...]) -> bytes:
    """Where each tensor of the view's shards lies in the source files, as JSON: what the engine hook
    reads directly instead of through the mount. A tensor's bytes (its slice included) sit at the same
    place relative to its start in both files."""
    used = sorted({f.source for f in view.files})
    position = {index: i for i, index in enumerate(used)}
    body = {
        "sources": [{"path": str(sources[i].path), "size": sources[i].size, "mtime_ns": sources[i].mtime_ns,
                     "inode": sources[i].inode} for i in used],
        "files": {f.name: {t.name: [position[t.source], t.source_offset] for t in f.tensors}
                  for f in view.files},
    }
    return json.dumps(body).encode() + b"\n"


@dataclass(frozen=True)
class RankLayout:
    spec: RankSpec
    profile: str
    sources: tuple[SourceFile, ...]
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
    shards, groups = _classify(checkpoint, prof)
    sources = checkpoint.shard_sources + tuple(f for _, f in checkpoint.other_files)
    plain = tuple((name, len(checkpoint.shards) + i) for i, (name, _) in enumerate(checkpoint.other_files))
    layouts = []
    for spec in specs:
        first, last = _owned_experts(groups, checkpoint, spec, prof)
        views = []
        for view_name in ("target", "draft"):
            files, order = [], 0
            for source_index, shard in enumerate(shards):
                vfile = _virtual_file(shard, source_index, view_name == "draft", first, last, spec, prof,
                                      order)
                if vfile is not None:
                    files.append(vfile)
                    order += vfile.tensor_count
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


@dataclass(frozen=True, eq=False)
class _ShardTensors:
    """One shard's tensors in the writer's order, classified once, as arrays for per-rank selection."""

    name: str
    data_start: int
    metadata: dict
    entries: tuple[TensorEntry, ...]
    nbytes: np.ndarray
    group: np.ndarray  # expert group id, -1 for tensors that are not routed experts
    expert: np.ndarray
    dim: np.ndarray  # the dim the MoE TP size narrows, -1 for none
    extent: np.ndarray  # the size of that dim
    draft: np.ndarray
    on_demand: np.ndarray


@dataclass
class _Group:
    """A MoE block: its highest expert id + 1 in the headers, and whether it belongs to the draft."""

    seen: int = 0
    draft: bool = False


def _classify(checkpoint: Checkpoint, prof: Profile):
    groups: dict[str, int] = {}
    info: list[_Group] = []
    shards = []
    for shard in checkpoint.shards:
        entries = sorted(shard.tensors.values(), key=lambda e: writer_order(e.name, e.dtype))
        rows = []
        for entry in entries:
            expert = prof.expert(entry.name)
            draft = prof.is_draft(entry.name, checkpoint.config)
            group, dim, extent = -1, -1, 0
            if expert is not None:
                group = groups.setdefault(expert.group, len(groups))
                if group == len(info):
                    info.append(_Group())
                info[group].seen = max(info[group].seen, expert.expert + 1)
                info[group].draft |= draft
                dim = prof.narrow_dims.get(expert.projection, -1)
                if dim >= len(entry.shape):
                    dim = -1
                extent = entry.shape[dim] if dim >= 0 else 0
            rows.append((entry.end - entry.begin, group, expert.expert if expert else -1, dim, extent,
                         draft, prof.is_on_demand(entry.name)))
        columns = list(zip(*rows)) if rows else [()] * 7
        dtypes = (np.int64, np.int32, np.int32, np.int8, np.int64, bool, bool)
        arrays = [np.array(c, dtype=t) for c, t in zip(columns, dtypes)]
        shards.append(_ShardTensors(shard.path.name, shard.data_start, shard.metadata or {},
                                    tuple(entries), *arrays))
    return shards, (list(groups), info)


def _owned_experts(groups, checkpoint: Checkpoint, spec: RankSpec, prof: Profile):
    """Per expert group id, [first, last) of the experts this rank loads.

    Target groups use config.json's count (or --n-experts), as the engine does; draft groups (whose
    stages may have fewer experts) use the count their headers show.
    """
    names, info = groups
    configured = spec.n_experts or prof.expert_count(checkpoint.config)
    first, last = np.zeros(len(names) + 1, np.int32), np.zeros(len(names) + 1, np.int32)
    for gid, (name, group) in enumerate(zip(names, info)):
        n = group.seen if group.draft or configured is None else configured
        if group.seen > n:
            raise LayoutError(f"{name} has expert {group.seen - 1}, but the model has {n} routed "
                              "experts (config.json or --n-experts)")
        owned = spec.owned_experts(n)
        first[gid], last[gid] = owned.start, owned.stop
    return first, last


def _virtual_file(shard: _ShardTensors, source_index: int, draft_view: bool, first, last,
                  spec: RankSpec, prof: Profile, first_order: int) -> VirtualFile | None:
    # group -1 indexes the spare last slot of first/last; non-experts pass the ownership test below.
    is_expert = shard.group >= 0
    owned = ~is_expert | ((shard.expert >= first[shard.group]) & (shard.expert < last[shard.group]))
    keep = (shard.draft == draft_view) & owned
    indices = np.flatnonzero(keep)
    if not len(indices):
        return None
    nbytes, dim, on_demand = shard.nbytes[indices], shard.dim[indices], shard.on_demand[indices]
    slicing = (spec.moe_tp_size, spec.moe_tp_rank) if spec.slices_experts else None
    sliced = (dim >= 0) if slicing else np.zeros(len(indices), bool)
    if sliced.any():
        bad = sliced & (shard.extent[indices] % spec.moe_tp_size != 0)
        if bad.any():
            entry = shard.entries[indices[np.argmax(bad)]]
            d = int(dim[np.argmax(bad)])
            raise LayoutError(f"tensor {entry.name!r}: dim {d} of size {entry.shape[d]} is not divisible "
                              f"by the MoE TP size {spec.moe_tp_size} (use --tp-slice off)")
    kept = np.where(sliced, nbytes // spec.moe_tp_size, nbytes)
    read = np.where(on_demand, 0, np.where(sliced & (dim == 0), kept, nbytes))
    metadata = dict(shard.metadata)
    metadata["rankfs.view"] = f"{'draft' if draft_view else 'target'} {spec.describe()} profile {prof.name}"
    return VirtualFile(shard.name, source_index, int(read.sum()), int(kept[~on_demand].sum()),
                       int(nbytes[on_demand].sum()), len(indices), first_order, metadata, shard, indices,
                       slicing)
