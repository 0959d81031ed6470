"""What the planner plans for: a model, a rollout shape, GPUs and a parallel layout (pure data).

Presets are written from the published `config.json` of each model (no download): the fields that decide
memory and FLOPs. Llama-3.1's rope scaling does not change either, so the planner ignores it (the engine itself
refuses it for training: models/arch.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.parallel.layout import ParallelLayout
from megatron_branch.rules import check_plannable

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


@dataclass(frozen=True, kw_only=True)
class GPU:
    """One accelerator as the planner sees it."""

    name: str
    """Preset name or "custom"."""
    memory_gb: float
    """Device memory in GB (1e9 bytes), as the vendor states it."""
    tflops: float
    """Peak dense bf16 TFLOP/s (no sparsity)."""
    link_gbps: float
    """Per-GPU interconnect bandwidth in GB/s (NVLink, one direction) used for ring, TP and DP traffic."""
    host_memory_gb: float = 1024
    """Host memory per node in GB (a stated assumption: DGX H100 / H200 ship 2 TB, H20 servers 1-2 TB)."""
    host_link_gbps: float = 25
    """Host<->GPU bandwidth per GPU in GB/s while all GPUs of the node copy at once (PCIe Gen5 x16, two GPUs per
    switch: an assumption), for the offloaded optimizer's gradients and parameters."""
    host_adam_gbps: float = 25
    """Host memory bandwidth one rank's CPU Adam gets, GB/s (a node's ~300 GB/s effective over 8 ranks)."""
    gpus_per_node: int = 8
    """GPUs per node (the host memory is shared by their ranks)."""
    node_link_gbps: float = 50
    """Per-GPU bandwidth between nodes in GB/s (one 400 Gb/s NIC per GPU, as 8-GPU H100 / H20 servers are built:
    an assumption), for a parallel group that spans nodes (plan/pipeline.py crosses_nodes)."""

    def __post_init__(self) -> None:
        for flag, value in (
            ("--gpu-memory-gb", self.memory_gb),
            ("--gpu-tflops", self.tflops),
            ("--link-gbps", self.link_gbps),
            ("--host-memory-gb", self.host_memory_gb),
            ("--host-link-gbps", self.host_link_gbps),
            ("--host-adam-gbps", self.host_adam_gbps),
            ("--gpus-per-node", self.gpus_per_node),
            ("--node-link-gbps", self.node_link_gbps),
        ):
            if value <= 0:
                raise UserError(f"{flag} must be positive, got {value}")

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)

    @property
    def host_memory_bytes(self) -> int:
        return int(self.host_memory_gb * 1e9)


GPU_PRESETS: dict[str, GPU] = {
    "h20": GPU(name="h20", memory_gb=96, tflops=148, link_gbps=900),
    "h100": GPU(name="h100", memory_gb=80, tflops=989, link_gbps=900),
    "h200": GPU(name="h200", memory_gb=141, tflops=989, link_gbps=900),
}


@dataclass(frozen=True, kw_only=True)
class RolloutShape:
    """A step's batch: `prompts` prompt groups, each a prompt of `prompt_length` tokens with `responses` responses
    of `response_length` tokens whose first `shared_response_length` tokens are the same in all of them.

    As a prefix tree (data/prefix_tree.py) each group is one root segment of prompt + shared tokens and
    `responses` leaf segments of the rest (a single segment when there is one response).
    """

    prompt_length: int
    """P: prompt tokens."""
    responses: int
    """G: responses per prompt."""
    response_length: int
    """S: tokens per response."""
    prompts: int = 1
    """N: prompt groups per step (over all data-parallel ranks)."""
    shared_response_length: int = 0
    """K: leading response tokens all G responses share (0 = they fork right after the prompt)."""

    def __post_init__(self) -> None:
        for f in ("prompt_length", "responses", "response_length", "prompts"):
            if getattr(self, f) <= 0:
                raise UserError(f"--{f.replace('_', '-')} must be positive, got {getattr(self, f)}")
        if not 0 <= self.shared_response_length < self.response_length:
            raise UserError(
                f"--shared-response-length must be in [0, response length {self.response_length}), "
                f"got {self.shared_response_length}"
            )

    @property
    def root_length(self) -> int:
        """Tokens of the shared root segment (prompt + shared response beginning)."""
        if self.responses == 1:
            return self.prompt_length + self.response_length
        return self.prompt_length + self.shared_response_length

    @property
    def leaf_length(self) -> int:
        """Tokens of each leaf segment (0 when there is one response: the root is the whole rollout)."""
        return 0 if self.responses == 1 else self.response_length - self.shared_response_length

    @property
    def rollout_length(self) -> int:
        return self.prompt_length + self.response_length

    @property
    def positions_logical(self) -> int:
        """Token positions naive training processes in the step."""
        return self.prompts * self.responses * self.rollout_length

    @property
    def positions_computed(self) -> int:
        """Distinct prefix-tree positions (packed and replay compute each once)."""
        return self.prompts * (self.root_length + self.responses * self.leaf_length)


RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True, kw_only=True)
class Layout(ParallelLayout):
    """A parallel layout (parallel/layout.py; the planner plans a whole world: dp is given) and an activation-
    recompute mode.

    recompute: "none" keeps every activation; "selective" is megatron's default selective recompute (core
    attention only; with a fused attention kernel it stores no score matrix, so it saves nothing here and the
    planner says so); "full" is per-layer activation checkpointing inside every chunk (the engine's
    ScheduleOptions.recompute_layers: megatron's recompute_granularity="full" shape, uniform, one layer per
    checkpoint, only each layer's input kept, but torch's non-reentrant checkpoint) together with the engine's
    segment recompute (replay keeps no graph for a segment with children, only its cached K/V).
    """

    dp: int = 1
    """Data-parallel size (the planner's layouts cover the whole world)."""
    sequence_parallel: bool = True
    """With tp > 1 (megatron's SP: norms and the MLP/attention inputs sharded over the sequence)."""
    recompute: str = "none"
    """none | selective | full (above)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recompute not in RECOMPUTE:
            raise UserError(f"--recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")

    def as_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "recompute": self.recompute}


def load_model(spec: str) -> tuple[str, ModelArch]:
    """A preset name or a path to an HF config.json -> (name, arch). Only the size fields are read, so a config
    with rope scaling (Llama-3.1) plans fine; unknown architectures are still refused."""
    if spec in MODEL_PRESETS:
        return spec, MODEL_PRESETS[spec]
    path = Path(spec)
    if not path.is_file():
        raise UserError(
            f"--model {spec!r} is neither a preset ({', '.join(MODEL_PRESETS)}) nor a config.json file"
        )
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"cannot read it as JSON: {e}", where=str(path)) from None
    if not isinstance(d, dict):
        raise UserError("expected a JSON object", where=str(path))
    rope = d.get("rope_parameters") or {}
    partial = d.get(
        "partial_rotary_factor", rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    )
    d = {k: v for k, v in d.items() if k not in ("rope_scaling", "rope_parameters")}  # sizes only
    if partial is not None:  # the one RoPE field that changes a size (the rotated dims' cos / sin)
        d["partial_rotary_factor"] = partial
    arch = ModelArch.from_hf_config(d, where=str(path))
    check_plannable(arch)  # rules/
    if arch.hybrid_override_pattern is not None:  # no Mamba-2 term in plan/layers.py, flops.py, memory.py yet
        raise UserError(
            f"the planner does not price {arch.family}'s Mamba-2 / attention-only / MLP-only layers yet; refusing "
            "rather than mispricing them",
            where=str(path),
        )
    return path.parent.name or str(path), arch


def parameter_count(arch: ModelArch) -> dict[str, int]:
    """Parameters by part: embedding, output layer (0 when tied), per full-attention layer, per linear-attention
    (gated delta net) layer, final norm, the total, and those every TP rank holds whole (norms). A MoE model: per
    MoE layer its attention, norms, router and shared expert ("moe_layer"), the routed experts of all layers
    ("experts", split over EP x TP) and those a token passes ("active_experts")."""
    from megatron_branch.plan.layers import (
        attention_layer_params,
        expert_params,
        gdn_layer_params,
        replicated_layer_params,
    )

    h = arch.hidden_size
    full, linear = arch.num_full_layers, arch.num_linear_layers
    layer = attention_layer_params(arch)
    linear_layer = gdn_layer_params(arch) if linear else 0
    n_moe = len(arch.moe_layers)
    sh = arch.shared_expert_ffn_hidden_size
    dense_mlp = 3 * h * arch.ffn_hidden_size
    # router (+ its correction bias, + gpt-oss's router bias) + shared expert (+ its gate)
    moe_block = (
        arch.num_experts * (h + arch.moe_expert_bias + arch.linear_bias)
        + 3 * h * sh
        + (h if arch.shared_expert_gate else 0)
    )
    moe_layer = layer - dense_mlp + moe_block
    experts = n_moe * arch.num_experts * expert_params(arch)
    return {
        "embedding": arch.vocab_size * h,
        "output": 0 if arch.tie_word_embeddings else arch.vocab_size * h,
        "layer": layer,
        "moe_layer": moe_layer if n_moe else 0,
        "experts": experts,
        "active_experts": n_moe * arch.moe_top_k * expert_params(arch),
        "linear_layer": linear_layer,
        "final_norm": h,
        # a MoE layer of either mixer kind: its dense SwiGLU replaced by the router, shared expert and experts
        "total": arch.vocab_size * h * (1 if arch.tie_word_embeddings else 2)
        + full * layer
        + linear * linear_layer
        + n_moe * (moe_block - dense_mlp)
        + experts
        + h,
        "replicated": full * replicated_layer_params(arch, False)
        + linear * replicated_layer_params(arch, True)
        + h,
    }
