"""The engine-side hook: `safe_open` on a rankfs view returns slab-backed tensors, and when the
engine's weight loading returns, everything the load held is released and accounted for.

Only files on a rankfs mount are touched; every other call goes to the stock `safe_open`.
Settings (environment): RANKFS_HOOK=on|observe|off, RANKFS_HOOK_SLAB_MB (256),
RANKFS_HOOK_INFLIGHT_GB (4), RANKFS_HOOK_THREADS (16), RANKFS_HOOK_MAP=auto|on|off (tensors view
the sources' maps instead of slabs; auto: when there is no CUDA).
"""

from __future__ import annotations

import atexit
import gc
import json
import logging
import mmap
import os
import sys
import threading
import time

import safetensors
import torch

from loader import memory
from loader.files import RankfsFile
from loader.ordered import OrderedExecutor
from loader.slabs import SlabPool
from mount import control
from reader.device import open_for_exact_reads, willneed_reach
from vfs.tree import sources_file

log = logging.getLogger("rankfs.hook")

RANKFS_FSTYPE = "fuse.rankfs"
MAP_READERS = 16


class LeftoverSlabs(RuntimeError):
    pass


class ViewProgress:
    """The bytes of one view this process has loaded from the sources, reported to the mount's
    daemon (at most every quarter second, and at release): `rankfs status` and `--progress` count
    them, though they never pass through the mount."""

    def __init__(self, report_dir: str, view: str):
        self.report_dir, self.view = report_dir, view
        self.loaded = 0
        self._reported_at = 0.0
        self._lock = threading.Lock()

    def add(self, nbytes: int):
        with self._lock:
            self.loaded += nbytes
            if time.monotonic() - self._reported_at >= 0.25:
                self._report()

    def flush(self):
        with self._lock:
            self._report()

    def _report(self):
        self._reported_at = time.monotonic()
        if self.report_dir is None:
            return
        try:
            control.report_loaded(self.report_dir, self.view, self.loaded)
        except OSError as exc:  # the mount is gone, or not ours to write to: stop telling it
            log.info("rankfs hook: %s: progress not reported: %s", self.view, exc)
            self.report_dir = None


def _rankfs_devices() -> set[int]:
    devices = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            if right.split()[0] == RANKFS_FSTYPE:
                major, minor = left.split()[2].split(":")
                devices.add(os.makedev(int(major), int(minor)))
    return devices


class Hook:
    def __init__(self, mode: str, slab_bytes: int, budget_bytes: int, threads: int, map_sources: bool):
        self.mode = mode
        # Tensors that view the sources' maps instead of slabs: for loads into host memory, where
        # a slab would only add a copy (RANKFS_HOOK_MAP; by default when there is no CUDA).
        self.map_sources = map_sources
        self.stock_open = safetensors.safe_open
        self.pool = SlabPool(slab_bytes, budget_bytes, pin=torch.cuda.is_available())
        self.threads = threads
        self.executor: OrderedExecutor | None = None  # reads into slabs
        self.map_executor: OrderedExecutor | None = None  # reads mapped tensors ahead
        self._start_readers()
        self.paths: set[str] = set()
        self.start: dict | None = None
        self.releases: list[dict] = []
        self._devices: set[int] | None = None
        self._lock = threading.Lock()
        self._maps: dict[str, dict] = {}  # map file -> where a view's tensors lie in the sources
        self._source_fds: dict[str, int] = {}
        self.willneed_reach: dict[str, int] = {}  # source path -> bytes one WILLNEED reads
        self._progress: dict[str, ViewProgress] = {}  # view directory -> its progress
        atexit.register(self.flush_progress)  # a program that never releases: its last figures
        self._source_maps: dict[str, mmap.mmap] = {}

    def _start_readers(self):
        self.executor = OrderedExecutor(self.threads, "rankfs-read")
        # A WILLNEED piece in flight per thread: enough to keep the disk busy (8 were slower on
        # the sliced rank, 32 no faster), few enough that what is in flight is what the loader
        # asks for next.
        self.map_executor = OrderedExecutor(MAP_READERS, "rankfs-map")

    def on_rankfs(self, path) -> bool:
        try:
            device = os.stat(path).st_dev
        except OSError:
            return False
        if self._devices is None or device not in self._devices:
            self._devices = _rankfs_devices()
        return device in self._devices

    def safe_open(self, filename, framework="pt", device="cpu", **kwargs):
        path = os.fspath(filename)
        if framework not in ("pt", "torch") or str(device) != "cpu" or kwargs or not self.on_rankfs(path):
            return self.stock_open(filename, framework=framework, device=device, **kwargs)
        path = own_rank_path(path)
        if path is None:  # this rank has nothing in that shard
            return EmptyFile()
        with self._lock:
            if self.start is None:
                self.start = memory.snapshot()
                patch_engines(self)
            self.paths.add(path)
        if self.mode == "observe":
            return self.stock_open(filename, framework=framework, device=device)
        if self.executor is None:  # a load after a release: read threads again
            self._start_readers()
        return RankfsFile(path, self, self.stock_open)

    def backing(self, path: str) -> dict[str, tuple[int, int, str]] | None:
        """Where a view file's tensors lie in the source shards, opened: {tensor: (fd, offset,
        source path)}. None when the mount does not say, or a source cannot be read here or has
        changed since it was mounted: then the hook reads the view (and the daemon reports it)."""
        mountpoint = control.mount_root(path)
        map_file = os.path.join(mountpoint, sources_file(os.path.relpath(os.path.dirname(path), mountpoint)))
        try:
            mapping = self._maps.get(map_file)
            if mapping is None:
                with open(map_file) as f:
                    mapping = self._maps[map_file] = json.load(f)
            fds = [self._source_fd(source) for source in mapping["sources"]]
        except OSError as exc:
            log.info("rankfs hook: %s: reading through the mount: %s", path, exc)
            return None
        paths = [source["path"] for source in mapping["sources"]]
        return {name: (fds[i], offset, paths[i])
                for name, (i, offset) in mapping["files"][os.path.basename(path)].items()}

    def flush_progress(self):
        with self._lock:
            views = list(self._progress.values())
        for progress in views:
            progress.flush()

    def progress(self, path: str) -> ViewProgress:
        """The progress of the view a file belongs to."""
        view_dir = os.path.dirname(path)
        with self._lock:
            progress = self._progress.get(view_dir)
        if progress is None:
            mountpoint = control.mount_root(path)
            try:
                report_dir = control.read_status(mountpoint)["hook_reports"]
            except (OSError, ValueError, KeyError):
                report_dir = None
            with self._lock:
                progress = self._progress.setdefault(
                    view_dir, ViewProgress(report_dir, os.path.relpath(view_dir, mountpoint)))
        return progress

    def _source_fd(self, source: dict) -> int:
        with self._lock:
            fd = self._source_fds.get(source["path"])
            if fd is None:
                fd = open_for_exact_reads(source["path"])
                st = os.fstat(fd)
                if (st.st_size, st.st_mtime_ns, st.st_ino) != (source["size"], source["mtime_ns"], source["inode"]):
                    os.close(fd)
                    raise OSError(f"{source['path']}: changed since it was mounted")
                self._source_fds[source["path"]] = fd
                self.willneed_reach[source["path"]] = willneed_reach(source["path"])
            return fd

    def source_map(self, path: str) -> mmap.mmap:
        """A private map of a source shard (opened by `backing`): mapped tensors view it."""
        with self._lock:
            source = self._source_maps.get(path)
            if source is None:
                source = self._source_maps[path] = mmap.mmap(self._source_fds[path], 0, access=mmap.ACCESS_COPY)
                # No read-around on the loader's faults: it read other ranks' rows of sliced experts
                # (EP1 sliced: 4.97 GB from disk for 4.61 planned). The read-ahead asks for the rest.
                source.madvise(mmap.MADV_RANDOM)
            return source

    def _drop_daemons(self):
        """The daemons of the mounts loaded from release their buffers and drop what they pushed
        into page cache. Not for a mount several local ranks share: the others may still load."""
        for mountpoint in {control.mount_root(path) for path in self.paths}:
            try:
                if len(control.read_status(mountpoint)["ranks"]) == 1:
                    control.drop(mountpoint, timeout=10)
            except OSError as exc:  # unmounted already, or not ours to signal
                log.info("rankfs hook: %s: daemon not asked to drop: %s", mountpoint, exc)

    def release(self, phase: str = "load") -> dict:
        """Stop the readers, free what the load held, drop the views' page cache, and report."""
        before = memory.snapshot()
        if self.executor is not None:
            self.executor.shutdown()
            self.map_executor.shutdown()
            self.executor = self.map_executor = None
        gc.collect()
        leftovers = self.pool.alive()
        self.pool.drop_idle()
        memory.malloc_trim()
        memory.return_pinned_and_cached()
        for path in self.paths:
            try:
                fd = os.open(path, os.O_RDONLY)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            except OSError:
                pass  # unmounted already: nothing cached
        self.flush_progress()
        self._drop_daemons()
        with self._lock:
            self._progress.clear()
            self._source_maps.clear()  # unmapped once no tensor views them
            for fd in self._source_fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
            self._source_fds.clear()
            self._maps.clear()
        after = memory.snapshot()
        start = self.start or before
        stats = self.pool.stats
        figures = {
            "phase": phase,
            **after,
            "mem_available_before": before["memavailable"],
            "pinned": self.pool.pin,
            "slab_requests": stats.requests, "slabs": stats.slabs,
            "peak_slab_bytes": stats.peak_live_bytes, "slabs_alive": len(leftovers),
            "torch_host_allocs": _host_alloc_count(),
            # MemAvailable lost since the load began, less what CUDA's allocator grew by where that
            # is host memory (unified memory).
            "nontorch_since_load_start": (start["memavailable"] - after["memavailable"])
            - ((after["cuda_reserved"] - start["cuda_reserved"]) if memory.unified_memory() else 0),
        }
        line = memory.format_line(figures)
        log.warning("%s", line)
        print(line, file=sys.stderr, flush=True)
        self.releases.append(figures)
        for file, names in leftovers:
            message = f"rankfs: a slab of {file} is still alive after the {phase} load, held by " \
                      f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}"
            log.error("%s", message)
            if phase == "target":
                raise LeftoverSlabs(message)
        return figures


def current_rank() -> int:
    """This process's rank: RANKFS_RANK, else torch.distributed's, else 0 (the engine's main
    process, which only reads config and headers)."""
    if "RANKFS_RANK" in os.environ:
        return int(os.environ["RANKFS_RANK"])
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def own_rank_path(path: str) -> str | None:
    """A shard of the view shared by a mount's local ranks (MNT/target/X) is read from this rank's
    own view (MNT/rank-R/target/X); None when this rank's view has no such shard."""
    view_dir = os.path.dirname(os.path.abspath(path))
    mount_root = os.path.dirname(view_dir)
    if not os.path.isdir(os.path.join(mount_root, "rank-0")):
        return path
    own = os.path.join(mount_root, f"rank-{current_rank()}", os.path.basename(view_dir), os.path.basename(path))
    return own if os.path.exists(own) else None


class EmptyFile:
    """safe_open's answer for a shard in which this rank keeps no tensor."""

    def keys(self):
        return []

    def metadata(self):
        return {}

    def get_tensor(self, name):
        raise KeyError(name)

    get_slice = get_tensor

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


def _host_alloc_count():
    try:
        stats = torch.cuda.host_memory_stats()
        return stats.get("num_host_alloc", None)
    except Exception:
        return None


def patch_engines(hook: Hook):
    """Release when the engines' weight loading returns (SGLang: DefaultModelLoader's
    load_weights_and_postprocess; vLLM: DefaultModelLoader.load_weights)."""
    sglang = sys.modules.get("sglang.srt.model_loader.loader")
    if sglang is not None and hasattr(sglang, "DefaultModelLoader"):
        cls = sglang.DefaultModelLoader
        original = cls.__dict__.get("load_weights_and_postprocess")
        if isinstance(original, staticmethod) and not getattr(original.__func__, "_rankfs", False):
            def load_weights_and_postprocess(model, weights, target_device, _f=original.__func__):
                result = _f(model, weights, target_device)
                hook.release(_phase_of(model))
                return result
            load_weights_and_postprocess._rankfs = True
            cls.load_weights_and_postprocess = staticmethod(load_weights_and_postprocess)
    vllm = sys.modules.get("vllm.model_executor.model_loader.default_loader")
    if vllm is not None and hasattr(vllm, "DefaultModelLoader"):
        cls = vllm.DefaultModelLoader
        original = cls.load_weights
        if not getattr(original, "_rankfs", False):
            def load_weights(self, model, model_config, _f=original):
                result = _f(self, model, model_config)
                hook.release(_phase_of(model))
                return result
            load_weights._rankfs = True
            cls.load_weights = load_weights


def _phase_of(model) -> str:
    name = type(model).__name__.lower()
    return "draft" if any(k in name for k in ("nextn", "mtp", "draft", "eagle")) else "target"
