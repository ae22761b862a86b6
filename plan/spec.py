"""One rank's parallel layout as the engines mean the flags, and the slice of a tensor it keeps.

Standard library only: the engine hook uses `Slice` to find a sliced tensor's bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from rankfs.plan.errors import LayoutError
from rankfs.plan.safetensors import DTYPE_SIZES

TP_SLICE_MODES = ("auto", "on", "off")
PLACEMENTS = ("sglang", "vllm")


@dataclass(frozen=True)
class RankSpec:
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

    def expert_slice(self, shape: tuple[int, ...], dim: int) -> "Slice":
        """FusedMoE's narrowing: dim split in moe_tp_size parts, this rank's part."""
        size = shape[dim] // self.moe_tp_size
        return Slice(dim, size * self.moe_tp_rank, size * (self.moe_tp_rank + 1))

    def describe(self) -> str:
        return (f"tp{self.tp_size}/ep{self.ep_size} rank {self.tp_rank} (ep rank {self.ep_rank}, "
                f"moe-tp rank {self.moe_tp_rank}/{self.moe_tp_size}, "
                f"experts {'sliced' if self.slices_experts else 'whole'})")


class Rows(NamedTuple):
    """Where a slice's bytes lie in its tensor: in each of `count` rows of `row_bytes`, the bytes
    [keep_start, keep_stop). A slice of dim 0 is one row: a single block."""

    count: int
    row_bytes: int
    keep_start: int
    keep_stop: int

    @property
    def kept_bytes(self) -> int:
        return self.count * (self.keep_stop - self.keep_start)

    @property
    def is_block(self) -> bool:
        return self.count == 1


class Slice(NamedTuple):
    """The part of a tensor the rank keeps: [start, stop) along `dim`."""

    dim: int
    start: int
    stop: int

    def rows(self, dtype: str, shape) -> Rows:
        inner = DTYPE_SIZES[dtype] * math.prod(shape[self.dim + 1:])
        row_bytes = inner * shape[self.dim]
        return Rows(math.prod(shape[:self.dim]), row_bytes, inner * self.start, inner * self.stop)
