"""What a mount serves and how: the typed settings `rankfs mount` hands to its daemon."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

from rankfs.common.contract import GIB
from rankfs.plan.spec import RankSpec

# The loaders read nine files at once and a pushed chunk counts until its first page is read: a
# smaller budget leaves most of a warm load to FUSE requests (figures: docs/benchmark.md).
DEFAULT_BUDGET_BYTES = 4 * GIB
MIN_BUDGET_BYTES = 64 << 20
# The kernel's read-around of a page fault the pushes have not covered; less where experts are
# sliced by rows, since a fault by a slice's edge reads the other ranks' fill around it.
READAHEAD_KB = 1024
SLICED_READAHEAD_KB = 256


def default_readahead_kb(specs) -> int:
    return SLICED_READAHEAD_KB if any(spec.slices_experts for spec in specs) else READAHEAD_KB


@dataclass(frozen=True)
class MountConfig:
    checkpoint: str
    mountpoint: str
    specs: tuple[RankSpec, ...]
    budget_bytes: int  # memory the daemon may hold for read-ahead
    profile: str | None = None
    workers: int = 8  # threads reading ahead (their bytes: 8 MiB each), and as many for reads waited on
    direct_io: bool = False
    push: bool = True
    push_threads: int = 8  # notify_store calls at once (default_push_threads)
    keep_cache: bool = False  # the views' pages stay cached once the loader is done with them
    readahead_kb: int = READAHEAD_KB
    max_background: int = 64
    congestion_threshold: int = 48
    allow_other: bool = False
    allow_outside_symlinks: bool = False
    fuse_options: tuple[str, ...] = ()  # passed to libfuse (-o)
    debug_fuse: bool = False
    trace_file: str | None = None  # the read engine's events (reader.trace)
    log_file: str | None = None
    started: float = field(default_factory=time.time)

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), "specs": [dataclasses.asdict(s) for s in self.specs]})

    @classmethod
    def from_json(cls, text: str) -> "MountConfig":
        raw = json.loads(text)
        raw["specs"] = tuple(RankSpec(**s) for s in raw["specs"])
        raw["fuse_options"] = tuple(raw["fuse_options"])
        return cls(**raw)


def default_budget_bytes(available_bytes: int) -> int:
    """4 GiB, less where under 32 GiB is available to the process (an eighth of it, at least
    64 MiB): `available_bytes` is rankfs.common.limits.available_memory, its cgroup's room. The
    rest is the loader's, and the page cache the view is read through."""
    return int(min(DEFAULT_BUDGET_BYTES, max(MIN_BUDGET_BYTES, available_bytes // 8)))


def default_push_threads(cores: int) -> int:
    """Threads pushing into the views' page cache: eight (one file's store rate peaks near four and
    loaders read nine files at once), two a core at most: each push is a copy on the CPU, where the
    workers' reads mostly wait on the disk. `cores`: rankfs.common.limits.cpu_count, the CPU quota."""
    return max(1, min(8, 2 * cores))
