"""`rankfs mount` and `rankfs umount`: starting the daemon and waiting until its views can be read;
unmounting, and waiting until the daemon has ended."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from rankfs.common import contract
from rankfs.mount import kernel
from rankfs.mount.config import MountConfig
from rankfs.mount.exits import EXIT_FAILURE, EXIT_OK, fail, say

DAEMON_EXIT_SECONDS = 30.0


def default_log(mountpoint: str) -> Path:
    base = Path("/var/log/rankfs") if os.geteuid() == 0 else \
        Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "rankfs"
    return base / (os.path.abspath(mountpoint).strip("/").replace("/", "-") + ".log")


def check_mountpoint(mountpoint: str) -> str | None:
    """Why a path cannot be mounted on, or None."""
    state = kernel.health(mountpoint)
    if state == "dead":
        return f"a rankfs mount whose daemon died is still there; run 'rankfs umount {mountpoint}' first"
    if state != "absent":
        return "already a mount point"
    if not os.path.isdir(mountpoint):
        return "mount point does not exist or is not a directory"
    return None


def mount(config: MountConfig, foreground: bool) -> int:
    problem = check_mountpoint(config.mountpoint)
    if problem:
        return fail(f"{config.mountpoint}: {problem}", EXIT_FAILURE)
    if foreground:
        from rankfs.mount.daemon import serve
        logging.basicConfig(filename=config.log_file, level=logging.INFO,
                            format="%(asctime)s %(name)s %(levelname)s %(message)s")
        return serve(config, None)
    Path(config.log_file).parent.mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    with open(config.log_file, "ab") as log_out:
        child = subprocess.Popen([sys.executable, "-m", "rankfs.mount.daemon", config.to_json(), str(write_end)],
                                 pass_fds=(write_end,), stdin=subprocess.DEVNULL, stdout=log_out,
                                 stderr=log_out, start_new_session=True, cwd="/")
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        answer = pipe.readline().strip()
    if not answer.startswith("ready"):
        child.wait(timeout=30)
        detail = answer.removeprefix("error: ") or \
            f"the daemon exited with {child.returncode}; see {config.log_file}"
        return fail(detail, EXIT_FAILURE)
    say(f"{answer} (daemon pid {child.pid}, log {config.log_file})")
    return EXIT_OK


def umount(mountpoint: str, lazy: bool, force: bool) -> int:
    mountpoint = os.path.abspath(mountpoint)
    entry = contract.find_mount(mountpoint)
    if entry is None:
        return fail(f"{mountpoint}: not mounted", EXIT_FAILURE)
    if entry.fstype != contract.FSTYPE:
        return fail(f"{mountpoint}: not a rankfs mount", EXIT_FAILURE)
    if force and not kernel.abort(entry):  # before anything touches the mount: a hung daemon would hang us too
        return fail(f"{mountpoint}: could not abort the FUSE connection (needs root, or fusectl)", EXIT_FAILURE)
    state = kernel.health(mountpoint)
    pid = contract.read_status(mountpoint)["pid"] if state == "alive" else None
    result = kernel.unmount(mountpoint, lazy=lazy or force)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        if "busy" in message.lower():
            return fail(f"{mountpoint}: busy: files on it are still open or mapped (an engine still "
                        f"loading?). Stop them, or detach now with 'rankfs umount --lazy {mountpoint}'",
                        EXIT_FAILURE)
        return fail(f"{mountpoint}: unmount failed: {message}", EXIT_FAILURE)
    if force:
        say(f"unmounted {mountpoint} (its FUSE connection aborted; detached)")
    elif state == "dead":
        say(f"unmounted {mountpoint} (its daemon had died)")
    elif lazy:
        say(f"unmounted {mountpoint} (detached; the daemon ends when the last open file closes)")
    elif pid and not wait_gone(pid, DAEMON_EXIT_SECONDS):
        os.kill(pid, signal.SIGTERM)
        return fail(f"unmounted {mountpoint}, but its daemon (pid {pid}) did not exit within "
                    f"{DAEMON_EXIT_SECONDS:g} s and was sent SIGTERM; see its log", EXIT_FAILURE)
    else:
        say(f"unmounted {mountpoint}")
    return EXIT_OK


def wait_gone(pid: int, timeout: float) -> bool:
    """Whether process `pid` (not our child) ended within `timeout` seconds."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        import select
        return bool(select.select([pidfd], [], [], timeout)[0])
    finally:
        os.close(pidfd)
