"""The `repeat` baseline: each segment attends to its ancestors' K/V REPEATED per segment (PrefixGrouper's method).

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    q      [sq, b, n, h]        k, v   [sk, b, g, h]        out  [sq, b, n * h]
    inside, per run of B equal-length sibling segments of L rows with c ancestor keys:
        q [B*b, n, L, h]   k, v [B*b, g, c + L, h] (the ancestors' keys copied B times)   mask [L, c + L]

This is a BASELINE for the benchmark, not a path to use, and not an executor of the plan (it returns no lse, so it
cannot serve the ring: under context parallelism it is refused, attention/dispatch.py). It is how PrefixGrouper
(arXiv 2506.05433) shares a prompt in one forward: the shared tokens run once, and each response's attention
concatenates the shared K/V in front of its own (a repeat per response) and calls ordinary masked SDPA,
differentiated by autograd (no lse is used, so the CPU lse trap does not apply). Exact, with the same useful FLOPs as
`merge`; what it pays is the per-branch copy of the prefix K/V (memory and bandwidth that grow with G) and a masked
kernel. Its grouping (siblings by their ancestors, equal lengths batched) is read off THE plan (attention/plan.py).
"""

from __future__ import annotations

import bisect
import math

import torch
import torch.nn.functional as F

from megatron_branch.attention.heads import from_kernel, to_kernel
from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.plan import BlockPlan, FullGroup
from megatron_branch.attention.plan_sources import plan_from_layout
from megatron_branch.attention.reference import check_shapes


def _with_prefix(own: torch.Tensor, anc: torch.Tensor, runs: int) -> torch.Tensor:
    """Own keys [runs*L, b, g, h] and ancestor keys [c, b, g, h] -> [runs*b, g, c + L, h]: the ancestors' keys
    REPEATED in front of each segment's own keys (the copy this method pays for; kv heads stay compact)."""
    own_k = to_kernel(own, runs)  # [runs*b, g, L, h]
    c, b, g, h = anc.shape
    rep = to_kernel(anc, 1).unsqueeze(0).expand(runs, -1, -1, -1, -1)  # [runs, b, g, c, h]
    return torch.cat([rep.reshape(runs * b, g, c, h), own_k], dim=2)


def _group_at(plan: BlockPlan) -> list[tuple[int, int, FullGroup]]:
    """(row start, row end, group) of every full group's row ranges, sorted by row."""
    return sorted((a, e, grp) for grp in plan.full for a, e in grp.rows)


def _sibling_runs(plan: BlockPlan) -> list[tuple[FullGroup | None, int, int, int, int]]:
    """(group, first row, own-key column, length, count): the plan's causal squares re-batched so that every batch
    lies in one full group (the squares' shared ancestors). Built once per plan."""
    spans = _group_at(plan)
    starts = [a for a, _, _ in spans]

    def group(row: int, size: int) -> FullGroup | None:
        i = bisect.bisect_right(starts, row) - 1
        if i < 0 or spans[i][1] <= row:
            return None
        assert spans[i][1] >= row + size, "a causal square spans two groups"
        return spans[i][2]

    out: list[tuple[FullGroup | None, int, int, int, int]] = []
    for run in plan.causal:
        for i in range(run.count):
            row, col = run.row + i * run.size, run.col + i * run.size
            grp = group(row, run.size)
            last = out[-1] if out else None
            if (
                last is not None
                and last[0] is grp
                and last[3] == run.size
                and last[1] + last[3] * last[4] == row
            ):
                out[-1] = (grp, last[1], last[2], run.size, last[4] + 1)
            else:
                out.append((grp, row, col, run.size, 1))
    return out


def repeat_prefix_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: AttentionLayout, scale: float | None = None
) -> torch.Tensor:
    """q [sq,b,n,h] x k/v [sk,b,g,h] -> [sq,b,n*h]; one masked SDPA per run of equal-length sibling segments."""
    check_shapes(q, k, v, layout)
    sq, b, n, h = q.shape
    scale = 1.0 / math.sqrt(h) if scale is None else scale
    plan = plan_from_layout(layout)
    pieces_out: list[tuple[int, torch.Tensor]] = []
    for grp, row, col, L, B in plan.derived("sibling_runs", lambda: _sibling_runs(plan)):
        cols = [(p.start, p.end) for p in grp.pieces] if grp is not None else []
        anc_k = torch.cat([k[a:e] for a, e in cols]) if cols else k[:0]  # [c, b, g, h]
        anc_v = torch.cat([v[a:e] for a, e in cols]) if cols else v[:0]
        c = anc_k.shape[0]  # ancestor keys of the group
        mask = torch.ones(L, c + L, dtype=torch.bool, device=q.device)  # [L, c + L]
        mask[:, c:] = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
        own = slice(col, col + B * L)
        kr, vr = _with_prefix(k[own], anc_k, B), _with_prefix(v[own], anc_v, B)  # [B*b, g, c + L, h]
        if q.is_cuda and kr.shape[1] != n:
            # the baseline's own cost, not the engine's: CUDA's masked memory-efficient kernel takes no GQA, so a
            # user of this method expands the kv heads (the engine never does, attention/heads.py)
            kr, vr = (x.repeat_interleave(n // x.shape[1], dim=1) for x in (kr, vr))
        o = F.scaled_dot_product_attention(
            to_kernel(q[row : row + B * L], B),
            kr,
            vr,
            attn_mask=mask,
            scale=scale,
            enable_gqa=kr.shape[1] != n,
        )  # [B*b, n, L, h]
        pieces_out.append((row, from_kernel(o, B)))
    pieces_out.sort(key=lambda p: p[0])
    out = torch.cat([o for _, o in pieces_out])  # [sq, b, n, hv]
    return out.reshape(sq, b, -1)
