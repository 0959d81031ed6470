"""Nemotron-H and Nemotron 3 (NemotronHForCausalLM, transformers `nemotron_h`): a Mamba-2 hybrid.

Its layers follow `hybrid_override_pattern` (transformers 5.24 reads it into `layers_block_type`): "M" a Mamba-2
mixer (megatron's MambaMixer: models/mamba.py), "*" self-attention WITHOUT positional encoding (GQA, no bias), "-"
an MLP up -> squared ReLU -> down (no gate, HF mlp_hidden_act relu2); each layer is one RMS norm and that one block
(NemotronHBlock). Every norm uses layer_norm_epsilon, the mixer's grouped gated norm too. "E" a mixture of experts
(Nemotron 3, NemotronHMoE) on megatron's MoELayer (models/moe.py), the DeepSeek-style router GLM-4.5's uses
(models/families/glm4_moe.py, the same megatron settings: models/router_settings.py):

    scores  = sigmoid(x . W_gate)                       float32 in HF (and in megatron: moe_utils.py)
    choice  = top-k of scores + e_score_correction_bias  within the topk_group best of n_group groups
    weights = scores at the choice, / their sum when norm_topk_prob, x routed_scaling_factor
    out     = sum_k weights_k expert_k(x) + shared_experts(x)

each expert and the shared expert (moe_shared_expert_intermediate_size wide) an ungated up -> relu2 -> down MLP, as
the "-" layers (megatron: gated_linear_unit=False, squared_relu). What the engine would not compute exactly is
refused in one line: the latent MoE (moe_latent_size: Nemotron 3 Super's fc1/fc2_latent_proj around the experts),
biases (attention_bias, mlp_bias, use_bias / mamba_proj_bias), sliding windows, other activations. Published
checkpoints name the model `backbone.` (the parameter map's names; transformers renames it `model.` in memory,
read here too); the
multi-token-prediction head (`mtp.`) is not part of the policy (transformers ignores it on load).
"""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.families.param_rules import HEAD, Rule
from megatron_branch.models.families.registry import FamilySpec, register_family

_KINDS = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
"""transformers' layers_block_type names -> megatron's hybrid_override_pattern characters (HF's own mapping,
NemotronHConfig._list_to_pattern)."""

# The parameter map's rules (checkpoint/param_map.py; Rule.layers = the pattern character a rule applies to): each
# layer is `norm` and ONE `mixer`, in megatron's slots of that block (models/mamba.py). megatron's MambaMixer in_proj
# rows [z; x; B; C; dt] and conv1d channels [x; B; C] are HF's. Names are the checkpoint's (`backbone.`: what
# save_pretrained writes; transformers renames it `model.` in memory). The norms' TE names: megatron's TE Mamba
# stack fuses them into in_proj / linear_qkv / linear_fc1 (mamba_layer_specs.py).
_M = "decoder.layers.{i}."
_B = "backbone."
_NL = _B + "layers.{i}."
_MX = _NL + "mixer."
_SA = _M + "self_attention."


def _mamba(name: str, hf: str, when: str | None = None) -> Rule:
    return Rule(mcore=_SA + name, hf=(_MX + hf,), transform="identity", when=when, layers="M")


def _experts() -> tuple[Rule, ...]:
    """An "E" layer: its norm (the MoE spec keeps megatron's pre-MLP norm apart: models/moe.py), the router and its
    correction bias, routed expert j (ungated: up_proj is linear_fc1 as is; megatron's names as param_rules._moe's)
    and the shared expert. HF names are the checkpoint's: one tensor per expert (transformers merges them into 3-D
    tensors in memory only: conversion_mapping.py `nemotron_h`)."""
    exp, hexp = _M + "mlp.experts.", _MX + "experts.{j}."
    moe = dict(layers="E", mlp="moe")
    return (
        Rule(mcore=_M + "pre_mlp_layernorm.weight", hf=(_NL + "norm.weight",), transform="identity", **moe),
        Rule(mcore=_M + "mlp.router.weight", hf=(_MX + "gate.weight",), transform="identity", **moe),
        Rule(
            mcore=_M + "mlp.router.expert_bias",
            hf=(_MX + "gate.e_score_correction_bias",),
            transform="identity",
            when="expert_bias",
            **moe,
        ),
        *(
            Rule(
                mcore=exp + f"local_experts.{{j}}.{fc}.weight",
                hf=(hexp + f"{proj}.weight",),
                transform="identity",
                te=exp + f"{fc}.weight{{j}}",
                key=exp + f"experts.{fc}.weight",
                **moe,
            )
            for fc, proj in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj"))
        ),
        *(
            Rule(
                mcore=_M + f"mlp.shared_experts.{fc}.weight",
                hf=(_MX + f"shared_experts.{proj}.weight",),
                transform="identity",
                when="shared_expert",
                **moe,
            )
            for fc, proj in (("linear_fc1", "up_proj"), ("linear_fc2", "down_proj"))
        ),
    )


NEMOTRON_H_RULES: tuple[Rule, ...] = (
    Rule(mcore="embedding.word_embeddings.weight", hf=(_B + "embeddings.weight",), transform="vocab_pad"),
    *(
        Rule(
            mcore=_M + "input_layernorm.weight",
            hf=(_NL + "norm.weight",),
            transform="identity",
            te=_SA + fused + ".layer_norm_weight",
            layers=kind,
        )
        for kind, fused in (("M", "in_proj"), ("*", "linear_qkv"))
    ),
    *(
        _mamba(n, n, when)
        for n, when in (
            ("in_proj.weight", None),
            ("conv1d.weight", None),
            ("conv1d.bias", "mamba_conv_bias"),
            ("dt_bias", None),
            ("A_log", None),
            ("D", None),
            ("norm.weight", None),
            ("out_proj.weight", None),
        )
    ),
    Rule(
        mcore=_SA + "linear_qkv.weight",
        hf=tuple(_MX + f"{p}_proj.weight" for p in "qkv"),
        transform="qkv_interleave",
        layers="*",
    ),
    Rule(mcore=_SA + "linear_proj.weight", hf=(_MX + "o_proj.weight",), transform="identity", layers="*"),
    Rule(
        mcore=_M + "pre_mlp_layernorm.weight",
        hf=(_NL + "norm.weight",),
        transform="identity",
        te=_M + "mlp.linear_fc1.layer_norm_weight",
        layers="-",
    ),
    Rule(mcore=_M + "mlp.linear_fc1.weight", hf=(_MX + "up_proj.weight",), transform="identity", layers="-"),
    Rule(
        mcore=_M + "mlp.linear_fc2.weight", hf=(_MX + "down_proj.weight",), transform="identity", layers="-"
    ),
    *_experts(),
    Rule(mcore="decoder.final_layernorm.weight", hf=(_B + "norm_f.weight",), transform="identity"),
    HEAD[1],
)


def _pattern(d: dict[str, Any], where: str) -> str:
    types = d.get("layers_block_type") or d.get("layer_types")
    if types is not None:
        return "".join(_KINDS.get(t, "?") for t in types)
    pattern = d.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or not pattern:
        raise UserError("nemotron_h needs hybrid_override_pattern or layers_block_type", where=where)
    return pattern


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    pattern = _pattern(d, where)
    bad = sorted(set(pattern) - set("M*-E"))
    if bad:
        raise UserError(f"nemotron_h layer kind {bad[0]!r} is not supported (only M, *, -, E)", where=where)
    for key, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if d.get(key, want) != want:
            raise UserError(f"nemotron_h {key}={d[key]!r} is not supported (only {want})", where=where)
    for key in ("attention_bias", "mlp_bias", "use_bias", "mamba_proj_bias"):
        if d.get(key):
            raise UserError(f"nemotron_h {key}=true is not supported", where=where)
    if d.get("sliding_window") is not None:
        raise UserError("nemotron_h sliding_window is not supported", where=where)
    n_heads = d["num_attention_heads"]
    return dict(
        **(_read_experts(d, pattern, where) if "E" in pattern else {}),
        family="nemotron_h",
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=len(pattern),
        num_attention_heads=n_heads,
        num_query_groups=d.get("num_key_value_heads") or n_heads,
        ffn_hidden_size=d["intermediate_size"],
        head_dim=d.get("head_dim"),
        rms_norm_eps=float(d.get("layer_norm_epsilon", 1e-5)),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        hybrid_override_pattern=pattern,
        mlp_activation="relu2",
        position_embedding="none",
        mamba_num_heads=int(d["mamba_num_heads"]),
        mamba_head_dim=int(d["mamba_head_dim"]),
        mamba_state_dim=int(d["ssm_state_size"]),
        mamba_num_groups=int(d["n_groups"]),
        mamba_conv_kernel=int(d.get("conv_kernel", 4)),
        mamba_conv_bias=bool(d.get("use_conv_bias", True)),
        mamba_chunk_size=int(d.get("chunk_size", 128)),
        mamba_dt_min=float(d.get("time_step_min", 0.001)),
    )


def _read_experts(d: dict[str, Any], pattern: str, where: str) -> dict[str, Any]:
    """The "E" layers' fields (NemotronHMoE: the module docstring); megatron's router settings are checked where
    ModelArch validates (models/router_settings.py)."""
    if d.get("moe_latent_size") is not None:
        raise UserError(
            f"nemotron_h moe_latent_size={d['moe_latent_size']} (the latent MoE) is not supported",
            where=where,
        )
    marks = tuple(int(c == "E") for c in pattern)
    return dict(
        num_experts=int(d["n_routed_experts"]),
        moe_top_k=int(d["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(d["moe_intermediate_size"]),
        moe_norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        moe_layer_pattern=None if all(marks) else marks,
        shared_expert_ffn_hidden_size=int(d["moe_shared_expert_intermediate_size"]),
        moe_score_function="sigmoid",
        moe_expert_bias=True,
        moe_num_groups=int(d.get("n_group", 1) or 1),
        moe_group_topk=int(d.get("topk_group", 1) or 1),
        moe_routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
    )


def _experts_hf(arch: Any) -> dict[str, Any]:
    """The HF config fields `_read_experts` reads back (none for a model without "E" layers)."""
    if not arch.is_moe:
        return {}
    return dict(
        n_routed_experts=arch.num_experts,
        num_experts_per_tok=arch.moe_top_k,
        moe_intermediate_size=arch.moe_ffn_hidden_size,
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size,
        norm_topk_prob=arch.moe_norm_topk_prob,
        n_group=arch.moe_num_groups,
        topk_group=arch.moe_group_topk,
        routed_scaling_factor=arch.moe_routed_scaling_factor,
    )


def _mamba_hf(arch: Any) -> dict[str, Any]:
    return dict(
        hybrid_override_pattern=arch.hybrid_override_pattern,
        mamba_num_heads=arch.mamba_num_heads,
        mamba_head_dim=arch.mamba_head_dim,
        ssm_state_size=arch.mamba_state_dim,
        n_groups=arch.mamba_num_groups,
        conv_kernel=arch.mamba_conv_kernel,
        use_conv_bias=arch.mamba_conv_bias,
        chunk_size=arch.mamba_chunk_size,
        time_step_min=arch.mamba_dt_min,
        layer_norm_epsilon=arch.rms_norm_eps,
    )


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    common = {k: v for k, v in common.items() if k not in ("num_hidden_layers", "rms_norm_eps")}
    return transformers.NemotronHConfig(**common, **_mamba_hf(arch), **_experts_hf(arch))


TINY_NEMOTRON_EXPERTS = dict(
    n_routed_experts=12,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
"""The tiny Nemotron MoE ("E" layers): 12 experts of width 16 in 4 groups of 3, top-4 within the best 2 groups
(the group limit binds: 6 of 12 eligible), a shared expert of width 24, weights scaled by 2.5 (Nemotron 3 Nano's
factor; its router has one group: HF's and megatron's group ranking agree only where top-k / topk_group is 2)."""


def tiny_hf_config(
    common: dict[str, Any],
    *,
    head_dim: int | None = None,
    layer_types: Any = None,
    moe: dict[str, Any] | None = None,
    **_: Any,
) -> Any:
    """Mamba, attention, MLP, Mamba, MLP (`layer_types`: a hybrid_override_pattern string instead; with "E" layers
    the experts are TINY_NEMOTRON_EXPERTS updated by `moe`); 4 Mamba heads of 8 channels in 2 groups, state 8,
    chunk 8 (so a test's sequences span several chunks)."""
    import transformers

    drop = ("num_hidden_layers", "rope_parameters", "rms_norm_eps")
    kw = {k: v for k, v in common.items() if k not in drop}
    heads = kw["num_attention_heads"]
    pattern = layer_types if isinstance(layer_types, str) else "M*-M-"
    if "E" in pattern:
        kw.update(TINY_NEMOTRON_EXPERTS, **(moe or {}))
    return transformers.NemotronHConfig(
        architectures=["NemotronHForCausalLM"],
        hybrid_override_pattern=pattern,
        head_dim=head_dim or kw["hidden_size"] // heads,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=2,
        ssm_state_size=8,
        conv_kernel=4,
        chunk_size=8,
        layer_norm_epsilon=1e-5,
        **kw,
    )


NEMOTRON_H = register_family(
    FamilySpec(
        name="nemotron_h",
        architectures=("NemotronHForCausalLM",),
        model_types=("nemotron_h",),
        export_class="NemotronHForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=NEMOTRON_H_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "mamba", "mlp"),  # + experts where the pattern has "E" (arch.is_moe)
        hf_text_prefixes=(("model.", "backbone."),),
        hf_not_converted=("mtp.",),
    )
)
