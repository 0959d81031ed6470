"""Head layouts in one place: GQA expansion and its gradient reduction, and the rows-first <-> kernel layout views.

SHAPE LEGEND:
    rows-first (Megatron)  x [s, b, H, t]      s rows, b batch, H heads (n query heads or g kv groups), t head dim
    kernel (SDPA)          y [B*b, H, L, t]    a batch of B equal-length row runs of L rows each (s = B * L)
    folded (GQA)           f [b, g, r*m, t]    the r = n // g query heads of each kv group stacked along rows
Megatron's grouping: query head j uses kv group j // r, so the r query heads of a group are adjacent.

Folding is how a non-causal part reads a kv group's keys ONCE for all r query heads of the group, with no expanded
(repeated) copy of the keys: softmax rows are independent, so stacking the group's query heads along the rows changes
nothing but the GEMM shape. Causal parts cannot fold (the diagonal follows the row index), they expand their own
keys, which are short. Every other backend uses `expand_kv`; the ring's gradient uses `reduce_kv_heads`.
"""

from __future__ import annotations

import torch


def expand_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """[s, b, g, h] -> [s, b, n, h]: each kv head repeated n // g times, adjacent (query head j -> group j // (n//g))."""
    g = x.shape[2]
    return x if g == n else x.repeat_interleave(n // g, dim=2)


def reduce_kv_heads(d: torch.Tensor, g: int) -> torch.Tensor:
    """Gradient of `expand_kv`: [s, b, n, h] -> [s, b, g, h], each kv head's n // g copies summed."""
    s, b, n, h = d.shape
    return d if g == n else d.view(s, b, g, n // g, h).sum(3)


def to_kernel(x: torch.Tensor, runs: int) -> torch.Tensor:
    """rows-first [runs*L, b, H, t] -> kernel [runs*b, H, L, t] (a view when runs == 1)."""
    s, b, heads, t = x.shape
    length = s // runs
    y = x.view(runs, length, b, heads, t).permute(0, 2, 3, 1, 4)  # [runs, b, H, L, t]
    return y[0] if runs == 1 else y.reshape(runs * b, heads, length, t)


def from_kernel(y: torch.Tensor, runs: int) -> torch.Tensor:
    """kernel [runs*b, H, L, t] -> rows-first [runs*L, b, H, t]."""
    rb, heads, length, t = y.shape
    b = rb // runs
    return y.view(runs, b, heads, length, t).permute(0, 3, 1, 2, 4).reshape(runs * length, b, heads, t)


def fold(x: torch.Tensor, g: int) -> torch.Tensor:
    """rows-first query-head tensor [m, b, n, t] -> folded [b, g, r*m, t] (r = n // g)."""
    m, b, n, t = x.shape
    r = n // g
    return x.view(m, b, g, r, t).permute(1, 2, 3, 0, 4).reshape(b, g, r * m, t)


def unfold(f: torch.Tensor, n: int) -> torch.Tensor:
    """folded [b, g, r*m, t] -> rows-first [m, b, n, t]."""
    b, g, rm, t = f.shape
    r = n // g
    m = rm // r
    return f.view(b, g, r, m, t).permute(3, 0, 1, 2, 4).reshape(m, b, n, t)
