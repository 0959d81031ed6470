"""Context parallelism: ring attention over a tree mask (exact forward and backward, any CP size, gloo or NCCL).

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    sq  query rows held by THIS rank      sk  key rows held by THIS rank (the same on every rank of the ring)
    b   batch   n query heads   g kv heads (GQA groups)   h head dim   W ring (CP group) size
    q        [sq, b, n, h]           k, v     [sk, b, g, h]            out  [sq, b, n * h]
    q_meta   [2, sq] long            k_meta   [2, sk] long: row 0 tree segment id (-1 = padding), row 1 offset of
                                     the token inside its segment
    related  [S, S] bool             related[qs, ks]: segment ks is an ancestor-or-self of segment qs
    inside:  qb [b, n, sq, h], one K/V block kvb [2, sk, b, g, h] (k and v stacked, one message), lse [b, n, sq]

Tree mask of a (query, key) pair, from the metadata alone (tokens may sit anywhere, e.g. zigzag-reordered):
    visible = related[q_seg, k_seg] and (q_seg != k_seg or k_off <= q_off), and neither is padding.
A rank keeps its own K/V and passes one K/V block (plus its metadata) to rank r+1 each step, W-1 times per layer
(ring-flash-attention by zhuzilin: `ring_flash_attn_forward` / `_backward`, RingComm). Block results are merged with
THE `lse_merge` in fp32 (fp64 for fp64 inputs). Blocks the mask hides entirely are skipped (no kernel call);
fully-visible blocks use the fused kernel, partial ones the masked math kernel.

Backward (the same ring trick as attention/merge_backend.py): each block's backward runs with the MERGED out/lse, so
P = exp(S - lse) is exactly that block's columns of the full softmax. dQ stays local; a dK/dV accumulator (fp32)
travels around the ring WITH its K/V block, every rank adds its contribution, and one last hop delivers it to the
block's owner: W-1 K/V messages and W dK/dV messages per layer.

Communication overlaps compute: the next block's isend/irecv is posted before the current block is computed, so a
rank holds its own K/V, the block it computes on and the block in flight (never the whole sequence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.attention.kernels import (
    fused_attention_backward,
    fused_attention_forward,
    lse_dtype,
    math_attention_backward,
    math_attention_forward,
)
from megatron_branch.attention.merge import lse_merge


@dataclass
class RingStats:
    """Counters the tests read to prove the ring is real (reset with `reset()`)."""

    kv_messages: int = 0  # K/V blocks sent (forward and backward recompute rings)
    grad_messages: int = 0  # dK/dV blocks sent (backward)
    bytes_sent: int = 0
    blocks_computed: int = 0  # (q block, k block) pairs with a kernel call, forward
    blocks_skipped: int = 0  # pairs the mask hides entirely, forward
    max_kv_rows_held: int = 0  # largest number of FOREIGN K/V rows alive at once on this rank
    kv_block_shapes: set[tuple[int, ...]] = field(default_factory=set)  # shapes of every received K/V block

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


RING_STATS = RingStats()
"""Process-wide counters, used when no `stats` object is passed."""


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


def _block_mask(q_meta: torch.Tensor, k_meta: torch.Tensor, related: torch.Tensor) -> torch.Tensor:
    """[sq, sk] bool visibility of one (query block, key block) pair from per-token metadata."""
    qs, qo = q_meta[0], q_meta[1]  # [sq]
    ks, ko = k_meta[0], k_meta[1]  # [sk]
    real = (qs >= 0)[:, None] & (ks >= 0)[None, :]  # [sq, sk]; padding sees nothing and is seen by nothing
    rel = related[qs.clamp(min=0)][:, ks.clamp(min=0)]  # [sq, sk]
    causal = (qs[:, None] != ks[None, :]) | (ko[None, :] <= qo[:, None])  # [sq, sk]
    return real & rel & causal


def _expand(x: torch.Tensor, n: int) -> torch.Tensor:
    """[sk, b, g, h] -> [b, n, sk, h], kv heads repeated n // g times (Megatron's grouping)."""
    g = x.shape[2]
    x = x if g == n else x.repeat_interleave(n // g, dim=2)
    return x.permute(1, 2, 0, 3).contiguous()


def _reduce_groups(x: torch.Tensor, g: int) -> torch.Tensor:
    """[b, n, sk, h] gradient of the expanded heads -> [sk, b, g, h], summing each kv head's copies."""
    b, n, sk, h = x.shape
    return x.view(b, g, n // g, sk, h).sum(2).permute(2, 0, 1, 3)


def _block_forward(qb, kvb, q_meta, k_meta, related, scale):  # noqa: ANN001, ANN202
    """(out [b,n,sq,h], lse [b,n,sq]) of the local queries over one K/V block, or None when the mask hides it."""
    mask = _block_mask(q_meta, k_meta, related)  # [sq, sk]
    if not bool(mask.any()):
        return None
    n = qb.shape[1]
    kb, vb = _expand(kvb[0], n), _expand(kvb[1], n)  # [b, n, sk, h]
    if bool(mask.all()):  # fully visible (e.g. a whole ancestor block): the fused kernel, no mask
        return fused_attention_forward(qb, kb, vb, False, scale)
    return math_attention_forward(qb, kb, vb, mask, scale)


def ring_tree_attention_forward(q, k, v, q_meta, k_meta, related, scale, group, stats):  # noqa: ANN001, ANN201
    """Forward ring; returns (out [b,n,sq,h] acc dtype, lse [b,n,sq])."""
    comm = _RingComm(group, stats)
    sq, b, n, h = q.shape
    qb = q.permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
    kvb = torch.stack([k, v]).contiguous()  # [2, sk, b, g, h]: one message for both
    meta = k_meta.contiguous()  # [2, sk]
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    for step in range(comm.world):
        if step + 1 < comm.world:  # post the next hop BEFORE computing: communication overlaps the kernel
            nxt = comm.send_recv([kvb, meta], tag=0)
            stats.kv_messages += 1
            # foreign K/V alive now: the block computed on (from step 1) + the one in flight
            stats.max_kv_rows_held = max(stats.max_kv_rows_held, (2 if step else 1) * k.shape[0])
        res = _block_forward(qb, kvb, q_meta, meta, related, scale)
        if res is None:
            stats.blocks_skipped += 1
        else:
            stats.blocks_computed += 1
            out, lse = lse_merge(out, lse, res[0], res[1])
        if step + 1 < comm.world:
            comm.wait()
            kvb, meta = nxt
            stats.kv_block_shapes.add(tuple(kvb.shape))
    if out is None:  # this rank's queries see no key at all (all padding): out 0, lse -inf
        acc = lse_dtype(q.dtype)
        out = torch.zeros(b, n, sq, h, dtype=acc, device=q.device)
        lse = torch.full((b, n, sq), float("-inf"), dtype=acc, device=q.device)
    assert lse is not None
    return out, lse


def ring_tree_attention_backward(dout, q, k, v, out, lse, q_meta, k_meta, related, scale, group, stats):  # noqa: ANN001, ANN201
    """Backward ring with the MERGED out/lse; returns dq [sq,b,n,h], dk/dv [sk,b,g,h] for this rank's rows."""
    comm_kv, comm_d = _RingComm(group, stats), _RingComm(group, stats)
    sq, b, n, h = q.shape
    g = k.shape[2]
    acc = lse_dtype(q.dtype)
    qb = q.permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
    dob = dout.permute(1, 2, 0, 3).contiguous()  # [b, n, sq, h]
    dq = torch.zeros(b, n, sq, h, dtype=acc, device=q.device)  # dQ never leaves the rank
    kvb = torch.stack([k, v]).contiguous()  # [2, sk, b, g, h]
    meta = k_meta.contiguous()  # [2, sk]
    dkv_recv: list[torch.Tensor] = []
    for step in range(comm_kv.world):
        last = step + 1 == comm_kv.world
        if not last:  # next K/V block in flight while this one is differentiated
            nxt = comm_kv.send_recv([kvb, meta], tag=0)
            stats.kv_messages += 1
            stats.max_kv_rows_held = max(stats.max_kv_rows_held, (2 if step else 1) * k.shape[0])
        mask = _block_mask(q_meta, meta, related)  # [sq, sk]
        dkv_block = None
        if bool(mask.any()):
            kb, vb = _expand(kvb[0], n), _expand(kvb[1], n)  # [b, n, sk, h]
            if bool(mask.all()):
                dqb, dkb, dvb = fused_attention_backward(dob, qb, kb, vb, out.to(q.dtype), lse, False, scale)
            else:
                dqb, dkb, dvb = math_attention_backward(dob, qb, kb, vb, out, lse, mask, scale)
            dq += dqb.to(acc)
            dkv_block = torch.stack([_reduce_groups(dkb.to(acc), g), _reduce_groups(dvb.to(acc), g)])
        # The dK/dV accumulator of the block we hold travelled with it (one hop behind); add ours, pass it on.
        if step == 0:
            dkv = torch.zeros(2, *k.shape, dtype=acc, device=k.device)  # [2, sk, b, g, h]: our own block
        else:
            comm_d.wait()
            dkv = dkv_recv[0]
        if dkv_block is not None:
            dkv = dkv + dkv_block
        dkv_recv = comm_d.send_recv([dkv.contiguous()], tag=2)
        stats.grad_messages += 1
        if not last:
            comm_kv.wait()
            kvb, meta = nxt
            stats.kv_block_shapes.add(tuple(kvb.shape))
    comm_d.wait()  # after W hops the accumulator of OUR block is back home
    dk, dv = dkv_recv[0][0], dkv_recv[0][1]  # [sk, b, g, h] each
    return dq.permute(2, 0, 1, 3).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingTreeAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q, k, v, q_meta, k_meta, related, scale, group, stats):  # noqa: ANN001, ANN205
        with torch.no_grad():
            out, lse = ring_tree_attention_forward(q, k, v, q_meta, k_meta, related, scale, group, stats)
        ctx.save_for_backward(q, k, v, out, lse, q_meta, k_meta, related)
        ctx.scale, ctx.group, ctx.stats = scale, group, stats
        sq, b, n, h = q.shape
        return out.permute(2, 0, 1, 3).reshape(sq, b, n * h).to(q.dtype)  # [sq, b, n*h]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        q, k, v, out, lse, q_meta, k_meta, related = ctx.saved_tensors
        sq, b, n, h = q.shape
        dout = grad.reshape(sq, b, n, h)  # [sq, b, n, h]
        dq, dk, dv = ring_tree_attention_backward(
            dout, q, k, v, out, lse, q_meta, k_meta, related, ctx.scale, ctx.group, ctx.stats
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
    (segment id, offset in segment; segment -1 = padding); related [S,S] bool (ancestor-or-self). Collective: every
    rank of `cp_group` must call it, in the same order, and run its backward.
    """
    assert q.dim() == 4 and k.dim() == 4 and k.shape == v.shape, (q.shape, k.shape, v.shape)
    assert q_meta.shape == (2, q.shape[0]) and k_meta.shape == (2, k.shape[0]), (q_meta.shape, k_meta.shape)
    assert q.shape[2] % k.shape[2] == 0, "query heads must be a multiple of kv heads"
    return _RingTreeAttention.apply(
        q, k, v, q_meta, k_meta, related, scale, cp_group, RING_STATS if stats is None else stats
    )
