"""The float64 oracle: plain, differentiable masked-softmax attention over an AttentionLayout.

SHAPE LEGEND (Megatron sequence-first):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]
    k, v   [sk, b, g, h]      n % g == 0; query head j uses kv group j // (n // g) (Megatron's grouping)
    out    [sq, b, n * h]

No tricks on purpose: every other backend is tested against this one (run it in float64).
"""

from __future__ import annotations

import math

import torch

from megatron_branch.attention.heads import expand_kv
from megatron_branch.attention.layout import AttentionLayout

__all__ = ["check_shapes", "expand_kv", "reference_attention"]


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
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    qb = q.permute(1, 2, 0, 3)  # [b, n, sq, h]
    kb = expand_kv(k, n).permute(1, 2, 0, 3)  # [b, n, sk, h]
    vb = expand_kv(v, n).permute(1, 2, 0, 3)  # [b, n, sk, h]
    s = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [b, n, sq, sk]
    s = s.masked_fill(~layout.dense_mask(q.device), float("-inf"))
    p = torch.softmax(s, dim=-1)  # [b, n, sq, sk]; every row has >= 1 visible key (layout covers all queries)
    out = torch.matmul(p, vb)  # [b, n, sq, h]
    return out.permute(2, 0, 1, 3).reshape(sq, b, n * h)  # [sq, b, n*h]
