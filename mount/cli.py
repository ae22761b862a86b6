"""The `rankfs` command line.

Exit codes follow mount(8): 0 success, 1 invalid invocation or input, 2 system error, 32 mount or
unmount failure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_USAGE, EXIT_SYSTEM, EXIT_FAILURE = 0, 1, 2, 32
GIB = 1 << 30


class UsageError(Exception):
    pass


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rankfs",
        description="Serve each inference-engine rank a virtual checkpoint that holds only what it "
                    "loads: its experts, pre-sliced, and a draft view with the mtp.* tensors.",
        epilog="Typical use: rankfs mount /models/dsv4 /mnt/rankfs --tp-size 4 --tp-rank 0; point "
               "--model-path at /mnt/rankfs/target (and the draft path at /mnt/rankfs/draft); "
               "rankfs umount /mnt/rankfs after the load. Exit codes: 0 ok, 1 invalid invocation "
               "or input, 2 system error, 32 mount or unmount failure.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def layout_flags(q, plan_all_ranks=False):
        g = q.add_argument_group("rank layout (the engine's flags)")
        g.add_argument("--tp-size", type=int, required=True, metavar="N", help="tensor-parallel size")
        if not plan_all_ranks:
            g.add_argument("--tp-rank", type=int, metavar="R",
                           help="this rank (0..N-1); or use --local-ranks")
            g.add_argument("--local-ranks", metavar="LIST",
                           help="serve several ranks from one mount: 'all' or '0,1,2,3'; views under "
                                "MOUNTPOINT/rank-R/")
        else:
            g.add_argument("--rank", type=int, metavar="R", help="only this rank (default: all)")
        g.add_argument("--ep-size", type=int, default=1, metavar="E",
                       help="expert-parallel size, dividing N (default 1); the MoE TP size is N/E")
        g.add_argument("--tp-slice", choices=("auto", "on", "off"), default="auto",
                       help="slice owned routed experts by MoE TP rank: auto = at E=1 only (default)")
        g.add_argument("--placement", choices=("sglang", "vllm"), default="sglang",
                       help="expert placement across EP ranks (default sglang: equal blocks)")
        g.add_argument("--n-experts", type=int, metavar="K",
                       help="routed experts per layer (default: from config.json)")
        g.add_argument("--profile", help="model family (default: detected from config.json); "
                                         "see 'rankfs profiles'")
        g.add_argument("--allow-outside-symlinks", action="store_true",
                       help="serve files whose symlinks point outside the checkpoint directory "
                            "(e.g. a Hugging Face cache snapshot)")

    q = sub.add_parser("mount", help="mount a rank's views of a checkpoint",
                       description="Mount CHECKPOINT's per-rank views at MOUNTPOINT (target/ and "
                                   "draft/). Returns once the mount is ready; the daemon stays in "
                                   "the background until 'rankfs umount'.")
    q.add_argument("checkpoint", help="the checkpoint directory (config.json, *.safetensors)")
    q.add_argument("mountpoint", help="an empty directory")
    layout_flags(q)
    g = q.add_argument_group("serving")
    g.add_argument("--inflight-gb", type=float, metavar="GB",
                   help="memory the daemon may hold for read-ahead (default 1 GiB; less when under "
                        "8 GiB are available)")
    g.add_argument("--workers", type=int, default=8, help="parallel backing reads (default 8)")
    g.add_argument("--direct-io", action="store_true",
                   help="read the backing files with O_DIRECT (best on NVMe); default is buffered "
                        "reads whose page cache is dropped right after")
    g.add_argument("--no-push", dest="push", action="store_false",
                   help="answer every read on the FUSE thread instead of pushing read-ahead into "
                        "the page cache from threads of its own (slower; for comparison)")
    g.add_argument("--readahead-mb", type=int, default=16, help="kernel readahead of the mount")
    g.add_argument("--allow-other", action="store_true", help="let other users read the mount")
    g.add_argument("--foreground", "-f", action="store_true", help="stay attached; log to stderr")
    g.add_argument("--log", metavar="FILE", help="daemon log (default: printed on mount)")
    g.add_argument("--progress", action="store_true",
                   help="after mounting, show loading progress until the views are read")

    q = sub.add_parser("umount", help="unmount and stop the daemon",
                       description="Unmount MOUNTPOINT and wait for its daemon to end. A mount "
                                   "whose daemon died is cleaned up too.")
    q.add_argument("mountpoint")
    q.add_argument("--lazy", "-l", action="store_true",
                   help="detach now even if files are still open or mapped")
    q.add_argument("--force", action="store_true",
                   help="for a hung daemon: abort its FUSE connection (waiting readers get an error), "
                        "then detach")

    q = sub.add_parser("status", help="live figures of a mount")
    q.add_argument("mountpoint")
    q.add_argument("--json", action="store_true")
    q.add_argument("--watch", action="store_true", help="refresh until interrupted or loaded")

    q = sub.add_parser("drop", help="drop the views' page cache and the daemon's buffers")
    q.add_argument("mountpoint")

    q = sub.add_parser("plan", help="print each rank's views (headers only, nothing mounted)",
                       description="Per rank and view: files, tensors, bytes read from disk, bytes "
                                   "the rank keeps, and the bytes kept from its largest file.")
    q.add_argument("checkpoint")
    layout_flags(q, plan_all_ranks=True)
    q.add_argument("--json", action="store_true", help="a JSON list of rows")

    sub.add_parser("profiles", help="list the model families rankfs knows")

    q = sub.add_parser("fixture", help="write a synthetic DeepSeek-V4-class checkpoint")
    q.add_argument("directory")
    size = q.add_mutually_exclusive_group()
    size.add_argument("--size-gb", type=float, help="real expert shapes, about this many GB")
    size.add_argument("--full-scale", action="store_true",
                      help="the production layout (384 experts, 48 shards, ~510 GB); use with "
                           "--header-only")
    q.add_argument("--header-only", action="store_true", help="headers only; data left as holes")

    q = sub.add_parser("run", help="run an engine with the rankfs hook in its Python processes",
                       description="Run COMMAND with the hook active in every Python process it "
                                   "starts (pinned slabs for rankfs views, release and memory "
                                   "accounting when the weights are loaded). Nothing in the engine "
                                   "is edited. Example: rankfs run -- python -m sglang.launch_server "
                                   "--model-path /mnt/rankfs/target ...")
    q.add_argument("--observe", action="store_true",
                   help="only log the memory accounting; load the stock way")
    q.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")

    q = sub.add_parser("bench", help="benchmark rankfs against the stock path, peers and the disk",
                       description="Same as python3 -m bench.run; 'rankfs bench -- --help' for its options.")
    q.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- OPTIONS ...")

    q = sub.add_parser("demo", help="generate a fixture, mount a rank, load it with safetensors")
    q.add_argument("--workdir", default="/tmp/rankfs-demo")
    return p


# -- commands -------------------------------------------------------------------------------------

def _specs(args) -> list:
    from plan.layout import RankSpec
    common = dict(tp_size=args.tp_size, ep_size=args.ep_size, tp_slice=args.tp_slice,
                  placement=args.placement, n_experts=args.n_experts)
    if getattr(args, "local_ranks", None):
        if args.tp_rank is not None:
            raise UsageError("give --tp-rank or --local-ranks, not both")
        ranks = range(args.tp_size) if args.local_ranks == "all" else _int_list(args.local_ranks)
    elif hasattr(args, "local_ranks"):
        if args.tp_rank is None:
            raise UsageError("--tp-rank (or --local-ranks) is required")
        ranks = [args.tp_rank]
    else:
        ranks = [args.rank] if args.rank is not None else range(args.tp_size)
    return [RankSpec(tp_rank=r, **common) for r in ranks]


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--local-ranks: expected 'all' or a list like 0,1,2,3, got {text!r}") from None


def _default_log(mountpoint: str) -> Path:
    base = Path("/var/log/rankfs") if os.geteuid() == 0 else \
        Path(os.environ.get("XDG_STATE_HOME", Path.home() / ".local/state")) / "rankfs"
    return base / (os.path.abspath(mountpoint).strip("/").replace("/", "-") + ".log")


def cmd_mount(args) -> int:
    from mount import kernel
    from mount.config import MountConfig, default_budget_bytes
    mountpoint = os.path.abspath(args.mountpoint)
    state = kernel.health(mountpoint)
    if state == "dead":
        print(f"rankfs: {mountpoint}: a rankfs mount whose daemon died is still there; "
              f"run 'rankfs umount {args.mountpoint}' first", file=sys.stderr)
        return EXIT_FAILURE
    if state != "absent":
        print(f"rankfs: {mountpoint}: already a mount point", file=sys.stderr)
        return EXIT_FAILURE
    if not os.path.isdir(mountpoint):
        print(f"rankfs: {mountpoint}: mount point does not exist or is not a directory", file=sys.stderr)
        return EXIT_FAILURE
    log_file = args.log or ("-" if args.foreground else str(_default_log(mountpoint)))
    config = MountConfig(
        checkpoint=os.path.abspath(args.checkpoint), mountpoint=mountpoint, specs=_specs(args),
        profile=args.profile,
        budget_bytes=int(args.inflight_gb * GIB) if args.inflight_gb else default_budget_bytes(),
        workers=args.workers, direct_io=args.direct_io, push=args.push, readahead_kb=args.readahead_mb * 1024,
        allow_other=args.allow_other, allow_outside_symlinks=args.allow_outside_symlinks,
        log_file=None if log_file == "-" else log_file)
    if args.foreground:
        from mount.daemon import serve
        _setup_logging(config.log_file)
        return serve(config, None)
    Path(config.log_file).parent.mkdir(parents=True, exist_ok=True)
    read_end, write_end = os.pipe()
    payload = json.dumps({**dataclasses.asdict(config),
                          "specs": [dataclasses.asdict(s) for s in config.specs]})
    with open(config.log_file, "ab") as log_out:
        child = subprocess.Popen([sys.executable, "-m", "mount.cli", "_serve", payload, str(write_end)],
                                 pass_fds=(write_end,), stdin=subprocess.DEVNULL, stdout=log_out,
                                 stderr=log_out, start_new_session=True, cwd="/",
                                 env={**os.environ, "PYTHONPATH": _package_root_path()})
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        answer = pipe.readline().strip()
    if not answer.startswith("ready"):
        child.wait(timeout=30)
        detail = answer.removeprefix("error: ") or f"the daemon exited with {child.returncode}; " \
                                                   f"see {config.log_file}"
        print(f"rankfs: {detail}", file=sys.stderr)
        return EXIT_FAILURE
    print(f"rankfs: {answer} (daemon pid {child.pid}, log {config.log_file})")
    if args.progress:
        return _watch(mountpoint, until_loaded=True)
    return EXIT_OK


def _package_root_path() -> str:
    root = str(Path(__file__).resolve().parent.parent)
    existing = os.environ.get("PYTHONPATH")
    return root + (os.pathsep + existing if existing else "")


def _setup_logging(log_file: str | None):
    logging.basicConfig(
        filename=log_file, level=logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s %(message)s")


def cmd_serve(payload: str, ready_fd: str) -> int:
    """The daemon process (internal)."""
    from mount.config import MountConfig
    from mount.daemon import serve
    from plan.layout import RankSpec
    raw = json.loads(payload)
    raw["specs"] = [RankSpec(**s) for s in raw["specs"]]
    config = MountConfig(**raw)
    _setup_logging(None)  # stdout/stderr already go to the log file
    return serve(config, int(ready_fd))


def _status(mountpoint: str) -> dict:
    from mount import control
    return control.read_status(mountpoint)


def _check_alive(mountpoint: str) -> str | None:
    from mount import kernel
    state = kernel.health(mountpoint)
    if state == "alive":
        return None
    return {"absent": "not mounted", "other": "not a rankfs mount",
            "dead": f"DEAD: the daemon is gone; 'rankfs umount {mountpoint}' cleans it up"}[state]


def cmd_status(args) -> int:
    problem = _check_alive(args.mountpoint)
    if problem:
        print(f"rankfs: {args.mountpoint}: {problem}", file=sys.stderr)
        return EXIT_FAILURE
    if args.watch:
        return _watch(args.mountpoint, until_loaded=False)
    status = _status(args.mountpoint)
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    print(_format_status(status))
    return EXIT_OK


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _format_status(s: dict) -> str:
    lines = [f"{s['mountpoint']}: alive, pid {s['pid']}, profile {s['profile']}, {s['checkpoint']}",
             f"  read {_gb(s['read_bytes'])} at {s['read_rate_bytes_per_s'] / 1e9:.2f} GB/s; "
             f"held {_gb(s['held_bytes'])} (peak {_gb(s['peak_held_bytes'])}, budget "
             f"{_gb(s['budget_bytes'])}); daemon RSS {_gb(s['rss_bytes'])}; errors {s['errors']}"]
    for v in s["views"]:
        hook = v["hook_loaded_bytes"]
        lines.append(f"  {v['view']:<16} {_bar(_loaded(v), v['planned_bytes'])} "
                     f"{_gb(_loaded(v))} / {_gb(v['planned_bytes'])}"
                     + (f" ({_gb(hook)} by the engine hook, from the sources)" if hook else ""))
    return "\n".join(lines)


def _loaded(view: dict) -> int:
    """A view's bytes loaded: served through the mount, and read by engine hooks directly."""
    return view["served_bytes"] + view["hook_loaded_bytes"]


def _bar(done: int, total: int, width: int = 30) -> str:
    fraction = min(1.0, done / total) if total else 1.0
    filled = int(fraction * width)
    return f"[{'#' * filled}{'.' * (width - filled)}] {fraction * 100:5.1f}%"


def _watch(mountpoint: str, until_loaded: bool) -> int:
    """Redraw the status every second; with until_loaded, stop once every opened view is read."""
    try:
        while True:
            problem = _check_alive(mountpoint)
            if problem:
                print(f"\nrankfs: {mountpoint}: {problem}", file=sys.stderr)
                return EXIT_FAILURE
            status = _status(mountpoint)
            text = _format_status(status)
            sys.stdout.write("\x1b[2J\x1b[H" + text + "\n" if sys.stdout.isatty() else text + "\n")
            sys.stdout.flush()
            active = [v for v in status["views"] if v["active"]]
            if until_loaded and active and all(_loaded(v) >= v["planned_bytes"] for v in active):
                return EXIT_OK
            time.sleep(1)
    except KeyboardInterrupt:
        return EXIT_OK


def cmd_umount(args) -> int:
    from mount import kernel
    mountpoint = os.path.abspath(args.mountpoint)
    entry = kernel.find_mount(mountpoint)
    if args.force and entry is not None and entry.fstype == kernel.FSTYPE:
        kernel.abort(entry)  # before anything touches the mount: a hung daemon would hang us too
    state = kernel.health(mountpoint)
    if state in ("absent", "other"):
        print(f"rankfs: {mountpoint}: {'not mounted' if state == 'absent' else 'not a rankfs mount'}",
              file=sys.stderr)
        return EXIT_FAILURE
    if args.force:
        args.lazy = True
    pid = _status(mountpoint)["pid"] if state == "alive" else None
    result = kernel.unmount(mountpoint, lazy=args.lazy)
    if result.returncode != 0:
        message = (result.stderr or result.stdout).strip()
        if "busy" in message.lower():
            print(f"rankfs: {mountpoint}: busy: files on it are still open or mapped (an engine "
                  f"still loading?). Stop them, or detach now with 'rankfs umount --lazy "
                  f"{args.mountpoint}'", file=sys.stderr)
        else:
            print(f"rankfs: {mountpoint}: unmount failed: {message}", file=sys.stderr)
        return EXIT_FAILURE
    if pid and not args.lazy:
        _wait_gone(pid, timeout=30)
    note = " (its daemon had died)" if state == "dead" else \
        " (detached; the daemon ends when the last open file closes)" if args.lazy else ""
    print(f"rankfs: unmounted {mountpoint}{note}")
    return EXIT_OK


def _wait_gone(pid: int, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGTERM)


def cmd_drop(args) -> int:
    problem = _check_alive(args.mountpoint)
    if problem:
        print(f"rankfs: {args.mountpoint}: {problem}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        from mount import control
        control.drop(args.mountpoint)
    except OSError as exc:
        print(f"rankfs: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print("rankfs: dropped the views' page cache and the daemon's buffers")
    return EXIT_OK


def cmd_plan(args) -> int:
    from plan.checkpoint import Checkpoint
    from plan.layout import plan_ranks
    checkpoint = Checkpoint.open(args.checkpoint, args.allow_outside_symlinks)
    layouts = plan_ranks(checkpoint, _specs(args), args.profile)
    for warning in layouts[0].warnings:
        print(f"rankfs: warning: {warning}", file=sys.stderr)
    rows = [row for layout in layouts for row in layout.summary()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    spec = layouts[0].spec
    print(f"{checkpoint.root}: profile {layouts[0].profile}, tp{spec.tp_size}/ep{spec.ep_size} "
          f"(moe-tp {spec.moe_tp_size}), experts {'sliced' if spec.slices_experts else 'whole'}")
    print(f"{'rank':>4}  {'view':<6} {'files':>5} {'tensors':>8} {'read':>22} {'kept':>22} "
          f"{'largest file kept':>22}")
    for r in rows:
        print(f"{r['rank']:>4}  {r['view']:<6} {r['files']:>5} {r['tensors']:>8} "
              f"{_size(r['read_bytes']):>22} {_size(r['kept_bytes']):>22} "
              f"{_size(r['largest_file_bytes']):>22}")
    return EXIT_OK


def _size(n: int) -> str:
    """Decimal and binary, like the seed's tables: '155.2 GB (144.5 GiB)'."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB ({n / GIB:.1f} GiB)"
    return f"{n / 1e6:.1f} MB ({n / (1 << 20):.1f} MiB)"


def cmd_profiles(args) -> int:
    from plan.profiles import BY_NAME
    for profile in BY_NAME.values():
        print(f"{profile.name:<12} {profile.description}")
    return EXIT_OK


def cmd_fixture(args) -> int:
    from fixture import deepseek_v4
    if args.full_scale:
        spec = deepseek_v4.FixtureSpec.full_scale()
        if not args.header_only:
            raise UsageError("--full-scale writes ~510 GB; add --header-only for the layout alone")
    elif args.size_gb:
        spec = deepseek_v4.FixtureSpec.sized(int(args.size_gb * 1e9))
    else:
        spec = deepseek_v4.FixtureSpec.tiny()

    def progress(done, total):
        print(f"\rrankfs: writing shard {done}/{total}", end="", file=sys.stderr, flush=True)
    deepseek_v4.write(args.directory, spec, header_only=args.header_only, progress=progress)
    print(f"\nrankfs: wrote {args.directory}", file=sys.stderr)
    return EXIT_OK


def cmd_run(args) -> int:
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if not argv:
        raise UsageError("rankfs run: give the command after --")
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root / "loader" / "boot"), str(root)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["RANKFS_HOOK"] = "observe" if args.observe else env.get("RANKFS_HOOK", "on")
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        print(f"rankfs: {argv[0]}: command not found", file=sys.stderr)
        return 127


def cmd_bench(args) -> int:
    from bench.run import main as bench_main
    return bench_main(args.argv[1:] if args.argv[:1] == ["--"] else args.argv)


def cmd_demo(args) -> int:
    from mount.demo import run_demo
    return run_demo(Path(args.workdir))


COMMANDS = {"mount": cmd_mount, "umount": cmd_umount, "status": cmd_status, "drop": cmd_drop,
            "plan": cmd_plan, "profiles": cmd_profiles, "fixture": cmd_fixture, "demo": cmd_demo,
            "run": cmd_run, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_serve"]:
        return cmd_serve(*argv[1:])
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: 2 on bad usage; mount(8) says 1
        return EXIT_USAGE if exc.code else EXIT_OK
    from plan.errors import CheckpointError, LayoutError
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"rankfs: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (CheckpointError, LayoutError) as exc:
        print(f"rankfs: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        print(f"rankfs: {exc}", file=sys.stderr)
        return EXIT_SYSTEM


if __name__ == "__main__":
    sys.exit(main())
