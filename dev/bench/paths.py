"""One benchmark path, run in a process of its own so that its peak RSS is its own:

    python3 -m dev.bench.paths KIND < arguments.json   ->  one JSON line on stdout

KIND: engine (the engine-like loader over a directory, optionally through the hook), runai,
fastsafetensors, raw (parallel preads of exact byte ranges, O_DIRECT or buffered).
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from dev.bench.engine_like import MoELayout, Progress, expert_counts, load, shard_files
from rankfs.plan.profiles import BY_NAME


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _timed(work, progress: Progress) -> dict:
    """Runs `work` and times it; whatever it returns is freed after the clock stops (an engine keeps
    its weights: their munmap is no part of a load)."""
    samples, done = [], threading.Event()
    began = time.monotonic()

    def sample():
        while not done.wait(0.05):
            samples.append((round(time.monotonic() - began, 3), progress.bytes))
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    kept = work()
    seconds = time.monotonic() - began
    done.set()
    sampler.join()
    samples.append((round(seconds, 3), progress.bytes))
    del kept
    return {"seconds": seconds, "bytes": progress.bytes, "timeline": samples, "peak_rss": _peak_rss()}


def run_engine(args: dict) -> dict:
    import torch
    if args.get("hook"):
        import rankfs.loader as loader
        loader.activate("on")
    profile = BY_NAME[args["profile"]]
    layout = MoELayout(**args["layout"])
    counts = expert_counts(shard_files(args["counts_from"]), profile)
    progress = Progress()
    config = json.loads(open(os.path.join(args["counts_from"], "config.json")).read())
    keep = (lambda name: not profile.is_draft(name, config))

    def work():
        params = load(args["directory"], profile, layout, counts=counts, keep=keep, device=args["device"],
                      progress=progress)
        if args["device"] != "cpu":
            torch.cuda.synchronize()
        return params
    result = _timed(work, progress)
    if args.get("hook"):
        import rankfs.loader as loader
        result["release"] = {k: v for k, v in loader.release("target").items()
                             if k in ("slabs", "slab_requests", "peak_slab_bytes", "slabs_alive", "pinned",
                                      "nontorch_since_load_start")}
    return result


def run_runai(args: dict) -> dict:
    from runai_model_streamer import SafetensorsStreamer
    progress = Progress()

    def work():
        with SafetensorsStreamer() as streamer:
            streamer.stream_files(args["files"])
            for _, tensor in streamer.get_tensors():
                progress.add(tensor.numel() * tensor.element_size())
    return _timed(work, progress)


def run_fastsafetensors(args: dict) -> dict:
    from fastsafetensors import fastsafe_open
    progress = Progress()

    def work():
        with fastsafe_open(filenames=args["files"], nogds=True, device="cpu") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                progress.add(tensor.numel() * tensor.element_size())
    return _timed(work, progress)


def run_raw(args: dict) -> dict:
    """The limit: exactly the rank's byte ranges, 16 threads, 16 MiB requests, each thread reading
    into one buffer of its own (a fresh one per read costs a zero-filled page fault per 4 KiB)."""
    direct = args["direct"]
    piece = 16 << 20
    progress = Progress()
    jobs = [(path, off + i, min(piece, length - i)) for path, off, length in args["ranges"]
            for i in range(0, length, piece)]
    buffers = threading.local()

    def read(job):
        path, offset, length = job
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            start = offset - offset % 4096 if direct else offset
            end = -(-(offset + length) // 4096) * 4096 if direct else offset + length
            if not hasattr(buffers, "map"):
                buffers.map = mmap.mmap(-1, piece + 2 * 4096)
            os.preadv(fd, [memoryview(buffers.map)[:end - start]], start)
            progress.add(length)
        finally:
            os.close(fd)

    def work():
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(read, jobs))
    return _timed(work, progress)


RUNNERS = {"engine": run_engine, "runai": run_runai, "fastsafetensors": run_fastsafetensors, "raw": run_raw}

if __name__ == "__main__":
    kind, payload = sys.argv[1], json.load(sys.stdin)
    print(json.dumps(RUNNERS[kind](payload)))
