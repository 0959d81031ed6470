"""`RingBranchContext`: the BranchContext hook that runs attention as a ring over the context-parallel group.

SHAPE LEGEND (Megatron sequence-first; everything is THIS rank's share of the chunk, see cp_layout.py):
    s  local chunk rows   c  local rows of the cached ancestors (replay)   b batch (1)
    n  query heads, g kv heads (on this TP rank)   h head dim
    q [s,b,n,h]   k, v [s,b,g,h]   external k/v [c,b,g,h]   q_meta [2,s]   external_meta [2,c]   out [s,b,n*h]

The model is built with context_parallel_size = 1 in its TransformerConfig (megatron's own CP paths, which need
TransformerEngine, stay off); parallel_state knows the real CP size so that DP groups and DDP are right. The tokens
reach the model already split (zigzag) with their own position ids, so RoPE needs no CP slicing; only attention
talks across CP ranks, through this context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.attention.core_attention import BranchContext
from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.parallel.ring import RingStats, ring_tree_attention


@dataclass(kw_only=True)
class RingBranchContext(BranchContext):
    """Attention of this rank's chunk rows over the keys of every CP rank (and every rank's cached ancestor rows)."""

    layout: AttentionLayout | None = None  # type: ignore[assignment]
    """Unused: visibility comes from the per-token metadata below (attention/visibility.py cuts it into
    rectangles per ring block)."""
    q_meta: torch.Tensor
    """[2, s] long (segment id, offset in segment) of this rank's chunk rows; segment -1 = padding."""
    external_meta: torch.Tensor | None = None
    """[2, c] metadata of this rank's rows of the cached ancestors (replay), in the order of `external_kv`."""
    related: torch.Tensor
    """[S, S] bool ancestor-or-self relation of the tree's segments (cp_layout.tree_related)."""
    cp_group: Any
    """The context-parallel process group the ring runs on."""
    stats: RingStats | None = None
    """Counters the ring adds to (messages, kernel calls); None = not counted. Passed in, never a global."""

    def attend(
        self, layer_number: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [s,b,n,h], k/v [s,b,g,h] -> [s, b, n*h]."""
        if self.capture:
            self.captured[layer_number] = (k, v)
        k_meta = self.q_meta  # [2, s]: a chunk's keys are its queries
        if layer_number in self.external_kv:
            assert self.external_meta is not None, "external K/V need their metadata"
            blocks = self.external_kv[layer_number]  # cached ancestor blocks, root first, each [c_j,b,g,h]
            k = torch.cat([*(kb for kb, _ in blocks), k], dim=0)  # [c+s,b,g,h]: dK flows back to each leaf
            v = torch.cat([*(vb for _, vb in blocks), v], dim=0)
            k_meta = torch.cat([self.external_meta, self.q_meta], dim=1)  # [2, c+s]
        return ring_tree_attention(
            q, k, v, self.q_meta, k_meta, self.related, scale, self.cp_group, stats=self.stats
        )
