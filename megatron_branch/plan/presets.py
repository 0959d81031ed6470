"""The planner's model presets, written from the published `config.json` of each model (no download): the fields
that decide memory and FLOPs, as ModelArch. `megatron-branch plan --model NAME` (plan/model.py load_model) reads
them; a config.json path plans any other model of a registered family.
"""

from __future__ import annotations

from megatron_branch.models.arch import ModelArch

MODEL_PRESETS: dict[str, ModelArch] = {
    # Qwen/Qwen2.5-7B config.json
    "qwen2.5-7b": ModelArch(
        family="qwen2",
        vocab_size=152064,
        hidden_size=3584,
        num_layers=28,
        num_attention_heads=28,
        num_query_groups=4,
        ffn_hidden_size=18944,
        rope_theta=1e6,
        qkv_bias=True,
        max_position_embeddings=131072,
    ),
    # meta-llama/Llama-3.1-8B config.json
    "llama-3.1-8b": ModelArch(
        family="llama",
        vocab_size=128256,
        hidden_size=4096,
        num_layers=32,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        rope_theta=5e5,
        max_position_embeddings=131072,
    ),
    # Qwen/Qwen3-30B-A3B config.json: 48 MoE layers of 128 experts (width 768), top-8, norm_topk_prob
    "qwen3-30b-a3b": ModelArch(
        family="qwen3_moe",
        vocab_size=151936,
        hidden_size=2048,
        num_layers=48,
        num_attention_heads=32,
        num_query_groups=4,
        head_dim=128,
        ffn_hidden_size=6144,
        rope_theta=1e6,
        qk_norm=True,
        max_position_embeddings=40960,
        num_experts=128,
        moe_top_k=8,
        moe_ffn_hidden_size=768,
        moe_norm_topk_prob=True,
    ),
    # Qwen/Qwen2.5-32B config.json
    "qwen2.5-32b": ModelArch(
        family="qwen2",
        vocab_size=152064,
        hidden_size=5120,
        num_layers=64,
        num_attention_heads=40,
        num_query_groups=8,
        ffn_hidden_size=27648,
        rope_theta=1e6,
        qkv_bias=True,
        max_position_embeddings=131072,
    ),
    # Qwen/Qwen2.5-72B config.json (a 70B-class policy: 80 layers, hidden 8192, GQA 64 / 8 heads, FFN 29568)
    "qwen2.5-72b": ModelArch(
        family="qwen2",
        vocab_size=152064,
        hidden_size=8192,
        num_layers=80,
        num_attention_heads=64,
        num_query_groups=8,
        ffn_hidden_size=29568,
        rope_theta=1e6,
        qkv_bias=True,
        max_position_embeddings=131072,
    ),
}

# The config.json fields of the published checkpoints, mapped by the same code as any HF folder
# (models/families/): Qwen/Qwen3-8B and Qwen/Qwen3-32B config.json; Qwen/Qwen3.6-27B config.json's
# text_config (revision 6a9e13bd; model card: hidden 5120, 64 layers = 16 x (3 x (Gated DeltaNet -> FFN) + 1 x
# (Gated Attention -> FFN)), GDN 16 QK / 48 V heads of 128, attention 24 Q / 4 KV heads of 256, RoPE dim 64, FFN
# 17408, vocabulary 248320). The multimodal checkpoint's vision tower and MTP head are not part of the policy.
_QWEN3 = dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936, head_dim=128,
              max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000, tie_word_embeddings=False,
              hidden_act="silu", attention_bias=False)  # fmt: skip
_QWEN3_6_27B_TEXT = dict(
    model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], vocab_size=248320, hidden_size=5120,
    intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 16,
    full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=48, attn_output_gate=True, output_gate_type="swish",
    max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    attention_bias=False, partial_rotary_factor=0.25,
    rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                     "rope_theta": 10000000, "rope_type": "default"},
)  # fmt: skip
MODEL_PRESETS.update(
    {
        "qwen3-8b": ModelArch.from_hf_config(
            dict(_QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                 num_key_value_heads=8), where="preset qwen3-8b"
        ),
        "qwen3-32b": ModelArch.from_hf_config(
            dict(_QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8), where="preset qwen3-32b"
        ),
        "qwen3.6-27b": ModelArch.from_hf_config(_QWEN3_6_27B_TEXT, where="preset qwen3.6-27b"),
    }
)  # fmt: skip
# Qwen/Qwen3.5-35B-A3B config.json's text_config (revision ec2d4ece; model card: hidden 2048, 40 layers = 10 x (3 x (Gated DeltaNet
# -> MoE) + 1 x (Gated Attention -> MoE)), GDN 16 QK / 32 V heads of 128, attention 16 Q / 2 KV heads of 256, RoPE
# dim 64, 256 experts of width 512, 8 routed + 1 shared, vocabulary 248320); Qwen3.6-35B-A3B has the same text
# config. The published file has no intermediate_size: no layer has a dense MLP.
_QWEN3_5_35B_A3B_TEXT = dict(
    model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], vocab_size=248320, hidden_size=2048,
    num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 10,
    full_attention_interval=4, linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_num_key_heads=16, linear_num_value_heads=32, attn_output_gate=True, max_position_embeddings=262144,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
    partial_rotary_factor=0.25, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
    shared_expert_intermediate_size=512, router_aux_loss_coef=0.001,
    rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                     "rope_theta": 10000000, "rope_type": "default"},
)  # fmt: skip
MODEL_PRESETS["qwen3.5-35b-a3b"] = ModelArch.from_hf_config(
    _QWEN3_5_35B_A3B_TEXT, where="preset qwen3.5-35b-a3b"
)


# GLM-4.5-Air (zai-org/GLM-4.5-Air, 106B total / 12B active): transformers' Glm4MoeConfig defaults are this
# "GLM-4-MOE-100B-A10B style configuration" (configuration_glm4_moe.py: hidden 4096, 46 layers of which the first
# dense (first_k_dense_replace 1, intermediate 10944), 96 query / 8 KV heads, 128 routed experts of width 1408, top-8,
# one shared expert, one group, norm_topk_prob, partial_rotary_factor 0.5, context 131072, vocabulary 151552,
# rms_norm_eps 1e-5); the published config.json sets head_dim 128 (4096 / 96 is not whole) and attention_bias true
# (accelerate's glm4_moe Megatron parser: add_qkv_bias; use_qk_norm "false for glm4.5-air"). rope_theta is left at
# transformers' default: it changes neither memory nor FLOPs. Its MTP layer is not part of the policy.
# (tests/unit/test_glm4_moe.py checks these numbers against transformers' defaults.)
GLM4_5_AIR_CONFIG = dict(
    model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"], vocab_size=151552, hidden_size=4096,
    intermediate_size=10944, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
    max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
    attention_bias=True, use_qk_norm=False, moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1,
    n_routed_experts=128, routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1,
    norm_topk_prob=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
)  # fmt: skip
MODEL_PRESETS["glm-4.5-air"] = ModelArch.from_hf_config(GLM4_5_AIR_CONFIG, where="preset glm-4.5-air")


# openai/gpt-oss-20b and openai/gpt-oss-120b config.json: 24 / 36 layers alternating sliding (window 128) and full
# attention, starting with sliding; hidden 2880, 64 query / 8 KV heads of 64, every layer a MoE of 32 / 128 experts
# of width 2880, top-4, with biases (router, experts, q/k/v, o_proj) and learned sinks; YaRN (factor 32 over 4096
# positions) to 131072: it changes only the rotary tables, neither memory nor FLOPs.
_GPT_OSS = dict(
    model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=201088, hidden_size=2880,
    intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
    num_experts_per_tok=4, max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
    attention_bias=True, swiglu_limit=7.0, hidden_act="silu", router_aux_loss_coef=0.9,
    rope_parameters={"rope_type": "yarn", "rope_theta": 150000, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
)  # fmt: skip
MODEL_PRESETS.update(
    {
        f"gpt-oss-{size}": ModelArch.from_hf_config(
            dict(_GPT_OSS, num_hidden_layers=layers, num_local_experts=experts,
                 layer_types=["sliding_attention", "full_attention"] * (layers // 2)),
            where=f"preset gpt-oss-{size}",
        )
        for size, layers, experts in (("20b", 24, 32), ("120b", 36, 128))
    }
)  # fmt: skip


# DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; DeepSeek-R1 has the same shape): 61 layers, hidden 7168, 128
# heads of multi-latent attention (q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128), the
# first 3 layers dense (intermediate 18432), then 256 routed experts of width 2048 + 1 shared, top-8 within 4 of 8
# groups, sigmoid scores x 2.5, vocabulary 129280, context 163840. Kimi-K2 (moonshotai/Kimi-K2-Instruct config.json:
# model_type "kimi_k2", architectures DeepseekV3ForCausalLM, the same code): 64 heads, 384 routed experts + 1 shared,
# top-8, one group, the first layer dense, x 2.827, vocabulary 163840, context 131072. Their rope_scaling (yarn) is
# dropped here as load_model drops it (it changes neither memory nor FLOPs; the engine refuses it for training); their
# MTP layer (num_nextn_predict_layers) is not part of the policy and not priced.
_DEEPSEEK_V3_CLASS = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], hidden_size=7168, intermediate_size=18432,
    moe_intermediate_size=2048, num_hidden_layers=61, n_shared_experts=1, num_experts_per_tok=8, kv_lora_rank=512,
    q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, norm_topk_prob=True,
    rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False, attention_bias=False, rope_interleave=True,
)  # fmt: skip
DEEPSEEK_V3_CONFIG = dict(
    _DEEPSEEK_V3_CLASS, vocab_size=129280, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
    n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5, max_position_embeddings=163840,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip
KIMI_K2_CONFIG = dict(
    _DEEPSEEK_V3_CLASS, vocab_size=163840, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
    n_group=1, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.827, max_position_embeddings=131072,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
)  # fmt: skip
MODEL_PRESETS["deepseek-v3"] = ModelArch.from_hf_config(DEEPSEEK_V3_CONFIG, where="preset deepseek-v3")
MODEL_PRESETS["kimi-k2"] = ModelArch.from_hf_config(KIMI_K2_CONFIG, where="preset kimi-k2")


# NVIDIA Nemotron 3 Nano 30B-A3B (nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 config.json; model card and technical
# report, arXiv 2512.20848: 31.6B total / 3.2B active parameters, 52 layers = 23 Mamba-2 + 23 MoE + 6 GQA): hidden
# 2688, hybrid_override_pattern below, attention 32 query / 2 KV heads of 128 without positional encoding, Mamba-2 64
# heads of 64 in 8 groups, state 128, conv 4, chunk 128, 128 routed experts of width 1856 (squared ReLU, ungated),
# top-6 by sigmoid scores with the correction bias, one group, x 2.5, one shared expert of width 3712, vocabulary
# 131072 untied, context 262144 (max_position_embeddings; the card's 1M needs its long-context setting).
# intermediate_size (1856) is no layer's: every MLP layer is an "E". Its MTP head, where present, is not priced.
NEMOTRON_3_NANO_CONFIG = dict(
    model_type="nemotron_h", architectures=["NemotronHForCausalLM"], vocab_size=131072, hidden_size=2688,
    num_hidden_layers=52, hybrid_override_pattern="MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    num_attention_heads=32, num_key_value_heads=2, head_dim=128, intermediate_size=1856, mlp_hidden_act="relu2",
    mamba_num_heads=64, mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4, chunk_size=128,
    use_conv_bias=True, mamba_hidden_act="silu", time_step_min=0.001, n_routed_experts=128, num_experts_per_tok=6,
    moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, n_group=1, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.5, layer_norm_epsilon=1e-5, max_position_embeddings=262144,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, use_bias=False, mamba_proj_bias=False,
)  # fmt: skip
MODEL_PRESETS["nemotron-3-nano-30b-a3b"] = ModelArch.from_hf_config(
    NEMOTRON_3_NANO_CONFIG, where="preset nemotron-3-nano-30b-a3b"
)
