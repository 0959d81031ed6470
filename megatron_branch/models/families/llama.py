"""Llama (LlamaForCausalLM): the plain decoder (RMSNorm, SwiGLU, RoPE, GQA).

attention_bias (which also biases o_proj) is refused."""

from __future__ import annotations

from typing import Any

from megatron_branch.models.families.hf_fields import common_fields, default_rope
from megatron_branch.models.families.param_rules import DECODER_RULES
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    return common_fields("llama", d, where)


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    return transformers.LlamaConfig(attention_bias=False, rope_parameters=default_rope(arch), **common)


def tiny_hf_config(common: dict[str, Any], **_: Any) -> Any:
    import transformers

    return transformers.LlamaConfig(architectures=["LlamaForCausalLM"], **common)


LLAMA = register_family(
    FamilySpec(
        name="llama",
        architectures=("LlamaForCausalLM",),
        model_types=("llama",),
        export_class="LlamaForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=DECODER_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "mlp"),
    )
)
