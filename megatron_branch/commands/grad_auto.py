"""`grad --schedule auto`: packed when its planned activation peak fits the budget and the tree is at most one of
replay's chunks (`--chunk-tokens`), replay otherwise (the rule is plan/auto.py's, the same `plan --schedule auto`
uses); this module only finds the budget, what packed refuses and the run's chunk budget."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import torch

from megatron_branch import rules
from megatron_branch.commands.grad_flags import SPELLING
from megatron_branch.errors import SettingError

__all__ = ["auto_choice"]


def auto_choice(args: argparse.Namespace, spec: Any, rollouts: list[Any], world: int) -> Any:
    """--schedule auto (plan/auto.py): the budget is --memory-budget, or the free device memory now (after the model
    is loaded), the smallest over the ranks, so every rank picks the same."""
    import torch.distributed as dist

    from megatron_branch.plan import Layout
    from megatron_branch.plan.auto import grad_choice
    from megatron_branch.precision import torch_dtype

    if args.memory_budget is not None:
        budget = int(args.memory_budget * 1e9)
    else:
        free = torch.tensor([torch.cuda.mem_get_info()[0]], dtype=torch.long, device="cuda")
        if dist.is_initialized():
            dist.all_reduce(free, op=dist.ReduceOp.MIN)
        budget = int(free.item())
    problem = None
    try:  # what packed refuses (segment recompute is replay's)
        rules.check(dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, name="packed")))
    except SettingError as e:
        problem = str(e.spelled(SPELLING))
    lay = spec.layout
    layout = Layout(tp=lay.tp, cp=lay.cp, pp=lay.pp, dp=lay.data_parallel_size(world),
                    sequence_parallel=lay.sequence_parallel)  # fmt: skip
    # --chunk-tokens: auto's replay runs with it, and a tree over one chunk picks replay (plan/auto.py)
    return grad_choice(spec.arch, [rollouts], layout, act_bytes=torch_dtype(spec.dtype).itemsize,
                       layer_recompute=spec.schedule.enable_gradient_checkpointing, budget_bytes=budget,
                       chunk_tokens=spec.schedule.chunk_tokens, packed_problem=problem)  # fmt: skip
