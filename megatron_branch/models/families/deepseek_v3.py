"""DeepSeek-V3 / R1 and Kimi-K2 (DeepseekV3ForCausalLM, transformers' `deepseek_v3`): multi-latent attention
(MLA: queries through a q_lora_rank bottleneck or a plain q_proj when q_lora_rank is None, keys and values
decompressed per head from one kv_lora_rank latent, a decoupled RoPE part of qk_rope_head_dim dims whose key is
shared by all heads, rotated in DeepSeek's interleaved pairs; models/mla.py has the shapes and what megatron's
MLASelfAttention computes), the first `first_k_dense_replace` layers a dense SwiGLU of intermediate_size, every
later layer the DeepSeek MoE block (DeepseekV3MoE) that GLM-4.5 copies: sigmoid router with the correction bias in
the selection only, group-limited top-k, renormalised, x routed_scaling_factor, n_shared_experts ungated shared
experts (hf_fields.deepseek_experts, models/router_settings.py; glm4_moe.py's docstring has the formulas).

Refused in one line: rope scaling (the published DeepSeek-V3 / Kimi-K2 configs set yarn: not reproduced here),
rope_interleave=false (megatron's MLA rotates the interleaved layout only), attention_bias (a bias on q_a_proj /
kv_a_proj / o_proj the map does not carry), num_key_value_heads != num_attention_heads, rms_norm_eps other than
HF's latent-norm eps 1e-6 (models/mla.py). The multi-token-prediction layers (num_nextn_predict_layers) are not
part of the policy: transformers' DeepseekV3ForCausalLM does not build them, a checkpoint storing them (at
model.layers.{num_hidden_layers}) is refused by the parameter map; export writes num_nextn_predict_layers 0.
"""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.families.glm4_moe import TINY_GLM_EXPERTS
from megatron_branch.models.families.hf_fields import (
    common_fields,
    deepseek_experts,
    deepseek_experts_hf,
    default_rope,
)
from megatron_branch.models.families.param_rules import DEEPSEEK_MOE, EMBEDDING, HEAD, Rule
from megatron_branch.models.families.registry import FamilySpec, register_family


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    fields = common_fields("deepseek_v3", d, where)
    if d.get("rope_interleave", True) is not True:
        raise UserError(
            "rope_interleave=false: megatron's multi-latent attention rotates DeepSeek's interleaved pairs only",
            where=where,
        )
    q_lora = d.get("q_lora_rank")
    fields.update(
        head_dim=int(d["qk_nope_head_dim"]),  # HF's head_dim is qk_rope_head_dim (its RoPE table's width)
        kv_lora_rank=int(d["kv_lora_rank"]),
        q_lora_rank=None if q_lora is None else int(q_lora),
        qk_rope_head_dim=int(d["qk_rope_head_dim"]),
        v_head_dim=int(d["v_head_dim"]),
    )
    deepseek_experts("deepseek_v3", d, fields, where)
    return fields


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    common = {k: v for k, v in common.items() if k != "head_dim"}  # DeepseekV3Config derives its own
    return transformers.DeepseekV3Config(
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_nope_head_dim=arch.head_dim,
        qk_rope_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        rope_parameters=default_rope(arch),
        rope_interleave=True,
        attention_bias=False,
        **deepseek_experts_hf(arch),
        **common,
    )


TINY_MLA = dict(q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=12)
"""The tiny MLA: every width distinct (a swapped width fails a shape check), values wider than the q/k heads (10):
every attention path carries two head widths."""


def tiny_hf_config(
    common: dict[str, Any], *, moe: dict[str, Any] | None = None, mla: dict[str, Any] | None = None, **_: Any
) -> Any:
    """TINY_MLA (`mla` overrides it: q_lora_rank None for a plain q_proj) and glm4_moe's tiny DeepSeek-style MoE
    (12 experts in 3 groups, top-4 within 2, one shared expert, x 1.5, layer 0 dense); one key/value per head."""
    import transformers

    return transformers.DeepseekV3Config(
        architectures=["DeepseekV3ForCausalLM"],
        **{**TINY_MLA, **(mla or {})},
        rope_interleave=True,
        num_nextn_predict_layers=0,
        **{**TINY_GLM_EXPERTS, **(moe or {})},
        **dict(common, num_key_value_heads=common["num_attention_heads"]),
    )


_L = "model.layers.{i}.self_attn."
_M = "decoder.layers.{i}.self_attention."
MLA_RULES: tuple[Rule, ...] = (
    Rule(
        mcore="decoder.layers.{i}.input_layernorm.weight",
        hf=("model.layers.{i}.input_layernorm.weight",),
        transform="identity",
    ),
    Rule(
        mcore=_M + "linear_q_proj.weight", hf=(_L + "q_proj.weight",), transform="identity", when="no_q_lora"
    ),
    Rule(
        mcore=_M + "linear_q_down_proj.weight",
        hf=(_L + "q_a_proj.weight",),
        transform="identity",
        when="q_lora",
    ),
    Rule(
        mcore=_M + "q_layernorm.weight",
        hf=(_L + "q_a_layernorm.weight",),
        transform="identity",
        te=_M + "linear_q_up_proj.layer_norm_weight",
        when="q_lora",
    ),
    Rule(
        mcore=_M + "linear_q_up_proj.weight",
        hf=(_L + "q_b_proj.weight",),
        transform="identity",
        when="q_lora",
    ),
    Rule(
        mcore=_M + "linear_kv_down_proj.weight", hf=(_L + "kv_a_proj_with_mqa.weight",), transform="identity"
    ),
    Rule(
        mcore=_M + "kv_layernorm.weight",
        hf=(_L + "kv_a_layernorm.weight",),
        transform="identity",
        te=_M + "linear_kv_up_proj.layer_norm_weight",
    ),
    Rule(mcore=_M + "linear_kv_up_proj.weight", hf=(_L + "kv_b_proj.weight",), transform="identity"),
    Rule(mcore=_M + "linear_proj.weight", hf=(_L + "o_proj.weight",), transform="identity"),
)
"""MLA's tensors: megatron's local MLA spec names (te: the TransformerEngine spec's fused latent norms, also the
dist-checkpoint keys, models/mla.py MLA_KEYS_MAP), HF's DeepseekV3Attention names; each a plain copy (megatron and
HF lay out q_b_proj / kv_b_proj rows alike: per head [nope; rope] and [k_nope; v])."""

DEEPSEEK_V3 = register_family(
    FamilySpec(
        name="deepseek_v3",
        architectures=("DeepseekV3ForCausalLM",),
        model_types=("deepseek_v3",),
        export_class="DeepseekV3ForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=(EMBEDDING, *MLA_RULES, *DEEPSEEK_MOE, *HEAD),
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "mlp", "moe", "shared_expert"),
        moe=True,
        train_defaults={"moe_score_function": "sigmoid", "moe_expert_bias": True},
    )
)
