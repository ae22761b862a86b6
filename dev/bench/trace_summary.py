"""What a load through a view waited on, from the daemon's trace (`rankfs mount --trace FILE`) or
the hook's (RANKFS_HOOK_TRACE=FILE) and, where given, the benchmark row of that load (its timeline,
on the same clock).

    python3 -m dev bench ... --trace            # a trace and its summary per row through a view
    python3 -m dev.bench.trace_summary TRACE [ROW_JSON] [--step SECONDS]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

GB = 1e9


def _quantiles(values: list[float]) -> str:
    values = sorted(values)
    if not values:
        return "-"
    q = lambda f: values[min(len(values) - 1, int(f * len(values)))]  # noqa: E731
    return f"{q(0.5):.3f} (p10 {q(0.1):.3f}, p90 {q(0.9):.3f}, p99 {q(0.99):.3f})"


def _worker_calls(name: str, events: list[dict]) -> str:
    """Where a kind of worker call spent its time (ms): waiting for a thread, in the thread, and
    waiting for the event loop to take its result; and how many were in flight on average."""
    if not events:
        return f"{name}: none"
    span = max(e["t"] for e in events) - min(e["asked"] for e in events)
    in_flight = sum(e["t"] - e["asked"] for e in events) / span if span > 0 else 0.0
    ms = lambda a, b: _quantiles([(e[b] - e[a]) * 1000 for e in events])  # noqa: E731
    return (f"{name}: {len(events)}, {in_flight:.1f} in flight; waited for a thread {ms('asked', 'began')} ms, "
            f"ran {ms('began', 'ended')} ms, waited for the loop {ms('ended', 't')} ms")


def _stalls(timeline: list[tuple[float, int]], longer_than: float = 0.1) -> str:
    """The loader's sampler thread (dev.bench.paths) wakes every 20 ms: where it did not for longer,
    one of the loader's threads held the GIL all that time (a safetensors open or listing blocked
    in the kernel holds it)."""
    gaps = [b[0] - a[0] for a, b in zip(timeline, timeline[1:]) if b[0] - a[0] > longer_than]
    return (f"the loader's sampler kept from the GIL over {longer_than:.1f} s: {len(gaps)} times, "
            f"{sum(gaps):.2f} s in all, the longest {max(gaps, default=0.0):.2f} s")


def summarize(events: list[dict], row: dict | None = None, step: float = 0.5) -> str:
    requests = [e for e in events if e["event"] == "request" and e["path"]]
    pushes = [e for e in events if e["event"] == "pushed"]
    chunk = lambda e: (e["inode"], e["offset"])  # noqa: E731
    pushed = {chunk(e): e["t"] for e in pushes}
    first = {chunk(e): e["t"] for e in events if e["event"] == "first"}
    reads = [e for e in events if e["event"] == "read"]
    read_at = {chunk(e): e["t"] for e in reads if not e["demand"]}
    push_waits = [e["asked"] - read_at[chunk(e)] for e in pushes if chunk(e) in read_at]
    sizes = collections.Counter("1 MiB" if e["bytes"] >= 1 << 20 else "8 KiB or less" if e["bytes"] <= 8192
                                else "between" for e in requests)
    ahead = [first[c] - t for c, t in pushed.items() if c in first and t < first[c]]
    lines = [
        f"requests: {len(requests)}, {sum(e['bytes'] for e in requests) / GB:.2f} GB "
        f"({', '.join(f'{n} of {k}' for k, n in sizes.most_common())}); answered in {_quantiles([e['seconds'] for e in requests])} s",
        f"chunks read: {sum(not e['demand'] for e in reads)} ahead, {sum(e['demand'] for e in reads)} for a waiting request; "
        f"pushed {sum(e['pushed'] for e in pushes) / GB:.2f} GB "
        f"(+ {sum(e['pushed_fill'] for e in pushes) / GB:.2f} GB of fill on their pages)",
        f"chunks a loader asked for: {len(first)}, {len(ahead)} of them pushed before, by {_quantiles(ahead)} s",
        _worker_calls("reads ahead", [e for e in reads if not e["demand"]]),
        _worker_calls("reads for a waiting request", [e for e in reads if e["demand"]]),
        _worker_calls("pushes", pushes),
        f"read ahead, then waited for a push thread: {_quantiles(push_waits)} s",
        _worker_calls("listings pushed at a first open (the open waits)",
                      [e for e in events if e["event"] == "listed"]),
    ]
    if row and row.get("timeline"):
        lines.append(_stalls(row["timeline"]))
    events = [e for e in events if e["event"] != "file"]  # laid out at the mount, before any load
    if not events:
        return "\n".join(lines)
    start = row["started"] if row and "started" in row else events[0]["t"]
    timeline = row.get("timeline", []) if row else []
    buckets = collections.defaultdict(list)  # step index -> its events
    for e in events:
        buckets[int((e["t"] - start) // step)].append(e)
    lines.append(f"\n{'t s':>6} {'loader GB':>9} {'req MB':>7} {'pushed MB':>9} {'read MB':>8} "
                 f"{'files pushed':>12} {'files asked':>11}")
    for i in range(min(0, min(buckets)), max(buckets) + 1):
        span = buckets.get(i, [])
        mb = lambda kind, key="bytes": sum(e[key] for e in span if e["event"] == kind) / 2**20  # noqa: E731
        landed = max([b for t, b in timeline if t <= (i + 1) * step] or [0]) / GB
        lines.append(f"{i * step:6.1f} {landed:9.2f} {mb('request'):7.0f} {mb('pushed', 'pushed'):9.0f} "
                     f"{mb('read'):8.0f} {len({e['inode'] for e in span if e['event'] == 'pushed'}):12d} "
                     f"{len({e['inode'] for e in span if e['event'] == 'first'}):11d}")
    return "\n".join(lines)


def summarize_hook(events: list[dict], row: dict | None = None, step: float = 0.1) -> str:
    """The hook's side of a load: how its groups were staged (waiting for a read thread, reading),
    what the loader waited for, file by file, and a timeline of the reads beside what the loader
    copied."""
    groups = [e for e in events if e["event"] == "group"]
    waits = [e for e in events if e["event"] == "wait"]
    opens = {e["path"]: e for e in events if e["event"] == "open"}
    if not groups:
        return "no group staged"
    start = row["started"] if row and "started" in row else min(e["began"] for e in events if "began" in e)
    busy = _union([(e["began"], e["ended"]) for e in groups])
    staged = sum(e["bytes"] for e in groups)
    waited_for_thread = _quantiles([e["began"] - e["asked"] for e in groups])
    lines = [
        f"groups: {len(groups)}, {staged / GB:.2f} GB; staged at {staged / busy / GB:.2f} GB/s over the {busy:.2f} s "
        f"some group was being staged; waited for a read thread {waited_for_thread} s, "
        f"staged in {_quantiles([e['ended'] - e['began'] for e in groups])} s",
        _jobs([e for e in events if e["event"] == "job"]),
        _bounces(events, start),
        f"the loader waited for a group {len(waits)} times, {sum(e['t'] - e['began'] for e in waits):.2f} s in all: "
        f"{_quantiles([e['t'] - e['began'] for e in waits])} s",
        f"\n{'file':<40} {'opened':>7} {'took':>6} {'first read':>10} {'last staged':>11} {'GB':>5} {'waited':>7}",
    ]
    by_file = collections.defaultdict(list)
    for e in groups:
        by_file[e["path"]].append(e)
    for path in sorted(set(by_file) | set(opens)):
        staged_here, opened = by_file.get(path, []), opens.get(path)
        first = min((e["began"] for e in staged_here), default=None)
        last = max((e["ended"] for e in staged_here), default=None)
        waited = sum(e["t"] - e["began"] for e in waits if e["path"] == path)
        at = lambda t: "-" if t is None else f"{t - start:.3f}"  # noqa: E731
        lines.append(f"{path.rsplit('/', 1)[-1][-40:]:<40} {at(opened and opened['began']):>7} "
                     f"{(opened['t'] - opened['began']) if opened else 0:6.3f} {at(first):>10} {at(last):>11} "
                     f"{sum(e['bytes'] for e in staged_here) / GB:5.2f} {waited:7.3f}")
    timeline = row.get("timeline", []) if row else []
    end = max(e["t"] for e in events)
    lines.append(f"\n{'t s':>6} {'loader GB':>9} {'staged MB':>9} {'groups':>6} {'files':>5} {'waiting':>7}")
    for i in range(int((end - start) // step) + 1):
        lo, hi = start + i * step, start + (i + 1) * step
        running = [e for e in groups if e["began"] < hi and e["ended"] > lo]
        mb = sum(e["bytes"] * _overlap(e["began"], e["ended"], lo, hi) / max(e["ended"] - e["began"], 1e-9)
                 for e in running) / 2**20
        landed = max([b for t, b in timeline if t <= (i + 1) * step] or [0]) / GB
        waiting = sum(_overlap(e["began"], e["t"], lo, hi) for e in waits) / step
        lines.append(f"{i * step:6.1f} {landed:9.2f} {mb:9.0f} {len(running):6d} "
                     f"{len({e['path'] for e in running}):5d} {waiting:7.1f}")
    return "\n".join(lines)


def _bounces(events: list[dict], start: float) -> str:
    """When the read threads' bounce buffers were made (GPU staging), and what waiting for them cost."""
    made = [e for e in events if e["event"] == "bounce"]
    taken = [e for e in events if e["event"] == "bounce-taken"]
    if not made:
        return "bounce buffers: none made"
    return (f"bounce buffers: {len(made)} made from {min(e['began'] for e in made) - start:.3f} s, the last ready at "
            f"{max(e['t'] for e in made) - start:.3f} s, each in {_quantiles([e['t'] - e['began'] for e in made])} s "
            f"({sum(not e['pinned'] for e in made)} not page-locked); the read threads waited "
            f"{sum(e['t'] - e['began'] for e in taken):.3f} s in all for {len(taken)}")


def _jobs(jobs: list[dict]) -> str:
    """How much of their jobs' time the read threads ran on a CPU (the rest they waited)."""
    if not jobs:
        return "jobs: none traced"
    wall = sum(e["ended"] - e["began"] for e in jobs)
    cpu = sum(e["cpu"] for e in jobs)
    runnable = sum(e.get("runnable", 0) for e in jobs)
    some = _union([(e["began"], e["ended"]) for e in jobs])
    return (f"jobs: {len(jobs)}, {sum(e['reads'] for e in jobs)} reads, {wall:.2f} s in all, of it "
            f"{cpu:.2f} s on a CPU ({cpu / wall:.0%}), {runnable:.2f} s waiting for one, the rest asleep, "
            f"switched in {sum(e.get('switches', 0) for e in jobs)} times; a job "
            f"{_quantiles([e['ended'] - e['began'] for e in jobs])} s, {sum(e['bytes'] for e in jobs) / wall / GB:.2f} "
            f"GB/s a thread; {wall / some:.1f} threads in a job on average over the {some:.2f} s some thread was")


def _overlap(begin: float, end: float, lo: float, hi: float) -> float:
    return max(0.0, min(end, hi) - max(begin, lo))


def _union(spans: list[tuple[float, float]]) -> float:
    """The seconds covered by at least one of the spans."""
    covered, reach = 0.0, float("-inf")
    for begin, end in sorted(spans):
        if end > reach:
            covered += end - max(begin, reach)
            reach = end
    return covered


def read_events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m dev.bench.trace_summary", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="the daemon's trace (rankfs mount --trace FILE) or the hook's (RANKFS_HOOK_TRACE)")
    p.add_argument("row", nargs="?", help="the load's benchmark row, JSON (a line of rows.jsonl)")
    p.add_argument("--step", type=float,
                   help="seconds per line of the timeline (default: 0.5 for the daemon's, 0.1 for the hook's)")
    args = p.parse_args(argv)
    row = json.loads(open(args.row).read()) if args.row else None
    events = read_events(args.trace)
    hook = any(e["event"] == "group" for e in events)
    if hook:
        print(summarize_hook(events, row, args.step or 0.1))
    else:
        print(summarize(events, row, args.step or 0.5))
    return 0


if __name__ == "__main__":
    sys.exit(main())
