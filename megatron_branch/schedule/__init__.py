"""Training schedules over a prefix tree: `naive` (baseline), `packed` (one pass), `replay` (DFS, bounded memory);
`naive-fused` and `packed-nosharing` are the unshared baselines on the same kernels (schedule/unshared.py).

All three accumulate the SAME parameter gradients (into `param.grad`, or megatron DDP's `main_grad`) for the same
logical-batch loss; they differ only in what is computed once and what is kept alive.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.losses.objective import Objective
from megatron_branch.schedule.common import ScheduleOptions, StepResult
from megatron_branch.schedule.naive import run_naive
from megatron_branch.schedule.packed import run_packed
from megatron_branch.schedule.replay import run_replay
from megatron_branch.schedule.unshared import run_naive_fused, run_packed_nosharing

SCHEDULES: dict[str, Callable[..., StepResult]] = {
    "naive": run_naive,
    "packed": run_packed,
    "replay": run_replay,
    # baselines without sharing on the same kernels (the benchmark's fair comparison)
    "naive-fused": run_naive_fused,
    "packed-nosharing": run_packed_nosharing,
}


def run_schedule(
    name: str,
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective,
    opts: ScheduleOptions,
) -> StepResult:
    """Forward and backward the logical batch `tree` with schedule `name`; gradients accumulate in the model."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    return SCHEDULES[name](model, tree, objective, opts)


__all__ = ["SCHEDULES", "ScheduleOptions", "StepResult", "run_schedule"]
