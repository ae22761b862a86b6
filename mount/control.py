"""Talking to a running daemon through its mount: its status, and asking it to drop what it holds.
Used by the command line and by the engine hook after a load; light to import."""

from __future__ import annotations

import json
import os
import signal
import time

from vfs.tree import CONTROL_DIR, STATUS_FILE, flat_name


class DropError(OSError):
    pass


def read_status(mountpoint: str) -> dict:
    with open(os.path.join(mountpoint, CONTROL_DIR, STATUS_FILE)) as f:
        return json.load(f)


def mount_root(path: str) -> str:
    """The mount point a path lies under."""
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def report_loaded(report_dir: str, view: str, loaded_bytes: int):
    """Tell the daemon how many of a view's bytes this process has loaded straight from the
    sources (the engine hook does), so that its status counts them with what it served."""
    path = os.path.join(report_dir, f"{os.getpid()}.{flat_name(view)}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"view": view, "bytes": loaded_bytes}, f)
    os.replace(path + ".tmp", path)


def loaded_by_hooks(report_dir: str) -> dict[str, int]:
    """{view: bytes} the hooks have reported; a view loaded twice (an engine restarted) counts
    its larger load."""
    loaded: dict[str, int] = {}
    for name in os.listdir(report_dir):
        if name.endswith(".json"):
            try:
                with open(os.path.join(report_dir, name)) as f:
                    report = json.load(f)
                loaded[report["view"]] = max(loaded.get(report["view"], 0), int(report["bytes"]))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being replaced, or not a report
    return loaded


def drop(mountpoint: str, timeout: float = 30.0):
    """Have the daemon release its buffers and drop the views' page cache, and wait until it says
    it has. Opening the views here instead would start their prefetch again."""
    before = read_status(mountpoint)
    os.kill(before["pid"], signal.SIGUSR1)
    deadline = time.monotonic() + timeout
    while read_status(mountpoint).get("drops", 0) == before.get("drops", 0):
        if time.monotonic() > deadline:
            raise DropError(f"{mountpoint}: the daemon did not confirm the drop within {timeout:g} s")
        time.sleep(0.05)
