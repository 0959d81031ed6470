"""The `merge` backend: shared-prefix attention as fused two-part attention merged by log-sum-exp.

SHAPE LEGEND (Megatron sequence-first, rows first everywhere; kernel views from attention/heads.py):
    s  sequence (sq queries, sk keys)   b batch   n query heads   g query groups (kv heads)   h head dim
    r = n // g query heads per kv group
    q      [sq, b, n, h]        k, v   key blocks [sk_j, b, g, h]        out  [sq, b, n * h]
    inside: out [sq, b, n, h] and lse [sq, b, n] fp32 (fp64 for fp64), dk_j/dv_j [sk_j, b, g, h] fp32 (fp64)

Per query segment (see layout.py) the attention splits over two disjoint key sets:
    part A: the segment's queries vs its ancestor key ranges, no mask (fused, non-causal);
    part B: the segment's queries vs its own keys, causal (fused, causal, sq == sk).
All parts are merged with THE `lse_merge`. The kernel calls are batched (`MergePlan`, built once per layout):
    - segments with the same ancestor ranges (the G sibling branches of one prefix) run part A as ONE call per key
      range over all their queries, GQA-folded (heads.fold): the prefix K/V are read in place, once per kv group,
      as strided views of the caller's tensors: no concatenated, expanded or permuted copy of cached K/V is made;
    - consecutive segments of equal length whose own keys are consecutive (siblings of equal length, or every
      rollout of a packed batch without sharing) run part B as ONE batched causal call.
Key BLOCKS (the replay schedule's cached ancestor leaves, then the chunk's own K/V) are read where they lie.

Backward: per part, the fused kernel's backward runs with the MERGED out and lse (ring-flash-attention by zhuzilin:
P = exp(S - lse_merged) is then exactly the part's columns of the full softmax, and D = rowsum(dO * O_merged) is the
full row's D), dq sums over the parts, dk/dv add into the full key gradient. An ancestor range shared by many
segments thus receives the SUM of all their gradients: the heart of exact shared-prefix training.
Structure as in ring-flash-attention: plain `merge_attention_forward` / `merge_attention_backward` functions, a thin
`MergeAttnFunc` (autograd.Function) and the public `merge_attention`.

TRAP: never "simplify" this into autograd through the fused op's lse: on CPU that lse carries no gradient and dq/dk
come out silently wrong. tests/unit/test_attention_kernels.py guards it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.attention.heads import (
    expand_kv,
    fold,
    from_kernel,
    reduce_kv_heads,
    to_kernel,
    unfold,
)
from megatron_branch.attention.kernels import fused_attention_backward, fused_attention_forward, lse_dtype
from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.merge import lse_merge
from megatron_branch.attention.reference import check_shapes


@dataclass(frozen=True)
class Run:
    """Part B of `count` consecutive segments of `length` rows from query row `q0`, own keys from `k0` of block j."""

    q0: int
    count: int
    length: int
    block: int
    k0: int  # local to the block

    @property
    def rows(self) -> slice:
        return slice(self.q0, self.q0 + self.count * self.length)


@dataclass(frozen=True)
class Group:
    """Segments sharing one set of ancestor ranges: part A once for all their rows, part B by runs."""

    rows: tuple[tuple[int, int], ...]  # query row ranges, in group order (part A's row order)
    pieces: tuple[tuple[int, int, int], ...]  # (block, local start, local end) of the ancestor keys
    runs: tuple[Run, ...]

    @property
    def num_rows(self) -> int:
        return sum(e - a for a, e in self.rows)


@dataclass(frozen=True)
class MergePlan:
    """The kernel calls of one layout over key blocks with the given starts (pure Python, no tensors)."""

    groups: tuple[Group, ...]

    @property
    def calls(self) -> int:
        """Fused kernel calls per forward (the same number per backward): what batching saves."""
        return sum(len(g.pieces) + len(g.runs) for g in self.groups)


def _locate(a: int, e: int, starts: Sequence[int]) -> list[tuple[int, int, int]]:
    """Global key range [a, e) -> (block, local start, local end) pieces (a range may span a block boundary)."""
    out = []
    for j in range(len(starts) - 1):
        lo, hi = max(a, starts[j]), min(e, starts[j + 1])
        if lo < hi:
            out.append((j, lo - starts[j], hi - starts[j]))
    return out


def build_plan(layout: AttentionLayout, starts: Sequence[int]) -> MergePlan:
    """Group segments by ancestor ranges (insertion ordered), then cut each group's segments into equal-length runs."""
    by_ranges: dict[tuple[tuple[int, int], ...], list] = {}
    for seg in layout.segments:
        by_ranges.setdefault(seg.ancestor_ranges, []).append(seg)
    groups = []
    for ranges, segs in by_ranges.items():
        pieces = tuple(p for a, e in ranges for p in _locate(a, e, starts))
        runs: list[Run] = []
        for seg in segs:
            (j, k0, k1), *rest = _locate(seg.self_k_start, seg.self_k_end, starts)
            assert not rest and k1 - k0 == seg.length, f"own keys of rows {seg.q_start} straddle key blocks"
            last = runs[-1] if runs else None
            if (
                last is not None
                and last.length == seg.length
                and last.block == j
                and last.rows.stop == seg.q_start
                and last.k0 + last.count * last.length == k0
            ):
                runs[-1] = Run(last.q0, last.count + 1, last.length, j, last.k0)
            else:
                runs.append(Run(seg.q_start, 1, seg.length, j, k0))
        rows = tuple((s.q_start, s.q_end) for s in segs)
        groups.append(Group(rows=rows, pieces=pieces, runs=tuple(runs)))
    return MergePlan(groups=tuple(groups))


def _plan(layout: AttentionLayout, ks: Sequence[torch.Tensor]) -> MergePlan:
    starts = [0]
    for k in ks:
        starts.append(starts[-1] + k.shape[0])
    return layout.derived(("merge_plan", tuple(starts)), lambda: build_plan(layout, starts))


def _take_rows(x: torch.Tensor, rows: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """x [s, ...] -> the given row ranges stacked [m, ...] (a view for one range)."""
    if len(rows) == 1:
        return x[rows[0][0] : rows[0][1]]
    return torch.cat([x[a:e] for a, e in rows])


def _kv_view(x: torch.Tensor, a: int, e: int) -> torch.Tensor:
    """Cached keys [sk_j, b, g, h] rows [a, e) as a kernel operand [b, g, e-a, h]: a strided view, no copy."""
    return x[a:e].permute(1, 2, 0, 3)


def _part_a(q_rows, ks, vs, pieces, g, scale):  # noqa: ANN001, ANN202
    """(out [m,b,n,h], lse [m,b,n]) of the group's rows over its ancestor keys: one folded call per key piece."""
    n = q_rows.shape[2]
    qf = fold(q_rows, g)  # [b, g, r*m, h]
    out = lse = None
    for j, a, e in pieces:
        o, lo = fused_attention_forward(qf, _kv_view(ks[j], a, e), _kv_view(vs[j], a, e), False, scale)
        out, lse = lse_merge(out, lse, o, lo)  # [b, g, r*m, h], [b, g, r*m] in the accumulation dtype
    return unfold(out, n), unfold(lse.unsqueeze(-1), n).squeeze(-1)


def _expand_run(x: torch.Tensor, run: Run, n: int) -> torch.Tensor:
    """Own keys of a run [count*L, b, g, h] -> kernel [count*b, n, L, h] (GQA-expanded: short, causal)."""
    return to_kernel(expand_kv(x[run.k0 : run.k0 + run.count * run.length], n), run.count)


def merge_attention_forward(
    q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor], plan: MergePlan, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward over key blocks; returns (out [sq,b,n,h], lse [sq,b,n]) in the accumulation dtype."""
    sq, b, n, h = q.shape
    g = ks[0].shape[2]
    acc = lse_dtype(q.dtype)
    out = torch.empty(sq, b, n, h, dtype=acc, device=q.device)
    lse = torch.empty(sq, b, n, dtype=acc, device=q.device)
    for group in plan.groups:
        out_a = lse_a = None
        if group.pieces:
            out_a, lse_a = _part_a(_take_rows(q, group.rows), ks, vs, group.pieces, g, scale)  # [m, b, n, *]
        offset = 0  # runs follow the group's row order, so part A's rows of a run are contiguous
        for run in group.runs:
            o, lo = fused_attention_forward(
                to_kernel(q[run.rows], run.count),  # [count*b, n, L, h]
                _expand_run(ks[run.block], run, n),
                _expand_run(vs[run.block], run, n),
                True,
                scale,
            )
            o_s = from_kernel(o, run.count).to(acc)  # [count*L, b, n, h]
            lse_s = from_kernel(lo.unsqueeze(-1), run.count).squeeze(-1).to(acc)  # [count*L, b, n]
            if out_a is not None:
                part = slice(offset, offset + run.count * run.length)
                o_s, lse_s = lse_merge(out_a[part], lse_a[part], o_s, lse_s)
                offset += run.count * run.length
            out[run.rows], lse[run.rows] = o_s, lse_s
    return out, lse


def merge_attention_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    ks: Sequence[torch.Tensor],
    vs: Sequence[torch.Tensor],
    out: torch.Tensor,
    lse: torch.Tensor,
    plan: MergePlan,
    scale: float,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Backward with the MERGED out [sq,b,n,h] and lse [sq,b,n]; returns dq [sq,b,n,h], dk_j/dv_j [sk_j,b,g,h],
    accumulated in fp32 (fp64) over the many parts, in that dtype."""
    sq, b, n, h = q.shape
    g = ks[0].shape[2]
    acc = lse_dtype(q.dtype)
    out = out.to(q.dtype)  # the fused kernels take out in the input dtype (lse stays fp32/fp64)
    dq = torch.zeros(sq, b, n, h, dtype=acc, device=q.device)
    dks = [torch.zeros(k.shape, dtype=acc, device=q.device) for k in ks]
    dvs = [torch.zeros(v.shape, dtype=acc, device=q.device) for v in vs]
    for group in plan.groups:
        if group.pieces:  # part A per key piece, folded, with the merged out/lse of the group's rows
            rows = group.rows
            lse_f = fold(_take_rows(lse, rows).unsqueeze(-1), g).squeeze(-1)  # [b, g, r*m]
            operands = [fold(_take_rows(x, rows), g) for x in (dout, q, out)]  # [b, g, r*m, h]
            dq_a = None
            for j, a, e in group.pieces:
                dqf, dka, dva = fused_attention_backward(
                    operands[0],
                    operands[1],
                    _kv_view(ks[j], a, e),
                    _kv_view(vs[j], a, e),
                    operands[2],
                    lse_f,
                    False,
                    scale,
                )  # [b, g, r*m, h], [b, g, e-a, h] x2: no GQA reduction needed (keys were never expanded)
                dq_a = dqf.to(acc) if dq_a is None else dq_a + dqf
                dks[j][a:e] += dka.permute(2, 0, 1, 3)  # shared ancestor keys get the sum over every query
                dvs[j][a:e] += dva.permute(2, 0, 1, 3)
            dq_rows = unfold(dq_a, n)  # [m, b, n, h]
            offset = 0
            for a, e in rows:
                dq[a:e] += dq_rows[offset : offset + e - a]
                offset += e - a
        for run in group.runs:  # part B, batched causal over own keys, also with the merged out/lse
            c = run.count
            dqs, dkk, dvv = fused_attention_backward(
                to_kernel(dout[run.rows], c),
                to_kernel(q[run.rows], c),
                _expand_run(ks[run.block], run, n),
                _expand_run(vs[run.block], run, n),
                to_kernel(out[run.rows], c),
                to_kernel(lse[run.rows].unsqueeze(-1), c).squeeze(-1),
                True,
                scale,
            )  # [c*b, n, L, h] x3
            own = slice(run.k0, run.k0 + c * run.length)
            dq[run.rows] += from_kernel(dqs, c)
            dks[run.block][own] += reduce_kv_heads(from_kernel(dkk.to(acc), c), g)
            dvs[run.block][own] += reduce_kv_heads(from_kernel(dvv.to(acc), c), g)
    return dq, dks, dvs


class MergeAttnFunc(torch.autograd.Function):
    """Thin autograd wrapper. Inputs: q, the plan, the scale, the number of key blocks m, then k_0.., v_0.."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, plan: MergePlan, scale: float, m: int, *kv: torch.Tensor):  # noqa: ANN205
        ks, vs = kv[:m], kv[m:]
        with torch.no_grad():
            out, lse = merge_attention_forward(q, ks, vs, plan, scale)
        sq, b, n, h = q.shape
        result = out.to(q.dtype).view(sq, b, n * h)  # [sq, b, n*h]
        # backward needs the inputs, the MERGED output and lse; nothing per part
        ctx.save_for_backward(q, result, lse, *ks, *vs)
        ctx.plan, ctx.scale, ctx.m = plan, scale, m
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, result, lse, *kv = ctx.saved_tensors
        ks, vs = kv[: ctx.m], kv[ctx.m :]
        sq, b, n, h = q.shape
        dq, dks, dvs = merge_attention_backward(
            grad.reshape(sq, b, n, h), q, ks, vs, result.view(sq, b, n, h), lse, ctx.plan, ctx.scale
        )
        needs = ctx.needs_input_grad
        grads_k = [d.to(k.dtype) if needs[4 + j] else None for j, (d, k) in enumerate(zip(dks, ks))]
        grads_v = [d.to(v.dtype) if needs[4 + ctx.m + j] else None for j, (d, v) in enumerate(zip(dvs, vs))]
        return (dq.to(q.dtype) if needs[0] else None, None, None, None, *grads_k, *grads_v)


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
    return MergeAttnFunc.apply(q, _plan(layout, ks), scale, len(ks), *ks, *vs)
