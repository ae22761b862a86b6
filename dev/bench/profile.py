"""Where a benchmark load spends its time: the load's process recorded by py-spy (every thread,
idle ones included), summed per thread group (the hook's readers, the loader's copy and open
threads, the main thread) into the frames they sat in most.

    python3 -m dev bench ... --profile [MODE] # a py-spy record and a summary per load row (and its mount's daemon)
    python3 -m dev.bench.profile RAW [N]      # the summary of a record (py-spy's raw format)

`--profile threads` samples the kernel's view of the load's threads instead (dev.bench.thread_states).
"""

from __future__ import annotations

import collections
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from dev.bench import thread_states

FRAME_DEPTH = 3  # innermost frames shown per sample: enough to tell a wait from a read


# What a record samples: every thread, waits included; only the threads holding the GIL (who makes
# the others wait); every thread with its C frames (numpy's copies, the kernel calls), which needs
# the process paused at each sample; or, without py-spy, each thread's state and system call.
MODES = {"idle": ["--idle", "--nonblocking"], "gil": ["--gil", "--nonblocking"], "native": ["--idle", "--native"],
         "threads": []}


def command(record: Path, mode: str = "idle") -> list[str] | None:
    """The prefix that records a command into `record` (a mode of MODES); None where py-spy is
    wanted and missing."""
    if mode == "threads":
        return thread_states.command(record)
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    return [spy, "record", "--rate", "100", "--threads", *MODES[mode], "--format", "raw", "--output", str(record),
            "--"]


def attach(pid: int, record: Path, mode: str = "idle") -> subprocess.Popen | None:
    """py-spy recording a running process (a mount's daemon) into `record` until `detach`; never
    pausing it: a FUSE daemon stopped mid-request stalls its readers. In `threads` mode, the
    kernel's view of its threads instead."""
    if mode == "threads":
        return subprocess.Popen(thread_states.attach_command(record, pid))
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    return subprocess.Popen([spy, "record", "--rate", "100", "--threads", "--idle", "--nonblocking", "--format", "raw",
                             "--output", str(record), "--pid", str(pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def detach(recorder: subprocess.Popen | None, record: Path, mode: str = "idle"):
    """Stop an `attach` recording (both recorders write their record on SIGINT) and summarize it
    beside it."""
    if recorder is None:
        return
    recorder.send_signal(signal.SIGINT)
    recorder.wait(timeout=60)
    if record.exists():
        record.with_suffix(".summary.txt").write_text(summarize(record, mode=mode) + "\n")


def _frame(frame: str) -> str:
    return re.sub(r" \((?:.*/)?([^/]*:\d+)\)", r" (\1)", frame)


def summarize(record: Path, top: int = 8, mode: str = "idle") -> str:
    if mode == "threads":
        return thread_states.summarize(record)
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in record.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        thread, *frames = stack.split(";")
        where = " < ".join(_frame(f) for f in frames[::-1][:FRAME_DEPTH])
        groups[thread_states.group(thread.split(": ", 1)[-1])][where] += int(count)
    lines = []
    for group, frames in sorted(groups.items(), key=lambda g: -sum(g[1].values())):
        total = sum(frames.values())
        lines.append(f"{group}: {total} samples")
        lines += [f"  {100 * n / total:5.1f}%  {where}" for where, n in frames.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summarize(Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8))
