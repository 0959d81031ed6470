"""What the planner plans for: a model, a rollout shape, GPUs and a parallel layout (pure data).

The presets live in plan/presets.py (from each model's published `config.json`). Llama-3.1's rope scaling changes
neither memory nor FLOPs, so the planner ignores it (the engine itself refuses it for training: models/arch.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.parallel.layout import ParallelLayout
from megatron_branch.plan.presets import MODEL_PRESETS
from megatron_branch.rules import check_plannable


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
    return path.parent.name or str(path), arch


def parameter_count(arch: ModelArch) -> dict[str, int]:
    """Parameters by part: embedding, output layer (0 when tied), per full-attention layer, per linear-attention
    (gated delta net) layer, final norm, the total, and those every TP rank holds whole (norms, a row-parallel
    bias, a MoE layer's router and shared-expert gate: megatron's TopKRouter and gate weights are not split). A MoE model: per
    MoE layer its attention, norms, router and shared expert ("moe_layer"), the routed experts of all layers
    ("experts", split over EP x TP) and those a token passes ("active_experts")."""
    from megatron_branch.plan.layers import (
        attention_layer_params,
        expert_params,
        gdn_layer_params,
        replicated_layer_params,
    )
    from megatron_branch.plan.mamba import is_mamba_hybrid, pattern_parameter_count

    if is_mamba_hybrid(arch):  # one block per layer, priced per kind (plan/mamba.py)
        return pattern_parameter_count(arch)
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
    router = (
        moe_block - 3 * h * sh
    )  # the router (+ biases) and the shared expert's gate: whole on every TP rank
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
        + n_moe * router
        + h,
    }
