"""The hook's settings, from the environment: every variable it reads is here, with its default.

    RANKFS_HOOK             on | observe | off     on: load rankfs views through the hook; observe:
                                                   load the stock way, only log the memory figures
    RANKFS_HOOK_MAP         auto | on | off       tensors that view maps of the sources instead of
                                                   slabs (auto: without CUDA, for each file the page
                                                   cache holds)
    RANKFS_HOOK_DEVICE      auto | cpu | cuda[:N] where staged tensors are handed out: GPU memory (the
                                                   loader's copies are device to device) or
                                                   page-locked host memory (cpu); auto: the GPU the
                                                   engine's parameters are on, when there is CUDA
    RANKFS_HOOK_SLAB_MB     256                    slab size, MiB (rounded down to a power of two)
    RANKFS_HOOK_INFLIGHT_GB 4                      memory read ahead of the loader, GiB (in host
                                                   memory 0.5 a core, up to 4)
    RANKFS_HOOK_THREADS     8                      read threads (as many as half the cores, half of
                                                   them at least, for copies out of the page cache
                                                   in small reads)
    RANKFS_HOOK_READ_NICE   -10                    the read threads' niceness while they read from
                                                   the disk, relative to their own (a thread whose
                                                   read completes starts the next before the
                                                   loader's copy threads run on); 0: as their own.
                                                   Needs CAP_SYS_NICE or RLIMIT_NICE room: without,
                                                   as their own
    RANKFS_HOOK_TRACE       (off)                  write the hook's read events to this file, a JSON
                                                   line each ({pid} is replaced by the process id);
                                                   read by `python3 -m dev.bench.trace_summary`
    RANKFS_RANK             (torch.distributed)    this process's rank, for a mount of several
                                                   local ranks

Standard library only.
"""

from __future__ import annotations

import os

from rankfs.common.contract import GIB

MODES = ("on", "observe", "off")
MAP_MODES = ("auto", "on", "off")


class SettingError(ValueError):
    pass


def _choice(name: str, default: str, choices: tuple[str, ...]) -> str:
    value = os.environ.get(name, default)
    if value not in choices:
        raise SettingError(f"{name} must be one of {', '.join(choices)}, not {value!r}")
    return value


def _number(name: str, default: str, kind=int, minimum: float = 1):
    text = os.environ.get(name, default)
    try:
        value = kind(text)
    except ValueError:
        raise SettingError(f"{name} must be a number, not {text!r}") from None
    if value < minimum:
        raise SettingError(f"{name} must be at least {minimum}, not {text!r}")
    return value


def _device(name: str, default: str) -> str:
    value = os.environ.get(name, default)
    kind, _, index = value.partition(":")
    if value in ("auto", "cpu", "cuda") or kind == "cuda" and index.isdigit():
        return value
    raise SettingError(f"{name} must be auto, cpu, cuda or cuda:N, not {value!r}")


def _cores() -> int:
    return len(os.sched_getaffinity(0))


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

    __slots__ = ("mode", "map_sources", "device", "slab_bytes", "budget_bytes", "threads", "read_nice", "trace_file")

    def __init__(self, mode: str = "on", map_sources: str = "auto", device: str = "auto",
                 slab_bytes: int = 256 << 20, budget_bytes: int | None = None, threads: int = 8,
                 read_nice: int = -10, trace_file: str | None = None):
        self.mode, self.map_sources, self.device, self.slab_bytes = mode, map_sources, device, slab_bytes
        self.budget_bytes, self.threads, self.read_nice, self.trace_file = budget_bytes, threads, read_nice, trace_file

    def budget_for(self, host_slabs: bool) -> int:
        """The bytes read ahead (RANKFS_HOOK_INFLIGHT_GB). Unset: 4 GiB, and where slabs are host
        memory 512 MiB a core up to that: each slab's first use faults fresh memory in, work for
        the cores the loader copies on (figures in docs/benchmark.md, twenty-eighth session)."""
        if self.budget_bytes is not None:
            return self.budget_bytes
        return min(4 * GIB, (512 << 20) * _cores()) if host_slabs else 4 * GIB

    def cpu_work_threads(self) -> int:
        """How many read threads may copy out of the page cache at once: half the cores, the rest
        left to the loader's threads, and half the threads at least (where cores are few, more only
        take the GIL from the loader's loop)."""
        return max(1, self.threads // 2, min(self.threads, _cores() // 2))

    @classmethod
    def from_env(cls, mode: str | None = None) -> "HookSettings":
        slab_mb = _number("RANKFS_HOOK_SLAB_MB", "256")
        return cls(mode=mode or _choice("RANKFS_HOOK", "on", MODES),
                   map_sources=_choice("RANKFS_HOOK_MAP", "auto", MAP_MODES),
                   device=_device("RANKFS_HOOK_DEVICE", "auto"),
                   slab_bytes=(1 << (slab_mb.bit_length() - 1)) << 20,
                   budget_bytes=_inflight_bytes("RANKFS_HOOK_INFLIGHT_GB"),
                   threads=_number("RANKFS_HOOK_THREADS", "8"),
                   read_nice=_number("RANKFS_HOOK_READ_NICE", "-10", minimum=-39),
                   trace_file=_trace_file("RANKFS_HOOK_TRACE"))


def rank_override() -> int | None:
    """RANKFS_RANK, where set."""
    value = os.environ.get("RANKFS_RANK")
    return None if value is None else _number("RANKFS_RANK", value, minimum=0)
