"""The `repeat` backend: each segment attends to its ancestors' K/V REPEATED per segment (PrefixGrouper's method).

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]        k, v   [sk, b, g, h]        out  [sq, b, n * h]
    inside, per run of B equal-length sibling segments of L rows with c ancestor keys:
        q [B*b, n, L, h]   k, v [B*b, g, c + L, h] (the ancestors' keys copied B times)   mask [L, c + L]

This is a BASELINE for the benchmark, not a path to use: it is how PrefixGrouper (arXiv 2506.05433) shares a prompt
in one forward: the shared tokens run once, and each response's attention concatenates the shared K/V in front of
its own (a repeat per response) and calls ordinary masked SDPA, differentiated by autograd (no lse is used, so the
CPU lse trap does not apply). Exact, with the same useful FLOPs as `merge`; what it pays is the per-branch copy of
the prefix K/V (memory and bandwidth that grow with G) and a masked kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megatron_branch.attention.heads import from_kernel, to_kernel
from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.merge_backend import build_plan
from megatron_branch.attention.reference import check_shapes


def _with_prefix(own: torch.Tensor, anc: torch.Tensor, runs: int) -> torch.Tensor:
    """Own keys [runs*L, b, g, h] and ancestor keys [c, b, g, h] -> [runs*b, g, c + L, h]: the ancestors' keys
    REPEATED in front of each segment's own keys (the copy this method pays for; kv heads stay compact)."""
    own_k = to_kernel(own, runs)  # [runs*b, g, L, h]
    c, b, g, h = anc.shape
    rep = to_kernel(anc, 1).unsqueeze(0).expand(runs, -1, -1, -1, -1)  # [runs, b, g, c, h]
    return torch.cat([rep.reshape(runs * b, g, c, h), own_k], dim=2)


def repeat_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, scale: float | None = None
) -> torch.Tensor:
    """q [sq,b,n,h] x k/v [sk,b,g,h] -> [sq,b,n*h]; one masked SDPA per run of equal-length sibling segments."""
    check_shapes(q, k, v, layout)
    sq, b, n, h = q.shape
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    plan = layout.derived(("merge_plan", (0, k.shape[0])), lambda: build_plan(layout, [0, k.shape[0]]))
    pieces_out: list[tuple[slice, torch.Tensor]] = []
    for group in plan.groups:
        anc_k = torch.cat([k[a:e] for _, a, e in group.pieces]) if group.pieces else k[:0]  # [c, b, g, h]
        anc_v = torch.cat([v[a:e] for _, a, e in group.pieces]) if group.pieces else v[:0]
        c = anc_k.shape[0]  # ancestor keys of the group
        for run in group.runs:
            B, L = run.count, run.length
            own = slice(run.k0, run.k0 + B * L)
            mask = torch.ones(L, c + L, dtype=torch.bool, device=q.device)  # [L, c + L]
            mask[:, c:] = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
            kr, vr = _with_prefix(k[own], anc_k, B), _with_prefix(v[own], anc_v, B)  # [B*b, g, c + L, h]
            if q.is_cuda and kr.shape[1] != n:
                # CUDA's masked memory-efficient kernel takes no GQA: expand the heads (as a user of that kernel must)
                kr, vr = (
                    kr.repeat_interleave(n // kr.shape[1], dim=1),
                    vr.repeat_interleave(n // vr.shape[1], dim=1),
                )
            o = F.scaled_dot_product_attention(
                to_kernel(q[run.rows], B), kr, vr, attn_mask=mask, scale=scale, enable_gqa=kr.shape[1] != n
            )  # [B*b, n, L, h]
            pieces_out.append((run.rows, from_kernel(o, B)))
    pieces_out.sort(key=lambda p: p[0].start)
    out = torch.cat([o for _, o in pieces_out])  # [sq, b, n, h]
    return out.reshape(sq, b, n * h)
