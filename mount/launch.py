"""Starting the daemon and waiting until its views can be read; unmounting, and waiting until the
daemon has ended (rankfs.mount.api and the command line are built on these)."""

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


class MountError(OSError):
    """A mount or unmount that failed, or a path that is not a live rankfs mount; the message says why."""


def serve_in_foreground(config: MountConfig) -> int:
    """Mount and serve in this process until unmounted (`rankfs mount --foreground`)."""
    problem = check_mountpoint(config.mountpoint)
    if problem:
        raise MountError(f"{config.mountpoint}: {problem}")
    from rankfs.mount.daemon import serve
    logging.basicConfig(filename=config.log_file, level=logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return serve(config, None)


def start(config: MountConfig) -> tuple[int, str]:
    """Start the daemon and wait until its views can be read: (its pid, its ready line)."""
    problem = check_mountpoint(config.mountpoint)
    if problem:
        raise MountError(f"{config.mountpoint}: {problem}")
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
        raise MountError(answer.removeprefix("error: ") or
                         f"the daemon exited with {child.returncode}; see {config.log_file}")
    return child.pid, answer


def unmount(mountpoint: str, lazy: bool = False, force: bool = False) -> str:
    """Unmount and wait for the daemon to end; returns what was done."""
    mountpoint = os.path.abspath(mountpoint)
    entry = contract.find_mount(mountpoint)
    if entry is None:
        raise MountError(f"{mountpoint}: not mounted")
    if entry.fstype != contract.FSTYPE:
        raise MountError(f"{mountpoint}: not a rankfs mount")
    if force and not kernel.abort(entry):  # before anything touches the mount: a hung daemon would hang us too
        raise MountError(f"{mountpoint}: could not abort the FUSE connection (needs root, or fusectl)")
    state = kernel.health(mountpoint)
    pid = contract.read_status(mountpoint)["pid"] if state == "alive" else None
    result = kernel.unmount(mountpoint, lazy=lazy or force)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        if "busy" in message.lower():
            raise MountError(f"{mountpoint}: busy: files on it are still open or mapped (an engine still "
                             f"loading?). Stop them, or detach now with 'rankfs umount --lazy {mountpoint}'")
        raise MountError(f"{mountpoint}: unmount failed: {message}")
    if force:
        return f"unmounted {mountpoint} (its FUSE connection aborted; detached)"
    if state == "dead":
        return f"unmounted {mountpoint} (its daemon had died)"
    if lazy:
        return f"unmounted {mountpoint} (detached; the daemon ends when the last open file closes)"
    if pid and not wait_gone(pid, DAEMON_EXIT_SECONDS):
        os.kill(pid, signal.SIGTERM)
        raise MountError(f"unmounted {mountpoint}, but its daemon (pid {pid}) did not exit within "
                         f"{DAEMON_EXIT_SECONDS:g} s and was sent SIGTERM; see its log")
    return f"unmounted {mountpoint}"


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
