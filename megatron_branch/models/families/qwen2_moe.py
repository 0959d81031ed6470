"""Qwen2-MoE (Qwen2MoeForCausalLM): Qwen2's attention (qkv_bias, default true) + experts as Qwen3-MoE's + the
shared expert (shared_expert_intermediate_size) with its sigmoid gate (megatron's SharedExpertMLP,
moe_shared_expert_gate)."""

from __future__ import annotations

from typing import Any

from megatron_branch.models.families.hf_fields import (
    TINY_EXPERTS_SHARED,
    common_fields,
    default_rope,
    qwen_experts,
    qwen_experts_hf,
)
from megatron_branch.models.families.param_rules import QWEN_MOE_RULES
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields("qwen2_moe", d, where, qkv_bias=True)
    fields["qkv_bias"] = bool(d.get("qkv_bias", True))
    qwen_experts(d, fields, where, shared_expert=True)
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    return transformers.Qwen2MoeConfig(
        rope_parameters=default_rope(arch),
        qkv_bias=arch.qkv_bias,
        **qwen_experts_hf(arch, shared_expert=True),
        **common,
    )


def tiny_hf_config(common: dict[str, Any], *, moe: dict[str, Any] | None = None, **_: Any) -> Any:
    """4 experts of width 16, top-2, no renormalisation, a shared expert of width 24."""
    import transformers

    experts = {
        **TINY_EXPERTS_SHARED,
        "norm_topk_prob": False,
        **(moe or {}),
    }
    return transformers.Qwen2MoeConfig(architectures=["Qwen2MoeForCausalLM"], **experts, **common)


QWEN2_MOE = register_family(
    FamilySpec(
        name="qwen2_moe",
        architectures=("Qwen2MoeForCausalLM",),
        model_types=("qwen2_moe",),
        export_class="Qwen2MoeForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=QWEN_MOE_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "mlp", "moe", "shared_expert"),
        moe=True,
        train_defaults={"qkv_bias": True},
    )
)
