"""What a load's threads are doing, as the kernel sees them: each thread's state, system call, the
futex it waits on and, asleep elsewhere, the kernel function it sleeps in (so that a page fault
waiting on a page lock tells apart from one waiting on a FUSE reply), sampled from /proc every few
milliseconds for the life of a command or until told to stop, summed per thread group (the name
without the pool's index: rankfs' threads are named in the kernel). A futex that threads of several
groups, and most of the process's threads, wait on is the GIL's: the share of a thread's samples
waiting there is what the GIL costs it, which py-spy does not show.

    python3 -m dev bench ... --profile threads          # a record and a summary per load row
    python3 -m dev.bench.thread_states --record R -- COMMAND ...
    python3 -m dev.bench.thread_states --record R --pid PID   # a running process, until SIGINT
    python3 -m dev.bench.thread_states R                # the summary of a record
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

INTERVAL = 0.002  # seconds between samples: hundreds over a one-second load
_PR_SET_PDEATHSIG = 1
SYSCALLS = {"0": "read", "1": "write", "7": "poll", "9": "mmap", "10": "mprotect", "11": "munmap", "16": "ioctl",
            "17": "pread64", "20": "writev", "28": "madvise", "35": "nanosleep", "202": "futex",
            "217": "getdents64", "221": "fadvise64", "232": "epoll_wait", "257": "openat", "295": "preadv",
            "327": "preadv2", "426": "io_uring_enter"}


def command(record: Path) -> list[str]:
    """The prefix that runs a command under the sampler, into `record`."""
    return [sys.executable, "-m", "dev.bench.thread_states", "--record", str(record), "--"]


def attach_command(record: Path, pid: int) -> list[str]:
    """The command that samples the running process `pid` into `record` until it gets SIGINT."""
    return [sys.executable, "-m", "dev.bench.thread_states", "--record", str(record), "--pid", str(pid)]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:  # the thread has ended
        return ""


def sample(pid: int) -> list[tuple[str, str, str, str]]:
    """(thread name, thread id, state, what it does) for each thread of `pid`: `running`, a
    system call's name, or `futex@ADDRESS` for a futex wait; asleep in anything but a futex, with
    the kernel function it sleeps in (`a page fault in folio_wait_bit_common`)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found = []
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        stat, call = _read(f"{base}/stat"), _read(f"{base}/syscall").split()
        if not stat or not call:
            continue
        state = stat.rsplit(")", 1)[1].split()[0]
        # /proc says "running" for a thread in user space, -1 for one in the kernel outside a system call.
        doing = {"running": "running", "-1": "a page fault"}.get(call[0]) \
            or SYSCALLS.get(call[0], f"syscall {call[0]}")
        if doing == "futex" and len(call) > 1:
            doing = f"futex@{call[1]}"
        elif state in ("S", "D") and doing != "running":
            sleeps_in = _read(f"{base}/wchan").strip()
            doing += f" in {sleeps_in}" if sleeps_in not in ("", "0") else ""
        found.append((_read(f"{base}/comm").strip(), tid, state, doing))
    return found


def record_samples(pid: int, record: Path, going) -> None:
    """Sample the threads of `pid` while `going()`; the record: per (thread, state, doing), how
    many samples."""
    counts: collections.Counter = collections.Counter()
    while going():
        for name, tid, state, doing in sample(pid):
            counts[f"{name}\t{tid}\t{state}\t{doing}"] += 1
        time.sleep(INTERVAL)
    record.write_text(json.dumps(counts))


def record_command(argv: list[str], record: Path) -> int:
    """Run argv, sampling its threads until it exits. Returns its exit status."""
    child = subprocess.Popen(argv, preexec_fn=_die_with_parent)
    record_samples(child.pid, record, lambda: child.poll() is None)
    return child.returncode


def record_process(pid: int, record: Path) -> int:
    """Sample the running process `pid` until this process gets SIGINT or `pid` exits."""
    stopped = []
    signal.signal(signal.SIGINT, lambda *_: stopped.append(True))
    record_samples(pid, record, lambda: not stopped and os.path.exists(f"/proc/{pid}"))
    return 0


def _die_with_parent():
    """In the child: killed with the sampler (the benchmark kills a row that outlasts its limit)."""
    ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def group(name: str) -> str:
    """A thread's group: its name without the pool's index (rankfs-read-3 -> rankfs-read)."""
    return re.sub(r"[-_ ]?\d+$", "", name) or "?"


def summarize(record: Path) -> str:
    rows = [(*key.split("\t"), n) for key, n in json.loads(record.read_text()).items()]
    threads = {(name, tid) for name, tid, *_ in rows}
    waiters = collections.defaultdict(set)
    for name, tid, _, doing, _ in rows:
        if doing.startswith("futex@"):
            waiters[doing].add((group(name), tid))
    gil = {f for f, who in waiters.items()
           if len({g for g, _ in who}) >= 2 and len(who) * 2 >= len(threads)}
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, _, state, doing, n in rows:
        what = ("on a CPU" if state == "R" or doing == "running" else "waiting for the GIL" if doing in gil
                else "waiting on another futex" if doing.startswith("futex@")
                else f"in {doing} ({'disk' if state == 'D' else 'asleep'})")
        groups[group(name)][what] += n
    lines = [f"{len(threads)} threads; futexes taken for the GIL's: {len(gil)}"]
    for kind, whats in sorted(groups.items(), key=lambda g: -sum(g[1].values())):
        total = sum(whats.values())
        lines.append(f"{kind}: {total} samples")
        lines += [f"  {100 * n / total:5.1f}%  {what}" for what, n in whats.most_common(6)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if "--record" not in argv:
        print(summarize(Path(argv[0])))
        return 0
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python3 -m dev.bench.thread_states")
    p.add_argument("--record", type=Path, required=True)
    p.add_argument("--pid", type=int, help="sample this running process (until SIGINT) instead of a command")
    args = p.parse_args(argv[:split])
    if args.pid is not None:
        return record_process(args.pid, args.record)
    return record_command(argv[split + 1:], args.record)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
