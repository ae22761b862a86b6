"""What the kernel knows about a mount: finding it, its health, its readahead and FUSE background
limits, and unmounting it."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("rankfs.kernel")

FSTYPE = "fuse.rankfs"
FUSECTL = Path("/sys/fs/fuse/connections")


@dataclass(frozen=True)
class MountEntry:
    mountpoint: str
    device: str  # "major:minor"
    fstype: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    return field.encode().decode("unicode_escape")


def find_mount(mountpoint: str | os.PathLike) -> MountEntry | None:
    """The mount at exactly this path, from /proc/self/mountinfo (never touches the mount itself,
    so it works while our own daemon cannot answer yet, and on dead mounts)."""
    target = os.path.abspath(mountpoint)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields = left.split()
            if _unescape(fields[4]) == target:
                found = MountEntry(target, fields[2], right.split()[0])  # the last one is on top
    return found


def health(mountpoint: str | os.PathLike) -> str:
    """'absent', 'alive', 'dead' (daemon gone: ENOTCONN) or 'other' (not a rankfs mount)."""
    entry = find_mount(mountpoint)
    if entry is None:
        return "absent"
    if entry.fstype != FSTYPE:
        return "other"
    try:
        os.statvfs(mountpoint)  # always answered by the daemon (stat may come from the kernel's cache)
    except OSError as exc:
        if exc.errno in (errno.ENOTCONN, errno.ECONNABORTED):
            return "dead"
        raise
    return "alive"


def _write(path: Path, value: int) -> bool:
    try:
        path.write_text(f"{value}\n")
        return True
    except OSError as exc:
        log.warning("cannot set %s to %s: %s", path, value, exc.strerror)
        return False


def tune(entry: MountEntry, readahead_kb: int, max_background: int, congestion_threshold: int) -> dict:
    """Large readahead and a deep background queue, so page faults become large parallel reads.
    Needs root; without it the mount works with the kernel defaults (logged)."""
    done = {"read_ahead_kb": _write(Path(f"/sys/class/bdi/{entry.device}/read_ahead_kb"), readahead_kb)}
    minor = entry.device.split(":")[1]
    if not (FUSECTL / minor).exists() and os.geteuid() == 0:
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSECTL)], capture_output=True)
    connection = FUSECTL / minor
    # Raise the limit before the threshold: the kernel refuses a threshold above the limit.
    done["max_background"] = _write(connection / "max_background", max_background)
    done["congestion_threshold"] = _write(connection / "congestion_threshold", congestion_threshold)
    return done


def abort(entry: MountEntry) -> bool:
    """End a hung connection (a daemon stuck or stopped): every waiting request fails with ENOTCONN."""
    return _write(FUSECTL / entry.device.split(":")[1] / "abort", 1)


def unmount(mountpoint: str | os.PathLike, lazy: bool = False) -> subprocess.CompletedProcess:
    """fusermount3 -u (works for the mounting user and root), else umount."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        cmd = [tool, "-u"] + (["-z"] if lazy else []) + [str(mountpoint)]
    else:
        cmd = ["umount"] + (["-l"] if lazy else []) + [str(mountpoint)]
    return subprocess.run(cmd, capture_output=True, text=True)
