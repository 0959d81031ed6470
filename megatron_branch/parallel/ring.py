"""Context parallelism: ring attention over a tree mask, each block run by the CHOSEN executor of THE plan.

SHAPE LEGEND (Megatron sequence-first, rows first everywhere):
    sq  query rows held by THIS rank      sk  key rows held by THIS rank (the same on every rank of the ring),
                                              as local key blocks sk_j (replay: this rank's shards of the cached
                                              ancestors, then the chunk's own rows), sum_j sk_j = sk
    b   batch   n query heads   g kv heads (GQA groups, never expanded)   h head dim   W ring (CP group) size
    q        [sq, b, n, h]           ks[j], vs[j] [sk_j, b, g, h]         out  [sq, b, n * h]
    q_meta   [2, sq] long            k_meta   [2, sk] long: row 0 tree segment id (-1 = padding), row 1 offset of
                                     the token inside its segment (the local blocks' rows end to end)
    related  [S, S] bool             related[qs, ks]: segment ks is an ancestor-or-self of segment qs
    message  [2, sk, b, g, h]        this rank's K/V stacked, the ring's one K/V message (one copy of the blocks)
    out, lse [sq, b, n, h], [sq, b, n] in fp32 (fp64 for fp64): the running merge over the ring's steps

Step t computes this rank's queries over the key rows of rank r - t: step 0 reads the LOCAL blocks in place (no
concatenation of a cached path's K/V), later steps the received message. Each step's visibility is THE plan
(attention/plan.py, built from the metadata by plan_sources.plan_from_meta), run by the executor the schedule chose
(attention/executor.py: merge, packed, reference, flex): the same functions a single rank runs, so a backend means
the same at CP1 and under CP. Each step's (out, lse) is merged into the running result with THE `lse_merge`; a step
the tree hides entirely has an empty plan and computes nothing. No tensor of [sq, sk] size exists (with merge or
flex), forward or backward.

A rank keeps its own K/V and passes one K/V message (plus, on a forward's first layer, its metadata) to rank r+1
each step, W-1 times per layer (ring-flash-attention by zhuzilin: `ring_flash_attn_forward` / `_backward`,
RingComm). The plans of every step are the same for every layer of a chunk: the context keeps them
(`RingPlans`), so later layers send K/V only.

Backward (the ring trick): each step's executor backward runs with the MERGED out/lse, so dq sums over steps. A dK/dV
accumulator (fp32) travels around the ring WITH its K/V block, every rank adds its contribution, and one last hop
delivers it to the block's owner: W-1 K/V messages and W dK/dV messages per layer. Communication overlaps compute:
the next block's isend/irecv is posted before the current block is computed, so a rank holds its own K/V, the block
it computes on and the block in flight (never the whole sequence).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.attention.executor import Executor, empty_result, own
from megatron_branch.attention.kernels import lse_dtype
from megatron_branch.attention.merge import add_sink, lse_merge, sink_grad
from megatron_branch.attention.plan import BlockPlan, Runs, runs_from_meta
from megatron_branch.attention.plan_sources import ancestors_from_related, plan_from_meta


@dataclass
class RingStats:
    """Counters the tests and benchmarks read to prove the ring (and the head exchange of a gated delta net layer)
    is real; pass one in (`stats=`), read it after.

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
    # the head exchange of a gated delta net layer (parallel/head_exchange.py), forward; backward sends as much
    exchange_messages: int = 0  # blocks sent to other ranks
    exchange_bytes: int = 0  # their bytes

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]


@dataclass
class RingPlans:
    """The plan of every ring step for one chunk's forward, per sliding window (None: full attention; the same for
    every layer of that window), and the key metadata of every step: the chunk's first layer receives it and
    keeps it, so a layer of another window (gpt-oss alternates) plans without sending it again."""

    metas: list[torch.Tensor] = field(default_factory=list)
    """[2, sk] key metadata of ring step t (step 0: this rank's own)."""
    by_window: dict[int | None, list[BlockPlan]] = field(default_factory=dict)
    """window -> the plan of every ring step."""


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


def _message(ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Blocks [sk_j, b, g, h] as ONE contiguous message [2, sk, b, g, h] (the one copy point-to-point needs): the
    local K/V, or a step's dK/dV."""
    sk = sum(k.shape[0] for k in ks)
    msg = ks[0].new_empty(2, sk, *ks[0].shape[1:])
    start = 0
    for k, v in zip(ks, vs):
        msg[0, start : start + k.shape[0]] = k
        msg[1, start : start + k.shape[0]] = v
        start += k.shape[0]
    return msg


@dataclass
class _Query:
    """The query side of the ring, fixed over its steps: runs and ancestors computed once per call."""

    meta: torch.Tensor
    runs: Runs
    ancestors: dict[int, tuple[int, ...]]


@dataclass(frozen=True)
class Window:
    """A sliding window for the ring's plans: `size` path positions (None: none), `seg_start` [S] long the path
    position of each tree segment's first token (a token's position = its segment's start + its offset)."""

    size: int | None = None
    seg_start: torch.Tensor | None = None


def _plan(
    query: _Query, k_meta: torch.Tensor, related: torch.Tensor, sizes: list[int], window: Window
) -> BlockPlan:
    return plan_from_meta(
        query.meta,
        k_meta,
        related,
        sizes,
        q_runs=query.runs,
        ancestors=query.ancestors,
        window=window.size,
        seg_start=window.seg_start,
    )


def ring_forward(q, ks, vs, q_meta, k_meta, related, scale, group, executor, stats, plans, window):  # noqa: ANN001, ANN201
    """Forward ring; returns (out [sq,b,n,h], lse [sq,b,n]) in the accumulation dtype and the plan of every step
    (kept in `plans` for the chunk's later layers of the same window)."""
    comm = _RingComm(group, stats)
    sizes = [k.shape[0] for k in ks]
    sk = sum(sizes)
    known = bool(
        plans.metas
    )  # later layers of the chunk: the metadata of every step is known, only K/V travel
    steps = plans.by_window.get(window.size)
    new_steps: list[BlockPlan] = []
    query = (
        None
        if steps is not None
        else _Query(q_meta, runs := runs_from_meta(q_meta), ancestors_from_related(related, runs.segment))
    )
    out, lse = empty_result(q)  # rows that never see a key end as out 0, lse -inf (padding)
    msg, meta = (_message(ks, vs) if comm.world > 1 else None), k_meta.contiguous()
    blocks: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] = (ks, vs)
    for step in range(comm.world):
        if step + 1 < comm.world:  # post the next hop BEFORE computing: communication overlaps the kernels
            nxt = comm.send_recv([msg] if known else [msg, meta], tag=0)
            stats.kv_messages += 1
            # foreign K/V alive now: the block computed on (from step 1) + the one in flight
            stats.max_kv_rows_held = max(stats.max_kv_rows_held, (2 if step else 1) * sk)
        if not known:
            plans.metas.append(meta)
        if steps is None:
            assert query is not None
            new_steps.append(_plan(query, plans.metas[step], related, sizes if step == 0 else [sk], window))
        plan = (new_steps if steps is None else steps)[step]
        if plan.empty:
            stats.blocks_skipped += 1
        else:
            stats.blocks_computed += 1
            stats.kernel_calls += plan.kernel_calls
            stats.visible_pairs += plan.visible_pairs
            o, lo = executor.forward(q, *blocks, plan, scale)  # [sq, b, n, h], [sq, b, n]
            out, lse = (o, lo) if step == 0 else lse_merge(out, lse, o, lo)
        if step + 1 < comm.world:
            comm.wait()
            msg = nxt[0]
            meta = meta if known else nxt[1]
            blocks = ([msg[0]], [msg[1]])
            stats.kv_block_shapes.add(tuple(msg.shape))
    if steps is None:
        plans.by_window[window.size] = steps = new_steps
    return out, lse, steps


def ring_backward(dout, q, ks, vs, out, lse, steps, scale, group, executor, stats):  # noqa: ANN001, ANN201
    """Backward ring with the MERGED out/lse and the forward's plan of every step; returns dq [sq,b,n,h] and, per local block,
    dk_j/dv_j [sk_j,b,g,h], in the accumulation dtype."""
    comm_kv, comm_d = _RingComm(group, stats), _RingComm(group, stats)
    world, acc = comm_kv.world, lse_dtype(q.dtype)
    sizes = [k.shape[0] for k in ks]
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # dQ never leaves the rank
    if world == 1:  # one rank: the executor's own backward, nothing travels
        dq_t, dks, dvs = executor.backward(dout, q, ks, vs, out, lse, steps[0], scale)
        return dq_t, dks, dvs
    msg = _message(ks, vs)  # [2, sk, b, g, h]: this rank's blocks, the message of the backward ring
    blocks: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]] = (ks, vs)
    dkv_recv: list[torch.Tensor] = []
    for step in range(world):
        last = step + 1 == world
        if (
            not last
        ):  # next K/V block in flight while this one is differentiated (no metadata: plans are kept)
            nxt = comm_kv.send_recv([msg], tag=0)
            stats.kv_messages += 1
            stats.max_kv_rows_held = max(stats.max_kv_rows_held, (2 if step else 1) * msg.shape[1])
        contribution = (
            None  # our dK/dV for the block held, computed while the travelling accumulator is in flight
        )
        if not steps[step].empty:
            dq_t, dks_t, dvs_t = executor.backward(dout, q, *blocks, out, lse, steps[step], scale)
            dq += dq_t
            contribution = _message(dks_t, dvs_t)  # [2, sk, b, g, h], the travelling accumulator's shape
        # The dK/dV accumulator of the block we hold travelled with it (one hop behind); add ours, pass it on.
        if step == 0:
            dkv = (
                torch.zeros(2, *msg.shape[1:], dtype=acc, device=q.device)
                if contribution is None
                else contribution
            )
        else:
            comm_d.wait()
            dkv = dkv_recv[0] if contribution is None else dkv_recv[0].add_(contribution)
        dkv_recv = comm_d.send_recv([dkv.contiguous()], tag=2)
        stats.grad_messages += 1
        if not last:
            comm_kv.wait()
            msg = nxt[0]
            blocks = ([msg[0]], [msg[1]])
            stats.kv_block_shapes.add(tuple(msg.shape))
    comm_d.wait()  # after W hops the accumulator of OUR blocks is back home
    home = dkv_recv[0]  # [2, sk, b, g, h]
    return dq, list(torch.split(home[0], sizes)), list(torch.split(home[1], sizes))


class _RingTreeAttention(torch.autograd.Function):
    """Inputs: q, q_meta, k_meta, related, scale, group, executor, stats, plans, window, the number of local
    blocks m, the sink [n] (None: none), then k_0.., v_0.."""

    @staticmethod
    def forward(
        ctx: Any, q, q_meta, k_meta, related, scale, group, executor, stats, plans, window, m, sink, *kv
    ):  # noqa: ANN001, ANN205
        ks, vs = kv[:m], kv[m:]
        with torch.no_grad():
            out, lse, steps = ring_forward(
                q, ks, vs, q_meta, k_meta, related, scale, group, executor, stats, plans, window
            )
            if sink is not None:  # once per row, after every ring step (attention/merge.py)
                out, lse = add_sink(out, lse, sink)
        sq, b, n, h = q.shape
        result = out.to(q.dtype).reshape(sq, b, n * h)  # [sq, b, n*h]
        ctx.save_for_backward(q, result, lse, *ks, *vs)  # the local blocks in place: no concatenated copy
        ctx.scale, ctx.group, ctx.executor, ctx.stats, ctx.steps, ctx.m, ctx.sink = (
            scale,
            group,
            executor,
            stats,
            steps,
            m,
            sink,
        )
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        q, result, lse, *kv = ctx.saved_tensors
        m = ctx.m
        ks, vs = kv[:m], kv[m:]
        sq, b, n, h = q.shape
        d_sink = None
        if ctx.needs_input_grad[
            11
        ]:  # this rank's rows' share; the sink's gradient is summed over CP like any
            d_sink = sink_grad(grad.reshape(sq, b, n, h), result.view(sq, b, n, h), lse, ctx.sink)
        dq, dks, dvs = ring_backward(
            grad.reshape(sq, b, n, h),
            q,
            ks,
            vs,
            result.view(sq, b, n, h),
            lse,
            ctx.steps,
            ctx.scale,
            ctx.group,
            ctx.executor,
            ctx.stats,
        )
        grads = [own(d, t) for d, t in zip([*dks, *dvs], [*ks, *vs])]
        return (dq.to(q.dtype), *(None,) * 10, d_sink, *grads)


def ring_tree_attention(
    q: torch.Tensor,
    k: torch.Tensor | Sequence[torch.Tensor],
    v: torch.Tensor | Sequence[torch.Tensor],
    q_meta: torch.Tensor,
    k_meta: torch.Tensor,
    related: torch.Tensor,
    scale: float,
    cp_group: Any,
    *,
    executor: Executor | None = None,
    stats: RingStats | None = None,
    plans: RingPlans | None = None,
    window: int | None = None,
    seg_start: torch.Tensor | None = None,
    sink: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree-masked attention of this rank's queries over the keys of every rank of `cp_group` -> [sq, b, n*h].

    q [sq,b,n,h]; k, v [sk,b,g,h] or local key blocks [sk_j,b,g,h] end to end (this rank's keys, read in place; sk
    equal on every rank); q_meta [2,sq], k_meta [2,sk] long (segment id, offset in segment; segment -1 = padding);
    related [S,S] bool (ancestor-or-self). `executor`: the plan's executor (None: merge). `stats`: counters to add
    to. `plans`: the chunk's ring plans, shared by its layers (None: built for this call). `window`: a sliding
    window over path positions, `seg_start` [S] long the path position of each segment's first token (needed with
    a window); `sink` [n]: learned sink logits, merged once per row after every step. Collective: every rank of
    `cp_group` must call it, in the same order, and run its backward.
    """
    assert window is None or seg_start is not None, "a sliding window needs the segments' path positions"
    from megatron_branch.attention.dispatch import executor as named_executor

    ks = [k] if isinstance(k, torch.Tensor) else list(k)
    vs = [v] if isinstance(v, torch.Tensor) else list(v)
    sk = sum(x.shape[0] for x in ks)
    assert q.dim() == 4 and all(x.shape == y.shape for x, y in zip(ks, vs)), (q.shape, [x.shape for x in ks])
    assert q_meta.shape == (2, q.shape[0]) and k_meta.shape == (2, sk), (q_meta.shape, k_meta.shape)
    assert q.shape[2] % ks[0].shape[2] == 0, "query heads must be a multiple of kv heads"
    ex = named_executor(None) if executor is None else executor
    ex.check_grad(q, [*ks, *vs])
    stats = RingStats() if stats is None else stats
    plans = RingPlans() if plans is None else plans
    win = Window(size=window, seg_start=seg_start)
    return _RingTreeAttention.apply(
        q, q_meta, k_meta, related, scale, cp_group, ex, stats, plans, win, len(ks), sink, *ks, *vs
    )
