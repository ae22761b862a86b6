"""The benchmark's results: each row's shape (time to the first byte, steady rate), the bitwise
check against the original shards, the median of a row's runs, the table and the timeline."""

from __future__ import annotations

from pathlib import Path


def shape(result: dict, planned: int):
    """Time to the first byte landed, and the rate between a tenth and nine tenths of the bytes."""
    timeline = result.get("timeline") or []
    first = next((t for t, b in timeline if b > 0), None)
    total = result.get("bytes") or 0
    lo = next((t for t, b in timeline if b >= 0.1 * total), None)
    hi = next((t for t, b in timeline if b >= 0.9 * total), None)
    result["ttfb"] = first
    result["steady_gb_per_s"] = 0.8 * total / (hi - lo) / 1e9 if lo is not None and hi and hi > lo else None
    if "seconds" in result:
        result["gb_per_s"] = planned / result["seconds"] / 1e9


def check_bitwise(rows: list[dict]):
    """Each load's weights against those the first load of the original shards got (stock, the
    ceiling or a peer): `bitwise` True where every run of the row equals them, False where one does
    not, None with no such load in the run."""
    reference = next((r["weights_sha256"] for r in rows if "weights_sha256" in r and not r["through_view"]), None)
    for row in rows:
        if "weights_sha256" in row:
            row["bitwise"] = None if reference is None else set(row["runs_weights_sha256"]) == {reference}


def median_run(runs: list[dict]) -> dict:
    """The run of median time (of two, the faster), every run's seconds and digests in it; the
    last run where none has a time (each failed)."""
    timed = sorted((r for r in runs if "seconds" in r), key=lambda r: r["seconds"])
    if not timed:
        return runs[-1]
    median = timed[(len(timed) - 1) // 2]
    median["runs_seconds"] = [r["seconds"] for r in timed]
    median["runs_weights_sha256"] = sorted({r["weights_sha256"] for r in timed if "weights_sha256" in r})
    return median


BITWISE = {True: "equal", False: "DIFFER", None: "-"}  # a row's weights against the original shards'


def table(result: dict) -> str:
    lines = [f"\n{result['case']}: {result['spec']}",
             f"{'mode':<5} {'path':<44} {'s':>6} {'GB/s':>6} {'x limit':>7} {'TTFB s':>6} {'steady':>6} "
             f"{'waited':>6} {'copy thr':>8} {'CPU s':>11} "
             f"{'release s':>9} {'loader RSS':>10} {'daemon RSS':>10} {'hook pinned':>11} {'hook GPU':>10} "
             f"{'cache left':>10} {'runs s':>11} {'bitwise':>7}"]
    mib = lambda n: f"{n / 2**20:6.0f} MiB" if n else f"{'-':>10}"  # noqa: E731
    spread = lambda r: (f"{min(r['runs_seconds']):.2f}-{max(r['runs_seconds']):.2f}"  # noqa: E731
                        if len(r.get("runs_seconds", ())) > 1 else "-")
    bound = lambda r: (f"{r['waited']:6.2f} {r['copying'] / r['seconds']:8.1f}" if r.get("copying")  # noqa: E731
                       else f"{'-':>6} {'-':>8}")  # the limits copy nothing
    cpu = lambda r: (f"{r['cpu_seconds']:.1f}" + (f"+{r['daemon_cpu_seconds']:.1f}"  # noqa: E731
                                                  if "daemon_cpu_seconds" in r else "")) if "cpu_seconds" in r else "-"
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"{r['mode']:<5} {r['path']:<44} error: {r['error']}")
            continue
        release = r.get("release") or {}
        lines.append(f"{r['mode']:<5} {r['path']:<44} {r['seconds']:6.2f} {r['gb_per_s']:6.2f} "
                     f"{r.get('ratio_to_limit', float('nan')):7.2f} {r['ttfb'] or float('nan'):6.2f} "
                     f"{r['steady_gb_per_s'] or float('nan'):6.2f} {bound(r)} {cpu(r):>11} {r.get('release_seconds', float('nan')):9.2f} "
                     f"{mib(r['peak_rss']):>10} "
                     f"{mib(r.get('daemon_peak_rss')):>10} {mib(release.get('peak_host_bytes')):>11} "
                     f"{mib(release.get('peak_device_bytes')):>10} {mib(max(0, r['cached_after'])):>10} "
                     f"{spread(r):>11} {BITWISE[r.get('bitwise')]:>7}")
    return "\n".join(lines)


def plot(results: list[dict], path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [(result, mode) for result in results for mode in sorted({r["mode"] for r in result["rows"]})]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (result, mode) in zip(axes[0], panels):
        for r in result["rows"]:
            if r["mode"] == mode and r.get("timeline"):
                t, b = zip(*r["timeline"])
                ax.plot(t, [x / 1e9 for x in b], label=r["path"])
        ax.set_title(f"{result['case']} ({mode}): {result['spec']}", fontsize=9)
        ax.set_xlabel("seconds")
        ax.set_ylabel("GB loaded")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
