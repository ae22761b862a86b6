"""The hook's slabs: a dead slab's buffer serves the next one while the budget has room; what
does not fit is unmapped, and nothing is kept after the load."""

from __future__ import annotations

import gc

from loader.slabs import SlabPool

MIB = 1 << 20


def test_dead_slabs_are_reused_then_evicted_then_dropped():
    pool = SlabPool(MIB, 3 * MIB, pin=False)
    slabs = [pool.allocate(MIB, [f"t{i}"], "a.safetensors") for i in range(3)]
    buffers = [slab.buffer for slab in slabs]
    view = slabs[0].tensor[:16]  # a tensor the loader still holds keeps its slab live
    del slabs
    gc.collect()
    assert pool.alive() == [("a.safetensors", ["t0"])]
    del view
    gc.collect()
    assert pool.alive() == [] and pool.stats.live_bytes == 0

    again = pool.allocate(MIB, ["t3"], "b.safetensors")
    idle = list(pool._idle)
    assert any(again.buffer is buffer for buffer in buffers) and len(idle) == 2  # reused, not mapped anew

    larger = pool.allocate(2 * MIB, ["t4"], "b.safetensors")  # no idle buffer fits: a new one
    pool.alive()  # 3 MiB live: both idle buffers exceed the budget and are unmapped
    assert pool._idle == [] and all(buffer.map.closed for buffer in idle)

    del again, larger
    gc.collect()
    pool.drop_idle()
    assert pool._idle == [] and pool.stats.live_bytes == 0
