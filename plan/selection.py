"""Which tensors a rank's view keeps: every tensor is classified once (routed expert or not, the
dim FusedMoE narrows, draft or target, on demand), as arrays, so that selecting the view of each rank
of a 100k-tensor checkpoint is a few array operations."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.errors import LayoutError
from rankfs.plan.profiles import Profile
from rankfs.plan.safetensors import TensorEntry, writer_order
from rankfs.plan.spec import RankSpec


@dataclass(frozen=True, eq=False)
class ShardTensors:
    """One shard's tensors in the writer's order, classified."""

    name: str
    data_start: int
    metadata: dict
    entries: tuple[TensorEntry, ...]
    nbytes: np.ndarray
    group: np.ndarray  # expert group id, -1 for tensors that are not routed experts
    expert: np.ndarray
    dim: np.ndarray  # the dim the MoE TP size narrows, -1 for none
    extent: np.ndarray  # the size of that dim
    rows: np.ndarray  # rows of that dim (the product of the dims before it): 1 means a slice is one block
    draft: np.ndarray
    on_demand: np.ndarray


@dataclass
class _Group:
    """A MoE block: its highest expert id + 1 in the headers, and whether it belongs to the draft."""

    seen: int = 0
    draft: bool = False


@dataclass(frozen=True)
class Classified:
    shards: list[ShardTensors]
    group_names: list[str]
    groups: list[_Group]


def classify(checkpoint: Checkpoint, prof: Profile) -> Classified:
    group_ids: dict[str, int] = {}
    groups: list[_Group] = []
    shards = []
    for shard, file_name in zip(checkpoint.shards, checkpoint.shard_names):
        entries = sorted(shard.tensors.values(), key=lambda e: writer_order(e.name, e.dtype))
        table = []
        for entry in entries:
            expert = prof.expert(entry.name)
            draft = prof.is_draft(entry.name, checkpoint.config)
            group, dim, extent, rows_of_dim = -1, -1, 0, 1
            if expert is not None:
                group = group_ids.setdefault(expert.group, len(group_ids))
                if group == len(groups):
                    groups.append(_Group())
                groups[group].seen = max(groups[group].seen, expert.expert + 1)
                groups[group].draft |= draft
                dim = prof.narrow_dims.get(expert.projection, -1)
                if dim >= len(entry.shape):
                    dim = -1
                if dim >= 0:
                    extent, rows_of_dim = entry.shape[dim], math.prod(entry.shape[:dim])
            table.append((entry.nbytes, group, expert.expert if expert else -1, dim, extent, rows_of_dim,
                         draft, prof.is_on_demand(entry.name)))
        columns = list(zip(*table)) if table else [()] * 8
        dtypes = (np.int64, np.int32, np.int32, np.int8, np.int64, np.int64, bool, bool)
        arrays = [np.array(c, dtype=t) for c, t in zip(columns, dtypes)]
        shards.append(ShardTensors(file_name, shard.data_start, shard.metadata or {},
                                   tuple(entries), *arrays))
    return Classified(shards, list(group_ids), groups)


def owned_experts(classified: Classified, checkpoint: Checkpoint, spec: RankSpec, prof: Profile):
    """Per expert group id, [first, last) of the experts this rank loads (one spare last slot, so
    that group -1 indexes something). Target groups use config.json's count (or --n-experts), as
    the engine does; draft groups (whose stages may have fewer experts) the count their headers show."""
    configured = spec.n_experts or prof.expert_count(checkpoint.config)
    count = len(classified.groups)
    first, last = np.zeros(count + 1, np.int32), np.zeros(count + 1, np.int32)
    for gid, (name, group) in enumerate(zip(classified.group_names, classified.groups)):
        n = group.seen if group.draft or configured is None else configured
        if group.seen > n:
            raise LayoutError(f"{name} has expert {group.seen - 1}, but the model has {n} routed "
                              "experts (config.json or --n-experts)")
        owned = spec.owned_experts(n)
        first[gid], last[gid] = owned.start, owned.stop
    return first, last


@dataclass(frozen=True)
class Selection:
    """The tensors one view keeps of one shard, with its byte counts."""

    indices: np.ndarray  # positions in the shard's entries
    sliced: np.ndarray  # per kept tensor: cut to the rank's MoE TP slice
    read_bytes: int
    kept_bytes: int
    on_demand_bytes: int


def select(shard: ShardTensors, draft_view: bool, owned, spec: RankSpec) -> Selection | None:
    """What a view keeps of a shard; None when nothing."""
    first, last = owned
    is_expert = shard.group >= 0
    keep = (shard.draft == draft_view) & (~is_expert | ((shard.expert >= first[shard.group])
                                                       & (shard.expert < last[shard.group])))
    indices = np.flatnonzero(keep)
    if not len(indices):
        return None
    nbytes, dim, on_demand = shard.nbytes[indices], shard.dim[indices], shard.on_demand[indices]
    sliced = (dim >= 0) if spec.slices_experts else np.zeros(len(indices), bool)
    bad = sliced & (shard.extent[indices] % spec.moe_tp_size != 0)
    if bad.any():
        entry = shard.entries[indices[np.argmax(bad)]]
        d = int(dim[np.argmax(bad)])
        raise LayoutError(f"tensor {entry.name!r}: dim {d} of size {entry.shape[d]} is not divisible "
                          f"by the MoE TP size {spec.moe_tp_size} (use --tp-slice off)")
    kept = np.where(sliced, nbytes // spec.moe_tp_size, nbytes)
    # A slice of one row is one block; any other needs whole rows, since every page of them holds
    # kept bytes. On-demand tensors are not read ahead.
    read = np.where(on_demand, 0, np.where(sliced & (shard.rows[indices] == 1), kept, nbytes))
    return Selection(indices, sliced, int(read.sum()), int(kept[~on_demand].sum()), int(nbytes[on_demand].sum()))
