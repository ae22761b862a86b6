"""The hook's read threads run the read the loader needs first, not the one submitted first."""

from __future__ import annotations

import threading

import pytest

from rankfs.loader.ordered import OrderedExecutor


def test_queued_reads_run_in_the_loaders_order():
    pool = OrderedExecutor(1, "test")
    gate, ran = threading.Event(), []
    pool.submit(("", -1), gate.wait)  # the one thread is busy while the rest queue up
    keys = [("b.safetensors", 1), ("a.safetensors", 2), ("b.safetensors", 0), ("a.safetensors", 1)]
    futures = [pool.submit(key, ran.append, key) for key in keys]
    gate.set()
    for future in futures:
        future.result()
    assert ran == sorted(keys)
    pool.shutdown()


def test_shutdown_cancels_what_has_not_started():
    pool = OrderedExecutor(1, "test")
    gate, started = threading.Event(), threading.Event()
    running = pool.submit(0, lambda: (started.set(), gate.wait()))
    queued = pool.submit(1, lambda: None)
    started.wait(10)  # shut down once the first has started (else both are cancelled)
    threading.Timer(0.1, gate.set).start()
    pool.shutdown()
    assert running.done() and not running.cancelled() and queued.cancelled()


def test_a_group_read_by_every_free_thread_completes_even_when_all_are_busy_with_groups():
    """Each thread filling a group runs its group's reads itself while free threads help: with
    every thread inside a group no read is left waiting in the queue. Errors reach the caller."""
    pool = OrderedExecutor(2, "test")
    done = []

    def fill(group):
        pool.run_all(("f", group), [lambda i=i: done.append((group, i)) for i in range(50)])
        return group
    assert [f.result(timeout=10) for f in [pool.submit(("f", g), fill, g) for g in range(4)]] == [0, 1, 2, 3]
    assert sorted(done) == [(g, i) for g in range(4) for i in range(50)]

    def fail():
        raise OSError("model-00001.safetensors: tensor 'x': read failed")
    with pytest.raises(OSError, match="tensor 'x'"):
        pool.run_all(("f", 9), [lambda: None, fail, lambda: None])
    pool.shutdown()
