"""The hook's slabs: a slab's budget is released the moment its last tensor dies, its buffer serves
the next slab while the budget has room, what does not fit is unmapped, nothing is kept after the
load; and a read ahead waits for room only until the loader asks for it."""

from __future__ import annotations

import gc
import threading

from rankfs.loader.budget import Budget
from rankfs.loader.slabs import SlabPool

MIB = 1 << 20


def test_dead_slabs_are_released_reused_then_evicted_then_dropped():
    budget = Budget(3 * MIB)
    pool = SlabPool(MIB, budget, pin=False)
    slabs = [pool.allocate(MIB, [f"t{i}"], "a.safetensors", lambda: True) for i in range(3)]
    buffers = [slab.buffer for slab in slabs]
    view = slabs[0].tensor[:16]  # a tensor the loader still holds keeps its slab live
    del slabs
    assert pool.alive() == [("a.safetensors", ["t0"])] and budget.used == MIB
    del view
    assert pool.alive() == [] and budget.used == 0  # no collection needed: torch frees the storage

    again = pool.allocate(MIB, ["t3"], "b.safetensors", lambda: True)
    assert any(again.buffer is buffer for buffer in buffers) and len(pool._idle) == 2  # reused, not mapped anew
    idle = list(pool._idle)
    larger = pool.allocate(2 * MIB, ["t4"], "b.safetensors", lambda: True)  # none fits: a new one
    assert pool._idle == [] and all(buffer.map.closed for buffer in idle)  # 3 MiB in use: no room for idle

    del again, larger
    gc.collect()
    pool.drop_idle()
    assert pool._idle == [] and budget.used == 0 and pool.pinned_bytes() == 0


def test_a_read_ahead_waits_for_room_until_the_loader_asks_for_it():
    budget = Budget(2 * MIB)
    pool = SlabPool(MIB, budget, pin=False)
    held = [pool.allocate(MIB, [f"t{i}"], "a.safetensors", lambda: True) for i in range(2)]
    demanded = threading.Event()
    done = []
    reader = threading.Thread(target=lambda: done.append(
        pool.allocate(MIB, ["t2"], "a.safetensors", lambda: not demanded.is_set())))
    reader.start()
    while not budget.waiting:  # the budget is full: it waits
        reader.join(0.001)
    assert not done
    demanded.set()
    budget.wake()
    reader.join(10)
    assert done and budget.used == 3 * MIB  # over the budget by one slab, as the loader needs it
    del held
    assert budget.used == MIB
