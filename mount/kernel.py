"""What the kernel knows about a mount: finding it, its health, its readahead and FUSE background
limits, and unmounting it."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import subprocess
from pathlib import Path

from rankfs.common.contract import FSTYPE, MountEntry, find_mount

log = logging.getLogger("rankfs.kernel")

FUSECTL = Path("/sys/fs/fuse/connections")


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


def connection(entry: MountEntry) -> Path:
    """The mount's FUSE connection in fusectl (its limits, its waiting requests, abort); mounts
    fusectl first where root can and it is not mounted."""
    path = FUSECTL / entry.device.split(":")[1]
    if not path.exists() and os.geteuid() == 0:
        subprocess.run(["mount", "-t", "fusectl", "fusectl", str(FUSECTL)], capture_output=True)
    return path


def tune(entry: MountEntry, readahead_kb: int, max_background: int, congestion_threshold: int) -> dict:
    """The mount's readahead, and a deep background queue, so page faults become parallel reads.
    Needs root; without it the mount works with the kernel defaults (logged). Called off the
    event loop: the kernel sets the readahead again from the daemon's answer to its INIT request,
    over a value written before, and a request (statvfs) is only answered once INIT is done."""
    os.statvfs(entry.mountpoint)
    done = {"read_ahead_kb": _write(Path(f"/sys/class/bdi/{entry.device}/read_ahead_kb"), readahead_kb)}
    fuse = connection(entry)
    # Raise the limit before the threshold: the kernel refuses a threshold above the limit.
    done["max_background"] = _write(fuse / "max_background", max_background)
    done["congestion_threshold"] = _write(fuse / "congestion_threshold", congestion_threshold)
    return done


def abort(entry: MountEntry) -> bool:
    """End a hung connection (a daemon stuck or stopped): every waiting request fails with ENOTCONN."""
    return _write(connection(entry) / "abort", 1)


def unmount(mountpoint: str | os.PathLike, lazy: bool = False) -> subprocess.CompletedProcess:
    """fusermount3 -u (works for the mounting user and root), else umount."""
    tool = shutil.which("fusermount3") or shutil.which("fusermount")
    if tool:
        cmd = [tool, "-u"] + (["-z"] if lazy else []) + [str(mountpoint)]
    else:
        cmd = ["umount"] + (["-l"] if lazy else []) + [str(mountpoint)]
    return subprocess.run(cmd, capture_output=True, text=True)
