"""The `merge` backend: shared-prefix attention as fused two-part attention merged by log-sum-exp.

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]        k, v   [sk, b, g, h]        out  [sq, b, n * h]
    inside: qb [b, n, sq, h], kb/vb [b, n, sk, h] (kv expanded for GQA), lse [b, n, sq] fp32 (fp64 for fp64)

Per query segment (see layout.py) the attention splits over two disjoint key sets:
    part A: the segment's queries vs the concatenation of its ancestor key ranges, no mask (fused, non-causal);
    part B: the segment's queries vs its own keys, causal (fused, causal, sq == sk).
A and B are merged with `lse_merge`. Segments with the same ancestor ranges (G sibling branches of one prefix) run
part A as ONE fused call over all their queries: the prefix K/V are read once for the whole group.

Backward: per part, the fused kernel's backward runs with the MERGED out and lse (ring-flash-attention by zhuzilin:
P = exp(S - lse_merged) is then exactly the part's columns of the full softmax, and D = rowsum(dO * O_merged) is the
full row's D), dq sums over the parts, dk/dv scatter-add into the full key gradient. An ancestor range shared by many
segments thus receives the SUM of all their gradients: the heart of exact shared-prefix training.

TRAP: never "simplify" this into autograd through the fused op's lse: on CPU that lse carries no gradient and dq/dk
come out silently wrong. tests/unit/test_attention_kernels.py guards it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_branch.attention.kernels import flash_attention_backward, flash_attention_forward, lse_dtype
from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.attention.merge import lse_merge
from megatron_branch.attention.reference import check_shapes, expand_kv

Ranges = tuple[tuple[int, int], ...]


def _groups(layout: AttentionLayout) -> dict[Ranges, list[QuerySegment]]:
    """Segments keyed by their ancestor ranges (insertion ordered), so a shared prefix's part A is one call."""
    groups: dict[Ranges, list[QuerySegment]] = {}
    for seg in layout.segments:
        groups.setdefault(seg.ancestor_ranges, []).append(seg)
    return groups


def _rows(segs: list[QuerySegment], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(s.q_start, s.q_end, device=device) for s in segs])  # [rows of the group]


def _keys(x: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """[b, n, sk, h] -> [b, n, sum of range lengths, h], contiguous."""
    return torch.cat([x[:, :, a:b] for a, b in ranges], dim=2)


def _to_internal(x: torch.Tensor, n: int) -> torch.Tensor:
    return expand_kv(x, n).permute(1, 2, 0, 3).contiguous()  # [s, b, *, h] -> [b, n, s, h]


class _MergeAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, scale: float
    ) -> torch.Tensor:
        sq, b, n, h = q.shape
        qb = _to_internal(q, n)  # [b, n, sq, h]
        kb, vb = _to_internal(k, n), _to_internal(v, n)  # [b, n, sk, h]
        out = torch.empty_like(qb)  # [b, n, sq, h]
        lse = torch.empty(b, n, sq, dtype=lse_dtype(q.dtype), device=q.device)  # [b, n, sq]
        for ranges, segs in _groups(layout).items():
            if ranges:  # part A for the whole group in one fused call
                rows = _rows(segs, q.device)
                out_a, lse_a = flash_attention_forward(
                    qb[:, :, rows], _keys(kb, ranges), _keys(vb, ranges), False, scale
                )  # [b, n, rows, h], [b, n, rows]
            offset = 0
            for seg in segs:
                own = slice(seg.self_k_start, seg.self_k_end)
                qs = slice(seg.q_start, seg.q_end)
                o_s, lse_s = flash_attention_forward(
                    qb[:, :, qs].contiguous(),
                    kb[:, :, own].contiguous(),
                    vb[:, :, own].contiguous(),
                    True,
                    scale,
                )  # part B: [b, n, L, h], [b, n, L]
                if ranges:
                    part = slice(offset, offset + seg.length)
                    o_s, lse_s = lse_merge(out_a[:, :, part], lse_a[:, :, part], o_s, lse_s)
                    offset += seg.length
                out[:, :, qs] = o_s.to(out.dtype)
                lse[:, :, qs] = lse_s
        result = out.permute(2, 0, 1, 3).reshape(sq, b, n * h)  # [sq, b, n*h]
        # backward needs the inputs, the MERGED output and lse; nothing per part
        ctx.save_for_backward(q, k, v, result, lse)
        ctx.layout, ctx.scale = layout, scale
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, result, lse = ctx.saved_tensors
        layout: AttentionLayout = ctx.layout
        scale: float = ctx.scale
        sq, b, n, h = q.shape
        sk, _, g, _ = k.shape
        acc = lse_dtype(q.dtype)  # sum the many parts' contributions in fp32 (fp64) before casting back
        qb = _to_internal(q, n)  # [b, n, sq, h]
        kb, vb = _to_internal(k, n), _to_internal(v, n)  # [b, n, sk, h]
        ob = result.view(sq, b, n, h).permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h] merged out
        dob = grad.reshape(sq, b, n, h).permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
        dq = torch.zeros(b, n, sq, h, dtype=acc, device=q.device)
        dk = torch.zeros(b, n, sk, h, dtype=acc, device=q.device)
        dv = torch.zeros(b, n, sk, h, dtype=acc, device=q.device)
        for ranges, segs in _groups(layout).items():
            if ranges:  # part A with the merged out/lse of the group's rows
                rows = _rows(segs, q.device)
                dqa, dka, dva = flash_attention_backward(
                    dob[:, :, rows],
                    qb[:, :, rows],
                    _keys(kb, ranges),
                    _keys(vb, ranges),
                    ob[:, :, rows],
                    lse[:, :, rows],
                    False,
                    scale,
                )  # [b, n, rows, h], [b, n, ancestor keys, h] x2
                dq.index_add_(2, rows, dqa.to(acc))
                start = 0
                for (
                    a,
                    e,
                ) in ranges:  # scatter back: shared ancestor keys get the sum over every query that saw them
                    dk[:, :, a:e] += dka[:, :, start : start + e - a]
                    dv[:, :, a:e] += dva[:, :, start : start + e - a]
                    start += e - a
            for seg in segs:  # part B, causal over own keys, also with the merged out/lse
                own = slice(seg.self_k_start, seg.self_k_end)
                qs = slice(seg.q_start, seg.q_end)
                dqs, dks, dvs = flash_attention_backward(
                    dob[:, :, qs].contiguous(),
                    qb[:, :, qs].contiguous(),
                    kb[:, :, own].contiguous(),
                    vb[:, :, own].contiguous(),
                    ob[:, :, qs].contiguous(),
                    lse[:, :, qs].contiguous(),
                    True,
                    scale,
                )  # [b, n, L, h] x3
                dq[:, :, qs] += dqs
                dk[:, :, own] += dks
                dv[:, :, own] += dvs
        # GQA: the kv head repeated n // g times received one gradient per copy; sum them (Megatron grouping)
        dk = dk.view(b, g, n // g, sk, h).sum(2)  # [b, g, sk, h]
        dv = dv.view(b, g, n // g, sk, h).sum(2)  # [b, g, sk, h]
        dq_out = dq.permute(2, 0, 1, 3).to(q.dtype) if ctx.needs_input_grad[0] else None  # [sq, b, n, h]
        dk_out = dk.permute(2, 0, 1, 3).to(k.dtype) if ctx.needs_input_grad[1] else None  # [sk, b, g, h]
        dv_out = dv.permute(2, 0, 1, 3).to(v.dtype) if ctx.needs_input_grad[2] else None  # [sk, b, g, h]
        return dq_out, dk_out, dv_out, None, None


def merge_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, scale: float | None = None
) -> torch.Tensor:
    """Shared-prefix attention by fused two-part attention + lse merge; q [sq,b,n,h], k/v [sk,b,g,h] -> [sq,b,n*h]."""
    check_shapes(q, k, v, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _MergeAttention.apply(q, k, v, layout, scale)
