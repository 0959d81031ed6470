"""`schedule.name: auto` in a training run (issue 33 item 2): before each update of a step (and the warm-up), packed
when its planned activation peak on the largest chunk fits the budget and that chunk's tree is at most one of replay's
chunks (`schedule.chunk_tokens`), replay otherwise: the rule is plan/auto.py's (`grad --schedule auto` and `plan
--schedule auto` use it too). Both schedules give the same gradient; the pick only
trades memory for speed, so it may change from step to step with the sampled trees.

The budget: `schedule.memory_budget_gb`, else the device's free memory (a GPU: torch's mem_get_info; a CPU: the host's
available memory shared by the node's ranks), the smallest over the ranks so that every rank picks the same. The
config is checked as replay (what auto falls back to); what the rules refuse to packed for this run (segment
recompute, ...) makes every pick replay, with that line as the reason. `schedule.chunk_tokens` (on by default):
auto's replay runs with it, and a tree over one chunk picks replay (as fast as packed there and bounded in memory,
docs/performance.md); off, the pick is packed's memory alone. Reported: metrics
`schedule/auto_packed` (1 = packed), `schedule/auto_packed_gb`, `schedule/auto_budget_gb`, `schedule/auto_tokens`
(the largest chunk's tree) each step, a printed line whenever the pick changes, and the last pick with its reason
in the run's final JSON (`schedule_auto`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_branch import rules
from megatron_branch.errors import SettingError
from megatron_branch.plan.auto import AutoChoice, free_device_bytes, grad_choice
from megatron_branch.plan.model import Layout


def packed_problem(spec: Any, spelling: Any) -> str | None:
    """What the rules refuse to packed in this run (the one line, in the config's words), or None."""
    try:
        rules.check(dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, name="packed")))
    except SettingError as e:
        return str(e.spelled(spelling))
    return None


def free_bytes(groups: Any) -> int:
    """The device's free memory for one rank, the smallest over the world (a collective)."""
    import torch
    import torch.distributed as dist

    free = free_device_bytes()
    if not dist.is_initialized():
        return int(free)
    t = torch.tensor([free], dtype=torch.long, device="cuda" if torch.cuda.is_available() else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


@dataclass(kw_only=True)
class AutoSchedule:
    """The per-update pick of `schedule.name: auto` for one run (train/policy.py asks it before each update)."""

    arch: Any
    """The policy's ModelArch."""
    layout: Layout
    """The run's layout (tp, cp, pp, dp, sequence parallel)."""
    act_bytes: int
    """Bytes per activation element (the run's dtype)."""
    layer_recompute: bool
    """schedule.enable_gradient_checkpointing (the planner's recompute full when set)."""
    micro_batches: int
    """Micro-batches per rank of one update."""
    budget_gb: float | None
    """schedule.memory_budget_gb; None: the device's free memory at each pick."""
    problem: str | None
    """What the rules refuse to packed in this run (every pick replay), or None."""
    chunk_tokens: int | None
    """schedule.chunk_tokens: replay's token budget per chunk (a larger tree picks replay); None: off."""
    is_main: bool = True
    """Rank 0 prints the line when the pick changes."""
    last: AutoChoice | None = field(default=None, init=False)
    """The latest pick (the run's JSON reports it)."""

    def pick(self, batches: list[list[Any]], groups: Any) -> AutoChoice:
        """One schedule for every update of `batches` (each one update's rollouts): THE rule on the largest of
        their chunks' planned peaks and tokens."""
        budget = int(self.budget_gb * 1e9) if self.budget_gb is not None else free_bytes(groups)
        choice = grad_choice(self.arch, batches, self.layout, act_bytes=self.act_bytes,
                             layer_recompute=self.layer_recompute, budget_bytes=budget,
                             chunk_tokens=self.chunk_tokens, packed_problem=self.problem,
                             micro_batches=self.micro_batches)  # fmt: skip
        if self.is_main and (self.last is None or self.last.schedule != choice.schedule):
            print(f"schedule auto: {choice.schedule} ({choice.reason})", flush=True)
        self.last = choice
        return choice

    def metrics(self) -> dict[str, float]:
        """The latest pick as numbers (metrics.jsonl, TensorBoard)."""
        assert self.last is not None
        return {
            "schedule/auto_packed": float(self.last.schedule == "packed"),
            "schedule/auto_packed_gb": self.last.packed_bytes / 1e9,
            "schedule/auto_budget_gb": self.last.budget_bytes / 1e9,
            "schedule/auto_tokens": float(self.last.tokens),
        }


def run_summary(auto: AutoSchedule | None, schedule: Any) -> dict[str, Any]:
    """The run's final JSON about its schedule: auto's last pick and why, and the budget replay's chunks ran with
    (or why none: schedule/options.py chunks_ran) under the schedule that ran last."""
    from megatron_branch.schedule.options import chunks_ran

    if auto is None or auto.last is None:
        return chunks_ran(schedule.name, schedule.chunk_tokens)
    return {"schedule_auto": auto.last.to_json(), **chunks_ran(auto.last.schedule, schedule.chunk_tokens)}


def auto_schedule(
    cfg: Any, arch: Any, groups: Any, *, micro_batches: int, act_bytes: int
) -> AutoSchedule | None:
    """The run's AutoSchedule when `schedule.name` is auto, else None."""
    import torch.distributed as dist

    from megatron_branch.train.validate import SPELLING, run_spec

    s = cfg.schedule
    if s.name != rules.AUTO_SCHEDULE:
        return None
    layout = Layout(tp=groups.tp_size, cp=groups.cp_size, pp=groups.pp_size, dp=groups.dp_size,
                    sequence_parallel=groups.sequence_parallel)  # fmt: skip
    return AutoSchedule(
        arch=arch, layout=layout, act_bytes=act_bytes, layer_recompute=s.enable_gradient_checkpointing,
        micro_batches=micro_batches, budget_gb=s.memory_budget_gb,
        problem=packed_problem(run_spec(cfg, arch), SPELLING), chunk_tokens=s.chunk_tokens,
        is_main=not dist.is_initialized() or dist.get_rank() == 0,
    )  # fmt: skip
