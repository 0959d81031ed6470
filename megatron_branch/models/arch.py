"""The architecture description shared by model building, checkpoint conversion and the CLI.

`ModelArch` is the one place where a Hugging Face config (Llama, Qwen2) is mapped to megatron-core's
`TransformerConfig`. Everything that is not reproduced exactly (rope scaling, sliding windows, MLP bias, other
activations) is refused with a one-line `UserError` instead of being silently approximated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.errors import UserError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}


def check_supported_architecture(model_type: Any, architectures: Any, *, where: str) -> str:
    """The family ("llama"/"qwen2") of a config's `model_type` and `architectures`, naming what is unsupported.

    Called on the raw config.json (hf_io.load_hf_config: transformers may re-map an unknown model_type) and on the
    parsed config."""
    if architectures is None:
        archs: list[Any] = []
    else:
        archs = list(architectures) if isinstance(architectures, (list, tuple)) else [architectures]
    family = {"llama": "llama", "qwen2": "qwen2"}.get(model_type)
    supported = ", ".join(f"{cls} (model_type {fam!r})" for cls, fam in SUPPORTED_ARCHITECTURES.items())
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


@dataclass(kw_only=True)
class ModelArch:
    """A decoder-only Llama/Qwen2-style transformer: RMSNorm, SwiGLU, RoPE, GQA."""

    family: str
    """"llama" or "qwen2"; decides the HF class written back on export."""
    vocab_size: int
    """Vocabulary size of the tokenizer (unpadded). Megatron pads it to a multiple of TP; see `padded_vocab_size`."""
    hidden_size: int
    """Model width."""
    num_layers: int
    """Number of transformer layers."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (GQA groups); equal to num_attention_heads for plain multi-head attention."""
    ffn_hidden_size: int
    """SwiGLU inner width (HF `intermediate_size`)."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads."""
    rope_theta: float = 10000.0
    """RoPE base."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    qkv_bias: bool = False
    """Bias on the Q/K/V projections (Qwen2: True)."""
    tie_word_embeddings: bool = False
    """Share the input embedding with the output layer."""
    max_position_embeddings: int = 4096
    """Longest sequence the model is built for (RoPE table length)."""

    def __post_init__(self) -> None:
        if self.family not in ("llama", "qwen2"):
            raise ValueError(f"family must be 'llama' or 'qwen2', not {self.family!r}")
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

    # ------------------------------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: Any, *, where: str = "config.json") -> ModelArch:
        """Map a transformers `PretrainedConfig` (or its dict) to a ModelArch, refusing what we cannot reproduce."""
        d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
        family = check_supported_architecture(d.get("model_type"), d.get("architectures"), where=where)
        if d.get("hidden_act", "silu") != "silu":
            raise UserError(
                f"hidden_act={d['hidden_act']!r} is not supported (only silu/SwiGLU)", where=where
            )
        if d.get("mlp_bias"):
            raise UserError("mlp_bias=true is not supported", where=where)
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in (None, "default"):
            raise UserError(f"rope scaling {rope_type!r} cannot be reproduced exactly; refusing", where=where)
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        if family == "qwen2" and d.get("use_sliding_window"):
            raise UserError("use_sliding_window=true is not supported", where=where)
        if family == "llama":
            qkv_bias = bool(d.get("attention_bias", False))
            if qkv_bias:
                # Llama's attention_bias also puts a bias on o_proj, which the map below does not carry.
                raise UserError("Llama attention_bias=true (bias on o_proj) is not supported", where=where)
        else:
            qkv_bias = True
        n_heads = d["num_attention_heads"]
        try:
            return cls(
                family=family,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                num_layers=d["num_hidden_layers"],
                num_attention_heads=n_heads,
                num_query_groups=d.get("num_key_value_heads") or n_heads,
                ffn_hidden_size=d["intermediate_size"],
                head_dim=d.get("head_dim"),
                rope_theta=float(theta),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                qkv_bias=qkv_bias,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            )
        except KeyError as e:
            raise UserError(f"missing field {e.args[0]!r}", where=where) from None
        except ValueError as e:
            raise UserError(str(e), where=where) from None

    def to_hf_config(self) -> Any:
        """The transformers config that `from_hf_config` maps back to this arch."""
        from transformers import LlamaConfig, Qwen2Config

        common = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.ffn_hidden_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_query_groups,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.family == "llama":
            return LlamaConfig(architectures=["LlamaForCausalLM"], attention_bias=False, **common)
        return Qwen2Config(architectures=["Qwen2ForCausalLM"], **common)

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

    def check_tensor_parallel(self, tp: int) -> None:
        if tp <= 0:
            raise UserError(f"tensor parallel size must be positive, got {tp}")
        if self.num_attention_heads % tp:
            raise UserError(
                f"tensor parallel size {tp} does not divide num_attention_heads={self.num_attention_heads}"
            )
        if self.num_query_groups % tp and tp % self.num_query_groups:
            raise UserError(
                f"tensor parallel size {tp} and num_key_value_heads={self.num_query_groups}: one must divide the other"
            )
        if self.ffn_hidden_size % tp:
            raise UserError(
                f"tensor parallel size {tp} does not divide intermediate_size={self.ffn_hidden_size}"
            )

    def to_transformer_config(
        self,
        *,
        dtype: torch.dtype = torch.float32,
        tp: int = 1,
        sequence_parallel: bool = False,
        **overrides: Any,
    ) -> Any:
        """megatron-core TransformerConfig for this arch. Dropout is 0: branch replay recomputes nothing that
        draws random numbers, so exactness needs no RNG replay (see docs/design.md)."""
        import torch.nn.functional as F
        from megatron.core.transformer import TransformerConfig

        self.check_tensor_parallel(tp)
        kwargs: dict[str, Any] = dict(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.head_dim,
            ffn_hidden_size=self.ffn_hidden_size,
            normalization="RMSNorm",
            layernorm_epsilon=self.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=self.qkv_bias,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=dtype,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            use_cpu_initialization=True,
            tensor_model_parallel_size=tp,
            sequence_parallel=sequence_parallel and tp > 1,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            apply_rope_fusion=False,
            gradient_accumulation_fusion=False,
            attention_softmax_in_fp32=False,
        )
        kwargs.update(overrides)
        return TransformerConfig(**kwargs)
