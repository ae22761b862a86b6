"""What this process may use: its memory cgroup's limit and high mark less what the cgroup already
uses, and its CPU quota and affinity. Budgets are sized from these, not from the host's MemAvailable
or core count: an engine in a container with a memory limit is killed by its cgroup, whatever the
host has free. cgroup v2 (`memory.max`, `memory.high`, `cpu.max`) and v1 (`memory.limit_in_bytes`,
`cpu.cfs_quota_us`), each limit of the cgroup and of every cgroup above it. Standard library only."""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a number near 2**63


class Cgroups(NamedTuple):
    """Where this process's memory and CPU controllers' cgroups lie (None: none of that kind)."""
    memory: Path | None
    cpu: Path | None
    v2: bool


def _mounts() -> dict[str, str]:
    """{controller or 'cgroup2': mount point} of the cgroup filesystems this process sees."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, (fstype, _, options) = left.split(), right.split()[:3]
                if fstype == "cgroup2":
                    found.setdefault("cgroup2", fields[4])
                elif fstype == "cgroup":
                    for option in options.split(","):
                        found.setdefault(option, fields[4])
    except OSError:
        pass
    return found


def cgroups() -> Cgroups:
    """This process's cgroups, from /proc/self/cgroup and the mounts."""
    mounts, memory, cpu, v2 = _mounts(), None, None, None
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return Cgroups(None, None, False)
    for line in lines:
        _, controllers, path = line.split(":", 2)
        names = controllers.split(",") if controllers else []
        if "memory" in names and "memory" in mounts:
            memory = Path(mounts["memory"] + path)
        if "cpu" in names and "cpu" in mounts:
            cpu = Path(mounts["cpu"] + path)
        if not controllers and "cgroup2" in mounts:
            v2 = Path(mounts["cgroup2"] + path)
    if v2 is not None and memory is None and (v2 / "memory.max").exists():
        return Cgroups(v2, v2, True)
    if v2 is not None and cpu is None and (v2 / "cpu.max").exists():
        cpu = v2
    return Cgroups(memory, cpu, False)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _number(text: str | None) -> int | None:
    """A limit file's value; None where there is none ('max', absent, or v1's near 2**63)."""
    if text is None or text == "max":
        return None
    value = int(text)
    return None if value >= UNLIMITED else value


def _stat(directory: Path, key: str) -> int:
    for line in (_read(directory / "memory.stat") or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return int(value)
    return 0


def _lineage(directory: Path, marker: str):
    """The cgroup and every cgroup above it that has the controller's `marker` file (the
    hierarchy's root has none of a limit's files)."""
    yield directory
    while directory.parent != directory and (directory.parent / marker).exists():
        directory = directory.parent
        yield directory


def memory_room(groups: Cgroups | None = None) -> int | None:
    """Bytes this process's cgroup may still take before a limit (or a high mark, past which the
    kernel throttles it) stops it: the least, over it and the cgroups above it, of the limit less
    what the cgroup uses, its inactive page cache counted as room (the kernel reclaims that
    first). None where no cgroup limits memory."""
    groups = groups or cgroups()
    if groups.memory is None:
        return None
    limit_files, usage_file, inactive_key = (
        (("memory.max", "memory.high"), "memory.current", "inactive_file") if groups.v2
        else (("memory.limit_in_bytes",), "memory.usage_in_bytes", "total_inactive_file"))
    room = None
    for directory in _lineage(groups.memory, limit_files[0]):
        limits = [limit for limit in (_number(_read(directory / name)) for name in limit_files) if limit]
        if not limits:  # its usage and memory.stat go unread: the read-ahead asks ten times a second
            continue
        used, inactive = _number(_read(directory / usage_file)), _stat(directory, inactive_key)
        for limit in limits:
            free = max(0, limit - (used or 0) + inactive)
            room = free if room is None else min(room, free)
    return room


def available_memory(groups: Cgroups | None = None) -> int:
    """The memory this process may still take: the host's MemAvailable, or its cgroup's room where
    that is less."""
    with open("/proc/meminfo") as f:
        host = next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))
    room = memory_room(groups)
    return host if room is None else min(host, room)


def _quota_cores(directory: Path, v2: bool) -> int | None:
    """The cores a cgroup's own CPU quota allows (None: no quota)."""
    if v2:
        quota, _, period = (_read(directory / "cpu.max") or "max").partition(" ")
        quota_us, period_us = (None if quota == "max" else int(quota)), int(period or 100000)
    else:
        quota_us = _number(_read(directory / "cpu.cfs_quota_us"))
        quota_us = None if quota_us is not None and quota_us < 0 else quota_us
        period_us = _number(_read(directory / "cpu.cfs_period_us")) or 100000
    return max(1, quota_us // period_us) if quota_us else None


def cpu_count(groups: Cgroups | None = None) -> int:
    """The cores this process may run on: its affinity, or the least CPU quota of its cgroup and
    those above it where that is fewer (at least one)."""
    cores = len(os.sched_getaffinity(0))
    groups = groups or cgroups()
    if groups.cpu is None:
        return cores
    quotas = [_quota_cores(directory, groups.v2)
              for directory in _lineage(groups.cpu, "cpu.max" if groups.v2 else "cpu.cfs_quota_us")]
    return min([cores, *filter(None, quotas)])
