"""Run a `BlockPlan` (attention/visibility.py) through the fused kernels: forward merged by THE lse_merge, and the
per-rectangle backward with the MERGED out/lse (the trick of attention/merge_backend.py and ring-flash-attention).

SHAPE LEGEND (INTERNAL SDPA layout, like attention/kernels.py):
    b batch   n query heads   g kv heads   h head dim   sq query rows   sk key rows of the block
    q, dout, out   [b, n, sq, h]      lse [b, n, sq]      k, v [b, n, sk, h] (GQA heads already expanded)
    acc            fp32 (fp64 for fp64 inputs): the dtype every running sum is kept in
    dkv            [2, sk, b, g, h] acc: the compact-head dK/dV accumulator of the block (the ring's message)

Nothing here is [sq, sk]-sized: every kernel call is one rectangle (a group of query rows over key column ranges,
or a causal square), its inputs are gathered row/column slices and its outputs are O(rows * h). Rows a plan never
touches keep out = 0 and lse = -inf (they see no key in this block), which `lse_merge` treats as "no mass".

TRAP: the lse of the CPU fused kernel carries no gradient (see kernels.py); these are plain functions under the
caller's no_grad, and the backward below is the only way gradients flow.
"""

from __future__ import annotations

import torch

from megatron_branch.attention.kernels import fused_attention_backward, fused_attention_forward
from megatron_branch.attention.merge import lse_merge
from megatron_branch.attention.visibility import BlockPlan, Range


def _gather(x: torch.Tensor, ranges: tuple[Range, ...]) -> torch.Tensor:
    """[b, n, s, h] (or [b, n, s]) -> the rows of `ranges` along dim 2, contiguous."""
    if len(ranges) == 1:
        a, e = ranges[0]
        return x[:, :, a:e].contiguous()
    return torch.cat([x[:, :, a:e] for a, e in ranges], dim=2)


def _merge_into(
    out: torch.Tensor, lse: torch.Tensor, rows: tuple[Range, ...], o: torch.Tensor, lo: torch.Tensor
):  # noqa: ANN202
    """Merge a part's (o [b,n,r,h], lo [b,n,r]) over `rows` into the running (out, lse), in place."""
    start = 0
    for a, e in rows:
        part = slice(start, start + e - a)
        new_o, new_l = lse_merge(out[:, :, a:e], lse[:, :, a:e], o[:, :, part], lo[:, :, part])
        out[:, :, a:e] = new_o
        lse[:, :, a:e] = new_l
        start += e - a


def plan_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    plan: BlockPlan,
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention of q over one key block, merged INTO the running out [b,n,sq,h] / lse [b,n,sq] (acc dtype)."""
    assert plan.fits(q.shape[2], k.shape[2]), "the plan was made for blocks of other sizes"
    for grp in plan.full:  # rows that see the same key ranges: one non-causal call
        o, lo = fused_attention_forward(
            _gather(q, grp.rows), _gather(k, grp.cols), _gather(v, grp.cols), False, scale
        )  # [b, n, rows, h], [b, n, rows]
        _merge_into(out, lse, grp.rows, o, lo)
    for sq in plan.causal:  # the diagonal pieces: causal squares
        rows, cols = (sq.row, sq.row + sq.size), (sq.col, sq.col + sq.size)
        o, lo = fused_attention_forward(
            _gather(q, (rows,)), _gather(k, (cols,)), _gather(v, (cols,)), True, scale
        )
        _merge_into(out, lse, (rows,), o, lo)


def _reduce_heads(x: torch.Tensor, g: int) -> torch.Tensor:
    """[b, n, s, h] gradient of expanded heads -> [s, b, g, h], summing each kv head's n // g copies."""
    b, n, s, h = x.shape
    return x.view(b, g, n // g, s, h).sum(2).permute(2, 0, 1, 3)


def _scatter_kv(dkv: torch.Tensor, cols: tuple[Range, ...], dk: torch.Tensor, dv: torch.Tensor) -> None:
    """Add a part's dk/dv ([b, n, cols, h], expanded heads) into the compact accumulator dkv [2, sk, b, g, h]."""
    g = dkv.shape[3]
    dk_c, dv_c = _reduce_heads(dk.to(dkv.dtype), g), _reduce_heads(dv.to(dkv.dtype), g)  # [cols, b, g, h]
    start = 0
    for a, e in cols:
        dkv[0, a:e] += dk_c[start : start + e - a]
        dkv[1, a:e] += dv_c[start : start + e - a]
        start += e - a


def _scatter_rows(dq: torch.Tensor, rows: tuple[Range, ...], part: torch.Tensor) -> None:
    start = 0
    for a, e in rows:
        dq[:, :, a:e] += part[:, :, start : start + e - a].to(dq.dtype)
        start += e - a


def plan_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: BlockPlan,
    scale: float,
    dq: torch.Tensor,
    dkv: torch.Tensor,
) -> None:
    """Per-rectangle backward with the MERGED out/lse; adds into dq [b,n,sq,h] and dkv [2,sk,b,g,h] (acc)."""
    parts = [(grp.rows, grp.cols, False) for grp in plan.full]
    parts += [(((c.row, c.row + c.size),), ((c.col, c.col + c.size),), True) for c in plan.causal]
    for rows, cols, causal in parts:
        dqp, dkp, dvp = fused_attention_backward(
            _gather(dout, rows),
            _gather(q, rows),
            _gather(k, cols),
            _gather(v, cols),
            _gather(out, rows),
            _gather(lse.unsqueeze(-1), rows).squeeze(-1),
            causal,
            scale,
        )  # [b, n, rows, h], [b, n, cols, h] x2
        _scatter_rows(dq, rows, dqp)
        _scatter_kv(dkv, cols, dkp, dvp)
