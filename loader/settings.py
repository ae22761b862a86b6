"""The hook's settings, from the environment: every variable it reads is declared in SETTINGS, with
its default and meaning (docs/reference.md is rendered from it), and validated here.

Standard library only: every Python process of the engine imports it at start-up.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from rankfs.common.contract import GIB

MODES = ("on", "observe", "off")
MAP_MODES = ("auto", "on", "off")
MIN_BUDGET_BYTES = 16 << 20
MIN_SLAB_BYTES = 1 << 20


class Setting(NamedTuple):
    variable: str
    default: str
    meaning: str


SETTINGS = (
    Setting("RANKFS_HOOK", "on", "`on`: load rankfs views through the hook; `observe`: load the stock way, only log "
            "the memory figures; `off`: nothing"),
    Setting("RANKFS_HOOK_DEVICE", "auto", "where staged tensors are handed out: `cuda[:N]` (GPU memory: the engine's "
            "copies are device to device), `cpu` (page-locked host memory); `auto`: the GPU the engine's parameters "
            "are on; host memory where the process holds no CUDA memory (it is not loading into a GPU)"),
    Setting("RANKFS_HOOK_MAP", "auto", "tensors that view maps of the sources (`on`), or slabs (`off`); `auto`: slabs "
            "with CUDA; without, maps for each file the page cache holds and slabs read from the disk for the "
            "others, maps for every file where the memory the process may use holds less than two slabs"),
    Setting("RANKFS_HOOK_INFLIGHT_GB", "4", "memory read ahead of the loader, GiB: GPU memory where the hook stages "
            "there; host slabs: 0.5 a core (of the CPU quota) and a quarter of the memory the process may use (its "
            "cgroup's limit less what it uses), up to 4; a value above the latter is refused"),
    Setting("RANKFS_HOOK_SLAB_MB", "256", "slab size, MiB (a power of two; host slabs: half the budget at most)"),
    Setting("RANKFS_HOOK_THREADS", "8", "read threads; as many as half the cores (half the threads at least, two a "
            "core at most, of the CPU quota) copy small reads out of the page cache at once, leaving the other cores "
            "and the GIL to the loader"),
    Setting("RANKFS_HOOK_DISK_THREADS", "16", "more read threads, that only read from the disk: a group the page cache "
            "does not hold is read with RANKFS_HOOK_THREADS plus these in flight (a sliced rank's reads are a few MB "
            "each, too few at once for a fast disk); their bounce buffers (GPU staging) take an eighth of the memory "
            "the process may use at most; 0: none"),
    Setting("RANKFS_HOOK_READ_NICE", "-10", "niceness of a read thread while it reads from the disk, relative to "
            "its own, so that it starts its next read before the loader's copy threads run on; 0: none (needs "
            "`CAP_SYS_NICE` or `RLIMIT_NICE` room, else ignored)"),
    Setting("RANKFS_HOOK_TRACE", "(off)", "the hook's events to this file (`{pid}` becomes the process id), a JSON "
            "line each, for `python3 -m dev.bench.trace_summary`"),
    Setting("RANKFS_RANK", "(torch.distributed)", "this process's rank, for a mount of several local ranks"),
)
_DEFAULTS = {s.variable: s.default for s in SETTINGS}


class SettingError(ValueError):
    pass


def _choice(name: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, _DEFAULTS[name])
    if value not in choices:
        raise SettingError(f"{name} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _number(name: str, default: str | None = None, kind=int, minimum: float = 1):
    text = os.environ.get(name, _DEFAULTS[name] if default is None else default)
    try:
        value = kind(text)
    except ValueError:
        raise SettingError(f"{name} must be a number, not {text!r}") from None
    if value < minimum:
        raise SettingError(f"{name} must be at least {minimum}, not {text!r}")
    return value


def _device(name: str) -> str:
    value = os.environ.get(name, _DEFAULTS[name])
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or kind == "cuda" and index.isdigit():
        return value
    raise SettingError(f"{name} must be auto, cpu, cuda or cuda:N, not {value!r}")


def _cores() -> int:
    """The cores this process may use: its affinity and its CPU quota (rankfs.common.limits)."""
    from rankfs.common.limits import cpu_count
    return cpu_count()


def _inflight_bytes(name: str) -> int | None:
    """Where set, GiB as bytes; None where unset (HookSettings.budget_for)."""
    if not os.environ.get(name):
        return None
    return int(_number(name, "", float, minimum=1 / 1024) * GIB)


def _trace_file(name: str) -> str | None:
    value = os.environ.get(name)
    return value.replace("{pid}", str(os.getpid())) if value else None


class HookSettings:
    """A plain class, not a dataclass: every Python process of the engine imports it at start-up."""

    __slots__ = ("mode", "map_sources", "device", "slab_bytes", "budget_bytes", "threads", "disk_threads",
                 "read_nice", "trace_file")

    def __init__(self, mode: str = "on", map_sources: str = "auto", device: str = "auto",
                 slab_bytes: int = 256 << 20, budget_bytes: int | None = None, threads: int = 8,
                 disk_threads: int = 16, read_nice: int = -10, trace_file: str | None = None):
        self.mode, self.map_sources, self.device, self.slab_bytes = mode, map_sources, device, slab_bytes
        self.budget_bytes, self.threads, self.disk_threads = budget_bytes, threads, disk_threads
        self.read_nice, self.trace_file = read_nice, trace_file

    def budget_for(self, host_slabs: bool, room: int) -> int:
        """The bytes read ahead (RANKFS_HOOK_INFLIGHT_GB), given the memory the process may still
        take (`room`: rankfs.common.limits.available_memory). Unset: 4 GiB, and where slabs are host
        memory, 512 MiB a core (each slab's first use faults fresh memory in, work for the cores
        the loader copies on) and a quarter of the room at most: past its cgroup's limit the engine
        is killed. A budget set above the room is refused."""
        if self.budget_bytes is not None:
            if host_slabs and self.budget_bytes > room:
                raise SettingError(
                    f"RANKFS_HOOK_INFLIGHT_GB={self.budget_bytes / GIB:g} is more than the {room / GIB:.2f} GiB "
                    "this process may still use (its cgroup's memory limit less what it uses, or the host's "
                    "available memory); set it lower, or leave it unset to size it from that")
            return self.budget_bytes
        if not host_slabs:
            return 4 * GIB
        return max(MIN_BUDGET_BYTES, min(4 * GIB, (512 << 20) * _cores(), room // 4))

    def slab_for(self, budget: int) -> int:
        """A host slab's size under a budget: RANKFS_HOOK_SLAB_MB, or the largest power of two that
        leaves room for two slabs (the loader's file may pass the budget by one)."""
        fits = 1 << max(0, (budget // 2).bit_length() - 1)
        return max(MIN_SLAB_BYTES, min(self.slab_bytes, fits))

    def disk_threads_for(self, bounce_bytes: int, room: int) -> int:
        """The threads that only read from the disk, given what each one's bounce buffers take
        (GPU staging; 0 for host slabs, which the reads fill directly) and the memory the process
        may still take: an eighth of it at most."""
        if not bounce_bytes:
            return self.disk_threads
        return min(self.disk_threads, room // 8 // bounce_bytes)

    def cpu_work_threads(self) -> int:
        """How many read threads may copy out of the page cache at once: half the cores, the rest
        left to the loader's threads, and half the threads at least (where cores are few, copies
        waiting behind the loader still keep it fed), but never more than two a core."""
        cores = _cores()
        return max(1, min(self.threads, 2 * cores, max(self.threads // 2, cores // 2)))

    @classmethod
    def from_env(cls, mode: str | None = None) -> "HookSettings":
        slab_mb = _number("RANKFS_HOOK_SLAB_MB")
        return cls(mode=mode or _choice("RANKFS_HOOK", MODES),
                   map_sources=_choice("RANKFS_HOOK_MAP", MAP_MODES),
                   device=_device("RANKFS_HOOK_DEVICE"),
                   slab_bytes=(1 << (slab_mb.bit_length() - 1)) << 20,
                   budget_bytes=_inflight_bytes("RANKFS_HOOK_INFLIGHT_GB"),
                   threads=_number("RANKFS_HOOK_THREADS"),
                   disk_threads=_number("RANKFS_HOOK_DISK_THREADS", minimum=0),
                   read_nice=_number("RANKFS_HOOK_READ_NICE", minimum=-39),
                   trace_file=_trace_file("RANKFS_HOOK_TRACE"))


def rank_override() -> int | None:
    """RANKFS_RANK, where set."""
    value = os.environ.get("RANKFS_RANK")
    return None if value is None else _number("RANKFS_RANK", value, minimum=0)
