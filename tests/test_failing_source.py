"""A source shard that fails mid-load: reads of one tensor's bytes give EIO (a small FUSE filesystem
under the checkpoint, tests/faulty_fs.py). Through the hook, whichever way it reads (maps or slabs),
the load ends with an error naming the file and the tensor; through the view, readers get EIO and
the daemon's log names them. No wrong bytes, no hang, and the daemon still serves its other views."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from conftest import ROOT, mounted, through_faulty_fs
from dev.bench.engine_like import shard_files
from dev.memstate import uncache
from rankfs.common import contract
from rankfs.common.disk import PAGE
from rankfs.plan.safetensors import read_header

pytestmark = pytest.mark.mount


@pytest.fixture
def failing(tiny_checkpoint, tmp_path):
    """The checkpoint seen through a filesystem that fails the reads of one attention tensor of its
    second shard (a tensor every rank loads): (checkpoint, shard name, tensor name)."""
    shard = shard_files(tiny_checkpoint)[1]
    header = read_header(shard)
    tensor = next(name for name in sorted(header.tensors) if ".attn." in name)
    entry = header.tensors[tensor]
    checkpoint = tmp_path / "ckpt"
    # The pages wholly inside the tensor, as a bad sector within it: its neighbours stay readable.
    begin, end = -(-(header.data_start + entry.begin) // PAGE) * PAGE, (header.data_start + entry.end) // PAGE * PAGE
    with through_faulty_fs(tiny_checkpoint, checkpoint, os.path.basename(shard), begin, end - begin):
        yield checkpoint, os.path.basename(shard), tensor


def _hash_all(directory) -> None:
    for path in shard_files(directory):
        with safe_open(path, framework="pt") as f:
            for name in sorted(f.keys()):
                hashlib.sha256(f.get_tensor(name).contiguous().view(torch.uint8).numpy()).hexdigest()


def test_a_failing_source_fails_the_load_through_the_view_by_name(failing, mount_dir):
    """Readers of the view get EIO for the bytes the source cannot give; a loader that maps the view
    (safetensors) gets SIGBUS for them, as it would from the original file. The daemon's log names
    the file and the tensor, and it goes on serving."""
    checkpoint, shard, tensor = failing
    log = mount_dir.parent / "rankfs.log"
    with mounted(checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 0, "--ep-size", 2, log=log):
        with open(mount_dir / "target" / shard, "rb") as f, pytest.raises(OSError) as info:
            while f.read(1 << 20):
                pass
        assert info.value.errno == errno.EIO
        mapped = subprocess.run([sys.executable, str(ROOT / "tests" / "hash_loader.py"), mount_dir / "target"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert mapped.returncode == -signal.SIGBUS
        _hash_all(mount_dir / "draft")  # the daemon still serves the other views
        assert contract.read_status(str(mount_dir))["errors"] >= 1
    assert any(shard in line and tensor in line and "EIO" in line for line in log.read_text().splitlines())


@pytest.mark.parametrize("maps", ["on", "off"])
def test_a_failing_source_fails_the_load_through_the_hook_by_name(failing, mount_dir, maps):
    checkpoint, shard, tensor = failing
    with mounted(checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 0, "--ep-size", 2):
        uncache(shard_files(checkpoint))
        result = subprocess.run(["rankfs", "run", "--", sys.executable, "-X", "faulthandler", str(ROOT / "tests" / "hash_loader.py"),
                                 mount_dir / "target", "--hook"], cwd=ROOT, capture_output=True, text=True,
                                timeout=120, env={**os.environ, "RANKFS_HOOK_MAP": maps})
        assert result.returncode == 1, result.stderr[-2000:]  # an error, not a signal
        error = result.stderr.strip().splitlines()[-1]
        assert error.startswith("OSError") and shard in error and repr(tensor) in error
        _hash_all(mount_dir / "draft")


# A loader that comes once the hook's map readers have read every group of the file ahead (the
# hook's MappedFile: each group's pieces left to read).
_LATE_LOADER = """
import hashlib, sys, time
import torch
import rankfs.loader
from safetensors import safe_open
rankfs.loader.activate("on")
with safe_open(sys.argv[1], framework="pt") as f:
    while len(f._pieces_left) < len(f.groups) or any(f._pieces_left.values()):
        time.sleep(0.01)
    for name in sorted(f.keys()):
        hashlib.sha256(f.get_tensor(name).contiguous().view(torch.uint8).numpy())
"""


def test_a_source_failing_inside_what_was_read_ahead_fails_the_load_by_name(failing, mount_dir):
    """A read ahead of a piece of the sources that fails within the piece leaves its last page to be
    read alone, and well: a loader that comes once the read-ahead is done gets the error by name,
    not SIGBUS at the first touch of a page the disk could not give."""
    checkpoint, shard, tensor = failing
    with mounted(checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 0, "--ep-size", 2):
        uncache(shard_files(checkpoint))
        result = subprocess.run(["rankfs", "run", "--", sys.executable, "-c", _LATE_LOADER, mount_dir / "target" / shard],
                                cwd=ROOT, capture_output=True, text=True, timeout=120,
                                env={**os.environ, "RANKFS_HOOK_MAP": "on"})
    assert result.returncode == 1, result.stderr[-2000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("OSError") and shard in error and repr(tensor) in error
