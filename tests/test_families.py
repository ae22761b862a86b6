"""Model families beyond DeepSeek-V4: tiny models saved by transformers, mounted for every rank."""

from __future__ import annotations

import re

import pytest
import torch

from dev.bench.engine_like import MoELayout, expert_counts, load, shard_files
from conftest import mounted, rankfs
from dev.fixtures import hf
from rankfs.plan.checkpoint import Checkpoint
from rankfs.plan.layout import plan_rank
from rankfs.plan.spec import RankSpec
from rankfs.plan.profiles import BY_NAME

# Written independently of rankfs' profiles: (expert regex, draft test)
NAMES = {
    "qwen3-moe": (r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.", lambda n: False),
    "mixtral": (r"^model\.layers\.\d+\.block_sparse_moe\.experts\.(\d+)\.", lambda n: False),
    "deepseek-v3": (r"^model\.layers\.\d+\.mlp\.experts\.(\d+)\.", lambda n: n.startswith("model.layers.2.")),
}
EXPERTS = {"qwen3-moe": 8, "mixtral": 4, "deepseek-v3": 8}


@pytest.fixture(scope="module", params=hf.FAMILIES)
def family(request, tmp_path_factory):
    return request.param, hf.write(request.param, tmp_path_factory.mktemp(request.param) / "model")


def names_in(directory) -> set[str]:
    from safetensors import safe_open
    names = set()
    for path in shard_files(directory):
        with safe_open(path, "pt") as f:
            names.update(f.keys())
    return names


def raw(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.mount
@pytest.mark.parametrize("tp_size,ep_size", [(2, 2), (4, 1)])
def test_every_rank_holds_its_tensors_bitwise(family, mount_dir, tp_size, ep_size):
    name, checkpoint = family
    profile = BY_NAME[name]
    expert_re, is_draft = NAMES[name]
    counts = expert_counts(shard_files(checkpoint), profile)
    all_names = names_in(checkpoint)
    moe_tp = tp_size // ep_size
    with mounted(checkpoint, mount_dir, "--tp-size", tp_size, "--ep-size", ep_size, "--local-ranks", "all"):
        for rank in range(tp_size):
            layout = MoELayout(moe_tp, rank % moe_tp, ep_size, rank // moe_tp)
            per_rank = EXPERTS[name] // ep_size
            ep_rank = rank // moe_tp
            for view in ("target", "draft"):
                expected = {n for n in all_names if is_draft(n) == (view == "draft") and not (
                    (m := re.match(expert_re, n)) and not ep_rank * per_rank <= int(m[1]) < (ep_rank + 1) * per_rank)}
                directory = mount_dir / f"rank-{rank}" / view
                if not expected:
                    assert not directory.exists()
                    continue
                assert names_in(directory) == expected
                got = load(directory, profile, layout, counts=counts)
                want = {n: t for n, t in load(checkpoint, profile, layout, counts=counts).items() if n in expected}
                assert sorted(got) == sorted(want)
                for tensor in want:
                    assert torch.equal(raw(got[tensor]), raw(want[tensor])), tensor
                del got


@pytest.mark.mount
def test_full_view_loads_with_from_pretrained(family, mount_dir):
    from transformers import AutoModelForCausalLM
    name, checkpoint = family
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    with mounted(checkpoint, mount_dir, "--tp-size", 1, "--tp-rank", 0):
        loaded = AutoModelForCausalLM.from_pretrained(mount_dir / "target")
        want, got = reference.state_dict(), loaded.state_dict()
        assert sorted(got) == sorted(want)
        for tensor in want:
            assert torch.equal(raw(got[tensor]), raw(want[tensor])), tensor
        del loaded, got


def test_plan_names_the_family(family):
    name, checkpoint = family
    result = rankfs("plan", checkpoint, "--tp-size", 4, "--ep-size", 2)
    assert f"profile {name}" in result.stdout


def test_unknown_model_gets_every_tensor_whole_with_a_warning(tmp_path):
    checkpoint = hf.write("mixtral", tmp_path / "model")
    config = (checkpoint / "config.json").read_text()
    (checkpoint / "config.json").write_text(config.replace('"mixtral"', '"somethingnew"')
                                            .replace("MixtralForCausalLM", "SomethingNewForCausalLM"))
    result = rankfs("plan", checkpoint, "--tp-size", 4, "--ep-size", 2, "--rank", 3)
    assert "no model profile matches" in result.stderr and "profile generic" in result.stdout
    layout = plan_rank(Checkpoint.open(checkpoint), RankSpec(4, 3, 2))
    total = sum(h.file_size - h.data_start for h in Checkpoint.open(checkpoint).shards)
    assert layout.view("target").summary()["kept_bytes"] == total


def test_vllm_placement_for_uneven_expert_counts(tmp_path):
    checkpoint = Checkpoint.open(hf.write("mixtral", tmp_path / "model"))  # 4 experts over 3 EP ranks
    owned = []
    for rank in range(3):
        layout = plan_rank(checkpoint, RankSpec(3, rank, 3, placement="vllm"))
        names = {t for f in layout.view("target").files for t in f.tensor_names}
        owned.append(sorted({int(m[1]) for n in names if (m := re.search(r"experts\.(\d+)\.", n))}))
    assert owned == [[0, 1], [2], [3]]
