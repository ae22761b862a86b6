"""The mount's lifecycle: plan, mount, tune, serve until unmounted, and report live figures.

`serve()` runs in the daemon process. It reports readiness (or the error that stopped it) on a pipe
to the `rankfs mount` that started it, so that command exits 0 only once the views can be read.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import time

import psutil
import pyfuse3
import trio

from mount import control, kernel
from mount.config import MountConfig
from plan.checkpoint import Checkpoint
from plan.layout import RankLayout, plan_ranks
from reader.engine import ReadEngine
from vfs.fs import RankFS
from vfs.push import push_prefetched
from vfs.tree import Tree

log = logging.getLogger("rankfs.daemon")

def plan(config: MountConfig) -> list[RankLayout]:
    checkpoint = Checkpoint.open(config.checkpoint, config.allow_outside_symlinks)
    return plan_ranks(checkpoint, config.specs, config.profile)


class Daemon:
    def __init__(self, config: MountConfig, layouts: list[RankLayout]):
        self.config = config
        self.layouts = layouts
        self.engine = ReadEngine(layouts[0].sources, config.budget_bytes, config.workers, config.direct_io)
        self.tree = Tree(layouts, self.engine, self.status_json)
        self.ops = RankFS(self.tree, self.engine)
        self._rate = (time.monotonic(), 0, 0.0)  # (when, bytes read then, bytes/s)
        self.tuning: dict = {}
        self.drops = 0  # completed `rankfs drop`s: the command waits for this to move
        # Where engine hooks, reading the sources directly, report what they have loaded. They may
        # run as any user: world-writable, sticky, like /tmp.
        self.hook_reports = tempfile.mkdtemp(prefix="rankfs-hooks-")
        os.chmod(self.hook_reports, 0o1777)

    def status(self) -> dict:
        stats = self.engine.stats
        read_total = sum(stats.read_bytes.values())
        hooks = control.loaded_by_hooks(self.hook_reports)
        when, before, rate = self._rate
        now = time.monotonic()
        if now - when >= 1.0:
            rate = (read_total - before) / (now - when)
            self._rate = (now, read_total, rate)
        return {
            "pid": os.getpid(),
            "mountpoint": self.config.mountpoint,
            "checkpoint": self.config.checkpoint,
            "started": self.config.started,
            "profile": self.layouts[0].profile,
            "ranks": [layout.spec.describe() for layout in self.layouts],
            "views": [{"view": s.name, "planned_bytes": s.planned_bytes, "served_bytes": s.served_bytes,
                       "hook_loaded_bytes": hooks.get(s.name, 0), "active": s.active}
                      for s in self.engine.streams.values()],
            "hook_reports": self.hook_reports,
            "read_bytes": read_total,
            "on_demand_read_bytes": stats.on_demand_read_bytes,
            "read_rate_bytes_per_s": rate,
            "held_bytes": stats.held_bytes,
            "peak_held_bytes": stats.peak_held_bytes,
            "budget_bytes": self.config.budget_bytes,
            "rss_bytes": psutil.Process().memory_info().rss,
            "requests": self.ops.requests,
            "request_bytes": self.ops.request_bytes,
            "fill_bytes": self.ops.fill_bytes,
            "demand_loads": stats.demand_loads,
            "buffers": self.engine.buffer_stats(),
            "prefetch_loads": stats.prefetch_loads,
            "pushed_bytes": stats.pushed_bytes,
            "remnant_bytes": stats.remnant_bytes,
            "errors": stats.errors,
            "drops": self.drops,
            "tuning": self.tuning,
            "log_file": self.config.log_file,
        }

    def status_json(self) -> bytes:
        return json.dumps(self.status(), indent=2).encode() + b"\n"

    def invalidate_page_cache(self):
        """Drop the kernel's page cache of every virtual file (blocking: run it in a thread)."""
        for node in self.tree.files():
            try:
                pyfuse3.invalidate_inode(node.inode, attr_only=False)
            except OSError:
                pass  # never looked up by the kernel: nothing cached

    async def run(self, on_ready):
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run)
            if self.config.push:
                nursery.start_soon(push_prefetched, self.engine)
            nursery.start_soon(self._signals, nursery.cancel_scope)
            nursery.start_soon(self._after_start, on_ready)
            await pyfuse3.main(min_tasks=4, max_tasks=64)
            nursery.cancel_scope.cancel()  # unmounted from outside: fusermount -u

    async def _after_start(self, on_ready):
        entry = kernel.find_mount(self.config.mountpoint)
        if entry is not None:
            self.tuning = await trio.to_thread.run_sync(
                kernel.tune, entry, self.config.readahead_kb, self.config.max_background,
                self.config.congestion_threshold)
        on_ready()

    async def _signals(self, cancel_scope):
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGUSR1) as signals:
            async for signum in signals:
                if signum == signal.SIGUSR1:
                    self.engine.drop()
                    await trio.to_thread.run_sync(self.invalidate_page_cache)
                    self.drops += 1
                    log.info("dropped the read engine's buffers and the views' page cache")
                else:
                    log.info("signal %s: unmounting", signal.Signals(signum).name)
                    cancel_scope.cancel()
                    return


def serve(config: MountConfig, ready_fd: int | None):
    """Plan, mount and serve until unmounted. Reports 'ready' or 'error: ...' on ready_fd."""

    def report(message: str):
        if ready_fd is not None:
            os.write(ready_fd, message.encode() + b"\n")
            os.close(ready_fd)
        log.info("%s", message)

    try:
        layouts = plan(config)
        for warning in layouts[0].warnings:
            log.warning("%s", warning)
        daemon = Daemon(config, layouts)
        options = {"fsname=rankfs", "subtype=rankfs", "ro", "default_permissions", "noatime"}
        if config.allow_other:
            options.add("allow_other")
        pyfuse3.init(daemon.ops, config.mountpoint, options)
    except Exception as exc:  # every failure before the mount is the user's answer
        report(f"error: {exc}")
        return 32
    unmounted = False
    try:
        trio.run(daemon.run, lambda: report(
            f"ready: {config.mountpoint} serves {', '.join(s.describe() for s in config.specs)}"))
        unmounted = kernel.find_mount(config.mountpoint) is None
    finally:
        pyfuse3.close(unmount=not unmounted)
        shutil.rmtree(daemon.hook_reports, ignore_errors=True)
        log.info("unmounted %s", config.mountpoint)
    return 0
