"""Post-import hooks: run a function on a module right after it is first imported (or at once, if
it already is), without importing it. Standard library only.

A finder at the front of sys.meta_path answers for the watched names only: it asks the other finders
for the real spec and wraps its loader, so the module is loaded as it would be and handed to the
hook right after its code has run."""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Callable

_hooks: dict[str, list[Callable]] = {}
_lock = threading.Lock()


class _AfterExec(importlib.abc.Loader):
    def __init__(self, loader, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        with _lock:
            hooks = _hooks.pop(self._name, [])
        for hook in hooks:
            hook(module)

    def __getattr__(self, name):  # is_package, get_code, get_resource_reader, ...
        return getattr(self._loader, name)


class _Watcher(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _hooks:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _AfterExec(spec.loader, name)
                return spec
        return None


_watcher = _Watcher()


def when_imported(name: str, hook: Callable):
    """hook(module) once `name` is imported: now if it is, else right after its import."""
    module = sys.modules.get(name)
    if module is not None:
        hook(module)
        return
    with _lock:
        _hooks.setdefault(name, []).append(hook)
        if _watcher not in sys.meta_path:
            sys.meta_path.insert(0, _watcher)
