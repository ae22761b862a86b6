"""The benchmark's profile summary (dev/bench/profile.py)."""

from __future__ import annotations

from dev.bench.profile import summarize


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
