"""Where staged tensors are handed out (RANKFS_HOOK_DEVICE), and how the bytes get there: a
`Staging` names the GPU, how a read thread's uploads reach it (rankfs.loader.uploads) and how to
wait for the copies queued on it. `stage_on` is the hook's one way to it, and the seam the tests use
to stage into host memory standing in for a GPU's."""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from rankfs.loader.uploads import CudaTransfer, Transfer


class Staging(NamedTuple):
    device: torch.device
    transfer: Callable[[torch.device], Transfer]  # a read thread's uploads, made on that thread
    synchronize: Callable[[], None]  # until every copy queued on the device is done
    pinned: bool  # the bounce buffers are page-locked


def stage_on(setting: str) -> Staging | None:
    """A CUDA device to stage on, or None for page-locked host memory. auto: the CUDA device
    holding most of this process's allocations (the engine builds its model there before it loads
    the weights); host memory where it holds none: its reader wants tensors on the CPU."""
    if setting == "cpu" or not torch.cuda.is_available():
        return None
    if setting != "auto":
        device = torch.device(setting)
    else:
        if not torch.cuda.is_initialized():
            return None
        allocated = [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())]
        most = max(range(len(allocated)), key=allocated.__getitem__)
        if not allocated[most]:
            return None
        device = torch.device("cuda", most)
    return Staging(device, CudaTransfer, functools.partial(torch.cuda.synchronize, device), pinned=True)
