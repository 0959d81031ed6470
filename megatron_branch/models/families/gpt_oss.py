"""gpt-oss (GptOssForCausalLM, transformers' `gpt_oss`): grouped-query attention with a bias on q/k/v AND o_proj,
learned per-head sinks in every row's softmax (GptOssAttention `sinks`; megatron's softmax_type="learnable", the core
attention's softmax_offset; merged once per row: attention/merge.py), sliding-window layers alternating with full
ones (layer_types "sliding_attention" / "full_attention", window `sliding_window`: megatron's window_size and
window_attn_skip_freq list; the window cuts THE plan: attention/window.py), every layer the MoE block GptOssMLP:

    logits  = x . W_router + b_router                   (GptOssTopKRouter: a bias, unlike every other family's)
    choice  = top-k of the logits;  weights = softmax over the k chosen logits   (megatron: softmax score function,
                                                          top-k before the softmax, i.e. moe_router_pre_softmax off)
    expert  = down(glu(gate_up(x) + b) ) + b_down,  glu = gate.clamp(max=L) * sigmoid(1.702 gate.clamp(max=L))
              * (up.clamp(-L, L) + 1)                   (GptOssExperts `_apply_gate`, L = swiglu_limit; megatron's
                                                          quick_gelu + activation_func_clamp_value + glu_linear_offset)
    out     = sum_k weights_k expert_k(x)               no shared experts

Every linear layer but the embeddings and lm_head has a bias (megatron's add_bias_linear). HF keeps each layer's
experts as four fused 3-D tensors, gate_up's columns interleaved (checkpoint/fused_experts.py, layouts.py). The
published checkpoints use YaRN RoPE (rope_type "yarn", truncate false): megatron's YarnRotaryEmbedding and its
concentration factor (models/rotary.py); an explicit attention_factor / mscale is refused. swiglu_alpha must be
1.702 (megatron's quick_gelu hard-codes it). megatron-core allows expert biases only at expert tensor parallel size
1: TP runs with every expert whole on each TP rank (--etp 1, models/expert_tp.py); experts split over TP are refused
(models/arch_checks.py); CP and EP run.
The planner prices it: a sliding layer's attention FLOPs over its window only (plan/flops.py attention_flops), the
sinks and biases in the parameters (plan/layers.py); presets gpt-oss-20b / gpt-oss-120b (plan/presets.py).
"""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.families.hf_fields import common_fields, default_rope
from megatron_branch.models.families.param_rules import (  # the shared rows (and their name stems)
    _ATTN,
    _EXP,
    _L,
    _M,
    EMBEDDING,
    HEAD,
    Rule,
    _attention,
    _moe,
)
from megatron_branch.models.families.registry import FamilySpec, register_family

# gpt-oss: Qwen2's attention names with a bias on o_proj too and the learned sinks (megatron's core attention
# softmax_offset), every layer the MoE block of GptOssMLP: a router with a bias, experts with biases stored fused
# (checkpoint/fused_experts.py presents them per expert), gate_up's columns interleaved (glu_interleaved*).
_OSS = _L + "mlp.experts.{j}."
GPT_OSS_RULES: tuple[Rule, ...] = (
    EMBEDDING,
    *_attention("qkv_interleave", None),
    Rule(
        mcore=_M + "self_attention.linear_proj.bias", hf=(_L + _ATTN + "o_proj.bias",), transform="identity"
    ),
    Rule(
        mcore=_M + "self_attention.core_attention.softmax_offset",
        hf=(_L + _ATTN + "sinks",),
        transform="identity",
    ),
    _moe("mlp.", "gate_proj", "up_proj", "down_proj")[0],  # the pre-MLP norm
    Rule(mcore=_M + "mlp.router.weight", hf=(_L + "mlp.router.weight",), transform="identity", mlp="moe"),
    Rule(mcore=_M + "mlp.router.bias", hf=(_L + "mlp.router.bias",), transform="identity", mlp="moe"),
    *(
        Rule(
            mcore=_EXP + f"local_experts.{{j}}.{fc}.{kind}",
            hf=(_OSS + hf,),
            transform=transform,
            te=_EXP + f"{fc}.{kind}{{j}}",
            key=_EXP + f"experts.{fc}.{kind}",
            mlp="moe",
        )
        for fc, kind, hf, transform in (
            ("linear_fc1", "weight", "gate_up_proj", "glu_interleaved_t"),
            ("linear_fc1", "bias", "gate_up_proj_bias", "glu_interleaved"),
            ("linear_fc2", "weight", "down_proj", "transpose"),
            ("linear_fc2", "bias", "down_proj_bias", "identity"),
        )
    ),
    *HEAD,
)

SWIGLU_ALPHA = 1.702
"""The one swiglu_alpha megatron computes (megatron.core.transformer.mlp.quick_gelu: x * sigmoid(1.702 x))."""
LAYER_KINDS = ("sliding_attention", "full_attention")
"""HF gpt_oss layer_types."""


def read_hf(d: dict[str, Any], where: str) -> dict[str, Any]:
    if not d.get("attention_bias", True):
        raise UserError(
            "gpt_oss attention_bias=false is not supported (megatron biases every linear)", where=where
        )
    if float(d.get("swiglu_alpha", SWIGLU_ALPHA)) != SWIGLU_ALPHA:
        raise UserError(
            f"gpt_oss swiglu_alpha={d['swiglu_alpha']} is not supported (only {SWIGLU_ALPHA})", where=where
        )
    rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
    yarn = rope.get("rope_type", rope.get("type")) == "yarn"
    if yarn:  # read here; common_fields sees the plain RoPE it refuses nothing of
        d = dict(d, rope_parameters={"rope_type": "default", "rope_theta": rope.get("rope_theta", 150000.0)})
    fields = common_fields("gpt_oss", d, where, qkv_bias=True)  # intermediate_size: the expert width
    if yarn:
        fields.update(yarn_fields(rope, d, where))
    n = fields["num_layers"]
    kinds = list(
        d.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    )
    bad = [k for k in kinds if k not in LAYER_KINDS]
    if bad or len(kinds) != n:
        raise UserError(
            f"gpt_oss layer_types must be {n} of {', '.join(LAYER_KINDS)}, got {kinds}", where=where
        )
    window = d.get("sliding_window")
    if window is None and "sliding_attention" in kinds:
        raise UserError("gpt_oss sliding_attention layers need sliding_window", where=where)
    fields.update(
        head_dim=fields["head_dim"] or fields["hidden_size"] // fields["num_attention_heads"],
        qkv_bias=True,
        linear_bias=True,
        attention_sinks=True,
        sliding_window=None if "sliding_attention" not in kinds else int(window),
        window_layers=None
        if "sliding_attention" not in kinds
        else tuple(int(k == "sliding_attention") for k in kinds),
        swiglu_limit=float(d.get("swiglu_limit", 7.0)),
        num_experts=int(d["num_local_experts"]),
        moe_top_k=int(d["num_experts_per_tok"]),
        moe_ffn_hidden_size=int(d["intermediate_size"]),
        moe_norm_topk_prob=True,  # GptOssTopKRouter: softmax over the top-k logits
    )
    return fields


def yarn_fields(rope: dict[str, Any], d: dict[str, Any], where: str) -> dict[str, Any]:
    """ModelArch's yarn_* fields of HF's YaRN rope parameters (transformers' `_compute_yarn_parameters`); an explicit
    attention_factor / mscale / mscale_all_dim (which gpt-oss never sets) is refused rather than half-honoured."""
    for key in ("attention_factor", "mscale", "mscale_all_dim"):
        if rope.get(key) is not None:
            raise UserError(f"gpt_oss yarn {key}={rope[key]} is not supported", where=where)
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or d.get("max_position_embeddings", original) / original
    return dict(
        yarn_factor=float(factor),
        yarn_original_max_position_embeddings=original,
        yarn_beta_fast=float(rope.get("beta_fast") or 32.0),
        yarn_beta_slow=float(rope.get("beta_slow") or 1.0),
        yarn_truncate=bool(rope.get("truncate", True)),
    )


def _rope(arch: Any) -> dict[str, Any]:
    if arch.yarn_factor is None:
        return default_rope(arch)
    return {
        "rope_type": "yarn",
        "rope_theta": arch.rope_theta,
        "factor": arch.yarn_factor,
        "original_max_position_embeddings": arch.yarn_original_max_position_embeddings,
        "beta_fast": arch.yarn_beta_fast,
        "beta_slow": arch.yarn_beta_slow,
        "truncate": arch.yarn_truncate,
    }


def _layer_types(arch: Any) -> list[str]:
    return [LAYER_KINDS[arch.window_of(i) is None] for i in range(arch.num_layers)]


def hf_config(arch: Any, common: dict[str, Any]) -> Any:
    import transformers

    return transformers.GptOssConfig(
        rope_parameters=_rope(arch),
        sliding_window=arch.sliding_window,
        layer_types=_layer_types(arch),
        num_local_experts=arch.num_experts,
        num_experts_per_tok=arch.moe_top_k,
        swiglu_limit=arch.swiglu_limit,
        attention_bias=True,
        output_router_logits=False,
        **{**common, "intermediate_size": arch.moe_ffn_hidden_size},
    )


TINY_OSS = dict(
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=16,
    sliding_window=4,
    swiglu_limit=1.0,
)
"""The tiny gpt-oss: 4 experts of width 16, top-2; a window of 4 positions (a tree branch's window ends inside its
ancestors, or short of them); the clamp at 1.0 so that it binds on the tiny model's activations."""


TINY_YARN = dict(
    rope_type="yarn",
    factor=4.0,
    original_max_position_embeddings=64,
    beta_fast=32.0,
    beta_slow=1.0,
    truncate=False,
)
"""The tiny gpt-oss's YaRN parameters (gpt-oss-20b's: factor 32 over 4096, truncate false)."""


def tiny_hf_config(
    common: dict[str, Any], *, head_dim: int | None = None, moe: dict[str, Any] | None = None, **_: Any
) -> Any:
    """TINY_OSS, hidden 64, head_dim 16, layer 0 sliding and layer 1 full (HF's alternation), YaRN RoPE as the
    published configs have it (factor 4 over an original context of 64: the ramp blends dims 0 to 2)."""
    import transformers

    rope = dict(common["rope_parameters"], **TINY_YARN)
    return transformers.GptOssConfig(
        architectures=["GptOssForCausalLM"],
        head_dim=head_dim or 16,
        attention_bias=True,
        **{**common, "hidden_size": 64, "rope_parameters": rope, **TINY_OSS, **(moe or {})},
    )


GPT_OSS = register_family(
    FamilySpec(
        name="gpt_oss",
        architectures=("GptOssForCausalLM",),
        model_types=("gpt_oss",),
        export_class="GptOssForCausalLM",
        read_hf=read_hf,
        hf_config=hf_config,
        param_rules=GPT_OSS_RULES,
        tiny_hf_config=tiny_hf_config,
        layer_kinds=("attention", "moe"),
        moe=True,
        train_defaults={"qkv_bias": True},
    )
)
