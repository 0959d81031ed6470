"""A schedule call on a mixture-of-experts policy: bind the router work to the tree, count, train, check.

    plan = bind_router_plan(name, model, tree, opts)   # groups, membership, forced routes (losses/router.py)
    counting pass (load-balancing losses on): the same schedule forward-only, every router counting its top-k
    maps per group; then the training call with every loss weighted by multiplicity; then `plan.finish()` checks
    that the training forward routed as the counting pass did and returns the routing metrics.

The schedules attach `router_context(opts, ...)` to their forwards (forward_chunk for packed and replay, one per
rollout for naive, one per packed group for the unshared baselines); for a dense model, or without MoE options,
it is None and nothing changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.losses.router import MoEOptions, check_dropless, pinned_aux_scale
from megatron_branch.losses.router_plan import RouterPlan
from megatron_branch.losses.routing import RowContext
from megatron_branch.models.moe import release_dispatcher_state

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
    )


def run_with_router(
    fn: Callable[..., Any],
    name: str,
    model: torch.nn.Module,
    tree: PrefixTree,
    objective: Any,
    opts: Any,
    *,
    forward_only: bool,
) -> Any:
    """`fn` (a schedule) on a MoE model: counting pass when a balancing loss is on, then the call; the routing
    metrics are added to the result's stats (summed over TP x CP: they add over micro-batches and DP ranks)."""
    plan = bind_router_plan(name, model, tree, opts)
    bound = dataclasses.replace(opts, router_plan=plan)
    try:
        with pinned_aux_scale():
            if plan.needs_counts and not forward_only:
                counting = dataclasses.replace(
                    bound, keep_logprobs=False, keep_entropy=False, ring_stats=None
                )
                with plan.counting_pass(), torch.no_grad():
                    fn(model, tree, None, counting, forward_only=True)
            result = fn(model, tree, objective, bound, forward_only=forward_only)
    finally:
        release_dispatcher_state(model)
    metrics = plan.finish()
    if not forward_only:
        result.stats.update(metrics)
    return result


def router_context(opts: Any, *, token_index: torch.Tensor | None = None, rollouts: Sequence[int] = (), rows: int = 0
                   ) -> RowContext | None:  # fmt: skip
    """The router context of one forward: a tree chunk's rows (`token_index`, -1 = padding) or rollouts laid end
    to end (`rollouts`, padded to `rows`). None without a bound plan (a dense model)."""
    plan = getattr(opts, "router_plan", None)
    if plan is None:
        return None
    if token_index is not None:
        return plan.chunk_context(token_index)
    return plan.rollouts_context(rollouts, rows)
