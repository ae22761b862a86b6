"""The `rankfs` command line: its parser and dispatch. Each command's work lives in its module
(launch, status_view, run); nothing is imported before a command needs it, so that `rankfs run`
costs an engine's start-up little more than starting Python once."""

from __future__ import annotations

import dataclasses
import sys

from rankfs.common.contract import GIB
from rankfs.mount.exits import EXIT_FAILURE, EXIT_OK, EXIT_SYSTEM, EXIT_USAGE, UsageError, fail, say, warn

EPILOG = """exit codes (those of mount(8)):
  0    success
  1    invalid invocation or input (bad flags, a layout that does not fit, a bad checkpoint for plan)
  2    system error
  32   mount or unmount failure (a bad checkpoint at mount time included); status, drop or umount
       on a path that is not a live rankfs mount
  run: the command's own exit status; 126 if it cannot be executed, 127 if it is not found

typical use:
  rankfs mount /models/dsv4 /mnt/rankfs --tp-size 4 --tp-rank 0
  rankfs run -- python -m sglang.launch_server --model-path /mnt/rankfs/target ...
  rankfs umount /mnt/rankfs"""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("rankfs")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _switch(group, *flags: str, help: str, **extra):
    """An option that turns something on (or, with dest and store_false, off)."""
    group.add_argument(*flags, action=extra.pop("action", "store_true"), help=help, **extra)


def _layout_flags(q, one_rank: bool):
    g = q.add_argument_group("rank layout (the engine's flags)")
    g.add_argument("--tp-size", type=int, required=True, metavar="N", help="tensor-parallel size")
    if one_rank:
        g.add_argument("--tp-rank", type=int, metavar="R", help="this rank, 0..N-1 (or --local-ranks)")
        g.add_argument("--local-ranks", metavar="LIST",
                       help="serve several ranks from one mount: 'all' or '0,1,2,3'; their views go "
                            "under MOUNTPOINT/rank-R/")
    else:
        g.add_argument("--rank", type=int, metavar="R", help="only this rank (default: every rank)")
    g.add_argument("--ep-size", type=int, default=1, metavar="E",
                   help="expert-parallel size, dividing N; the MoE TP size is N/E (default: 1)")
    g.add_argument("--tp-slice", choices=("auto", "on", "off"), default="auto",
                   help="pre-slice owned routed experts by MoE TP rank: auto slices at E=1 only "
                        "(default: auto)")
    g.add_argument("--placement", choices=("sglang", "vllm"), default="sglang",
                   help="expert placement across EP ranks: sglang's equal blocks, or vllm's "
                        "(default: sglang)")
    g.add_argument("--n-experts", type=int, metavar="K", help="routed experts per layer (default: config.json)")
    g.add_argument("--profile", help="model family (default: detected from config.json; see 'rankfs profiles')")
    g.add_argument("--revision", metavar="REV",
                   help="with a Hugging Face repo id: the branch, tag or commit of the cached snapshot "
                        "(default: main)")
    _switch(g, "--allow-outside-symlinks",
            help="serve files whose symlinks point outside the checkpoint directory, as in a Hugging "
                 "Face cache snapshot (default: refused)")


def _gib(text: str) -> float:
    import argparse
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be more than 0 GiB")
    return value


def _count(text: str) -> int:
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def parser():
    import argparse
    p = argparse.ArgumentParser(
        prog="rankfs", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description="Serve each inference-engine rank a virtual checkpoint that holds only what it "
                    "loads: its routed experts, pre-sliced, and a draft view with the draft tensors.")
    p.add_argument("--version", action="version", version=f"rankfs {_version()}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    q = sub.add_parser("mount", help="mount a rank's views of a checkpoint",
                       description="Mount CHECKPOINT's per-rank views at MOUNTPOINT (target/ and draft/). "
                                   "Returns once the views can be read; the daemon stays in the "
                                   "background until 'rankfs umount'.")
    q.add_argument("checkpoint", help="the checkpoint directory (config.json, *.safetensors), or a Hugging Face "
                                      "repo id (ORG/NAME) whose snapshot the local cache holds")
    q.add_argument("mountpoint", help="an existing, empty directory")
    _layout_flags(q, one_rank=True)
    g = q.add_argument_group("serving")
    g.add_argument("--inflight-gb", type=_gib, metavar="GIB",
                   help="memory the daemon may hold for read-ahead, in GiB (default: 4, or an eighth "
                        "of the memory this process may use when that is under 32 GiB, at least 0.25: the host's "
                        "available memory, or its cgroup's limit less what it uses; more than that is refused)")
    g.add_argument("--workers", type=_count, default=8, metavar="N",
                   help="threads reading the sources ahead, N x 8 MiB in flight at most, and as many "
                        "for reads a loader waits on (default: 8)")
    g.add_argument("--readahead-kb", type=_count, metavar="KIB",
                   help="the mount's kernel readahead, in KiB: what a page fault the daemon's pushes have "
                        "not covered reads around it (default: 256 where experts are sliced, which puts "
                        "the other ranks' fill around each slice, else 1024)")
    _switch(g, "--direct-io",
            help="read every chunk of the sources into buffers, none from maps of them (default: "
                 "from maps where the page cache holds the chunk, read direct (O_DIRECT) into a "
                 "buffer where it does not; the sources' page cache is dropped once served)")
    _switch(g, "--no-push", dest="push", action="store_false",
            help="answer every read on the FUSE thread instead of pushing read-ahead into the page "
                 "cache from threads of its own (default: push; this is for comparison)")
    g.add_argument("--push-threads", type=_count, metavar="N",
                   help="threads pushing read-ahead into the views' page cache (default: 8, two a core "
                        "at most of the cores this process may use: its affinity and CPU quota)")
    _switch(g, "--keep-cache",
            help="keep the views' pages in the page cache once a loader is done with them, for an engine "
                 "restarted on the mount to find them (default: a file's pages are dropped once the "
                 "loader that read it closed it: the memory is the engine's, its KV pool is sized from it)")
    _switch(g, "--allow-other",
            help="let other users read the mount and write its control file (same as -o "
                 "allow_other; needs user_allow_other in /etc/fuse.conf for non-root users)")
    g.add_argument("-o", dest="options", action="append", default=[], metavar="OPT[,OPT...]",
                   help="FUSE mount options, passed to libfuse (e.g. -o allow_other)")
    _switch(g, "--debug-fuse", help="log every FUSE request (libfuse's debug option)")
    g.add_argument("--trace", metavar="FILE",
                   help="write the read engine's events to FILE, a JSON line each: every chunk queued "
                        "for read-ahead, read, pushed and first asked for, every request and the seconds "
                        "its answer took (default: none; for diagnosis: python3 -m dev.bench.trace_summary)")
    _switch(g, "--foreground", "-f", help="stay attached and log to stderr")
    g.add_argument("--log", metavar="FILE",
                   help="the daemon's log (default: /var/log/rankfs/MOUNTPOINT.log as root, else "
                        "$XDG_STATE_HOME/rankfs/)")
    _switch(g, "--progress", help="after mounting, show loading progress until the opened views are loaded")

    q = sub.add_parser("umount", help="unmount and stop the daemon",
                       description="Unmount MOUNTPOINT and wait (up to 30 s) for its daemon to end. "
                                   "A mount whose daemon died is cleaned up too.")
    q.add_argument("mountpoint")
    _switch(q, "--lazy", "-l", help="detach now even if files are still open or mapped")
    _switch(q, "--force",
            help="for a hung daemon: abort its FUSE connection (waiting readers get an error), then detach")

    q = sub.add_parser("status", help="live figures of a mount")
    q.add_argument("mountpoint")
    _switch(q, "--json", help="the daemon's figures as JSON")
    _switch(q, "--watch", help="refresh every second until interrupted")

    q = sub.add_parser("drop", help="drop the views' page cache and the daemon's buffers",
                       description="Release what the daemon holds after a load: its buffers and the "
                                   "views' page cache. Returns once done.")
    q.add_argument("mountpoint")

    q = sub.add_parser("plan", help="print each rank's views (headers only, nothing mounted)",
                       description="Per rank and view: files, tensors, bytes read from disk, bytes "
                                   "the rank keeps, and the bytes kept from its largest file.")
    q.add_argument("checkpoint", help="the checkpoint directory, or a Hugging Face repo id the local cache holds")
    _layout_flags(q, one_rank=False)
    _switch(q, "--json", help="a JSON list of rows")

    sub.add_parser("profiles", help="list the model families rankfs knows")

    q = sub.add_parser("run", help="run an engine with the rankfs hook in its Python processes",
                       description="Run COMMAND with the hook in every Python process it starts. The "
                                   "hook stays dormant until a process opens a rankfs file; then it "
                                   "reads tensors from the sources at the disk's speed and, when the "
                                   "engine's weight loading returns, releases everything and logs "
                                   "the memory the KV pool will be sized from. Nothing in the engine "
                                   "is edited. Settings: see the README (RANKFS_HOOK_*).")
    _switch(q, "--observe", help="only log the memory accounting; load the stock way")
    q.add_argument("argv", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    return p


def cmd_mount(args) -> int:
    from rankfs.mount.api import mount_config
    from rankfs.mount.launch import MountError, serve_in_foreground, start
    config = mount_config(
        args.checkpoint, args.mountpoint, tp_size=args.tp_size, tp_rank=args.tp_rank, local_ranks=args.local_ranks,
        ep_size=args.ep_size, tp_slice=args.tp_slice, placement=args.placement, n_experts=args.n_experts,
        profile=args.profile, revision=args.revision, inflight_gb=args.inflight_gb, workers=args.workers,
        readahead_kb=args.readahead_kb, direct_io=args.direct_io, push=args.push, push_threads=args.push_threads,
        keep_cache=args.keep_cache,
        allow_other=args.allow_other, allow_outside_symlinks=args.allow_outside_symlinks,
        fuse_options=[o for opts in args.options for o in opts.split(",")], debug_fuse=args.debug_fuse,
        trace=args.trace, log=args.log)
    try:
        if args.foreground:
            return serve_in_foreground(config if args.log else dataclasses.replace(config, log_file=None))
        pid, ready = start(config)
    except MountError as exc:
        return fail(str(exc), EXIT_FAILURE)
    say(f"{ready} (daemon pid {pid}, log {config.log_file})")
    if args.progress:
        from rankfs.mount.status_view import watch_until
        return watch_until(config.mountpoint, until_loaded=True)
    return EXIT_OK


def cmd_umount(args) -> int:
    from rankfs.mount.launch import MountError, unmount
    try:
        say(unmount(args.mountpoint, args.lazy, args.force))
    except MountError as exc:
        return fail(str(exc), EXIT_FAILURE)
    return EXIT_OK


def cmd_status(args) -> int:
    from rankfs.mount.status_view import status
    return status(args.mountpoint, args.json, args.watch)


def cmd_drop(args) -> int:
    from rankfs.mount.status_view import drop
    return drop(args.mountpoint)


def cmd_plan(args) -> int:
    from rankfs.mount.api import rank_specs, resolve_checkpoint
    from rankfs.plan.checkpoint import Checkpoint
    from rankfs.plan.layout import plan_ranks
    directory, from_hub = resolve_checkpoint(args.checkpoint, args.revision)
    checkpoint = Checkpoint.open(directory, args.allow_outside_symlinks or from_hub)
    ranks = [args.rank] if args.rank is not None else range(args.tp_size)
    specs = [spec for rank in ranks for spec in rank_specs(args.tp_size, rank, None, args.ep_size, args.tp_slice,
                                                           args.placement, args.n_experts)]
    layouts = plan_ranks(checkpoint, specs, args.profile)
    for warning in layouts[0].warnings:
        warn(warning)
    rows = [row for layout in layouts for row in layout.summary()]
    if args.json:
        import json
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    spec = layouts[0].spec
    print(f"{checkpoint.root}: profile {layouts[0].profile}, tp{spec.tp_size}/ep{spec.ep_size} "
          f"(moe-tp {spec.moe_tp_size}), experts {'sliced' if spec.slices_experts else 'whole'}")
    print(f"{'rank':>4}  {'view':<6} {'files':>5} {'tensors':>8} {'read':>22} {'kept':>22} "
          f"{'largest file kept':>22}")
    for r in rows:
        print(f"{r['rank']:>4}  {r['view']:<6} {r['files']:>5} {r['tensors']:>8} "
              f"{_size(r['read_bytes']):>22} {_size(r['kept_bytes']):>22} {_size(r['largest_file_bytes']):>22}")
    return EXIT_OK


def _size(n: int) -> str:
    """Decimal and binary, like the seed's tables: '155.2 GB (144.5 GiB)'."""
    if n >= 1e9:
        return f"{n / 1e9:.1f} GB ({n / GIB:.1f} GiB)"
    return f"{n / 1e6:.1f} MB ({n / (1 << 20):.1f} MiB)"


def cmd_profiles(args) -> int:
    from rankfs.plan.profiles import BY_NAME
    for profile in BY_NAME.values():
        print(f"{profile.name:<12} {profile.description}")
    return EXIT_OK


def cmd_run(args) -> int:
    from rankfs.mount.run import run
    return run(args.argv, args.observe)


COMMANDS = {"mount": cmd_mount, "umount": cmd_umount, "status": cmd_status, "drop": cmd_drop,
            "plan": cmd_plan, "profiles": cmd_profiles, "run": cmd_run}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"] and "--" in argv[1:3] and set(argv[1:argv.index("--")]) <= {"--observe"}:
        from rankfs.mount.run import run  # the engine's start-up waits on this: no parser
        return run(argv[argv.index("--"):], "--observe" in argv[1:argv.index("--")])
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on bad usage; mount(8) says 1
        return EXIT_USAGE if exc.code else EXIT_OK
    from rankfs.plan.errors import CheckpointError, LayoutError
    try:
        return COMMANDS[args.command](args)
    except (UsageError, CheckpointError, LayoutError) as exc:
        return fail(str(exc), EXIT_USAGE)
    except OSError as exc:
        return fail(str(exc), EXIT_SYSTEM)


if __name__ == "__main__":
    sys.exit(main())
