"""ModelArch's own field and layout checks (models/arch.py calls them): the MoE fields, the token mixers'
(layer_types, a hybrid's gated delta net sizes), and the tensor- / expert-parallel sizes a model can be split over.
Field errors are ValueErrors (the dataclass's __post_init__), layout errors one-line UserErrors.
"""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.families import get_family
from megatron_branch.models.router_settings import check_router

LAYER_TYPES = ("full_attention", "linear_attention")
"""HF's names for the two kinds of token mixer (Qwen3.5 `layer_types`)."""


def check_moe_fields(arch: Any) -> None:
    """The mixture-of-experts fields (ModelArch.__post_init__): top-k, widths, the MoE layer pattern, the router."""
    if get_family(arch.family).moe and arch.num_experts <= 0:
        raise ValueError(f"family {arch.family} needs num_experts > 0")
    if arch.num_experts <= 0:
        if arch.moe_layer_pattern is not None or arch.shared_expert_ffn_hidden_size:
            raise ValueError("moe_layer_pattern / shared experts need num_experts > 0")
        return
    if not 0 < arch.moe_top_k <= arch.num_experts:
        raise ValueError(
            f"num_experts_per_tok={arch.moe_top_k} must be in [1, num_experts={arch.num_experts}]"
        )
    if arch.moe_ffn_hidden_size <= 0:
        raise ValueError(f"moe_intermediate_size must be positive, got {arch.moe_ffn_hidden_size}")
    if arch.moe_layer_pattern is not None:
        arch.moe_layer_pattern = tuple(int(x) for x in arch.moe_layer_pattern)  # a JSON list
        if len(arch.moe_layer_pattern) != arch.num_layers or set(arch.moe_layer_pattern) - {0, 1}:
            raise ValueError(
                f"moe_layer_pattern must hold one 0/1 per layer ({arch.num_layers}), got {arch.moe_layer_pattern}"
            )
        if all(arch.moe_layer_pattern):
            arch.moe_layer_pattern = None  # one canonical form: every layer MoE
        elif not any(arch.moe_layer_pattern):
            raise ValueError("moe_layer_pattern has no MoE layer (mlp_only_layers lists every layer)")
    if arch.shared_expert_gate and not arch.shared_expert_ffn_hidden_size:
        raise ValueError("shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)")
    check_router(arch)  # models/router_settings.py


def check_layer_types(arch: Any) -> None:
    """The token mixers' fields (ModelArch.__post_init__): HF's layer_types and a hybrid's gated delta net sizes."""
    if arch.layer_types is None:
        return
    arch.layer_types = tuple(arch.layer_types)  # a JSON list from megatron_branch.json
    if len(arch.layer_types) != arch.num_layers:
        raise ValueError(
            f"layer_types has {len(arch.layer_types)} entries for num_hidden_layers={arch.num_layers}"
        )
    bad = [t for t in arch.layer_types if t not in LAYER_TYPES]
    if bad:
        raise ValueError(f"layer type {bad[0]!r} is not supported; supported: {', '.join(LAYER_TYPES)}")
    if not arch.is_hybrid:
        return
    for name in (
        "linear_conv_kernel_dim",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "linear_num_key_heads",
        "linear_num_value_heads",
    ):
        if getattr(arch, name) <= 0:
            raise ValueError(
                f"{name} must be positive for linear-attention layers, got {getattr(arch, name)}"
            )
    if arch.linear_num_value_heads % arch.linear_num_key_heads:
        raise ValueError(
            f"linear_num_value_heads={arch.linear_num_value_heads} is not a multiple of "
            f"linear_num_key_heads={arch.linear_num_key_heads}"
        )


def check_window_fields(arch: Any) -> None:
    """The sliding-window fields (ModelArch.__post_init__): a positive window, one 0/1 per layer."""
    if arch.sliding_window is None:
        if arch.window_layers is not None:
            raise ValueError("window_layers needs sliding_window")
        return
    if arch.sliding_window <= 0:
        raise ValueError(f"sliding_window must be positive, got {arch.sliding_window}")
    if arch.window_layers is not None:
        arch.window_layers = tuple(int(x) for x in arch.window_layers)  # a JSON list
        if len(arch.window_layers) != arch.num_layers or set(arch.window_layers) - {0, 1}:
            raise ValueError(
                f"window_layers must hold one 0/1 per layer ({arch.num_layers}), got {arch.window_layers}"
            )
    if arch.is_hybrid or arch.multi_latent or arch.hybrid_override_pattern is not None:
        raise ValueError("sliding_window is supported on grouped-query attention layers only (gpt_oss)")


def check_expert_parallel(arch: Any, ep: int, *, tp: int = 1, etp: int | None = None) -> None:
    """Refuse, in one line, an expert-parallel size the model cannot be split over (`etp`: the experts' own
    tensor-parallel size, megatron's expert_tensor_parallel_size; None = tp)."""
    etp = tp if etp is None else etp
    if ep <= 0:
        raise UserError(f"expert parallel size must be positive, got {ep}")
    if ep > 1 and not arch.is_moe:
        raise UserError(
            f"expert parallel size {ep} needs a mixture-of-experts model ({arch.family} is dense)"
        )
    if arch.num_experts % ep:
        raise UserError(f"expert parallel size {ep} does not divide num_experts={arch.num_experts}")
    if arch.is_moe and arch.moe_ffn_hidden_size % etp:
        # the experts are split over ETP (megatron's expert_tensor_parallel_size: TP unless set to 1)
        raise UserError(
            f"expert tensor parallel size {etp} does not divide moe_intermediate_size={arch.moe_ffn_hidden_size}"
        )
    if arch.shared_expert_ffn_hidden_size % tp:
        raise UserError(
            f"tensor parallel size {tp} does not divide shared_expert_intermediate_size="
            f"{arch.shared_expert_ffn_hidden_size}"
        )


def check_tensor_parallel(arch: Any, tp: int, *, etp: int | None = None) -> None:
    """Refuse, in one line, a tensor-parallel size the model cannot be split over (`etp`: the experts' own
    tensor-parallel size, megatron's expert_tensor_parallel_size; None = tp)."""
    if tp <= 0:
        raise UserError(f"tensor parallel size must be positive, got {tp}")
    if arch.num_attention_heads % tp:
        raise UserError(
            f"tensor parallel size {tp} does not divide num_attention_heads={arch.num_attention_heads}"
        )
    if arch.num_query_groups % tp and tp % arch.num_query_groups:
        raise UserError(
            f"tensor parallel size {tp} and num_key_value_heads={arch.num_query_groups}: one must divide the other"
        )
    if arch.ffn_hidden_size % tp and not (arch.is_moe and not arch.has_dense_mlp_layers):
        raise UserError(f"tensor parallel size {tp} does not divide intermediate_size={arch.ffn_hidden_size}")
    etp = tp if etp is None else etp
    if arch.is_moe and arch.linear_bias and etp > 1:
        # megatron-core 0.16.1 asserts "Bias in Moe is only supported when ETP==1" (transformer_config.py)
        raise UserError(
            f"expert tensor parallel size {etp} with {arch.family}'s expert biases: megatron-core needs expert "
            "tensor parallel size 1 for them (grad's and convert's --etp 1)"
        )
    if arch.is_moe:
        check_expert_parallel(arch, 1, tp=tp, etp=etp)
    if arch.hybrid_override_pattern is not None:
        from megatron_branch.models.mamba_arch import check_mamba_tensor_parallel

        check_mamba_tensor_parallel(arch, tp)
    if arch.is_hybrid:  # megatron's GatedDeltaNet splits both head counts over TP (transformer_config.py)
        for name in ("linear_num_key_heads", "linear_num_value_heads"):
            if getattr(arch, name) % tp:
                raise UserError(f"tensor parallel size {tp} does not divide {name}={getattr(arch, name)}")
