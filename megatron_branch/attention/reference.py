"""The float64 oracle: plain, differentiable masked-softmax attention over an AttentionLayout.

SHAPE LEGEND (Megatron sequence-first):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]
    k, v   [sk, b, g, h]      n % g == 0; query head j uses kv group j // (n // g) (Megatron's grouping)
    out    [sq, b, n * h]

No tricks on purpose, and nothing shared with the engine's plan or executors: the mask is the layout's own dense
mask (AttentionLayout.dense_mask), so every executor is tested against an independent description of the tree (run
it in float64). The query heads are viewed as [g, r] and K/V broadcast over r (no copy).
"""

from __future__ import annotations

import math

import torch

from megatron_branch.attention.layout import AttentionLayout

__all__ = ["check_shapes", "reference_attention"]


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout) -> None:
    """Shared argument checks for every backend (Megatron layout)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [s, b, heads, h]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    sq, b, n, h = q.shape
    sk, bk, g, hk = k.shape
    if k.shape != v.shape or bk != b or hk != h:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [sk, {b}, g, {h}]")
    if n % g != 0:
        raise ValueError(f"query heads n={n} must be a multiple of kv heads g={g}")
    if sq != layout.num_queries or sk != layout.num_keys:
        raise ValueError(
            f"q has {sq} rows and k {sk}, layout expects {layout.num_queries} queries, {layout.num_keys} keys"
        )


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, scale: float | None = None
) -> torch.Tensor:
    """Masked softmax attention in the input dtype; returns [sq, b, n*h]."""
    check_shapes(q, k, v, layout)
    sq, b, n, h = q.shape
    g = k.shape[2]
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    qg = q.reshape(sq, b, g, n // g, h)  # query head j = (group j // r, member j % r)
    s = torch.einsum("qbgrh,kbgh->bgrqk", qg, k) * scale  # [b, g, r, sq, sk]
    s = s.masked_fill(~layout.dense_mask(q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)  # every row has >= 1 visible key (the layout covers all queries)
    out = torch.einsum("bgrqk,kbgh->qbgrh", p, v)  # [sq, b, g, r, hv]
    return out.reshape(sq, b, -1)  # [sq, b, n*hv]
