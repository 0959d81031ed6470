"""Hugging Face configs <-> `ModelArch` fields, family by family (no megatron, no model code).

What each family's config.json means, read off transformers 5.24's modeling code (the reference every test compares
against), and what is refused because this engine would not compute it exactly:
    llama     attention_bias (also biases o_proj) refused
    qwen2     QKV bias always; use_sliding_window refused
    qwen3     q_norm/k_norm; head_dim free (HF default 128); attention_bias (biases o_proj too) and sliding windows
              refused
    qwen3_5   Qwen3_5TextConfig, or the multimodal Qwen3_5Config whose text model is `text_config` (the published
              Qwen3.5 / Qwen3.6 checkpoints; transformers' AutoModelForCausalLM builds the text model of either).
              layer_types (default: every `full_attention_interval`-th layer full attention, HF's rule), the gated
              attention (HF always gates: attn_output_gate=false is refused rather than ignored), q/k norms,
              zero-centred norms, partial RoPE (HF default 0.25), multimodal RoPE sections (text-only: no effect),
              the gated delta net's widths. Vision tower and MTP head are not part of the policy (hf_io drops
              their tensors, as transformers' Qwen3_5ForCausalLM does on load).
"""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import UserError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
}
"""HF class -> family."""
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
}
"""config.json model_type -> family."""
EXPORT_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",  # the text model: no vision tower, no MTP head
}
"""family -> the HF class written on export."""
QWEN3_5_GATED_NORM_GATES = (None, "swish")
"""Qwen3.5's `output_gate_type`: HF gates the linear-attention output norm with silu (= swish), whatever it says."""


def check_supported_architecture(model_type: Any, architectures: Any, *, where: str) -> str:
    """The family of a config's `model_type` and `architectures`, naming what is unsupported.

    Called on the raw config.json (hf_io.load_hf_config: transformers may re-map an unknown model_type) and on the
    parsed config."""
    if architectures is None:
        archs: list[Any] = []
    else:
        archs = list(architectures) if isinstance(architectures, (list, tuple)) else [architectures]
    family = MODEL_TYPES.get(model_type) if isinstance(model_type, str) else None
    supported = ", ".join(f"{cls} ({fam})" for cls, fam in SUPPORTED_ARCHITECTURES.items())
    bad_archs = [a for a in archs if a not in SUPPORTED_ARCHITECTURES]
    if bad_archs:
        raise UserError(f"unsupported architecture {bad_archs[0]!r}; supported: {supported}", where=where)
    if family is None:
        also = f" (architectures says {', '.join(archs)})" if archs else ""
        raise UserError(
            f"unsupported architecture: model_type {model_type!r}{also}; supported: {supported}", where=where
        )
    mismatched = [a for a in archs if SUPPORTED_ARCHITECTURES[a] != family]
    if mismatched:
        raise UserError(
            f"model_type {model_type!r} does not match architectures {mismatched[0]!r}", where=where
        )
    return family


def _as_dict(cfg: Any) -> dict[str, Any]:
    return cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)


def _rope(d: dict[str, Any], where: str) -> tuple[dict[str, Any], float]:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise UserError(f"rope scaling {rope_type!r} cannot be reproduced exactly; refusing", where=where)
    return rope, float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))


def arch_fields_from_hf(cfg: Any, *, where: str = "config.json") -> dict[str, Any]:
    """ModelArch(**fields) for a transformers config (or its dict), refusing what is not reproduced exactly."""
    top = _as_dict(cfg)
    family = check_supported_architecture(top.get("model_type"), top.get("architectures"), where=where)
    d = top
    if family == "qwen3_5" and isinstance(top.get("text_config"), dict):
        d = {**top["text_config"]}  # the multimodal container: its text model is the policy
        d.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", False))
    if d.get("hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act={d['hidden_act']!r} is not supported (only silu/SwiGLU)", where=where)
    if d.get("mlp_bias"):
        raise UserError("mlp_bias=true is not supported", where=where)
    rope, theta = _rope(d, where)
    if d.get("attention_bias") and family != "qwen2":
        # Llama's and Qwen3's attention_bias also put a bias on o_proj, which the parameter map does not carry
        raise UserError(f"{family} attention_bias=true (bias on o_proj) is not supported", where=where)
    if d.get("use_sliding_window"):
        raise UserError("use_sliding_window=true is not supported", where=where)
    try:
        n_heads = d["num_attention_heads"]
        fields: dict[str, Any] = dict(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_query_groups=d.get("num_key_value_heads") or n_heads,
            ffn_hidden_size=d["intermediate_size"],
            head_dim=d.get("head_dim"),
            rope_theta=theta,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            qkv_bias=family == "qwen2",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )
        if family == "qwen3":
            _qwen3(d, fields, where)
        elif family == "qwen3_5":
            _qwen3_5(d, rope, fields, where)
    except KeyError as e:
        raise UserError(f"missing field {e.args[0]!r}", where=where) from None
    return fields


def _qwen3(d: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    if fields["head_dim"] is None:
        fields["head_dim"] = 128  # transformers' Qwen3Config default (not hidden / heads)
    kinds = set(d.get("layer_types") or ["full_attention"])
    if kinds != {"full_attention"}:
        raise UserError(f"qwen3 layer_types {sorted(kinds)} (sliding windows) are not supported", where=where)
    fields["qk_norm"] = True


def _qwen3_5(d: dict[str, Any], rope: dict[str, Any], fields: dict[str, Any], where: str) -> None:
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


def hf_config_of(arch: Any) -> Any:  # arch: a models.arch.ModelArch (arch.py imports this module, not back)
    """The transformers config of `arch` (the text model for qwen3_5) that `arch_fields_from_hf` maps back."""
    import transformers

    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": arch.rope_theta}
    common: dict[str, Any] = dict(
        architectures=[EXPORT_CLASS[arch.family]],
        vocab_size=arch.vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.ffn_hidden_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_query_groups,
        head_dim=arch.head_dim,
        rms_norm_eps=arch.rms_norm_eps,
        tie_word_embeddings=arch.tie_word_embeddings,
        max_position_embeddings=arch.max_position_embeddings,
    )
    if arch.family == "llama":
        return transformers.LlamaConfig(attention_bias=False, rope_parameters=rope, **common)
    if arch.family == "qwen2":
        return transformers.Qwen2Config(rope_parameters=rope, **common)
    if arch.family == "qwen3":
        return transformers.Qwen3Config(attention_bias=False, rope_parameters=rope, **common)
    assert arch.family == "qwen3_5", arch.family
    rope["partial_rotary_factor"] = arch.rotary_percent
    if arch.mrope_section is not None:
        rope["mrope_section"] = list(arch.mrope_section)
    rope["mrope_interleaved"] = arch.mrope_interleaved
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
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
