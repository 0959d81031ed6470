"""The `flex` backend: FlexAttention with a BlockMask built from the layout (the GPU path for general trees).

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]        k, v   [sk, b, g, h]        out  [sq, b, n * h]
    inside: [b, n, s, h]; mask [sq, sk] bool, True = visible

The mask_mod just indexes the layout's dense mask: simple, and exactly the reference's visibility. The BlockMask
skips the all-invisible blocks (the sibling branches' keys), which is where flex's savings come from on GPU.
On CPU torch refuses flex's backward ("FlexAttention does not support backward on CPU"), so there this backend is
forward-only and says so before running.
"""

from __future__ import annotations

import math

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.reference import check_shapes, expand_kv


def build_block_mask(layout: AttentionLayout, device: torch.device | str) -> object:
    """A BlockMask (batch- and head-broadcast) whose mask_mod reads the layout's dense mask."""
    dense = layout.dense_mask(device)  # [Sq, Sk]

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return dense[q_idx, kv_idx]

    return create_block_mask(mask_mod, None, None, layout.num_queries, layout.num_keys, device=device)


def flex_attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, scale: float | None = None
) -> torch.Tensor:
    """FlexAttention over [sq, b, n, h] x [sk, b, g, h] -> [sq, b, n*h]; forward-only on CPU."""
    check_shapes(q, k, v, layout)
    if q.device.type == "cpu" and torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        # torch's FlexAttention refuses backward on CPU (docs/design.md, measured facts): say so up front.
        raise RuntimeError(
            "the 'flex' attention backend has no backward on CPU (torch refuses it); "
            "run it under torch.no_grad() or use the 'merge' backend"
        )
    sq, b, n, h = q.shape
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    qb = q.permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
    kb = expand_kv(k, n).permute(1, 2, 0, 3).contiguous()  # [b, n, sk, h]
    vb = expand_kv(v, n).permute(1, 2, 0, 3).contiguous()  # [b, n, sk, h]
    out = flex_attention(
        qb, kb, vb, block_mask=build_block_mask(layout, q.device), scale=scale
    )  # [b, n, sq, h]
    return out.permute(2, 0, 1, 3).reshape(sq, b, n * h)  # [sq, b, n*h]
