"""The `moe` section of the training config: a mixture-of-experts policy's router losses and routing replay.

    moe:
      aux_loss_coeff: 0.001         # megatron's aux_loss (moe_router_load_balancing_type / moe_aux_loss_coeff)
      seq_aux_loss_coeff: 0.0       # seq_aux_loss: per rollout's sequence
      global_aux_loss_coeff: 0.0    # global_aux_loss: counts over the update's micro-batches, summed over DP
      z_loss_coeff: 0.0             # moe_z_loss_coeff
      router_replay: R3             # verl's router_replay.mode: disabled | R3 (the sampler records, the update
                                    # routes recorded tokens to their experts)
      expert_capacity_factor: null  # token dropping: refused (the tree schedules are exact only dropless)

Every loss is weighted by token multiplicity, so a tree schedule trains exactly what naive per-rollout training
would (losses/router_plan.py); parallel.ep splits the experts (inside dp x cp, as megatron lays it out).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(kw_only=True)
class MoEConfig:
    """Router losses and routing replay of a mixture-of-experts policy (ignored keys of a dense one are refused)."""

    aux_loss_coeff: float = 0.0
    """Load-balancing loss over each micro-batch (megatron's aux_loss), weighted by multiplicity."""
    seq_aux_loss_coeff: float = 0.0
    """Load-balancing loss per rollout's sequence (megatron's seq_aux_loss)."""
    global_aux_loss_coeff: float = 0.0
    """Load-balancing loss on the update's running counts, summed over DP (megatron's global_aux_loss)."""
    z_loss_coeff: float = 0.0
    """Router z-loss (megatron's moe_z_loss_coeff)."""
    router_replay: Literal["disabled", "R3"] = "disabled"
    """verl's router_replay.mode. R3: the sampler records every fed token's experts (Rollout.routed_experts) and
    every training and scoring forward routes those tokens to them (probabilities from the current router)."""
    expert_capacity_factor: float | None = None
    """megatron's moe_expert_capacity_factor (token dropping). Refused: which tokens an expert drops depends on
    which tokens share its batch, so no schedule that shares a prefix is exact with it."""

    @property
    def active(self) -> bool:
        return (
            any(
                v > 0
                for v in (
                    self.aux_loss_coeff,
                    self.seq_aux_loss_coeff,
                    self.global_aux_loss_coeff,
                    self.z_loss_coeff,
                )
            )
            or self.router_replay != "disabled"
            or self.expert_capacity_factor is not None
        )


def options(cfg: Any) -> Any:
    """The schedules' MoEOptions of the config (losses/router.py)."""
    from megatron_branch.losses.router import MoEOptions, RouterLossConfig

    m = cfg.moe
    return MoEOptions(
        losses=RouterLossConfig(
            aux_loss_coeff=m.aux_loss_coeff,
            seq_aux_loss_coeff=m.seq_aux_loss_coeff,
            global_aux_loss_coeff=m.global_aux_loss_coeff,
            z_loss_coeff=m.z_loss_coeff,
        ),
        routing_replay=m.router_replay == "R3",
    )
