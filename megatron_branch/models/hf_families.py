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
    qwen3_moe Qwen3 attention + num_experts / num_experts_per_tok / moe_intermediate_size / norm_topk_prob; layer i
              is MoE unless i is in mlp_only_layers or (i + 1) % decoder_sparse_step != 0 (HF's rule), dense layers
              use intermediate_size
    mixtral   Llama attention, num_local_experts, every layer MoE, top-k renormalised; router_jitter_noise > 0
              (random) and sliding_window refused
    qwen2_moe Qwen2 attention (qkv_bias, default true) + experts as qwen3_moe + the shared expert
              (shared_expert_intermediate_size) with its sigmoid gate
    qwen3_5_moe  Qwen3_5MoeTextConfig, or the multimodal Qwen3_5MoeConfig (text_config): the qwen3_5 hybrid with a
              MoE block in EVERY layer (transformers' Qwen3_5MoeDecoderLayer builds no dense MLP, so
              mlp_only_layers / decoder_sparse_step mean nothing), top-k always renormalised (its router has no
              norm_topk_prob switch), a shared expert with its sigmoid gate
    qwen3_next   Qwen3NextConfig: the same hybrid (gated attention, zero-centred norms, partial RoPE; text only, no
              multimodal RoPE) with the gated delta net's projections fused per key head (in_proj_qkvz, in_proj_ba:
              checkpoint/layouts.py), MoE layers as qwen3_moe (decoder_sparse_step, mlp_only_layers,
              norm_topk_prob, default true) plus the gated shared expert
    router_aux_loss_coef / output_router_logits are HF's training switches, not architecture: the router losses a run
    uses are its own settings (train config `actor.moe`, grad's --moe-* flags).
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
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3NextForCausalLM": "qwen3_next",
}
"""HF class -> family."""
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_moe": "qwen3_moe",
    "mixtral": "mixtral",
    "qwen2_moe": "qwen2_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}
"""config.json model_type -> family."""
EXPORT_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",  # the text model: no vision tower, no MTP head
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",  # the text model
    "qwen3_next": "Qwen3NextForCausalLM",
}
"""family -> the HF class written on export."""
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "qwen3_5_moe", "qwen3_next")
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")
"""Families whose layers are gated delta net or gated attention (`_qwen3_5`)."""
CONTAINER_FAMILIES = ("qwen3_5", "qwen3_5_moe")
"""Families whose multimodal config holds the text model's fields under `text_config`."""
GATED_SHARED_EXPERT_FAMILIES = ("qwen2_moe", "qwen3_5_moe", "qwen3_next")
"""Families whose MoE block adds a shared expert scaled by sigmoid(x . w) (Qwen2MoeSparseMoeBlock and its heirs)."""
QKV_BIAS_FAMILIES = ("qwen2", "qwen2_moe")
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
    if family in CONTAINER_FAMILIES and isinstance(top.get("text_config"), dict):
        d = {**top["text_config"]}  # the multimodal container: its text model is the policy
        d.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", False))
    if d.get("hidden_act", "silu") != "silu":
        raise UserError(f"hidden_act={d['hidden_act']!r} is not supported (only silu/SwiGLU)", where=where)
    if d.get("mlp_bias"):
        raise UserError("mlp_bias=true is not supported", where=where)
    rope, theta = _rope(d, where)
    if d.get("attention_bias") and family not in QKV_BIAS_FAMILIES:
        # Llama's and Qwen3's attention_bias also put a bias on o_proj, which the parameter map does not carry
        raise UserError(f"{family} attention_bias=true (bias on o_proj) is not supported", where=where)
    if d.get("use_sliding_window"):
        raise UserError("use_sliding_window=true is not supported", where=where)
    if family == "mixtral" and d.get("sliding_window") is not None:
        raise UserError(f"sliding_window={d['sliding_window']} is not supported", where=where)
    try:
        n_heads = d["num_attention_heads"]
        fields: dict[str, Any] = dict(
            family=family,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            num_layers=d["num_hidden_layers"],
            num_attention_heads=n_heads,
            num_query_groups=d.get("num_key_value_heads") or n_heads,
            # mixtral: every layer MoE, this is the expert width; qwen3_5_moe has no dense MLP and no such field
            ffn_hidden_size=d["moe_intermediate_size" if family == "qwen3_5_moe" else "intermediate_size"],
            head_dim=d.get("head_dim"),
            rope_theta=theta,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            qkv_bias=family == "qwen2" or (family == "qwen2_moe" and bool(d.get("qkv_bias", True))),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
        )
        if family in ("qwen3", "qwen3_moe"):
            _qwen3(d, fields, where)
        elif family in HYBRID_FAMILIES:
            _qwen3_5(d, rope, fields, where)
        if family in MOE_FAMILIES:
            _moe(family, d, fields, where)
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


def _moe(family: str, d: dict[str, Any], fields: dict[str, Any], where: str) -> None:
    """The experts of the MoE families (megatron's MoELayer, models/moe.py)."""
    n = fields["num_layers"]
    if family == "mixtral":
        if float(d.get("router_jitter_noise") or 0.0) > 0:
            raise UserError(
                f"router_jitter_noise={d['router_jitter_noise']} (random input noise) cannot be reproduced exactly",
                where=where,
            )
        fields.update(
            num_experts=int(d["num_local_experts"]),
            moe_top_k=int(d["num_experts_per_tok"]),
            moe_ffn_hidden_size=int(d["intermediate_size"]),
            moe_norm_topk_prob=True,  # MixtralTopKRouter always renormalises the top-k
        )
        return
    # Qwen3MoeConfig maps num_experts (the published config.json's name) onto num_local_experts (what it writes)
    num = int(d["num_experts"] if "num_experts" in d else d["num_local_experts"])
    step = int(d.get("decoder_sparse_step", 1) or 1)
    dense = set(d.get("mlp_only_layers") or [])
    if family == "qwen3_5_moe":  # Qwen3_5MoeDecoderLayer: a sparse block in every layer, whatever these say
        step, dense = 1, set()
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
    fields.update(
        num_experts=num,
        moe_top_k=int(d["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(d["moe_intermediate_size"]),
        moe_norm_topk_prob=_norm_topk_prob(family, d),
        moe_layer_pattern=None if all(pattern) else pattern,
    )
    if family in GATED_SHARED_EXPERT_FAMILIES:
        fields.update(
            shared_expert_ffn_hidden_size=int(d["shared_expert_intermediate_size"]),
            shared_expert_gate=True,  # Qwen2MoeSparseMoeBlock and its heirs always gate their shared expert
        )


def _norm_topk_prob(family: str, d: dict[str, Any]) -> bool:
    """Whether the family's router renormalises the top-k probabilities, as transformers computes it."""
    if family == "qwen3_5_moe":
        return True  # Qwen3_5MoeTopKRouter always renormalises (it reads no norm_topk_prob)
    return bool(d.get("norm_topk_prob", family == "qwen3_next"))  # HF's defaults: Qwen3-Next true, else false


def _moe_hf_fields(arch: Any) -> dict[str, Any]:  # arch: a models.arch.ModelArch
    """The HF config fields of `arch`'s experts (what `_moe` reads back)."""
    dense = (
        [] if arch.moe_layer_pattern is None else [i for i, m in enumerate(arch.moe_layer_pattern) if not m]
    )
    out: dict[str, Any] = dict(
        num_experts=arch.num_experts,
        num_experts_per_tok=arch.moe_top_k,
        moe_intermediate_size=arch.moe_ffn_hidden_size,
        norm_topk_prob=arch.moe_norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=dense,
        output_router_logits=False,
    )
    if arch.family in GATED_SHARED_EXPERT_FAMILIES:
        out["shared_expert_intermediate_size"] = arch.shared_expert_ffn_hidden_size
    if arch.family == "qwen3_5_moe":  # its config has no such fields (every layer MoE, always renormalised)
        for name in ("norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
            del out[name]
    return out


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
    if arch.family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            attention_bias=False, rope_parameters=rope, **_moe_hf_fields(arch), **common
        )
    if arch.family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            rope_parameters=rope, qkv_bias=arch.qkv_bias, **_moe_hf_fields(arch), **common
        )
    if arch.family == "mixtral":
        return transformers.MixtralConfig(
            rope_parameters=rope,
            num_local_experts=arch.num_experts,
            num_experts_per_tok=arch.moe_top_k,
            router_jitter_noise=0.0,
            output_router_logits=False,
            **{**common, "intermediate_size": arch.moe_ffn_hidden_size},
        )
    assert arch.family in HYBRID_FAMILIES, arch.family
    rope["partial_rotary_factor"] = arch.rotary_percent
    if arch.mrope_section is not None:
        rope["mrope_section"] = list(arch.mrope_section)
    if arch.family != "qwen3_next":  # text only: no multimodal RoPE fields
        rope["mrope_interleaved"] = arch.mrope_interleaved
    hybrid: dict[str, Any] = dict(
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
    if arch.family == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5TextConfig

        return Qwen3_5TextConfig(**hybrid)
    if arch.family == "qwen3_next":
        return transformers.Qwen3NextConfig(**_moe_hf_fields(arch), **hybrid)
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    del hybrid["intermediate_size"]  # no dense MLP in any layer
    return Qwen3_5MoeTextConfig(**_moe_hf_fields(arch), **hybrid)
