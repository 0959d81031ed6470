"""The `packed` backend: one SDPA call over the whole chunk with the layout's dense tree mask.

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]        k, v   [sk, b, g, h]        out  [sq, b, n * h]
    inside: [b, n, s, h]; mask [sq, sk] bool, True = visible

Exact and simple (autograd through SDPA is fine here: no lse is used), but a dense bool mask makes SDPA take its
math path, about as slow as G naive passes (docs/design.md, measured facts). It is the readable cross-check of `merge`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.reference import check_shapes, expand_kv


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, scale: float | None = None
) -> torch.Tensor:
    """One masked SDPA over [sq, b, n, h] x [sk, b, g, h] -> [sq, b, n*h]."""
    check_shapes(q, k, v, layout)
    sq, b, n, h = q.shape
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    qb = q.permute(1, 2, 0, 3)  # [b, n, sq, h]
    kb = expand_kv(k, n).permute(1, 2, 0, 3)  # [b, n, sk, h]
    vb = expand_kv(v, n).permute(1, 2, 0, 3)  # [b, n, sk, h]
    mask = layout.dense_mask(q.device)  # [sq, sk]
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)  # [b, n, sq, h]
    return out.permute(2, 0, 1, 3).reshape(sq, b, n * h)  # [sq, b, n*h]
