"""Baselines without sharing, on the SAME model, kernels and fused logprob as replay: the fair comparison.

Shape legend: s tokens of one forward, m rows that carry a loss, h hidden, v vocabulary slice on this TP rank.

    naive-fused       every rollout separately, one causal segment each (what megatron-core with flash attention or
                      TE does when a user trains each rollout alone): the baseline every headline ratio is quoted
                      against;
    packed-nosharing  all rollouts packed into ONE sequence, block-diagonal causal (verl's remove-padding packing):
                      nothing is shared, every rollout's prompt is computed again.

Both run the branch attention backend (default `merge`: one fused causal call per rollout, equal-length rollouts
batched) and send only the rows that predict a response token through the output projection, fused with the
logprob, exactly as the tree schedules do; only WHICH positions are computed differs. The loss is the objective's
per-rollout form (`rollout_loss`), so these are exact for every objective (tests/unit/test_unshared.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_branch.attention.context import LocalContext
from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.attention.prefix_state import ChunkSegment, ChunkTree
from megatron_branch.data import PrefixTree
from megatron_branch.errors import SettingError
from megatron_branch.losses.objective import BoundObjective, Objective
from megatron_branch.parallel.lockstep import backward
from megatron_branch.rules import API, check_run
from megatron_branch.schedule.common import (
    ChunkOut,
    ScheduleOptions,
    StepResult,
    Store,
    check_recompute_layers,
    model_device,
    row_logprobs,
)
from megatron_branch.schedule.hooks import Rows, hook_forwards


def _pack(tree: PrefixTree, rollouts: Sequence[int], pad_to: int) -> tuple[torch.Tensor, ...]:
    """(input_ids [s], position_ids [s], rows [m], targets [m], layout) of `rollouts` laid end to end."""
    ids, pos, rows, tgt, segs = [], [], [], [], []
    start = 0
    for i in rollouts:
        r = tree.rollouts[i]
        seq = torch.tensor(r.prompt + r.response, dtype=torch.long)  # [L]
        L = seq.numel()
        first = max(
            len(r.prompt) - 1, 0
        )  # row predicting the first response token (an empty prompt: token 1)
        ids.append(seq)
        pos.append(torch.arange(L))
        rows.append(torch.arange(start + first, start + L - 1))  # rows that predict a response token
        tgt.append(seq[first + 1 :])
        segs.append(QuerySegment(q_start=start, q_end=start + L, self_k_start=start))
        start += L
    s = -(-start // pad_to) * pad_to
    if s > start:  # padding: its own causal segment, invisible to every real query
        segs.append(QuerySegment(q_start=start, q_end=s, self_k_start=start))
        ids.append(torch.zeros(s - start, dtype=torch.long))
        pos.append(torch.zeros(s - start, dtype=torch.long))
    layout = AttentionLayout(num_queries=s, num_keys=s, segments=tuple(segs))
    return (
        torch.cat(ids),
        torch.cat(pos),
        torch.cat(rows),
        torch.cat(tgt),
        layout,
        _roots(segs[: len(rollouts)]),
    )


def _roots(segs: Sequence[QuerySegment]) -> ChunkTree:
    """Every rollout a root of its own: what a recurrent layer (the hybrids' gated delta net) reads."""
    return ChunkTree(segments=tuple(ChunkSegment(q.q_start, q.q_end, None) for q in segs))


def _forward(
    model: torch.nn.Module,
    tree: PrefixTree,
    rollouts: Sequence[int],
    bound: BoundObjective | None,
    opts: ScheduleOptions,
    store: Store,
) -> torch.Tensor:
    """One forward of `rollouts` packed without sharing; records their results, returns the sum of their losses."""
    ids, pos, rows, tgt, layout, roots = _pack(tree, rollouts, opts.pad_to)
    dev = model_device(model)
    ids, pos, rows, tgt = ids.to(dev)[None], pos.to(dev)[None], rows.to(dev), tgt.to(dev)
    check_recompute_layers(model, opts)
    ctx = LocalContext(
        layout=layout, backend=opts.backend, recompute_layers=opts.recompute_layers, tree=roots
    )
    want_entropy = opts.keep_entropy or (bound is not None and bound.needs_entropy)
    with hook_forwards(model, opts, Rows(rollouts=rollouts, rows=ids.shape[1])):
        x, ent = row_logprobs(model, ctx, ids, pos, rows, tgt, opts, entropy=want_entropy)
    total = x.new_zeros(())
    offset = 0
    for i in rollouts:
        r = tree.rollouts[i]
        first = max(len(r.prompt) - 1, 0)
        m = len(r.prompt) + len(r.response) - 1 - first  # this rollout's loss rows
        mine = x[offset : offset + m]
        mine_ent = None if ent is None else ent[offset : offset + m]
        offset += m
        loss, stats = x.new_zeros(()), torch.zeros(0, dtype=torch.float64)
        if bound is not None:
            # rollout_loss reads tokens 1..L-1; prompt rows carry no loss (objectives select response rows),
            # so zeros stand in for the rows never computed
            pad = x.new_zeros(first)
            full_ent = None if mine_ent is None else torch.cat([pad, mine_ent])
            loss, stats = bound.rollout_loss(i, torch.cat([pad, mine]), full_ent)
        total = total + loss
        idx = tree.response_indices(i) if r.prompt else tree.response_indices(i)[1:]
        store.add(idx, ChunkOut(loss=loss, stats=stats, logp=mine, entropy=mine_ent, captured={}))
    return total


def _run(
    name: str,
    groups: list[list[int]],
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    forward_only: bool,
) -> StepResult:
    try:  # the rule every entry point checks up front (rules/)
        check_run(name, cp=opts.cp_size, recompute_layers=opts.recompute_layers)
    except SettingError as e:
        raise e.spelled(API) from None
    bound = objective.bind(tree) if objective is not None else None
    store = Store(tree, opts)
    for group in groups:
        with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
            loss = _forward(model, tree, group, bound, opts, store)
        if not forward_only:
            backward(model, [loss])  # plain autograd; paired across replicas under EP (parallel/lockstep.py)
    return store.result(
        name, tree, bound, opts, positions_computed=tree.positions_logical, forwards=len(groups)
    )


def run_naive_fused(
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    *,
    forward_only: bool = False,
) -> StepResult:
    """Every rollout in its own forward/backward (the fair baseline)."""
    groups = [[i] for i in range(len(tree.rollouts))]
    return _run("naive-fused", groups, model, tree, objective, opts, forward_only)


def run_packed_nosharing(
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    *,
    forward_only: bool = False,
) -> StepResult:
    """All rollouts in one block-diagonal forward/backward, nothing shared."""
    groups = [list(range(len(tree.rollouts)))]
    return _run("packed-nosharing", groups, model, tree, objective, opts, forward_only)
