"""What rankfs costs a Python process that never opens a rankfs file: wall time and peak resident
memory of `rankfs run -- python3 -c pass` against `python3 -c pass`, runs interleaved, medians; the
threads the process has when its code starts; and, where vLLM is installed, what its plugin costs a
vLLM process (vLLM's own plugin loader, the rankfs plugin alone, timed inside the process).

    python3 -m dev startup-cost [--runs 41]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def measure(command: list[str]) -> tuple[float, int]:
    """(seconds, peak RSS in bytes) of one run."""
    began = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - began
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(command)} failed")
    return seconds, usage.ru_maxrss * 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m dev startup-cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=41, help="runs of each (default: %(default)s)")
    args = p.parse_args(argv)
    plain = [sys.executable, "-c", "pass"]
    hooked = ["rankfs", "run", "--", *plain]
    results: dict[str, list[tuple[float, int]]] = {"plain": [], "hooked": []}
    for _ in range(args.runs):
        results["plain"].append(measure(plain))
        results["hooked"].append(measure(hooked))
    seconds = {k: statistics.median(s for s, _ in v) for k, v in results.items()}
    rss = {k: statistics.median(r for _, r in v) for k, v in results.items()}
    threads = subprocess.run(["rankfs", "run", "--", sys.executable, "-c",
                              "import threading, safetensors; print(threading.active_count())"],
                             capture_output=True, text=True, check=True).stdout.strip()
    print(f"python3 -c pass                   {seconds['plain'] * 1e3:6.1f} ms  {rss['plain'] / 2**20:6.1f} MiB")
    print(f"rankfs run -- python3 -c pass     {seconds['hooked'] * 1e3:6.1f} ms  {rss['hooked'] / 2**20:6.1f} MiB")
    print(f"cost of rankfs run                {(seconds['hooked'] - seconds['plain']) * 1e3:+6.1f} ms  "
          f"{(rss['hooked'] - rss['plain']) / 2**20:+6.1f} MiB  (medians of {args.runs}; the launcher's own "
          f"Python start included)")
    print(f"threads in a process under rankfs run that imported safetensors: {threads}")
    plugin = vllm_plugin_cost(max(5, args.runs // 8))
    if plugin:
        print(f"vLLM's plugin loader with the rankfs plugin      {plugin[0] * 1e3:6.1f} ms  (median of "
              f"{plugin[2]}; threads before / after: {plugin[1]})")
    return 0


PLUGIN_PROBE = """
import os, threading, time
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import vllm.plugins as plugins
before = threading.active_count()
began = time.perf_counter()
plugins.load_general_plugins()
print(time.perf_counter() - began, before, threading.active_count())
"""


def vllm_plugin_cost(runs: int) -> tuple[float, str, int] | None:
    """(seconds, 'threads before / after', runs) of vLLM's general-plugin loading with the rankfs
    plugin alone (VLLM_PLUGINS=rankfs), vLLM imported first; None without vLLM."""
    samples = []
    for _ in range(runs):
        result = subprocess.run([sys.executable, "-c", PLUGIN_PROBE], capture_output=True, text=True,
                                env={**os.environ, "VLLM_PLUGINS": "rankfs"})
        if result.returncode != 0:
            return None
        seconds, before, after = result.stdout.split()[-3:]
        samples.append((float(seconds), f"{before} / {after}"))
    return statistics.median(s for s, _ in samples), samples[-1][1], runs


if __name__ == "__main__":
    sys.exit(main())
