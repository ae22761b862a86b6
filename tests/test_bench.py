"""The benchmark's own logic: its profile summary (dev/bench/profile.py), and the check that every
load got the weights the original shards give (dev/bench/run.py)."""

from __future__ import annotations

from dev.bench.profile import summarize
from dev.bench.run import check_bitwise


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
