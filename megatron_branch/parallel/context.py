"""`RingContext`: the branch context (attention/context.py) that runs attention as a ring over the CP group.

SHAPE LEGEND (Megatron sequence-first; everything is THIS rank's share of the chunk, see cp_layout.py):
    s  local chunk rows   c  local rows of the cached ancestors (replay)   b batch (1)
    n  query heads, g kv heads (on this TP rank)   h head dim
    q [s,b,n,h]   k, v [s,b,g,h]   handed-down k/v blocks [c_j,b,g,h]   q_meta [2,s]   external_meta [2,c]
    out [s,b,n*h]

The model is built with context_parallel_size = 1 in its TransformerConfig (megatron's own CP paths, which need
TransformerEngine, stay off); parallel_state knows the real CP size so that DP groups and DDP are right. The tokens
reach the model already split (zigzag) with their own position ids, so RoPE needs no CP slicing; only attention
talks across CP ranks, through this context. The executor is the one the schedule chose (`backend`), the same as
on one rank; the cached ancestors' blocks are read in place (parallel/ring.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_branch.attention.context import PrefixContext
from megatron_branch.attention.dispatch import executor
from megatron_branch.parallel.ring import RingPlans, RingStats, ring_tree_attention


@dataclass(kw_only=True)
class RingContext(PrefixContext):
    """Attention of this rank's chunk rows over the keys of every CP rank (and every rank's cached ancestor rows)."""

    q_meta: torch.Tensor
    """[2, s] long (segment id, offset in segment) of this rank's chunk rows; segment -1 = padding."""
    external_meta: torch.Tensor | None = None
    """[2, c] metadata of this rank's rows of the cached ancestors (replay), in the order of the handed-down K/V."""
    related: torch.Tensor
    """[S, S] bool ancestor-or-self relation of the tree's segments (cp_layout.tree_related)."""
    cp_group: Any
    """The context-parallel process group the ring runs on."""
    backend: str | None = None
    """Attention backend name (attention.dispatch); None = the default. Runs every ring block."""
    stats: RingStats | None = None
    """Counters the ring adds to (messages, kernel calls); None = not counted. Passed in, never a global."""
    plans: RingPlans = field(default_factory=RingPlans)
    """The ring's per-step plans, built by the chunk's first attention layer and reused by the others (and by
    the layer checkpoint's recomputation, which shares this object)."""
    seg_start: torch.Tensor | None = None
    """[S] long the path position of each tree segment's first token: what a sliding window is measured in
    (attention/window.py); None = the model has no window."""

    def attend(
        self,
        layer_number: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [s,b,n,h], k/v [s,b,g,h] -> [s, b, n*h]; a sliding window cuts every ring step's plan, the sink is
        merged once per row after the last step (parallel/ring.py)."""
        ks, vs = self._kv_blocks(layer_number, k, v)  # cached ancestor blocks root first, then the chunk
        k_meta = self.q_meta  # [2, s]: a chunk's keys are its queries
        if len(ks) > 1:
            assert self.external_meta is not None, "handed-down K/V need their metadata"
            k_meta = torch.cat(
                [self.external_meta, self.q_meta], dim=1
            )  # [2, c+s]: positions only, no K/V copy
        return ring_tree_attention(
            q,
            ks,
            vs,
            self.q_meta,
            k_meta,
            self.related,
            scale,
            self.cp_group,
            executor=executor(self.backend),
            stats=self.stats,
            plans=self.plans,
            window=window,
            seg_start=self.seg_start,
            sink=sink,
        )
