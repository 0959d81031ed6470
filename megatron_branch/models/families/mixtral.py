"""Mixtral (MixtralForCausalLM): Llama's attention, num_local_experts, every layer MoE, the top-k always
renormalised (MixtralTopKRouter); router_jitter_noise > 0 (random) and sliding_window are refused. Its experts sit
under block_sparse_moe as w1 / w3 / w2."""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.families.hf_fields import common_fields, default_rope
from megatron_branch.models.families.param_rules import MIXTRAL_RULES
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields(
        "mixtral", d, where
    )  # intermediate_size: every layer MoE, this is the expert width
    if d.get("sliding_window") is not None:
        raise UserError(f"sliding_window={d['sliding_window']} is not supported", where=where)
    if float(d.get("router_jitter_noise") or 0.0) > 0:
        raise UserError(
            f"router_jitter_noise={d['router_jitter_noise']} (random input noise) cannot be reproduced exactly",
            where=where,
        )
    fields.update(
        num_experts=int(d["num_local_experts"]),
        moe_top_k=int(d["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(d["intermediate_size"]),
        moe_norm_topk_prob=True,  # MixtralTopKRouter always renormalises the top-k
    )
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    return transformers.MixtralConfig(
        rope_parameters=default_rope(arch),
        num_local_experts=arch.num_experts,
        num_experts_per_tok=arch.moe_top_k,
        router_jitter_noise=0.0,
        output_router_logits=False,
        **{**common, "intermediate_size": arch.moe_ffn_hidden_size},
    )


def tiny_hf_config(common: dict[str, Any], *, moe: dict[str, Any] | None = None, **_: Any) -> Any:
    """4 experts of width `ffn` (intermediate_size), top-2."""
    import transformers

    experts = {"num_experts_per_tok": 2, "num_local_experts": 4, **(moe or {})}
    return transformers.MixtralConfig(architectures=["MixtralForCausalLM"], **experts, **common)


MIXTRAL = register_family(
    FamilySpec(
        name="mixtral",
        architectures=("MixtralForCausalLM",),
        model_types=("mixtral",),
        export_class="MixtralForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=MIXTRAL_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "moe"),
        moe=True,
    )
)
