"""What a mount serves and how; light to import, since `rankfs mount` only passes it on."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import psutil

from plan.layout import RankSpec

GIB = 1 << 30


@dataclass
class MountConfig:
    checkpoint: str
    mountpoint: str
    specs: list[RankSpec]
    profile: str | None = None
    budget_bytes: int = 2 * GIB
    workers: int = 8
    direct_io: bool = False
    push: bool = True
    readahead_kb: int = 16384
    max_background: int = 64
    congestion_threshold: int = 48
    allow_other: bool = False
    allow_outside_symlinks: bool = False
    log_file: str | None = None
    started: float = field(default_factory=time.time)


def default_budget_bytes() -> int:
    """1 GiB (a tenth of a second of a fast NVMe array), less on a host with under 8 GiB free."""
    return int(min(GIB, max(GIB // 4, psutil.virtual_memory().available // 8)))


