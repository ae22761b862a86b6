"""A loader that reads a model directory the way SGLang's DeepSeek path does, for tests and the
benchmark: files opened several at a time and yielded in order (the buffered multi-thread
iterator), each tensor narrowed by FusedMoE's rule and copied into preallocated memory by a pool of
copy threads (on the loop for tensors on a GPU already, as SGLang does). Routed experts another EP
rank owns are skipped, row-store tables only have their shape checked. The parameters are allocated
before the load (`allocate`, as the engines build the model before they load its weights), or on
first sight. Nothing here knows about rankfs.
"""

from __future__ import annotations

import glob
import hashlib
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed.tensor  # noqa: F401  imported by SGLang's and vLLM's loaders before they load
from safetensors import safe_open

from rankfs.loader.files import TORCH_DTYPES
from rankfs.plan.profiles import Profile
from rankfs.plan.safetensors import read_header


@dataclass(frozen=True)
class MoELayout:
    moe_tp_size: int = 1
    moe_tp_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    n_experts: int | None = None  # per group: None means count from the names (draft stages)
    narrow_offset_shift: int = 0  # a loader that narrows elsewhere (to prove the guard): 1 = next slice

    def owns(self, expert: int, n_experts: int) -> bool:
        per_rank = n_experts // self.ep_size
        return self.ep_rank * per_rank <= expert < (self.ep_rank + 1) * per_rank


def shard_files(directory) -> list[str]:
    return sorted(glob.glob(os.path.join(os.fspath(directory), "*.safetensors")))


def iterate(files: list[str], open_threads: int = 8, skip=None):
    """(name, tensor) in file order, each file's tensors by sorted name; up to open_threads + 1
    files opened ahead, as SGLang's buffered multi-thread iterator does. `skip(name)` leaves a
    tensor unopened, as an engine's weight filter does before reading."""
    def open_file(path):
        handle = safe_open(path, framework="pt")
        names = [name for name in sorted(handle.keys()) if skip is None or not skip(name)]
        return handle, [(name, handle.get_tensor(name)) for name in names]

    with ThreadPoolExecutor(open_threads) as pool:
        pending = [pool.submit(open_file, f) for f in files[:open_threads + 1]]
        next_file = len(pending)
        while pending:
            handle, tensors = pending.pop(0).result()
            if next_file < len(files):
                pending.append(pool.submit(open_file, files[next_file]))
                next_file += 1
            yield from tensors
            del tensors


def narrowed(name: str, tensor: torch.Tensor, profile: Profile, layout: MoELayout, expert_counts: dict):
    """What FusedMoE copies from this checkpoint tensor, or None when it skips it."""
    if profile.is_on_demand(name):
        return None
    expert = profile.expert(name)
    if expert is None:
        return tensor
    n = layout.n_experts if layout.n_experts and not name.startswith("mtp.") else expert_counts[expert.group]
    if not layout.owns(expert.expert, n):
        return None
    dim = profile.narrow_dims.get(expert.projection)
    if dim is None or dim >= tensor.dim() or layout.moe_tp_size == 1:
        return tensor
    size = tensor.shape[dim] // layout.moe_tp_size
    rank = (layout.moe_tp_rank + layout.narrow_offset_shift) % layout.moe_tp_size
    return tensor.narrow(dim, size * rank, size)


def allocate(files: list[str], profile: Profile, layout: MoELayout, counts: dict, keep=None,
             device: str = "cpu") -> dict[str, torch.Tensor]:
    """The parameters a load of `files` copies into, from their headers alone: what the engines
    allocate when they build the model, before its weights are read."""
    params = {}
    for path in files:
        for name, entry in read_header(path).tensors.items():
            if keep is not None and not keep(name):
                continue
            meta = torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype], device="meta")
            source = narrowed(name, meta, profile, layout, counts)
            if source is not None:
                params[name] = torch.empty(source.shape, dtype=source.dtype, device=device)
    return params


def expert_counts(files: list[str], profile: Profile) -> dict[str, int]:
    counts: dict[str, int] = {}
    for path in files:  # the header alone: a safe_open maps the file, and its first read-ahead caches 8 MiB of it
        for name in read_header(path).tensors:
            expert = profile.expert(name)
            if expert is not None:
                counts[expert.group] = max(counts.get(expert.group, 0), expert.expert + 1)
    return counts


def digest(tensor: torch.Tensor) -> str:
    """The sha256 of a tensor's bytes, wherever it lies: two loads are bitwise equal where these are."""
    return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy()).hexdigest()


def weights_digest(params: dict[str, torch.Tensor]) -> str:
    """One sha256 over every parameter's name and digest, hashed by as many threads as cores
    (hashlib lets the GIL go)."""
    names = sorted(params)
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        digests = list(pool.map(lambda name: digest(params[name]), names))
    return hashlib.sha256("".join(f"{n} {d}\n" for n, d in zip(names, digests)).encode()).hexdigest()


class Progress:
    """Bytes copied so far, readable from another thread (for the benchmark's timeline), and what
    bounds the load: the loop's seconds waiting for its next tensor (the source), the copy threads'
    seconds copying, together (the copies); neither, the loop's own work."""

    def __init__(self):
        self.bytes = 0
        self.waited = 0.0
        self.copying = 0.0
        self._lock = threading.Lock()

    def add(self, n: int, seconds: float = 0.0):
        with self._lock:
            self.bytes += n
            self.copying += seconds


def copy_weights(weights, profile: Profile, layout: MoELayout, counts: dict, copy_threads: int = 24,
                 params: dict | None = None, keep=None, device: str = "cpu",
                 progress: Progress | None = None) -> dict[str, torch.Tensor]:
    """The model's side of a load: each (name, tensor) it owns, narrowed, copied into its parameter on
    `device` by a pool of copy threads, or on the loop where the tensor is on a GPU already, as
    SGLang does (parameters made on first sight, as if preallocated).
    `keep(name)` picks the model's tensors (the target skips mtp.*). Returns {name: parameter}."""
    params = {} if params is None else params

    def copy(name, source):
        began = time.monotonic()
        params[name].copy_(source, non_blocking=False)
        if progress is not None:
            progress.add(source.numel() * source.element_size(), time.monotonic() - began)

    with ThreadPoolExecutor(copy_threads) as copies:
        futures = []
        weights = iter(weights)
        while True:
            began = time.monotonic()
            item = next(weights, None)
            if progress is not None:
                progress.waited += time.monotonic() - began
            if item is None:
                break
            name, tensor = item
            if keep is not None and not keep(name):
                continue
            source = narrowed(name, tensor, profile, layout, counts)
            if source is None:
                continue
            if name not in params:
                params[name] = torch.empty(source.shape, dtype=source.dtype, device=device)
            if source.device.type == "cpu":
                futures.append(copies.submit(copy, name, source))
            else:  # SGLang's should_async_load: device tensors are loaded on the loop, no thread pool
                copy(name, source)
        for future in futures:
            future.result()
    return params


def load(directory, profile: Profile, layout: MoELayout, open_threads: int = 8, counts: dict | None = None,
         **copying) -> dict[str, torch.Tensor]:
    """Load a model directory the engine's way: SGLang's buffered iterator over its shards, into
    copy_weights. Missing weights are an error only when the directory has no shards at all, as in
    the engines."""
    files = shard_files(directory)
    if not files:
        raise FileNotFoundError(f"{directory}: no *.safetensors files")
    counts = counts if counts is not None else expert_counts(files, profile)
    return copy_weights(iterate(files, open_threads), profile, layout, counts, **copying)
