"""The `merge` backend: shared-prefix attention as fused two-part attention merged by log-sum-exp.

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]        k, v   [sk, b, g, h]        out  [sq, b, n * h]
    inside: qb [b, n, sq, h], kb/vb [b, n, sk, h] (kv expanded for GQA), lse [b, n, sq] fp32 (fp64 for fp64)

Per query segment (see layout.py) the attention splits over two disjoint key sets:
    part A: the segment's queries vs its ancestor key ranges, no mask (fused, non-causal), one call per key block;
    part B: the segment's queries vs its own keys, causal (fused, causal, sq == sk).
All parts are merged with `lse_merge`. Keys may come as BLOCKS (the replay schedule's cached ancestor leaves, then
the chunk's own K/V): each block is used where it lies, so no concatenated copy of the path's K/V is made or saved. Segments with the same ancestor ranges (G sibling branches of one prefix) run
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
from collections.abc import Sequence
from typing import Any

import torch

from megatron_branch.attention.kernels import flash_attention_backward, flash_attention_forward, lse_dtype
from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.attention.merge import lse_merge
from megatron_branch.attention.reference import check_shapes, expand_kv

Ranges = tuple[tuple[int, int], ...]
Pieces = dict[int, Ranges]  # key block -> ranges local to that block


def _groups(layout: AttentionLayout) -> dict[Ranges, list[QuerySegment]]:
    """Segments keyed by their ancestor ranges (insertion ordered), so a shared prefix's part A is one call."""
    groups: dict[Ranges, list[QuerySegment]] = {}
    for seg in layout.segments:
        groups.setdefault(seg.ancestor_ranges, []).append(seg)
    return groups


def _rows(segs: list[QuerySegment], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(s.q_start, s.q_end, device=device) for s in segs])  # [rows of the group]


def _split(ranges: Ranges, starts: list[int]) -> Pieces:
    """Global key ranges -> per-block local ranges (a range may span a block boundary)."""
    ends = starts[1:]
    pieces: dict[int, list[tuple[int, int]]] = {}
    for a, e in ranges:
        for j, (s0, s1) in enumerate(zip(starts, ends)):
            lo, hi = max(a, s0), min(e, s1)
            if lo < hi:
                pieces.setdefault(j, []).append((lo - s0, hi - s0))
    return {j: tuple(r) for j, r in pieces.items()}


def _own(seg: QuerySegment, starts: list[int]) -> tuple[int, slice]:
    """(block, local slice) of a segment's own keys; they never straddle blocks (a segment is one block's rows)."""
    for j in range(len(starts) - 1):
        if starts[j] <= seg.self_k_start and seg.self_k_end <= starts[j + 1]:
            return j, slice(seg.self_k_start - starts[j], seg.self_k_end - starts[j])
    raise AssertionError(f"own keys [{seg.self_k_start}, {seg.self_k_end}) straddle key blocks {starts}")


def _keys(x: torch.Tensor, ranges: Ranges) -> torch.Tensor:
    """[b, n, sk, h] -> [b, n, sum of range lengths, h], contiguous."""
    if len(ranges) == 1:
        a, e = ranges[0]
        return x[:, :, a:e].contiguous()
    return torch.cat([x[:, :, a:b] for a, b in ranges], dim=2)


def _to_internal(x: torch.Tensor, n: int) -> torch.Tensor:
    return expand_kv(x, n).permute(1, 2, 0, 3).contiguous()  # [s, b, *, h] -> [b, n, s, h]


class _MergeAttention(torch.autograd.Function):
    """Inputs: q, the layout, the scale, the number of key blocks m, then k_0..k_{m-1}, v_0..v_{m-1}.

    Key blocks let the replay schedule pass its cached ancestor K/V leaves as they are (no concatenation, so no
    copy saved for backward); the layout's key indices refer to the blocks laid end to end.
    """

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, layout: AttentionLayout, scale: float, m: int, *kv: torch.Tensor):  # noqa: ANN205
        ks, vs = kv[:m], kv[m:]
        sq, b, n, h = q.shape
        starts = [0]
        for k in ks:
            starts.append(starts[-1] + k.shape[0])
        qb = _to_internal(q, n)  # [b, n, sq, h]
        kbs = [_to_internal(k, n) for k in ks]  # [b, n, sk_j, h] per block
        vbs = [_to_internal(v, n) for v in vs]
        out = torch.empty_like(qb)  # [b, n, sq, h]
        lse = torch.empty(b, n, sq, dtype=lse_dtype(q.dtype), device=q.device)  # [b, n, sq]
        for ranges, segs in _groups(layout).items():
            out_a = lse_a = None
            if ranges:  # part A for the whole group: one fused call per key block, merged
                rows = _rows(segs, q.device)
                for j, local in _split(ranges, starts).items():
                    o_j, l_j = flash_attention_forward(
                        qb[:, :, rows], _keys(kbs[j], local), _keys(vbs[j], local), False, scale
                    )  # [b, n, rows, h], [b, n, rows]
                    out_a, lse_a = (o_j, l_j) if out_a is None else lse_merge(out_a, lse_a, o_j, l_j)
            offset = 0
            for seg in segs:
                j, own = _own(seg, starts)
                qs = slice(seg.q_start, seg.q_end)
                o_s, lse_s = flash_attention_forward(
                    qb[:, :, qs].contiguous(),
                    kbs[j][:, :, own].contiguous(),
                    vbs[j][:, :, own].contiguous(),
                    True,
                    scale,
                )  # part B: [b, n, L, h], [b, n, L]
                if out_a is not None:
                    part = slice(offset, offset + seg.length)
                    o_s, lse_s = lse_merge(out_a[:, :, part], lse_a[:, :, part], o_s, lse_s)
                    offset += seg.length
                out[:, :, qs] = o_s.to(out.dtype)
                lse[:, :, qs] = lse_s
        result = out.permute(2, 0, 1, 3).reshape(sq, b, n * h)  # [sq, b, n*h]
        # backward needs the inputs, the MERGED output and lse; nothing per part
        ctx.save_for_backward(q, result, lse, *ks, *vs)
        ctx.layout, ctx.scale, ctx.m, ctx.starts = layout, scale, m, starts
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, result, lse, *kv = ctx.saved_tensors
        m, starts = ctx.m, ctx.starts
        ks, vs = kv[:m], kv[m:]
        layout: AttentionLayout = ctx.layout
        scale: float = ctx.scale
        sq, b, n, h = q.shape
        g = ks[0].shape[2]
        acc = lse_dtype(q.dtype)  # sum the many parts' contributions in fp32 (fp64) before casting back
        qb = _to_internal(q, n)  # [b, n, sq, h]
        kbs = [_to_internal(k, n) for k in ks]  # [b, n, sk_j, h]
        vbs = [_to_internal(v, n) for v in vs]
        ob = result.view(sq, b, n, h).permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h] merged out
        dob = grad.reshape(sq, b, n, h).permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
        dq = torch.zeros(b, n, sq, h, dtype=acc, device=q.device)
        dks = [torch.zeros(b, n, k.shape[0], h, dtype=acc, device=q.device) for k in ks]
        dvs = [torch.zeros(b, n, v.shape[0], h, dtype=acc, device=q.device) for v in vs]
        for ranges, segs in _groups(layout).items():
            if ranges:  # part A per key block, each with the merged out/lse of the group's rows
                rows = _rows(segs, q.device)
                for j, local in _split(ranges, starts).items():
                    dqa, dka, dva = flash_attention_backward(
                        dob[:, :, rows],
                        qb[:, :, rows],
                        _keys(kbs[j], local),
                        _keys(vbs[j], local),
                        ob[:, :, rows],
                        lse[:, :, rows],
                        False,
                        scale,
                    )  # [b, n, rows, h], [b, n, block keys, h] x2
                    dq.index_add_(2, rows, dqa.to(acc))
                    start = 0
                    for a, e in local:  # scatter back: shared ancestor keys get the sum over every query
                        dks[j][:, :, a:e] += dka[:, :, start : start + e - a]
                        dvs[j][:, :, a:e] += dva[:, :, start : start + e - a]
                        start += e - a
            for seg in segs:  # part B, causal over own keys, also with the merged out/lse
                j, own = _own(seg, starts)
                qs = slice(seg.q_start, seg.q_end)
                dqs, dkk, dvv = flash_attention_backward(
                    dob[:, :, qs].contiguous(),
                    qb[:, :, qs].contiguous(),
                    kbs[j][:, :, own].contiguous(),
                    vbs[j][:, :, own].contiguous(),
                    ob[:, :, qs].contiguous(),
                    lse[:, :, qs].contiguous(),
                    True,
                    scale,
                )  # [b, n, L, h] x3
                dq[:, :, qs] += dqs
                dks[j][:, :, own] += dkk
                dvs[j][:, :, own] += dvv
        needs = ctx.needs_input_grad
        dq_out = dq.permute(2, 0, 1, 3).to(q.dtype) if needs[0] else None  # [sq, b, n, h]
        grads_k, grads_v = [], []
        for j in range(m):
            # GQA: the kv head repeated n // g times received one gradient per copy; sum them (Megatron grouping)
            for d, src, out_list, need in (
                (dks[j], ks[j], grads_k, needs[4 + j]),
                (dvs[j], vs[j], grads_v, needs[4 + m + j]),
            ):
                sk_j = src.shape[0]
                summed = d.view(b, g, n // g, sk_j, h).sum(2)  # [b, g, sk_j, h]
                out_list.append(summed.permute(2, 0, 1, 3).to(src.dtype) if need else None)  # [sk_j, b, g, h]
        return (dq_out, None, None, None, *grads_k, *grads_v)


KeyBlocks = torch.Tensor | Sequence[torch.Tensor]


def merge_attention(
    q: torch.Tensor, k: KeyBlocks, v: KeyBlocks, layout: AttentionLayout, scale: float | None = None
) -> torch.Tensor:
    """Shared-prefix attention by fused per-part attention + lse merge; q [sq,b,n,h] -> [sq,b,n*h].

    k/v: one tensor [sk,b,g,h], or key BLOCKS [sk_j,b,g,h] laid end to end (the layout indexes their concatenation;
    the blocks are used in place, never concatenated).
    """
    ks = [k] if isinstance(k, torch.Tensor) else list(k)
    vs = [v] if isinstance(v, torch.Tensor) else list(v)
    assert len(ks) == len(vs) and ks, "k and v need the same, non-zero number of blocks"
    # shape-only stand-ins for the concatenated keys (meta device: nothing is allocated)
    k_all = torch.empty((sum(x.shape[0] for x in ks), *ks[0].shape[1:]), device="meta")
    v_all = torch.empty((sum(x.shape[0] for x in vs), *vs[0].shape[1:]), device="meta")
    check_shapes(q, k_all, v_all, layout)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return _MergeAttention.apply(q, layout, scale, len(ks), *ks, *vs)
