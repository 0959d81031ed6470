"""verl's other policy-loss modes, natively: GSPO, CISPO, SAPO and GMPO (verl's `geo_mean`).

Each is `PolicyObjective` (losses/policy.py) with another policy term: the KL penalty, the entropy bonus, the
aggregation and the metrics are the vanilla loss's. Per (rollout i, response token t), A the advantage, old the
sampling policy's logprob (absent: on-policy, old = logp detached), sg = stop-gradient, eps_lo / eps_hi =
clip_ratio_low / clip_ratio_high, verl 0.9.1's `compute_policy_loss_<mode>` term by term:

    gspo   (Zheng et al. 2025, arXiv:2507.18071; verl's form is the paper's GSPO-token)
           log s_i   = (1/|o_i|) sum_t (logp_{i,t} - old_{i,t})                 the rollout's mean log-ratio
           s_{i,t}   = exp(min(sg(log s_i) + logp_{i,t} - sg(logp_{i,t}), 10))  value s_i, gradient s_i dlogp
           pg        = max(-A s_{i,t}, -A clip(s_{i,t}, 1 - eps_lo, 1 + eps_hi))
    cispo  (MiniMax-M1, arXiv:2506.13585)
           r         = exp(clamp(logp - old, -20, 20))
           pg        = -sg(clip(r, 1 - eps_lo, 1 + eps_hi)) A logp
    sapo   (arXiv:2511.20347)  tau = tau_pos if A > 0 else tau_neg
           pg        = -A (4 / tau) sigmoid(tau (r - 1)),    aggregated seq-mean-token-mean (verl's, always)
    geo_mean (GMPO, arXiv:2507.20673)  d = logp - old, h = sgn(A) min(sgn(A) d, sgn(A) clip(d, -eps_lo, eps_hi))
           m_i       = sum_t h_{i,t} / (|o_i| + 1e-8),  Abar_i = sum_t A_{i,t} / (|o_i| + 1e-8)
           L         = (1/N) sum_i -Abar_i exp(m_i)       (a mean over rollouts, whatever loss_agg_mode says;
                                                          N counts a rollout without trained tokens, as verl's does)

sapo's and geo_mean's policy terms carry their own aggregation as verl's functions do; the KL and entropy terms
keep loss_agg_mode's. With a scalar advantage and seq-mean-token-mean, GSPO-token's gradient is the
sequence-level GSPO's; the sequence-level form itself is TRL's importance_sampling_level="sequence" (`level`): the
same value, the gradient of s_i through all the rollout's tokens, d/dlogp_u = (s_i/|o_i|) sum_t (-A_t) [the
unclipped term is taken at t] (TRL does not clamp log s_i).

Sharing. s_i depends on rollout i's WHOLE response: at a token shared by rollouts i and j the two terms carry
s_i and s_j, which differ. So s_i is a per-rollout datum, never a per-token one: a forward-only pass scores the
micro-batch first (`needs_scores`, as DPO's), `prepare` turns its logprobs into s_i per rollout, and the gradient
pass evaluates each (rollout, token) pair with its own rollout's s_i (losses/pairs.py). GMPO's m_i likewise: its
gradient at token t is -Abar_i exp(m_i) h'(d_t) / (|o_i| + 1e-8), each of the rollout's pairs carrying 1/|o_i| of
its value. Means are over the rollout's scored response tokens (a first token after an empty prompt has no
logprob). CISPO and SAPO are per token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses.config import IS_LEVELS
from megatron_branch.losses.objective import Prepared, SequenceScores
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.losses.policy import PolicyObjective, policy_settings
from megatron_branch.losses.registry import register_policy_loss


def clipped_settings(cfg: Any, batch: Sequence[Rollout]) -> dict[str, Any]:
    """The vanilla loss's settings from cfg, less the dual clip (verl applies it in `vanilla` only)."""
    return dict(**policy_settings(cfg, batch), clip_low=cfg.clip_ratio_low, clip_high=cfg.clip_ratio_high)


@dataclass(kw_only=True)
class SequenceScoredObjective(PolicyObjective):
    """A loss mode whose per-pair term reads a per-rollout quantity of the CURRENT policy (`seq`, [R]): a
    forward-only pass scores the micro-batch, `prepare` reduces it per rollout, the gradient pass reads it."""

    needs_scores = True

    seq: torch.Tensor | None = None
    """[R] float64 per-rollout quantity of the bound micro-batch's rollouts (set by `prepare`; None before)."""

    def check(self, tree: PrefixTree) -> None:
        dataclasses.replace(self, seq=torch.zeros(len(tree.rollouts), dtype=torch.float64)).bind(tree)

    def prepare(self, tree: PrefixTree, scores: SequenceScores | None) -> Prepared:
        assert scores is not None, (
            f"{type(self).__name__} needs the forward-only pass's logprobs (needs_scores)"
        )
        pairs = TokenPairs(tree)
        return Prepared(
            objective=dataclasses.replace(self, seq=self.reduce(pairs, pair_logprobs(pairs, scores)))
        )

    def reduce(self, pairs: TokenPairs, cur: torch.Tensor) -> torch.Tensor:
        """[R] the per-rollout quantity from the current logprobs cur [P]."""
        raise NotImplementedError

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        assert self.seq is not None, f"bind a prepared {type(self).__name__} (prepare(tree, scores))"
        assert len(self.seq) == len(pairs.tree.rollouts), "a per-rollout quantity of another micro-batch"
        return {**super().pair_data(pairs), "seq": pairs.rollout_values(self.seq)}


def pair_logprobs(pairs: TokenPairs, scores: Any) -> torch.Tensor:
    """[P] the forward-only pass's logprob of every pair (scores.logprobs: one [len(response)] per rollout)."""
    return torch.cat(
        [
            scores.logprobs[i].to(torch.float64)[pairs.position[pairs.start[i] : pairs.start[i + 1]]]
            for i in range(len(pairs.tree.rollouts))
        ]
    )


def _per_rollout_mean(pairs: TokenPairs, x: torch.Tensor, eps: float = 0.0) -> torch.Tensor:
    """[R] sum of x [P] over each rollout's pairs / (its pair count + eps); 0 for a rollout without pairs."""
    total = torch.zeros(len(pairs.tree.rollouts), dtype=torch.float64).index_add_(0, pairs.rollout, x)
    count = torch.tensor([b - a for a, b in zip(pairs.start, pairs.start[1:])], dtype=torch.float64)
    return torch.where(count > 0, total / (count + eps), torch.zeros_like(total))


def _log_ratio(pairs: TokenPairs, cur: torch.Tensor) -> torch.Tensor:
    """[P] logp - old of every pair (0 on-policy: no old_logprobs)."""
    old, has_old = pairs.field("old_logprobs", required=False)
    return torch.where(has_old, cur - old, torch.zeros_like(cur))


@register_policy_loss("gspo")
@dataclass(kw_only=True)
class GSPOObjective(SequenceScoredObjective):
    """GSPO: the clipped surrogate on the rollout's sequence-level ratio s_i (module doc); seq = log s_i."""

    level: str = "token"
    """token: verl's GSPO-token (gradient s_i at each token); sequence: TRL's importance_sampling_level="sequence"
    (the gradient of s_i itself, through every token of the rollout; no clamp of log s_i)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.level not in IS_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {', '.join(IS_LEVELS)}, got {self.level!r}"
            )

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> GSPOObjective:
        return cls(**clipped_settings(cfg, batch), level=cfg.importance_sampling_level)

    def reduce(self, pairs: TokenPairs, cur: torch.Tensor) -> torch.Tensor:
        return _per_rollout_mean(pairs, _log_ratio(pairs, cur))

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        data = super().pair_data(pairs)
        if self.level == "sequence":
            # d(sum_t w pg_t)/dlogp_u = w (s_i/|o_i|) sum_t dpg_t/ds: -A_t where the unclipped term is taken (or
            # s_i is inside the clip range), 0 where the clipped one is. One coefficient K_i per rollout.
            assert self.clip_low is not None and self.clip_high is not None
            s, adv = data["seq"].exp(), data["adv"]
            unclipped = -adv * s >= -adv * s.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
            k = torch.where(unclipped, -adv * s, torch.zeros_like(s))
            k_sum = torch.zeros(len(pairs.tree.rollouts), dtype=torch.float64).index_add_(0, pairs.rollout, k)
            data["k"] = pairs.rollout_values(k_sum / _pair_counts(pairs).clamp(min=1.0))
        return data

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        adv = d["adv"]
        if self.level == "sequence":
            s = d["seq"].exp()
            assert self.clip_low is not None and self.clip_high is not None
            pg1, pg2 = -adv * s, -adv * s.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
            pg = torch.maximum(pg1, pg2) + d["k"] * (logp - logp.detach())
            return pg, (pg2 > pg1).to(logp.dtype), torch.zeros_like(pg1)
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
        return cls(**clipped_settings(cfg, batch))

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        old = torch.where(d["has_old"], d["old"], logp.detach())
        ratio = (logp - old).clamp(-20.0, 20.0).exp()
        assert self.clip_low is not None and self.clip_high is not None
        clipped = ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high)
        pg = -clipped.detach() * d["adv"] * logp
        return pg, (ratio != clipped).to(logp.dtype), torch.zeros_like(pg)


def _own_aggregation(obj: PolicyObjective, pairs: TokenPairs, target: torch.Tensor) -> torch.Tensor:
    """[P] factor turning the configured aggregation's weight of each pair into `target` [R] (a loss mode that
    fixes its own aggregation, as verl's sapo and geo_mean do; KL and entropy keep the configured one)."""
    w = torch.tensor(
        [obj.agg.rollout_weight(r.num_trained) for r in pairs.tree.rollouts], dtype=torch.float64
    )
    return pairs.rollout_values(target / w)


def _pair_counts(pairs: TokenPairs) -> torch.Tensor:
    """[R] scored response tokens of each rollout (|o_i|, less a first token after an empty prompt)."""
    return torch.tensor([b - a for a, b in zip(pairs.start, pairs.start[1:])], dtype=torch.float64)


@register_policy_loss("sapo")
@dataclass(kw_only=True)
class SAPOObjective(PolicyObjective):
    """SAPO: a smooth sigmoid gate of the token ratio instead of a hard clip (module doc)."""

    tau_pos: float = 1.0
    """Gate temperature where A > 0."""
    tau_neg: float = 1.05
    """Gate temperature where A <= 0."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.tau_pos > 0 and self.tau_neg > 0):
            raise ValueError(f"SAPO's temperatures must be positive, got {self.tau_pos}, {self.tau_neg}")

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> SAPOObjective:
        return cls(**clipped_settings(cfg, batch), tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg)

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        n = self.agg.num_rollouts * (_pair_counts(pairs) + 1e-8)  # verl: seq-mean-token-mean, |o| + 1e-8
        return {**super().pair_data(pairs), "own": _own_aggregation(self, pairs, 1.0 / n)}

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        adv = d["adv"]
        old = torch.where(d["has_old"], d["old"], logp.detach())
        ratio = (logp - old).clamp(-20.0, 20.0).exp()
        tau = torch.where(adv > 0, torch.full_like(logp, self.tau_pos), torch.full_like(logp, self.tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
        zero = torch.zeros_like(logp)
        return -gate * adv * d["own"], zero, zero


def _gmpo_log_ratio(dlogp: torch.Tensor, adv: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """GMPO's per-token clipped log-ratio: sgn(A) min(sgn(A) d, sgn(A) clip(d, -low, high))."""
    sgn = torch.sign(adv)
    return sgn * torch.minimum(sgn * dlogp, sgn * dlogp.clamp(-low, high))


@register_policy_loss("geo_mean", "gmpo")
@dataclass(kw_only=True)
class GMPOObjective(SequenceScoredObjective):
    """GMPO (verl's geo_mean): the geometric mean of the clipped token ratios, per rollout (module doc); seq = m_i,
    the mean clipped log-ratio of the current policy."""

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> GMPOObjective:
        return cls(**clipped_settings(cfg, batch))

    def reduce(self, pairs: TokenPairs, cur: torch.Tensor) -> torch.Tensor:
        adv, _ = pairs.field("advantages", scalar="advantage")
        assert self.clip_low is not None and self.clip_high is not None
        h = _gmpo_log_ratio(_log_ratio(pairs, cur), adv, self.clip_low, self.clip_high)
        return _per_rollout_mean(pairs, h, eps=1e-8)  # verl's |o| + 1e-8

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        data = super().pair_data(pairs)
        n = _pair_counts(pairs)
        data["abar"] = pairs.rollout_values(_per_rollout_mean(pairs, data["adv"], eps=1e-8))
        data["count"] = pairs.rollout_values(n)
        # verl's torch.mean over the batch's rows: a rollout without a trained token counts in N (unlike agg_loss)
        data["own"] = _own_aggregation(self, pairs, torch.full_like(n, 1.0 / self.agg.rows))
        return data

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # L_i = -Abar_i exp(m_i): each of the rollout's n_i pairs carries 1/n_i of its value, and the gradient
        # -Abar_i exp(m_i) h'(d_t) / (n_i + 1e-8) of its own token (m_i is detached: the first pass's)
        adv = d["adv"]
        old = torch.where(d["has_old"], d["old"], logp.detach())
        dlogp = logp - old
        assert self.clip_low is not None and self.clip_high is not None
        h = _gmpo_log_ratio(dlogp, adv, self.clip_low, self.clip_high)
        value = -d["abar"] * d["seq"].exp()
        pg = value * (1.0 / d["count"] + (h - h.detach()) / (d["count"] + 1e-8)) * d["own"]
        clipped = dlogp != dlogp.clamp(-self.clip_low, self.clip_high)
        return pg, (clipped & (adv > 0)).to(logp.dtype), (clipped & (adv < 0)).to(logp.dtype)
