"""Qwen3 (Qwen3ForCausalLM): RMSNorm on each head's q and k (megatron's qk_layernorm), head_dim free (HF default
128); attention_bias (which biases o_proj too) and sliding windows are refused."""

from __future__ import annotations

from typing import Any

from megatron_branch.models.families.hf_fields import common_fields, default_rope, qwen3_attention
from megatron_branch.models.families.param_rules import DECODER_RULES
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields("qwen3", d, where)
    qwen3_attention("qwen3", d, fields, where)
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    return transformers.Qwen3Config(attention_bias=False, rope_parameters=default_rope(arch), **common)


def tiny_hf_config(common: dict[str, Any], *, head_dim: int | None = None, **_: Any) -> Any:
    """head_dim 16 by default: with hidden 32 and 4 heads, not hidden / heads."""
    import transformers

    return transformers.Qwen3Config(architectures=["Qwen3ForCausalLM"], head_dim=head_dim or 16, **common)


QWEN3 = register_family(
    FamilySpec(
        name="qwen3",
        architectures=("Qwen3ForCausalLM",),
        model_types=("qwen3",),
        export_class="Qwen3ForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=DECODER_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "mlp"),
        train_defaults={"qk_norm": True},
    )
)
