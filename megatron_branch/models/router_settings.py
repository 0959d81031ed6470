"""The MoE router's settings as megatron-core computes them: the softmax routers (Qwen, Mixtral) and the
DeepSeek-style sigmoid router (GLM-4.5 `glm4_moe`; DeepSeek-V3's is the same), checked against what Hugging Face
computes and mapped to megatron's TransformerConfig fields. Pure: no megatron import (models/arch.py validates
with it, models/moe.py builds the config from it).

The DeepSeek-style router (transformers' DeepseekV3TopkRouter / Glm4MoeTopkRouter; megatron's
moe_utils.topk_routing_with_score_function with score_function="sigmoid"):

    scores  = sigmoid(logits)                               float32 on both sides
    choice  = top-k of (scores + bias) within the topk_group best of n_group groups
    weights = scores at the choice (no bias) / (their sum + 1e-20) x routed_scaling_factor

Where megatron computes otherwise than HF the setting is refused (ValueError, one line; ModelArch re-raises it as a
UserError naming the config): a group's rank (HF: the sum of its top-2 biased scores; megatron: of its top
k // topk_group), the renormalisation (megatron: exactly when k > 1; HF: when norm_topk_prob).
"""

from __future__ import annotations

import math
from typing import Any

SCORE_FUNCTIONS = ("softmax", "sigmoid")
"""megatron's moe_router_score_function values."""


def check_router(arch: Any) -> None:  # arch: a models/arch.ModelArch (arch.py calls this, one direction)
    """Refuse router settings megatron would not compute as HF does (ValueError, one line)."""
    if arch.moe_score_function not in SCORE_FUNCTIONS:
        raise ValueError(f"moe_score_function must be softmax or sigmoid, not {arch.moe_score_function!r}")
    if arch.moe_expert_bias and arch.moe_score_function != "sigmoid":
        raise ValueError("an expert correction bias needs the sigmoid router (megatron's rule)")
    scale = arch.moe_routed_scaling_factor
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"routed_scaling_factor must be a positive number, got {scale}")
    k = arch.moe_top_k
    if arch.moe_score_function == "sigmoid" and arch.moe_norm_topk_prob != (k > 1):
        raise ValueError(
            f"norm_topk_prob={arch.moe_norm_topk_prob} with num_experts_per_tok={k}: megatron's sigmoid router "
            "renormalises the top-k exactly when num_experts_per_tok > 1"
        )
    g, gk, E = arch.moe_num_groups, arch.moe_group_topk, arch.num_experts
    if g < 1 or not 1 <= gk <= g or E % g:
        raise ValueError(
            f"n_group={g}, topk_group={gk}: need 1 <= topk_group <= n_group and n_group dividing num_experts={E}"
        )
    if g > 1 and (k // gk != 2 or E // g < 2):
        raise ValueError(
            f"n_group={g} with num_experts_per_tok={k}, topk_group={gk}: HF ranks groups by their top-2 scores, "
            "megatron by their top num_experts_per_tok // topk_group; they agree only where that is 2"
        )
    if g > 1 and gk * (E // g) < k:
        raise ValueError(f"topk_group={gk} groups hold fewer than num_experts_per_tok={k} experts")


def router_config_kwargs(arch: Any) -> dict[str, Any]:
    """megatron TransformerConfig fields of `arch`'s router (the routing itself; its losses: models/moe.py)."""
    grouped = arch.moe_num_groups > 1
    return dict(
        moe_router_topk=arch.moe_top_k,
        moe_router_pre_softmax=not arch.moe_norm_topk_prob and arch.moe_score_function == "softmax",
        moe_router_score_function=arch.moe_score_function,
        moe_router_enable_expert_bias=arch.moe_expert_bias,
        # the correction bias is a checkpoint tensor RL keeps fixed (HF's buffer): finalize_model_grads'
        # aux-loss-free update (megatron's _update_router_expert_bias) then adds sign(.) x 0
        moe_router_bias_update_rate=0.0,
        moe_router_num_groups=arch.moe_num_groups if grouped else None,
        moe_router_group_topk=arch.moe_group_topk if grouped else None,
        moe_router_topk_scaling_factor=(
            arch.moe_routed_scaling_factor if arch.moe_routed_scaling_factor != 1.0 else None
        ),
    )
