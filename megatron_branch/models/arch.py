"""The architecture description shared by model building, checkpoint conversion, the planner and the CLI:
`ModelArch`, the one description of a model. Its megatron-core `TransformerConfig` is models/transformer_config.py;
the Hugging Face side (which config.json fields mean what) is the family's ONE file in models/families/ (llama.py,
qwen3_5.py, ...), which refuses in one line (`UserError`) what is not reproduced exactly (rope scaling, MLP bias,
...). Mixtures of experts run on megatron's MoELayer (models/moe.py), gated delta nets on its GatedDeltaNet
(models/gdn.py), Mamba-2 layers on its MambaMixer (models/mamba.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.errors import UserError
from megatron_branch.models.arch_checks import (
    LAYER_TYPES,  # noqa: F401  (re-exported: HF's token-mixer names)
    check_expert_parallel,
    check_layer_types,
    check_moe_fields,
    check_tensor_parallel,
    check_window_fields,
)
from megatron_branch.models.families import arch_fields_from_hf, families, get_family, hf_config_of
from megatron_branch.models.mla import check_mla
from megatron_branch.models.transformer_config import transformer_config_of
from megatron_branch.rules import check_hybrid_run


@dataclass(kw_only=True)
class ModelArch:
    """A decoder-only transformer of one of the registered families (models/families/)."""

    family: str
    """A registered family (models/families/); decides the HF class written back on export and the parameter
    map."""
    vocab_size: int
    """Vocabulary size of the tokenizer (unpadded). Megatron pads it to a multiple of TP; see `padded_vocab_size`."""
    hidden_size: int
    """Model width."""
    num_layers: int
    """Number of transformer layers."""
    num_attention_heads: int
    """Query heads (full-attention layers)."""
    num_query_groups: int
    """Key/value heads (GQA groups); equal to num_attention_heads for plain multi-head attention."""
    ffn_hidden_size: int
    """SwiGLU inner width (HF `intermediate_size`)."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads (Qwen3 and Qwen3.5 set it freely)."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (every norm of the model)."""
    qkv_bias: bool = False
    """Bias on the Q/K/V projections (Qwen2: True)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is built for (RoPE table length)."""
    qk_norm: bool = False
    """RMSNorm over each head's query and key, before RoPE (Qwen3, Qwen3.5: HF q_norm/k_norm; megatron's
    qk_layernorm with a norm in the q/k slots)."""
    zero_centered_norm: bool = False
    """RMSNorm weights stored as offsets from one, y = x / rms(x) * (1 + w) (Qwen3.5's Qwen3_5RMSNorm; megatron's
    layernorm_zero_centered_gamma). Every norm of the model, except a linear-attention layer's gated output norm,
    which HF computes as w * x / rms(x) (Qwen3_5RMSNormGated) and which is kept so (compat/norm.py)."""
    attention_output_gate: bool = False
    """q_proj also yields a per-head gate and the attention output is multiplied by sigmoid(gate) before o_proj
    (Qwen3.5's gated attention; megatron's attention_output_gate)."""
    rotary_percent: float = 1.0
    """Fraction of each head's dims RoPE rotates, the first ones (HF partial_rotary_factor; Qwen3.5: 0.25)."""
    mrope_section: tuple[int, ...] | None = None
    """Qwen3.5's multimodal RoPE sections (HF rope_parameters.mrope_section), carried to the exported config. Text
    positions are equal in all three sections, so for text the multimodal RoPE IS 1-D RoPE over the rotated dims
    (tests/unit/test_hybrid_models.py checks it against HF)."""
    mrope_interleaved: bool = False
    """HF rope_parameters.mrope_interleaved, carried to the exported config (no effect on text positions)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer "full_attention" or "linear_attention" (HF layer_types); None = every layer full attention."""
    linear_conv_kernel_dim: int = 4
    """Linear-attention layers: width of the causal depthwise convolution over q, k, v."""
    linear_key_head_dim: int = 0
    """Linear-attention layers: query/key head width (0 when the model has none)."""
    linear_value_head_dim: int = 0
    """Linear-attention layers: value head width, also the gated output norm's width."""
    linear_num_key_heads: int = 0
    """Linear-attention layers: query/key heads."""
    linear_num_value_heads: int = 0
    """Linear-attention layers: value heads (a multiple of linear_num_key_heads; each key head serves
    linear_num_value_heads // linear_num_key_heads consecutive value heads)."""
    num_experts: int = 0
    """Routed experts per MoE layer (HF num_experts / num_local_experts); 0 = a dense model."""
    moe_top_k: int = 0
    """Experts each token is routed to (HF num_experts_per_tok)."""
    moe_ffn_hidden_size: int = 0
    """SwiGLU inner width of each routed expert (HF moe_intermediate_size; Mixtral: intermediate_size)."""
    moe_norm_topk_prob: bool = True
    """Renormalise the top-k probabilities to sum to one (HF norm_topk_prob; Mixtral always): megatron's softmax
    over the top-k logits; False = the top-k of the softmax over all experts (megatron's moe_router_pre_softmax)."""
    moe_layer_pattern: tuple[int, ...] | None = None
    """Per layer 1 = MoE, 0 = dense SwiGLU of ffn_hidden_size (HF decoder_sparse_step / mlp_only_layers; megatron's
    moe_layer_freq list); None = every layer MoE when num_experts > 0."""
    shared_expert_ffn_hidden_size: int = 0
    """Width of the shared expert every token also passes (Qwen2-MoE shared_expert_intermediate_size); 0 = none."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by sigmoid(x . w_gate) (Qwen2-MoE shared_expert_gate)."""
    moe_score_function: str = "softmax"
    """The router's score function: "softmax" (the Qwen and Mixtral routers) or "sigmoid" (the DeepSeek-style
    router of GLM-4.5: per-expert sigmoid scores, the top-k renormalised; megatron's moe_router_score_function)."""
    moe_expert_bias: bool = False
    """Sigmoid router: a per-expert correction bias added to the scores for the SELECTION only, never to the weights
    (HF e_score_correction_bias; megatron's moe_router_enable_expert_bias, held fixed: models/moe.py)."""
    moe_num_groups: int = 1
    """Group-limited top-k: the experts split into this many equal groups (HF n_group; megatron's
    moe_router_num_groups); 1 = no group limit."""
    moe_group_topk: int = 1
    """Group-limited top-k: the groups each token may route into (HF topk_group; megatron's moe_router_group_topk)."""
    moe_routed_scaling_factor: float = 1.0
    """The routed experts' weights are multiplied by this (HF routed_scaling_factor; megatron's
    moe_router_topk_scaling_factor)."""
    kv_lora_rank: int = 0
    """Multi-latent attention (DeepSeek-V3's MLA, models/families/deepseek_v3.py): the width of the compressed
    key/value latent c_kv (HF kv_lora_rank; megatron's MLATransformerConfig); 0 = grouped-query attention. Under
    MLA `head_dim` is the per-head width of the non-rotating q/k part (HF qk_nope_head_dim)."""
    q_lora_rank: int | None = None
    """MLA: the width of the compressed query (HF q_lora_rank); None = queries projected from the hidden state."""
    qk_rope_head_dim: int = 0
    """MLA: the per-head width of the decoupled RoPE part of q/k (the key's shared by every head)."""
    v_head_dim: int = 0
    """MLA: the per-head width of the values."""
    hybrid_override_pattern: str | None = None
    """A Mamba hybrid's layers, one character each (megatron's and Nemotron-H's hybrid_override_pattern): "M" a
    Mamba-2 mixer, "*" self-attention, "-" an MLP, "E" a mixture of experts (megatron's MoELayer; the num_experts /
    moe_* fields, moe_layer_pattern its "E" layers); each layer is its norm and that ONE block (models/mamba.py).
    None: every layer attention + MLP."""
    mlp_activation: str = "swiglu"
    """The MLP: "swiglu" (gate/up/down) or "relu2" (Nemotron-H: up, squared ReLU, down; no gate)."""
    position_embedding: str = "rope"
    """"rope", or "none" (Nemotron-H's attention has no positional encoding: its Mamba layers carry order)."""
    mamba_num_heads: int = 0
    """Mamba-2 layers: heads (HF mamba_num_heads); d_inner = heads x mamba_head_dim."""
    mamba_head_dim: int = 0
    """Mamba-2 layers: channels per head (HF mamba_head_dim)."""
    mamba_state_dim: int = 0
    """Mamba-2 layers: SSM state size N (HF ssm_state_size)."""
    mamba_num_groups: int = 0
    """Mamba-2 layers: groups of heads sharing B and C, and the gated norm's groups (HF n_groups)."""
    mamba_conv_kernel: int = 4
    """Mamba-2 layers: width of the causal depthwise convolution over x, B, C (HF conv_kernel)."""
    mamba_conv_bias: bool = True
    """Mamba-2 layers: the convolution has a bias (HF use_conv_bias)."""
    mamba_chunk_size: int = 128
    """Mamba-2 layers: the SSD scan's chunk length (HF chunk_size; precision only, never the result's meaning)."""
    mamba_dt_min: float = 0.0
    """Mamba-2 layers: dt is clamped to at least this after softplus (HF's mixer: time_step_min)."""
    sliding_window: int | None = None
    """Sliding-window attention (gpt-oss: HF sliding_window): a query at path position p sees keys at positions
    p - W + 1 .. p only (attention/window.py), in the layers `window_layers` marks; None = no window."""
    window_layers: tuple[int, ...] | None = None
    """Per layer 1 = sliding-window attention, 0 = full attention (HF layer_types "sliding_attention" /
    "full_attention"; megatron's window_attn_skip_freq list); None = every layer windowed when sliding_window."""
    yarn_factor: float | None = None
    """YaRN RoPE (gpt-oss: HF rope_parameters rope_type "yarn", `factor`): frequencies blended between the plain and
    the factor-interpolated ones over a ramp, cos/sin scaled by 0.1 ln(factor) + 1 (megatron's YarnRotaryEmbedding
    and its concentration factor; models/rotary.py); None = plain RoPE."""
    yarn_original_max_position_embeddings: int = 4096
    """YaRN: the pretraining context the ramp is measured against (HF original_max_position_embeddings)."""
    yarn_beta_fast: float = 32.0
    """YaRN: the ramp's fast boundary in rotations (HF beta_fast)."""
    yarn_beta_slow: float = 1.0
    """YaRN: the ramp's slow boundary in rotations (HF beta_slow)."""
    yarn_truncate: bool = True
    """YaRN: the ramp's bounds rounded to whole dims (HF truncate; gpt-oss: false; megatron's
    yarn_correction_range_round_to_int)."""
    linear_bias: bool = False
    """A bias on every linear layer but the embeddings and the output layer: q/k/v, o_proj, the router and the
    experts' fc1 / fc2 (gpt-oss; megatron's add_bias_linear)."""
    swiglu_limit: float | None = None
    """gpt-oss's clamped GLU: gate.clamp(max=L) * sigmoid(1.702 gate) * (up.clamp(-L, L) + 1) (HF swiglu_limit L,
    swiglu_alpha 1.702; megatron's quick_gelu with activation_func_clamp_value L, glu_linear_offset 1); None =
    SwiGLU."""
    attention_sinks: bool = False
    """A learned logit per query head in every row's softmax denominator (gpt-oss: HF self_attn.sinks; megatron's
    softmax_type="learnable", its core attention's softmax_offset): merged once per row (attention/merge.py)."""

    def __post_init__(self) -> None:
        if self.family not in families():
            raise ValueError(f"family must be one of {', '.join(families())}, not {self.family!r}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_attention_heads", "num_query_groups"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_query_groups}"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    "hidden_size must be a multiple of num_attention_heads when head_dim is not given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if not 0 < self.rotary_percent <= 1:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_dim % 2 and not self.multi_latent:  # MLA's: check_mla
            raise ValueError(
                f"head_dim {self.head_dim} x partial_rotary_factor {self.rotary_percent} = {self.rotary_dim} "
                "rotated dims: RoPE needs an even number"
            )
        if self.yarn_factor is not None and (self.rotary_percent != 1 or self.multi_latent):
            raise ValueError(
                "YaRN RoPE is supported with full rotary dims on grouped-query attention (gpt_oss)"
            )
        if self.mrope_section is not None:
            self.mrope_section = tuple(int(x) for x in self.mrope_section)
        check_layer_types(self)  # models/arch_checks.py
        check_window_fields(self)
        check_moe_fields(self)
        if self.multi_latent:
            check_mla(self)  # models/mla.py
        if self.hybrid_override_pattern is not None or "mamba" in get_family(self.family).layer_kinds:
            from megatron_branch.models.mamba_arch import check_mamba_arch

            check_mamba_arch(self)

    # --- mixture of experts ---------------------------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        """True when some layer is a mixture of experts (megatron's MoELayer)."""
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Layer `layer` (0-based) has a MoELayer in its MLP slot."""
        return self.is_moe and (self.moe_layer_pattern is None or bool(self.moe_layer_pattern[layer]))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """0-based indices of the MoE layers, in order (the routing-replay layout's layer axis)."""
        return tuple(i for i in range(self.num_layers) if self.is_moe_layer(i))

    @property
    def has_dense_mlp_layers(self) -> bool:
        return self.is_moe and len(self.moe_layers) < self.num_layers

    def check_expert_parallel(self, ep: int, *, tp: int = 1, etp: int | None = None) -> None:
        """Refuse, in one line, an expert-parallel size the model cannot be split over (etp None = tp)."""
        check_expert_parallel(self, ep, tp=tp, etp=etp)  # models/arch_checks.py

    # --- layer kinds ----------------------------------------------------------------------------------------------
    @property
    def is_hybrid(self) -> bool:
        """True when some layer is linear attention (gated delta net)."""
        return self.layer_types is not None and "linear_attention" in self.layer_types

    def is_linear(self, layer: int) -> bool:
        """Layer `layer` (0-based) is a linear-attention (gated delta net) layer."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    def window_of(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (0-based): `sliding_window` where `window_layers` marks it, else
        None (full attention)."""
        if self.sliding_window is None or (self.window_layers is not None and not self.window_layers[layer]):
            return None
        return self.sliding_window

    @property
    def num_linear_layers(self) -> int:
        return sum(self.is_linear(i) for i in range(self.num_layers))

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_linear_layers

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (HF: int(head_dim * partial_rotary_factor), as megatron computes it;
        MLA: the decoupled qk_rope_head_dim)."""
        assert self.head_dim is not None
        return self.qk_rope_head_dim if self.multi_latent else int(self.head_dim * self.rotary_percent)

    @property
    def multi_latent(self) -> bool:
        """Multi-latent attention (megatron's MLASelfAttention, models/mla.py) in every attention layer."""
        return self.kv_lora_rank > 0

    # --- the GDN widths megatron's GatedDeltaNet uses (ssm/gated_delta_net.py) -------------------------------------
    @property
    def linear_qk_dim(self) -> int:
        return self.linear_key_head_dim * self.linear_num_key_heads

    @property
    def linear_v_dim(self) -> int:
        return self.linear_value_head_dim * self.linear_num_value_heads

    def gdn_in_proj_sections(self) -> tuple[int, ...]:
        """Rows of the full in_proj weight: [q, k, v, z (output gate), beta, alpha] (megatron's split order)."""
        qk, v, nv = self.linear_qk_dim, self.linear_v_dim, self.linear_num_value_heads
        return (qk, qk, v, v, nv, nv)

    def gdn_conv_sections(self) -> tuple[int, ...]:
        """Channels of the causal convolution: [q, k, v]."""
        qk, v = self.linear_qk_dim, self.linear_v_dim
        return (qk, qk, v)

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, *, where: str = "config.json") -> ModelArch:
        """Map a transformers `PretrainedConfig` (or its dict) to a ModelArch, refusing what we cannot reproduce."""
        try:
            return cls(**arch_fields_from_hf(cfg, where=where))
        except ValueError as e:
            if isinstance(e, UserError):
                raise
            raise UserError(str(e), where=where) from None

    def to_hf_config(self) -> Any:
        """The transformers config that `from_hf_config` maps back to this arch."""
        return hf_config_of(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelArch:
        return cls(**d)

    # ------------------------------------------------------------------------------------------------------------
    def padded_vocab_size(self, tp: int, divisible_by: int = 1) -> int:
        """Megatron's vocab-parallel embedding needs the vocabulary to divide by TP; the extra rows are masked out
        of every softmax (losses/logprobs.py), so padding never changes a result."""
        m = tp * divisible_by
        return -(-self.vocab_size // m) * m

    def check_tensor_parallel(self, tp: int, *, etp: int | None = None) -> None:
        """Refuse, in one line, a tensor-parallel size the model cannot be split over (models/arch_checks.py;
        `etp`: the experts' tensor-parallel size, None = tp)."""
        check_tensor_parallel(self, tp, etp=etp)

    def to_transformer_config(
        self,
        *,
        dtype: torch.dtype = torch.float32,
        tp: int = 1,
        sequence_parallel: bool = False,
        **overrides: Any,
    ) -> Any:
        """megatron-core TransformerConfig for this arch (models/transformer_config.py)."""
        return transformer_config_of(
            self, dtype=dtype, tp=tp, sequence_parallel=sequence_parallel, **overrides
        )


def gdn_block_heads(key_heads: int, value_heads: int, cp: int) -> tuple[int, int]:
    """(key heads, value heads) of ONE context-parallel rank's block of a gated delta net layer whose TP rank holds
    `key_heads` / `value_heads`: the value heads split evenly, the key heads with them when cp divides their count,
    else one key head shared by cp / key_heads ranks (models/gdn_heads.py; which sizes: rules/
    check_gdn_context_parallel). The planner's per-rank GDN terms use the same widths (plan/layers.py)."""
    splits = value_heads % cp == 0 and (key_heads % cp == 0 or cp % key_heads == 0)
    assert splits, (key_heads, value_heads, cp)
    return (key_heads // cp if key_heads % cp == 0 else 1), value_heads // cp


def check_schedule_supports(arch: ModelArch, schedule: str, *, cp: int = 1, tp: int = 1) -> None:
    """Refuse, in one line, a schedule or layout that cannot run `arch` exactly (before any work): the hybrid
    rules, rules.check_hybrid_run (SettingErrors: re-spell them at entry points with other names)."""
    check_hybrid_run(arch, schedule, cp=cp, tp=tp)
