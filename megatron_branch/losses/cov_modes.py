"""Clip-Cov and KL-Cov (Cui et al. 2025, arXiv:2505.22617; verl 0.9.1's `clip_cov`, `kl_cov`), natively.

Both single out the few (rollout, token) pairs whose covariance between advantage and current logprob is largest
and treat them apart. Per pair p of the LOGICAL batch (a token shared by k rollouts is k pairs, each with its own
rollout's advantage: the ranking is over pairs, never over tree tokens), A the advantage, logp the current
policy's (detached) logprob, means over all P pairs of the batch:

    cov_p = (A_p - mean A) (logp_p - mean logp)
    kl_cov    the max(1, int(P kl_cov_ratio)) pairs of largest cov_p (torch.topk) get
              pg = -A r + ppo_kl_coef |logp - old|; every other pair pg = -A r  (r = exp(logp - old), no clip)
    clip_cov  pairs whose clipped term is taken are out; of the rest, those with clip_cov_lb < cov_p < clip_cov_ub
              are candidates, and max(1, int(P clip_cov_ratio)) of them drawn at random (torch.randperm, the global
              generator, as verl) lose their gradient: pg = max(-A r, -A clip(r)) * (0 if drawn else 1)

The ranking needs every pair's current logprob at once: a forward-only pass scores the micro-batch
(`needs_scores`), and the micro-batch must be the whole batch (one micro-batch on one DP rank; otherwise refused in
one line): verl ranks within each call, so its selection depends on how the batch is split; this one does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.errors import UserError
from megatron_branch.losses.objective import Prepared, SequenceScores
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.losses.policy import PolicyObjective
from megatron_branch.losses.policy_modes import clipped_settings, pair_logprobs
from megatron_branch.losses.registry import register_policy_loss


def _covariance(adv: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """[P] (A - mean A)(logp - mean logp) over the batch's pairs (verl's masked means: count + 1e-8)."""
    n = adv.numel() + 1e-8
    return (adv - adv.sum() / n) * (logp - logp.sum() / n)


@dataclass(kw_only=True)
class _CovObjective(PolicyObjective):
    """A loss mode that marks pairs by a batch-wide ranking of the current policy (`selected`, [P])."""

    needs_scores = True

    selected: torch.Tensor | None = None
    """[P] bool: the pairs the ranking singled out (set by `prepare`)."""

    def check(self, tree: PrefixTree) -> None:
        dataclasses.replace(self, selected=torch.zeros(TokenPairs(tree).num_pairs, dtype=torch.bool)).bind(
            tree
        )

    def prepare(self, tree: PrefixTree, scores: SequenceScores | None) -> Prepared:
        assert scores is not None, f"{type(self).__name__} needs the forward-only pass's logprobs"
        if len(tree.rollouts) != self.agg.rows:
            raise UserError(
                f"{type(self).NAME} ranks the whole batch at once: run the update as one micro-batch on one DP "
                f"rank ({len(tree.rollouts)} of {self.agg.rows} rollouts here)"
            )
        pairs = TokenPairs(tree)
        selected = self.select(pairs, pair_logprobs(pairs, scores))
        return Prepared(objective=dataclasses.replace(self, selected=selected))

    NAME = ""

    def select(self, pairs: TokenPairs, cur: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        assert self.selected is not None and len(self.selected) == pairs.num_pairs, (
            "bind a prepared objective"
        )
        return {**super().pair_data(pairs), "sel": self.selected}


@register_policy_loss("kl_cov")
@dataclass(kw_only=True)
class KLCovObjective(_CovObjective):
    """KL-Cov (module doc)."""

    NAME = "kl_cov"
    kl_cov_ratio: float = 0.0002
    """Fraction of the batch's pairs that get the |log-ratio| penalty."""
    ppo_kl_coef: float = 0.1
    """Coefficient of that penalty."""

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> KLCovObjective:
        return cls(**clipped_settings(cfg, batch), kl_cov_ratio=cfg.kl_cov_ratio, ppo_kl_coef=cfg.ppo_kl_coef)

    def select(self, pairs: TokenPairs, cur: torch.Tensor) -> torch.Tensor:
        adv, _ = pairs.field("advantages", scalar="advantage")
        cov = _covariance(adv, cur)
        top = torch.topk(cov, max(1, int(cov.numel() * self.kl_cov_ratio)), largest=True).indices
        return torch.zeros(cov.numel(), dtype=torch.bool).index_fill_(0, top, True)

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        adv = d["adv"]
        log_ratio = logp - torch.where(d["has_old"], d["old"], logp.detach())
        pg = -adv * log_ratio.exp()
        pg = torch.where(d["sel"], pg + self.ppo_kl_coef * log_ratio.abs(), pg)
        zero = torch.zeros_like(pg)
        return pg, zero, zero


@register_policy_loss("clip_cov")
@dataclass(kw_only=True)
class ClipCovObjective(_CovObjective):
    """Clip-Cov (module doc)."""

    NAME = "clip_cov"
    clip_cov_ratio: float = 0.0002
    """Fraction of the batch's pairs whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """Lower bound of a candidate's covariance."""
    clip_cov_ub: float = 5.0
    """Upper bound of a candidate's covariance."""

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> ClipCovObjective:
        return cls(
            **clipped_settings(cfg, batch),
            clip_cov_ratio=cfg.clip_cov_ratio,
            clip_cov_lb=cfg.clip_cov_lb,
            clip_cov_ub=cfg.clip_cov_ub,
        )

    def _terms(
        self, logp: torch.Tensor, adv: torch.Tensor, old: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.clip_low is not None and self.clip_high is not None
        ratio = (logp - old).exp()
        return -adv * ratio, -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)

    def select(self, pairs: TokenPairs, cur: torch.Tensor) -> torch.Tensor:
        adv, _ = pairs.field("advantages", scalar="advantage")
        old, has_old = pairs.field("old_logprobs", required=False)
        pg1, pg2 = self._terms(cur, adv, torch.where(has_old, old, cur))
        cov = _covariance(adv, cur).masked_fill(pg2 > pg1, -torch.inf)
        candidates = torch.nonzero((cov < self.clip_cov_ub) & (cov > self.clip_cov_lb))[:, 0]
        drawn = candidates[torch.randperm(len(candidates))[: max(1, int(cov.numel() * self.clip_cov_ratio))]]
        return torch.zeros(cov.numel(), dtype=torch.bool).index_fill_(0, drawn, True)

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pg1, pg2 = self._terms(logp, d["adv"], torch.where(d["has_old"], d["old"], logp.detach()))
        cut = d["sel"].to(logp.dtype)
        return torch.maximum(pg1, pg2) * (1.0 - cut), cut, torch.zeros_like(pg1)
