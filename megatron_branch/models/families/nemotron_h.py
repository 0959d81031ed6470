"""Nemotron-H and Nemotron 3 (NemotronHForCausalLM, transformers `nemotron_h`): a Mamba-2 hybrid.

Its layers follow `hybrid_override_pattern` (transformers 5.24 reads it into `layers_block_type`): "M" a Mamba-2
mixer (megatron's MambaMixer: models/mamba.py), "*" self-attention WITHOUT positional encoding (GQA, no bias), "-"
an MLP up -> squared ReLU -> down (no gate, HF mlp_hidden_act relu2); each layer is one RMS norm and that one block
(NemotronHBlock). Every norm uses layer_norm_epsilon, the mixer's grouped gated norm too. What the engine would
not compute exactly is refused in one line: MoE layers ("E": Nemotron 3's latent MoE router is not built here),
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
    if "E" in pattern:
        raise UserError("nemotron_h MoE layers ('E' / moe) are not supported; refusing", where=where)
    bad = sorted(set(pattern) - set("M*-"))
    if bad:
        raise UserError(f"nemotron_h layer kind {bad[0]!r} is not supported (only M, *, -)", where=where)
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
    return transformers.NemotronHConfig(**common, **_mamba_hf(arch))


def tiny_hf_config(
    common: dict[str, Any], *, head_dim: int | None = None, layer_types: Any = None, **_: Any
) -> Any:
    """Mamba, attention, MLP, Mamba, MLP (`layer_types`: a hybrid_override_pattern string instead); 4 Mamba heads
    of 8 channels in 2 groups, state 8, chunk 8 (so a test's sequences span several chunks)."""
    import transformers

    drop = ("num_hidden_layers", "rope_parameters", "rms_norm_eps")
    kw = {k: v for k, v in common.items() if k not in drop}
    heads = kw["num_attention_heads"]
    return transformers.NemotronHConfig(
        architectures=["NemotronHForCausalLM"],
        hybrid_override_pattern=layer_types if isinstance(layer_types, str) else "M*-M-",
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
        layer_kinds=("attention", "mamba", "mlp"),
        hf_text_prefixes=(("model.", "backbone."),),
        hf_not_converted=("mtp.",),
    )
)
