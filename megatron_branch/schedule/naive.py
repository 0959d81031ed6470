"""The naive schedule: every rollout run separately through megatron's own attention (the baseline).

Nothing here uses the prefix tree's sharing or our attention backends: each rollout is a plain causal sequence
through megatron-core's DotProductAttention, which is what the exactness tests compare everything else against.
The tree is used only to read per-rollout data (tokens, loss weights) and to index results.
"""

from __future__ import annotations

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.losses.logprobs import vocab_parallel_logprobs
from megatron_branch.losses.objective import Objective
from megatron_branch.schedule.common import ScheduleOptions, StepResult, model_device


def run_naive(
    model: torch.nn.Module, tree: PrefixTree, objective: Objective, opts: ScheduleOptions
) -> StepResult:
    # Under CP every CP rank would run every rollout whole, and the CP grad sum would count it cp times.
    if opts.cp_size > 1:
        raise ValueError(
            "the naive schedule has no context parallelism (cp_size must be 1); use packed or replay"
        )
    bound = objective.bind(tree)
    total = 0.0
    store = torch.full((tree.num_tokens,), float("nan"), dtype=torch.float64) if opts.keep_logprobs else None
    dev = model_device(model)
    for i, r in enumerate(tree.rollouts):
        seq = torch.tensor(r.prompt + r.response, dtype=torch.long, device=dev)  # [L]
        L = seq.numel()
        s = -(-L // opts.pad_to) * opts.pad_to  # sequence parallel needs s % tp == 0; pad at the end
        ids = torch.cat([seq, torch.zeros(s - L, dtype=torch.long, device=dev)])
        pos = torch.arange(s, device=dev)
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=dev), diagonal=1)[
            None, None
        ]  # True = masked
        logits = model(ids[None], pos[None], mask)  # [1, s, v]
        logp = vocab_parallel_logprobs(
            logits[0, : L - 1], seq[1:], vocab_size=opts.vocab_size, tp_group=opts.tp_group
        )  # [L-1]: row j predicts token j+1
        loss = bound.rollout_loss(i, logp)
        loss.backward()
        total += float(loss.detach())
        if (
            store is not None
        ):  # like the tree schedules, keep the logprobs of response tokens (the ones a loss uses)
            first = max(len(r.prompt) - 1, 0)
            idx = tree.rollout_indices(i)[1 + first :]
            store[idx] = logp[first:].detach().to(device=store.device, dtype=torch.float64)
    return StepResult(
        schedule="naive",
        loss=total,
        positions_logical=tree.positions_logical,
        positions_computed=tree.positions_logical,
        forwards=len(tree.rollouts),
        target_logprobs=store,
    )
