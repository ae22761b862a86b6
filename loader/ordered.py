"""The hook's read threads: a pool that runs the job the loader will need first, not the one
submitted first, and admits reads ahead only as the budget has room.

Loaders open several files at once (SGLang's iterator nine) but consume them one after another in
sorted order; jobs are keyed (file, group, ...) and run lowest key first. A job with a cost (a
group read ahead) is admitted, its cost reserved, only in key order and only when the budget has
room, unless it is urgent (the loader waits for it, in the file it consumes now). So a thread never
waits for the budget, and what waits for it is what the loader needs last.

Parts that are CPU work (copies out of the page cache in pieces of a few MB) run on `cpu_threads`
at most (the hook's: HookSettings.cpu_work_threads): each takes the GIL between its calls, and
where cores are few the loader's loop, which hands out and narrows every tensor, waits behind each
thread that wants it. Reads from the disk keep every thread (a read in flight each), and the
`disk_threads` more that run nothing else, and run at `disk_nice` from the thread's own niceness
(negative: ahead of the loader's threads), which the thread keeps until it runs a part of another
kind: a read that completes needs the CPU only to start the next, and where cores are few the
loader's copy threads would hold the disk idle.
"""

from __future__ import annotations

import bisect
import itertools
import os
import threading
from concurrent.futures import Future
from typing import Callable

from rankfs.loader.budget import Budget
from rankfs.common.threads import start_thread


_thread = threading.local()


class _Job:
    __slots__ = ("key", "sequence", "future", "fn", "args", "cost", "urgent", "part", "cpu", "disk")

    def __init__(self, key, sequence, future, fn, args, cost, urgent, part=False, cpu=False, disk=False):
        self.key, self.sequence, self.future, self.fn, self.args = key, sequence, future, fn, args
        self.cost, self.urgent = cost, urgent
        self.part = part  # a part of a group's reads (run_all), which any thread may run
        self.cpu = cpu  # a part that is CPU work: on `cpu_threads` at most
        self.disk = disk  # a part that reads from the disk: at `disk_nice`

    def __lt__(self, other):
        return (self.key, self.sequence) < (other.key, other.sequence)

    def run(self) -> bool:
        """Run it here unless it was cancelled: whether it ran."""
        if not self.future.set_running_or_notify_cancel():
            return False
        try:
            self.future.set_result(self.fn(*self.args))
        except BaseException as exc:  # handed to whoever waits on the future
            self.future.set_exception(exc)
        return True


class OrderedExecutor:
    def __init__(self, threads: int, name: str, budget: Budget | None = None,
                 hold: Callable[[tuple], bool] | None = None, cpu_threads: int | None = None, disk_nice: int = 0,
                 disk_threads: int = 0):
        """`hold(key)`: whether a job with a cost and that key waits for now, however much room the
        budget has and urgent or not (`wake` once that may have changed); `cpu_threads`: how many
        may run CPU-work parts at once (half of them by default); `disk_nice`: the niceness, relative
        to the thread's own, that parts reading from the disk run at, where the process may;
        `disk_threads`: threads more that run only parts reading from the disk."""
        self._disk_nice = disk_nice
        self._queue: list[_Job] = []  # sorted, lowest key first
        self._hold = hold
        self._chores: list[Callable[[], None]] = []  # run when no job can
        self._sequence = itertools.count()
        lock = threading.Lock()
        self._ready = threading.Condition(lock)  # the threads that run any job
        self._disk_ready = threading.Condition(lock)  # those that run parts reading from the disk only
        self._closed = False
        self._held_back = False  # the last look at the queue left a costly job waiting for room
        self._budget = budget
        self.cpu_threads = cpu_threads or max(1, threads // 2)
        self._cpu_running = 0
        self._running = 0
        if budget is not None:
            budget.on_release(self.wake)
        self._threads = [start_thread(self._work, f"{name}-{i}") for i in range(threads)]
        self._threads += [start_thread(self._work, f"{name}-d{i}", True) for i in range(disk_threads)]

    def submit(self, key, fn, *args, cost: int = 0, urgent: Callable[[], bool] | None = None) -> Future:
        """Run fn(*args) before every queued job with a larger key (ties: in submission order). A
        job with a cost runs once the budget has room for it and every costly job before it has
        run, or once urgent() holds."""
        return self._enqueue(key, fn, args, cost, urgent)

    def _enqueue(self, key, fn, args, cost=0, urgent=None, part=False, cpu=False, disk=False) -> Future:
        future: Future = Future()
        with self._ready:
            if self._closed:
                raise RuntimeError("the hook's read threads were shut down")
            bisect.insort(self._queue, _Job(key, next(self._sequence), future, fn, args, cost, urgent, part, cpu, disk))
            self._ready.notify()
            if part and disk:
                self._disk_ready.notify()
        return future

    def chore(self, fn: Callable[[], None]):
        """Run fn() on a thread that has nothing else it may run (work off the loader's path)."""
        with self._ready:
            if self._closed:
                raise RuntimeError("the hook's read threads were shut down")
            self._chores.append(fn)
            self._ready.notify()

    def costly_queued(self) -> bool:
        """Whether reads ahead wait in the queue (more slabs will be wanted)."""
        with self._ready:
            return any(job.cost and not job.future.cancelled() for job in self._queue)

    def busy(self) -> bool:
        """Whether some job is running: a read in flight, however slow the disk."""
        with self._ready:
            return self._running > 0

    def wake(self):
        """The budget or a job's urgency has changed: if a job was held back, one thread looks at
        the queue again (each thread that takes a job wakes the next, while there are any)."""
        with self._ready:
            if self._held_back:
                self._ready.notify()

    def run_all(self, key: tuple, jobs: list, cpu: bool = False, disk: bool = False):
        """Run every job (a callable) on this thread and on whichever others are free for them
        (queued under key + (i,), before any later key), on `cpu_threads` at most where they
        are CPU work (`cpu`), at `disk_nice` where they read from the disk (`disk`); return when
        all are done, raising the first error. Until they are,
        this thread runs the first part of any group queued, its own or one the loader needs
        sooner, and starts a group the loader needs sooner: threads that took groups read ahead
        (eight at the start of a load) would otherwise each read their own, and the file the loader
        waits for would get one thread of eight, or none. It never waits on queued work, only on
        jobs running."""
        parts = [self._enqueue((*key, i), job, (), part=True, cpu=cpu, disk=disk) for i, job in enumerate(jobs)]
        while not all(part.done() for part in parts):
            with self._ready:
                # Once per thread, no deeper: when every thread holds a group, the file the loader
                # waits for could not start before one of them is done.
                job = self._admissible(sooner_than=() if getattr(_thread, "nested", False) else key)
            if job is None:
                break
            if job.part:
                self._run(job)
                continue
            _thread.nested = True
            try:
                self._run(job)
            finally:
                _thread.nested = False
        for part in parts:
            part.result()

    def shutdown(self):
        """Cancel what has not started, wait for what has; chores left are run here."""
        with self._ready:
            self._closed = True
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._ready.notify_all()
            self._disk_ready.notify_all()
        for thread in self._threads:
            thread.join()
        chores, self._chores = self._chores, []
        for fn in chores:
            fn()

    def _admissible(self, sooner_than: tuple | None = None, disk_only: bool = False) -> _Job | None:
        """The next job to run, its cost reserved: the first costless one, or the first costly one
        if it is not held and the budget has room for it or it is urgent (called holding the
        lock). Costly jobs after the first held back wait too, unless urgent: admission follows the
        loaders' order, and a loader that takes files out of order waits for a group behind reads
        ahead it has not reached. For a thread inside run_all (`sooner_than`, its group's key; ()
        where it may start none): parts of groups' reads, and other jobs only with a key before its
        group's (a later one would hold its group's end back). `disk_only`: the first part reading
        from the disk."""
        held_back, i = None, 0
        if sooner_than is None and not disk_only:
            self._held_back = False
        while i < len(self._queue):
            job = self._queue[i]
            if job.future.cancelled():
                del self._queue[i]
                continue
            i += 1
            if disk_only and not (job.part and job.disk):
                continue
            if not job.part and sooner_than is not None and not job.key < sooner_than:
                continue
            if job.cpu and self._cpu_running >= self.cpu_threads:
                continue
            if job.cost:
                if held_back is not None and not (job.urgent is not None and job.urgent()):
                    continue
                over_budget = self._budget is not None and not self._budget.fits(job.cost)
                if (self._hold is not None and self._hold(job.key)
                        or over_budget and not (job.urgent is not None and job.urgent())):
                    held_back = job
                    self._held_back = True
                    continue
                if self._budget is not None:
                    self._budget.reserve(job.cost)
            self._cpu_running += job.cpu
            self._running += 1
            return self._queue.pop(i - 1)
        return None

    def _work(self, disk_only: bool = False):
        ready = self._disk_ready if disk_only else self._ready
        while True:
            with ready:
                job = self._admissible(disk_only=disk_only)
                while job is None and not self._closed and (disk_only or not self._chores):
                    ready.wait()
                    job = self._admissible(disk_only=disk_only)
                if job is None:
                    if self._closed:
                        return
                    chore = self._chores.pop(0)
                else:
                    chore = None
                    if self._queue:  # more may be admissible: the next thread looks
                        ready.notify()
            if chore is not None:
                chore()
                continue
            self._run(job)

    def _run(self, job: _Job):
        """Run an admitted job; a cancelled one gives its reserved cost back."""
        if job.part and self._disk_nice:  # kept until a part of the other kind: no call per part
            _renice(self._disk_nice if job.disk else 0)
        try:
            if not job.run() and job.cost and self._budget is not None:
                self._budget.release(job.cost)
        finally:
            with self._ready:
                self._running -= 1
                if job.cpu:
                    self._cpu_running -= 1
                    self._ready.notify()  # a CPU-work part may have waited for this one


_may_renice = True  # until the kernel refuses: a process without CAP_SYS_NICE or RLIMIT_NICE room


def _renice(steps: int):
    """This thread's niceness set `steps` from its own (as it was at its first call), where the
    process may and it is not already."""
    global _may_renice
    if not _may_renice or getattr(_thread, "steps", 0) == steps:
        return
    thread = threading.get_native_id()
    if not hasattr(_thread, "nice"):
        _thread.nice = os.getpriority(os.PRIO_PROCESS, thread)
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(19, max(-20, _thread.nice + steps)))
    except PermissionError:
        _may_renice = False
        return
    _thread.steps = steps
