"""A schedule call on a mixture-of-experts policy: bind the router work to the tree, count, train, check.

    plan = bind_router_plan(name, model, tree, opts)   # at the hook's bind: groups, membership, forced routes
    counting pass (load-balancing losses on): the same schedule forward-only, every router counting its top-k
    maps per group; then the training call with every loss weighted by multiplicity; then `plan.finish()` checks
    that the training forward routed as the counting pass did and returns the routing metrics.

The plan enters the schedules as a schedule hook (schedule/hooks.py; `ROUTER_PLAN`, registered in
schedule/__init__.py HOOKS): every schedule's forwards enter `hook_forwards` (forward_chunk for packed and replay,
one per rollout for naive, one per packed group for the unshared baselines, every pipeline stage's forward), and
the bound plan attaches its router context there; for a dense model it is not bound and nothing changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.losses.router import MoEOptions, check_dropless, pinned_aux_scale
from megatron_branch.losses.router_plan import RouterPlan
from megatron_branch.models.moe import attach_router_context, release_dispatcher_state
from megatron_branch.schedule.hooks import Rows

ROLLOUT_SCHEDULES = ("naive", "naive-fused", "packed-nosharing")
"""Schedules whose rows are whole rollouts (a rollout's tokens are its own group)."""


def moe_arch(model: torch.nn.Module) -> Any:
    """The model's ModelArch when it is a mixture of experts (None otherwise)."""
    arch = getattr(getattr(model, "module", model), "arch", None)
    return arch if arch is not None and getattr(arch, "is_moe", False) else None


def bind_router_plan(name: str, model: torch.nn.Module, tree: PrefixTree, opts: Any) -> RouterPlan:
    arch = moe_arch(model)
    assert arch is not None
    check_dropless(getattr(model, "module", model).config, name)
    return RouterPlan(
        tree,
        opts.moe if opts.moe is not None else MoEOptions(),
        by_rollout=name in ROLLOUT_SCHEDULES,
        moe_layers=arch.moe_layers,
        top_k=arch.moe_top_k,
        num_experts=arch.num_experts,
        pp_group=opts.groups.pp if opts.groups.pp_size > 1 else None,  # each stage its own MoE layers
    )


@dataclass(frozen=True)
class RouterPlanHook:
    """The router plan as a schedule hook (schedule/hooks.py): bound for a MoE policy, nothing for a dense one."""

    name: str = "moe-router-plan"

    def bind(
        self, schedule: str, model: torch.nn.Module, tree: PrefixTree, opts: Any
    ) -> BoundRouterPlan | None:
        if moe_arch(model) is None:
            return None
        return BoundRouterPlan(bind_router_plan(schedule, model, tree, opts), model)


@dataclass
class BoundRouterPlan:
    """One step's router plan: a counting pass when a balancing loss is on, then the call; every forward routes
    its rows under the plan; at the end the routing metrics are added to the result's stats (summed over TP x CP:
    they add over micro-batches and DP ranks)."""

    plan: RouterPlan
    model: torch.nn.Module

    def run(self, step: Callable[..., Any], opts: Any, *, forward_only: bool) -> Any:
        try:
            with pinned_aux_scale():
                if self.plan.needs_counts and not forward_only:
                    counting = dataclasses.replace(
                        opts, keep_logprobs=False, keep_entropy=False, ring_stats=None
                    )
                    with self.plan.counting_pass():
                        step(counting, score_only=True)
                return step(opts)
        finally:
            release_dispatcher_state(self.model)

    def forward(self, model: torch.nn.Module, where: Rows) -> contextlib.AbstractContextManager[Any]:
        """The router context of one forward: a tree chunk's rows or rollouts laid end to end."""
        if where.token_index is not None:
            ctx = self.plan.chunk_context(where.token_index)
        else:
            ctx = self.plan.rollouts_context(where.rollouts, where.rows)
        return attach_router_context(model, ctx)

    def finish(self, result: Any, *, forward_only: bool) -> None:
        metrics = self.plan.finish()
        if not forward_only:
            result.stats.update(metrics)


ROUTER_PLAN = RouterPlanHook()
"""The registered hook (schedule/__init__.py HOOKS)."""
