"""Qwen2 (Qwen2ForCausalLM): Llama's layers with a bias on Q/K/V, always; use_sliding_window is refused."""

from __future__ import annotations

from typing import Any

from megatron_branch.models.families.hf_fields import common_fields, default_rope
from megatron_branch.models.families.param_rules import DECODER_RULES
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    return dict(common_fields("qwen2", d, where, qkv_bias=True), qkv_bias=True)


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    return transformers.Qwen2Config(rope_parameters=default_rope(arch), **common)


def tiny_hf_config(common: dict[str, Any], **_: Any) -> Any:
    import transformers

    return transformers.Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)


QWEN2 = register_family(
    FamilySpec(
        name="qwen2",
        architectures=("Qwen2ForCausalLM",),
        model_types=("qwen2",),
        export_class="Qwen2ForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=DECODER_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "mlp"),
        train_defaults={"qkv_bias": True},
    )
)
