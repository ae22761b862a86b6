"""Per-rank views through a real mount, read with stock `safetensors.safe_open`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from conftest import expected_view, mounted
from dev.fixtures import deepseek_v4
from rankfs.common import contract

pytestmark = pytest.mark.mount

SPEC = deepseek_v4.FixtureSpec.tiny()


def raw(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def original_tensors(checkpoint: Path) -> dict[str, Path]:
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    return {name: checkpoint / file for name, file in index.items()}


def check_view(view_dir: Path, checkpoint: Path, expected: set[str], slices_allowed: bool = False):
    """The view holds exactly `expected`, bitwise equal to the original (sliced tensors: their
    slice), its index matches its files, and every other file is identical."""
    originals = original_tensors(checkpoint)
    index = json.loads((view_dir / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(p.name for p in view_dir.glob("*.safetensors"))
    assert sorted(set(index.values())) == shards
    seen, sources = set(), {}
    for shard in shards:
        with safe_open(view_dir / shard, "pt") as view:
            slices = json.loads((view.metadata() or {}).get("rankfs.slices", "{}"))
            assert slices_allowed or not slices
            for name in view.keys():
                assert index[name] == shard
                got = view.get_tensor(name)
                if originals[name] not in sources:
                    sources[originals[name]] = safe_open(originals[name], "pt")
                want = sources[originals[name]].get_tensor(name)
                assert got.dtype == want.dtype and got.shape == want.shape, name
                if name in slices:
                    dim, start, stop = slices[name]
                    got, want = got.narrow(dim, start, stop - start), want.narrow(dim, start, stop - start)
                assert torch.equal(raw(got.contiguous()), raw(want.contiguous())), name
                seen.add(name)
    assert seen == expected == set(index)
    for plain in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (view_dir / plain).read_bytes() == (checkpoint / plain).read_bytes()


@pytest.mark.parametrize("tp_size,ep_size", [(4, 1), (4, 2), (4, 4), (8, 8)])
def test_every_rank_gets_exactly_its_tensors_bitwise(tiny_checkpoint, tmp_path, tp_size, ep_size):
    names = set(original_tensors(tiny_checkpoint))
    dtypes = set()
    for rank in range(tp_size):
        moe_tp = tp_size // ep_size
        with mounted(tiny_checkpoint, tmp_path / f"rank{rank}", "--tp-size", tp_size, "--tp-rank", rank,
                     "--ep-size", ep_size, "--tp-slice", "off") as mnt:
            for view in ("target", "draft"):
                expected = expected_view(names, SPEC.experts, SPEC.draft_experts, ep_size,
                                         rank // moe_tp, view)
                check_view(mnt / view, tiny_checkpoint, expected)
            with safe_open(next((mnt / "target").glob("*.safetensors")), "pt") as f:
                dtypes |= {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes >= {"I8", "F8_E8M0", "F8_E4M3", "BF16", "F32"}


def test_several_local_ranks_share_one_mount(tiny_checkpoint, mount_dir):
    names = set(original_tensors(tiny_checkpoint))
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--ep-size", 2, "--local-ranks", "all"):
        assert sorted(p.name for p in mount_dir.iterdir()) == [
            ".rankfs", "draft", "rank-0", "rank-1", "rank-2", "rank-3", "target"]
        for rank in range(4):
            check_view(mount_dir / f"rank-{rank}" / "target", tiny_checkpoint,
                       expected_view(names, SPEC.experts, SPEC.draft_experts, 2, rank // 2, "target"),
                       slices_allowed=True)


def test_every_view_is_laid_out_once_mounted_before_any_shard_is_opened(tiny_checkpoint, mount_dir):
    """The daemon lays out each rank's views in the background once the mount is ready (its status
    lists a view once it is), so that a load's first open does not wait for the layout."""
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 4, "--ep-size", 2, "--local-ranks", "all"):
        views = {f"{rank.name}/{view.name}" for rank in mount_dir.glob("rank-*") for view in rank.iterdir()
                 if view.is_dir()}
        deadline = time.monotonic() + 60
        while {v["view"] for v in contract.read_status(mount_dir)["views"]} != views:
            assert time.monotonic() < deadline, "the views were not laid out"
            time.sleep(0.05)
        check_view(mount_dir / "rank-1" / "target", tiny_checkpoint,
                   expected_view(set(original_tensors(tiny_checkpoint)), SPEC.experts, SPEC.draft_experts, 2, 0,
                                 "target"), slices_allowed=True)


def test_whole_file_reads_match_the_files_safetensors_would_write(tiny_checkpoint, mount_dir):
    """Read each virtual file in one go (as --weight-loader-disable-mmap does) and parse it with
    safetensors' own bytes loader: the file itself is a valid safetensors file."""
    from safetensors import deserialize
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 2, "--tp-rank", 1, "--ep-size", 2):
        for shard in (mount_dir / "target").glob("*.safetensors"):
            tensors = dict(deserialize(shard.read_bytes()))
            with safe_open(shard, "pt") as f:
                assert sorted(tensors) == sorted(f.keys())
                for name, info in tensors.items():
                    assert bytes(info["data"]) == raw(f.get_tensor(name)).numpy().tobytes(), name


def test_mount_is_read_only(tiny_checkpoint, mount_dir):
    import errno
    import os
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 1, "--tp-rank", 0):
        target = mount_dir / "target"
        shard = next(target.glob("*.safetensors"))
        for attempt in (lambda: open(shard, "r+b"), lambda: (target / "new").write_text("x"),
                        lambda: os.rename(shard, target / "moved"), lambda: os.chmod(shard, 0o777),
                        lambda: os.unlink(shard), lambda: os.truncate(shard, 0)):
            with pytest.raises(OSError) as info:
                attempt()
            assert info.value.errno == errno.EROFS
