"""The hook's slabs: a slab's budget is released the moment its last tensor dies, its buffer serves
the next slab while the budget has room, what does not fit is unmapped, nothing is kept after the
load."""

from __future__ import annotations

import gc

from rankfs.loader.budget import Budget
from rankfs.loader.slabs import SlabPool

MIB = 1 << 20


def test_dead_slabs_are_released_reused_then_evicted_then_dropped():
    budget = Budget(3 * MIB)
    pool = SlabPool(MIB, budget, pin=False)

    def allocate(nbytes, name, file):  # as the read threads do: reserved at admission
        budget.reserve(nbytes)
        return pool.allocate(nbytes, [name], file)
    slabs = [allocate(MIB, f"t{i}", "a.safetensors") for i in range(3)]
    buffers = [slab.buffer for slab in slabs]
    view = slabs[0].tensor[:16]  # a tensor the loader still holds keeps its slab live
    del slabs
    assert pool.alive() == [("a.safetensors", ["t0"])] and budget.used == MIB
    del view
    assert pool.alive() == [] and budget.used == 0  # no collection needed: torch frees the storage

    again = allocate(MIB, "t3", "b.safetensors")
    assert any(again.buffer is buffer for buffer in buffers) and len(pool._idle) == 2  # reused, not mapped anew
    idle = list(pool._idle)
    larger = allocate(2 * MIB, "t4", "b.safetensors")  # none fits: a new one
    assert pool._idle == [] and all(buffer.map.closed for buffer in idle)  # 3 MiB in use: no room for idle

    del again, larger
    gc.collect()
    pool.drop_idle()
    assert pool._idle == [] and budget.used == 0 and pool.pinned_bytes() == 0
