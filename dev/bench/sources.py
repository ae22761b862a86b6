"""Where the benchmark's loads get their tensors: (name, tensor) iterators in the forms the engines
use as load formats, each feeding the same engine-like copies (engine_like.copy_weights).

    stock            SGLang's buffered iterator over safe_open (mmap): engine_like.iterate
    ep-filter        the same, with vLLM's EP weight filter (--enable-ep-weight-filter): its own
                     should_skip_weight leaves other EP ranks' expert weights unread (scales are read)
    staged           tensors already read into page-locked memory before the clock: reading is free,
                     what is left is the engine's own narrowing and copying (the engine ceiling)
    instanttensor    instanttensor.safe_open over all files at once, into CUDA, as SGLang's
                     instanttensor_weights_iterator uses it; with a tensor filter and a backend
    fastsafetensors  fastsafe_open over the files (whole files into device memory), as SGLang's
    runai            runai-model-streamer's SafetensorsStreamer (whole files into host memory)
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from safetensors import safe_open

from dev.bench.engine_like import iterate
from rankfs.common.disk import anonymous_map


def stock(files: list[str]):
    return iterate(files)


def ep_filtered(files: list[str], n_experts: int, ep_size: int, ep_rank: int):
    """Stock with vLLM's EP weight filter: its own module, loaded alone (vLLM's package import takes
    seconds and starts work of its own that would share the load's cores and disk)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None:
        raise RuntimeError("the ep-filter row runs vLLM's own weight filter: vLLM is not installed")
    path = Path(spec.submodule_search_locations[0]) / "model_executor" / "model_loader" / "ep_weight_filter.py"
    module_spec = importlib.util.spec_from_file_location("vllm_ep_weight_filter", path)
    vllm_filter = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(vllm_filter)
    local = vllm_filter.compute_local_expert_ids(n_experts, ep_size, ep_rank)
    return iterate(files, skip=lambda name: vllm_filter.should_skip_weight(name, local))


class Staged:
    """The tensors `names` of `files`, read into one page-locked buffer in the loaders' order."""

    def __init__(self, files: list[str], names: set[str], pin: bool):
        entries = []
        for path in files:
            with safe_open(path, framework="pt") as f:
                entries += [(name, f.get_tensor(name)) for name in sorted(f.keys()) if name in names]
        total = sum(t.numel() * t.element_size() for _, t in entries)
        self._map = anonymous_map(max(total, 1))
        buffer = torch.frombuffer(self._map, dtype=torch.uint8)
        if pin:
            error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), total, 0)
            assert int(error) == 0, f"cudaHostRegister failed: {error}"
        self.tensors, offset = [], 0
        for name, tensor in entries:
            nbytes = tensor.numel() * tensor.element_size()
            staged = buffer[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape)
            staged.copy_(tensor)
            self.tensors.append((name, staged))
            offset += nbytes

    def __iter__(self):
        return iter(self.tensors)


def instanttensor(files: list[str], device: str, backend: str | None, names: set[str] | None):
    import instanttensor as it
    backends = None if backend is None else [it._impl.parse_backend(backend)]
    with it.safe_open(sorted(files), framework="pt", device=torch.device(device), copy=True, backend=backends,
                      tensor_filter=sorted(names) if names is not None else None,
                      tensor_name_match_mode="exact") as f:
        yield from f.tensors()


def fastsafetensors(files: list[str], device: str):
    from fastsafetensors import fastsafe_open
    with fastsafe_open(filenames=sorted(files), nogds=True, device=device) as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def runai(files: list[str]):
    from runai_model_streamer import SafetensorsStreamer
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(sorted(files))
        yield from streamer.get_tensors()
