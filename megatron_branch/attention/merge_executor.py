"""The `merge` executor: every rectangle of the plan through a fused kernel, merged by THE log-sum-exp merge.

SHAPE LEGEND (Megatron sequence-first, rows first everywhere; kernel views from attention/heads.py):
    s  sequence (sq queries, sk_j keys of block j)   b batch   n query heads   g kv heads   h head dim
    r = n // g query heads per kv group
    q      [sq, b, n, h]        ks[j], vs[j]  [sk_j, b, g, h] (read in place)
    out    [sq, b, n, h] acc    lse [sq, b, n] acc         dq, dks[j], dvs[j] in acc (fp32, fp64 for fp64)

The plan (attention/plan.py) gives two kinds of calls:
    full groups   the query rows that see the same key columns (the G sibling branches of one prefix): their
                  queries FOLDED (heads.fold: a kv group's r query heads stacked along the rows), ONE non-causal
                  call per key piece, the piece's K/V read in place as a strided view of the caller's block -- no
                  concatenated, expanded or permuted copy of cached K/V is made;
    causal runs   equal causal squares laid end to end (siblings of equal length, every rollout of a packed batch
                  without sharing, a segment's two zigzag pieces on a CP rank): ONE batched causal call, compact kv
                  heads (the fused kernels group query heads themselves).
    bands         a sliding window's edges (attention/window.py): rows a window boundary crosses, each tile one small
                  masked call of the math kernels over the few key columns its rows see (at most 2W per row).
Results are merged with `lse_merge`; a causal run whose rows no full group touched is written, not merged.

Backward: per call, the fused kernel's backward with the MERGED out and lse (ring-flash-attention by zhuzilin), dq
summed over the calls, dk/dv added into each block's gradient. An ancestor range shared by many rows thus receives
the SUM of all their gradients: the heart of exact shared-prefix training.

TRAP: never "simplify" this into autograd through the fused op's lse: on CPU that lse carries no gradient and dq/dk
come out silently wrong. tests/unit/test_attention_kernels.py guards it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_branch.attention.executor import Executor, empty_result, zero_grads
from megatron_branch.attention.heads import fold, from_kernel, kv_view, to_kernel, unfold
from megatron_branch.attention.kernels import (
    fused_attention_backward,
    fused_attention_forward,
    lse_dtype,
    math_attention_backward,
    math_attention_forward,
)
from megatron_branch.attention.merge import lse_merge
from megatron_branch.attention.plan import BlockPlan, CausalRun, Range
from megatron_branch.attention.window import Band


def _take_rows(x: torch.Tensor, rows: tuple[Range, ...]) -> torch.Tensor:
    """x [s, ...] -> the given row ranges stacked [m, ...] (a view for one range)."""
    if len(rows) == 1:
        return x[rows[0][0] : rows[0][1]]
    return torch.cat([x[a:e] for a, e in rows])


def _put_rows(dst: torch.Tensor, rows: tuple[Range, ...], src: torch.Tensor, add: bool = False) -> None:
    """Write (or add) src [m, ...] into the row ranges of dst [s, ...], in order."""
    offset = 0
    for a, e in rows:
        if add:
            dst[a:e] += src[offset : offset + e - a]
        else:
            dst[a:e] = src[offset : offset + e - a]
        offset += e - a


def _run_view(x: torch.Tensor, run: CausalRun) -> torch.Tensor:
    """Key block [sk, b, g, h] -> the run's own keys as kernel [count*b, g, L, h] (a view when b == 1)."""
    return to_kernel(x[run.cols], run.count)


def _band_views(x: torch.Tensor, band: Band, keys: bool) -> torch.Tensor:
    """[s, b, heads, h] -> the band's rows (keys=False) or key columns (keys=True) as [b, heads, L, h], in the
    accumulation dtype: the math kernels return their results in the input dtype, and a band's part must not be
    rounded to bf16 before it is merged (a band is small: the copy is W x 2W per tile at most)."""
    lo, n = (band.col, band.cols) if keys else (band.row, band.rows)
    return x[lo : lo + n].permute(1, 2, 0, 3).to(lse_dtype(x.dtype))


def merge_forward(
    q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], plan: BlockPlan, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over the plan's key blocks; returns (out [sq,b,n,h], lse [sq,b,n]) in the accumulation dtype."""
    n = q.shape[2]
    g = ks[0].shape[2]
    out, lse = empty_result(q)
    acc = out.dtype
    for grp in plan.full:
        qf = fold(_take_rows(q, grp.rows), g)  # [b, g, r*m, h]
        o = lo = None
        for p in grp.pieces:
            o_p, lo_p = fused_attention_forward(
                qf, kv_view(ks[p.block], p.start, p.end), kv_view(vs[p.block], p.start, p.end), False, scale
            )
            o, lo = lse_merge(o, lo, o_p, lo_p)  # [b, g, r*m, h], [b, g, r*m] in the accumulation dtype
        _put_rows(out, grp.rows, unfold(o, n))  # each row is in at most one full group: written, not merged
        _put_rows(lse, grp.rows, unfold(lo.unsqueeze(-1), n).squeeze(-1))
    for run, fresh in zip(plan.causal, plan.causal_fresh):
        c = run.count
        o, lo = fused_attention_forward(
            to_kernel(q[run.rows], c),
            _run_view(ks[run.block], run),
            _run_view(vs[run.block], run),
            True,
            scale,
        )  # [c*b, n, L, h], [c*b, n, L]
        o_s = from_kernel(o, c).to(acc)  # [c*L, b, n, h]
        lse_s = from_kernel(lo.unsqueeze(-1), c).squeeze(-1).to(acc)  # [c*L, b, n]
        if not fresh:
            o_s, lse_s = lse_merge(out[run.rows], lse[run.rows], o_s, lse_s)
        out[run.rows], lse[run.rows] = o_s, lse_s
    for band in plan.bands:  # always merged: a band's rows may have seen a group or a run already
        rows = slice(band.row, band.row + band.rows)
        o, lo = math_attention_forward(
            _band_views(q, band, False),
            _band_views(ks[band.block], band, True),
            _band_views(vs[band.block], band, True),
            band.mask(q.device),
            scale,
        )  # [b, n, rows, h], [b, n, rows]
        out[rows], lse[rows] = lse_merge(out[rows], lse[rows], o.permute(2, 0, 1, 3), lo.permute(2, 0, 1))
    return out, lse


def merge_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: BlockPlan,
    scale: float,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Backward with the MERGED out [sq,b,n,h] and lse [sq,b,n]; returns dq [sq,b,n,h], dk_j/dv_j [sk_j,b,g,h],
    accumulated over the calls in the accumulation dtype."""
    n = q.shape[2]
    g = ks[0].shape[2]
    out = out.to(q.dtype)  # the fused kernels take out in the input dtype (lse stays fp32/fp64)
    dq, dks, dvs = zero_grads(q, ks)
    for grp in plan.full:  # per key piece, folded, with the merged out/lse of the group's rows
        lse_f = fold(_take_rows(lse, grp.rows).unsqueeze(-1), g).squeeze(-1)  # [b, g, r*m]
        do_f, q_f, o_f = (fold(_take_rows(x, grp.rows), g) for x in (dout, q, out))  # [b, g, r*m, h]
        dq_f = None
        for p in grp.pieces:
            dqp, dkp, dvp = fused_attention_backward(
                do_f,
                q_f,
                kv_view(ks[p.block], p.start, p.end),
                kv_view(vs[p.block], p.start, p.end),
                o_f,
                lse_f,
                False,
                scale,
            )  # [b, g, r*m, h], [b, g, e-a, h] x2: folded, so no kv-head reduction is needed
            dq_f = dqp.to(dq.dtype) if dq_f is None else dq_f + dqp
            dks[p.block][p.start : p.end] += dkp.permute(2, 0, 1, 3)  # shared keys get the sum over every row
            dvs[p.block][p.start : p.end] += dvp.permute(2, 0, 1, 3)
        _put_rows(dq, grp.rows, unfold(dq_f, n), add=True)
    for run in plan.causal:  # batched causal over own keys, also with the merged out/lse
        c = run.count
        dqs, dkk, dvv = fused_attention_backward(
            to_kernel(dout[run.rows], c),
            to_kernel(q[run.rows], c),
            _run_view(ks[run.block], run),
            _run_view(vs[run.block], run),
            to_kernel(out[run.rows], c),
            to_kernel(lse[run.rows].unsqueeze(-1), c).squeeze(-1),
            True,
            scale,
        )  # [c*b, n, L, h], [c*b, g, L, h] x2
        dq[run.rows] += from_kernel(dqs, c)
        dks[run.block][run.cols] += from_kernel(dkk, c)
        dvs[run.block][run.cols] += from_kernel(dvv, c)
    for band in plan.bands:  # the window's edges, with the merged out/lse of their rows
        dqb, dkb, dvb = math_attention_backward(
            *(_band_views(x, band, False) for x in (dout, q)),
            _band_views(ks[band.block], band, True),
            _band_views(vs[band.block], band, True),
            _band_views(out, band, False),
            lse[band.row : band.row + band.rows].permute(1, 2, 0),
            band.mask(q.device),
            scale,
        )  # [b, n, rows, h], [b, g, cols, h] x2
        dq[band.row : band.row + band.rows] += dqb.permute(2, 0, 1, 3)
        dks[band.block][band.col : band.col + band.cols] += dkb.permute(2, 0, 1, 3)
        dvs[band.block][band.col : band.col + band.cols] += dvb.permute(2, 0, 1, 3)
    return dq, dks, dvs


MERGE = Executor(name="merge", forward=merge_forward, backward=merge_backward)
