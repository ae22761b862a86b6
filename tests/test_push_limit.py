"""The benchmark's push limit: the rank's bytes pushed into the page cache of FUSE files, every
file in turn, as the daemon pushes them (read direct where the page cache does not hold them, from
maps where it does), and the files unmounted after the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from dev.bench.push_limit import PIECE_BYTES, push_pieces
from dev.bench.bench import rank_ranges
from dev.memstate import uncache, warm
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.layout import plan_rank
from rankfs.plan.spec import RankSpec


def testpush_pieces_take_every_file_in_turn_and_cover_each_range_once():
    ranges = [("a", 0, 2 * PIECE_BYTES + 5), ("a", 10 * PIECE_BYTES, 7), ("b", 3, PIECE_BYTES)]
    sizes, pieces = push_pieces(ranges)
    assert sizes == [2 * PIECE_BYTES + 12, PIECE_BYTES]
    assert [(p[0], p[1]) for p in pieces[:3]] == [(0, 0), (1, 0), (0, PIECE_BYTES)]
    assert sorted((p[2], p[3], p[4]) for p in pieces) == [
        ("a", 0, PIECE_BYTES), ("a", PIECE_BYTES, PIECE_BYTES), ("a", 2 * PIECE_BYTES, 5),
        ("a", 10 * PIECE_BYTES, 7), ("b", 3, PIECE_BYTES)]
    assert [p[1] for p in pieces if p[0] == 0] == [0, PIECE_BYTES, 2 * PIECE_BYTES, 2 * PIECE_BYTES + 5]


@pytest.mark.mount
def test_the_push_limit_pushes_the_ranks_bytes_as_the_daemon_reads_them_and_unmounts(large_checkpoint, tmp_path):
    """Cold, every byte is read direct before its push (as the daemon's cold reads are: a fault
    through a map would add a page cache fill to the limit's cost); warm, what the page cache
    still holds is pushed from maps (a host may reclaim idle cache between the two: DAMON)."""
    ranges = rank_ranges(plan_rank(Checkpoint.open(large_checkpoint), RankSpec(4, 1, 1)))
    sources = sorted({path for path, _, _ in ranges})
    mountpoint = tmp_path / "push"
    mountpoint.mkdir()

    def push() -> dict:
        run = subprocess.run([sys.executable, "-m", "dev.bench.paths", "push"], cwd=ROOT, capture_output=True,
                             text=True, input=json.dumps({"ranges": ranges, "mountpoint": str(mountpoint)}),
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert not os.path.ismount(mountpoint)
        return json.loads(run.stdout.splitlines()[-1])
    uncache(sources)
    cold = push()
    warm(sources)
    warmed = push()
    total = sum(length for _, _, length in ranges)
    assert cold["bytes"] == warmed["bytes"] == total > 0 and cold["seconds"] > 0
    assert cold["direct_read_bytes"] == total and warmed["direct_read_bytes"] < total // 2
