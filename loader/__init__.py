"""The rankfs engine hook.

    import loader; loader.activate()    # before the engine imports safetensors' loaders
    ...                                   # the engine loads from a rankfs view
    figures = loader.release()            # other programs: free everything, get the memlog

`rankfs run -- ENGINE ...` activates it in the engine's Python processes without editing the engine.
"""

from __future__ import annotations

import os
import sys

_hook = None


def activate(mode: str | None = None):
    """Route `safetensors.safe_open` on rankfs views through the hook. mode: 'on' (default),
    'observe' (log the memory accounting, load the stock way) or 'off'."""
    global _hook
    mode = mode or os.environ.get("RANKFS_HOOK", "on")
    if mode == "off" or _hook is not None:
        return _hook
    if mode not in ("on", "observe"):
        raise ValueError(f"RANKFS_HOOK must be on, observe or off, not {mode!r}")
    import safetensors

    from loader.hook import Hook
    mapping = os.environ.get("RANKFS_HOOK_MAP", "auto")
    if mapping not in ("auto", "on", "off"):
        raise ValueError(f"RANKFS_HOOK_MAP must be auto, on or off, not {mapping!r}")
    _hook = Hook(mode,
                 slab_bytes=_power_of_two(int(os.environ.get("RANKFS_HOOK_SLAB_MB", "256"))) << 20,
                 budget_bytes=int(float(os.environ.get("RANKFS_HOOK_INFLIGHT_GB", "4")) * (1 << 30)),
                 threads=int(os.environ.get("RANKFS_HOOK_THREADS", "16")),
                 map_sources=mapping == "on" or mapping == "auto" and not torch_cuda_available())
    if mode == "on":
        from loader.guard import warm_up
        warm_up()
    stock = _hook.stock_open
    safetensors.safe_open = _hook.safe_open
    # Modules that bound the stock function at import time (`from safetensors import safe_open`).
    for module in list(sys.modules.values()):
        if getattr(module, "safe_open", None) is stock:
            module.safe_open = _hook.safe_open
    return _hook


def torch_cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


def deactivate():
    global _hook
    if _hook is None:
        return
    import atexit

    import safetensors
    for module in [safetensors] + list(sys.modules.values()):
        if getattr(module, "safe_open", None) == _hook.safe_open:
            module.safe_open = _hook.stock_open
    atexit.unregister(_hook.flush_progress)
    _hook = None


def release(phase: str = "load") -> dict:
    """Free what the load held and return the memory figures (see loader.hook.Hook.release)."""
    if _hook is None:
        raise RuntimeError("rankfs hook is not active: call loader.activate() first")
    return _hook.release(phase)


def _power_of_two(n: int) -> int:
    return 1 << max(0, n.bit_length() - 1)
