"""rankfs as a library, for what starts engines (launchers, operators): mount a rank's views, read a
mount's status, drop what it holds, unmount. The command line is built on it.

    import rankfs
    with rankfs.mount("/models/dsv4", "/mnt/rankfs", tp_size=4, tp_rank=0, ep_size=1) as mnt:
        ...                                   # start the engine on mnt.path / "target"
        print(mnt.status().views)

A checkpoint is a directory, or a Hugging Face repo id whose snapshot the local cache holds
(`revision`: a branch, tag or commit). Failures raise: `MountError` (a mount or unmount that failed,
a path that is not a live rankfs mount; an OSError), `CheckpointError` and `LayoutError` (the
checkpoint or the layout: ValueErrors), `UsageError` (arguments that do not fit together).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from rankfs.common import contract, limits
from rankfs.common.contract import GIB
from rankfs.mount import hf_cache, kernel
from rankfs.mount.config import MountConfig, default_budget_bytes, default_push_threads, default_readahead_kb
from rankfs.mount.exits import UsageError
from rankfs.mount.launch import MountError, default_log, start, unmount
from rankfs.plan.errors import CheckpointError, LayoutError
from rankfs.plan.spec import RankSpec

__all__ = ["Mount", "MountError", "MountStatus", "ViewStatus", "CheckpointError", "LayoutError", "UsageError",
           "attach", "mount", "mount_config", "rank_specs"]


@dataclass(frozen=True)
class ViewStatus:
    """One view's loading: planned against served through the mount and loaded by hooks."""
    view: str  # target, draft, rank-R/target, ...
    planned_bytes: int
    served_bytes: int  # through the mount
    hook_loaded_bytes: int  # by engine hooks, straight from the sources
    active: bool

    @property
    def loaded_bytes(self) -> int:
        return self.served_bytes + self.hook_loaded_bytes


@dataclass(frozen=True)
class MountStatus:
    """A live mount's figures (`rankfs status --json` holds them all: `raw`)."""
    pid: int
    mountpoint: str
    checkpoint: str
    profile: str
    ranks: tuple[str, ...]
    views: tuple[ViewStatus, ...]
    read_bytes: int  # from the sources, by the daemon
    held_bytes: int  # read ahead and held now
    budget_bytes: int
    rss_bytes: int
    errors: int
    raw: dict = field(repr=False)

    @classmethod
    def of(cls, raw: dict) -> "MountStatus":
        views = tuple(ViewStatus(**{k: v[k] for k in ViewStatus.__dataclass_fields__}) for v in raw["views"])
        return cls(raw["pid"], raw["mountpoint"], raw["checkpoint"], raw["profile"], tuple(raw["ranks"]), views,
                   raw["read_bytes"], raw["held_bytes"], raw["budget_bytes"], raw["rss_bytes"], raw["errors"], raw)


class Mount:
    """A live rankfs mount. As a context manager it unmounts on exit (lazily where files on it are
    still open: an engine that maps the shards)."""

    def __init__(self, path: str | os.PathLike, pid: int | None = None):
        self.path = Path(os.path.abspath(path))
        self.pid = pid

    def _live(self):
        state = kernel.health(self.path)
        if state != "alive":
            why = {"absent": "not mounted", "other": "not a rankfs mount",
                   "dead": f"its daemon is gone; 'rankfs umount {self.path}' cleans it up"}[state]
            raise MountError(f"{self.path}: {why}")

    def status(self) -> MountStatus:
        """The daemon's figures now."""
        self._live()
        return MountStatus.of(contract.read_status(str(self.path)))

    def drop(self):
        """Release the daemon's buffers and the views' page cache; returns once done."""
        self._live()
        contract.send(str(self.path), contract.DROP)

    def unmount(self, lazy: bool = False, force: bool = False) -> str:
        """Unmount and wait for the daemon to end (`rankfs umount`); returns what was done."""
        return unmount(str(self.path), lazy, force)

    def __enter__(self) -> "Mount":
        return self

    def __exit__(self, *exc):
        if contract.find_mount(self.path) is None:
            return
        try:
            self.unmount()
        except MountError:
            self.unmount(lazy=True)

    def __repr__(self):
        return f"Mount({str(self.path)!r}, pid={self.pid})"


def attach(path: str | os.PathLike) -> Mount:
    """A mount already there (made by `rankfs mount` or another process)."""
    found = Mount(path)
    found._live()
    return found


def rank_specs(tp_size: int, tp_rank: int | None = None, local_ranks=None, ep_size: int = 1,
               tp_slice: str = "auto", placement: str = "sglang", n_experts: int | None = None) -> tuple[RankSpec, ...]:
    """The ranks a mount serves: one (`tp_rank`), or several of one host (`local_ranks`: 'all', or
    a list of ranks)."""
    common = dict(tp_size=tp_size, ep_size=ep_size, tp_slice=tp_slice, placement=placement, n_experts=n_experts)
    if local_ranks is not None:
        if tp_rank is not None:
            raise UsageError("give --tp-rank or --local-ranks, not both")
        ranks = range(tp_size) if local_ranks == "all" else _rank_list(local_ranks)
    elif tp_rank is None:
        raise UsageError("--tp-rank (or --local-ranks) is required")
    else:
        ranks = [tp_rank]
    return tuple(RankSpec(tp_rank=r, **common) for r in ranks)


def _rank_list(ranks) -> list[int]:
    if not isinstance(ranks, str):
        return [int(r) for r in ranks]
    try:
        return [int(x) for x in ranks.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--local-ranks: expected 'all' or a list like 0,1,2,3, got {ranks!r}") from None


def resolve_checkpoint(checkpoint: str | os.PathLike, revision: str | None = None) -> tuple[str, bool]:
    """(the checkpoint's directory, whether its files are a Hugging Face cache's symlinks into blobs)."""
    text = os.fspath(checkpoint)
    if hf_cache.is_repo_id(text):
        return str(hf_cache.snapshot(text, revision)), True
    if revision is not None:
        raise UsageError(f"--revision is for a Hugging Face repo id, and {text} is a directory")
    return os.path.abspath(text), False


def mount_config(checkpoint, mountpoint, *, tp_size: int, tp_rank: int | None = None, local_ranks=None,
                 ep_size: int = 1, tp_slice: str = "auto", placement: str = "sglang", n_experts: int | None = None,
                 profile: str | None = None, revision: str | None = None, inflight_gb: float | None = None,
                 workers: int = 8, readahead_kb: int | None = None, direct_io: bool = False, push: bool = True,
                 push_threads: int | None = None, keep_cache: bool = False, allow_other: bool = False,
                 allow_outside_symlinks: bool = False,
                 fuse_options=(), debug_fuse: bool = False, trace: str | None = None,
                 log: str | None = None) -> MountConfig:
    """What a mount serves and how (`rankfs mount --help` says what each argument means)."""
    directory, from_hub = resolve_checkpoint(checkpoint, revision)
    mountpoint = os.path.abspath(mountpoint)
    available = limits.available_memory()
    budget = int(inflight_gb * GIB) if inflight_gb else default_budget_bytes(available)
    if budget > available:
        raise UsageError(f"--inflight-gb {inflight_gb:g} is more than the {available / GIB:.2f} GiB this "
                         "process may still use (its cgroup's memory limit less what it uses, or the host's "
                         "available memory); give less, or leave it out to size it from that")
    options = [o for o in fuse_options if o]
    specs = rank_specs(tp_size, tp_rank, local_ranks, ep_size, tp_slice, placement, n_experts)
    return MountConfig(
        checkpoint=directory, mountpoint=mountpoint, specs=specs,
        budget_bytes=budget, profile=profile, workers=workers, direct_io=direct_io, push=push,
        push_threads=push_threads or default_push_threads(limits.cpu_count()), keep_cache=keep_cache,
        readahead_kb=readahead_kb or default_readahead_kb(specs),
        allow_other=allow_other or "allow_other" in options,
        allow_outside_symlinks=allow_outside_symlinks or from_hub,
        fuse_options=tuple(o for o in options if o != "allow_other"), debug_fuse=debug_fuse,
        trace_file=trace and os.path.abspath(trace), log_file=log or str(default_log(mountpoint)))


def mount(checkpoint, mountpoint, **options) -> Mount:
    """Mount a checkpoint's views (`mount_config` takes the options) and return once they can be read."""
    config = mount_config(checkpoint, mountpoint, **options)
    pid, _ = start(config)
    return Mount(config.mountpoint, pid)
