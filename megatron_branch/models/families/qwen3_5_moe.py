"""Qwen3.5-MoE / Qwen3.6-MoE text models (Qwen3_5MoeForCausalLM, or the multimodal
Qwen3_5MoeForConditionalGeneration: `text_config`): the qwen3_5 hybrid with a MoE block in EVERY layer
(transformers' Qwen3_5MoeDecoderLayer builds no dense MLP, so mlp_only_layers / decoder_sparse_step mean nothing),
the top-k always renormalised (its router has no norm_topk_prob switch), a shared expert with its sigmoid gate.
The published checkpoints store each layer's experts as two 3-D tensors (checkpoint/hf_io.py reads them per
expert)."""

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
from megatron_branch.models.families.param_rules import CONTAINER_TEXT_PREFIXES, QWEN3_5_MOE_RULES
from megatron_branch.models.families.qwen3_5 import HYBRID_DEFAULTS
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields("qwen3_5_moe", d, where, ffn_key="moe_intermediate_size")  # no dense MLP anywhere
    hybrid_layers(d, fields, where)
    qwen_experts(d, fields, where, every_layer=True, norm_topk_prob=True, shared_expert=True)
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    hybrid = hybrid_hf(arch, common)
    del hybrid["intermediate_size"]  # no dense MLP in any layer
    return Qwen3_5MoeTextConfig(**qwen_experts_hf(arch, every_layer=True, shared_expert=True), **hybrid)


def tiny_hf_config(
    common: dict[str, Any],
    *,
    head_dim: int | None = None,
    layer_types: Any = None,
    moe: dict[str, Any] | None = None,
    **_: Any,
) -> Any:
    """qwen3_5's tiny layers, every one with qwen2_moe's tiny experts; no dense MLP."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    kw = tiny_hybrid(common, head_dim=head_dim, layer_types=layer_types)
    del kw["intermediate_size"]
    experts = {**TINY_EXPERTS_SHARED, **(moe or {})}
    return Qwen3_5MoeTextConfig(architectures=["Qwen3_5MoeForCausalLM"], **experts, **kw)


QWEN3_5_MOE = register_family(
    FamilySpec(
        name="qwen3_5_moe",
        architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
        model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
        export_class="Qwen3_5MoeForCausalLM",  # the text model
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=QWEN3_5_MOE_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("gated_attention", "gdn", "moe", "shared_expert"),
        moe=True,
        text_config_container=True,
        hf_text_prefixes=CONTAINER_TEXT_PREFIXES,
        hf_not_converted=("model.visual.", "mtp."),
        train_defaults=HYBRID_DEFAULTS,
    )
)
