"""What `rankfs run` installs in every Python process of the engine (through the boot directory's
sitecustomize): post-import hooks that route safetensors' safe_open through the hook and wrap the
engines' weight loading. Nothing else happens until a rankfs file is opened: no torch, no thread,
no CUDA. Standard library only."""

from __future__ import annotations

from rankfs.loader import engines, routing
from rankfs.loader.imports import when_imported
from rankfs.loader.settings import HookSettings


def install():
    settings = HookSettings.from_env()
    if settings.mode == "off":
        return
    routing.activate_dormant(settings)
    for name in ("safetensors", "safetensors.torch"):
        when_imported(name, routing.install)
    engines.watch()
