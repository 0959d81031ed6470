"""Training schedules over a prefix tree: `naive` (baseline), `packed` (one pass), `replay` (DFS, bounded memory);
`naive-fused` and `packed-nosharing` are the unshared baselines on the same kernels (schedule/unshared.py).
`replay-stopgrad` is the one INEXACT entry: a comparison baseline (prompt K/V as constants, schedule/replay.py).

The exact ones accumulate the SAME parameter gradients (into `param.grad`, or megatron DDP's `main_grad`) for the same
logical-batch loss; they differ only in what is computed once and what is kept alive. Each also runs forward-only
(`score_rollouts`): no backward, no graph, the same numbers as its training forward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.errors import SettingError
from megatron_branch.losses.objective import Objective
from megatron_branch.rules import API, check_gdn_context_parallel, check_hybrid_schedule, check_pipeline
from megatron_branch.schedule.common import ScheduleOptions, StepResult
from megatron_branch.schedule.hooks import ScheduleHook, run_hooked
from megatron_branch.schedule.moe import ROUTER_PLAN
from megatron_branch.schedule.naive import run_naive
from megatron_branch.schedule.packed import run_packed
from megatron_branch.schedule.replay import run_replay, run_replay_stopgrad
from megatron_branch.schedule.score import Scores, score_rollouts
from megatron_branch.schedule.unshared import run_naive_fused, run_packed_nosharing

SCHEDULES: dict[str, Callable[..., StepResult]] = {
    "naive": run_naive,
    "packed": run_packed,
    "replay": run_replay,
    # baselines without sharing on the same kernels (the benchmark's fair comparison)
    "naive-fused": run_naive_fused,
    "packed-nosharing": run_packed_nosharing,
    # NOT exact, a comparison only: the prompt's K/V as constants (the announced stop-gradient system)
    "replay-stopgrad": run_replay_stopgrad,
}

HOOKS: tuple[ScheduleHook, ...] = (ROUTER_PLAN,)
"""The registered per-step features (schedule/hooks.py), bound to every step of every schedule, one rank or
pipelined; each binds to nothing where it does not apply (the router plan on a dense model)."""


def run_schedule(
    name: str,
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Objective | None,
    opts: ScheduleOptions,
    *,
    forward_only: bool = False,
) -> StepResult:
    """Forward and backward the logical batch `tree` with schedule `name`; gradients accumulate in the model.

    `forward_only`: no backward and no graph (`objective` may be None: logprobs/entropy only, see score_rollouts).
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    try:
        check_model_supports(model, name, cp=opts.cp_size, tp=opts.tp_size)
    except SettingError as e:
        raise e.spelled(API) from None
    if objective is None and not forward_only:
        raise ValueError("a training step needs an objective (objective=None only with forward_only=True)")
    if (
        opts.pp_size == 1
    ):  # root pieces fill pipeline stages: refused without them (the pipeline checks its own)
        try:
            check_pipeline(name, pp=1, root_pieces=opts.root_pieces)
        except SettingError as e:
            raise e.spelled(API) from None
    fn = SCHEDULES[name]
    if opts.pp_size > 1:  # this rank's pipeline stage runs its part of the walk (schedule/pipeline.py)
        from megatron_branch.schedule.pipeline import check_pipeline_step, run_pipeline

        check_pipeline_step(name, model, opts)  # before any hook binds: refusals first
        fn = functools.partial(run_pipeline, name)  # called as the one-rank schedules are
    hooks = (*HOOKS, *opts.hooks)  # per-step features (MoE's router plan): no schedule names them
    return run_hooked(fn, name, model, tree, objective, opts, hooks, forward_only=forward_only)


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model under every wrapper (megatron's DDP, Float16Module: each holds the next as `.module`)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def check_model_supports(model: torch.nn.Module, name: str, *, cp: int = 1, tp: int = 1) -> None:
    """Refuse a schedule or layout that cannot run a hybrid (gated delta net) model exactly (SettingErrors): read
    off the ModelArch `build_model` sets, else off megatron's TransformerConfig (a GPTModel built elsewhere, e.g.
    reached through the drop-in integration)."""
    base = unwrap_model(model)
    arch = getattr(base, "arch", None)
    if arch is not None:
        from megatron_branch.models.arch import check_schedule_supports

        check_schedule_supports(arch, name, cp=cp, tp=tp)
        return
    config = getattr(base, "config", None)
    if getattr(config, "experimental_attention_variant", None) != "gated_delta_net":
        return
    check_hybrid_schedule(name, model="experimental_attention_variant=gated_delta_net")
    check_gdn_context_parallel(
        key_heads=config.linear_num_key_heads, value_heads=config.linear_num_value_heads, tp=tp, cp=cp
    )


__all__ = [
    "HOOKS",
    "SCHEDULES",
    "ScheduleOptions",
    "Scores",
    "StepResult",
    "check_model_supports",
    "run_schedule",
    "score_rollouts",
    "unwrap_model",
]
