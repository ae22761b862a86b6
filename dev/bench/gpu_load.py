"""End-to-end load into CUDA memory: the stock path (mmap of the original files, pageable copies)
against the rankfs view through the hook (staged on the GPU; page-locked host slabs with
RANKFS_HOOK_DEVICE=cpu), each in a process of its own.

    python3 -m dev.bench.gpu_load CHECKPOINT MOUNTPOINT [--tp-size 4 --tp-rank 1 --ep-size 1] [--warm]

Mounts the rank's view, loads it both ways with the engine-like loader, checks that every parameter
is bitwise equal (digests of the GPU bytes), and prints the memory figures after each load: RSS,
MemAvailable lost, CUDA reserved, and for the hook its release report (slabs, windows, pinned,
leftovers). Each load starts with the sources out of the page cache (the hook reads them with
O_DIRECT), or with `--warm` in it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dev.bench.engine_like import digest, shard_files
from dev.bench.run import drop_caches, warm
from dev.session import ROOT, mounted


def child(mode: str, directory: str, counts_from: str, layout: dict, device: str) -> dict:
    import gc

    import torch

    from dev.bench.engine_like import MoELayout, expert_counts, load
    from rankfs.loader import memory
    from rankfs.plan.profiles import BY_NAME
    torch.empty(1, device=device)  # the CUDA context belongs to the baseline
    baseline = memory.snapshot()
    if mode == "hook":
        import rankfs.loader as loader
        loader.activate("on")
    profile = BY_NAME["deepseek-v4"]
    config = json.loads((Path(counts_from) / "config.json").read_text())
    began = time.monotonic()
    params = load(directory, profile, MoELayout(**layout), counts=expert_counts(shard_files(counts_from), profile),
                  keep=lambda n: not profile.is_draft(n, config), device=device)
    if device != "cpu":
        torch.cuda.synchronize()
    seconds = time.monotonic() - began
    out = {"mode": mode, "seconds": seconds, "params": len(params),
           "bytes": sum(p.numel() * p.element_size() for p in params.values())}
    if mode == "hook":
        import rankfs.loader as loader
        figures = loader.release("target")
        out["release"] = {k: figures[k] for k in (
            "pinned", "staged_on", "slabs", "windows", "slab_requests", "peak_slab_bytes", "peak_host_bytes",
            "peak_device_bytes", "slabs_alive", "torch_host_allocs", "nontorch_since_load_start")}
    else:  # what an engine does after a stock load
        gc.collect()
        memory.malloc_trim()
        memory.return_pinned_and_cached()
    after = memory.snapshot()
    reserved = after["cuda_reserved"] - baseline["cuda_reserved"]
    out.update(rss_growth=after["rss"] - baseline["rss"],
               mem_available_lost=baseline["memavailable"] - after["memavailable"],
               cuda_reserved_growth=reserved, cached_growth=after["cached"] - baseline["cached"])
    out["digests"] = {name: digest(p) for name, p in sorted(params.items())}
    return out


def _child_command(args, rank: int, mode: str, directory: str, device: str) -> list[str]:
    return [sys.executable, "-m", "dev.bench.gpu_load", args.checkpoint, args.mountpoint, "--tp-size", str(args.tp_size),
            "--tp-rank", str(rank), "--ep-size", str(args.ep_size), "--device", device,
            "--_child", mode, directory, "x"]


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(err[-3000:])
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("mountpoint")
    p.add_argument("--tp-size", type=int, default=4)
    p.add_argument("--tp-rank", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--local-ranks", help="several ranks at once through one mount (e.g. 0,1), one GPU each")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warm", action="store_true", help="start each load with the sources in page cache")
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    moe_tp = args.tp_size // args.ep_size
    if args._child:
        layout = {"moe_tp_size": moe_tp, "moe_tp_rank": args.tp_rank % moe_tp, "ep_size": args.ep_size,
                  "ep_rank": args.tp_rank // moe_tp}
        mode, directory, _ = args._child
        print(json.dumps(child(mode, directory, args.checkpoint, layout, args.device)))
        return 0
    ranks = [int(r) for r in args.local_ranks.split(",")] if args.local_ranks else [args.tp_rank]
    devices = [f"cuda:{i}" if args.device == "cuda" and len(ranks) > 1 else args.device for i in range(len(ranks))]
    rank_flags = ["--local-ranks", args.local_ranks] if args.local_ranks else ["--tp-rank", args.tp_rank]
    results = {}
    with mounted(args.checkpoint, args.mountpoint, "--tp-size", args.tp_size, "--ep-size", args.ep_size,
                 *rank_flags) as mnt:
        # With several local ranks every rank is started with the same shared view, as an engine is.
        for mode, directory in (("stock", args.checkpoint), ("hook", str(mnt / "target"))):
            if args.warm:
                warm(shard_files(args.checkpoint))
            else:
                drop_caches()
            procs = [subprocess.Popen(_child_command(args, rank, mode, directory, device), cwd=ROOT, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      env={**os.environ, "RANKFS_RANK": str(rank)})
                     for rank, device in zip(ranks, devices)]
            results[mode] = [_finish(proc) for proc in procs]
    same = True
    for rank, stock, hook in zip(ranks, results["stock"], results["hook"]):
        equal = stock["digests"] == hook["digests"]
        same &= equal
        for r in (stock, hook):
            r["params"] = len(r.pop("digests"))
            print(json.dumps({"rank": rank, **r}))
        print(f"rank {rank}: bitwise equal in {args.device} memory: {equal} ({stock['params']} parameters, "
              f"{stock['bytes'] / 1e9:.2f} GB)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
