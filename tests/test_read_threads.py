"""The hook's read threads run the read the loader needs first, not the one submitted first, and
admit reads ahead in that order only as the budget has room, unless the loader waits for them."""

from __future__ import annotations

import os
import threading

import pytest

from rankfs.loader.budget import Budget
from rankfs.loader.ordered import OrderedExecutor
from rankfs.loader.settings import HookSettings, SettingError


def test_the_read_threads_carry_their_names_in_the_kernel():
    """What `top -H`, perf and the benchmark's thread sampler see of the engine's process: the
    hook's threads by name (cut to the kernel's 15 bytes), not one more `python3`."""
    def own_name():
        with open("/proc/thread-self/comm") as comm:
            return comm.read().strip()
    pool = OrderedExecutor(1, "rankfs-read")
    long_named = OrderedExecutor(1, "rankfs-a-name-longer-than")
    try:
        assert pool.submit(("", 0), own_name).result() == "rankfs-read-0"
        assert long_named.submit(("", 0), own_name).result() == "rankfs-a-name-l"
    finally:
        pool.shutdown()
        long_named.shutdown()


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


def test_the_pool_says_whether_a_job_is_running():
    """What the hook's stall rule asks before it reads past the budget: a read in flight, however
    slow its disk, is progress to come."""
    pool = OrderedExecutor(1, "test")
    gate, started = threading.Event(), threading.Event()
    assert not pool.busy()
    running = pool.submit(0, lambda: (started.set(), gate.wait()))
    started.wait(10)
    assert pool.busy()
    gate.set()
    running.result(timeout=10)
    pool.shutdown()
    assert not pool.busy()


def test_reads_from_the_disk_have_threads_of_their_own_and_nothing_else_does():
    """A group the page cache does not hold is read with the disk threads' reads in flight beside
    the read threads' (a sliced rank's reads are a few MB each: eight in flight leave a fast disk
    idle), and those threads run nothing else: the groups, and copies out of the page cache, keep
    to the read threads. Three reads that each wait for the other two complete only if all three
    run at once; the one read thread alone runs the rest."""
    pool = OrderedExecutor(1, "test", disk_threads=2)
    meet = threading.Barrier(3, timeout=30)
    names = []

    def group(disk: bool):
        def part():
            names.append(threading.current_thread().name)
            if disk:
                meet.wait()
        pool.run_all(("f", disk), [part] * 3, disk=disk)
        return threading.current_thread().name
    try:
        assert pool.submit(("f", 0), group, True).result(timeout=60) == "test-0"
        assert sorted(names) == ["test-0", "test-d0", "test-d1"]
        names.clear()
        assert pool.submit(("f", 1), group, False).result(timeout=60) == "test-0"
        assert names == ["test-0"] * 3
        # Copies out of the page cache queued ahead of reads from the disk stay queued for the read
        # thread (busy with the first of them): a disk thread that read one part of the reads looks
        # at the queue again at once, and leaves them.
        names.clear()
        gate, first, pair = threading.Event(), threading.Event(), threading.Barrier(2, timeout=30)

        def copy(i):
            names.append((i, threading.current_thread().name))
            if i == 0:
                first.set()
                gate.wait(30)
        copies = pool.submit(("a", 0), pool.run_all, ("a", 0), [lambda i=i: copy(i) for i in range(3)])
        first.wait(30)
        pool.run_all(("0", 0), [pair.wait] * 2, disk=True)
        gate.set()
        copies.result(timeout=60)
        assert sorted(n for i, n in names if i != "disk") == ["test-0"] * 3
    finally:
        pool.shutdown()


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


def test_parts_that_are_cpu_work_run_on_half_the_threads_at_most():
    """Copies out of the page cache take the GIL the loader's loop needs: a group of them runs on
    half the threads at most (the caller of run_all counts), reads on every free thread."""
    pool = OrderedExecutor(4, "test")
    state = threading.Condition()
    running, peak, started = 0, 0, 0

    def part(together: int):
        """Wait for the others of its batch of `together` (or for one too many)."""
        nonlocal running, peak, started
        with state:
            running += 1
            started += 1
            peak = max(peak, running)
            batch_end = -(-started // together) * together
            state.notify_all()
            state.wait_for(lambda: started >= batch_end or peak > together, timeout=10)
            running -= 1

    pool.run_all(("f", 0), [lambda: part(5)] * 10)  # four threads and this one, all at once
    assert peak == 5
    peak = started = 0
    pool.run_all(("f", 1), [lambda: part(2)] * 10, cpu=True)
    assert peak == pool.cpu_threads == 2
    pool.shutdown()


def _niceness() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _may_renice(steps: int) -> bool:
    """Whether this process may set a thread's niceness `steps` from its own (CAP_SYS_NICE, or
    RLIMIT_NICE room), tried on a thread of its own."""
    could = []

    def probe():
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _niceness() + steps)
            could.append(True)
        except PermissionError:
            could.append(False)
    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return could[0]


def test_parts_that_read_from_the_disk_run_at_the_read_niceness_where_the_process_may():
    """A read that completes needs the CPU only to start the next: parts reading from the disk run
    `disk_nice` from the thread's own niceness (ahead of the loader's threads), where the process
    may; every other part at its own."""
    pool = OrderedExecutor(2, "test", disk_nice=-3)
    own = _niceness()  # threads start at their creator's
    seen = {"disk": set(), "other": set()}

    def part(kind: str):
        seen[kind].add(_niceness())
    try:
        for turn in range(2):
            pool.run_all(("f", 2 * turn), [lambda: part("disk")] * 6, disk=True)
            pool.run_all(("f", 2 * turn + 1), [lambda: part("other")] * 6)
        assert seen["disk"] == {own - 3 if _may_renice(-3) else own}
        assert seen["other"] == {own}
    finally:
        pool.shutdown()
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), own)  # this thread ran parts too


def test_the_read_niceness_defaults_to_ten_below_and_follows_its_setting(monkeypatch):
    monkeypatch.delenv("RANKFS_HOOK_READ_NICE", raising=False)
    assert HookSettings.from_env().read_nice == -10
    monkeypatch.setenv("RANKFS_HOOK_READ_NICE", "0")
    assert HookSettings.from_env().read_nice == 0
    monkeypatch.setenv("RANKFS_HOOK_READ_NICE", "high")
    with pytest.raises(SettingError, match="RANKFS_HOOK_READ_NICE"):
        HookSettings.from_env()


def test_the_disk_threads_follow_their_setting_and_their_buffers_an_eighth_of_the_room(monkeypatch):
    """Sixteen by default; where groups are staged on a GPU each holds two page-locked bounce
    buffers, and together they take an eighth of the memory the process may still use at most."""
    monkeypatch.delenv("RANKFS_HOOK_DISK_THREADS", raising=False)
    settings = HookSettings.from_env()
    assert settings.disk_threads == 16
    assert settings.disk_threads_for(0, 0) == 16  # host slabs: the reads fill them, nothing more held
    assert settings.disk_threads_for(32 << 20, 64 << 30) == 16
    assert settings.disk_threads_for(32 << 20, 1 << 30) == 4
    monkeypatch.setenv("RANKFS_HOOK_DISK_THREADS", "0")
    assert HookSettings.from_env().disk_threads == 0
    monkeypatch.setenv("RANKFS_HOOK_DISK_THREADS", "-1")
    with pytest.raises(SettingError, match="RANKFS_HOOK_DISK_THREADS"):
        HookSettings.from_env()


def test_a_group_the_loader_needs_sooner_starts_on_a_thread_inside_a_group():
    """Every thread is inside a group (one thread here): a group with a lower key, submitted
    meanwhile (the loader opened the file it consumes first last), starts on that thread before
    the rest of its group's reads, not once that group is done; a group with a higher key waits
    (it would hold back the end of the group the loader needs first)."""
    pool = OrderedExecutor(1, "test", Budget(10))
    ran, opened = [], []

    def group(name, parts):
        pool.run_all((name, 0), parts)
        ran.append(f"{name} done")

    def open_files():
        opened.extend(pool.submit((name, 0), group, name, [lambda name=name: ran.append(f"{name} read")], cost=1)
                      for name in ("c", "a"))
    pool.submit(("b", 0), group, "b", [open_files, lambda: ran.append("b read")], cost=1).result(timeout=10)
    for future in opened:
        future.result(timeout=10)
    assert ran == ["a read", "a done", "b read", "b done", "c read", "c done"]
    pool.shutdown()


def test_reads_ahead_are_admitted_in_order_as_the_budget_has_room_or_when_urgent():
    budget = Budget(2)
    pool = OrderedExecutor(4, "test", budget)
    ran = []
    first = [pool.submit(("a", g), ran.append, ("a", g), cost=1) for g in range(2)]  # fills the budget
    for future in first:
        future.result(timeout=10)
    urgent = threading.Event()
    later = [pool.submit(("b", g), ran.append, ("b", g), cost=1, urgent=urgent.is_set) for g in range(2)]
    free = pool.submit(("c", 0), ran.append, ("c", 0))  # costless: never held back
    free.result(timeout=10)
    assert ran == [("a", 0), ("a", 1), ("c", 0)] and not any(f.done() for f in later) and budget.used == 2
    urgent.set()  # the loader waits for them: they go ahead over the budget
    pool.wake()
    for future in later:
        future.result(timeout=10)
    assert budget.used == 4 and budget.peak == 4
    budget.release(4)
    held = pool.submit(("d", 0), ran.append, ("d", 0), cost=3)  # larger than the budget: alone, at once
    held.result(timeout=10)
    assert budget.used == 3
    pool.shutdown()


def test_a_read_the_loader_waits_for_goes_ahead_of_reads_ahead_held_back_before_it():
    """A loader that takes files out of order waits for a group queued behind reads ahead that the
    budget holds back: urgent, it is admitted past them, and they still wait for room."""
    budget = Budget(1)
    pool = OrderedExecutor(2, "test", budget)
    ran, waited = [], threading.Event()
    pool.submit(("a", 0), ran.append, ("a", 0), cost=1).result(timeout=10)  # fills the budget
    ahead = pool.submit(("b", 0), ran.append, ("b", 0), cost=1)
    wanted = pool.submit(("c", 0), ran.append, ("c", 0), cost=1, urgent=waited.is_set)
    pool.submit(("d", 0), ran.append, ("d", 0)).result(timeout=10)  # costless: run once both were looked at
    assert ran == [("a", 0), ("d", 0)] and not ahead.done() and not wanted.done()
    waited.set()
    pool.wake()
    wanted.result(timeout=10)
    assert not ahead.done() and budget.used == 2
    budget.release(2)
    ahead.result(timeout=10)
    assert ran == [("a", 0), ("d", 0), ("c", 0), ("b", 0)]
    pool.shutdown()


def test_reads_ahead_wait_while_they_are_held_urgent_or_not():
    """The hook holds reads of a file while a file before it is being opened (the loader will wait
    for that one first, even where it asks for this one now): held, a costly job waits with every
    costly one after it, costless ones run; woken once the hold is gone."""
    opening = {"a"}
    pool = OrderedExecutor(2, "test", Budget(8), hold=lambda key: any(path < key[0] for path in opening))
    ran, urgent = [], threading.Event()
    later = [pool.submit(("b", g), ran.append, ("b", g), cost=1, urgent=urgent.is_set) for g in range(2)]
    pool.submit(("c", 0), ran.append, ("c", 0)).result(timeout=10)
    assert ran == [("c", 0)] and not any(f.done() for f in later)
    urgent.set()  # the loader waits for the second: held still
    pool.wake()
    pool.submit(("c", 1), ran.append, ("c", 1)).result(timeout=10)
    assert not any(f.done() for f in later)
    opening.clear()
    pool.wake()
    for future in later:
        future.result(timeout=10)
    assert ran[2:] == [("b", 0), ("b", 1)]
    pool.shutdown()


def test_chores_run_when_a_thread_has_nothing_else_and_by_shutdown():
    pool = OrderedExecutor(1, "test")
    gate, ran, chore_ran = threading.Event(), [], threading.Event()
    pool.submit(("a", 0), gate.wait)
    pool.chore(lambda: (ran.append("chore"), chore_ran.set()))
    job = pool.submit(("a", 1), ran.append, "job")
    gate.set()
    job.result(timeout=10)
    assert chore_ran.wait(10) and ran == ["job", "chore"]  # queued work first
    pool.submit(("a", 2), gate.wait)
    pool.chore(lambda: ran.append("last"))
    pool.shutdown()
    assert ran[-1] == "last"
