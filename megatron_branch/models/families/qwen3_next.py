"""Qwen3-Next (Qwen3NextForCausalLM): the qwen3_5 hybrid's layers (gated attention, zero-centred norms, partial
RoPE; text only, no multimodal RoPE) with the gated delta net's projections stored fused per key head
(in_proj_qkvz, in_proj_ba: checkpoint/layouts.py), MoE layers as qwen3_moe's rule decides (decoder_sparse_step,
mlp_only_layers, norm_topk_prob with HF's default true) plus the gated shared expert. Its MTP head is not part of
the policy."""

from __future__ import annotations

from typing import Any

from megatron_branch.models.families.hf_fields import (
    TINY_EXPERTS_SHARED,
    common_fields,
    hybrid_hf,
    hybrid_layers,
    qwen_experts,
    qwen_experts_hf,
    tiny_hybrid,
)
from megatron_branch.models.families.param_rules import QWEN3_NEXT_RULES
from megatron_branch.models.families.qwen3_5 import HYBRID_DEFAULTS
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields("qwen3_next", d, where)
    hybrid_layers(d, fields, where)
    qwen_experts(d, fields, where, norm_topk_default=True, shared_expert=True)
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    hybrid = hybrid_hf(arch, common, mrope=False)
    return transformers.Qwen3NextConfig(**qwen_experts_hf(arch, shared_expert=True), **hybrid)


def tiny_hf_config(
    common: dict[str, Any],
    *,
    head_dim: int | None = None,
    layer_types: Any = None,
    moe: dict[str, Any] | None = None,
    **_: Any,
) -> Any:
    """qwen3_5_moe's tiny model with text-only RoPE and renormalised top-k; MoE layers by decoder_sparse_step /
    mlp_only_layers (`moe`)."""
    import transformers

    kw = tiny_hybrid(common, head_dim=head_dim, layer_types=layer_types, mrope=False)
    experts = {
        **TINY_EXPERTS_SHARED,
        "norm_topk_prob": True,
        **(moe or {}),
    }
    return transformers.Qwen3NextConfig(architectures=["Qwen3NextForCausalLM"], **experts, **kw)


QWEN3_NEXT = register_family(
    FamilySpec(
        name="qwen3_next",
        architectures=("Qwen3NextForCausalLM",),
        model_types=("qwen3_next",),
        export_class="Qwen3NextForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=QWEN3_NEXT_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("gated_attention", "gdn", "mlp", "moe", "shared_expert"),
        moe=True,
        hf_not_converted=("mtp.",),
        train_defaults=HYBRID_DEFAULTS,
    )
)
