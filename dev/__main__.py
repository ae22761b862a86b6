"""Development commands, run from a checkout (they are not part of the installed package):

    python3 -m dev demo [--workdir DIR]          generate a checkpoint, mount a rank, load it, check it
    python3 -m dev fixture DIR [--size-gb X]     write a synthetic DeepSeek-V4-class checkpoint
    python3 -m dev bench [OPTIONS]               the benchmark (python3 -m dev bench --help)
    python3 -m dev gpu-load CKPT MNT [OPTIONS]   a GPU load through the hook, checked bitwise
    python3 -m dev startup-cost [--runs N]       what `rankfs run` costs a process that never loads
    python3 -m dev reference                     render docs/reference.md from the parser and the settings
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def fixture(argv: list[str]) -> int:
    from dev.fixtures import deepseek_v4
    p = argparse.ArgumentParser(prog="python3 -m dev fixture", description="Write a synthetic "
                                "DeepSeek-V4-class checkpoint (real expert shapes and dtypes).")
    p.add_argument("directory")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--size-gb", type=float, help="real expert shapes, about this many GB (default: tiny)")
    size.add_argument("--full-scale", action="store_true",
                      help="the production layout (384 experts, 48 shards, ~510 GB); with --header-only")
    p.add_argument("--header-only", action="store_true", help="headers only; the data left as holes")
    args = p.parse_args(argv)
    if args.full_scale and not args.header_only:
        p.error("--full-scale writes ~510 GB; add --header-only for the layout alone")
    spec = (deepseek_v4.FixtureSpec.full_scale() if args.full_scale else
            deepseek_v4.FixtureSpec.sized(int(args.size_gb * 1e9)) if args.size_gb else deepseek_v4.FixtureSpec.tiny())
    deepseek_v4.write(args.directory, spec, header_only=args.header_only,
                      progress=lambda done, total: print(f"\rwriting shard {done}/{total}", end="", flush=True))
    print(f"\nwrote {args.directory}")
    return 0


def demo(argv: list[str]) -> int:
    from dev.demo import run_demo
    p = argparse.ArgumentParser(prog="python3 -m dev demo", description="Generate a checkpoint, mount "
                                "rank 1 of TP4/EP1, load both views with stock safetensors and check "
                                "every byte, unmount.")
    p.add_argument("--workdir", default="/tmp/rankfs-demo", help="where to work (default: %(default)s)")
    return run_demo(Path(p.parse_args(argv).workdir))


def bench(argv: list[str]) -> int:
    from dev.bench.bench import main
    return main(argv)


def gpu_load(argv: list[str]) -> int:
    from dev.bench.gpu_load import main
    return main(argv)


def startup_cost(argv: list[str]) -> int:
    from dev.bench.startup_cost import main
    return main(argv)


def reference(argv: list[str]) -> int:
    from dev.reference import main
    return main(argv)


COMMANDS = {"demo": demo, "fixture": fixture, "bench": bench, "gpu-load": gpu_load, "startup-cost": startup_cost,
            "reference": reference}

if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        sys.exit(1)
    sys.exit(COMMANDS[sys.argv[1]](sys.argv[2:]))
