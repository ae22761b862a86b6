"""The mount's lifecycle: plan, mount, tune, serve until unmounted, report live figures and carry
out the commands written to the control file.

`serve()` runs in the daemon process. It reports readiness (or the error that stopped it) on a pipe
to the `rankfs mount` that started it, so that command exits 0 only once the views can be read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import threading
import time

import psutil
import pyfuse3
import trio

from rankfs.common import contract
from rankfs.mount import kernel
from rankfs.mount.config import MountConfig
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.layout import RankLayout, plan_ranks
from rankfs.reader.engine import ReadEngine
from rankfs.reader.host_pages import HostPages
from rankfs.common.trace import Trace
from rankfs.vfs.fs import RankFS
from rankfs.vfs.push import drop_consumed, push_prefetched
from rankfs.vfs.tree import Tree

log = logging.getLogger("rankfs.daemon")


def plan(config: MountConfig) -> list[RankLayout]:
    checkpoint = Checkpoint.open(config.checkpoint, config.allow_outside_symlinks)
    return plan_ranks(checkpoint, config.specs, config.profile)


class Daemon:
    def __init__(self, config: MountConfig, layouts: list[RankLayout]):
        self.config = config
        self.layouts = layouts
        self.engine = ReadEngine(layouts[0].sources, config.budget_bytes, config.workers, config.direct_io,
                                 Trace(config.trace_file))
        # With several local ranks: which source pages each view reads, and which other ranks read too
        # (made after the mount is ready: at full scale it takes seconds).
        self._host_pages: HostPages | None = None
        self._host_pages_made = threading.Lock()
        self.tree = Tree(layouts, self.engine, self.status_json, allow_other=config.allow_other,
                         shared_pages=self.shared_pages if len(layouts) > 1 else None)
        self.ops = RankFS(self.tree, self.engine, self.command)
        self._rate = (time.monotonic(), 0, 0.0)  # (when, bytes read then, bytes/s)
        self.tuning: dict = {}
        self.drops = 0
        # {(pid, view): bytes} engine hooks have loaded straight from the sources
        self.hook_loaded: dict[tuple[int, str], int] = {}
        self.uncached_shared_bytes = 0  # source pages dropped once every local rank was done with them

    async def command(self, text: str, pid: int):
        """A command written to the control file (rankfs.common.contract); ValueError if unknown."""
        verb, args = contract.parse_command(text)
        if verb == contract.DROP:
            await self.drop()
        elif verb == contract.CONSUMED:
            await self.consumed(*args)
        else:
            view, loaded = args
            self.hook_loaded[(pid, view)] = int(loaded)
            self.engine.hooked(view)

    async def consumed(self, view: str, file: str):
        """A hook is done reading a view file from the sources: the source pages no local rank
        needs any more leave the page cache (the hooks of a mount of several local ranks read
        through it, so that the host reads each page once)."""
        if len(self.layouts) == 1:
            return
        host_pages = self._host_pages or await trio.to_thread.run_sync(self.host_pages)
        ranges = host_pages.consumed(view, file)
        await self.engine.uncache(ranges)
        self.uncached_shared_bytes += sum(end - begin for _, begin, end in ranges)

    def host_pages(self) -> HostPages:
        """The local ranks' source pages, made once, by a thread after start-up or whoever asks first."""
        with self._host_pages_made:
            if self._host_pages is None:
                self._host_pages = HostPages.of(self.layouts)
            return self._host_pages

    def shared_pages(self, view: str) -> dict[int, list[tuple[int, int]]]:
        """{source: pages} of a view's reads that another local rank still needs."""
        return self.host_pages().shared_pages(view)

    async def drop(self):
        """Release the read engine's memory and the views' page cache."""
        self.engine.drop()
        await trio.to_thread.run_sync(self.invalidate_page_cache)
        self.drops += 1
        log.info("dropped the read engine's buffers and the views' page cache")

    def invalidate_page_cache(self):
        """Drop the kernel's page cache of every virtual file (blocking: run it in a thread)."""
        for node in self.tree.files():
            try:
                pyfuse3.invalidate_inode(node.inode, attr_only=False)
            except OSError:
                pass  # never looked up by the kernel: nothing cached

    def _loaded_by_hooks(self) -> dict[str, int]:
        """{view: bytes}; a view loaded twice (an engine restarted) counts its larger load."""
        loaded: dict[str, int] = {}
        for (_, view), nbytes in self.hook_loaded.items():
            loaded[view] = max(loaded.get(view, 0), nbytes)
        return loaded

    def counters(self) -> dict:
        """What the read engine and the FUSE operations have done: the engine's Stats (bytes read
        from the sources as a total) and the requests answered."""
        stats = self.engine.stats
        return {**{f.name: getattr(stats, f.name) for f in dataclasses.fields(stats)},
                "read_bytes": sum(stats.read_bytes.values()), **self.ops.counters(),
                "uncached_shared_bytes": self.uncached_shared_bytes}

    def status(self) -> dict:
        counters, budget = self.counters(), self.engine.budget
        hooks = self._loaded_by_hooks()
        when, before, rate = self._rate
        now = time.monotonic()
        if now - when >= 1.0:
            rate = (counters["read_bytes"] - before) / (now - when)
            self._rate = (now, counters["read_bytes"], rate)
        return {
            "pid": os.getpid(),
            "mountpoint": self.config.mountpoint,
            "checkpoint": self.config.checkpoint,
            "started": self.config.started,
            "profile": self.layouts[0].profile,
            "ranks": [layout.spec.describe() for layout in self.layouts],
            "views": [{"view": v.name, "planned_bytes": v.planned_bytes, "served_bytes": v.served_bytes,
                       "hook_loaded_bytes": hooks.get(v.name, 0), "active": v.active or v.name in hooks}
                      for v in self.engine.views.values()],
            **counters,
            "counters": sorted(counters),
            "read_rate_bytes_per_s": rate,
            "held_bytes": budget.used,
            "peak_held_bytes": budget.peak,
            "budget_bytes": budget.ceiling,
            "read_ahead_limit_bytes": budget.limit,
            "workers": self.config.workers,
            "push_threads": self.config.push_threads,
            "rss_bytes": psutil.Process().memory_info().rss,
            "memory": self.engine.held.figures(),
            "drops": self.drops,
            "tuning": self.tuning,
            "log_file": self.config.log_file,
        }

    def status_json(self) -> bytes:
        return json.dumps(self.status(), indent=2).encode() + b"\n"

    async def run(self, on_ready):
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run)
            if self.config.push:
                nursery.start_soon(push_prefetched, self.engine, self.config.push_threads)
                nursery.start_soon(self.ops.listings.push_ahead)
            if not self.config.keep_cache:
                nursery.start_soon(drop_consumed, self.engine)
            nursery.start_soon(self._signals, nursery.cancel_scope)
            nursery.start_soon(self._after_start, on_ready)
            await pyfuse3.main(min_tasks=4, max_tasks=64)
            nursery.cancel_scope.cancel()  # unmounted from outside: fusermount -u

    async def _after_start(self, on_ready):
        entry = contract.find_mount(self.config.mountpoint)
        if entry is not None:
            self.tuning = await trio.to_thread.run_sync(
                kernel.tune, entry, self.config.readahead_kb, self.config.max_background,
                self.config.congestion_threshold)
        on_ready()
        # Targets first: the engines load them first, and their first opens then find them laid out.
        for view in sorted(self.tree.lazy_views, key=lambda lazy: lazy.view.name != "target"):
            try:
                await view.lay_out()
            except Exception:  # not the mount's end here: an open of the view meets the error again, as before
                log.exception("%s: laying out the view failed", view.directory)
        if len(self.layouts) > 1:
            await trio.to_thread.run_sync(self.host_pages)

    async def _signals(self, cancel_scope):
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("signal %s: unmounting", signal.Signals(signum).name)
                cancel_scope.cancel()
                return


def serve(config: MountConfig, ready_fd: int | None) -> int:
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
        options = {"fsname=rankfs", "subtype=rankfs", "default_permissions", "noatime", *config.fuse_options}
        if config.allow_other:
            options.add("allow_other")
        if config.debug_fuse:
            options.add("debug")
        try:
            pyfuse3.init(daemon.ops, config.mountpoint, options)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}: {why_not_mounted()}") from None
    except Exception as exc:  # every failure before the mount is the user's answer
        report(f"error: {exc}")
        return 32
    unmounted = False
    try:
        trio.run(daemon.run, lambda: report(
            f"ready: {config.mountpoint} serves {', '.join(s.describe() for s in config.specs)}"))
        unmounted = contract.find_mount(config.mountpoint) is None
    finally:
        pyfuse3.close(unmount=not unmounted)
        daemon.engine.trace.close()
        log.info("unmounted %s", config.mountpoint)
    return 0


def why_not_mounted() -> str:
    """What a failed mount most likely lacks (libfuse says which call failed, not why)."""
    if os.geteuid() != 0 and not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "this user may not open /dev/fuse (Debian makes it 0666; a container needs --device /dev/fuse)"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return "a user that is not root mounts through fusermount3: install fuse3"
    return "the daemon's log says why (libfuse's message)"


def main(argv: list[str]) -> int:
    """The daemon process, started by `rankfs mount`: python -m rankfs.mount.daemon CONFIG READY_FD.
    Its stdout and stderr are the log file."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config_json, ready_fd = argv
    return serve(MountConfig.from_json(config_json), int(ready_fd))


if __name__ == "__main__":
    import sys
    sys.exit(main(sys.argv[1:]))
