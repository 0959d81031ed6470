"""Head layouts in one place: THE GQA fold, and the rows-first <-> kernel layout views.

SHAPE LEGEND:
    rows-first (Megatron)  x [s, b, H, t]      s rows, b batch, H heads (n query heads or g kv groups), t head dim
    kernel (SDPA)          y [B*b, H, L, t]    a batch of B equal-length row runs of L rows each (s = B * L)
    folded (GQA)           f [b, g, r*m, t]    the r = n // g query heads of each kv group stacked along rows
Megatron's grouping: query head j uses kv group j // r, so the r query heads of a group are adjacent.

K/V are NEVER expanded (repeated per query head) anywhere in the engine. Two mechanisms cover every kernel call:
    * non-causal parts FOLD the queries (`fold`): softmax rows are independent, so stacking a group's r query
      heads along the rows changes nothing but the GEMM shape, and each kv group's keys are read ONCE for all of
      them, in place, as strided views (`kv_view`) -- the merge executor and the decode step use it;
    * causal parts (the diagonal follows the row index, so they cannot fold) and the dense math pass compact kv
      heads to kernels that group query heads themselves (attention/kernels.py: the CPU and CUDA flash kernels and
      flash-attn take g < n natively; the math kernels read K/V through a broadcast view).
"""

from __future__ import annotations

import torch


def to_kernel(x: torch.Tensor, runs: int) -> torch.Tensor:
    """rows-first [runs*L, b, H, t] -> kernel [runs*b, H, L, t] (a view when runs == 1 or b == 1)."""
    s, b, heads, t = x.shape
    length = s // runs
    y = x.view(runs, length, b, heads, t).permute(0, 2, 3, 1, 4)  # [runs, b, H, L, t]
    return y[0] if runs == 1 else y.reshape(runs * b, heads, length, t)


def from_kernel(y: torch.Tensor, runs: int) -> torch.Tensor:
    """kernel [runs*b, H, L, t] -> rows-first [runs*L, b, H, t]."""
    rb, heads, length, t = y.shape
    b = rb // runs
    return y.view(runs, b, heads, length, t).permute(0, 3, 1, 2, 4).reshape(runs * length, b, heads, t)


def kv_view(x: torch.Tensor, a: int, e: int) -> torch.Tensor:
    """Keys [sk, b, g, h] rows [a, e) as a kernel operand [b, g, e-a, h]: a strided view, no copy."""
    return x[a:e].permute(1, 2, 0, 3)


def fold(x: torch.Tensor, g: int) -> torch.Tensor:
    """THE GQA fold: rows-first query-head tensor [m, b, n, t] -> folded [b, g, r*m, t] (r = n // g)."""
    m, b, n, t = x.shape
    r = n // g
    return x.view(m, b, g, r, t).permute(1, 2, 3, 0, 4).reshape(b, g, r * m, t)


def unfold(f: torch.Tensor, n: int) -> torch.Tensor:
    """folded [b, g, r*m, t] -> rows-first [m, b, n, t]."""
    b, g, rm, t = f.shape
    r = n // g
    m = rm // r
    return f.view(b, g, r, m, t).permute(3, 0, 1, 2, 4).reshape(m, b, n, t)
