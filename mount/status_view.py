"""`rankfs status` and `rankfs drop`: a running daemon's figures, once or live, and asking it to
let go of what it holds."""

from __future__ import annotations

import json
import sys
import time

from rankfs.common import contract
from rankfs.mount import kernel
from rankfs.mount.exits import EXIT_FAILURE, EXIT_OK, fail, say


def problem(mountpoint: str) -> str | None:
    """Why a path is not a live rankfs mount, or None."""
    return {"alive": None, "absent": "not mounted", "other": "not a rankfs mount",
            "dead": f"DEAD: the daemon is gone; 'rankfs umount {mountpoint}' cleans it up"}[kernel.health(mountpoint)]


def status(mountpoint: str, as_json: bool, watch: bool) -> int:
    if (why := problem(mountpoint)) is not None:
        return fail(f"{mountpoint}: {why}", EXIT_FAILURE)
    if watch:
        return watch_until(mountpoint, until_loaded=False)
    figures = contract.read_status(mountpoint)
    print(json.dumps(figures, indent=2) if as_json else render(figures))
    return EXIT_OK


def drop(mountpoint: str) -> int:
    if (why := problem(mountpoint)) is not None:
        return fail(f"{mountpoint}: {why}", EXIT_FAILURE)
    contract.send(mountpoint, contract.DROP)
    say("dropped the views' page cache and the daemon's buffers")
    return EXIT_OK


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def loaded(view: dict) -> int:
    """A view's bytes loaded: served through the mount, and read by engine hooks directly."""
    return view["served_bytes"] + view["hook_loaded_bytes"]


def _bar(done: int, total: int, width: int = 30) -> str:
    fraction = min(1.0, done / total) if total else 1.0
    filled = int(fraction * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {fraction * 100:5.1f}%"


def render(s: dict) -> str:
    lines = [f"{s['mountpoint']}: alive, pid {s['pid']}, profile {s['profile']}, {s['checkpoint']}",
             f"  read {_gb(s['read_bytes'])} at {s['read_rate_bytes_per_s'] / 1e9:.2f} GB/s; "
             f"held {_gb(s['held_bytes'])} (peak {_gb(s['peak_held_bytes'])}, budget "
             f"{_gb(s['budget_bytes'])}); daemon RSS {_gb(s['rss_bytes'])}; errors {s['errors']}"]
    for v in s["views"]:
        hook = v["hook_loaded_bytes"]
        lines.append(f"  {v['view']:<16} {_bar(loaded(v), v['planned_bytes'])} "
                     f"{_gb(loaded(v))} / {_gb(v['planned_bytes'])}"
                     + (f" ({_gb(hook)} by the engine hook, from the sources)" if hook else ""))
    return "\n".join(lines)


def watch_until(mountpoint: str, until_loaded: bool) -> int:
    """Redraw the status every second; with until_loaded, stop once every opened view is read."""
    try:
        while True:
            if (why := problem(mountpoint)) is not None:
                return fail(f"{mountpoint}: {why}", EXIT_FAILURE)
            figures = contract.read_status(mountpoint)
            text = render(figures)
            sys.stdout.write("\x1b[2J\x1b[H" + text + "\n" if sys.stdout.isatty() else text + "\n")
            sys.stdout.flush()
            active = [v for v in figures["views"] if v["active"]]
            if until_loaded and active and all(loaded(v) >= v["planned_bytes"] for v in active):
                return EXIT_OK
            time.sleep(1)
    except KeyboardInterrupt:
        return EXIT_OK
