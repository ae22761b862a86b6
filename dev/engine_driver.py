"""Loads checkpoints with SGLang's or vLLM's real DefaultModelLoader on the CPU, the way the engines
drive it, into a tiny model whose `load_weights` narrows experts the FusedMoE way; run by
tests/test_engines.py and `python3 -m dev gpu-load --engine`, under `rankfs run` or not.

    python3 -m dev.engine_driver sglang|vllm JOBS_JSON

JOBS_JSON: [{"directory", "model": the original checkpoint (its headers give the parameters' shapes,
as the engine's config does), "phase": "target"|"draft", "layout": MoELayout fields, "counts":
{expert group: experts}, "device": "cpu" (default) or "cuda", "uncache": [files to drop from the
page cache first]}, ...], loaded in order in this one process. ENGINE_DRIVER_STAGE_ON=host: the hook stages as
it does on a GPU (bounce buffers into device slabs), host memory standing in for the GPU's.
ENGINE_DRIVER_PLUGINS=1: vLLM's general plugins are loaded first, as vLLM's processes do.
Prints one JSON line per load: the parameters' digests, the seconds it took, the releases the hook
had made when the load returned (with their figures), whether the garbage collector ran inside the
load and after it, the process's threads, and on a GPU what CUDA's allocator holds once it returned
against the parameters' bytes.
"""

from __future__ import annotations

import gc
import importlib.abc
import importlib.machinery
import json
import os
import sys
import threading
import time
import types

import torch

from dev.bench.engine_like import MoELayout, allocate, digest, narrowed, shard_files
from dev.memstate import uncache
from rankfs.plan.profiles import BY_NAME

PROFILE = BY_NAME["deepseek-v4"]


class TinyMoE(torch.nn.Module):
    """Stands in for the engine's model class: built with its parameters (on `device`, shaped from
    the headers of the checkpoint `model`, before the load, as the engines build theirs), it
    consumes the weights iterator and copies each tensor it owns, narrowed as FusedMoE narrows,
    into its parameter."""

    def __init__(self, phase: str, layout: MoELayout, counts: dict, model: str, device: str = "cpu"):
        super().__init__()
        self.phase, self.layout, self.counts, self.device = phase, layout, counts, device
        self.weights = allocate(shard_files(model), PROFILE, layout, counts, keep=self.owns, device=device)

    def owns(self, name: str) -> bool:
        """The target skips the draft's tensors; the draft takes only those."""
        return name.startswith("mtp.") == (self.phase == "draft")

    def load_weights(self, weights):
        for name, tensor in weights:
            if not self.owns(name):
                continue
            source = narrowed(name, tensor, PROFILE, self.layout, self.counts)
            if source is not None:
                self.weights[name].copy_(source)
        self.collector_in_load = gc.isenabled()
        return None


def stand_in_for_torchvision():
    """sglang.srt.model_loader.loader imports torchvision at module level and never calls it on this
    path; the registry's torchvision is built for a CUDA torch and fails to import beside a CPU one:
    where it does, an import-only stand-in takes its place."""
    try:
        import torchvision  # noqa: F401
        return
    except Exception:
        pass
    import transformers  # noqa: F401  first: it decides once that torchvision is absent
    vision = types.ModuleType("torchvision")
    vision.transforms = types.ModuleType("torchvision.transforms")
    vision.transforms.functional = types.ModuleType("torchvision.transforms.functional")
    vision.transforms.InterpolationMode = vision.transforms.functional.InterpolationMode = type(
        "InterpolationMode", (), {"BICUBIC": "bicubic", "BILINEAR": "bilinear"})
    sys.modules.update({"torchvision": vision, "torchvision.transforms": vision.transforms,
                        "torchvision.transforms.functional": vision.transforms.functional})


class _StandIn:
    """A name of a module that is not installed: its attributes are stand-ins too; called, it says so."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attribute: str):
        if attribute.startswith("__"):
            raise AttributeError(attribute)
        return _StandIn(f"{self._name}.{attribute}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is a stand-in: sgl_kernel is not installed")


class _StandInKernels(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """sgl_kernel and its submodules as import-only stand-ins (`_StandIn` names)."""

    def find_spec(self, name, path, target=None):
        if name == "sgl_kernel" or name.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []
        module.__getattr__ = lambda attribute: _StandIn(f"{spec.name}.{attribute}") \
            if not attribute.startswith("__") else (_ for _ in ()).throw(AttributeError(attribute))
        return module

    def exec_module(self, module):
        pass


def stand_in_for_sgl_kernel():
    """With CUDA, SGLang's quantization modules import sgl_kernel's CUDA kernels at module level,
    which its loader never calls on this path; where the package is not installed, stand-ins."""
    try:
        import sgl_kernel  # noqa: F401
    except ImportError:
        sys.meta_path.insert(0, _StandInKernels())


def sglang():
    stand_in_for_torchvision()
    if torch.cuda.is_available():
        stand_in_for_sgl_kernel()
    from sglang.srt import runtime_context
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.server_args import ServerArgs
    published = []

    def load(directory: str, model, is_draft: bool, device: torch.device):
        server_args = ServerArgs(model_path=directory, device=device.type, skip_tokenizer_init=True)
        if not published:
            runtime_context.publish(server_args, role="scheduler")
            published.append(True)
        model_config = ModelConfig.from_server_args(server_args, model_path=directory, is_draft_model=is_draft)
        loader = DefaultModelLoader(LoadConfig())
        # As DefaultModelLoader.load_model does: the weights are a generator, opened inside the call.
        loader.load_weights_and_postprocess(model, loader._get_all_weights(model_config, model), device)
    return load


def vllm(directories: list[str]):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.get("ENGINE_DRIVER_PLUGINS"):  # as each vLLM process does at its start
        from vllm.plugins import load_general_plugins
        load_general_plugins()
    from vllm.config import LoadConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    # vLLM builds every model config (target and draft) before it loads any.
    configs = {d: ModelConfig(model=d, tokenizer=d, skip_tokenizer_init=True) for d in directories}

    def load(directory: str, model, is_draft: bool, device: torch.device):
        load_config = LoadConfig()
        with set_current_vllm_config(VllmConfig(model_config=configs[directory], load_config=load_config)):
            DefaultModelLoader(load_config).load_weights(model, configs[directory])
    return load


RELEASE_FIGURES = ("pinned", "pinned_bytes", "peak_slab_bytes", "peak_host_bytes", "peak_device_bytes", "slabs",
                   "slab_requests", "windows", "staged_on", "cuda_reserved", "nvml_process", "release_seconds",
                   "source_direct_bytes", "source_cached_bytes", "cores", "budget_bytes", "read_threads",
                   "copy_threads")


def cuda_figures(model: TinyMoE) -> dict | None:
    """What CUDA's allocator holds once a load returned, against the parameters the model keeps."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    torch.cuda.synchronize()
    return {"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated(),
            "parameters": sum(t.numel() * t.element_size() for t in model.weights.values() if t.is_cuda)}


def main(engine: str, jobs: list[dict]):
    load = sglang() if engine == "sglang" else vllm(sorted({job["directory"] for job in jobs}))
    if os.environ.get("ENGINE_DRIVER_STAGE_ON") == "host":
        from dev.host_staging import host_staging
        from rankfs.loader import staging
        staging.stage_on = host_staging
    for job in jobs:
        device = job.get("device", "cpu")
        uncache(job.get("uncache", []))
        model = TinyMoE(job["phase"], MoELayout(**job["layout"]), job["counts"], job["model"], device)
        began = time.monotonic()
        load(job["directory"], model, job["phase"] == "draft", torch.device(device))
        seconds = time.monotonic() - began
        import rankfs.loader
        hook = rankfs.loader.current()
        print(json.dumps({"directory": job["directory"], "phase": job["phase"], "seconds": seconds,
                          "digests": {n: digest(t) for n, t in sorted(model.weights.items())},
                          "releases": [r["phase"] for r in hook.releases] if hook else [],
                          "slabs_alive": [r["slabs_alive"] for r in hook.releases] if hook else [],
                          "release_figures": [{k: r[k] for k in RELEASE_FIGURES} for r in hook.releases]
                          if hook else [],
                          "cuda": cuda_figures(model),
                          "collector_in_load": model.collector_in_load, "collector_after": gc.isenabled(),
                          "threads": threading.active_count()}), flush=True)
        del model


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
