"""The rankfs engine hook.

    import rankfs.loader as hook
    hook.activate()           # route safetensors' safe_open on rankfs views through the hook
    ...                       # the program loads from a rankfs view
    figures = hook.release()  # free everything the load held; returns the memory figures

`rankfs run -- ENGINE ...` does this in every Python process of the engine without editing it, and
releases each SGLang or vLLM load when it returns (rankfs.loader.engines). Importing this package
imports nothing heavy: torch and the read threads come with the first rankfs file opened.
"""

from rankfs.loader.routing import activate, current, deactivate, release

__all__ = ["activate", "current", "deactivate", "release"]
