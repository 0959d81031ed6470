"""What a MoE run asks of its routers: the router losses (`RouterLossConfig`), the schedule's MoE options, the
dropless rule, and the router metrics' folding (the losses and the routing under sharing: losses/router_plan.py
and losses/routing.py; docs/design.md "Mixture of experts: exact under sharing").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_branch.errors import SettingError

LOSS_NAMES = {
    "aux_loss": "load_balancing_loss",
    "seq_aux_loss": "seq_load_balancing_loss",
    "global_aux_loss": "global_load_balancing_loss",
    "z_loss": "z_loss",
}
"""Router loss -> megatron's tracker name (its metrics: the loss over its coefficient, mean over MoE layers)."""


@dataclass(kw_only=True)
class RouterLossConfig:
    """The router losses of a MoE policy (megatron's moe_router_load_balancing_type / moe_aux_loss_coeff /
    moe_z_loss_coeff), each weighted by token multiplicity under sharing. All 0 = none (megatron's default)."""

    aux_loss_coeff: float = 0.0
    """Load-balancing loss over each micro-batch (megatron's "aux_loss")."""
    seq_aux_loss_coeff: float = 0.0
    """Load-balancing loss per rollout's sequence, averaged over the micro-batch's rollouts ("seq_aux_loss")."""
    global_aux_loss_coeff: float = 0.0
    """Load-balancing loss with the counts averaged over the update's micro-batches and summed over DP
    ("global_aux_loss")."""
    z_loss_coeff: float = 0.0
    """Router z-loss: mean over tokens of logsumexp(logits)^2 (ST-MoE)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{f.name} must be a finite number >= 0, got {v!r}")

    @property
    def balancing(self) -> bool:
        """A load-balancing loss is on: the schedules count routes before training."""
        return self.aux_loss_coeff > 0 or self.seq_aux_loss_coeff > 0 or self.global_aux_loss_coeff > 0

    @property
    def enabled(self) -> bool:
        return self.balancing or self.z_loss_coeff > 0

    def coeffs(self) -> dict[str, float]:
        """Loss name -> coefficient, for the losses that are on."""
        all_ = {
            "aux_loss": self.aux_loss_coeff,
            "seq_aux_loss": self.seq_aux_loss_coeff,
            "global_aux_loss": self.global_aux_loss_coeff,
            "z_loss": self.z_loss_coeff,
        }
        return {k: v for k, v in all_.items() if v > 0}


@dataclass(kw_only=True)
class GlobalAuxState:
    """global_aux_loss's running sum of (DP-summed) counts over an update's micro-batches (megatron's
    `global_tokens_per_expert` / `ga_steps`, reset by finalize_model_grads each step: one state per update)."""

    sums: dict[int, torch.Tensor] = field(default_factory=dict)
    steps: int = 0


@dataclass(kw_only=True)
class RouteRecord:
    """Where a schedule call writes the experts each packed tree token is routed to (verl's router replay R2
    records them in compute_log_prob's forward): `table` [N, MoE layers, k] long, -1 until written; each row's
    experts ascending; under sequence parallel each TP rank writes its own rows (the caller combines them)."""

    table: torch.Tensor
    columns: tuple[int, ...] | None = None
    """The table's MoE-layer columns this pipeline stage routes (its own layers; verl records each stage's and
    joins them over the stages, router_replay_utils.pp_gather); None: every column (no pipeline)."""


@dataclass(kw_only=True)
class MoEOptions:
    """What a schedule does with a MoE policy's routers (ScheduleOptions.moe)."""

    losses: RouterLossConfig = field(default_factory=RouterLossConfig)
    """The router losses (multiplicity-weighted)."""
    routing_replay: bool = False
    """Route every token with a recorded choice (Rollout.routed_experts) to those experts."""
    loss_scale: float = 1.0
    """Multiplies every router loss: 1 / (micro-batches of the update over all DP ranks), set by the update."""
    global_state: GlobalAuxState | None = None
    """global_aux_loss only: the update's running counts (one per update; None = this call alone)."""
    dp_group: Any = None
    """global_aux_loss only: the group its counts are summed over (the data-parallel group)."""
    route_record: RouteRecord | None = None
    """Record every routed row's experts here (the forwards that are neither counting nor recomputing)."""
    micro_batches: tuple[tuple[int, ...], ...] | None = None
    """The tree's rollouts per megatron micro-batch when one tree holds several (verl's engine: every micro-batch
    of the step, each packed THD by verl, batch 1): aux_loss and z_loss are then each micro-batch's own (its T
    tokens), and seq_aux_loss takes a micro-batch as its one sequence (megatron's reshape at bsz 1); None = the
    tree is one micro-batch, each rollout a sequence. Each micro-batch's losses are times `loss_scale`."""

    def __post_init__(self) -> None:
        if not (self.loss_scale > 0 and math.isfinite(self.loss_scale)):
            raise ValueError(f"loss_scale must be a positive number, got {self.loss_scale}")
        if self.micro_batches is not None and self.losses.global_aux_loss_coeff:
            raise ValueError("global_aux_loss is not supported with micro_batches (verl's engine)")


def check_dropless(config: Any, schedule: str) -> None:
    """Refuse token dropping (a capacity factor) in a schedule that shares tokens (rules.check_moe_run)."""
    from megatron_branch.rules import API, check_moe_run

    try:
        check_moe_run(schedule, moe=True, capacity_factor=getattr(config, "moe_expert_capacity_factor", None))
    except SettingError as e:
        raise e.spelled(API) from None


def fold_expert_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """The `moe/tokens_per_expert/{kind}/layer_{i}/expert_{e}` floats (what adds over micro-batches and ranks)
    folded into one list per layer and kind, `moe/tokens_per_expert/{kind}/layer_{i}` (a metrics.jsonl line)."""
    out: dict[str, Any] = {}
    lists: dict[str, dict[int, float]] = {}
    for k, v in metrics.items():
        head, sep, tail = k.rpartition("/expert_")
        if sep and head.startswith("moe/tokens_per_expert/") and tail.isdigit():
            lists.setdefault(head, {})[int(tail)] = v
        else:
            out[k] = v
    for head, by_e in lists.items():
        out[head] = [by_e[e] for e in range(len(by_e))]
    return out


@contextmanager
def pinned_aux_scale() -> Iterator[None]:
    """megatron's MoEAuxLossAutoScaler multiplies every attached loss's gradient by a class-wide scale that its
    pipeline schedules set to loss_scale / num_microbatches; our losses carry their own scale (MoEOptions
    .loss_scale), so the scale is 1 while a schedule of ours runs, and restored after."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    held = MoEAuxLossAutoScaler.main_loss_backward_scale
    MoEAuxLossAutoScaler.main_loss_backward_scale = torch.ones(())
    try:
        yield
    finally:
        MoEAuxLossAutoScaler.main_loss_backward_scale = held
