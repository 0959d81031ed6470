"""Context parallelism: ring attention over a tree mask (exact forward and backward, any CP size, gloo or NCCL).

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    sq  query rows held by THIS rank      sk  key rows held by THIS rank (the same on every rank of the ring)
    b   batch   n query heads   g kv heads (GQA groups)   h head dim   W ring (CP group) size
    q        [sq, b, n, h]           k, v     [sk, b, g, h]            out  [sq, b, n * h]
    q_meta   [2, sq] long            k_meta   [2, sk] long: row 0 tree segment id (-1 = padding), row 1 offset of
                                     the token inside its segment
    related  [S, S] bool             related[qs, ks]: segment ks is an ancestor-or-self of segment qs
    inside:  qb [b, n, sq, h], one K/V block kvb [2, sk, b, g, h] (k and v stacked, one message), lse [b, n, sq]

Visibility comes from the metadata alone (tokens may sit anywhere, e.g. zigzag-reordered): each (query block, key
block) pair is cut into fully visible rectangles and causal squares (attention/visibility.py: `plan_block` over the
blocks' runs of consecutive offsets), run through the fused kernels and merged with THE `lse_merge` in fp32 (fp64
for fp64 inputs) by attention/rectangles.py. No tensor of [sq, sk] size exists anywhere, forward or backward: no
mask, no scores, no probabilities outside the fused kernels' tiles. A block the tree hides entirely has an empty plan
and is skipped without a kernel call. A block's metadata is O(sk) longs and its plan O(runs).

A rank keeps its own K/V and passes one K/V block (plus its metadata) to rank r+1 each step, W-1 times per layer
(ring-flash-attention by zhuzilin: `ring_flash_attn_forward` / `_backward`, RingComm).

Backward (the same ring trick as attention/merge_backend.py): each rectangle's backward runs with the MERGED out/lse,
so P = exp(S - lse) is exactly that rectangle's columns of the full softmax. The forward's plans are kept for the
backward (block t of the backward ring comes from the same rank as block t of the forward), so the backward ring
sends no metadata. dQ stays local; a dK/dV accumulator (fp32) travels around the ring WITH its K/V block, every rank
adds its contribution, and one last hop delivers it to the block's owner: W-1 K/V messages and W dK/dV messages per
layer.

Communication overlaps compute: the next block's isend/irecv is posted before the current block is computed (and a
block's dK/dV contribution is computed before the accumulator that travels with it is waited for), so a rank holds
its own K/V, the block it computes on and the block in flight (never the whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.attention.kernels import lse_dtype
from megatron_branch.attention.rectangles import plan_backward, plan_forward
from megatron_branch.attention.reference import expand_kv
from megatron_branch.attention.visibility import BlockPlan, ancestors_from_related, plan_block, runs_from_meta


@dataclass
class RingStats:
    """Counters the tests and benchmarks read to prove the ring is real; pass one in (`stats=`), read it after.

    Counted per process; all counts are deterministic for a given tree, layout and model.
    """

    kv_messages: int = 0  # K/V blocks sent (forward and backward rings)
    grad_messages: int = 0  # dK/dV blocks sent (backward)
    bytes_sent: int = 0
    blocks_computed: int = 0  # (q block, k block) pairs with at least one kernel call, forward
    blocks_skipped: int = 0  # pairs the tree hides entirely, forward (no kernel call, nothing built)
    kernel_calls: int = 0  # fused-kernel rectangles run, forward
    visible_pairs: int = 0  # visible (query, key) pairs computed, forward (causal counted as causal)
    max_kv_rows_held: int = 0  # largest number of FOREIGN K/V rows alive at once on this rank
    kv_block_shapes: set[tuple[int, ...]] = field(default_factory=set)  # shapes of every received K/V block

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


class _RingComm:
    """One hop of the ring: send to rank+1, receive from rank-1 (global ranks resolved once)."""

    def __init__(self, group: Any, stats: RingStats) -> None:
        self.group, self.stats = group, stats
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world)
        self._reqs: list[Any] = []

    def send_recv(self, tensors: list[torch.Tensor], tag: int = 0) -> list[torch.Tensor]:
        """Post isend of `tensors` to next and irecv of same-shaped buffers from prev; returns the buffers.

        Distinct tags per stream (K/V, metadata, dK/dV) keep two rings in flight on one group unambiguous."""
        recv = [torch.empty_like(t) for t in tensors]
        ops = []
        for i, (t, r) in enumerate(zip(tensors, recv)):
            assert t.is_contiguous(), "point-to-point needs contiguous tensors"
            ops.append(dist.P2POp(dist.isend, t, self.next, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev, self.group, tag + i))
            self.stats.bytes_sent += t.numel() * t.element_size()
        self._reqs = dist.batch_isend_irecv(ops)
        return recv

    def wait(self) -> None:
        for req in self._reqs:
            req.wait()
        self._reqs = []


def _expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """[sk, b, g, h] -> [b, n, sk, h], kv heads repeated n // g times (THE expand_kv, Megatron's grouping)."""
    return expand_kv(x, n).permute(1, 2, 0, 3).contiguous()


def ring_tree_attention_forward(q, k, v, q_meta, k_meta, related, scale, group, stats):  # noqa: ANN001, ANN201
    """Forward ring; returns (out [b,n,sq,h] acc dtype, lse [b,n,sq], the W block plans in ring order)."""
    comm = _RingComm(group, stats)
    sq, b, n, h = q.shape
    acc = lse_dtype(q.dtype)
    qb = q.permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
    q_runs = runs_from_meta(q_meta)
    ancestors = ancestors_from_related(related, q_runs.segment)  # once per call: the query side is fixed
    kvb = torch.stack([k, v]).contiguous()  # [2, sk, b, g, h]: one message for both
    meta = k_meta.contiguous()  # [2, sk]
    # running result; rows that never see a key end as out 0, lse -inf (padding, or queries with no visible key)
    out = torch.zeros(b, n, sq, h, dtype=acc, device=q.device)
    lse = torch.full((b, n, sq), float("-inf"), dtype=acc, device=q.device)
    plans: list[BlockPlan] = []
    for step in range(comm.world):
        if step + 1 < comm.world:  # post the next hop BEFORE computing: communication overlaps the kernels
            nxt = comm.send_recv([kvb, meta], tag=0)
            stats.kv_messages += 1
            # foreign K/V alive now: the block computed on (from step 1) + the one in flight
            stats.max_kv_rows_held = max(stats.max_kv_rows_held, (2 if step else 1) * k.shape[0])
        plan = plan_block(q_runs, runs_from_meta(meta), ancestors)
        plans.append(plan)
        if plan.empty:
            stats.blocks_skipped += 1
        else:
            stats.blocks_computed += 1
            stats.kernel_calls += plan.kernel_calls
            stats.visible_pairs += plan.visible_pairs
            plan_forward(qb, _expand(kvb[0], n), _expand(kvb[1], n), plan, scale, out, lse)
        if step + 1 < comm.world:
            comm.wait()
            kvb, meta = nxt
            stats.kv_block_shapes.add(tuple(kvb.shape))
    return out, lse, plans


def ring_tree_attention_backward(dout, q, k, v, out, lse, plans, scale, group, stats):  # noqa: ANN001, ANN201
    """Backward ring with the MERGED out/lse and the forward's plans; returns dq [sq,b,n,h], dk/dv [sk,b,g,h]."""
    comm_kv, comm_d = _RingComm(group, stats), _RingComm(group, stats)
    sq, b, n, h = q.shape
    acc = lse_dtype(q.dtype)
    qb = q.permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
    dob = dout.permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
    ob = out.to(q.dtype)  # [b, n, sq, h]: the fused backward takes out in the input dtype
    dq = torch.zeros(b, n, sq, h, dtype=acc, device=q.device)  # dQ never leaves the rank
    kvb = torch.stack([k, v]).contiguous()  # [2, sk, b, g, h]
    dkv_recv: list[torch.Tensor] = []
    for step in range(comm_kv.world):
        last = step + 1 == comm_kv.world
        if (
            not last
        ):  # next K/V block in flight while this one is differentiated (no metadata: plans are kept)
            nxt = comm_kv.send_recv([kvb], tag=0)
            stats.kv_messages += 1
            stats.max_kv_rows_held = max(stats.max_kv_rows_held, (2 if step else 1) * k.shape[0])
        dkv_block = None
        if not plans[step].empty:  # our contribution, computed while the travelling accumulator is in flight
            dkv_block = torch.zeros(2, *k.shape, dtype=acc, device=k.device)  # [2, sk, b, g, h]
            kb, vb = _expand(kvb[0], n), _expand(kvb[1], n)  # [b, n, sk, h]
            plan_backward(dob, qb, kb, vb, ob, lse, plans[step], scale, dq, dkv_block)
        # The dK/dV accumulator of the block we hold travelled with it (one hop behind); add ours, pass it on.
        if step == 0:
            dkv = torch.zeros(2, *k.shape, dtype=acc, device=k.device) if dkv_block is None else dkv_block
        else:
            comm_d.wait()
            dkv = dkv_recv[0] if dkv_block is None else dkv_recv[0].add_(dkv_block)
        dkv_recv = comm_d.send_recv([dkv.contiguous()], tag=2)
        stats.grad_messages += 1
        if not last:
            comm_kv.wait()
            (kvb,) = nxt
            stats.kv_block_shapes.add(tuple(kvb.shape))
    comm_d.wait()  # after W hops the accumulator of OUR block is back home
    dk, dv = dkv_recv[0][0], dkv_recv[0][1]  # [sk, b, g, h] each
    return dq.permute(2, 0, 1, 3).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, q_meta, k_meta, related, scale, group, stats):  # noqa: ANN001, ANN205
        with torch.no_grad():
            out, lse, plans = ring_tree_attention_forward(
                q, k, v, q_meta, k_meta, related, scale, group, stats
            )
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plans, ctx.scale, ctx.group, ctx.stats = plans, scale, group, stats
        sq, b, n, h = q.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, n * h).to(q.dtype)  # [sq, b, n*h]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        q, k, v, out, lse = ctx.saved_tensors
        sq, b, n, h = q.shape
        dout = grad.reshape(sq, b, n, h)  # [sq, b, n, h]
        dq, dk, dv = ring_tree_attention_backward(
            dout, q, k, v, out, lse, ctx.plans, ctx.scale, ctx.group, ctx.stats
        )
        return dq, dk, dv, None, None, None, None, None, None


def ring_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_meta: torch.Tensor,
    k_meta: torch.Tensor,
    related: torch.Tensor,
    scale: float,
    cp_group: Any,
    *,
    stats: RingStats | None = None,
) -> torch.Tensor:
    """Tree-masked attention of this rank's queries over the keys of every rank of `cp_group` -> [sq, b, n*h].

    q [sq,b,n,h]; k, v [sk,b,g,h] (this rank's keys; sk equal on every rank); q_meta [2,sq], k_meta [2,sk] long
    (segment id, offset in segment; segment -1 = padding); related [S,S] bool (ancestor-or-self). `stats`: counters
    to add to (None = not counted). Collective: every rank of `cp_group` must call it, in the same order, and run
    its backward.
    """
    assert q.dim() == 4 and k.dim() == 4 and k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q_meta.shape == (2, q.shape[0]) and k_meta.shape == (2, k.shape[0]), (q_meta.shape, k_meta.shape)
    assert q.shape[2] % k.shape[2] == 0, "query heads must be a multiple of kv heads"
    return _RingTreeAttention.apply(
        q, k, v, q_meta, k_meta, related, scale, cp_group, RingStats() if stats is None else stats
    )
