"""The declarative rules of the one map between Hugging Face and megatron-core parameter names: the shared rows
every family's spec picks its rules from (models/families/*.py `param_rules`; the map's functions over them:
checkpoint/param_map.py).

Each `Rule` pairs a megatron name with the HF names it is made from and a named transform. Every transform is a
pure, linear re-arrangement of rows (concatenation, interleaving, zero padding), so the same map converts weights
and gradients, in both directions, bit-exactly. A rule applies to the layers of one kind (`layers`: full or linear
attention, models/arch.py `layer_types`) and under a condition of the arch (`when`).

Layouts (verified against megatron-core 0.16.1 source; checkpoint/layouts.py does the arithmetic):
- linear_qkv (transformer/attention.py, get_query_key_value_tensors): rows grouped per query group g:
  [the n/ng query heads of g, (with attention_output_gate) their n/ng gate heads, the k head of g, the v head of
  g], each head `head_dim` rows. Bias alike. HF's gated q_proj holds [query; gate] per head.
- linear_fc1 with gated_linear_unit (transformer/mlp.py): the full weight is [gate; up] (SwiGLU chunks the output
  in two halves). Under TP each rank holds [gate_r; up_r]; tp.py handles that, this file sees full tensors only.
- GatedDeltaNet in_proj (ssm/gated_delta_net.py): the full weight is [q; k; v; z; beta; alpha] (its dist
  checkpoint saves these six parts as separate keys), each rank holding [q_r; k_r; v_r; z_r; beta_r; alpha_r]
  (tp.py); HF's in_proj_qkv / in_proj_z / in_proj_b / in_proj_a stacked. conv1d [q; k; v] channels, as HF's.
- word_embeddings / output_layer: `padded_vocab` rows; rows past the tokenizer's vocabulary are zeros here and
  are dropped on export.
- Two megatron layer specs, one map: the local spec (`get_gpt_layer_local_spec`, and models/gdn.py for GDN layers)
  names the norms `input_layernorm` / `pre_mlp_layernorm`; the TransformerEngine specs leave those slots IdentityOp
  and fuse each norm into the next projection, whose norm weight is `linear_qkv.layer_norm_weight` (GDN layers:
  `in_proj.layer_norm_weight`) / `linear_fc1.layer_norm_weight`. A rule's `te` field is its TE name when it
  differs; every tensor and transform is the same.
- Mixture of experts (models/moe.py): the router `mlp.router.weight` is HF's `mlp.gate.weight` (Mixtral:
  `block_sparse_moe.gate.weight`); routed expert j is `mlp.experts.local_experts.{j}.linear_fc1/fc2` (megatron's
  SequentialMLP; under expert parallelism a rank holds local experts 0..E/ep-1, checkpoint/tp.py names them by
  their global index) or TEGroupedMLP's `mlp.experts.linear_fc1.weight{j}` (the TE name), [gate; up] from HF's
  per-expert gate_proj/up_proj (Mixtral w1/w3); the shared expert (Qwen2-MoE) is `mlp.shared_experts.*` with
  `gate_weight` = `shared_expert_gate.weight`. HF names are the checkpoint's (save_pretrained writes one tensor
  per expert; transformers fuses them into 3-D tensors in memory only). A rule with `{j}` stands for one rule per
  expert. Dense layers of a MoE model (mlp_only_layers) keep the dense MLP rules (`mlp="dense"`). In a dist
  checkpoint every expert of a layer is one key (`mlp.experts.experts.linear_fc1.weight`, the global expert
  index an axis: megatron's SequentialMLP.sharded_state_dict), and a MoE layer's pre-MLP norm is
  `pre_mlp_layernorm.weight` under both specs (the TE MoE spec keeps that norm apart: nothing to fuse it into).
- HF containers: a qwen3_5 / qwen3_5_moe checkpoint may be the multimodal ...ForConditionalGeneration, whose text
  model is under `model.language_model.`; its vision tower (`model.visual.`) and MTP head (`mtp.`, Qwen3-Next's
  too) are not part of the policy and are not converted (transformers' ...ForCausalLM drops them on load the same
  way).
- MoE hybrids (qwen3_5_moe, qwen3_next): the hybrid's attention and GDN rules with the MoE rules in the MLP slot.
  Qwen3-Next's GDN projections are HF's in_proj_qkvz / in_proj_ba, rows grouped per key head
  (`gdn_in_proj_grouped`, layouts.py); the published Qwen3.5-MoE checkpoints store each layer's experts as two 3-D
  tensors (`mlp.experts.gate_up_proj` [E, 2e, h], `mlp.experts.down_proj` [E, h, e]), read as the per-expert
  tensors save_pretrained writes (hf_io.py `split_fused_experts`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Buffers some older HF checkpoints carry; recomputed from the config, never converted.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
CONTAINER_TEXT_PREFIXES = (("model.language_model.", "model."),)
"""(stored prefix, canonical prefix): a multimodal container's text model under the names the rules use."""
TRANSFORM_NAMES = (
    "identity",
    "qkv_interleave",
    "qkv_bias_interleave",
    "qkv_gate_interleave",
    "fused_gate_up",
    "gdn_in_proj",
    "gdn_in_proj_grouped",
    "vocab_pad",
    *("glu_interleaved_t", "glu_interleaved", "transpose"),  # gpt-oss's experts (layouts.py)
)
"""The transforms' names (checkpoint/layouts.py TRANSFORMS implements exactly these: asserted there)."""
SPECS = ("local", "te")
"""megatron layer specs the map names tensors for: megatron-core's local spec and its TransformerEngine spec."""
WHEN = (
    None,
    *"qkv_bias untied qk_norm shared_expert shared_expert_gate expert_bias mamba_conv_bias q_lora no_q_lora".split(),
)
PATTERN_LAYERS = ("M", "*", "-")
"""`Rule.layers` of a hybrid_override_pattern model (Nemotron-H): the rule applies to the layers of that character
(models/mamba_arch.py)."""


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One megatron tensor <-> one or more HF tensors. `{i}` in a name is the layer index."""

    mcore: str
    hf: tuple[str, ...]
    transform: str
    """One of TRANSFORM_NAMES (checkpoint/layouts.py TRANSFORMS)."""
    when: str | None = None
    """None (always), "qkv_bias" (arch.qkv_bias), "untied" (not arch.tie_word_embeddings), "qk_norm", ...,
    "q_lora" / "no_q_lora" (MLA's query bottleneck: arch.q_lora_rank set or None); one of WHEN."""
    te: str | None = None
    """The megatron name under the TransformerEngine layer spec, when it differs from `mcore`."""
    layers: str | None = None
    """Per-layer rules only: None (every layer), "full" (full-attention layers) or "linear" (gated delta net)."""
    mlp: str | None = None
    """Per-layer rules only: None (every layer), "dense" (a SwiGLU MLP) or "moe" (a MoELayer) in the MLP slot."""
    key: str | None = None
    """The dist-checkpoint key (with `{i}`) when it is neither the local nor the TE name (every expert of a layer
    is one key)."""

    def __post_init__(self) -> None:
        assert self.transform in TRANSFORM_NAMES, self.transform
        assert self.when in WHEN, self.when
        assert self.layers in (None, "full", "linear", *PATTERN_LAYERS), self.layers
        assert self.mlp in (None, "dense", "moe"), self.mlp

    def name(self, spec: str = "local") -> str:
        """The megatron name (with `{i}`) under `spec` ("local" or "te")."""
        assert spec in SPECS, spec
        return self.te if spec == "te" and self.te else self.mcore

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.mcore

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.mcore

    def for_expert(self, j: int) -> Rule:
        """This rule for routed expert `j` (its `{j}` filled in; `{i}` kept)."""
        fill = lambda n: None if n is None else n.replace("{j}", str(j))  # noqa: E731
        return dataclasses.replace(
            self, mcore=fill(self.mcore), hf=tuple(fill(h) for h in self.hf), te=fill(self.te)
        )

    def checkpoint_key(self) -> str:
        """The dist-checkpoint key (with `{i}`): megatron names tensors as the TE layer spec's module tree does."""
        return self.key or self.name("te")


_L = "model.layers.{i}."
_M = "decoder.layers.{i}."
_ATTN = "self_attn."
_LIN = "linear_attn."
EMBEDDING = Rule(
    mcore="embedding.word_embeddings.weight", hf=("model.embed_tokens.weight",), transform="vocab_pad"
)
HEAD = (
    Rule(mcore="decoder.final_layernorm.weight", hf=("model.norm.weight",), transform="identity"),
    Rule(mcore="output_layer.weight", hf=("lm_head.weight",), transform="vocab_pad", when="untied"),
)


def _mlp(kind: str | None) -> tuple[Rule, ...]:
    """The dense SwiGLU MLP (with its norm): on every layer (`kind` None), or on a MoE model's dense layers."""
    return (
        Rule(
            mcore=_M + "pre_mlp_layernorm.weight",
            hf=(_L + "post_attention_layernorm.weight",),
            transform="identity",
            te=_M + "mlp.linear_fc1.layer_norm_weight",
            mlp=kind,
        ),
        Rule(
            mcore=_M + "mlp.linear_fc1.weight",
            hf=(_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
            transform="fused_gate_up",
            mlp=kind,
        ),
        Rule(
            mcore=_M + "mlp.linear_fc2.weight",
            hf=(_L + "mlp.down_proj.weight",),
            transform="identity",
            mlp=kind,
        ),
    )


MLP = _mlp(None)
_EXP = _M + "mlp.experts."


def _moe(block: str, gate: str, up: str, down: str) -> tuple[Rule, ...]:
    """A MoELayer (router + routed experts) whose HF block is `block` ("mlp." or Mixtral's "block_sparse_moe.")
    and whose expert j holds `gate` / `up` / `down` (HF's per-expert names)."""
    hf_expert = _L + block + "experts.{j}."
    return (
        Rule(
            mcore=_M + "pre_mlp_layernorm.weight",
            hf=(_L + "post_attention_layernorm.weight",),
            transform="identity",
            mlp="moe",
        ),
        Rule(
            mcore=_M + "mlp.router.weight", hf=(_L + block + "gate.weight",), transform="identity", mlp="moe"
        ),
        Rule(
            mcore=_EXP + "local_experts.{j}.linear_fc1.weight",
            hf=(hf_expert + gate + ".weight", hf_expert + up + ".weight"),
            transform="fused_gate_up",
            te=_EXP + "linear_fc1.weight{j}",
            key=_EXP + "experts.linear_fc1.weight",
            mlp="moe",
        ),
        Rule(
            mcore=_EXP + "local_experts.{j}.linear_fc2.weight",
            hf=(hf_expert + down + ".weight",),
            transform="identity",
            te=_EXP + "linear_fc2.weight{j}",
            key=_EXP + "experts.linear_fc2.weight",
            mlp="moe",
        ),
    )


SHARED_EXPERT = (
    Rule(
        mcore=_M + "mlp.shared_experts.linear_fc1.weight",
        hf=(_L + "mlp.shared_expert.gate_proj.weight", _L + "mlp.shared_expert.up_proj.weight"),
        transform="fused_gate_up",
        when="shared_expert",
        mlp="moe",
    ),
    Rule(
        mcore=_M + "mlp.shared_experts.linear_fc2.weight",
        hf=(_L + "mlp.shared_expert.down_proj.weight",),
        transform="identity",
        when="shared_expert",
        mlp="moe",
    ),
    Rule(
        mcore=_M + "mlp.shared_experts.gate_weight",
        hf=(_L + "mlp.shared_expert_gate.weight",),
        transform="identity",
        when="shared_expert_gate",
        mlp="moe",
    ),
)


# The DeepSeek-style MoE block (GLM-4.5's Glm4MoeMoE, DeepSeek-V3's): the sigmoid router's correction bias (a
# float32 buffer in HF, megatron's router `expert_bias`: models/moe.py keeps it a frozen parameter) and the shared
# experts, plural and ungated, one SwiGLU of n_shared_experts x moe_intermediate_size.
EXPERT_BIAS = Rule(
    mcore=_M + "mlp.router.expert_bias",
    hf=(_L + "mlp.gate.e_score_correction_bias",),
    transform="identity",
    when="expert_bias",
    mlp="moe",
)
SHARED_EXPERTS = tuple(
    dataclasses.replace(r, hf=tuple(h.replace("mlp.shared_expert.", "mlp.shared_experts.") for h in r.hf))
    for r in SHARED_EXPERT
    if r.when == "shared_expert"
)


def _attention(qkv: str, layers: str | None) -> tuple[Rule, ...]:
    """A full-attention block whose fused QKV is assembled by transform `qkv`."""
    return (
        Rule(
            mcore=_M + "input_layernorm.weight",
            hf=(_L + "input_layernorm.weight",),
            transform="identity",
            te=_M + "self_attention.linear_qkv.layer_norm_weight",
            layers=layers,
        ),
        Rule(
            mcore=_M + "self_attention.linear_qkv.weight",
            hf=tuple(_L + _ATTN + f"{p}_proj.weight" for p in "qkv"),
            transform=qkv,
            layers=layers,
        ),
        Rule(
            mcore=_M + "self_attention.linear_qkv.bias",
            hf=tuple(_L + _ATTN + f"{p}_proj.bias" for p in "qkv"),
            transform="qkv_bias_interleave",
            when="qkv_bias",
            layers=layers,
        ),
        Rule(
            mcore=_M + "self_attention.q_layernorm.weight",
            hf=(_L + _ATTN + "q_norm.weight",),
            transform="identity",
            when="qk_norm",
            layers=layers,
        ),
        Rule(
            mcore=_M + "self_attention.k_layernorm.weight",
            hf=(_L + _ATTN + "k_norm.weight",),
            transform="identity",
            when="qk_norm",
            layers=layers,
        ),
        Rule(
            mcore=_M + "self_attention.linear_proj.weight",
            hf=(_L + _ATTN + "o_proj.weight",),
            transform="identity",
            layers=layers,
        ),
    )


GATED_DELTA_NET = (
    Rule(
        mcore=_M + "input_layernorm.weight",
        hf=(_L + "input_layernorm.weight",),
        transform="identity",
        te=_M + "self_attention.in_proj.layer_norm_weight",
        layers="linear",
    ),
    Rule(
        mcore=_M + "self_attention.in_proj.weight",
        hf=tuple(_L + _LIN + f"in_proj_{p}.weight" for p in ("qkv", "z", "b", "a")),
        transform="gdn_in_proj",
        layers="linear",
    ),
    Rule(
        mcore=_M + "self_attention.conv1d.weight",
        hf=(_L + _LIN + "conv1d.weight",),
        transform="identity",
        layers="linear",
    ),
    Rule(mcore=_M + "self_attention.A_log", hf=(_L + _LIN + "A_log",), transform="identity", layers="linear"),
    Rule(
        mcore=_M + "self_attention.dt_bias",
        hf=(_L + _LIN + "dt_bias",),
        transform="identity",
        layers="linear",
    ),
    Rule(
        mcore=_M + "self_attention.out_norm.weight",
        hf=(_L + _LIN + "norm.weight",),
        transform="identity",
        layers="linear",
    ),
    Rule(
        mcore=_M + "self_attention.out_proj.weight",
        hf=(_L + _LIN + "out_proj.weight",),
        transform="identity",
        layers="linear",
    ),
)

# Llama, Qwen2 and Qwen3 share names: Qwen2 adds the QKV bias (arch.qkv_bias), Qwen3 the q/k norms (arch.qk_norm).
DECODER_RULES: tuple[Rule, ...] = (EMBEDDING, *_attention("qkv_interleave", None), *MLP, *HEAD)
HYBRID_RULES: tuple[Rule, ...] = (
    EMBEDDING,
    *_attention("qkv_gate_interleave", "full"),
    *GATED_DELTA_NET,
    *MLP,
    *HEAD,
)
# Qwen3-Next stores each GDN layer's projections fused per key head: in_proj_qkvz, in_proj_ba (layouts.py)
GATED_DELTA_NET_GROUPED = tuple(
    dataclasses.replace(
        r,
        hf=(_L + _LIN + "in_proj_qkvz.weight", _L + _LIN + "in_proj_ba.weight"),
        transform="gdn_in_proj_grouped",
    )
    if r.transform == "gdn_in_proj"
    else r
    for r in GATED_DELTA_NET
)
# The MoE hybrids: Qwen3.5-MoE (every layer MoE) and Qwen3-Next (dense layers where its config says), the gated
# attention and delta net of the hybrids, the experts of Qwen2-MoE (shared expert and its gate)
QWEN3_5_MOE_RULES: tuple[Rule, ...] = (
    EMBEDDING,
    *_attention("qkv_gate_interleave", "full"),
    *GATED_DELTA_NET,
    *_moe("mlp.", "gate_proj", "up_proj", "down_proj"),
    *SHARED_EXPERT,
    *HEAD,
)
QWEN3_NEXT_RULES: tuple[Rule, ...] = (
    EMBEDDING,
    *_attention("qkv_gate_interleave", "full"),
    *GATED_DELTA_NET_GROUPED,
    *_mlp("dense"),
    *_moe("mlp.", "gate_proj", "up_proj", "down_proj"),
    *SHARED_EXPERT,
    *HEAD,
)
# Qwen3-MoE and Qwen2-MoE share names (Qwen2-MoE adds the QKV bias and the shared expert); Mixtral is Llama's
# attention with the experts under block_sparse_moe and w1 / w3 / w2.
QWEN_MOE_RULES: tuple[Rule, ...] = (
    EMBEDDING,
    *_attention("qkv_interleave", None),
    *_mlp("dense"),
    *_moe("mlp.", "gate_proj", "up_proj", "down_proj"),
    *SHARED_EXPERT,
    *HEAD,
)
MIXTRAL_RULES: tuple[Rule, ...] = (
    EMBEDDING,
    *_attention("qkv_interleave", None),
    *_moe("block_sparse_moe.", "w1", "w3", "w2"),
    *HEAD,
)
# GLM-4.5 / 4.6 MoE: Qwen2's attention names (q/k/v bias, Qwen3's q/k norms when use_qk_norm), dense layers first
# (first_k_dense_replace), then the DeepSeek-style MoE block.
DEEPSEEK_MOE: tuple[Rule, ...] = (
    *_mlp("dense"),
    *_moe("mlp.", "gate_proj", "up_proj", "down_proj"),
    EXPERT_BIAS,
    *SHARED_EXPERTS,
)
"""The DeepSeek MoE block's MLP slots (GLM-4.5's and DeepSeek-V3's: models/families/deepseek_v3.py)."""
GLM4_MOE_RULES: tuple[Rule, ...] = (EMBEDDING, *_attention("qkv_interleave", None), *DEEPSEEK_MOE, *HEAD)
