"""Where the memory is: the figures the KV pool will be sized from, before and after release.

SGLang sizes the KV pool from MemAvailable on unified-memory machines, so everything a load leaves
behind (page cache, pinned or pageable staging, allocator arenas, driver state) shows up here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import torch

GIB = 1 << 30
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


def unified_memory() -> bool:
    """An integrated GPU (DGX Spark / GB10): CUDA's memory is the host's memory."""
    return bool(torch.cuda.is_available() and torch.cuda.get_device_properties(0).is_integrated)


def cuda_reserved() -> int:
    return torch.cuda.memory_reserved() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0


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


def snapshot() -> dict:
    info = meminfo()
    reserved = cuda_reserved()
    counted = sum(info[k] for k in ("MemFree", "Buffers", "Cached", "AnonPages", "Slab", "KernelStack",
                                    "PageTables", "SecPageTables"))
    return {**{k.lower(): v for k, v in info.items()}, "cuda_reserved": reserved,
            "nvml_process": nvml_process_bytes(), "rss": rss(),
            # What no counter explains (on unified memory CUDA's reservation is host memory too).
            "unaccounted": info["MemTotal"] - counted - reserved}


def malloc_trim():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def return_pinned_and_cached():
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        empty_host = getattr(torch._C, "_host_emptyCache", None)
        if empty_host is not None:
            empty_host()


BYTE_FIELDS = {k.lower() for k in MEMINFO_FIELDS} | {
    "cuda_reserved", "nvml_process", "rss", "unaccounted", "mem_available_before", "peak_slab_bytes",
    "nontorch_since_load_start"}


def format_line(figures: dict) -> str:
    """One log line; byte figures in GiB."""
    def show(key, value):
        if key in BYTE_FIELDS and isinstance(value, int):
            return f"{key.removesuffix('_bytes')}_gib={value / GIB:.3f}"
        return f"{key}={value}"
    return "rankfs hook memlog: " + " ".join(show(k, v) for k, v in figures.items())
