"""`rankfs mount --trace FILE`: the read engine's events, accounting for what the daemon counted,
and the benchmark's summary of them."""

from __future__ import annotations

import collections

import pytest

from conftest import mapped_digests, mounted, settled_status
from dev.bench import trace_summary
from dev.memstate import MIB
from rankfs.reader.chunks import CHUNK_BYTES

pytestmark = pytest.mark.mount


def test_a_trace_accounts_for_the_chunks_the_daemon_read_and_pushed(large_checkpoint, mount_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    flags = ("--tp-size", 4, "--tp-rank", 1, "--inflight-gb", 128 * MIB / (1 << 30), "--trace", trace)
    with mounted(large_checkpoint, mount_dir, *flags):
        mapped_digests(mount_dir / "target")
        status = settled_status(mount_dir)
    events = trace_summary.read_events(trace)  # complete once unmounted
    count = collections.Counter(e["event"] for e in events)
    data = sum(e["pushed"] for e in events if e["event"] == "pushed")
    fill = sum(e["pushed_fill"] for e in events if e["event"] == "pushed")
    assert count["queued"] == status["prefetch_loads"] > 0
    assert sum(e["demand"] for e in events if e["event"] == "read") == status["demand_loads"]
    assert (data, fill) == (status["pushed_bytes"], status["pushed_fill_bytes"]) and data > 0 and fill > 0
    paths = {e["inode"]: e["path"] for e in events if e["event"] == "file"}
    requested = {e["path"] for e in events if e["event"] == "request" and e["path"]}
    assert requested and requested <= set(paths.values())
    assert {paths[e["inode"]] for e in events if e["event"] == "first"} <= requested
    worker_calls = [e for e in events if e["event"] in ("read", "pushed")]
    assert all(e["asked"] <= e["began"] <= e["ended"] <= e["t"] for e in worker_calls)
    summary = trace_summary.summarize(events)
    assert f"chunks read: {count['read'] - status['demand_loads']} ahead" in summary
    assert f"reads ahead: {count['read'] - status['demand_loads']}, " in summary
    assert f"pushes: {count['pushed']}, " in summary


def test_reads_ahead_are_bounded_by_their_bytes_not_their_count(large_checkpoint, mount_dir, tmp_path):
    # A sliced view's chunks are rows of experts, most smaller than 8 MiB: more of them go at once
    # than the workers' number, and never more than the workers' number of whole chunks' bytes. The
    # event loop queues reads back to back while the bytes allow (no checkpoint between them), and a
    # read's end is traced by the loop after: how many are in flight follows from the chunks' sizes,
    # not from how the threads are scheduled.
    trace = tmp_path / "trace.jsonl"
    flags = ("--tp-size", 4, "--tp-rank", 1, "--workers", 2, "--trace", trace)
    with mounted(large_checkpoint, mount_dir, *flags):
        mapped_digests(mount_dir / "target")
    events = trace_summary.read_events(trace)
    queued = {(e["inode"], e["offset"]): e["t"] for e in events if e["event"] == "queued"}
    spans = [(queued[(e["inode"], e["offset"])], e["t"], e["bytes"]) for e in events
             if e["event"] == "read" and not e["demand"]]
    in_flight = [[(s, t, b) for s, t, b in spans if s <= at < t] for at, _, _ in spans]
    assert max(sum(b for *_, b in reads) for reads in in_flight) <= 2 * CHUNK_BYTES
    assert max(len(reads) for reads in in_flight) > 2
