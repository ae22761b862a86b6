"""The benchmark's own logic: its profile summaries (dev/bench/profile.py, what py-spy recorded;
dev/bench/thread_states.py, what the kernel said of each thread), the check that every load got
the weights the original shards give (dev/bench/report.py), the rounds of a repeated run
(dev/bench/bench.py), and the hook's own rate (a load with no engine copies, dev/bench/paths.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from conftest import ROOT, mounted
from dev.bench import thread_states
from dev.bench.profile import summarize
from dev.bench.bench import Bench, BenchConfig, Row, hook_env_variants
from dev.bench.report import check_bitwise
from rankfs.plan.safetensors import read_header


def test_a_profile_is_summed_per_thread_group(tmp_path):
    """The benchmark's profile summary: samples of a pool's threads count together, innermost frame first."""
    record = tmp_path / "raw.txt"
    record.write_text(
        "thread (0x1): rankfs-read-0;run (threading.py:1);_read_run (/x/loader/staged.py:10) 3\n"
        "thread (0x2): rankfs-read-1;run (threading.py:1);_read_run (/x/loader/staged.py:10) 1\n"
        "thread (0x2): rankfs-read-1;run (threading.py:1);wait (threading.py:5) 12\n"
        "thread (0x3): MainThread;main (m.py:2) 2\n")
    summary = summarize(record).splitlines()
    assert summary[0] == "rankfs-read: 16 samples"
    assert summary[1].split() == ["75.0%", "wait", "(threading.py:5)", "<", "run", "(threading.py:1)"]
    assert summary[2].split()[:3] == ["25.0%", "_read_run", "(staged.py:10)"] and summary[3] == "MainThread: 2 samples"


SPINNING_AND_IDLE = """
import threading, time
from rankfs.common.threads import start_thread
done = threading.Event()
def spin():
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        pass
spinners = [start_thread(spin, f"spin-{g}-{i}") for g in "ab" for i in range(2)]
idlers = [start_thread(done.wait, f"idle-{i}") for i in range(2)]
for thread in spinners:
    thread.join()
done.set()
"""


def test_the_thread_sampler_tells_waits_for_the_gil_from_other_waits(tmp_path):
    """Four threads of two groups spinning in Python wait for the GIL most of their time, by the
    kernel's count; two threads waiting on an event wait on a futex of their own, not the GIL's."""
    record = tmp_path / "threads.json"
    status = thread_states.main(["--record", str(record), "--", sys.executable, "-c", SPINNING_AND_IDLE])
    assert status == 0
    groups, group = {}, None
    for line in thread_states.summarize(record).splitlines()[1:]:
        if not line.startswith(" "):
            group = line.split(":")[0]
            continue
        share, what = line.split("%", 1)
        groups.setdefault(group, {})[what.strip()] = float(share)
    for spinners in ("spin-a", "spin-b"):
        assert groups[spinners].get("waiting for the GIL", 0) >= 25, groups
    idle = groups["idle"]
    assert idle.get("waiting on another futex", 0) >= 80 and idle.get("waiting for the GIL", 0) < 5, groups


def test_the_thread_sampler_names_where_a_running_process_sleeps(tmp_path):
    """A process blocked reading an empty pipe, sampled from outside: every sample of its thread
    says the read and the kernel function it sleeps in."""
    reader = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.buffer.read(1)"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not any(doing.startswith("read in ") for *_, doing in thread_states.sample(reader.pid)):
            assert time.monotonic() < deadline, thread_states.sample(reader.pid)
            os.sched_yield()
        record, samples = tmp_path / "threads.json", iter(range(20))
        thread_states.record_samples(reader.pid, record, lambda: next(samples, None) is not None)
    finally:
        reader.kill()
        reader.wait()
    counts = json.loads(record.read_text())
    assert sum(counts.values()) == 20
    for key, n in counts.items():
        name, tid, state, doing = key.split("\t")
        assert state == "S" and doing.startswith("read in ") and doing != "read in ", counts


def test_a_load_whose_weights_differ_from_the_originals_is_flagged():
    """Rows are compared with the first load of the original shards, every run of a repeated row."""
    load = lambda path, view, *digests: {"path": path, "through_view": view, "weights_sha256": digests[0],  # noqa: E731
                                         "runs_weights_sha256": sorted(set(digests))}
    rows = [{"path": "limit: O_DIRECT preads", "through_view": False}, load("stock", False, "a"),
            load("rankfs", True, "a"), load("rankfs + hook", True, "a", "b"), load("runai on the view", True, "c")]
    check_bitwise(rows)
    assert [r.get("bitwise") for r in rows] == [None, True, True, False, False]
    views_only = [load("rankfs", True, "a")]
    check_bitwise(views_only)
    assert views_only[0]["bitwise"] is None  # nothing read from the originals to compare with


def test_a_repeated_run_measures_every_row_once_a_round_in_turn_reversed(tmp_path):
    """--repeat N: N rounds of every row, each in a process of its own, so a drift of the disk
    moves every row alike, every other round in reverse, so that no row always follows another;
    each row reports its median run and every run's seconds."""
    source = tmp_path / "shard"
    source.write_bytes(os.urandom(1 << 20))
    journal = tmp_path / "rows.jsonl"
    bench = Bench(BenchConfig(tmp_path, tmp_path, "cpu", (), frozenset(), journal, repeat=3, log=lambda line: None))
    ranges = {"ranges": [(str(source), 0, 1 << 20)], "direct": False}
    rows = bench.rows([Row("first", "raw", lambda mnt: ranges), Row("second", "raw", lambda mnt: ranges)], "warm",
                      [str(source)])
    measured = [json.loads(line)["path"] for line in journal.read_text().splitlines()]
    assert measured == ["first", "second", "second", "first", "first", "second"]
    for row in rows:
        assert len(row["runs_seconds"]) == 3 and row["seconds"] == sorted(row["runs_seconds"])[1]


def test_hook_variants_are_sets_of_the_hooks_variables():
    assert hook_env_variants("") == ({},)
    assert hook_env_variants(";RANKFS_HOOK_THREADS=16,RANKFS_HOOK_SLAB_MB=64") == (
        {}, {"RANKFS_HOOK_THREADS": "16", "RANKFS_HOOK_SLAB_MB": "64"})
    for bad in ("THREADS=16", "RANKFS_HOOK_THREADS"):
        with pytest.raises(ValueError, match="is not RANKFS_HOOK_"):
            hook_env_variants(bad)


@pytest.mark.mount
def test_the_hooks_rows_run_once_per_variant(tiny_checkpoint, tmp_path):
    """--hook-env: each variant's variables reach its row's process, and only its."""
    bench = Bench(BenchConfig(tiny_checkpoint, tmp_path, "cpu", (), frozenset({"hook-alone"}), tmp_path / "rows.jsonl",
                              hook_variants=hook_env_variants(";RANKFS_HOOK_THREADS=0"), log=lambda line: None))
    rows = bench.case("ep2", ["warm"])["rows"]
    assert [row["path"] for row in rows] == ["rankfs + hook, no engine copies",
                                             "rankfs + hook, no engine copies (RANKFS_HOOK_THREADS=0)"]
    assert rows[0]["bytes"] > 0 and "RANKFS_HOOK_THREADS must be at least 1" in rows[1]["error"]


@pytest.mark.mount
def test_the_hook_alone_hands_out_every_tensor_of_the_view_and_keeps_none(large_checkpoint, mount_dir):
    """The row that bounds the hook's: every tensor of the rank's view handed out through the hook,
    none copied, and no slab alive at the release. Read into slabs, not mapped from the page cache
    (which holds the checkpoint just written): the read threads are what the row measures."""
    args = {"directory": str(mount_dir / "target"), "counts_from": str(large_checkpoint), "device": "cpu",
            "source": "stock", "hook": True, "copies": False,
            "layout": {"moe_tp_size": 4, "moe_tp_rank": 1, "ep_size": 1, "ep_rank": 0}}
    with mounted(large_checkpoint, mount_dir, "--tp-size", 4, "--tp-rank", 1):
        handed = sum(entry.nbytes for path in sorted((mount_dir / "target").glob("*.safetensors"))
                     for entry in read_header(path).tensors.values())
        run = subprocess.run([sys.executable, "-m", "dev.bench.paths", "load"], cwd=ROOT, capture_output=True,
                             text=True, input=json.dumps(args), timeout=120,
                             env={**os.environ, "RANKFS_HOOK_MAP": "off"})
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["bytes"] == handed > 0 and result["copying"] == 0 and "weights_sha256" not in result
    assert result["release"]["slabs"] > 0 and result["release"]["slabs_alive"] == 0


@pytest.mark.mount
def test_a_second_load_is_measured_on_the_mount_the_first_one_read(tiny_checkpoint, tmp_path):
    """rankfs-again: the row's load is the second on its mount, by a new process, the same bytes;
    the daemon's counters are the mount's, both loads': each chunk read once more."""
    bench = Bench(BenchConfig(tiny_checkpoint, tmp_path, "cpu", (), frozenset({"stock", "rankfs", "rankfs-again"}),
                              tmp_path / "rows.jsonl", log=lambda line: None))
    case = bench.case("ep1-sliced", ["warm"])
    stock, first, again = case["rows"]
    assert again["path"] == "rankfs, a second load (a new process)" and first["bitwise"] and again["bitwise"]
    assert first["daemon"]["read_bytes"] < again["daemon"]["read_bytes"] < 2.2 * first["daemon"]["read_bytes"]


def test_the_ep_filter_row_reads_what_vllms_filter_keeps(tiny_checkpoint):
    """The ep-filter row's loader gets every tensor but other EP ranks' expert weights (their scales
    it gets), by vLLM's own filter, and each tensor it gets equals stock's."""
    pytest.importorskip("vllm")
    import torch
    from dev.bench import sources
    from dev.bench.engine_like import shard_files
    files = shard_files(tiny_checkpoint)
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    experts = config["n_routed_experts"]
    stock = dict(sources.stock(files))
    filtered = dict(sources.ep_filtered(files, experts, 2, 1))
    owned = range(experts // 2, experts)
    skipped = {name for name in stock if ".experts." in name and name.endswith(".weight")
               and int(name.split(".experts.")[1].split(".")[0]) not in owned}
    assert skipped and set(filtered) == set(stock) - skipped
    as_bytes = lambda tensor: tensor.reshape(-1).view(torch.uint8)  # noqa: E731  (NaN patterns compare too)
    assert all(as_bytes(filtered[name]).equal(as_bytes(stock[name])) for name in filtered)
    assert {name for name, _ in sources.ep_filtered(files, experts, 1, 0)} == set(stock)  # no EP: none skipped
