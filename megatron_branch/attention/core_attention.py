"""The megatron-core `core_attention` plug-in that attends over cached ancestor keys/values.

Shape legend (Megatron, sequence first):
    s  tokens of the current chunk (one segment, a micro-batch of sibling segments, or a whole packed tree)
    c  tokens of the cached ancestors that are NOT in the chunk (replay: the current path above the chunk)
    b  batch (always 1 here: a chunk is a packed sequence)
    n  query heads on this tensor-parallel rank, g key/value groups on this rank, h head dim

`Attention.forward` in megatron-core computes q [s,b,n,h], k/v [s,b,g,h] (RoPE applied) and calls
`core_attention(q, k, v, mask, ...)`. With no `BranchContext` attached, this module is megatron's own
`DotProductAttention` (the naive schedule's baseline runs through it). With a context attached, the context decides
which keys each query sees (an `AttentionLayout` derived from the prefix tree), prepends the cached ancestor K/V,
records this chunk's K/V for the schedule, and calls the attention backend chosen once in `attention.dispatch`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from megatron_branch.attention.layout import AttentionLayout

KV = tuple[torch.Tensor, torch.Tensor]


@dataclass(kw_only=True)
class BranchContext:
    """What one forward of a chunk needs to know; built by a schedule, attached with `attach_context`."""

    layout: AttentionLayout
    """Which keys each query of the chunk may see. Keys are [external (c) | chunk (s)]."""
    external_kv: dict[int, list[KV]] = field(default_factory=dict)
    """layer_number -> cached ancestor K/V blocks, root first (each k, v [c_j,b,g,h]); empty for a packed tree or a
    root segment. They are handed to the backend as blocks, never concatenated (no copy of the path's K/V)."""
    capture: bool = False
    """Record each layer's chunk K/V (in the autograd graph) in `captured`; the replay schedule needs them."""
    captured: dict[int, KV] = field(default_factory=dict)
    """layer_number -> this chunk's (k [s,b,g,h], v [s,b,g,h]), filled during forward when `capture`."""
    backend: str | None = None
    """Attention backend name (see attention.dispatch); None = the default chosen once for the device."""
    recompute_layers: bool = False
    """Run each transformer layer of this forward under activation checkpointing (models/layer_checkpoint.py):
    only the layer inputs are kept, one layer's graph is rebuilt at a time in backward (with grad enabled only)."""

    def for_recompute(self) -> BranchContext:
        """The context a checkpointed layer's recomputation (in backward) attends with: the same layout, cached
        K/V and metadata, but capturing nothing (the schedule's K/V come from the first forward, whose graph is
        the one gradients are injected into; a recomputed capture would be a copy outside that graph)."""
        return replace(self, capture=False, captured={})

    def attend(
        self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [s,b,n,h], k/v [s,b,g,h] -> [s, b, n*h]."""
        from megatron_branch.attention.dispatch import attention

        if self.capture:
            self.captured[layer_number] = (k, v)
        blocks = [*self.external_kv.get(layer_number, []), (k, v)]  # keys: [ancestors (c) | chunk (s)]
        num_keys = sum(kb.shape[0] for kb, _ in blocks)
        assert num_keys == self.layout.num_keys and q.shape[0] == self.layout.num_queries, (
            f"layout {self.layout.num_queries}x{self.layout.num_keys} vs q {q.shape[0]} k {num_keys}"
        )
        ks, vs = [kb for kb, _ in blocks], [vb for _, vb in blocks]
        return attention(q, ks, vs, self.layout, backend=self.backend, scale=scale)


class BranchCoreAttention(MegatronModule):
    """Drop-in for megatron's DotProductAttention (same constructor), branch-aware when a context is attached."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.layer_number = max(1, layer_number)
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else head_dim**-0.5
        self.context: BranchContext | None = None
        self.stock: torch.nn.Module | None = None
        if config.context_parallel_size == 1:
            from megatron.core.transformer.dot_product_attention import DotProductAttention

            self.stock = DotProductAttention(
                config=config,
                layer_number=layer_number,
                attn_mask_type=attn_mask_type,
                attention_type=attention_type,
                attention_dropout=attention_dropout,
                softmax_scale=softmax_scale,
                cp_comm_type=cp_comm_type,
                pg_collection=pg_collection,
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: Any = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if self.context is None:
            assert self.stock is not None, (
                "no BranchContext attached and megatron's attention is unavailable (CP>1)"
            )
            return self.stock(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                attention_bias=attention_bias,
            )
        assert packed_seq_params is None and attention_bias is None
        return self.context.attend(self.layer_number, query, key, value, self.softmax_scale)


def branch_attention_modules(model: torch.nn.Module) -> list[BranchCoreAttention]:
    return [m for m in model.modules() if isinstance(m, BranchCoreAttention)]


@contextmanager
def attach_context(model: torch.nn.Module, ctx: BranchContext | None) -> Iterator[BranchContext | None]:
    """Attach `ctx` to every BranchCoreAttention of `model` for the duration of one forward."""
    mods = branch_attention_modules(model)
    assert mods, "the model has no BranchCoreAttention: build it with megatron_branch.models.build_model"
    for m in mods:
        m.context = ctx
    try:
        yield ctx
    finally:
        for m in mods:
            m.context = None
