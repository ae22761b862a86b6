"""The benchmark: one run compares, for one rank of a generated checkpoint, rankfs (with and without
the hook) against the stock engine path, the peers, the engine's own ceiling and the limit of the
storage, on the same data.

    python3 -m dev bench [--size-gb 8] [--cases ep2,ep1-sliced] [--modes cold,warm] [--device cpu|cuda]
                         [--peers instanttensor,fastsafetensors,runai] [--out DIR] [--repeat N] [--profile [MODE]]
                         [--trace] [--hook-env 'RANKFS_HOOK_THREADS=8;RANKFS_HOOK_THREADS=16']

Modes: `cold` drops the page cache before each path (needs root); `warm` reads the sources into it
first (the stand-in for storage faster than the disk); `tmpfs` copies the checkpoint into /dev/shm.
Every load runs the same engine-like loader (SGLang's buffered iterator, FusedMoE narrowing, 24 copy
threads into preallocated parameters on --device), fed by the path's source:

    limit            16 threads of exact preads of the rank's bytes (+ H2D on CUDA): the storage's best;
                     and the same bytes pushed into FUSE files' page cache (read direct first where
                     the page cache does not hold them, as the daemon does): the view's ceiling
    engine ceiling   tensors staged in page-locked memory before the clock: the engine's own cost
    stock            safe_open (mmap) of the original shards
    ep-filter        the same, skipping other EP ranks' expert weights by vLLM's own weight filter
                     (--enable-ep-weight-filter; needs vLLM installed)
    rankfs           the same loader on the rank's view, through FUSE
    rankfs-again     the same, a second load by a new process once the first has exited (an engine
                     restarted on the mount), the view's page cache evicted in between
    view-preads      the limit's O_DIRECT preads over every byte of the view's shards: the daemon's
                     request rate, as readers of their own with O_DIRECT get it (runai-model-streamer)
    rankfs + hook    the same, under the hook (rankfs run): tensors read from the sources directly
    hook-alone       the hook handing the rank's tensors to a loop that drops them (no engine
                     copies): the hook's own rate, which bounds the row above as the ceiling does
    <peer>           each peer as an engine uses it as a load format, on the originals and on the view

It prints, per case and mode, seconds, GB/s of the rank's bytes, the ratio to the limit, time to
the first byte landed, the steady rate, what bounds the load (the seconds its loop waited for the
next tensor; how many copy threads were busy on average), peak memory of loader and daemon, the
hook's host and GPU buffers at their peak and what stayed in page cache; writes results.json and
timeline.png.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dev.bench import profile, trace_summary
from dev.bench.report import check_bitwise, median_run, plot, shape, table
from dev.fixtures import deepseek_v4
from dev.memstate import cached_bytes, cpu_seconds, drop_caches, uncache, vm_hwm, warm
from dev.mounting import ROOT, mounted
import rankfs
from rankfs.common import contract
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.layout import plan_rank
from rankfs.plan.profiles import BY_NAME
from rankfs.plan.spec import RankSpec
from rankfs.common.disk import merge_adjacent

CASES = {  # name -> (tp_size, tp_rank, ep_size): an EP2 rank (experts whole), an EP1 rank (sliced)
    "ep2": (4, 0, 2),
    "ep1-sliced": (4, 1, 1),
}
PEERS = ("instanttensor", "fastsafetensors", "runai")
PATHS = ("limit", "ceiling", "stock", "ep-filter", "rankfs", "rankfs-again", "view-preads", "hook", "hook-alone", "peers",
         "peers-on-view")
# InstantTensor's configurations: its default, and its best for the mode (its own guidance).
INSTANTTENSOR_BEST = {"cold": None, "warm": "URING_BUFFERED", "tmpfs": "MMAP"}


PATH_TIMEOUT = 300  # seconds one path may take


def run_path(kind: str, args: dict, record: Path | None = None, profile_mode: str = "idle") -> dict:
    """Run one path in a process of its own, with the variables of args["env"] set; with `record`,
    under py-spy (rankfs' dev.bench.profile)."""
    prefix = (profile.command(record, profile_mode) or []) if record is not None else []
    try:
        result = subprocess.run([*prefix, sys.executable, "-m", "dev.bench.paths", kind], input=json.dumps(args),
                                cwd=ROOT, capture_output=True, text=True, timeout=PATH_TIMEOUT,
                                env={**os.environ, **args.get("env", {})})
    except subprocess.TimeoutExpired:
        return {"error": f"took over {PATH_TIMEOUT} s"}
    rows = [line for line in result.stdout.splitlines() if line.startswith("{")]  # py-spy talks too
    if result.returncode != 0 or not rows:
        return {"error": (result.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(rows[-1])


def rank_ranges(layout) -> list[tuple[str, int, int]]:
    """(source path, offset, length) of exactly the bytes the target view reads, merged."""
    spans = [(layout.sources[vfile.source].path, begin, end)
             for vfile in layout.view("target").files for begin, end in vfile.source_reads()]
    return [(path, begin, end - begin) for path, begin, end in merge_adjacent(spans)]


def whole_files(directory: Path) -> list[tuple[str, int, int]]:
    """(path, 0, size) of each shard in a directory: every byte of it."""
    return [(str(p), 0, p.stat().st_size) for p in sorted(directory.glob("*.safetensors"))]


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run's settings (`python3 -m dev bench --help`)."""
    checkpoint: Path
    workdir: Path
    device: str  # where the loader copies to: cpu or cuda
    peers: tuple[str, ...]
    paths: frozenset[str]  # the rows to run (PATHS)
    journal: Path  # each row as a JSON line, as it comes
    mount_args: tuple[str, ...] = ()  # more `rankfs mount` arguments for rows through a view
    repeat: int = 1  # rounds of every row of a mode
    profiles: Path | None = None  # py-spy records, per row
    profile_mode: str = "idle"
    traces: Path | None = None  # the daemon's and the hook's events, per row
    hook_variants: tuple[dict, ...] = ({},)  # the hook's rows, once per set of its variables
    log: Callable[[str], None] = print


@dataclass(frozen=True)
class Row:
    """A row: `args(mountpoint)` are its path's arguments; through a fresh mount of `view` where it
    reads one (`args` then gets the mount point, else None). `second_load`: the measured load is
    the view's second reader, a new process once a first load has exited."""
    label: str
    kind: str  # dev.bench.paths: load, raw, push
    args: Callable[[Path | None], dict]
    view: RankSpec | None = None
    second_load: bool = False


class Bench:
    def __init__(self, config: BenchConfig):
        self.config = config
        self.case_name = ""

    def rows(self, rows: list[Row], mode: str, files: list[str]) -> list[dict]:
        """Each row run `repeat` times, each in a process of its own, round by round, every row
        once a round: on a shared host the same load moves by up to 2x within minutes, and a disk's
        rate drifts between rounds, more than most differences measured. Every other round runs
        the rows in reverse (of two variants, the second often runs faster, whichever it is). The
        run of median time (of two, the faster) stands for the row, every run's seconds beside it."""
        runs = [[] for _ in rows]
        repeat = self.config.repeat
        for run in range(repeat):
            if repeat > 1:
                self.config.log(f"  {mode} round {run + 1} of {repeat}" + (", rows in reverse" if run % 2 else ""))
            order = list(zip(rows, runs))
            for row, done in order[::-1] if run % 2 else order:
                done.append(self.run_once(row, mode, files, run))
        return [median_run(done) for done in runs]

    def run_once(self, row: Row, mode: str, files: list[str], run: int) -> dict:
        """One run of a row: `measure`, through a fresh mount of its view where it has one, with its traces."""
        if row.view is None:
            return self.measure(row, row.args(None), mode, files, run=run)
        traces = self.config.traces
        trace = traces / f"{self.slug(row.label, mode, run)}.jsonl" if traces else None
        with self.mounted(row.view, trace) as mnt:
            run_args = row.args(mnt)
            if row.second_load:
                first = run_path(row.kind, run_args)
                if "error" in first:
                    self.config.log(f"  {row.label}: the first load failed: {first['error']}")
                uncache(mnt.rglob("*.safetensors"), direct=True)
            hook_trace = trace.with_suffix(".hook.jsonl") if trace and run_args.get("hook") else None
            if hook_trace:
                run_args["hook_trace"] = str(hook_trace)
            result = self.measure(row, run_args, mode, files, mnt, run)
        if trace is not None and trace.exists():  # complete once unmounted
            trace.with_suffix(".summary.txt").write_text(
                trace_summary.summarize(trace_summary.read_events(trace), result) + "\n")
        if hook_trace is not None and hook_trace.exists():
            hook_trace.with_suffix(".summary.txt").write_text(
                trace_summary.summarize_hook(trace_summary.read_events(hook_trace), result) + "\n")
        return result

    def measure(self, row: Row, args: dict, mode: str, files: list[str], mountpoint: Path | None = None,
                run: int = 0) -> dict:
        if mode == "cold":
            drop_caches()
        else:
            warm(files)
        record = None
        if self.config.profiles is not None and row.kind == "load":
            record = self.config.profiles / f"{self.slug(row.label, mode, run)}.txt"
        daemon = contract.read_status(str(mountpoint))["pid"] if mountpoint is not None else None
        sources_cached, daemon_cpu = cached_bytes(files), cpu_seconds(daemon) if daemon else 0.0
        daemon_record = record.with_suffix(".daemon.txt") if record is not None and daemon else None
        recorder = profile.attach(daemon, daemon_record, self.config.profile_mode) if daemon_record else None
        result = run_path(row.kind, args, record, self.config.profile_mode)
        profile.detach(recorder, daemon_record, self.config.profile_mode)
        # Only pages of files the row owns: machine-wide Cached also grows by the libraries a cold
        # process maps.
        left = cached_bytes(files) - sources_cached
        if mountpoint is not None:
            left += cached_bytes(mountpoint.rglob("*.safetensors"))
        if record is not None and record.exists():
            summary = profile.summarize(record, mode=self.config.profile_mode)
            record.with_suffix(".summary.txt").write_text(summary + "\n")
        result.update(case=self.case_name, path=row.label, mode=mode, cached_after=left,
                      through_view=mountpoint is not None)
        if mountpoint is not None:
            status = contract.read_status(str(mountpoint))
            result["daemon_peak_rss"] = vm_hwm(daemon)
            result["daemon_cpu_seconds"] = cpu_seconds(daemon) - daemon_cpu
            result["daemon"] = {key: status[key] for key in status["counters"]}
        self.log_row(result)
        with open(self.config.journal, "a") as f:  # each row as it comes: a run cut short keeps what it measured
            f.write(json.dumps({"checkpoint": str(self.config.checkpoint), **result}) + "\n")
        return result

    def log_row(self, result: dict):
        log = self.config.log
        log(f"  {result['mode']:<5} {result['path']:<36} {result.get('seconds', float('nan')):7.2f} s"
            + (f"  ERROR {result['error']}" if "error" in result else ""))
        if "daemon" in result:
            gb = {key: value / 1e9 for key, value in result["daemon"].items()}
            log(f"        through the view: pushed {gb['pushed_bytes']:.2f} GB (+ {gb['pushed_fill_bytes']:.2f} GB"
                f" of fill), requested {gb['request_bytes']:.2f} GB in {result['daemon']['requests']} requests"
                f" ({gb['fill_bytes']:.2f} GB of fill)")

    def load_args(self, directory, spec: RankSpec, source: str = "stock", **extra) -> dict:
        return {"directory": str(directory), "counts_from": str(self.config.checkpoint), "device": self.config.device,
                "source": source, **extra,
                "layout": {"moe_tp_size": spec.moe_tp_size, "moe_tp_rank": spec.moe_tp_rank,
                           "ep_size": spec.ep_size, "ep_rank": spec.ep_rank}}

    def slug(self, label: str, mode: str, run: int) -> str:
        """A row's run as a file name: ep2-warm-rankfs-2."""
        numbered = f" {run + 1}" if self.config.repeat > 1 else ""
        return re.sub(r"[^a-z0-9]+", "-", f"{self.case_name} {mode} {label}{numbered}".lower()).strip("-")

    def push_mountpoint(self) -> Path:
        """Where the push limit mounts its files for its run."""
        path = self.config.workdir / "mnt-push"
        path.mkdir(exist_ok=True)
        return path

    def mounted(self, spec: RankSpec, trace: Path | None = None):
        flags = ("--tp-size", spec.tp_size, "--tp-rank", spec.tp_rank, "--ep-size", spec.ep_size,
                 *self.config.mount_args, *(("--trace", trace) if trace else ()))
        return mounted(self.config.checkpoint, self.config.workdir / "mnt", *flags,
                       log=self.config.workdir / "rankfs.log")

    def case(self, name: str, modes: list[str]) -> dict:
        tp_size, tp_rank, ep_size = CASES[name]
        self.case_name = name
        spec = RankSpec(tp_size, tp_rank, ep_size)
        layout = plan_rank(Checkpoint.open(self.config.checkpoint), spec)
        target = layout.view("target")
        planned = target.summary()
        ranges = rank_ranges(layout)
        files = sorted(str(p) for p in self.config.checkpoint.glob("*.safetensors"))
        names = [n for f in target.files for n in f.tensor_names if not BY_NAME["deepseek-v4"].is_on_demand(n)]
        self.config.log(f"\n{name}: {spec.describe()}; reads {planned['read_bytes'] / 1e9:.2f} GB, keeps "
                        f"{planned['kept_bytes'] / 1e9:.2f} GB")
        rows = []
        for mode in modes:
            rows += self.rows(self.mode_rows(mode, spec, ranges, names), mode, files)
        for row in rows:
            shape(row, planned["read_bytes"])
        check_bitwise(rows)
        for mode in modes:
            limit = min((r["seconds"] for r in rows if r["mode"] == mode and r["path"].startswith("limit")
                         and "seconds" in r), default=None)
            for row in rows:
                if row["mode"] == mode and "seconds" in row and limit:
                    row["ratio_to_limit"] = limit / row["seconds"]
        return {"case": name, "spec": spec.describe(), "plan": planned, "rows": rows}

    def mode_rows(self, mode: str, spec: RankSpec, ranges, names) -> list[Row]:
        """The rows of a mode, in the order they run."""
        rows: list[Row] = []
        paths, cuda, checkpoint = self.config.paths, self.config.device != "cpu", self.config.checkpoint
        fixed = lambda args: (lambda mnt: args)  # noqa: E731  a row's arguments that need no mount
        if "limit" in paths:
            if mode == "cold":
                rows.append(Row("limit: O_DIRECT preads", "raw", fixed({"ranges": ranges, "direct": True})))
            rows.append(Row("limit: buffered preads", "raw", fixed({"ranges": ranges, "direct": False})))
            if cuda:
                rows.append(Row("limit: preads + H2D", "raw", fixed({"ranges": ranges, "direct": False, "h2d": True})))
            rows.append(Row("limit: pushes into FUSE page cache", "push",
                            fixed({"ranges": ranges, "mountpoint": str(self.push_mountpoint())})))
        if mode != "cold" and "ceiling" in paths:
            rows.append(Row("engine ceiling (staged, pinned)", "load",
                            fixed(self.load_args(checkpoint, spec, "staged", names=names))))
        if "stock" in paths:
            rows.append(Row("stock (engine-like, mmap)", "load", fixed(self.load_args(checkpoint, spec))))
        if "ep-filter" in paths:
            experts = BY_NAME["deepseek-v4"].expert_count(json.loads((checkpoint / "config.json").read_text()))
            rows.append(Row("stock + vLLM's EP weight filter", "load",
                            fixed(self.load_args(checkpoint, spec, "ep-filter", n_experts=experts))))
        through = lambda **extra: (lambda mnt: self.load_args(mnt / "target", spec, **extra))  # noqa: E731
        if "rankfs" in paths:
            rows.append(Row("rankfs", "load", through(), spec))
        if "rankfs-again" in paths:
            rows.append(Row("rankfs, a second load (a new process)", "load", through(), spec, second_load=True))
        if "view-preads" in paths:
            rows.append(Row("rankfs: O_DIRECT preads of the view", "raw",
                            lambda mnt: {"ranges": whole_files(mnt / "target"), "direct": True}, spec))
        for env in self.config.hook_variants:
            named = f" ({','.join(f'{k}={v}' for k, v in env.items())})" if env else ""
            if "hook" in paths:
                rows.append(Row(f"rankfs + hook{named}", "load", through(hook=True, env=env), spec))
            if "hook-alone" in paths:
                rows.append(Row(f"rankfs + hook, no engine copies{named}", "load",
                                through(hook=True, copies=False, env=env), spec))
        for peer in self.config.peers if {"peers", "peers-on-view"} & paths else ():
            rows += self.peer_rows(peer, mode, spec, names, through, fixed)
        return rows

    def peer_rows(self, peer: str, mode: str, spec: RankSpec, names, through, fixed) -> list[Row]:
        """A peer as an engine uses it, on the originals and on the view; InstantTensor (on CUDA
        only) in its default configuration and its best for the mode with the rank's tensors."""
        if peer == "instanttensor" and self.config.device == "cpu":
            return []
        configs = [("default", {})]
        if peer == "instanttensor":
            best = INSTANTTENSOR_BEST[mode]
            configs.append((f"{best or 'default'}, rank's tensors", {"backend": best, "filtered": True, "names": names}))
        rows = []
        for config, extra in configs:
            if "peers" in self.config.paths:
                rows.append(Row(f"{peer} ({config})", "load",
                                fixed(self.load_args(self.config.checkpoint, spec, peer, **extra))))
            if "peers-on-view" in self.config.paths:
                rows.append(Row(f"{peer} ({config}) on the view", "load", through(source=peer, **extra), spec))
        return rows


def hook_env_variants(text: str) -> tuple[dict, ...]:
    """--hook-env: 'A=1,B=2;A=3' as ({'A': '1', 'B': '2'}, {'A': '3'}); '' as the defaults alone."""
    variants = []
    for variant in text.split(";"):
        env = {}
        for setting in filter(None, variant.split(",")):
            name, equals, value = setting.strip().partition("=")
            if not equals or not name.startswith("RANKFS_HOOK"):
                raise ValueError(f"--hook-env: {setting!r} is not RANKFS_HOOK_...=VALUE")
            env[name] = value
        variants.append(env)
    return tuple(variants)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python3 -m dev bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gb", type=float, default=None,
                   help="checkpoint size, GB (default: 24 with --device cuda, else 8)")
    p.add_argument("--workdir", default="/var/tmp/rankfs-bench", help="where the checkpoint is written")
    p.add_argument("--cases", default="ep2,ep1-sliced", help=f"rank cases: {', '.join(CASES)}")
    p.add_argument("--modes", default="cold,warm", help="cold, warm, tmpfs (default: cold,warm)")
    p.add_argument("--device", default="cpu", help="where the loader copies to: cpu or cuda (default: cpu)")
    p.add_argument("--peers", default=",".join(PEERS), help="peers to run (default: all; '' for none)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"rows to run (default: all of {', '.join(PATHS)})")
    p.add_argument("--out", default="bench-results", help="results.json and timeline.png go here")
    p.add_argument("--mount-args", default="", metavar="ARGS",
                   help="more 'rankfs mount' arguments for the rows through a view, e.g. '--push-threads 4' "
                        "(a single flag with '=': --mount-args=--direct-io)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="run each row N times, each in a fresh process (and mount), in N rounds of every "
                        "row of a mode; the median run (of an even N, the faster middle one) is reported, with "
                        "every run's seconds (default: 1)")
    p.add_argument("--profile", nargs="?", const="idle", choices=profile.MODES, metavar="MODE",
                   help="record each load under py-spy (if on PATH): OUT/profiles/*.txt and a summary per thread "
                        "group, and a row's mount's daemon (*.daemon.txt, never paused); MODE: idle (every thread, the "
                        "default), gil (the threads holding the GIL), native (with C frames; pauses the process at "
                        "each sample), threads (without py-spy, the daemon's too: each thread's state, system call "
                        "and where it sleeps, from /proc, waits for the GIL told apart; dev.bench.thread_states)")
    p.add_argument("--trace", action="store_true",
                   help="trace the daemon of each row through a view (rankfs mount --trace), and the hook "
                        "(RANKFS_HOOK_TRACE): OUT/traces/*.jsonl and a summary of each (python3 -m dev.bench.trace_summary)")
    p.add_argument("--hook-env", default="", metavar="VARIANTS",
                   help="run the hook's rows once per variant, in the same rounds: variants separated by ';', "
                        "each NAME=VALUE[,NAME=VALUE] of RANKFS_HOOK_* variables, an empty one for the defaults "
                        "(e.g. 'RANKFS_HOOK_THREADS=8;RANKFS_HOOK_THREADS=16'; default: the defaults only)")
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        hook_variants = hook_env_variants(args.hook_env)
    except ValueError as exc:
        p.error(str(exc))
    # A run stopped by `timeout` or kill unwinds as Ctrl-C does: the row's mount is unmounted on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    # The hook's modules are imported at a load's first rankfs open, inside the clock: compiled ahead, as
    # pip compiles an installed rankfs, not from source in each row's process.
    compileall.compile_dir(rankfs.__path__[0], quiet=1, rx=re.compile(r"/\."))  # not .device/ and the like
    size = args.size_gb or (24.0 if args.device != "cpu" else 8.0)
    workdir = Path(args.workdir)
    checkpoint = workdir / f"checkpoint-{size:g}gb"
    if not (checkpoint / "config.json").exists():
        print(f"writing a {size:g} GB checkpoint to {checkpoint}", flush=True)
        deepseek_v4.write(checkpoint, deepseek_v4.FixtureSpec.sized(int(size * 1e9)),
                          progress=lambda i, n: print(f"\r  shard {i}/{n}", end="", flush=True))
        print()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = args.modes.split(",")
    if "cold" in modes and os.geteuid() != 0:
        print("not root: caches cannot be dropped, so cold paths read warm", flush=True)
    results = []
    for mode_group in (["tmpfs"] if "tmpfs" in modes else []) + [[m for m in modes if m != "tmpfs"]]:
        source = checkpoint
        if mode_group == ["tmpfs"]:
            source = Path("/dev/shm") / checkpoint.name
            shutil.copytree(checkpoint, source, dirs_exist_ok=True)
        profiles = out / "profiles" if args.profile else None
        traces = out / "traces" if args.trace else None
        for folder in (profiles, traces):
            if folder is not None:
                folder.mkdir(exist_ok=True)
        bench = Bench(BenchConfig(
            source, workdir, args.device, tuple(p for p in args.peers.split(",") if p),
            frozenset(args.paths.split(",")), out / "rows.jsonl", tuple(args.mount_args.split()), args.repeat,
            profiles, args.profile or "idle", traces, hook_variants, log=lambda line: print(line, flush=True)))
        try:
            results += [bench.case(name, mode_group) for name in args.cases.split(",")]
        finally:
            if mode_group == ["tmpfs"]:
                shutil.rmtree(source)
    (out / "results.json").write_text(json.dumps(
        {"when": time.strftime("%Y-%m-%d %H:%M:%S"), "size_gb": size, "device": args.device,
         "results": results}, indent=1))
    for result in results:
        print(table(result))
    differ = [f"{result['case']} {r['mode']} {r['path']}" for result in results for r in result["rows"]
              if r.get("bitwise") is False]
    if differ:
        print(f"\nbitwise: these loads' weights differ from the original shards': {'; '.join(differ)}")
    try:
        plot(results, out / "timeline.png")
        print(f"\nwrote {out / 'results.json'} and {out / 'timeline.png'}")
    except ImportError:
        print(f"\nwrote {out / 'results.json'} (no matplotlib here: no plot)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
