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
from pathlib import Path

from dev.bench.bench import hook_env_variants, run_path
from dev.bench.engine_like import expert_counts, shard_files
from dev.memstate import cached_bytes, disk_read_bytes, uncache, warm
from dev.mounting import ROOT, mounted
from rankfs.common import contract
from rankfs.common.disk import block_queue, joined_pages
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.layout import plan_ranks
from rankfs.plan.profiles import BY_NAME
from rankfs.plan.spec import RankSpec

RANKFS_RUN = [sys.executable, "-m", "rankfs.mount.cli", "run", "--"]


def _layout(tp_size: int, tp_rank: int, ep_size: int) -> dict:
    moe_tp = tp_size // ep_size
    return {"moe_tp_size": moe_tp, "moe_tp_rank": tp_rank % moe_tp, "ep_size": ep_size, "ep_rank": tp_rank // moe_tp}


def _prepare_sources(args):
    """The checkpoint in the page cache (--warm), or out of it: its pages only, so that what the
    loads read from the disk is the checkpoint, not the libraries they import."""
    if args.warm:
        warm(shard_files(args.checkpoint))
    else:
        uncache(shard_files(args.checkpoint))


def _joined(spans) -> list[tuple[int, int, int]]:
    """(source, begin, end) spans as the whole pages they cover, those that share or touch joined."""
    by_source: dict[int, list] = {}
    for source, begin, end in spans:
        by_source.setdefault(source, []).append((begin, end))
    return [(source, begin, end) for source, pieces in sorted(by_source.items())
            for begin, end in joined_pages(pieces)]


def _union_bytes(spans) -> int:
    """Bytes of (source, begin, end) spans, each page counted once."""
    return sum(end - begin for _, begin, end in _joined(spans))


def _rank_plans(args, ranks: list[int]) -> dict[int, dict]:
    """Per rank: its target's source reads (source, begin, end) and tensor names (row stores left out)."""
    specs = [RankSpec(args.tp_size, rank, args.ep_size) for rank in ranks]
    plans = {}
    for layout in plan_ranks(Checkpoint.open(args.checkpoint), specs):
        target = layout.view("target")
        plans[layout.spec.tp_rank] = {
            "reads": [(f.source, b, e) for f in target.files for b, e in f.source_reads()],
            "names": [n for f in target.files for n in f.tensor_names if not BY_NAME["deepseek-v4"].is_on_demand(n)]}
    return plans


def _load_args(args, rank: int, directory, source: str, names: list[str], **extra) -> dict:
    return {"directory": str(directory), "counts_from": args.checkpoint, "device": args.device, "source": source,
            "names": names, "layout": _layout(args.tp_size, rank, args.ep_size), **extra}


def _run_ranks(loads: list[tuple[int, dict]], device: str) -> list[dict]:
    """One load per rank, each in a process of its own (dev.bench.paths), their clocks started
    together once every rank is set up (CUDA context, parameters allocated), as the engine's ranks
    start loading together on one host."""
    gpus = 1
    if device == "cuda":
        import torch
        gpus = max(1, torch.cuda.device_count())
    procs = []
    for i, (rank, load) in enumerate(loads):
        load = dict(load, device=f"cuda:{i % gpus}" if device == "cuda" else device)
        proc = subprocess.Popen([sys.executable, "-m", "dev.bench.paths", "load"], cwd=ROOT, text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={**os.environ, "RANKFS_RANK": str(rank)})
        proc.stdin.write(json.dumps(dict(load, start_together=True)) + "\n")
        proc.stdin.flush()
        procs.append(proc)
    for proc in procs:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(proc.stderr.read()[-3000:])
    for proc in procs:
        proc.stdin.write("go\n")
        proc.stdin.close()
    results = []
    for proc in procs:
        out, err = proc.stdout.read(), proc.stderr.read()
        if proc.wait():
            raise RuntimeError(err[-3000:])
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def load_like(args) -> int:
    """The engine-like loader, one process per rank, all at once: stock, the hook and InstantTensor
    (the rank's tensors; on CUDA); each rank checked bitwise against its stock load, and the bytes
    the ranks read from the disk against the union and the sum of their plans."""
    ranks = [int(r) for r in args.local_ranks.split(",")] if args.local_ranks else [args.tp_rank]
    plans = _rank_plans(args, ranks)
    union = _union_bytes(span for plan in plans.values() for span in plan["reads"])
    total = sum(_union_bytes(plan["reads"]) for plan in plans.values())
    rank_flags = ["--local-ranks", args.local_ranks] if args.local_ranks else ["--tp-rank", args.tp_rank]
    modes = [("stock", "stock", {}), ("hook", "stock", {"hook": True})]
    if args.device == "cuda":
        modes.append(("instanttensor", "instanttensor", {"filtered": True}))
    same = True
    _prepare_sources(args)
    paths = {i: str(p) for i, p in enumerate(shard_files(args.checkpoint))}
    union_ranges = [(paths[s], b, e - b) for s, b, e in _joined(span for plan in plans.values() for span in plan["reads"])]
    limit = run_path("raw", {"ranges": union_ranges, "direct": not args.warm})
    print(json.dumps({"mode": "limit: O_DIRECT preads of the union" if not args.warm else "limit: preads of the union",
                      "seconds": round(limit["seconds"], 3), "union_gb": round(union / 1e9, 3),
                      "gb_per_s": round(union / limit["seconds"] / 1e9, 2)}))
    with mounted(args.checkpoint, args.mountpoint, "--tp-size", args.tp_size, "--ep-size", args.ep_size,
                 *rank_flags) as mnt:
        stock = {}
        for mode, source, extra in modes:
            # With several local ranks every rank is started with the same shared view, as an engine is.
            directory = mnt / "target" if extra.get("hook") else args.checkpoint
            _prepare_sources(args)
            daemon = contract.read_status(str(mnt))["pid"]
            disk_before, daemon_before = _disk_read_bytes(args.checkpoint), disk_read_bytes(daemon)
            results = _run_ranks([(rank, _load_args(args, rank, directory, source, plans[rank]["names"], **extra))
                                  for rank in ranks], args.device)
            disk = _disk_read_bytes(args.checkpoint) - disk_before
            read = sum(r["disk_read_bytes"] for r in results) + disk_read_bytes(daemon) - daemon_before
            began = min(r["started"] for r in results)
            wall = max(r["started"] + r["seconds"] for r in results) - began
            for rank, r in zip(ranks, results):
                stock.setdefault(rank, r["weights_sha256"])
                equal = r["weights_sha256"] == stock[rank]
                same &= equal
                print(json.dumps({"mode": mode, "rank": rank, "seconds": round(r["seconds"], 3),
                                  "began_after": round(r["started"] - began, 3),  # its process's start-up, past the first's
                                  "bitwise": equal, "gb": round(r["bytes"] / 1e9, 3),
                                  "disk_read_gb": round(r["disk_read_bytes"] / 1e9, 3),
                                  "release": r.get("release")}))
            print(json.dumps({"mode": mode, "ranks": ranks, "seconds": round(wall, 3),
                              "union_gb": round(union / 1e9, 3), "sum_gb": round(total / 1e9, 3),
                              "aggregate_gb_per_s": round(union / wall / 1e9, 2),
                              "read_by_processes_gb": round(read / 1e9, 3), "read_x_union": round(read / union, 2),
                              "disk_read_gb": disk and round(disk / 1e9, 3),
                              "page_cache_left_gb": round(cached_bytes(shard_files(args.checkpoint)) / 1e9, 3)}))
    print(f"every rank bitwise equal to its stock load: {same}")
    return 0 if same else 1


def _disk_read_bytes(path) -> int:
    """Bytes read from the block device under `path` so far (/proc/diskstats; 0 off block devices)."""
    queue = block_queue(path)
    if queue is None:
        return 0
    name = queue.parent.name
    with open("/proc/diskstats") as f:
        for line in f:
            fields = line.split()
            if fields[2] == name:
                return int(fields[5]) * 512
    return 0


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
    return [{"directory": str(Path(directory) / phase), "model": args.checkpoint, "phase": phase, "layout": layout,
             "counts": counts, "device": args.device} for phase in ("target", "draft")]


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
    p.add_argument("--local-ranks", help="several ranks at once through one mount (e.g. 0,1,2,3), started together, "
                                         "spread over the GPUs there are")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warm", action="store_true", help="start each load with the sources in page cache")
    p.add_argument("--hook-env", default="", metavar="VARIANTS",
                   help="--engine sglang|vllm: the views' loads once per variant ('A=1,B=2;A=3', an empty one "
                        "for the defaults; default: the defaults only)")
    args = p.parse_args(argv)
    args.checkpoint = os.path.abspath(args.checkpoint)
    return load_like(args) if args.engine == "like" else load_engine(args)


if __name__ == "__main__":
    sys.exit(main())
