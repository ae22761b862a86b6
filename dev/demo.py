"""`python3 -m dev demo`: the whole job on data it makes itself. Generate a DeepSeek-V4-class fixture,
mount rank 1 of TP4 (EP1, experts sliced), load both views through stock `safetensors.safe_open`
with the engines' expert narrowing, check every byte against the original, and unmount."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from dev.fixtures import deepseek_v4
from dev.mounting import rankfs
from rankfs.common import contract

FLAGS = ["--tp-size", "4", "--tp-rank", "1", "--ep-size", "1"]


def _rankfs(*args) -> str:
    result = rankfs(*args, check=False)
    if result.returncode:
        raise SystemExit(f"rankfs {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
    return result.stdout


def _load_view(view: Path, originals: dict[str, Path]) -> tuple[int, int, set[str]]:
    """Load like an engine's MoE loader: each tensor narrowed to this rank's slice, copied out;
    compared with the same narrowing of the original. Returns (tensors, bytes kept, dtypes)."""
    import torch
    from safetensors import safe_open
    count = kept = 0
    dtypes = set()
    for shard in sorted(view.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            slices = json.loads((f.metadata() or {}).get(contract.SLICES_KEY, "{}"))
            for name in f.keys():
                got = f.get_tensor(name)
                with safe_open(originals[name], "pt") as source:
                    want = source.get_tensor(name)
                if name in slices:
                    dim, start, stop = slices[name]
                    got, want = got.narrow(dim, start, stop - start), want.narrow(dim, start, stop - start)
                got, want = got.contiguous().reshape(-1), want.contiguous().reshape(-1)
                if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                    raise SystemExit(f"demo: {shard.name}: tensor {name} differs from the original")
                count += 1
                kept += got.numel() * got.element_size()
                dtypes.add(str(f.get_slice(name).get_dtype()))
    return count, kept, dtypes


def run_demo(workdir: Path) -> int:
    checkpoint, mountpoint = workdir / "checkpoint", workdir / "mnt"
    if checkpoint.exists():
        shutil.rmtree(checkpoint)
    mountpoint.mkdir(parents=True, exist_ok=True)
    print(f"1. writing a DeepSeek-V4-class fixture to {checkpoint}")
    deepseek_v4.write(checkpoint, deepseek_v4.FixtureSpec.tiny())
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    originals = {name: checkpoint / file for name, file in index.items()}
    print(f"   {len(originals)} tensors in {len(set(index.values()))} shards\n")
    print("2. the plan (headers only):")
    print(_rankfs("plan", str(checkpoint), "--tp-size", "4", "--rank", "1"))
    print(f"3. mounting rank 1 of TP4/EP1 at {mountpoint}")
    print("   " + _rankfs("mount", str(checkpoint), str(mountpoint), *FLAGS, "--log",
                          str(workdir / "rankfs.log")).strip())
    try:
        for view in ("target", "draft"):
            began = time.monotonic()
            count, kept, dtypes = _load_view(mountpoint / view, originals)
            print(f"4. {view}: loaded {count} tensors through stock safe_open in "
                  f"{time.monotonic() - began:.2f} s; {kept / 1e6:.1f} MB kept; dtypes "
                  f"{', '.join(sorted(dtypes))}; every byte equals the original's")
        status = contract.read_status(str(mountpoint))
        for v in status["views"]:
            print(f"   {v['view']}: planned {v['planned_bytes'] / 1e6:.1f} MB, served "
                  f"{v['served_bytes'] / 1e6:.1f} MB")
        print(f"   daemon read {status['read_bytes'] / 1e6:.1f} MB from disk "
              f"(of {sum(p.stat().st_size for p in checkpoint.glob('*.safetensors')) / 1e6:.1f} MB "
              f"in the checkpoint); peak held {status['peak_held_bytes'] / 1e6:.1f} MB")
    finally:
        print("5. " + _rankfs("umount", str(mountpoint)).strip())
    return 0
