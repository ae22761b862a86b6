"""Third-party loaders over real mounts: vLLM's weight iterators."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import expected_view, mounted
from dev.fixtures import deepseek_v4

pytestmark = pytest.mark.mount

SPEC = deepseek_v4.FixtureSpec.tiny()


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def originals(checkpoint) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        with safe_open(checkpoint / file, "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


@pytest.fixture(scope="module")
def vllm_weight_utils():
    # Installed by .ci/install without its GPU dependencies; a missing vLLM is a failure, not a skip.
    import importlib
    return importlib.import_module("vllm.model_executor.model_loader.weight_utils")


@pytest.mark.parametrize("view", ["target", "draft"])
def test_vllm_iterators_yield_exactly_the_view(tiny_checkpoint, mount_dir, vllm_weight_utils, view):
    source = originals(tiny_checkpoint)
    expected = expected_view(source, SPEC.experts, SPEC.draft_experts, 2, 1, view)
    with mounted(tiny_checkpoint, mount_dir, "--tp-size", 2, "--tp-rank", 1, "--ep-size", 2):
        files = sorted(str(p) for p in (mount_dir / view).glob("*.safetensors"))
        for iterator in (vllm_weight_utils.safetensors_weights_iterator(files, False),
                         vllm_weight_utils.multi_thread_safetensors_weights_iterator(files, False)):
            got = dict(iterator)
            assert set(got) == expected
            for name, tensor in got.items():
                assert torch.equal(raw(tensor), raw(source[name])), name
            del got, tensor  # mapped views of the mount: let it unmount cleanly


# transformers' from_pretrained over a full view: tests/test_families.py, for every family.
