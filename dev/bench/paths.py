"""One benchmark path, run in a process of its own so that its peak memory is its own:

    python3 -m dev.bench.paths KIND < arguments.json   ->  one JSON line on stdout

KIND: load (a source from dev.bench.sources into the engine-like copies, optionally through the
hook), raw (parallel preads of exact byte ranges, O_DIRECT or buffered, optionally copied to CUDA),
push (the same ranges pushed into the page cache of FUSE files: dev.bench.push_limit).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dev.bench import sources
from dev.bench.engine_like import (MoELayout, Progress, allocate, copy_weights, expert_counts, shard_files,
                                   weights_digest)
from dev.memstate import cpu_seconds, disk_read_bytes, vm_hwm
from rankfs.plan.profiles import BY_NAME
from rankfs.common.disk import anonymous_map

PROFILE = BY_NAME["deepseek-v4"]


def _timed(work, progress: Progress) -> dict:
    """Runs `work` and times it; whatever it returns is freed after the clock stops (an engine keeps
    its weights: their freeing is no part of a load)."""
    samples, done = [], threading.Event()
    began, cpu, disk = time.monotonic(), cpu_seconds(), disk_read_bytes()

    def sample():
        while not done.wait(0.02):
            samples.append((round(time.monotonic() - began, 3), progress.bytes))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    kept = work()
    seconds, cpu, disk = time.monotonic() - began, cpu_seconds() - cpu, disk_read_bytes() - disk
    done.set()
    sampler.join()
    samples.append((round(seconds, 3), progress.bytes))
    del kept
    return {"seconds": seconds, "started": began, "bytes": progress.bytes, "timeline": samples, "peak_rss": vm_hwm(),
            "cpu_seconds": cpu, "disk_read_bytes": disk, "waited": progress.waited, "copying": progress.copying}


def _weights(args: dict):
    """The (name, tensor) iterator of a load, and what was staged before the clock."""
    files = shard_files(args["directory"])
    kind = args["source"]
    if kind == "stock":
        return sources.stock(files)
    if kind == "ep-filter":
        layout = args["layout"]
        return sources.ep_filtered(files, args["n_experts"], layout["ep_size"], layout["ep_rank"])
    if kind == "staged":
        return sources.Staged(files, set(args["names"]), pin=args["device"] != "cpu")
    if kind == "instanttensor":
        return sources.instanttensor(files, args["device"], args.get("backend"),
                                     set(args["names"]) if args.get("filtered") else None)
    if kind == "fastsafetensors":
        return sources.fastsafetensors(files, args["device"])
    if kind == "runai":
        return sources.runai(files)
    raise ValueError(f"unknown source {kind!r}")


def _drain(weights, progress: Progress):
    """Take each tensor and drop it: how fast the source hands a load its tensors, with the
    engine's copies free (the loop's whole time counts as waiting for them)."""
    began = time.monotonic()
    for _, tensor in weights:
        progress.add(tensor.numel() * tensor.element_size())
    progress.waited = time.monotonic() - began


def run_load(args: dict) -> dict:
    import torch
    if args.get("hook"):
        if args.get("hook_trace"):
            os.environ["RANKFS_HOOK_TRACE"] = args["hook_trace"]
        import rankfs.loader
        rankfs.loader.activate("on")
    layout = MoELayout(**args["layout"])
    counts = expert_counts(shard_files(args["counts_from"]), PROFILE)
    config = json.loads(open(os.path.join(args["counts_from"], "config.json")).read())
    keep = (lambda name: not PROFILE.is_draft(name, config))
    progress = Progress()
    if args["device"] != "cpu":
        torch.empty(1, device=args["device"])  # the CUDA context is the engine's, made before it loads
        args["device"] = f"cuda:{torch.cuda.current_device()}"  # the peers want an index
    copies = args.get("copies", True)
    params = allocate(shard_files(args["counts_from"]), PROFILE, layout, counts, keep, args["device"]) if copies else {}
    weights = _weights(args)
    if args.get("start_together"):  # ranks set up, each waits for the others, as an engine's ranks do
        print("ready", flush=True)
        sys.stdin.readline()

    def work():
        if not copies:
            return _drain(weights, progress)
        copy_weights(weights, PROFILE, layout, counts, keep=keep, device=args["device"], progress=progress,
                     params=params)
        if args["device"] != "cpu":
            torch.cuda.synchronize()
        return params
    result = _timed(work, progress)
    if args.get("hook"):
        import rankfs.loader
        figures = rankfs.loader.release("target")
        result["release_seconds"] = figures["release_seconds"]  # the engine waits for it too
        result["release"] = {k: figures[k] for k in ("slabs", "windows", "window_bytes", "slab_requests",
                                                     "peak_slab_bytes", "peak_host_bytes", "peak_device_bytes",
                                                     "staged_on", "slabs_alive", "pinned", "pinned_bytes",
                                                     "nontorch_since_load_start", "release_steps",
                                                     "source_direct_bytes", "source_cached_bytes", "cores",
                                                     "budget_bytes", "copy_threads")}
    if copies:
        result["weights_sha256"] = weights_digest(params)  # after the clock and the release: the benchmark compares rows
    return result


def run_raw(args: dict) -> dict:
    """The limit: exactly the rank's byte ranges, 16 threads, 16 MiB requests, each thread reading
    into one buffer of its own (a fresh one per read costs a zero-filled page fault per 4 KiB); with
    `h2d`, each piece then copied into CUDA memory from page-locked buffers."""
    direct, h2d = args["direct"], args.get("h2d", False)
    piece = 16 << 20
    progress = Progress()
    jobs = [(path, off + i, min(piece, length - i)) for path, off, length in args["ranges"]
            for i in range(0, length, piece)]
    local = threading.local()
    if h2d:
        import torch
        target = torch.empty(piece, dtype=torch.uint8, device="cuda")

    def read(job):
        path, offset, length = job
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            start = offset - offset % 4096 if direct else offset
            end = -(-(offset + length) // 4096) * 4096 if direct else offset + length
            if not hasattr(local, "map"):
                local.map = anonymous_map(piece + 2 * 4096)
                if h2d:
                    local.host = torch.frombuffer(local.map, dtype=torch.uint8)
                    torch.cuda.cudart().cudaHostRegister(local.host.data_ptr(), len(local.map), 0)
                    local.stream = torch.cuda.Stream()
            os.preadv(fd, [memoryview(local.map)[:end - start]], start)
            if h2d:
                with torch.cuda.stream(local.stream):
                    target[:length].copy_(local.host[offset - start:offset - start + length], non_blocking=True)
                local.stream.synchronize()
            progress.add(length)
        finally:
            os.close(fd)

    def work():
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(read, jobs))
    return _timed(work, progress)


def run_push(args: dict) -> dict:
    from dev.bench import push_limit  # FUSE only for this path
    return push_limit.run_push(args, _timed)


RUNNERS = {"load": run_load, "raw": run_raw, "push": run_push}

if __name__ == "__main__":
    kind, payload = sys.argv[1], json.loads(sys.stdin.readline())
    print(json.dumps(RUNNERS[kind](payload)))
