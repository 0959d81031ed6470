"""verl's other policy-loss modes, natively: GSPO (a sequence-level ratio) and CISPO (clipped, stopped weights).

Each is `PolicyObjective` (losses/policy.py) with another policy term: the KL penalty, the entropy bonus, the
aggregation and the metrics are the vanilla loss's. Per (rollout i, response token t), A the advantage, old the
sampling policy's logprob (absent: on-policy, old = logp detached), sg = stop-gradient, eps_lo / eps_hi =
clip_ratio_low / clip_ratio_high, verl 0.9.1's `compute_policy_loss_gspo` / `_cispo` term by term:

    gspo   (Zheng et al. 2025, arXiv:2507.18071; verl's form is the paper's GSPO-token)
           log s_i   = (1/|o_i|) sum_t (logp_{i,t} - old_{i,t})                 the rollout's mean log-ratio
           s_{i,t}   = exp(min(sg(log s_i) + logp_{i,t} - sg(logp_{i,t}), 10))  value s_i, gradient s_i dlogp
           pg        = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_lo, 1 + eps_hi))
    cispo  (MiniMax-M1, arXiv:2506.13585)
           r         = exp(clamp(logp - old, -20, 20))
           pg        = -sg(clip(r, 1 - eps_lo, 1 + eps_hi)) A logp

With a scalar advantage and seq-mean-token-mean, GSPO-token's gradient is the sequence-level GSPO's.

Sharing. s_i depends on rollout i's WHOLE response: at a token shared by rollouts i and j the two terms carry
s_i and s_j, which differ. So s_i is a per-rollout datum, never a per-token one: a forward-only pass scores the
micro-batch first (`needs_scores`, as DPO's), `prepare` turns its logprobs into s_i per rollout, and the gradient
pass evaluates each (rollout, token) pair with its own rollout's s_i (losses/pairs.py). s_i is taken over the
rollout's scored response tokens (a first token after an empty prompt has no logprob). CISPO is per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses.aggregation import Aggregation
from megatron_branch.losses.objective import Prepared, SequenceScores
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.losses.policy import PolicyObjective
from megatron_branch.losses.registry import register_policy_loss


def _clipped_only(cfg: Any, batch: Sequence[Rollout]) -> dict[str, Any]:
    """The vanilla loss's settings from cfg, less the dual clip (verl applies it in `vanilla` only)."""
    return dict(
        agg=Aggregation.of_batch(batch, cfg.loss_agg_mode, cfg.loss_agg_norm),
        clip_low=cfg.clip_ratio_low,
        clip_high=cfg.clip_ratio_high,
        kl_coef=cfg.kl_loss_coef,
        kl_type=cfg.kl_loss_type,
        entropy_coef=cfg.entropy_coeff,
        entropy_metric=cfg.entropy_metric,
    )


@register_policy_loss("gspo")
@dataclass(kw_only=True)
class GSPOObjective(PolicyObjective):
    """GSPO: the clipped surrogate on the rollout's sequence-level ratio s_i (module doc)."""

    needs_scores = True

    seq_log_ratio: torch.Tensor | None = None
    """[R] float64 log s_i of the bound micro-batch's rollouts (set by `prepare`; None before)."""

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> GSPOObjective:
        return cls(**_clipped_only(cfg, batch))

    def check(self, tree: PrefixTree) -> None:
        dataclasses.replace(self, seq_log_ratio=torch.zeros(len(tree.rollouts))).bind(tree)

    def prepare(self, tree: PrefixTree, scores: SequenceScores | None) -> Prepared:
        assert scores is not None, "GSPO needs the forward-only pass's logprobs (needs_scores)"
        return Prepared(
            objective=dataclasses.replace(self, seq_log_ratio=self.sequence_log_ratios(tree, scores))
        )

    @staticmethod
    def sequence_log_ratios(tree: PrefixTree, scores: Any) -> torch.Tensor:
        """[R] log s_i: the mean over rollout i's scored response tokens of logp - old (0 on-policy)."""
        pairs = TokenPairs(tree)
        old, has_old = pairs.field("old_logprobs", required=False)
        out = torch.zeros(len(tree.rollouts), dtype=torch.float64)
        for i in range(len(tree.rollouts)):
            sl = slice(pairs.start[i], pairs.start[i + 1])
            cur = scores.logprobs[i].to(torch.float64)[pairs.position[sl]]  # [n_i] scored response tokens
            diff = torch.where(has_old[sl], cur - old[sl], torch.zeros_like(cur))
            out[i] = diff.mean() if diff.numel() else 0.0
        return out

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        assert self.seq_log_ratio is not None, "bind a prepared GSPO objective (prepare(tree, scores))"
        assert len(self.seq_log_ratio) == len(pairs.tree.rollouts), "s_i of another micro-batch"
        return {**super().pair_data(pairs), "seq": pairs.rollout_values(self.seq_log_ratio)}

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        adv = d["adv"]
        ratio = (logp - logp.detach() + d["seq"]).clamp(max=10.0).exp()  # value s_i, gradient s_i dlogp
        pg1 = -adv * ratio
        assert self.clip_low is not None and self.clip_high is not None
        pg2 = -adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        return torch.maximum(pg1, pg2), (pg2 > pg1).to(logp.dtype), torch.zeros_like(pg1)


@register_policy_loss("cispo")
@dataclass(kw_only=True)
class CISPOObjective(PolicyObjective):
    """CISPO: the policy gradient weighted by the clipped, stopped importance ratio (module doc)."""

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> CISPOObjective:
        return cls(**_clipped_only(cfg, batch))

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        old = torch.where(d["has_old"], d["old"], logp.detach())
        ratio = (logp - old).clamp(-20.0, 20.0).exp()
        assert self.clip_low is not None and self.clip_high is not None
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        pg = -clipped.detach() * d["adv"] * logp
        return pg, (ratio != clipped).to(logp.dtype), torch.zeros_like(pg)
