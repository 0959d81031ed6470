"""The packed schedule: the whole prefix tree in ONE forward/backward with the tree attention layout.

Every shared position is computed once; autograd sums the gradients that all branches send into a shared prefix
(the packed tree-mask identity, docs/design.md). Memory grows with the whole tree; `replay` is
the memory-bounded schedule.
"""

from __future__ import annotations

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.losses.objective import Objective
from megatron_branch.parallel.lockstep import backward
from megatron_branch.schedule.common import ScheduleOptions, StepResult, Store, forward_chunk, prepare_chunk


def run_packed(
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    *,
    forward_only: bool = False,
) -> StepResult:
    bound = objective.bind(tree) if objective is not None else None
    store = Store(tree, opts)
    chunk = prepare_chunk(tree, range(len(tree.segments)), opts)  # under CP: this rank's zigzag share
    with torch.set_grad_enabled(not forward_only and torch.is_grad_enabled()):
        out = forward_chunk(model, tree, chunk, bound, opts)
    if not forward_only:
        backward(model, [out.loss])  # plain autograd; paired across replicas under EP (parallel/lockstep.py)
    store.add(chunk.targets, out)
    return store.result("packed", tree, bound, opts, positions_computed=tree.positions_computed, forwards=1)
