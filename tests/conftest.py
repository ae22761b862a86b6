"""Shared fixtures: generated checkpoints, and real mounts made with the `rankfs` command line.

Tests marked `mount` mount real FUSE filesystems: they need root (they mount, and set kernel
tunables) and /dev/fuse, and fail without them (a machine that cannot mount is a failed run, not a
skip). The others run as any user."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dev.fixtures import deepseek_v4
from dev.mounting import ROOT, mounted, rankfs  # noqa: F401  (the tests import them from here)
from rankfs.common import contract


def pytest_runtest_setup(item):
    if item.get_closest_marker("mount") is None:
        return
    problems = []
    if not os.path.exists("/dev/fuse"):
        problems.append("/dev/fuse is missing")
    if os.geteuid() != 0:
        problems.append("not root")
    if problems:
        pytest.fail("this test mounts a FUSE filesystem and sets kernel tunables: " + "; ".join(problems),
                    pytrace=False)


def checkout_env(**extra) -> dict:
    """The environment of a child Python that imports the checkout first, then whatever path rankfs
    and the engines were found on."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **extra}


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return deepseek_v4.write(tmp_path_factory.mktemp("ckpt") / "dsv4", deepseek_v4.FixtureSpec.tiny())


@pytest.fixture(scope="session")
def large_checkpoint(tmp_path_factory) -> Path:
    # ~0.6 GB: over four times a 128 MiB budget.
    spec = deepseek_v4.FixtureSpec(layers=8, experts=16, hidden=2048, inter=1024, vocab=4096, shards=8,
                                   draft_shards=1, draft_experts=8, draft_stages=1, engram_rows=1024)
    return deepseek_v4.write(tmp_path_factory.mktemp("large") / "dsv4", spec)


@contextlib.contextmanager
def through_faulty_fs(source: Path, mountpoint: Path, shard: str, begin: int, length: int, meet: int = 0):
    """The checkpoint seen through tests/faulty_fs.py, whose reads of [begin, begin + length) of one
    shard fail (or, with `meet`, wait to meet others): yields the server, whose last line says how
    many met once this returns."""
    mountpoint.mkdir(exist_ok=True)
    server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "faulty_fs.py"), source, mountpoint,
                               shard, str(begin), str(length), str(meet)], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().strip() == "ready"
        yield server
    finally:
        subprocess.run(["fusermount3", "-u", str(mountpoint)], check=False)
        server.wait(timeout=30)


@pytest.fixture
def mount_dir(tmp_path) -> Path:
    return tmp_path / "mnt"


def settled_status(mount_dir, timeout: float = 30) -> dict:
    """The daemon's status once it has dropped every served source page from the page cache (a
    thread of its own does that, just after the replies)."""
    deadline = time.monotonic() + timeout
    while (status := contract.read_status(str(mount_dir)))["uncache_pending_bytes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return status


def mapped_digests(directory) -> dict[str, str]:
    """Each shard's digest, read through a map in file order (page faults, as mmap loaders read)."""
    digests = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with open(shard, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
            digests[shard.name] = hashlib.sha256(mapped).hexdigest()
    return digests


def direct_digests(directory) -> dict[str, str]:
    """Each shard's digest, read with O_DIRECT: every byte a request the daemon answers, none of
    the page cache."""
    digests = {}
    buffer = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT wants
    for shard in sorted(directory.glob("*.safetensors")):
        digest, fd, offset = hashlib.sha256(), os.open(shard, os.O_RDONLY | os.O_DIRECT), 0
        try:
            while done := os.preadv(fd, [buffer], offset):
                digest.update(buffer[:done])
                offset += done
        finally:
            os.close(fd)
        digests[shard.name] = digest.hexdigest()
    return digests


EXPERT = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.experts\.(\d+)\.(w[123])\.")


def expected_view(names, n_experts: int, draft_experts: int, ep_size: int, ep_rank: int, view: str):
    """The tensors a rank's view must hold, computed independently of rankfs' planner."""
    out = set()
    for name in names:
        if name.startswith("mtp.") != (view == "draft"):
            continue
        match = EXPERT.match(name)
        if match:
            per_rank = (draft_experts if view == "draft" else n_experts) // ep_size
            if not ep_rank * per_rank <= int(match[1]) < (ep_rank + 1) * per_rank:
                continue
        out.add(name)
    return out


@pytest.fixture
def copied_checkpoint(tiny_checkpoint, tmp_path) -> Path:
    """A private copy, for tests that damage it."""
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "ckpt"))
