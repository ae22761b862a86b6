"""Model families as data: which tensors are routed experts, how engines narrow them, which belong to
the draft model, and which are only served on demand.

To add a family, append a `Profile` to `PROFILES`; nothing else in rankfs names a model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple


class ExpertName(NamedTuple):
    group: str  # the MoE block the expert belongs to, e.g. "layers.3.ffn"
    expert: int
    projection: str  # e.g. "w1", "down_proj"


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    # Chosen when config.json's model_type or one of its architectures is listed here.
    model_types: tuple[str, ...] = ()
    architectures: tuple[str, ...] = ()
    # Routed experts: a regex with named groups `group`, `expert` and `projection`.
    expert_pattern: str | None = None
    # FusedMoE's narrowing: projection -> the dim split by the MoE TP size (weights and scales alike).
    narrow_dims: Mapping[str, int] = field(default_factory=dict)
    # Config keys holding the routed-expert count (top level or under text_config).
    expert_count_keys: tuple[str, ...] = ()
    # Draft (speculative) tensors: by name, or by decoder-layer index at or above a config value.
    draft_pattern: str | None = None
    draft_layer_pattern: str | None = None  # regex with a named group `layer`
    draft_layer_key: str | None = None
    # Tensors the engine serves from disk itself (row stores): declared, read only on demand.
    on_demand_pattern: str | None = None

    def __post_init__(self):
        for attr in ("expert_pattern", "draft_pattern", "draft_layer_pattern", "on_demand_pattern"):
            value = getattr(self, attr)
            object.__setattr__(self, f"_{attr}_re", re.compile(value) if value else None)

    def expert(self, name: str) -> ExpertName | None:
        match = self._expert_pattern_re and self._expert_pattern_re.search(name)
        if not match:
            return None
        return ExpertName(match["group"], int(match["expert"]), match["projection"])

    def is_draft(self, name: str, config: Mapping) -> bool:
        if self._draft_pattern_re and self._draft_pattern_re.search(name):
            return True
        if self._draft_layer_pattern_re:
            match = self._draft_layer_pattern_re.search(name)
            first = config_value(config, self.draft_layer_key)
            return bool(match) and isinstance(first, int) and int(match["layer"]) >= first
        return False

    def is_on_demand(self, name: str) -> bool:
        return bool(self._on_demand_pattern_re and self._on_demand_pattern_re.search(name))

    def expert_count(self, config: Mapping) -> int | None:
        for key in self.expert_count_keys:
            value = config_value(config, key)
            if isinstance(value, int) and value > 0:
                return value
        return None


def config_value(config: Mapping, key: str | None):
    """A config value at the top level or nested under text_config (DeepSeek-V4.1, multimodal)."""
    if key is None:
        return None
    if key in config:
        return config[key]
    nested = config.get("text_config")
    return nested.get(key) if isinstance(nested, Mapping) else None


_HF_PROJECTIONS = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}
_W123 = {"w1": 0, "w3": 0, "w2": 1}


def _experts(group: str, projections: str) -> str:
    """The pattern of routed-expert names GROUP.experts.E.PROJECTION.*"""
    return rf"^(?P<group>{group})\.experts\.(?P<expert>\d+)\.(?P<projection>{projections})\."


# Hugging Face naming of routed experts under model.layers.L.mlp (DeepSeek-V3, Qwen-MoE).
_HF_MLP_EXPERTS = _experts(r"model\.layers\.\d+\.mlp", "gate_proj|up_proj|down_proj")

PROFILES: tuple[Profile, ...] = (
    Profile(
        name="deepseek-v4",
        description="DeepSeek-V4-class, checkpoint naming (layers.L.ffn.experts.E.w1), "
                    "mtp.* draft stages, Engram row-store tables on demand",
        model_types=("deepseek_v4",),
        architectures=("DeepseekV4ForCausalLM",),
        expert_pattern=_experts(r"(?:layers|mtp)\.\d+\.ffn", "w[123]"),
        narrow_dims=_W123,
        expert_count_keys=("n_routed_experts",),
        draft_pattern=r"^mtp\.",
        on_demand_pattern=r"\.engram\.embed\.",
    ),
    Profile(
        name="deepseek-v3",
        description="DeepSeek-V3/R1, Hugging Face naming, FP8 with weight_scale_inv block scales, "
                    "MTP layers (index >= num_hidden_layers) as the draft",
        model_types=("deepseek_v3", "deepseek_v2", "kimi_k2"),
        architectures=("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
        expert_pattern=_HF_MLP_EXPERTS,
        narrow_dims=_HF_PROJECTIONS,
        expert_count_keys=("n_routed_experts",),
        draft_layer_pattern=r"^model\.layers\.(?P<layer>\d+)\.",
        draft_layer_key="num_hidden_layers",
    ),
    Profile(
        name="qwen3-moe",
        description="Qwen3-MoE (and Qwen2-MoE), Hugging Face naming",
        model_types=("qwen3_moe", "qwen2_moe"),
        architectures=("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"),
        expert_pattern=_HF_MLP_EXPERTS,
        narrow_dims=_HF_PROJECTIONS,
        expert_count_keys=("num_experts",),
    ),
    Profile(
        name="mixtral",
        description="Mixtral, Hugging Face naming (block_sparse_moe.experts.E.w1)",
        model_types=("mixtral",),
        architectures=("MixtralForCausalLM",),
        expert_pattern=_experts(r"model\.layers\.\d+\.block_sparse_moe", "w[123]"),
        narrow_dims=_W123,
        expert_count_keys=("num_local_experts",),
    ),
)

# An unknown model: every tensor whole, in the target view; nothing is left out.
GENERIC = Profile(name="generic", description="unknown model: every tensor kept whole")

BY_NAME = {p.name: p for p in PROFILES + (GENERIC,)}


def detect(config: Mapping) -> Profile:
    """The profile for a config.json, or GENERIC when no family claims it."""
    model_type = config.get("model_type")
    nested = config.get("text_config")
    nested_type = nested.get("model_type") if isinstance(nested, Mapping) else None
    architectures = set(config.get("architectures") or ())
    for profile in PROFILES:
        if ({model_type, nested_type} & set(profile.model_types)
                or architectures & set(profile.architectures)):
            return profile
    return GENERIC
