"""`BranchOptions(schedule="auto")`, the verl integration's default (issue 33 item 2): each `forward_backward_batch`
call (the update's and `compute_log_prob`'s) runs `packed` when its planned activation peak over this call's tree
fits the budget and the tree is at most one of replay's chunks (`chunk_tokens`), `replay` otherwise. The rule is
plan/auto.py's (`decide`), the same `grad --schedule auto`, `train`'s `schedule.name: auto` and `plan --schedule
auto` use; both schedules give the same gradient (each is exact), the pick trades memory for speed only.

What is compared: packed's planned activation peak of this rank's tree in one chunk (plan/auto.py
`packed_peak_bytes`: the saved tensors, the ring, logits and dispatcher buffers; not weights, gradients or optimizer
state, which are the same for both schedules) against `BranchOptions.memory_budget_gb`, else the device's free
memory at the call; the tree's tokens (its computed positions) against `chunk_tokens`. Every rank picks the same:
the largest packed peak and tree and the smallest budget over the world (one all-reduce; verl's workers call the step in lockstep, and TP/CP/EP ranks must run the same schedule). What the
rules refuse to packed under these options (segment `recompute`, `root_pieces`: replay's) makes the pick replay.
`chunk_tokens` (on by default) is how auto's replay runs, and a tree over one chunk picks replay (as fast as packed
there and bounded in memory, docs/performance.md); off (None), the pick is packed's memory alone.

Reported: verl's metrics `tree/auto_packed` (1 = packed), `tree/auto_packed_gb`, `tree/auto_budget_gb`,
`tree/auto_tokens` (the reason in numbers; `actor/tree/...` in verl's trainer), and one log line per engine whenever the pick changes, with
the reason in words.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.plan.auto import AutoChoice, decide, free_device_bytes, packed_peak_bytes
from megatron_branch.plan.model import Layout

logger = logging.getLogger(__name__)

AUTO = "auto"
"""The schedule name that asks for the pick (rules.AUTO_SCHEDULE's spelling in verl's options)."""

AUTO_METRICS = ("tree/auto_packed", "tree/auto_packed_gb", "tree/auto_budget_gb", "tree/auto_tokens")
"""The pick's metrics, added to verl's beside tree/positions_*."""


def packed_problem(opts: Any) -> str | None:
    """What the rules refuse to packed under these ScheduleOptions (one line, in the library's names), or None."""
    from megatron_branch.errors import SettingError
    from megatron_branch.rules import API, check_run

    if opts.root_pieces > 1:
        return "root_pieces is replay's"
    try:
        check_run("packed", cp=opts.cp_size, recompute=opts.recompute, recompute_layers=opts.recompute_layers,
                  backend=opts.backend)  # fmt: skip
    except SettingError as e:
        return str(e.spelled(API))
    return None


def model_arch(engine: Any) -> Any:
    """The policy's ModelArch from verl's HF config (kept on the engine: read once)."""
    from megatron_branch.models.arch import ModelArch

    arch = getattr(engine, "_branch_arch", None)
    if arch is None:
        arch = ModelArch.from_hf_config(engine.model_config.hf_config, where="verl's model config")
        engine._branch_arch = arch
    return arch


def _agree(packed: int, budget: int, tokens: int) -> tuple[int, int, int]:
    """The largest packed peak, the smallest budget and the largest tree over the world (every rank picks
    alike)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return packed, budget, tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"
    t = torch.tensor([packed, -budget, tokens], dtype=torch.long, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t[0].item()), -int(t[1].item()), int(t[2].item())


def pick(engine: Any, model: torch.nn.Module, tree: Any, opts: Any, options: Any) -> AutoChoice | None:
    """packed or replay for this call's `tree` (module doc) when `options` (BranchOptions) ask for auto, else None;
    logs the pick, with its reason, when it changes."""
    if options.schedule != AUTO:
        return None
    budget_gb, groups = options.memory_budget_gb, opts.groups
    layout = Layout(tp=groups.tp_size, cp=groups.cp_size, sequence_parallel=groups.sequence_parallel)
    # dp 1: each DP rank holds its own rollouts (verl dispatched them); its tree is its share
    act_bytes = model.config.params_dtype.itemsize
    peak = packed_peak_bytes(model_arch(engine), tree, layout, act_bytes=act_bytes,
                             layer_recompute=opts.recompute_layers)  # fmt: skip
    budget = int(budget_gb * 1e9) if budget_gb is not None else free_device_bytes()
    peak, budget, tokens = _agree(peak, budget, tree.num_tokens)  # tokens: as schedule/walk.py packed_groups
    choice = decide(peak, budget, packed_problem(opts), tokens=tokens, chunk_tokens=opts.chunk_tokens)
    if getattr(engine, "_branch_auto_last", None) != choice.schedule:
        engine._branch_auto_last = choice.schedule  # once per engine and change
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("megatron-branch: schedule auto picks %s (%s)", choice.schedule, choice.reason)
    return choice


def metrics(choice: AutoChoice | None) -> dict[str, float]:
    """The pick as numbers for verl's metrics (AUTO_METRICS); none without a pick."""
    if choice is None:
        return {}
    return dict(
        zip(
            AUTO_METRICS,
            (
                float(choice.schedule == "packed"),
                choice.packed_bytes / 1e9,
                choice.budget_bytes / 1e9,
                float(choice.tokens),
            ),
            strict=True,
        )
    )
