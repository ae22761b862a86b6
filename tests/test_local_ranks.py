"""Ranks of one host loading from one mount (`--local-ranks`) at once, each in a process of its own
under the hook: each gets its own bytes, bitwise, and the host reads each byte of the sources from
the disk once, whatever the ranks share; once every rank is done, nothing is left in page cache."""

from __future__ import annotations

import argparse
import json

import pytest

from conftest import mounted
from dev.bench.engine_like import shard_files
from dev.bench.gpu_load import _load_args, _rank_plans, _run_ranks, _union_bytes
from dev.memstate import cached_bytes_in, disk_read_bytes, uncache
from rankfs.common import contract

pytestmark = pytest.mark.mount

CASES = {  # name -> (tp size, ep size): two ranks of one EP rank (the same experts), and sliced experts
    "ep2": (4, 2),
    "ep1-sliced": (4, 1),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_of_one_host_read_each_shared_byte_once(large_checkpoint, mount_dir, case):
    tp_size, ep_size = CASES[case]
    ranks = [0, 1]
    layout = argparse.Namespace(checkpoint=str(large_checkpoint), tp_size=tp_size, ep_size=ep_size, device="cpu")
    plans = _rank_plans(layout, ranks)
    union = _union_bytes(span for plan in plans.values() for span in plan["reads"])
    total = sum(_union_bytes(plan["reads"]) for plan in plans.values())
    assert total > 1.3 * union  # the two ranks share much
    sources = shard_files(large_checkpoint)
    with mounted(large_checkpoint, mount_dir, "--tp-size", tp_size, "--ep-size", ep_size, "--local-ranks", "0,1"):
        daemon = contract.read_status(str(mount_dir))["pid"]
        uncache(sources)
        daemon_read = disk_read_bytes(daemon)
        loads = [(rank, _load_args(layout, rank, mount_dir / "target", "stock", plans[rank]["names"], hook=True))
                 for rank in ranks]
        hooked = _run_ranks(loads, "cpu")
        read = sum(r["disk_read_bytes"] for r in hooked) + disk_read_bytes(daemon) - daemon_read
        status = contract.read_status(str(mount_dir))
        left = sum(cached_bytes_in(sources[source], [(begin, end)]) for plan in plans.values()
                   for source, begin, end in plan["reads"])
    assert read <= 1.1 * union, f"the host read {read / union:.2f}x the union of the ranks' bytes"
    # Dropped once both ranks were done; pages a process still maps then stay until the kernel needs them.
    assert status["uncached_shared_bytes"] >= union and left <= union // 100
    assert all(r["release"]["slabs_alive"] == 0 and r["release"]["pinned_bytes"] == 0 for r in hooked)
    stock = _run_ranks([(rank, _load_args(layout, rank, large_checkpoint, "stock", [])) for rank in ranks], "cpu")
    assert [r["weights_sha256"] for r in hooked] == [r["weights_sha256"] for r in stock]
    print(json.dumps({"case": case, "union": union, "sum": total, "read": read}))


def test_the_bytes_no_other_rank_reads_are_read_direct(large_checkpoint, mount_dir):
    """EP1 sliced: each rank's rows of w1 and w3 are its own, every rank reads whole rows of w2. One
    rank loading alone leaves in the page cache the pages the other rank will read, and nothing of
    its own: those it read direct, at the disk's rate, as a rank alone does."""
    layout = argparse.Namespace(checkpoint=str(large_checkpoint), tp_size=4, ep_size=1, device="cpu")
    plans = _rank_plans(layout, [0, 1])
    own, other = plans[0]["reads"], plans[1]["reads"]
    both = _union_bytes(own) + _union_bytes(other) - _union_bytes(own + other)
    own_bytes = _union_bytes(own)
    assert own_bytes - both > 64 << 20  # the rank's own
    sources = shard_files(large_checkpoint)
    with mounted(large_checkpoint, mount_dir, "--tp-size", 4, "--ep-size", 1, "--local-ranks", "0,1"):
        uncache(sources)
        [hooked] = _run_ranks([(0, _load_args(layout, 0, mount_dir / "target", "stock", plans[0]["names"],
                                              hook=True))], "cpu")
        left = sum(cached_bytes_in(sources[source], [(b, e) for s, b, e in own if s == source])
                   for source in {s for s, _, _ in own})
        uncache(sources)
    assert both // 2 <= left <= both + (1 << 20), f"{left / both:.2f}x the pages the other rank reads"
    reads = hooked["release"]
    assert reads["source_cached_bytes"] <= both + (1 << 20) and reads["source_direct_bytes"] >= own_bytes - both - (1 << 20)
    [stock] = _run_ranks([(0, _load_args(layout, 0, large_checkpoint, "stock", []))], "cpu")
    assert hooked["weights_sha256"] == stock["weights_sha256"]
