"""Multi-latent attention (DeepSeek-V2/V3, Kimi-K2: transformers' DeepseekV3Attention) on megatron-core's
MLASelfAttention (transformer/multi_latent_attention.py, MLATransformerConfig), checked against what Hugging Face
computes. The family that reads it from a config: models/families/deepseek_v3.py.

Shape legend: s tokens, n heads, h hidden, d qk_nope_head_dim (ModelArch.head_dim), r qk_rope_head_dim,
dv v_head_dim, cq q_lora_rank, ckv kv_lora_rank.

    q        = W_qb . rmsnorm(W_qa . x)   [s, n (d + r)]   (q_lora_rank None: W_q . x)
    c_kv|k_r = W_kva . x                  [s, ckv + r]     c_kv normed (kv_a_layernorm), k_r one head for all
    k|v      = W_kvb . c_kv               [s, n (d + dv)]  per head [k_nope (d); v (dv)]
    q_r, k_r rotate: DeepSeek's interleaved pairs, de-interleaved first (HF rope_interleave=True; megatron's
             _apply_rotary_pos_emb_bshd with multi_latent_attention), then rotate-half over r dims
    key      = [k_nope | k_r] per head; softmax scale 1 / sqrt(d + r); out = W_o . attn [s, n dv]

The core attention sees per-head q/k [s, b, n, d + r] and v [s, b, n, dv] (kv_channels = dv: megatron's
DotProductAttention sizes its output by it). The prefix cache of a replayed segment holds the compressed latent
instead, c_kv + k_r (ckv + r values per token and layer, not n (d + r + dv)): the layer is megatron's
MLASelfAttention subclassed to hand the latent down and decompress its ancestors' in each chunk
(models/mla_latent.py); under the ring (CP) and in the sampler's decode cache it hands down per-head K/V.
"""

from __future__ import annotations

from typing import Any

MLA_NORM_EPS = 1e-6
"""transformers' DeepseekV3Attention builds q_a_layernorm / kv_a_layernorm with RMSNorm's default eps 1e-6 (not
the config's rms_norm_eps); megatron's use layernorm_epsilon: the two agree only where rms_norm_eps is 1e-6."""


def check_mla(arch: Any) -> None:  # arch: a models/arch.ModelArch (arch.py calls this, one direction)
    """Refuse MLA widths megatron would not compute as HF does (ValueError, one line)."""
    if arch.qk_rope_head_dim <= 0 or arch.qk_rope_head_dim % 2:
        raise ValueError(f"qk_rope_head_dim must be positive and even, got {arch.qk_rope_head_dim}")
    if arch.v_head_dim <= 0 or (arch.q_lora_rank is not None and arch.q_lora_rank <= 0):
        raise ValueError(
            f"v_head_dim={arch.v_head_dim}, q_lora_rank={arch.q_lora_rank}: need positive widths"
        )
    if arch.num_query_groups != arch.num_attention_heads:
        raise ValueError(
            f"num_key_value_heads={arch.num_query_groups} with multi-latent attention: every head has its own "
            f"key/value (num_key_value_heads must equal num_attention_heads={arch.num_attention_heads})"
        )
    if arch.rms_norm_eps != MLA_NORM_EPS:
        raise ValueError(
            f"rms_norm_eps={arch.rms_norm_eps}: HF's MLA latent norms use 1e-6 whatever the config says, "
            "megatron's the config's"
        )
    if arch.rotary_percent != 1.0 or arch.qkv_bias or arch.qk_norm or arch.attention_output_gate:
        raise ValueError("multi-latent attention has no partial rotary, q/k/v bias, q/k norm or output gate")


def mla_config(arch: Any, kwargs: dict[str, Any]) -> Any:
    """megatron's MLATransformerConfig for `arch` from the TransformerConfig fields `kwargs` (ModelArch's)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    return MLATransformerConfig(
        **{
            **kwargs,
            # the stock core attention (megatron's DotProductAttention, the naive baseline) sizes its output
            # n x kv_channels: the value width; MLA itself reads its own widths below, never kv_channels
            "kv_channels": arch.v_head_dim,
            "multi_latent_attention": True,
            "q_lora_rank": arch.q_lora_rank,
            "kv_lora_rank": arch.kv_lora_rank,
            "qk_head_dim": arch.head_dim,
            "qk_pos_emb_head_dim": arch.qk_rope_head_dim,
            "v_head_dim": arch.v_head_dim,
            # plain RoPE (scaled RoPE is refused by the family); rotary_scaling_factor 1 makes megatron's yarn
            # mscale 1, so the softmax scale is 1 / sqrt(d + r) as in HF without rope scaling
            "rope_type": "rope",
            "rotary_base": arch.rope_theta,
            "rotary_percent": 1.0,
            "rotary_scaling_factor": 1.0,
        }
    )


MLA_KEYS_MAP = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
"""The local MLA spec's checkpoint names -> the TransformerEngine MLA spec's (its latent norms fused into the up
projections, get_gpt_layer_with_transformer_engine_spec), so one dist checkpoint loads under both specs, as
megatron's local GPT spec does for its norms (its MLA branch has no such map)."""


def mla_layer_spec(norm: type) -> Any:
    """megatron's local MLA layer spec (get_gpt_layer_local_spec(multi_latent_attention=True)) with `norm` in its
    norm slots and the checkpoint names of MLA_KEYS_MAP (the caller plugs in the core attention and layer class)."""
    import copy

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = copy.deepcopy(
        get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True, multi_latent_attention=True)
    )
    spec.submodules.input_layernorm = norm
    spec.submodules.pre_mlp_layernorm = norm
    spec.submodules.self_attention.submodules.q_layernorm = norm
    spec.submodules.self_attention.submodules.kv_layernorm = norm
    spec.submodules.sharded_state_dict_keys_map = dict(MLA_KEYS_MAP)
    # the down projections replicated on every TP rank (megatron's Linear, which MLASelfAttention accepts: the
    # TE spec's "duplicated" TELinear), not the local spec's ColumnParallelLinear: with that, megatron gathers
    # [c_kv | k_rope] and splits it, and the gather's backward keeps each rank's own columns of the gradient;
    # k_rope's gradient is a PARTIAL sum (each rank's heads), so the other ranks' parts would be dropped (measured:
    # 5% off HF at TP2+SP). Replicated, k_rope is gathered from the sequence-parallel region, whose backward is a
    # reduce-scatter: the parts summed. (TP without SP is not reached: the family is a MoE, and a MoE at TP > 1
    # needs sequence parallelism, rules/; there k_rope's gradient would stay this rank's part.)
    from megatron.core.post_training.modelopt.layers import Linear

    # megatron's MLASelfAttention whose forward, under the schedules' chunks, hands down the compressed latent
    # instead of per-head K/V (models/mla_latent.py)
    from megatron_branch.models.mla_latent import BranchMLASelfAttention

    spec.submodules.self_attention.module = BranchMLASelfAttention
    attention = spec.submodules.self_attention.submodules
    attention.linear_q_down_proj = Linear
    attention.linear_kv_down_proj = Linear
    return spec
