"""The packed schedule: the whole prefix tree in ONE forward/backward with the tree attention layout.

Every shared position is computed once; autograd sums the gradients that all branches send into a shared prefix
(the packed tree-mask identity, docs/design.md). Memory grows with the whole tree; `replay` is
the memory-bounded schedule.
"""

from __future__ import annotations

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.losses.objective import Objective
from megatron_branch.schedule.common import (
    ScheduleOptions,
    StepResult,
    forward_chunk,
    prepare_chunk,
    record_logprobs,
    reduce_over_cp,
)


def run_packed(
    model: torch.nn.Module, tree: PrefixTree, objective: Objective, opts: ScheduleOptions
) -> StepResult:
    bound = objective.bind(tree)
    store = torch.full((tree.num_tokens,), float("nan"), dtype=torch.float64) if opts.keep_logprobs else None
    chunk = prepare_chunk(tree, range(len(tree.segments)), opts)  # under CP: this rank's zigzag share
    loss, logp, _ = forward_chunk(model, tree, chunk, bound, opts)
    loss.backward()
    record_logprobs(store, chunk, logp)
    total, store = reduce_over_cp(float(loss.detach()), store, opts)
    return StepResult(
        schedule="packed",
        loss=total,
        positions_logical=tree.positions_logical,
        positions_computed=tree.positions_computed,
        forwards=1,
        target_logprobs=store,
    )
