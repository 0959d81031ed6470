"""Tiny megatron-core models with random weights: the bench's precision and rehearsal models (bench/precision.py,
bench/rehearsal.py) and the tests' (re-exported by megatron_branch.testing, which the package never imports)."""

from __future__ import annotations

from typing import Any

import torch

from megatron_branch.models.arch import ModelArch
from megatron_branch.models.families import get_family


def tiny_arch(
    family: str = "llama", *, hidden: int = 32, layers: int = 2, vocab_size: int = 37, **fields: Any
) -> ModelArch:
    """A tiny model shape: 4 heads / 2 KV groups, SwiGLU ffn = 2 x hidden, the family's QKV bias (Qwen2's);
    `fields` set ModelArch's other fields (max_position_embeddings, ...)."""
    fields.setdefault("qkv_bias", get_family(family).train_default("qkv_bias"))
    return ModelArch(
        family=family,
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=layers,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=2 * hidden,
        **fields,
    )


def tiny_branch_model(
    dtype: torch.dtype = torch.float64,
    *,
    seed: int = 0,
    vocab_size: int = 37,
    scale: float = 3.0,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> Any:
    """A tiny megatron-core Llama (GQA) with random weights scaled by `scale` (peaked distributions), built on the
    current parallel state; the same seed gives the same full weights at any TP size only through checkpoints."""
    from megatron_branch.models.gpt import build_model

    torch.manual_seed(seed)
    arch = tiny_arch(vocab_size=vocab_size)
    model = build_model(arch, dtype=dtype, tp=tp, sequence_parallel=sequence_parallel)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model
