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

from megatron_branch.attention.core_attention import BranchContext, attach_context
from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.data import PrefixTree
from megatron_branch.losses.fused_logprobs import fused_linear_logprobs
from megatron_branch.losses.logprobs import vocab_parallel_logprobs
from megatron_branch.losses.objective import BoundObjective, Objective
from megatron_branch.models.gpt import BranchGPTModel
from megatron_branch.schedule.common import (
    ScheduleOptions,
    StepResult,
    _output_weight,
    _to_output_region,
    model_device,
)


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
    return torch.cat(ids), torch.cat(pos), torch.cat(rows), torch.cat(tgt), layout


def _forward(
    model: torch.nn.Module,
    tree: PrefixTree,
    rollouts: Sequence[int],
    bound: BoundObjective,
    opts: ScheduleOptions,
    store: torch.Tensor | None,
) -> torch.Tensor:
    """One forward of `rollouts` packed without sharing; returns the sum of their losses."""
    ids, pos, rows, tgt, layout = _pack(tree, rollouts, opts.pad_to)
    dev = model_device(model)
    ids, pos, rows, tgt = ids.to(dev)[None], pos.to(dev)[None], rows.to(dev), tgt.to(dev)
    ctx = BranchContext(layout=layout, backend=opts.backend)
    base = getattr(model, "module", model)
    if opts.fused_logprobs and isinstance(base, BranchGPTModel):
        with attach_context(model, ctx), base.hidden_states_only():
            hidden = model(ids, pos, None)  # [s (/tp under SP), 1, h]
        hidden = _to_output_region(hidden, opts)[:, 0]  # [s, h]
        logp = fused_linear_logprobs(
            hidden.index_select(0, rows),
            _output_weight(base),
            tgt,
            vocab_size=opts.vocab_size,
            tp_group=opts.tp_group,
            chunk_rows=opts.logprob_chunk_rows,
        )  # [m]
    else:
        with attach_context(model, ctx):
            logits = model(ids, pos, None)  # [1, s, v]
        logp = vocab_parallel_logprobs(
            logits[0].index_select(0, rows), tgt, vocab_size=opts.vocab_size, tp_group=opts.tp_group
        )
    total, offset = None, 0
    for i in rollouts:
        r = tree.rollouts[i]
        L = len(r.prompt) + len(r.response)
        first = max(len(r.prompt) - 1, 0)
        mine = logp[offset : offset + L - 1 - first]
        offset += L - 1 - first
        # rollout_loss takes logprobs of tokens 1..L-1; prompt tokens carry weight 0, so zeros stand in for them
        full = torch.cat([torch.zeros(first, dtype=mine.dtype, device=mine.device), mine])
        loss = bound.rollout_loss(i, full)
        total = loss if total is None else total + loss
        if store is not None:
            idx = tree.response_indices(i) if r.prompt else tree.response_indices(i)[1:]
            store[idx] = mine.detach().to(device=store.device, dtype=store.dtype)
    assert total is not None
    return total


def _run(
    name: str,
    groups: list[list[int]],
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective,
    opts: ScheduleOptions,
) -> StepResult:
    if opts.cp_size > 1:
        raise ValueError(f"the {name} schedule has no context parallelism (cp_size must be 1)")
    bound = objective.bind(tree)
    store = torch.full((tree.num_tokens,), float("nan"), dtype=torch.float64) if opts.keep_logprobs else None
    total = 0.0
    for group in groups:
        loss = _forward(model, tree, group, bound, opts, store)
        loss.backward()
        total += float(loss.detach())
    return StepResult(
        schedule=name,
        loss=total,
        positions_logical=tree.positions_logical,
        positions_computed=tree.positions_logical,
        forwards=len(groups),
        target_logprobs=store,
    )


def run_naive_fused(
    model: torch.nn.Module, tree: PrefixTree, objective: Objective, opts: ScheduleOptions
) -> StepResult:
    """Every rollout in its own forward/backward (the fair baseline)."""
    return _run("naive-fused", [[i] for i in range(len(tree.rollouts))], model, tree, objective, opts)


def run_packed_nosharing(
    model: torch.nn.Module, tree: PrefixTree, objective: Objective, opts: ScheduleOptions
) -> StepResult:
    """All rollouts in one block-diagonal forward/backward, nothing shared."""
    return _run("packed-nosharing", [list(range(len(tree.rollouts)))], model, tree, objective, opts)
