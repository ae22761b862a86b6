"""Mounting: the command line, the daemon's lifecycle, and the library (rankfs.mount.api).

The package is callable: `rankfs.mount(checkpoint, mountpoint, tp_size=..., ...)` is
rankfs.mount.api.mount. Standard library only here: importing rankfs imports this."""

import sys
import types


class _Package(types.ModuleType):
    def __call__(self, checkpoint, mountpoint, **options):
        from rankfs.mount.api import mount
        return mount(checkpoint, mountpoint, **options)


sys.modules[__name__].__class__ = _Package
