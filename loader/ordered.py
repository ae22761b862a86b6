"""The hook's read threads: a pool that runs the job the loader will need first, not the one
submitted first. Loaders open several files at once (SGLang's iterator eight) but consume them
one after another in sorted order; a first-in-first-out pool would spread the disk over all of them
while the loader waits on the first."""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future


class OrderedExecutor:
    def __init__(self, threads: int, name: str):
        self._queue: list = []  # (key, sequence, future, fn, args), lowest key first
        self._sequence = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, key, fn, *args) -> Future:
        """Run fn(*args) before every queued job with a larger key (ties: in submission order)."""
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the hook's read threads were shut down")
            heapq.heappush(self._queue, (key, next(self._sequence), future, fn, args))
            self._ready.notify()
        return future

    def run_all(self, key: tuple, jobs: list):
        """Run every job (a callable) on this thread and on whichever others are free for them
        (queued under key + (i,), before any later key); return when all are done, raising the
        first error. The calling thread never waits on queued work, only on jobs running."""
        claimed = [False] * len(jobs)
        results = [Future() for _ in jobs]
        lock = threading.Lock()

        def claim_and_run(i: int):
            with lock:
                if claimed[i]:
                    return
                claimed[i] = True
            try:
                results[i].set_result(jobs[i]())
            except BaseException as exc:  # raised below, in the caller
                results[i].set_exception(exc)
        for i in range(1, len(jobs)):
            self.submit((*key, i), claim_and_run, i)
        for i in range(len(jobs)):
            claim_and_run(i)
        for result in results:
            result.result()

    def shutdown(self):
        """Cancel what has not started, wait for what has."""
        with self._ready:
            self._closed = True
            for _, _, future, _, _ in self._queue:
                future.cancel()
            self._queue.clear()
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()

    def _work(self):
        while True:
            with self._ready:
                while not self._queue and not self._closed:
                    self._ready.wait()
                if not self._queue:
                    return
                _, _, future, fn, args = heapq.heappop(self._queue)
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)
