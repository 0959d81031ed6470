"""Qwen3.5 / Qwen3.6 text models (Qwen3_5ForCausalLM, or the multimodal Qwen3_5ForConditionalGeneration whose text
model is `text_config`: the published checkpoints; transformers' AutoModelForCausalLM builds the text model of
either): per layer a gated delta net (megatron's GatedDeltaNet) or gated full attention (attention_output_gate, q/k
norms, partial RoPE), zero-centred RMSNorm weights (megatron's layernorm_zero_centered_gamma): hf_fields.py
`hybrid_layers`. The vision tower and the MTP head are not part of the policy (not converted, as transformers'
Qwen3_5ForCausalLM drops them on load)."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

from megatron_branch.models.families.hf_fields import common_fields, hybrid_hf, hybrid_layers, tiny_hybrid
from megatron_branch.models.families.param_rules import CONTAINER_TEXT_PREFIXES, HYBRID_RULES
from megatron_branch.models.families.registry import FamilySpec, register_family

HYBRID_DEFAULTS = MappingProxyType(
    {"qk_norm": True, "zero_centered_norm": True, "attention_output_gate": True}
)
"""A config-defined hybrid's defaults (the Qwen3.5 family's layers)."""


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields("qwen3_5", d, where)
    hybrid_layers(d, fields, where)
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(**hybrid_hf(arch, common))


def tiny_hf_config(
    common: dict[str, Any], *, head_dim: int | None = None, layer_types: Any = None, **_: Any
) -> Any:
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    kw = tiny_hybrid(common, head_dim=head_dim, layer_types=layer_types)
    return Qwen3_5TextConfig(architectures=["Qwen3_5ForCausalLM"], **kw)


QWEN3_5 = register_family(
    FamilySpec(
        name="qwen3_5",
        architectures=("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"),
        model_types=("qwen3_5", "qwen3_5_text"),
        export_class="Qwen3_5ForCausalLM",  # the text model: no vision tower, no MTP head
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=HYBRID_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("gated_attention", "gdn", "mlp"),
        text_config_container=True,
        hf_text_prefixes=CONTAINER_TEXT_PREFIXES,
        hf_not_converted=("model.visual.", "mtp."),
        train_defaults=HYBRID_DEFAULTS,
    )
)
