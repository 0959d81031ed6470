"""The naive schedule: every rollout run separately through megatron's own attention (the baseline).

Nothing here uses the prefix tree's sharing or our attention backends: each rollout is a plain causal sequence
through megatron-core's DotProductAttention and output layer, which is what the exactness tests compare everything
else against. The tree is used only to read per-rollout data (tokens, loss weights) and to index results.
"""

from __future__ import annotations

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.errors import SettingError
from megatron_branch.losses.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_branch.losses.objective import Objective
from megatron_branch.models.gpt import BranchGPTModel
from megatron_branch.parallel.lockstep import backward
from megatron_branch.rules import API, check_run
from megatron_branch.schedule.common import (
    ChunkOut,
    ScheduleOptions,
    StepResult,
    Store,
    _to_replicated_region,
    model_device,
)
from megatron_branch.schedule.hooks import Rows, hook_forwards


def run_naive(
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    *,
    forward_only: bool = False,
) -> StepResult:
    try:  # the same rules every entry point checks up front (rules/), for library callers
        check_run("naive", cp=opts.cp_size, recompute_layers=opts.recompute_layers)
    except SettingError as e:
        raise e.spelled(API) from None
    bound = objective.bind(tree) if objective is not None else None
    want_entropy = opts.keep_entropy or (bound is not None and bound.needs_entropy)
    store = Store(tree, opts)
    base = getattr(model, "module", model)
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
        ent = None
        hooks = hook_forwards(model, opts, Rows(rollouts=[i], rows=s))  # per-step features (MoE): its rows
        with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()), hooks:
            if isinstance(base, BranchGPTModel) and base.is_critic:
                with base.hidden_states_only():
                    hidden = model(ids[None], pos[None], mask)  # [s (/tp), 1, h]
                x = base.values(_to_replicated_region(hidden, opts)[: L - 1, 0])  # [L-1] value of row j
            else:
                logits = model(ids[None], pos[None], mask)  # [1, s, v]
                x = vocab_parallel_logprobs(
                    logits[0, : L - 1], seq[1:], vocab_size=opts.vocab_size, tp_group=opts.tp_group
                )  # [L-1]: row j predicts token j+1
                if want_entropy:
                    ent = vocab_parallel_entropy(
                        logits[0, : L - 1], vocab_size=opts.vocab_size, tp_group=opts.tp_group
                    )
            if bound is not None:
                loss, stats = bound.rollout_loss(i, x, ent)
            else:
                loss, stats = x.new_zeros(()), torch.zeros(0, dtype=torch.float64)
        if not forward_only:
            backward(model, [loss])  # plain autograd; paired across replicas under EP (parallel/lockstep.py)
        # keep the response tokens' results, as the tree schedules do (prompt rows carry no loss; the first
        # response token is predicted by the last prompt row)
        first = max(len(r.prompt) - 1, 0)
        ent = None if ent is None else ent[first:]
        out = ChunkOut(loss=loss, stats=stats, logp=x[first:], entropy=ent, captured={})
        store.add(tree.rollout_indices(i)[1 + first :], out)
    return store.result(
        "naive",
        tree,
        bound,
        opts,
        positions_computed=tree.positions_logical,
        forwards=len(tree.rollouts),
    )
