"""Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention + num_experts / num_experts_per_tok /
moe_intermediate_size / norm_topk_prob (HF default false); layer i is MoE unless i is in mlp_only_layers or
(i + 1) % decoder_sparse_step != 0 (HF's rule), dense layers use intermediate_size."""

from __future__ import annotations

from typing import Any

from megatron_branch.models.families.hf_fields import (
    TINY_EXPERTS,
    common_fields,
    default_rope,
    qwen3_attention,
    qwen_experts,
    qwen_experts_hf,
)
from megatron_branch.models.families.param_rules import QWEN_MOE_RULES
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields("qwen3_moe", d, where)
    qwen3_attention("qwen3_moe", d, fields, where)
    qwen_experts(d, fields, where)
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    return transformers.Qwen3MoeConfig(
        attention_bias=False, rope_parameters=default_rope(arch), **qwen_experts_hf(arch), **common
    )


def tiny_hf_config(
    common: dict[str, Any], *, head_dim: int | None = None, moe: dict[str, Any] | None = None, **_: Any
) -> Any:
    """4 experts of width 16, top-2, norm_topk_prob; head_dim 16."""
    import transformers

    experts = {**TINY_EXPERTS, "norm_topk_prob": True, **(moe or {})}
    return transformers.Qwen3MoeConfig(
        architectures=["Qwen3MoeForCausalLM"], head_dim=head_dim or 16, **experts, **common
    )


QWEN3_MOE = register_family(
    FamilySpec(
        name="qwen3_moe",
        architectures=("Qwen3MoeForCausalLM",),
        model_types=("qwen3_moe",),
        export_class="Qwen3MoeForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=QWEN_MOE_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "mlp", "moe"),
        moe=True,
        train_defaults={"qk_norm": True},
    )
)
