"""Which files the hook takes, and when a load begins and ends.

`safe_open` here stands in for safetensors' own: a file on a rankfs mount goes to the hook, every
other call to the stock function. The hook itself (torch, read threads, CUDA) is created when the
first rankfs file is opened; until then a call costs a stat.

A load begins when an engine's weight loading is entered (rankfs.loader.engines) and ends when it
returns; the rankfs files opened in between belong to it, and it is released once, at its end.
Programs without such an entry point call `release()` themselves.

Standard library only, and light: every Python process of the engine imports it at start-up.
"""

from __future__ import annotations

import os
import sys
import threading

from rankfs.common import contract
from rankfs.loader.settings import HookSettings

_lock = threading.RLock()
_settings: HookSettings | None = None
_stock = None  # safetensors' safe_open
_hook = None  # the Hook, once a rankfs file has been opened
_rankfs_devices: set[int] = set()
_other_devices: set[int] = set()  # block devices seen not to be rankfs (anonymous ones may become so)
_depth = 0  # engine loads entered and not yet returned
_engine_delimited = False  # an engine's entry point is wrapped here: its calls are the loads
_load_start: dict | None = None


def on_rankfs(path) -> bool:
    try:
        device = os.stat(path).st_dev
    except (OSError, TypeError, ValueError):
        return False
    if device in _rankfs_devices:
        return True
    if device in _other_devices:
        return False
    _rankfs_devices.update(contract.rankfs_devices())
    if device in _rankfs_devices:
        return True
    if os.major(device) != 0:
        _other_devices.add(device)
    return False


def safe_open(filename, framework="pt", device="cpu", **kwargs):
    """safetensors.safe_open, with files on a rankfs mount loaded through the hook."""
    if _settings is not None and on_rankfs(filename):
        return current(create=True).safe_open(filename, framework, device, **kwargs)
    return _stock(filename, framework=framework, device=device, **kwargs)


def current(create: bool = False):
    """The hook, or None before the first rankfs file (or after `deactivate`)."""
    global _hook
    if _hook is None and create:
        with _lock:
            if _hook is None:
                from rankfs.loader.hook import Hook
                _hook = Hook(_settings, _stock, _load_start, outside_engine_load)
    return _hook


def install(module):
    """Route a module's `safe_open` through the hook, if it is the stock one (safetensors and
    safetensors.torch, and modules that bound it with `from safetensors import safe_open`)."""
    global _stock
    stock = getattr(module, "safe_open", None)
    if stock is None or stock is safe_open:
        return
    if _stock is None and module.__name__ == "safetensors":
        _stock = stock
    if stock is _stock:
        module.safe_open = safe_open


def activate(mode: str | None = None):
    """Route safetensors' safe_open on rankfs views through the hook, in safetensors and in every
    module that has bound it. mode: on, observe or off (default: RANKFS_HOOK, else on)."""
    global _settings
    settings = HookSettings.from_env(mode)
    if settings.mode == "off":
        return
    import safetensors
    with _lock:
        _settings = settings
        install(safetensors)
        for module in list(sys.modules.values()):
            install(module)


def activate_dormant(settings: HookSettings):
    """For start-up: settings now, the routing once safetensors is imported (rankfs.loader.startup)."""
    global _settings
    _settings = settings


def dormant_settings() -> HookSettings | None:
    """The settings installed (None: the hook is off or not installed)."""
    return _settings


def deactivate():
    """Put the stock safe_open back and forget the hook (its memory must have been released)."""
    global _settings, _hook
    with _lock:
        for module in list(sys.modules.values()):
            if getattr(module, "safe_open", None) is safe_open and module is not sys.modules[__name__]:
                module.safe_open = _stock
        _settings, _hook = None, None


def engine_delimits_loads():
    """An engine's weight-loading entry point was wrapped in this process (rankfs.loader.engines)."""
    global _engine_delimited
    _engine_delimited = True


def outside_engine_load() -> bool:
    """A rankfs file opened where an engine delimits the loads but none is under way (a look at a
    shard's header, say): no release may follow soon, so nothing that only a release undoes
    begins for it."""
    return _engine_delimited and _depth == 0


def begin_load():
    global _depth, _load_start
    with _lock:
        _depth += 1
        if _load_start is None:  # the figures are against the first load's start (the target's)
            from rankfs.loader import memory
            _load_start = memory.snapshot()


def end_load(failed: bool):
    """The engine's weight loading returned: release what the load held, once."""
    global _depth
    with _lock:
        _depth -= 1
        if _depth or _hook is None or not _hook.load_views:
            return
    try:
        _hook.release()
    except Exception:
        if not failed:
            raise
        import logging
        logging.getLogger("rankfs.hook").exception("rankfs hook: the release after a failed load failed too")


def release(phase: str | None = None) -> dict:
    """Free what the current load held and return the memory figures (rankfs.loader.hook.Hook.release).
    The phase defaults to the views the load read (target or draft)."""
    hook = current()
    if hook is None:
        raise RuntimeError("rankfs hook: no rankfs file has been loaded through the hook")
    return hook.release(phase)
