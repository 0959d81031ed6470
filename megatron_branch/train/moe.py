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
would (losses/router_plan.py); parallel.ep splits the experts (inside dp x cp, as megatron lays it out). The section
is the run assembly's MoEConfig (assembly/spec.py), which grad's --moe-* flags are generated from too.
"""

from __future__ import annotations

from typing import Any

from megatron_branch.assembly.spec import MoEConfig

__all__ = ["MoEConfig", "options"]


def options(cfg: Any) -> Any:
    """The schedules' MoEOptions of the config (losses/router.py)."""
    return cfg.moe.options()
