"""Hugging Face configs <-> `ModelArch` fields, through the registered families (no megatron, no model code).

A config.json names its family by `model_type` and `architectures` (checked against every registered family);
the family's spec reads the rest (`FamilySpec.read_hf`) and writes it back (`FamilySpec.hf_config`); the tiny
test configs are the specs' too (`tiny_hf_config`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.families.registry import (
    FamilySpec,
    get_family,
    model_types,
    supported_architectures,
)


def check_supported_architecture(model_type: Any, architectures: Any, *, where: str) -> str:
    """The family of a config's `model_type` and `architectures`, naming what is unsupported.

    Called on the raw config.json (hf_io.load_hf_config: transformers may re-map an unknown model_type) and on the
    parsed config."""
    if architectures is None:
        archs: list[Any] = []
    else:
        archs = list(architectures) if isinstance(architectures, (list, tuple)) else [architectures]
    known = supported_architectures()
    family = model_types().get(model_type) if isinstance(model_type, str) else None
    supported = ", ".join(f"{cls} ({fam})" for cls, fam in known.items())
    bad_archs = [a for a in archs if a not in known]
    if bad_archs:
        raise UserError(f"unsupported architecture {bad_archs[0]!r}; supported: {supported}", where=where)
    if family is None:
        also = f" (architectures says {', '.join(archs)})" if archs else ""
        raise UserError(
            f"unsupported architecture: model_type {model_type!r}{also}; supported: {supported}", where=where
        )
    mismatched = [a for a in archs if known[a] != family]
    if mismatched:
        raise UserError(
            f"model_type {model_type!r} does not match architectures {mismatched[0]!r}", where=where
        )
    return family


def arch_fields_from_hf(cfg: Any, *, where: str = "config.json") -> dict[str, Any]:
    """ModelArch(**fields) for a transformers config (or its dict), refusing what is not reproduced exactly."""
    top = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)
    spec = get_family(
        check_supported_architecture(top.get("model_type"), top.get("architectures"), where=where)
    )
    d = top
    if spec.text_config_container and isinstance(top.get("text_config"), dict):
        d = {**top["text_config"]}  # the multimodal container: its text model is the policy
        d.setdefault("tie_word_embeddings", top.get("tie_word_embeddings", False))
    try:
        return spec.read_hf(d, where)
    except KeyError as e:
        raise UserError(f"missing field {e.args[0]!r}", where=where) from None


def hf_config_of(arch: Any) -> Any:  # arch: a models.arch.ModelArch (arch.py imports this module, not back)
    """The transformers config of `arch` (a container family's text model) that `arch_fields_from_hf` maps back."""
    spec = get_family(arch.family)
    common: dict[str, Any] = dict(
        architectures=[spec.export_class],
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
    return spec.hf_config(arch, common)


def tiny_hf_config(
    family: str = "llama",
    *,
    vocab_size: int = 37,
    hidden_size: int = 32,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 64,
    tie: bool = False,
    rope_theta: float = 10000.0,
    head_dim: int | None = None,
    layer_types: Sequence[str] | None = None,
    moe: dict[str, Any] | None = None,
) -> Any:
    """A tiny transformers config of a registered family (random weights come from it: tests, examples, the
    tiny assets). The shape is shared; each family adds its own (FamilySpec.tiny_hf_config: e.g. Qwen3's
    head_dim 16, the hybrids' 3 linear-attention layers to 1 full, the MoE families' 4 experts, top-2);
    `head_dim`, `layer_types` and `moe` (expert field overrides) reach the families that have them."""
    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=ffn,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tie,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
    )
    spec: FamilySpec = get_family(family)
    return spec.tiny_hf_config(common, head_dim=head_dim, layer_types=layer_types, moe=moe)
