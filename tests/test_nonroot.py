"""A user that is not root mounts through fusermount3, as Debian sets it up, and loads the original
shards and the view with and without the hook, with RLIMIT_MEMLOCK at a container's default (64
KiB): the view's tensors bitwise the originals'.

The user (nobody) runs in a mount namespace of its own where /dev/fuse is 0666, as Debian has it,
and the directories above this Python that other users may not enter are open to it (overlays that
change only their mode): the host's files and devices are left as they are."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT, checkout_env

pytestmark = pytest.mark.mount

USER = 65534  # nobody
FUSE_DEVICE = os.makedev(10, 229)
MEMLOCK = 64 << 10


def _closed_directories(paths) -> list[Path]:
    """The directories above `paths` that other users may not enter."""
    closed = set()
    for path in paths:
        for parent in Path(os.path.realpath(path)).parents:
            if not os.stat(parent).st_mode & 0o001:
                closed.add(parent)
    return sorted(closed)


def _as_user(script: str, work: Path) -> str:
    """Runs `script` (sh) as USER in a mount namespace set up as the module says; its stdout."""
    setup = ["set -e"]
    for i, directory in enumerate(_closed_directories([sys.executable, sys.prefix, sys.base_prefix, ROOT])):
        upper, scratch = work / f"upper{i}", work / f"scratch{i}"
        upper.mkdir()
        scratch.mkdir()
        setup += [f"mount -t overlay overlay -o lowerdir={directory},upperdir={upper},workdir={scratch} {directory}",
                  f"chmod o+x {directory}"]
    device = work / "fuse"
    os.mknod(device, 0o666 | 0o020000, FUSE_DEVICE)
    os.chmod(device, 0o666)
    setup += [f"mount --bind {device} /dev/fuse",
              f'exec setpriv --reuid={USER} --regid={USER} --clear-groups prlimit --memlock={MEMLOCK} sh -c "$0"']
    result = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(setup), script],
                            cwd=ROOT, capture_output=True, text=True, timeout=300,
                            env=checkout_env(HOME=str(work / "home")))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.fixture
def work():
    """A directory other users may enter (pytest's are its user's alone)."""
    path = Path(tempfile.mkdtemp(prefix="rankfs-nonroot-"))
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path)


def test_a_user_mounts_through_fusermount3_and_loads_the_view(tiny_checkpoint, work):
    checkpoint, mountpoint, home = work / "checkpoint", work / "mnt", work / "home"
    shutil.copytree(tiny_checkpoint, checkpoint)
    for directory in (mountpoint, home):
        directory.mkdir()
        os.chown(directory, USER, USER)
    python, rankfs = sys.executable, f"{sys.executable} -m rankfs.mount.cli"
    stdout = _as_user(f"""
        set -e
        trap 'status=$?; {rankfs} umount --force {mountpoint} >/dev/null 2>&1 || true; exit $status' EXIT
        {rankfs} mount {checkpoint} {mountpoint} --tp-size 4 --tp-rank 0 --ep-size 2 --log {home}/rankfs.log >&2
        echo "$(grep " {mountpoint} " /proc/self/mountinfo | sed 's/.* - //')"
        ulimit -l
        id -u
        {python} tests/hash_loader.py {checkpoint}
        {python} tests/hash_loader.py {mountpoint}/target
        {python} tests/hash_loader.py {mountpoint}/target --hook
        {rankfs} umount {mountpoint} >&2
        """, work)
    mount_line, memlock, uid, stock, view, hooked = stdout.splitlines()[-6:]
    assert mount_line.startswith("fuse.rankfs") and f"user_id={USER}" in mount_line
    assert (int(memlock), int(uid)) == (MEMLOCK >> 10, USER)
    view, hooked, stock = (json.loads(line)["digests"] for line in (view, hooked, stock))
    assert view == hooked == {name: stock[name] for name in view} and len(view) > 10
