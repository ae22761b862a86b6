"""The hook's slabs: a slab's budget is released the moment its last tensor dies, its buffer serves
the next slab (never unmapped mid-load while the buffers fit the budget), one that would not fit is
unmapped, nothing is kept after the load; a window of the page cache views it in place and is
unmapped with its last tensor; a GPU slab is filled piece by piece through bounce buffers, made
ahead; the budget's default follows where slabs are."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from dev.memstate import uncache
from rankfs.loader.budget import Budget
import rankfs.loader.bounce as bounce_module
from dev.host_staging import host_staging
from rankfs.loader.device_slabs import DeviceSlabs
from rankfs.loader.landing import DeviceLanding
from rankfs.common.contract import GIB
from rankfs.loader.settings import HookSettings, SettingError
from rankfs.loader.slabs import HostBuffer, SlabPool
from rankfs.common.disk import PAGE, OpenFile

MIB = 1 << 20


def test_the_budget_follows_the_memory_the_process_may_use_and_its_setting(monkeypatch):
    """Unset: 4 GiB on the GPU; in host memory at most that, and a quarter of what the process may
    still take (its cgroup's room), slabs no more than half the budget; set, exactly that, but a
    host budget above the room is refused by name, as is a bad value."""
    monkeypatch.delenv("RANKFS_HOOK_INFLIGHT_GB", raising=False)
    settings = HookSettings.from_env()
    assert settings.budget_for(host_slabs=False, room=GIB) == 4 * GIB
    assert 512 << 20 <= settings.budget_for(host_slabs=True, room=64 * GIB) <= 4 * GIB
    tight = settings.budget_for(host_slabs=True, room=GIB)
    assert tight <= GIB // 4 and 2 * settings.slab_for(tight) <= tight
    assert settings.slab_for(4 * GIB) == 256 << 20
    monkeypatch.setenv("RANKFS_HOOK_INFLIGHT_GB", "1.5")
    assert HookSettings.from_env().budget_for(host_slabs=True, room=2 * GIB) == int(1.5 * GIB)
    with pytest.raises(SettingError, match="RANKFS_HOOK_INFLIGHT_GB=1.5 is more than the 1.00 GiB"):
        HookSettings.from_env().budget_for(host_slabs=True, room=GIB)
    monkeypatch.setenv("RANKFS_HOOK_INFLIGHT_GB", "lots")
    with pytest.raises(SettingError, match="RANKFS_HOOK_INFLIGHT_GB"):
        HookSettings.from_env()


def test_dead_slabs_are_released_reused_and_unmapped_beyond_the_budget():
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
    assert any(again.buffer is buffer for buffer in buffers) and len(pool.idle) == 2  # reused, not mapped anew
    larger = allocate(2 * MIB, "t4", "b.safetensors")  # none fits: a new one, the idle ones kept
    assert len(pool.idle) == 2 and larger.buffer not in buffers
    larger_buffer = larger.buffer
    del larger  # its buffer beside the idle ones and the one in use would exceed the budget: unmapped
    assert larger_buffer.map.closed and len(pool.idle) == 2 and budget.used == MIB
    del again  # this one fits: kept for the next slab
    assert len(pool.idle) == 3 and budget.used == 0

    gc.collect()
    pool.drop_idle()
    assert pool.idle == () and budget.used == 0 and pool.pinned_bytes() == 0


def test_a_window_views_the_page_cache_in_place_until_its_last_tensor_dies(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 3 * PAGE + 100, dtype=np.uint8).tobytes()
    path = tmp_path / "source.bin"
    path.write_bytes(data)
    source = OpenFile(str(path))
    try:
        assert source.resident(PAGE, 3 * PAGE + 100)  # just written: cached
        budget = Budget(MIB)
        pool = SlabPool(MIB, budget, pin=False)
        budget.reserve(3 * PAGE)
        window = pool.window(source, PAGE, 4 * PAGE, ["t"], "a.safetensors")
        buffer = window.buffer
        view = window.tensor[50:50 + 2 * PAGE]
        assert bytes(view.numpy()) == data[PAGE + 50:3 * PAGE + 50]
        del window
        assert pool.alive() == [("a.safetensors", ["t"])] and budget.used == 3 * PAGE
        del view
        assert pool.alive() == [] and budget.used == 0 and buffer.address is None  # unmapped, never kept
        assert pool.idle == () and (pool.stats.windows, pool.stats.window_bytes) == (1, 3 * PAGE)

        uncache([path])
        assert not source.resident(PAGE, 2 * PAGE)
    finally:
        source.close()


def test_a_gpu_slab_is_filled_through_bounce_buffers_and_frees_its_buffer_with_its_last_view(monkeypatch):
    """The GPU slabs' bookkeeping, run on host memory (the CUDA copy itself is checked on the GPU host
    by `python3 -m dev gpu-load`): pieces land in a thread's two bounce buffers in turn, those next
    to each other in the slab uploaded together while they fit; torch's DLPack deleter is what
    tells the pool a slab is dead; a dead slab's buffer is written again only after a device
    synchronization."""
    monkeypatch.setattr(bounce_module, "PIECE_BYTES", 256 << 10)  # two pieces of 100 KiB to a bounce buffer
    budget = Budget(3 * MIB)
    device = DeviceSlabs(host_staging(), MIB, budget, wanted=lambda: True, retire=lambda b: b.close())
    device.prepare_bounces(1)  # as a load's first staged file does
    deaths = []
    data = np.random.default_rng(5).integers(0, 256, MIB - 100, dtype=np.uint8)

    def fill(slab, nbytes, piece=100 << 10):
        landing = DeviceLanding(slab, device)
        for begin in range(0, nbytes, piece):  # pieces, as a read thread uploads them
            spot = landing.place(begin, min(piece, nbytes - begin))
            spot.buffer[spot.at:spot.at + spot.nbytes] = data[begin:begin + spot.nbytes].tobytes()
        landing.flush()  # a job's end
        landing.filled()  # the group's

    budget.reserve(MIB)
    slab = device.allocate(MIB - 100, ["t"], "a.safetensors", on_death=lambda: deaths.append("t"))
    fill(slab, MIB - 100)
    assert np.array_equal(slab.tensor.numpy(), data) and budget.used == MIB
    bounce = device.bounce()
    assert all(b is not None and len(b) < MIB for b in bounce.buffers)  # ten pieces: uploads from both in turn
    view = slab.tensor[10:20].view(torch.int16)
    buffer = slab.buffer
    del slab
    assert device.pool.alive() == [("a.safetensors", ["t"])] and budget.used == MIB
    del view
    assert device.pool.alive() == [] and budget.used == 0 and deaths == ["t"] and device.pool.idle == (buffer,)

    budget.reserve(MIB)
    synced = device.fence.count
    again = device.allocate(200, ["u"], "b.safetensors", on_death=None)
    assert again.buffer is buffer and device.fence.count == synced + 1  # written again only after a sync
    fill(again, 200)
    assert np.array_equal(again.tensor.numpy(), data[:200])
    del again
    device.pool.drop_idle()
    device.close_bounces()
    assert budget.used == 0 and device.pool.idle == () and buffer.memory is None
    assert bounce.buffers == [None, None] and device.bounce_bytes >= 512 << 10


def test_a_gpu_slab_whose_last_views_go_as_an_error_unwinds_is_freed_and_the_error_stays_the_loaders():
    """A loader that fails while it holds views of a slab only on its stack (a list being built)
    drops them as the error unwinds: the pool hears of the slab's death all the same, and the error
    that reaches the caller is the loader's own (a ctypes DLPack deleter could not run then: the
    slab stayed alive and a SystemError took the error's place)."""
    budget = Budget(MIB)
    device = DeviceSlabs(host_staging(), MIB, budget, wanted=lambda: True, retire=lambda b: b.close())
    deaths = []

    def slab():
        budget.reserve(MIB)
        return device.allocate(MIB, ["t"], "a.safetensors", on_death=lambda: deaths.append("t")).tensor

    def fails():
        raise ValueError("the loader's own error")
    with pytest.raises(ValueError, match="the loader's own error"):
        [slab()[:4], fails()]
    assert deaths == ["t"] and budget.used == 0 and device.pool.alive() == []


def test_bounce_buffers_are_made_ahead_and_those_never_taken_are_unmapped(monkeypatch):
    monkeypatch.setattr(bounce_module, "PIECE_BYTES", 256 << 10)
    supply = bounce_module.BounceBuffers(2, pin=False)
    made = [supply.take(100 << 10), supply.take(256 << 10)]  # the two made ahead
    row = supply.take(MIB)  # a row larger than a piece: a buffer of its own
    assert [len(b) for b in made] == [(256 << 10) + 2 * PAGE] * 2 and len(row) == MIB
    assert len(supply.take(PAGE)) == (256 << 10) + 2 * PAGE and supply.idle_bytes == 0  # made now: none left
    ahead = bounce_module.BounceBuffers(3, pin=False)
    ahead.take(PAGE)
    ahead.close()
    assert ahead.idle_bytes == 0


def test_a_bounce_buffer_that_cannot_be_page_locked_fails_its_taker_instead_of_hanging(monkeypatch):
    """The makers run on threads of their own: a page-lock the driver refuses reaches the read
    thread that waits for that buffer (and the load's error), and the buffer is unmapped."""
    monkeypatch.setattr(bounce_module, "PIECE_BYTES", 256 << 10)
    made = []

    def refuse(buffer):
        made.append(buffer)
        raise OSError("cudaHostRegister refused")
    monkeypatch.setattr(HostBuffer, "pin", refuse)
    supply = bounce_module.BounceBuffers(6, pin=True)
    for _ in range(6):
        with pytest.raises(RuntimeError, match="no page-locked bounce buffer.*cudaHostRegister refused"):
            supply.take(PAGE)
    supply.close()
    assert made and all(buffer.map.closed for buffer in made) and supply.idle_bytes == 0


def test_buffers_the_driver_will_not_page_lock_stay_pageable_and_the_load_goes_on(monkeypatch, caplog):
    """A page-lock refused (a container's RLIMIT_MEMLOCK, the driver's own limit): bounce buffers
    and host slabs stay pageable from then on, said once; every taker gets a buffer."""
    monkeypatch.setattr(bounce_module, "PIECE_BYTES", 256 << 10)
    refused = []

    def refuse(buffer, *flags):
        refused.append(buffer)
        raise RuntimeError("cudaHostRegister of 262144 bytes failed: 2")
    monkeypatch.setattr(HostBuffer, "pin", refuse)
    supply = bounce_module.BounceBuffers(6, pin=True)
    taken = [supply.take(PAGE) for _ in range(6)]
    assert all(not b.map.closed and b.pinned_at is None for b in taken) and not supply.pin
    supply.close()
    budget = Budget(2 * MIB)
    pool = SlabPool(MIB, budget, pin=True)
    budget.reserve(MIB)
    slab = pool.allocate(MIB, ["t"], "a.safetensors")
    pool.filled(slab)
    assert not pool.pin and pool.pinned_bytes() == 0
    assert sum("cannot be page-locked" in r.message for r in caplog.records) == 2
    for buffer in taken:
        buffer.close()
