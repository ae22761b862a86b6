"""A mount for the length of a `with` block, made and ended through the command line as a user would
(the tests, the benchmark and the GPU check use it)."""

from __future__ import annotations

import contextlib
import gc
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout


def rankfs(*args, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `rankfs ARGS` in a process of its own; with check, a non-zero exit raises with its output."""
    result = subprocess.run([sys.executable, "-m", "rankfs.mount.cli", *map(str, args)], cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"rankfs {' '.join(map(str, args))} exited {result.returncode}:\n"
                             f"{result.stdout}{result.stderr}")
    return result


@contextlib.contextmanager
def mounted(checkpoint, mountpoint, *flags, log=None):
    """Mount, yield the mount point, then unmount (lazily if something still maps it)."""
    mountpoint = Path(mountpoint)
    mountpoint.mkdir(parents=True, exist_ok=True)
    log = log or mountpoint.parent / f"{mountpoint.name}.log"
    rankfs("mount", checkpoint, mountpoint, "--log", log, *flags)
    try:
        yield mountpoint
    finally:
        gc.collect()  # tensors mapped from the mount keep it busy
        if rankfs("umount", mountpoint, check=False).returncode != 0:
            rankfs("umount", "--lazy", mountpoint, check=False)
