"""Where the memory is: the figures the KV pool will be sized from, before and after a release.

SGLang sizes the KV pool from MemAvailable on unified-memory machines, so everything a load leaves
behind (page cache, pinned or pageable staging, allocator arenas, driver state) shows up here.
Standard library only: CUDA's figures come from the engine's torch, where it has imported one, and
never start CUDA.
"""

from __future__ import annotations

import os
import sys

from rankfs.common.contract import GIB

MEMINFO_FIELDS = ("MemTotal", "MemFree", "MemAvailable", "Buffers", "Cached", "Mapped", "AnonPages",
                  "Shmem", "Slab", "KernelStack", "PageTables", "SecPageTables", "Unevictable")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes, for the fields that matter here (0 where the kernel lacks one)."""
    values = dict.fromkeys(MEMINFO_FIELDS, 0)
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) * 1024
    return values


def _cuda():
    """torch.cuda, where the process has imported torch and started CUDA; else None."""
    torch = sys.modules.get("torch")
    return torch.cuda if torch is not None and torch.cuda.is_initialized() else None


def unified_memory() -> bool:
    """An integrated GPU (DGX Spark / GB10): CUDA's memory is the host's memory."""
    cuda = _cuda()
    return bool(cuda and cuda.get_device_properties(0).is_integrated)


def cuda_reserved() -> int:
    cuda = _cuda()
    return cuda.memory_reserved() if cuda else 0


def nvml_process_bytes() -> int | None:
    """GPU memory NVML charges to this process, where NVML is there."""
    try:
        import pynvml
        pynvml.nvmlInit()
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if p.pid == os.getpid() and p.usedGpuMemory:
                    total += p.usedGpuMemory
        return total
    except Exception:
        return None


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def snapshot(with_nvml: bool = False) -> dict:
    info = meminfo()
    reserved = cuda_reserved()
    counted = sum(info[k] for k in ("MemFree", "Buffers", "Cached", "AnonPages", "Slab", "KernelStack",
                                    "PageTables", "SecPageTables"))
    return {**{k.lower(): v for k, v in info.items()}, "cuda_reserved": reserved,
            "nvml_process": nvml_process_bytes() if with_nvml else None, "rss": rss(),
            # What no counter explains (on unified memory CUDA's reservation is host memory too).
            "unaccounted": info["MemTotal"] - counted - reserved}


def malloc_trim():
    import ctypes
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def return_pinned_and_cached():
    """CUDA's caching allocator and torch's pinned host cache hand their free blocks back."""
    cuda = _cuda()
    if cuda:
        cuda.synchronize()
        cuda.empty_cache()
        empty_host = getattr(sys.modules["torch"]._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


def host_alloc_count() -> int | None:
    """torch's pinned host allocations so far (the hook makes none of its own)."""
    cuda = _cuda()
    try:
        return cuda.host_memory_stats().get("num_host_alloc") if cuda else None
    except Exception:
        return None


BYTE_FIELDS = {k.lower() for k in MEMINFO_FIELDS} | {
    "cuda_reserved", "nvml_process", "rss", "unaccounted", "mem_available_before", "peak_slab_bytes",
    "nontorch_since_load_start", "pinned_bytes", "peak_host_bytes", "peak_device_bytes", "source_direct_bytes",
    "source_cached_bytes", "budget_bytes"}


def format_line(figures: dict) -> str:
    """One log line; byte figures in GiB."""
    def show(key, value):
        if key in BYTE_FIELDS and isinstance(value, int):
            return f"{key.removesuffix('_bytes')}_gib={value / GIB:.3f}"
        return f"{key}={value}"
    return "rankfs hook memlog: " + " ".join(show(k, v) for k, v in figures.items() if not isinstance(v, dict))
