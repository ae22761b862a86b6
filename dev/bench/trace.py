"""What a load through a view waited on, from the daemon's trace (`rankfs mount --trace FILE`) and,
where given, the benchmark row of that load (its timeline, on the same clock).

    python3 -m dev bench ... --trace            # a trace and its summary per row through a view
    python3 -m dev.bench.trace TRACE [ROW_JSON] [--step SECONDS]
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


def summarize(events: list[dict], row: dict | None = None, step: float = 0.5) -> str:
    requests = [e for e in events if e["event"] == "request" and e["path"]]
    pushes = [e for e in events if e["event"] == "pushed"]
    chunk = lambda e: (e["inode"], e["offset"])  # noqa: E731
    pushed = {chunk(e): e["t"] for e in pushes if not e["fill"]}
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
        f"pushed {sum(e['pushed'] for e in pushes if not e['fill']) / GB:.2f} GB "
        f"(+ {sum(e['pushed'] for e in pushes if e['fill']) / GB:.2f} GB of fill)",
        f"chunks a loader asked for: {len(first)}, {len(ahead)} of them pushed before, by {_quantiles(ahead)} s",
        _worker_calls("reads ahead", [e for e in reads if not e["demand"]]),
        _worker_calls("reads for a waiting request", [e for e in reads if e["demand"]]),
        _worker_calls("pushes", pushes),
        f"read ahead, then waited for a push thread: {_quantiles(push_waits)} s",
    ]
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


def read_events(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m dev.bench.trace", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="the daemon's trace (rankfs mount --trace FILE)")
    p.add_argument("row", nargs="?", help="the load's benchmark row, JSON (a line of rows.jsonl)")
    p.add_argument("--step", type=float, default=0.5, help="seconds per line of the timeline (default: 0.5)")
    args = p.parse_args(argv)
    row = json.loads(open(args.row).read()) if args.row else None
    print(summarize(read_events(args.trace), row, args.step))
    return 0


if __name__ == "__main__":
    sys.exit(main())
