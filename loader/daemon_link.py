"""What the hook asks of a mount's daemon, through the mount itself (rankfs.common.contract): where the
mount's root and this rank's view lie, where a view file's tensors lie in the source shards, telling
it how much of a view was loaded straight from them and, where it serves several local ranks, which
view files this rank is done reading, and asking it to drop what it holds after a load. Standard
library only."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from rankfs.common import contract
from rankfs.common.disk import OpenFile, covering_pages, merge_adjacent, willneed_reach
from rankfs.common.threads import start_thread

log = logging.getLogger("rankfs.hook")

REPORT_INTERVAL = 0.25  # seconds between progress reports of one view
DROP_TIMEOUT = 10.0


class ViewProgress:
    """The bytes of one view this process has loaded from the sources, reported to the daemon (at
    most every REPORT_INTERVAL, and when flushed): `rankfs status` counts them with what it served."""

    def __init__(self, mountpoint: str, view_dir: str):
        self.mountpoint, self.view_dir = mountpoint, view_dir
        self.loaded = 0
        self._reported_at = 0.0
        self._counting = threading.Lock()
        self._sending = threading.Lock()  # one report at a time
        self._silent = False
        # At once, so that the daemon stops reading ahead what this process reads itself, but not on
        # the thread opening the view's first file: the write waits for the daemon to answer.
        start_thread(self.flush, "rankfs-report")

    def add(self, nbytes: int):
        """Count bytes loaded; report them where one is due and none is being sent. Called on the
        loader's threads as tensors are handed out or let go: none waits for another's report (a
        write through the mount, three FUSE round trips)."""
        with self._counting:
            self.loaded += nbytes
        if time.monotonic() - self._reported_at >= REPORT_INTERVAL and self._sending.acquire(blocking=False):
            try:
                self._report()
            finally:
                self._sending.release()

    def flush(self):
        with self._sending:
            self._report()

    def _report(self):
        self._reported_at = time.monotonic()
        if self._silent:
            return
        try:
            contract.send(self.mountpoint, contract.loaded_command(self.view_dir, self.loaded))
        except OSError as exc:  # unmounted, or not ours to write to: stop telling it
            log.info("rankfs hook: %s: progress not reported: %s", self.view_dir, exc)
            self._silent = True


class DaemonLink:
    def __init__(self):
        self._lock = threading.Lock()
        self._maps: dict[str, contract.SourcesMap | None] = {}  # sources map file -> its map (None: unreadable)
        self._sources: dict[str, OpenFile] = {}  # source path -> the file (checked unchanged at open)
        self.willneed_reach: dict[str, int] = {}  # source path -> bytes one WILLNEED reads
        self._progress: dict[str, ViewProgress] = {}  # view directory path -> its progress
        # Asked of the mount once per load, not per file: each is a FUSE round trip or several,
        # and the loader's eight open threads wait on them before the first tensor.
        self._roots: dict[str, str] = {}  # view directory path -> its mount point
        self._rank_views: dict[str, bool] = {}  # directory of views -> whether it has rank-R/ views
        self._consumed: set[str] = set()  # view files reported done with, to a mount of several ranks
        self._reports: ThreadPoolExecutor | None = None  # sends those reports, off the loader's threads
        self.source_reads = {"direct": 0, "cached": 0}  # bytes the last load read from the sources, each way

    def placement(self, path: str) -> dict[str, tuple[OpenFile, int]] | None:
        """Where a view file's tensors lie in the source shards, opened: {tensor: (source, offset
        of its first byte)}. None when the mount does not say (or says it in another version's
        format), or a source cannot be read here or has changed since it was mounted: the hook
        then reads the view itself (and the daemon serves it). Only the sources the file's
        tensors lie in are opened."""
        mountpoint = self.mount_root(path)
        map_file = contract.sources_path(mountpoint, os.path.relpath(os.path.dirname(path), mountpoint))
        try:
            sources_map = self._sources_map(map_file)
            if sources_map is None:
                return None
            places = sources_map.places(os.path.basename(path))
            several = self.serves_several_ranks(mountpoint)
            opened = {i: self._open(sources_map.sources[i], sources_map.shared.get(i, []) if several else None)
                      for i in {i for i, _ in places.values()}}
        except OSError as exc:
            log.info("rankfs hook: %s: reading through the mount: %s", path, exc)
            return None
        return {name: (opened[i], offset) for name, (i, offset) in places.items()}

    def _sources_map(self, map_file: str) -> contract.SourcesMap | None:
        """A view's sources map, read once per load; None (said once) where this hook cannot read
        it."""
        with self._lock:
            if map_file not in self._maps:
                with open(map_file, "rb") as f:
                    data = f.read()
                try:
                    self._maps[map_file] = contract.SourcesMap(data)
                except contract.SourcesMapError as exc:
                    log.warning("rankfs hook: %s: %s; the views are read through the mount", map_file, exc)
                    self._maps[map_file] = None
            return self._maps[map_file]

    def _open(self, source: contract.Source, shared: list[tuple[int, int]] | None) -> OpenFile:
        """A source, opened once per load; `shared`: the pages of it the mount's other local ranks
        read too, None on a mount of one rank (rankfs.common.disk.OpenFile)."""
        with self._lock:
            opened = self._sources.get(source.path)
            if opened is not None and shared:
                opened.share(shared)  # another view of this rank reads other pages of it
            if opened is None:
                opened = OpenFile(source.path, shared=shared)
                if not source.unchanged(os.fstat(opened.fd)):
                    opened.close()
                    raise OSError(f"{source.path}: changed since it was mounted")
                self._sources[source.path] = opened
                self.willneed_reach[source.path] = willneed_reach(source.path)
            return opened

    def mount_root(self, path: str) -> str:
        """The mount point a view file lies under."""
        view_dir = os.path.dirname(path)
        root = self._roots.get(view_dir)
        if root is None:
            root = self._roots[view_dir] = contract.mount_root(view_dir)
        return root

    def serves_several_ranks(self, directory: str) -> bool:
        """Whether a directory of views is a mount's root that serves several local ranks (it holds
        rank-R/ views)."""
        several = self._rank_views.get(directory)
        if several is None:
            try:
                several = any(name.startswith("rank-") for name in os.listdir(directory))
            except OSError:
                several = False
            self._rank_views[directory] = several
        return several

    def own_rank_path(self, path: str, rank: Callable[[], int]) -> str | None:
        """A shard of the view shared by a mount's local ranks (MNT/target/X) is read from this rank's
        own view (MNT/rank-R/target/X, R from `rank()`); None when this rank's view has no such shard."""
        view_dir = os.path.dirname(path)
        root = os.path.dirname(view_dir)
        if not self.serves_several_ranks(root):
            return path
        own = os.path.join(root, f"rank-{rank()}", os.path.basename(view_dir), os.path.basename(path))
        return own if os.path.exists(own) else None

    def source(self, source_path: str) -> OpenFile:
        """A source a placement opened."""
        with self._lock:
            return self._sources[source_path]

    def progress(self, path: str) -> ViewProgress:
        """The progress of the view a file belongs to."""
        view_path = os.path.dirname(path)
        with self._lock:
            if view_path not in self._progress:
                mountpoint = self.mount_root(path)
                self._progress[view_path] = ViewProgress(mountpoint, os.path.relpath(view_path, mountpoint))
            return self._progress[view_path]

    def flush_progress(self):
        with self._lock:
            views = list(self._progress.values())
        for progress in views:
            progress.flush()

    def consumed(self, path: str):
        """This rank is done reading a view file from the sources. A mount that serves several local
        ranks hears of it (on a thread of its own: the write waits for the daemon), and drops the
        source pages no rank needs any more; the hooks leave that to it."""
        mountpoint = self.mount_root(path)
        if not self.serves_several_ranks(mountpoint):
            return
        command = contract.consumed_command(os.path.relpath(os.path.dirname(path), mountpoint), os.path.basename(path))
        with self._lock:
            if path in self._consumed:
                return
            self._consumed.add(path)
            if self._reports is None:
                self._reports = ThreadPoolExecutor(1, thread_name_prefix="rankfs-consumed")
            self._reports.submit(_send, mountpoint, command)

    def close(self, paths: set[str], uncache: dict[str, list[tuple[int, int]]],
              step: Callable[[str], None] = lambda name: None):
        """After a load: report the last figures and the view files it read (`paths`), drop what the
        load added to the sources' page cache (the (begin, end) spans in `uncache` per source, which
        it read through maps, unless other local ranks share the source: their daemon drops those)
        and close them; `step(name)` as each part ends (the release's clock)."""
        self.flush_progress()
        step("progress_report")
        with self._lock:
            self.source_reads = {"direct": sum(f.direct_read_bytes for f in self._sources.values()),
                                 "cached": sum(f.cached_read_bytes for f in self._sources.values())}
            for path, opened in self._sources.items():
                if not opened.shared:
                    for _, begin, end in merge_adjacent((0, *covering_pages(*span)) for span in uncache.get(path, ())):
                        os.posix_fadvise(opened.fd, begin, end - begin, os.POSIX_FADV_DONTNEED)
                opened.drop_added()  # where it read through the page cache (a filesystem without O_DIRECT)
                opened.close()  # unmapped first: the page cache keeps pages a process maps
        step("source_pages")
        for path in paths:
            self.consumed(path)
        with self._lock:
            reports, self._reports = self._reports, None
        if reports is not None:
            reports.shutdown(wait=True)
        step("consumed_reports")
        with self._lock:
            self._sources.clear()
            self._maps.clear()
            self._progress.clear()
            self._roots.clear()
            self._rank_views.clear()
            self._consumed.clear()


def drop_daemons(paths: set[str]):
    """The daemons of the mounts loaded from release their buffers and drop what they pushed into
    page cache. Not a mount that several local ranks share: the others may still be loading. A
    daemon that does not answer within DROP_TIMEOUT is left to it."""
    for mountpoint in {contract.mount_root(path) for path in paths}:
        try:
            if len(contract.read_status(mountpoint)["ranks"]) != 1:
                continue
        except (OSError, ValueError, KeyError) as exc:  # unmounted already
            log.info("rankfs hook: %s: daemon not asked to drop: %s", mountpoint, exc)
            continue
        sender = start_thread(_send, "rankfs-drop", mountpoint, contract.DROP)
        sender.join(DROP_TIMEOUT)
        if sender.is_alive():
            log.warning("rankfs hook: %s: the daemon did not confirm the drop within %g s", mountpoint, DROP_TIMEOUT)


def _send(mountpoint: str, command: str):
    try:
        contract.send(mountpoint, command)
    except OSError as exc:
        log.info("rankfs hook: %s: %r not sent: %s", mountpoint, command, exc)
