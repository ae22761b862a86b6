"""The engines' weight-loading entry points, wrapped so that each load is one rankfs load: it begins
when the entry point is entered, before any file is opened, and is released when it returns, before
the engine sizes its KV pool.

    SGLang  sglang.srt.model_loader.loader               DefaultModelLoader.load_weights_and_postprocess
    vLLM    vllm.model_executor.model_loader.default_loader  DefaultModelLoader.load_weights

Both are wrapped on the class, when their module is imported, so subclasses and every caller (the
target and the draft model runners, weight reloading) get the wrapper. Nested entries (an entry
point calling another) are one load. Standard library only.
"""

from __future__ import annotations

import functools

from rankfs.loader import routing
from rankfs.loader.imports import when_imported

ENTRY_POINTS = (
    ("sglang.srt.model_loader.loader", "DefaultModelLoader", "load_weights_and_postprocess"),
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader", "load_weights"),
)


def as_load(function):
    """`function`, run as one rankfs load."""
    if getattr(function, "_rankfs_load", False):
        return function

    @functools.wraps(function)
    def load(*args, **kwargs):
        routing.begin_load()
        try:
            result = function(*args, **kwargs)
        except BaseException:
            routing.end_load(failed=True)
            raise
        routing.end_load(failed=False)
        return result
    load._rankfs_load = True
    return load


def wrap_method(cls, name: str):
    routing.engine_delimits_loads()
    raw = cls.__dict__.get(name)
    if isinstance(raw, staticmethod):
        setattr(cls, name, staticmethod(as_load(raw.__func__)))
    elif isinstance(raw, classmethod):
        setattr(cls, name, classmethod(as_load(raw.__func__)))
    elif callable(raw):
        setattr(cls, name, as_load(raw))


def watch():
    """Wrap each entry point once its module is imported."""
    for module_name, class_name, method in ENTRY_POINTS:
        def wrap(module, class_name=class_name, method=method):
            cls = getattr(module, class_name, None)
            if cls is not None:
                wrap_method(cls, method)
        when_imported(module_name, wrap)
