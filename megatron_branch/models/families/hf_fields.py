"""The shared parts of reading and writing a family's HF config: what several families' config.json fields mean
(each family's file calls the ones it uses; a family's own quirks stay in its file).

Read off transformers 5.24's modeling code, the reference every test compares against. What the engine would not
compute exactly is refused with a one-line UserError instead of being approximated: rope scaling, sliding
windows, MLP bias, activations other than SiLU/SwiGLU, a bias on o_proj. No megatron, no model code here.
router_aux_loss_coef / output_router_logits are HF's training switches, not architecture: the router losses a run
uses are its own settings (train config `actor.moe`, grad's --moe-* flags).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType
from typing import Any

from megatron_branch.errors import UserError

QWEN3_5_GATED_NORM_GATES = (None, "swish")
"""Qwen3.5's `output_gate_type`: HF gates the linear-attention output norm with silu (= swish), whatever it says."""


def rope_of(d: dict[str, Any], where: str) -> tuple[dict[str, Any], float]:
    """(rope parameters, theta); a scaled RoPE is refused (not reproduced exactly)."""
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise UserError(f"rope scaling {rope_type!r} cannot be reproduced exactly; refusing", where=where)
    return rope, float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))


def common_fields(
    family: str,
    d: dict[str, Any],
    where: str,
    *,
    qkv_bias: bool = False,
    ffn_key: str = "intermediate_size",
) -> dict[str, Any]:
    """The fields every family reads alike, after the refusals every family shares. `qkv_bias`: the family's
    attention_bias is a bias on q/k/v only (Qwen2's); elsewhere attention_bias also biases o_proj, which the
    parameter map does not carry, and is refused. `ffn_key`: the HF field of the SwiGLU width."""
    if d.get("hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act={d['hidden_act']!r} is not supported (only silu/SwiGLU)", where=where)
    if d.get("mlp_bias"):
        raise UserError("mlp_bias=true is not supported", where=where)
    _, theta = rope_of(d, where)
    if d.get("attention_bias") and not qkv_bias:
        raise UserError(f"{family} attention_bias=true (bias on o_proj) is not supported", where=where)
    if d.get("use_sliding_window"):
        raise UserError("use_sliding_window=true is not supported", where=where)
    n_heads = d["num_attention_heads"]
    return dict(
        family=family,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_attention_heads=n_heads,
        num_query_groups=d.get("num_key_value_heads") or n_heads,
        ffn_hidden_size=d[ffn_key],
        head_dim=d.get("head_dim"),
        rope_theta=theta,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        qkv_bias=False,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
    )


def qwen3_attention(family: str, d: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    """Qwen3's attention: q/k norms, a free head_dim (transformers' Qwen3Config default 128, not hidden / heads);
    sliding windows refused."""
    if fields["head_dim"] is None:
        fields["head_dim"] = 128
    kinds = set(d.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UserError(
            f"{family} layer_types {sorted(kinds)} (sliding windows) are not supported", where=where
        )
    fields["qk_norm"] = True


def qwen_experts(
    d: dict[str, Any],
    fields: dict[str, Any],
    where: str,
    *,
    every_layer: bool = False,
    norm_topk_prob: bool | None = None,
    norm_topk_default: bool = False,
    shared_expert: bool = False,
) -> None:
    """The experts of the Qwen MoE families (megatron's MoELayer, models/moe.py): num_experts / num_experts_per_tok
    / moe_intermediate_size; layer i is MoE unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0
    (HF's rule) unless `every_layer` (the family builds a sparse block in every layer whatever these say);
    `norm_topk_prob` fixed by the family's router, else read with HF's default `norm_topk_default`; a
    `shared_expert` (shared_expert_intermediate_size) with its sigmoid gate (Qwen2MoeSparseMoeBlock and heirs)."""
    n = fields["num_layers"]
    # Qwen3MoeConfig maps num_experts (the published config.json's name) onto num_local_experts (what it writes)
    num = int(d["num_experts"] if "num_experts" in d else d["num_local_experts"])
    step = 1 if every_layer else int(d.get("decoder_sparse_step", 1) or 1)
    dense = set() if every_layer else set(d.get("mlp_only_layers") or [])
    bad = sorted(i for i in dense if not (isinstance(i, int) and 0 <= i < n))
    if bad:
        raise UserError(f"mlp_only_layers lists layer {bad[0]!r}, not one of 0..{n - 1}", where=where)
    pattern = tuple(int(i not in dense and num > 0 and (i + 1) % step == 0) for i in range(n))
    if not any(pattern):
        raise UserError(
            "no MoE layer (mlp_only_layers / decoder_sparse_step leave every layer dense); convert it as a dense "
            "model",
            where=where,
        )
    if norm_topk_prob is None:
        norm_topk_prob = bool(d.get("norm_topk_prob", norm_topk_default))
    fields.update(
        num_experts=num,
        moe_top_k=int(d["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(d["moe_intermediate_size"]),
        moe_norm_topk_prob=norm_topk_prob,
        moe_layer_pattern=None if all(pattern) else pattern,
    )
    if shared_expert:
        fields.update(
            shared_expert_ffn_hidden_size=int(d["shared_expert_intermediate_size"]),
            shared_expert_gate=True,  # Qwen2MoeSparseMoeBlock and its heirs always gate their shared expert
        )


def qwen_experts_hf(arch: Any, *, every_layer: bool = False, shared_expert: bool = False) -> dict[str, Any]:
    """The HF config fields of `arch`'s experts (what `qwen_experts` reads back); `every_layer`: the family's
    config has no norm_topk_prob / decoder_sparse_step / mlp_only_layers (Qwen3.5-MoE)."""
    dense = (
        [] if arch.moe_layer_pattern is None else [i for i, m in enumerate(arch.moe_layer_pattern) if not m]
    )
    out: dict[str, Any] = dict(
        num_experts=arch.num_experts,
        num_experts_per_tok=arch.moe_top_k,
        moe_intermediate_size=arch.moe_ffn_hidden_size,
        output_router_logits=False,
    )
    if not every_layer:
        out.update(norm_topk_prob=arch.moe_norm_topk_prob, decoder_sparse_step=1, mlp_only_layers=dense)
    if shared_expert:
        out["shared_expert_intermediate_size"] = arch.shared_expert_ffn_hidden_size
    return out


def deepseek_experts(family: str, d: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    """The DeepSeek-style MoE block (transformers' DeepseekV3MoE and its heirs, GLM-4.5's Glm4MoeMoE):
    n_routed_experts of moe_intermediate_size, num_experts_per_tok, n_shared_experts x moe_intermediate_size shared
    experts (ungated), the first first_k_dense_replace layers dense (intermediate_size); the sigmoid router with its
    correction bias, n_group / topk_group, norm_topk_prob (HF default true), routed_scaling_factor (what megatron
    computes otherwise: models/router_settings.py)."""
    n = fields["num_layers"]
    first_dense = int(d.get("first_k_dense_replace", 1))
    if not 0 <= first_dense < n:
        raise UserError(
            f"first_k_dense_replace={first_dense} leaves no MoE layer of {n}; convert it as a dense model",
            where=where,
        )
    shared = int(d.get("n_shared_experts", 1))
    if shared < 1:
        raise UserError(f"n_shared_experts={shared} is not supported ({family}: one or more)", where=where)
    width = int(d["moe_intermediate_size"])
    fields.update(
        num_experts=int(d["n_routed_experts"] if "n_routed_experts" in d else d["num_local_experts"]),
        moe_top_k=int(d["num_experts_per_tok"]),
        moe_ffn_hidden_size=width,
        moe_norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        moe_layer_pattern=tuple(int(i >= first_dense) for i in range(n)) if first_dense else None,
        shared_expert_ffn_hidden_size=shared * width,
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_num_groups=int(d.get("n_group", 1) or 1),
        moe_group_topk=int(d.get("topk_group", 1) or 1),
        moe_routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
    )


def deepseek_experts_hf(arch: Any) -> dict[str, Any]:
    """The HF config fields of `arch`'s DeepSeek-style MoE block (what `deepseek_experts` reads back); the
    multi-token-prediction layers are not part of the policy: num_nextn_predict_layers 0."""
    pattern = arch.moe_layer_pattern or (1,) * arch.num_layers
    first_dense = pattern.index(1)
    if any(not m for m in pattern[first_dense:]):
        raise ValueError(
            f"{arch.family}: MoE layer pattern {list(pattern)} is not dense layers first, then MoE"
        )
    shared, width = arch.shared_expert_ffn_hidden_size, arch.moe_ffn_hidden_size
    if shared % width:
        raise ValueError(f"{arch.family}: shared expert width {shared} is not a multiple of {width}")
    return dict(
        n_routed_experts=arch.num_experts,
        num_experts_per_tok=arch.moe_top_k,
        moe_intermediate_size=width,
        n_shared_experts=shared // width,
        norm_topk_prob=arch.moe_norm_topk_prob,
        n_group=arch.moe_num_groups,
        topk_group=arch.moe_group_topk,
        routed_scaling_factor=arch.moe_routed_scaling_factor,
        first_k_dense_replace=first_dense,
        num_nextn_predict_layers=0,
        output_router_logits=False,
    )


def hybrid_layers(d: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    """The Qwen3.5 hybrid's layers: per layer a gated delta net or gated full attention (layer_types; default
    every `full_attention_interval`-th layer full, HF's rule), q/k norms, zero-centred norms, partial RoPE (HF
    default 0.25), multimodal RoPE sections (text-only: no effect), the delta net's widths. HF always gates the
    attention (attn_output_gate=false is refused rather than ignored)."""
    rope, _ = rope_of(d, where)
    if d.get("attn_output_gate") is False:
        raise UserError(
            "attn_output_gate=false: transformers' qwen3_5 attention always gates its output", where=where
        )
    if d.get("output_gate_type") not in QWEN3_5_GATED_NORM_GATES:
        raise UserError(
            f"output_gate_type={d['output_gate_type']!r}: transformers' qwen3_5 gates with swish (silu) only",
            where=where,
        )
    n = fields["num_layers"]
    layer_types = d.get("layer_types")
    if layer_types is None:  # transformers' rule (Qwen3_5TextConfig.__post_init__)
        every = int(d.get("full_attention_interval", 4))
        layer_types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    fields.update(
        head_dim=d["head_dim"],
        qk_norm=True,
        zero_centered_norm=True,
        attention_output_gate=True,
        rotary_percent=float(rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.25))),
        mrope_section=tuple(rope["mrope_section"]) if rope.get("mrope_section") else None,
        mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
        layer_types=tuple(layer_types),
        linear_conv_kernel_dim=int(d.get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(d["linear_key_head_dim"]),
        linear_value_head_dim=int(d["linear_value_head_dim"]),
        linear_num_key_heads=int(d["linear_num_key_heads"]),
        linear_num_value_heads=int(d["linear_num_value_heads"]),
    )


def hybrid_hf(arch: Any, common: dict[str, Any], *, mrope: bool = True) -> dict[str, Any]:
    """The HF config fields of the hybrid's layers (what `hybrid_layers` reads back); `mrope`: the family's
    config carries the multimodal RoPE fields (not Qwen3-Next: text only)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": arch.rope_theta}
    rope["partial_rotary_factor"] = arch.rotary_percent
    if arch.mrope_section is not None:
        rope["mrope_section"] = list(arch.mrope_section)
    if mrope:
        rope["mrope_interleaved"] = arch.mrope_interleaved
    return dict(
        rope_parameters=rope,
        attention_bias=False,
        layer_types=list(arch.layer_types or ["full_attention"] * arch.num_layers),
        linear_conv_kernel_dim=arch.linear_conv_kernel_dim,
        linear_key_head_dim=arch.linear_key_head_dim,
        linear_value_head_dim=arch.linear_value_head_dim,
        linear_num_key_heads=arch.linear_num_key_heads,
        linear_num_value_heads=arch.linear_num_value_heads,
        **common,
    )


def default_rope(arch: Any) -> dict[str, Any]:
    """The plain RoPE parameters of `arch` (no scaling)."""
    return {"rope_type": "default", "rope_theta": arch.rope_theta}


# --- tiny test configs ------------------------------------------------------------------------------------------
TINY_EXPERTS = MappingProxyType(dict(num_experts=4, moe_intermediate_size=16, num_experts_per_tok=2))
"""The tiny MoE's routed experts: 4 of width 16, top-2."""
TINY_EXPERTS_SHARED = MappingProxyType({**TINY_EXPERTS, "shared_expert_intermediate_size": 24})
"""The tiny MoE's routed experts and a shared expert of width 24."""


def tiny_hybrid(
    common: dict[str, Any], *, head_dim: int | None, layer_types: Sequence[str] | None, mrope: bool = True
) -> dict[str, Any]:
    """A tiny Qwen3.5 hybrid's fields: 3 linear-attention layers to 1 full by default, head_dim 16, partial RoPE
    0.5 (8 of 16 dims rotate), multimodal RoPE sections unless not `mrope`, 2 key / 4 value GDN heads of 8."""
    kw = dict(common, rope_parameters=dict(common["rope_parameters"], partial_rotary_factor=0.5))
    if mrope:
        kw["rope_parameters"].update(mrope_section=[2, 1, 1], mrope_interleaved=True)
    n = kw["num_hidden_layers"]
    if layer_types is None:
        layer_types = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(n)]
    kw.update(
        head_dim=head_dim or 16,
        layer_types=list(layer_types),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )
    return kw
