"""The benchmark: one run compares, for one rank's view of a generated checkpoint, the stock
engine-style path, rankfs (with and without the hook), the peers that run here, and the physical
limit (the fastest raw read of exactly the bytes the rank needs); then the same loader with the
backing files in page cache, where what is left is the cost of the FUSE path.

    python3 -m dev bench [--size-gb 8] [--cases ep2,ep1-sliced] [--device cpu|cuda] [--out DIR]

Prints one table per rank case (seconds, GB/s of the rank's bytes, ratio to the limit, peak RSS of
loader and daemon, MemAvailable lost and page cache left after the load), writes results.json and
a PNG of bytes over time per path. Ratios from one run hold; absolute times on shared machines do
not. Caches are dropped before each cold path (needs root; otherwise it says so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from dev.fixtures import deepseek_v4
from rankfs.loader.memory import meminfo
from dev.session import ROOT, mounted
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.layout import plan_rank
from rankfs.plan.spec import RankSpec
from rankfs.reader.io import block_queue, merge_adjacent

CASES = {  # name -> (tp_size, tp_rank, ep_size): an EP2 rank (experts whole), an EP1 rank (sliced)
    "ep2": (4, 0, 2),
    "ep1-sliced": (4, 1, 1),
}


def drop_caches() -> bool:
    if os.geteuid() != 0:
        return False
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    return True


def warm(files):
    for path in files:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def readahead_file(path: Path) -> Path:
    return block_queue(path) / "read_ahead_kb"


def run_path(kind: str, args: dict) -> dict:
    result = subprocess.run([sys.executable, "-m", "dev.bench.paths", kind], input=json.dumps(args), cwd=ROOT,
                            capture_output=True, text=True)
    if result.returncode != 0:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(result.stdout.strip().splitlines()[-1])


def rank_ranges(layout) -> list[tuple[str, int, int]]:
    """(source path, offset, length) of exactly the bytes the target view reads, merged."""
    spans = [(str(layout.sources[e.source].path), e.source_offset, e.source_offset + e.length)
             for vfile in layout.view("target").files for e in vfile.extents()
             if e.kind == "data" and not e.on_demand]
    return [(path, begin, end - begin) for path, begin, end in merge_adjacent(spans)]


class Bench:
    def __init__(self, checkpoint: Path, workdir: Path, device: str, log):
        self.checkpoint, self.workdir, self.device, self.log = checkpoint, workdir, device, log
        self.can_drop = os.geteuid() == 0

    def measure(self, label: str, kind: str, args: dict, cold: bool, mounted: Path | None = None) -> dict:
        if cold:
            drop_caches()
        before = meminfo()
        result = run_path(kind, args)
        after = meminfo()
        result.update(path=label, cold=cold, mem_available_lost=before["MemAvailable"] - after["MemAvailable"],
                      cached_after=after["Cached"] - before["Cached"])
        if mounted is not None:
            status = json.loads((mounted / ".rankfs" / "status.json").read_text())
            result["daemon_peak_rss"] = _vm_hwm(status["pid"])
            result["daemon_read_bytes"] = status["read_bytes"]
        self.log(f"  {label:<34} {result.get('seconds', float('nan')):7.2f} s"
                 + (f"  ERROR {result['error']}" if "error" in result else ""))
        return result

    def engine_args(self, directory: Path, spec: RankSpec, hook: bool = False) -> dict:
        return {"directory": str(directory), "counts_from": str(self.checkpoint), "profile": "deepseek-v4",
                "device": self.device, "hook": hook,
                "layout": {"moe_tp_size": spec.moe_tp_size, "moe_tp_rank": spec.moe_tp_rank,
                           "ep_size": spec.ep_size, "ep_rank": spec.ep_rank}}

    def mounted_run(self, label: str, spec: RankSpec, cold: bool, hook: bool = False) -> dict:
        flags = ("--tp-size", spec.tp_size, "--tp-rank", spec.tp_rank, "--ep-size", spec.ep_size)
        with mounted(self.checkpoint, self.workdir / "mnt", *flags, log=self.workdir / "rankfs.log") as mnt:
            return self.measure(label, "engine", self.engine_args(mnt / "target", spec, hook), cold, mounted=mnt)

    def case(self, name: str) -> dict:
        tp_size, tp_rank, ep_size = CASES[name]
        spec = RankSpec(tp_size, tp_rank, ep_size)
        layout = plan_rank(Checkpoint.open(self.checkpoint), spec)
        planned = layout.view("target").summary()
        ranges = rank_ranges(layout)
        originals = sorted({str(layout.sources[f.source].path) for f in layout.view("target").files})
        all_files = sorted(str(p) for p in self.checkpoint.glob("*.safetensors"))
        self.log(f"\n{name}: {spec.describe()}; reads {planned['read_bytes'] / 1e9:.2f} GB, keeps "
                 f"{planned['kept_bytes'] / 1e9:.2f} GB")
        rows = []
        limit = [self.measure("limit: O_DIRECT preads", "raw", {"ranges": ranges, "direct": True}, True),
                 self.measure("limit: buffered preads", "raw", {"ranges": ranges, "direct": False}, True)]
        rows.extend(limit)
        rows.append(self.measure("stock (engine-like, mmap)", "engine",
                                 self.engine_args(self.checkpoint, spec), True))
        ra_file = readahead_file(self.checkpoint)
        saved = ra_file.read_text().strip()
        try:
            ra_file.write_text("128\n")
            rows.append(self.measure("stock, readahead 128 KiB", "engine",
                                     self.engine_args(self.checkpoint, spec), True))
        finally:
            ra_file.write_text(saved + "\n")
        rows.append(self.mounted_run("rankfs", spec, cold=True))
        rows.append(self.mounted_run("rankfs + hook", spec, cold=True, hook=True))
        rows.append(self.measure("runai-model-streamer", "runai", {"files": originals}, True))
        rows.append(self.measure("fastsafetensors", "fastsafetensors", {"files": originals}, True))
        # Before each: rankfs drops the source pages it has read (nothing cached twice).
        warm(all_files)
        rows.append(self.measure("warm: stock", "engine", self.engine_args(self.checkpoint, spec), False))
        warm(all_files)
        rows.append(self.mounted_run("warm: rankfs", spec, cold=False))
        warm(all_files)
        rows.append(self.mounted_run("warm: rankfs + hook", spec, cold=False, hook=True))
        best_limit = min(r["seconds"] for r in limit if "seconds" in r)
        for r in rows:
            if "seconds" in r:
                r["gb_per_s"] = planned["read_bytes"] / r["seconds"] / 1e9
                r["ratio_to_limit"] = best_limit / r["seconds"]
        return {"case": name, "spec": spec.describe(), "plan": planned, "readahead_kb": saved, "rows": rows}


def _vm_hwm(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def table(result: dict) -> str:
    lines = [f"\n{result['case']}: {result['spec']}",
             f"{'path':<34} {'s':>7} {'GB/s':>6} {'x limit':>8} {'loader RSS':>11} {'daemon RSS':>11} "
             f"{'MemAvail lost':>14} {'cache left':>11}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['path']:<34} error: {r['error']}")
            continue
        daemon = f"{r['daemon_peak_rss'] / 2**20:8.0f} MiB" if r.get("daemon_peak_rss") else f"{'-':>11}"
        lines.append(f"{r['path']:<34} {r['seconds']:7.2f} {r['gb_per_s']:6.2f} {r['ratio_to_limit']:8.2f} "
                     f"{r['peak_rss'] / 2**20:7.0f} MiB {daemon} {r['mem_available_lost'] / 2**20:10.0f} MiB "
                     f"{r['cached_after'] / 2**20:7.0f} MiB")
    stock = next((r for r in result["rows"] if r["path"] == "warm: stock" and "seconds" in r), None)
    served = next((r for r in result["rows"] if r["path"] == "warm: rankfs" and "seconds" in r), None)
    if stock and served:
        lines.append(f"serving rate (warm): rankfs / stock = {stock['seconds'] / served['seconds']:.2f}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(7 * len(results), 5), squeeze=False)
    for ax, result in zip(axes[0], results):
        for r in result["rows"]:
            if r.get("timeline"):
                t, b = zip(*r["timeline"])
                ax.plot(t, [x / 1e9 for x in b], label=r["path"])
        ax.set_title(f"{result['case']}: {result['spec']}", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylabel("GB loaded")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="rankfs bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=8.0, help="checkpoint size (default 8)")
    p.add_argument("--workdir", default="/var/tmp/rankfs-bench", help="where the checkpoint is written")
    p.add_argument("--cases", default="ep2,ep1-sliced", help=f"rank cases: {', '.join(CASES)}")
    p.add_argument("--device", default="cpu", help="where the loader copies to: cpu or cuda")
    p.add_argument("--out", default="bench-results", help="results.json and timeline.png go here")
    args = p.parse_args(argv)
    workdir = Path(args.workdir)
    checkpoint = workdir / f"checkpoint-{args.size_gb:g}gb"
    if not (checkpoint / "config.json").exists():
        print(f"writing a {args.size_gb:g} GB checkpoint to {checkpoint}", flush=True)
        deepseek_v4.write(checkpoint, deepseek_v4.FixtureSpec.sized(int(args.size_gb * 1e9)),
                          progress=lambda i, n: print(f"\r  shard {i}/{n}", end="", flush=True))
        print()
    if os.geteuid() != 0:
        print("not root: caches cannot be dropped, so every path reads warm", flush=True)
    bench = Bench(checkpoint, workdir, args.device, lambda line: print(line, flush=True))
    results = [bench.case(name) for name in args.cases.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "size_gb": args.size_gb, "device": args.device,
         "results": results}, indent=1))
    for result in results:
        print(table(result))
    try:
        plot(results, out / "timeline.png")
        print(f"\nwrote {out / 'results.json'} and {out / 'timeline.png'}")
    except ImportError:
        print(f"\nwrote {out / 'results.json'} (no matplotlib here: no plot)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
