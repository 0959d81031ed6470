"""The clipped-surrogate policy loss of GRPO and PPO, with a KL penalty to a reference policy and an entropy bonus.

Per (rollout i, response token t), logp the current policy, old the sampling policy, ref the reference, A the
advantage (the rollout's scalar or its per-token value), r = exp(clamp(logp - old, -20, 20)) (verl's clamp):

    pg  = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
    pg  = min(pg, -A clip_c)                      for A < 0, only when clip_c is given (dual clip, c > 1)
    kl  = k(logp, ref):  k1 = logp - ref,  k2 = (logp - ref)^2 / 2,
                         k3 = clamp(e^x - x - 1, -10, 10), x = clamp(ref - logp, -20, 20)   (verl's low_var_kl)
    kl  = r k(logp, ref)                          with kl_bias_correction (TRL's use_bias_correction_kl)
    l   = pg + kl_coef kl - entropy_coef H        H = the policy's full-vocabulary entropy at that position

and with rollout_is the policy term pg is multiplied by the rollout-correction weight (losses/rollout_correction.py),
aggregated over the global batch (losses/aggregation.py); with entropy_token_mean the bonus alone is a token mean
over the global batch (TRL's), whatever the loss's aggregation. `old_logprobs` absent = on-policy: old = logp detached,
so r = 1 with the gradient of r (the plain policy gradient). Every term is a function of this pair's logp (and
entropy) and this pair's data, so under sharing each rollout's term at a shared token is evaluated separately
(losses/pairs.py) and the gradient equals per-rollout training exactly.

Metrics (verl's names): actor/pg_loss, actor/kl_loss (before the coefficient) and actor/entropy are aggregated
like the loss; actor/pg_clipfrac (the clipped branch is taken), actor/pg_clipfrac_lower (A < 0 and the dual clip
bound is taken) and actor/ppo_kl (mean of old - logp) are token means over the global batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import Rollout
from megatron_branch.losses.aggregation import Aggregation
from megatron_branch.losses.config import KL_ALIASES, KL_TYPES
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.losses.registry import register_policy_loss
from megatron_branch.losses.rollout_correction import rollout_is_weights
from megatron_branch.losses.token import TokenObjective

__all__ = ["KL_ALIASES", "KL_TYPES", "PolicyObjective", "kl_penalty"]


def kl_penalty(logp: torch.Tensor, ref: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference (k1, k2, or k3 = verl's low_var_kl with its clamps)."""
    kind = KL_ALIASES.get(kind, kind)
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref).square()
    if kind == "k3":
        x = (ref - logp).clamp(-20.0, 20.0)
        return (x.exp() - x - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown KL type {kind!r}; choose one of {', '.join(KL_TYPES + tuple(KL_ALIASES))}")


def policy_settings(cfg: Any, batch: Sequence[Rollout]) -> dict[str, Any]:
    """The settings every loss mode shares (aggregation, KL, entropy, TRL's options, rollout correction) from
    verl's actor keys (losses.config.ObjectiveConfig): the one mapping."""
    return dict(
        agg=Aggregation.of_batch(batch, cfg.loss_agg_mode, cfg.loss_agg_norm),
        kl_coef=cfg.kl_loss_coef,
        kl_type=cfg.kl_loss_type,
        entropy_coef=cfg.entropy_coeff,
        entropy_metric=cfg.entropy_metric,
        kl_bias_correction=cfg.use_bias_correction_kl,
        entropy_token_mean=cfg.entropy_token_mean,
        rollout_is=cfg.rollout_is,
        rollout_is_threshold=cfg.rollout_is_threshold,
        rollout_is_threshold_lower=cfg.rollout_is_threshold_lower,
        rollout_metrics=bool(batch) and all(r.field("rollout_logprobs") is not None for r in batch),
    )


@register_policy_loss("vanilla", "grpo")
@dataclass(kw_only=True)
class PolicyObjective(TokenObjective):
    """GRPO / PPO actor loss (verl's `vanilla`). Per-rollout data comes from the rollouts of the bound tree
    (advantage or advantages, old_logprobs, ref_logprobs)."""

    clip_low: float | None = 0.2
    """epsilon_low: r is clipped below at 1 - clip_low (None with clip_high None: no clipping)."""
    clip_high: float | None = 0.2
    """epsilon_high: r is clipped above at 1 + clip_high (DAPO's clip-higher when larger than clip_low)."""
    clip_c: float | None = None
    """Dual-clip bound for A < 0 (> 1); None = off. verl always applies it with 3."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty (needs ref_logprobs when non-zero)."""
    kl_type: str = "k1"
    """k1 | k2 | k3 (aliases kl, mse, low_var_kl)."""
    entropy_coef: float = 0.0
    """Coefficient of the entropy bonus (the loss subtracts entropy_coef * H)."""
    entropy_metric: bool = False
    """Report actor/entropy even when entropy_coef is 0 (costs one sum per row in the fused projection)."""
    kl_bias_correction: bool = False
    """Multiply the KL estimate by the importance ratio r (TRL's use_bias_correction_kl, DeepSeek-V3.2)."""
    entropy_token_mean: bool = False
    """Average the entropy bonus over every response token of the batch (TRL) instead of with the loss's
    aggregation (verl)."""
    rollout_is: str | None = None
    """Truncated importance weights of old_logprobs over rollout_logprobs on the policy term: token | sequence
    (losses/rollout_correction.py); None = off."""
    rollout_is_threshold: float = 2.0
    """Their upper truncation (or IcePop's upper bound)."""
    rollout_is_threshold_lower: float | None = None
    """IcePop's lower bound: weights outside [lower, upper] are zeroed instead of truncated."""
    rollout_metrics: bool = False
    """Report training/rollout_probs_diff_mean (every rollout carries rollout_logprobs)."""

    def __post_init__(self) -> None:
        if (self.clip_low is None) != (self.clip_high is None):
            raise ValueError("give both clip_low and clip_high, or neither (no clipping)")
        for name in ("clip_low", "clip_high"):
            v = getattr(self, name)
            if v is not None and not 0 <= v:
                raise ValueError(f"{name} must be >= 0, got {v}")
        if self.clip_low is not None and self.clip_low >= 1:
            raise ValueError(f"clip_low must be < 1 (r is clipped at 1 - clip_low), got {self.clip_low}")
        if self.clip_c is not None and not self.clip_c > 1:
            raise ValueError(f"the dual-clip constant must be > 1, got {self.clip_c}")
        self.kl_type = KL_ALIASES.get(self.kl_type, self.kl_type)
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"unknown KL type {self.kl_type!r}; choose k1, k2, k3 (or kl, mse, low_var_kl)")

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> PolicyObjective:
        """verl's actor keys (losses.config.ObjectiveConfig) onto the loss's own parameters."""
        return cls(
            **policy_settings(cfg, batch),
            clip_low=cfg.clip_ratio_low,
            clip_high=cfg.clip_ratio_high,
            clip_c=cfg.clip_ratio_c,
        )

    @classmethod
    def requires_reference(cls, cfg: Any) -> bool:
        return cfg.kl_loss_coef != 0

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef != 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_coef != 0 or self.entropy_metric

    def stats(self) -> tuple[tuple[str, str], ...]:
        names = [
            ("actor/pg_loss", "agg"),
            ("actor/pg_clipfrac", "token"),
            ("actor/pg_clipfrac_lower", "token"),
            ("actor/ppo_kl", "token"),
        ]
        if self.kl_coef != 0:
            names.append(("actor/kl_loss", "agg"))
        if self.needs_entropy:
            names.append(("actor/entropy", "agg"))
        if self.rollout_is is not None:
            names.append(("rollout_corr/rollout_is_mean", "token"))
        if self.rollout_metrics:
            names.append(("training/rollout_probs_diff_mean", "token"))
        return tuple(names)

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        adv, _ = pairs.field("advantages", scalar="advantage")
        old, has_old = pairs.field("old_logprobs", required=False)
        data = {"adv": adv, "old": old, "has_old": has_old}
        if self.kl_coef != 0:
            data["ref"], _ = pairs.field("ref_logprobs")
        if self.rollout_is is not None:
            data["is_w"] = rollout_is_weights(
                pairs, self.rollout_is, self.rollout_is_threshold, self.rollout_is_threshold_lower
            )
        if self.rollout_metrics:
            data["rollout"], _ = pairs.field("rollout_logprobs")
        if self.entropy_token_mean:  # the bonus's weight 1/T instead of the pair's aggregation weight
            w = [self.agg.rollout_weight(r.num_trained) for r in pairs.tree.rollouts]
            data["ent_scale"] = pairs.rollout_values(
                self.agg.token_weight / torch.tensor(w, dtype=torch.float64)
            )
        return data

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(policy loss, clipped, dual-clipped) per pair [q]: verl's `vanilla`; a loss mode overrides this
        (losses/policy_modes.py)."""
        adv = d["adv"]
        old = torch.where(d["has_old"], d["old"], logp.detach())  # on-policy: r = 1 with r's gradient
        neg_kl = (logp - old).clamp(-20.0, 20.0)  # verl clamps the log-ratio before exp
        ratio = neg_kl.exp()
        pg1 = -adv * ratio
        if self.clip_low is not None and self.clip_high is not None:
            pg2 = -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
            pg = torch.maximum(pg1, pg2)
            clipped = (pg2 > pg1).to(logp.dtype)
        else:
            pg, clipped = pg1, torch.zeros_like(pg1)
        lower = torch.zeros_like(pg)
        if self.clip_c is not None:
            pg3 = -adv * self.clip_c
            neg = adv < 0
            lower = ((pg > pg3) & neg).to(logp.dtype)
            pg = torch.where(neg, torch.minimum(pg, pg3), pg)
        return pg, clipped, lower

    def terms(
        self, logp: torch.Tensor, entropy: torch.Tensor | None, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Per-pair loss [q] and stats, in `stat_names` order: the policy term `pg_terms`, then KL and entropy
        (added outside the policy-loss function, as verl's actor does for every loss mode)."""
        pg, clipped, lower = self.pg_terms(logp, d)
        if self.rollout_is is not None:  # verl multiplies the policy term (pg_losses) by the weights
            pg = pg * d["is_w"]
        old = torch.where(d["has_old"], d["old"], logp.detach())
        loss = pg
        stats = [pg, clipped, lower, -(logp - old).clamp(-20.0, 20.0)]
        if self.kl_coef != 0:
            kl = kl_penalty(logp, d["ref"], self.kl_type)
            if self.kl_bias_correction:  # TRL: k * r, r the token ratio with its gradient
                kl = kl * (logp - old).clamp(-20.0, 20.0).exp()
            loss = loss + self.kl_coef * kl
            stats.append(kl)
        if self.needs_entropy:
            assert entropy is not None, "the schedule did not compute the entropy the objective needs"
            if self.entropy_coef != 0:
                bonus = entropy * d["ent_scale"] if self.entropy_token_mean else entropy
                loss = loss - self.entropy_coef * bonus
            stats.append(entropy)
        if self.rollout_is is not None:
            stats.append(d["is_w"])
        if self.rollout_metrics:
            stats.append((logp.detach().exp() - d["rollout"].exp()).abs())
        return loss, stats
