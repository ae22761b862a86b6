"""End-to-end loads into CUDA memory, checked bitwise against the same loader on the original shards.

    python3 -m dev gpu-load CHECKPOINT MOUNTPOINT [--tp-size 4 --tp-rank 1 --ep-size 1] [--warm]
    python3 -m dev gpu-load CHECKPOINT MOUNTPOINT --engine sglang [--hook-env ';RANKFS_HOOK_MAP=off']

`--engine like` (the default): the engine-like loader (dev.bench.engine_like), the stock path (mmap
of the original files, pageable copies) against the rank's view through the hook (staged on the
GPU; page-locked host slabs with RANKFS_HOOK_DEVICE=cpu), each in a process of its own; with
`--local-ranks`, every rank at once through one mount, as a host of several GPUs starts them.

`--engine sglang|vllm`: the engine's own DefaultModelLoader (dev.engine_driver) loads the target
and then the draft, of the original shards, then of the mount's views under `rankfs run`, once per
set of hook variables (`--hook-env`): each load released once when it returns, nothing pinned and
no slab left, and CUDA's allocator holding the parameters and nothing more.

Each prints the memory figures after each load. Each load starts with the sources out of the page
cache (the hook reads them with O_DIRECT), or with `--warm` in it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dev.bench.engine_like import digest, expert_counts, shard_files
from dev.bench.bench import drop_caches, hook_env_variants, warm
from dev.mounting import ROOT, mounted
from rankfs.plan.profiles import BY_NAME

RANKFS_RUN = [sys.executable, "-m", "rankfs.mount.cli", "run", "--"]


def child(mode: str, directory: str, counts_from: str, layout: dict, device: str) -> dict:
    import gc

    import torch

    from dev.bench.engine_like import MoELayout, load
    from rankfs.loader import memory
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


def _layout(tp_size: int, tp_rank: int, ep_size: int) -> dict:
    moe_tp = tp_size // ep_size
    return {"moe_tp_size": moe_tp, "moe_tp_rank": tp_rank % moe_tp, "ep_size": ep_size, "ep_rank": tp_rank // moe_tp}


def _child_command(args, rank: int, mode: str, directory: str, device: str) -> list[str]:
    return [sys.executable, "-m", "dev.bench.gpu_load", args.checkpoint, args.mountpoint, "--tp-size", str(args.tp_size),
            "--tp-rank", str(rank), "--ep-size", str(args.ep_size), "--device", device,
            "--_child", mode, directory, "x"]


def _finish(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise RuntimeError(err[-3000:])
    return json.loads(out.strip().splitlines()[-1])


def _prepare_sources(args):
    if args.warm:
        warm(shard_files(args.checkpoint))
    else:
        drop_caches()


def load_like(args) -> int:
    """The engine-like loader, stock against the hook, one process per rank."""
    ranks = [int(r) for r in args.local_ranks.split(",")] if args.local_ranks else [args.tp_rank]
    devices = [f"cuda:{i}" if args.device == "cuda" and len(ranks) > 1 else args.device for i in range(len(ranks))]
    rank_flags = ["--local-ranks", args.local_ranks] if args.local_ranks else ["--tp-rank", args.tp_rank]
    results = {}
    with mounted(args.checkpoint, args.mountpoint, "--tp-size", args.tp_size, "--ep-size", args.ep_size,
                 *rank_flags) as mnt:
        # With several local ranks every rank is started with the same shared view, as an engine is.
        for mode, directory in (("stock", args.checkpoint), ("hook", str(mnt / "target"))):
            _prepare_sources(args)
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


def _drive(engine: str, jobs: list[dict], runner: list[str], env: dict) -> tuple[list[dict], str]:
    """The engine's real loader over `jobs` (dev.engine_driver) in a process of its own."""
    result = subprocess.run([*runner, sys.executable, "-m", "dev.engine_driver", engine, json.dumps(jobs)],
                            cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env})
    if result.returncode:
        raise RuntimeError(f"{engine} driver exited {result.returncode}:\n{result.stderr[-4000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")], result.stderr


def _engine_jobs(directory, args) -> list[dict]:
    counts = expert_counts(shard_files(args.checkpoint), BY_NAME["deepseek-v4"])
    layout = _layout(args.tp_size, args.tp_rank, args.ep_size)
    return [{"directory": str(Path(directory) / phase), "phase": phase, "layout": layout, "counts": counts,
             "device": args.device} for phase in ("target", "draft")]


def _verdict(report: dict, original: dict, released: list[str], stderr: str) -> dict:
    """One load through the hook against the same phase of the originals."""
    figures = report["release_figures"][-1] if report["release_figures"] else {}
    cuda = report.get("cuda") or {}
    return {"phase": report["phase"], "seconds": round(report["seconds"], 3),
            "bitwise": report["digests"] == original["digests"] and bool(original["digests"]),
            "parameters": len(report["digests"]), "released": report["releases"],
            "released_once": report["releases"] == released
            and stderr.count(f"rankfs hook memlog: phase={report['phase']} ") == released.count(report["phase"]),
            "pinned_bytes": figures.get("pinned_bytes"), "slabs_alive": report["slabs_alive"][-1:] or None,
            "staged_on": figures.get("staged_on"), "peak_device_bytes": figures.get("peak_device_bytes"),
            "peak_host_bytes": figures.get("peak_host_bytes"), "release_seconds": figures.get("release_seconds"),
            # What CUDA's allocator holds beyond the engine's parameters once the load returned.
            "cuda_beyond_parameters": cuda.get("reserved", 0) - cuda.get("parameters", 0) if cuda else None}


def load_engine(args) -> int:
    """The engine's DefaultModelLoader on the originals, then on the views under `rankfs run`, once
    per set of hook variables."""
    _prepare_sources(args)
    originals, _ = _drive(args.engine, [dict(job, directory=args.checkpoint) for job in _engine_jobs(
        args.checkpoint, args)], [], {})
    by_phase = {r["phase"]: r for r in originals}
    for r in originals:
        print(json.dumps({"variant": "originals", "phase": r["phase"], "seconds": round(r["seconds"], 3),
                          "parameters": len(r["digests"]), "cuda": r.get("cuda")}))
    ok = True
    with mounted(args.checkpoint, args.mountpoint, "--tp-size", args.tp_size, "--tp-rank", args.tp_rank,
                 "--ep-size", args.ep_size) as mnt:
        for env in hook_env_variants(args.hook_env):
            _prepare_sources(args)
            reports, stderr = _drive(args.engine, _engine_jobs(mnt, args), RANKFS_RUN, env)
            released: list[str] = []
            for report in reports:
                released = released + [report["phase"]]
                verdict = _verdict(report, by_phase[report["phase"]], released, stderr)
                ok &= (verdict["bitwise"] and verdict["released_once"] and verdict["pinned_bytes"] == 0
                       and verdict["slabs_alive"] == [0])
                print(json.dumps({"variant": ",".join(f"{k}={v}" for k, v in env.items()) or "defaults", **verdict}))
            print("\n".join(line for line in stderr.splitlines() if "rankfs hook memlog" in line))
    print(f"{args.engine}: every load bitwise equal, released once, nothing pinned or left: {ok}")
    return 0 if ok else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m dev gpu-load", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("mountpoint")
    p.add_argument("--engine", choices=("like", "sglang", "vllm"), default="like",
                   help="the engine-like loader, or an engine's own DefaultModelLoader (default: like)")
    p.add_argument("--tp-size", type=int, default=4)
    p.add_argument("--tp-rank", type=int, default=1)
    p.add_argument("--ep-size", type=int, default=1)
    p.add_argument("--local-ranks", help="several ranks at once through one mount (e.g. 0,1), one GPU each")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warm", action="store_true", help="start each load with the sources in page cache")
    p.add_argument("--hook-env", default="", metavar="VARIANTS",
                   help="--engine sglang|vllm: the views' loads once per variant ('A=1,B=2;A=3', an empty one "
                        "for the defaults; default: the defaults only)")
    p.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.checkpoint = os.path.abspath(args.checkpoint)
    if args._child:
        mode, directory, _ = args._child
        print(json.dumps(child(mode, directory, args.checkpoint, _layout(args.tp_size, args.tp_rank, args.ep_size),
                               args.device)))
        return 0
    return load_like(args) if args.engine == "like" else load_engine(args)


if __name__ == "__main__":
    sys.exit(main())
