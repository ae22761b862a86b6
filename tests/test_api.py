"""rankfs as a library (rankfs.mount, rankfs.attach) and Hugging Face repo ids as checkpoints: the
snapshot huggingface_hub's cache holds, in the cache's own layout (checked by huggingface_hub)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys

import pytest

import rankfs
from conftest import ROOT, mapped_digests
from rankfs.common import contract
from rankfs.mount.api import MountError, MountStatus

REPO = "deepseek-ai/DeepSeek-V4-Tiny"


@pytest.mark.mount
def test_the_python_api_mounts_loads_and_unmounts(tiny_checkpoint, mount_dir):
    mount_dir.mkdir()
    with rankfs.mount(tiny_checkpoint, mount_dir, tp_size=4, tp_rank=1, ep_size=1,
                      log=str(mount_dir.parent / "rankfs.log")) as mnt:
        assert mnt.pid > 0 and rankfs.attach(mount_dir).path == mnt.path
        digests = mapped_digests(mnt.path / "target")
        status = mnt.status()
        assert isinstance(status, MountStatus) and status.ranks and digests
        target = next(v for v in status.views if v.view == "target")
        assert target.active and target.loaded_bytes == target.planned_bytes > 0
        mnt.drop()
        assert mnt.status().held_bytes == 0
    assert contract.find_mount(mount_dir) is None
    with pytest.raises(MountError, match="not mounted"):
        rankfs.attach(mount_dir)


def _blob(cache_repo, path) -> str:
    """A file into the cache's blobs, named by its sha256 as huggingface_hub names LFS blobs."""
    data = path.read_bytes()
    name = hashlib.sha256(data).hexdigest()
    (cache_repo / "blobs" / name).write_bytes(data)
    return name


@pytest.fixture
def hub_cache(tiny_checkpoint, tmp_path, monkeypatch):
    """tiny_checkpoint in huggingface_hub's cache layout: blobs, a snapshot of symlinks into them,
    refs/main; huggingface_hub itself must find it offline."""
    cache = tmp_path / "hub"
    repo = cache / f"models--{REPO.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    for folder in (repo / "blobs", repo / "refs", snapshot):
        folder.mkdir(parents=True)
    for path in sorted(tiny_checkpoint.iterdir()):
        os.symlink(f"../../blobs/{_blob(repo, path)}", snapshot / path.name)
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    from huggingface_hub import scan_cache_dir, snapshot_download
    assert [r.repo_id for r in scan_cache_dir(cache).repos] == [REPO]
    assert snapshot_download(REPO, local_files_only=True, cache_dir=cache) == str(snapshot)
    return snapshot


def _rankfs(*args, env=None):
    return subprocess.run([sys.executable, "-m", "rankfs.mount.cli", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, env=env or os.environ, timeout=120)


@pytest.mark.mount
def test_a_repo_id_mounts_the_snapshot_the_cache_holds(hub_cache, tiny_checkpoint, mount_dir, tmp_path):
    mount_dir.mkdir()
    result = _rankfs("mount", REPO, mount_dir, "--tp-size", 4, "--tp-rank", 1, "--log", tmp_path / "log")
    assert result.returncode == 0, result.stderr
    try:
        assert hub_cache.name in contract.read_status(str(mount_dir))["checkpoint"]
        got = mapped_digests(mount_dir / "target")
    finally:
        _rankfs("umount", mount_dir)
    other = tmp_path / "direct"
    other.mkdir()
    with rankfs.mount(tiny_checkpoint, other, tp_size=4, tp_rank=1, log=str(tmp_path / "log2")) as mnt:
        assert got == mapped_digests(mnt.path / "target")


def test_a_repo_or_revision_the_cache_lacks_and_a_partial_snapshot_are_one_line_errors(hub_cache, tmp_path):
    mountpoint = tmp_path / "mnt"
    mountpoint.mkdir()
    for args, words in ((["not-there/Model"], "not in the Hugging Face cache"),
                        ([REPO, "--revision", "v9"], "revision 'v9' is not in the cache (cached: main)")):
        result = _rankfs("mount", *args, mountpoint, "--tp-size", 4, "--tp-rank", 1)
        assert result.returncode == 1 and words in result.stderr and len(result.stderr.splitlines()) == 1
    shard = sorted(hub_cache.glob("*.safetensors"))[0]
    os.unlink(os.path.realpath(shard))  # its blob gone: a download cut short
    result = _rankfs("mount", REPO, mountpoint, "--tp-size", 4, "--tp-rank", 1)
    assert result.returncode == 1 and "partial" in result.stderr and shard.name in result.stderr
    assert len(result.stderr.splitlines()) == 1 and contract.find_mount(mountpoint) is None
    result = _rankfs("plan", REPO, "--tp-size", 4)
    assert result.returncode == 1 and "partial" in result.stderr
    shutil.rmtree(hub_cache.parent.parent)
