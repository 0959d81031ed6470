"""The `flex` backend: FlexAttention with a BlockMask built from the layout (the GPU path for general trees).

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]        k, v   [sk, b, g, h]        out  [sq, b, n * h]
    inside: [b, n, s, h] (k/v [b, g, s, h]: flex reads GQA groups itself, enable_gqa)
    metadata (one layout, per token, never [sq, sk]):
        q_seg [sq]  segment index of each query row      q_off [sq]  row offset inside its segment
        k_own [sk]  segment whose own keys hold the key, -1 if none      k_off [sk]  key offset inside them
        k_int [sk]  index of the key's interval between consecutive range boundaries
        anc   [S, I] bool: interval I lies in an ancestor range of segment S

visible(q, k) = anc[q_seg[q], k_int[k]] or (k_own[k] == q_seg[q] and k_off[k] <= q_off[q]): exactly the layout's
visibility, evaluated per (q, k) from per-token metadata, so no dense [sq, sk] mask is ever built (a 40K-token
chunk's dense mask would be 1.6 GB). The BlockMask skips the all-invisible blocks (sibling branches' keys), which
is where flex's savings come from on GPU; metadata and BlockMask are built once per layout and reused by every
layer. On CUDA flex runs compiled (its fused Triton kernel, with a backward); on CPU torch refuses flex's backward
("FlexAttention does not support backward on CPU"), so there this backend is forward-only and says so.
UNTESTED on GPU (none was lent): tests/gpu/test_gpu_attention.py checks it there.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.reference import check_shapes


def visibility_metadata(layout: AttentionLayout, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Per-token metadata of the layout's visibility (see the legend); O(sq + sk + S * I) memory."""
    sq, sk, segs = layout.num_queries, layout.num_keys, layout.segments
    bounds = sorted({0, sk, *(x for s in segs for r in s.ancestor_ranges for x in r)})
    q_seg, q_off = torch.empty(sq, dtype=torch.long), torch.empty(sq, dtype=torch.long)
    k_own, k_off = torch.full((sk,), -1, dtype=torch.long), torch.zeros(sk, dtype=torch.long)
    anc = torch.zeros(len(segs), max(1, len(bounds) - 1), dtype=torch.bool)
    for i, s in enumerate(segs):
        q_seg[s.q_start : s.q_end] = i
        q_off[s.q_start : s.q_end] = torch.arange(s.length)
        k_own[s.self_k_start : s.self_k_end] = i
        k_off[s.self_k_start : s.self_k_end] = torch.arange(s.length)
        for a, e in s.ancestor_ranges:
            anc[i, bounds.index(a) : bounds.index(e)] = True
    k_int = torch.searchsorted(torch.tensor(bounds[1:-1], dtype=torch.long), torch.arange(sk), right=True)
    meta = dict(q_seg=q_seg, q_off=q_off, k_own=k_own, k_off=k_off, k_int=k_int, anc=anc)
    return {name: t.to(device) for name, t in meta.items()}


def _mask_mod(meta: dict[str, torch.Tensor]) -> Any:
    q_seg, q_off, k_own, k_off, k_int, anc = (
        meta[x] for x in ("q_seg", "q_off", "k_own", "k_off", "k_int", "anc")
    )

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        qs = q_seg[q_idx]
        return anc[qs, k_int[kv_idx]] | ((k_own[kv_idx] == qs) & (k_off[kv_idx] <= q_off[q_idx]))

    return mask_mod


def build_block_mask(layout: AttentionLayout, device: torch.device | str) -> Any:
    """A BlockMask (batch- and head-broadcast) of the layout, built once per layout and device."""
    dev = torch.device(device)

    def build() -> Any:
        meta = layout.derived(("flex_meta", str(dev)), lambda: visibility_metadata(layout, dev))
        return create_block_mask(
            _mask_mod(meta),
            None,
            None,
            layout.num_queries,
            layout.num_keys,
            device=dev,
            _compile=dev.type == "cuda",
        )

    return layout.derived(("block_mask", str(dev)), build)


@functools.cache
def _compiled_flex() -> Any:
    """flex_attention compiled once per process (its Triton kernel; eager flex materialises the scores)."""
    return torch.compile(flex_attention, dynamic=False)


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
    if not torch.is_grad_enabled():  # torch's flex checks requires_grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    sq, b, n, h = q.shape
    g = k.shape[2]
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    qb = q.permute(1, 2, 0, 3)  # [b, n, sq, h]
    kb, vb = k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, g, sk, h]
    fn = _compiled_flex() if q.is_cuda else flex_attention
    out = fn(
        qb, kb, vb, block_mask=build_block_mask(layout, q.device), scale=scale, enable_gqa=g != n
    )  # [b, n, sq, h]
    return out.permute(2, 0, 1, 3).reshape(sq, b, n * h)  # [sq, b, n*h]
