"""The hook's read threads run the read the loader needs first, not the one submitted first."""

from __future__ import annotations

import threading

from loader.ordered import OrderedExecutor


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
    gate = threading.Event()
    running = pool.submit(0, gate.wait)
    queued = pool.submit(1, lambda: None)
    threading.Timer(0.1, gate.set).start()
    pool.shutdown()
    assert running.done() and not running.cancelled() and queued.cancelled()
