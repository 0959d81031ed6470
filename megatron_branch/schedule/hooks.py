"""Per-step features of a schedule call: the `ScheduleHook` seam (as `StateKind`, attention/prefix_state.py, is the
seam of what a layer hands down). A feature that must see every step and every forward of it -- MoE's router plan
(schedule/moe.py) is the first -- enters here, and no schedule names it:

    begin of step   ScheduleHook.bind(name, model, tree, opts) -> a StepHook bound to this step, or None when the
                    feature has nothing to do (a dense model for the router plan)
    around the step StepHook.run(step, opts, forward_only): calls step(opts) once (or more: the router plan runs a
                    counting pass first with step(opts, score_only=True))
    each forward    StepHook.forward(model, where): a context around ONE model forward of the step, told which rows
                    it runs (`Rows`: a tree chunk's packed token indices, or whole rollouts laid end to end);
                    every bound hook sees every forward, another hook's extra pass included
    end of step     StepHook.finish(result, forward_only): check, add metrics to result.stats

run_schedule binds the registered hooks (schedule/__init__.py `HOOKS`) and the caller's (`ScheduleOptions.hooks`)
and hands the bound ones to the schedule in `ScheduleOptions.step_hooks`; every forward of every schedule -- one
rank or any pipeline stage -- enters `hook_forwards(model, opts, where)`. A hook never changes the math by
itself: what it attaches (a router context) is what the model reads.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from megatron_branch.data import PrefixTree

# this file sits below options.py (which holds the hooks) and common.py: the options and the step's result are
# named here, not imported (one direction)
ScheduleOptions = Any  # schedule/options.py ScheduleOptions
StepResult = Any  # schedule/common.py StepResult


@dataclass(frozen=True, kw_only=True)
class Rows:
    """Which rows one forward runs: a tree chunk's packed token index per row (`token_index` [s], -1 = padding),
    or whole rollouts laid end to end (`rollouts`, padded to `rows`)."""

    token_index: torch.Tensor | None = None
    rollouts: Sequence[int] = ()
    rows: int = 0


Step = Callable[..., StepResult]
"""step(opts, *, score_only=False): the schedule call (score_only: forward-only, no objective, no grad)."""


class StepHook(Protocol):
    """One feature bound to one step (see the module doc)."""

    def run(self, step: Step, opts: ScheduleOptions, *, forward_only: bool) -> StepResult:
        """Around the step: return step(opts) (after any extra passes of its own)."""
        ...

    def forward(self, model: torch.nn.Module, where: Rows) -> contextlib.AbstractContextManager[Any]:
        """A context around one forward of the step's model over the rows `where`."""
        ...

    def finish(self, result: StepResult, *, forward_only: bool) -> None:
        """After the step: checks, and metrics into result.stats."""
        ...


class ScheduleHook(Protocol):
    """A per-step feature: `bind` it to one step (None: nothing to do for this model or schedule)."""

    name: str

    def bind(
        self, schedule: str, model: torch.nn.Module, tree: PrefixTree, opts: ScheduleOptions
    ) -> StepHook | None: ...


def run_hooked(
    fn: Callable[..., StepResult],
    name: str,
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Any,
    opts: ScheduleOptions,
    hooks: Sequence[ScheduleHook],
    *,
    forward_only: bool,
) -> StepResult:
    """fn(model, tree, objective, opts, forward_only=...) with `hooks` bound to this step: each bound hook runs
    around the next (the first outermost), its forwards see every model forward, its finish runs last."""
    bound = tuple(b for b in (h.bind(name, model, tree, opts) for h in hooks) if b is not None)
    if not bound:
        return fn(model, tree, objective, opts, forward_only=forward_only)

    def call(o: ScheduleOptions, *, score_only: bool = False) -> StepResult:
        if score_only:
            with torch.no_grad():
                return fn(model, tree, None, o, forward_only=True)
        return fn(model, tree, objective, o, forward_only=forward_only)

    step: Step = call
    for hook in reversed(bound):
        step = _around(hook, step, forward_only)
    result = step(_with_bound(opts, bound))
    for hook in bound:
        hook.finish(result, forward_only=forward_only)
    return result


def _around(hook: StepHook, inner: Step, forward_only: bool) -> Step:
    def step(o: ScheduleOptions, *, score_only: bool = False) -> StepResult:
        if score_only:  # an outer hook's extra pass goes straight through
            return inner(o, score_only=True)
        return hook.run(inner, o, forward_only=forward_only)

    return step


def _with_bound(opts: ScheduleOptions, bound: tuple[StepHook, ...]) -> ScheduleOptions:
    return dataclasses.replace(opts, step_hooks=bound)


@contextlib.contextmanager
def hook_forwards(model: torch.nn.Module, opts: ScheduleOptions, where: Rows) -> Iterator[None]:
    """Every bound hook's context around one forward (nothing without bound hooks)."""
    with contextlib.ExitStack() as stack:
        for hook in opts.step_hooks:
            stack.enter_context(hook.forward(model, where))
        yield
