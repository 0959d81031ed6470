"""PPO's critic loss: the clipped value loss on per-token values, aggregated like the policy loss.

Per (rollout i, response token t), V the critic's value at the row that predicts token t (verl's alignment:
values[t] comes from the position before the token), V_old the value when the batch was sampled (`values`
field), R the return (`returns` field, e.g. from GAE, losses/advantages.py):

    vf = 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)        (c = clip; None: 0.5 (V - R)^2)

Under sharing, the value at a shared row is one number (one forward computes it once), while the return differs
per rollout: each rollout's term is evaluated separately on the same V (losses/pairs.py), so the gradient equals
per-rollout training exactly. Metrics: critic/vf_loss (aggregated), critic/vf_clipfrac (token mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.losses.token import TokenObjective


@dataclass(kw_only=True)
class ValueObjective(TokenObjective):
    """The critic's loss; bind it to a tree and run a schedule on a critic model (models/critic.py). Not a policy
    loss (verl keeps its value loss apart too): the loop builds it for the critic, with `critic.cliprange_value`."""

    role = "critic"
    clip: float | None = 0.5
    """Value clipping range around V_old (verl's cliprange_value); None = unclipped (needs no `values`)."""

    def __post_init__(self) -> None:
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"the value clip range must be positive, got {self.clip}")

    def stats(self) -> tuple[tuple[str, str], ...]:
        return (("critic/vf_loss", "agg"), ("critic/vf_clipfrac", "token"))

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        data = {"ret": pairs.field("returns")[0]}
        if self.clip is not None:
            data["old"] = pairs.field("values")[0]
        return data

    def terms(
        self, v: torch.Tensor, entropy: torch.Tensor | None, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        l1 = (v - d["ret"]).square()
        if self.clip is None:
            return 0.5 * l1, [0.5 * l1, torch.zeros_like(l1)]
        v_clip = torch.clamp(v, d["old"] - self.clip, d["old"] + self.clip)
        l2 = (v_clip - d["ret"]).square()
        vf = 0.5 * torch.maximum(l1, l2)
        return vf, [vf, (l2 > l1).to(v.dtype)]
