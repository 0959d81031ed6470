"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM, transformers' `glm4_moe`): grouped-query attention with partial RoPE
(rope_parameters.partial_rotary_factor, HF default 0.5: the first half of each head's dims rotate, rotate-half
layout), a bias on q/k/v (attention_bias; o_proj has none), RMSNorm over each head's q and k when use_qk_norm;
the first `first_k_dense_replace` layers a dense SwiGLU of intermediate_size, every later layer the DeepSeek-style
MoE block (Glm4MoeMoE):

    scores  = sigmoid(x . W_gate)                       float32 in HF (and in megatron: moe_utils.py)
    choice  = top-k of scores + e_score_correction_bias  within the topk_group best of n_group groups (a group's
                                                          rank: the sum of its top-2 biased scores)
    weights = scores at the choice (the bias NOT added), / their sum when norm_topk_prob, x routed_scaling_factor
    out     = sum_k weights_k expert_k(x) + shared_experts(x)   (n_shared_experts x moe_intermediate_size, ungated)

megatron-core computes exactly this with moe_router_score_function="sigmoid", moe_router_enable_expert_bias (the
bias held fixed: models/moe.py), moe_router_num_groups / moe_router_group_topk (megatron ranks a group by its top
k // topk_group scores: equal to HF's top-2 where that quotient is 2, else refused: models/router_settings.py), and
moe_router_topk_scaling_factor. The multi-token-prediction layers (num_nextn_predict_layers) are not part of the
policy: transformers' Glm4MoeForCausalLM does not build them, and a checkpoint that stores them is refused by the
parameter map (they sit at model.layers.{num_hidden_layers}); export writes num_nextn_predict_layers 0.
"""

from __future__ import annotations

from typing import Any

from megatron_branch.models.families.hf_fields import (
    common_fields,
    deepseek_experts,
    deepseek_experts_hf,
    rope_of,
)
from megatron_branch.models.families.param_rules import GLM4_MOE_RULES
from megatron_branch.models.families.registry import FamilySpec, register_family

PARTIAL_ROTARY_DEFAULT = 0.5
"""transformers' Glm4MoeConfig default partial_rotary_factor (its __post_init__)."""


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields("glm4_moe", d, where, qkv_bias=True)
    rope, _ = rope_of(d, where)
    fields.update(
        head_dim=fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"],
        qkv_bias=bool(d.get("attention_bias", False)),
        qk_norm=bool(d.get("use_qk_norm", False)),
        rotary_percent=float(
            rope.get("partial_rotary_factor", d.get("partial_rotary_factor", PARTIAL_ROTARY_DEFAULT))
        ),
    )
    deepseek_experts("glm4_moe", d, fields, where)
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    rope = {
        "rope_type": "default",
        "rope_theta": arch.rope_theta,
        "partial_rotary_factor": arch.rotary_percent,
    }
    return transformers.Glm4MoeConfig(
        rope_parameters=rope,
        attention_bias=arch.qkv_bias,
        use_qk_norm=arch.qk_norm,
        **deepseek_experts_hf(arch),
        **common,
    )


TINY_GLM_EXPERTS = dict(
    n_routed_experts=12,
    moe_intermediate_size=16,
    num_experts_per_tok=4,
    n_group=3,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=1.5,
    first_k_dense_replace=1,
    norm_topk_prob=True,
)
"""The tiny GLM MoE: 12 experts of width 16 in 3 groups of 4, top-4 within the best 2 groups (the group limit
binds: 8 of 12 experts eligible), one shared expert, weights scaled by 1.5, layer 0 dense."""


def tiny_hf_config(
    common: dict[str, Any], *, head_dim: int | None = None, moe: dict[str, Any] | None = None, **_: Any
) -> Any:
    """TINY_GLM_EXPERTS, q/k/v bias and q/k norms, head_dim 16 with half of it rotating (HF's default 0.5)."""
    import transformers

    kw = dict(
        common, rope_parameters=dict(common["rope_parameters"], partial_rotary_factor=PARTIAL_ROTARY_DEFAULT)
    )
    return transformers.Glm4MoeConfig(
        architectures=["Glm4MoeForCausalLM"],
        head_dim=head_dim or 16,
        attention_bias=True,
        use_qk_norm=True,
        num_nextn_predict_layers=0,
        **{**TINY_GLM_EXPERTS, **(moe or {})},
        **kw,
    )


GLM4_MOE = register_family(
    FamilySpec(
        name="glm4_moe",
        architectures=("Glm4MoeForCausalLM",),
        model_types=("glm4_moe",),
        export_class="Glm4MoeForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=GLM4_MOE_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "mlp", "moe", "shared_expert"),
        moe=True,
        train_defaults={
            "qkv_bias": True,
            "qk_norm": True,
            "moe_score_function": "sigmoid",
            "moe_expert_bias": True,
        },
    )
)
