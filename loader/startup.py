"""What `rankfs run` installs in every Python process of the engine (through the boot directory's
sitecustomize), and vLLM in each of its processes (the `vllm.general_plugins` entry point,
`install_plugin`): post-import hooks that route safetensors' safe_open through the hook and wrap
the engines' weight loading. Nothing else happens until a rankfs file is opened: no torch, no
thread, no CUDA. Standard library only."""

from __future__ import annotations

import sys

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


def install_plugin():
    """vLLM's general plugin: what `rankfs run` installs, in a vLLM process started without it
    (`VLLM_PLUGINS` and RANKFS_HOOK=off turn it off). vLLM has imported its modules by then: those
    that bound safetensors' safe_open are routed too. Installing twice (under `rankfs run`) changes
    nothing."""
    install()
    if routing.dormant_settings() is not None:
        for module in list(sys.modules.values()):
            routing.install(module)
