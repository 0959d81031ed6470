"""Per-token objectives: a sum over (rollout, response token) pairs of a function of that pair's logprob (or value).

    L = sum_{i, t} w_i * terms(x_{i,t}, H_{i,t}, data_{i,t})        w_i: the aggregation weight of rollout i

A subclass says which per-pair data it reads (`pair_data`, from the rollouts' fields), which metrics it reports
(`stats`) and the per-pair loss (`terms`); binding, sharing and normalisation are done here, once, for every such
objective (losses/pairs.py: a token shared by k rollouts is k terms, each with its own rollout's data). The policy
loss (losses/policy.py), the critic's value loss (losses/value.py) and any plugin's per-token objective are this:

    @register_policy_loss("half_pg")
    @dataclass(kw_only=True)
    class HalfPG(TokenObjective):
        def pair_data(self, pairs):
            return {"adv": pairs.field("advantages", scalar="advantage")[0]}

        def terms(self, logp, entropy, d):
            return -0.5 * d["adv"] * logp, []
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses.aggregation import Aggregation
from megatron_branch.losses.objective import ObjectiveBase
from megatron_branch.losses.pairs import PairBound, TokenPairs


@dataclass(kw_only=True)
class TokenObjective(ObjectiveBase):
    """Base of the per-token objectives (module doc)."""

    agg: Aggregation
    """Aggregation mode and the GLOBAL batch counts."""

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> TokenObjective:
        """The objective aggregated as `cfg.loss_agg_mode` says over the global `batch` (subclasses with more
        settings read them from cfg too)."""
        return cls(agg=Aggregation.of_batch(batch, cfg.loss_agg_mode, cfg.loss_agg_norm))

    @property
    def needs_entropy(self) -> bool:
        """Ask the schedule for each row's full-vocabulary entropy."""
        return False

    def stats(self) -> tuple[tuple[str, str], ...]:
        """(metric name, "agg" | "token") in `terms`' order: "agg" averages like the loss, "token" is a token mean
        over the global batch."""
        return ()

    def metric_names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.stats())

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        """{name: [P]} per-pair data `terms` reads (pairs.field: a missing field is a UserError with file:line)."""
        return {}

    def terms(
        self, x: torch.Tensor, entropy: torch.Tensor | None, data: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(per-pair loss [q], one [q] tensor per stat) at logprobs (or values) x [q]."""
        raise NotImplementedError

    def bind(self, tree: PrefixTree) -> PairBound:
        pairs = TokenPairs(tree)
        weight = pairs.rollout_values(
            torch.tensor([self.agg.rollout_weight(r.num_trained) for r in tree.rollouts], dtype=torch.float64)
        )
        stats = self.stats()
        return PairBound(
            pairs,
            data=self.pair_data(pairs),
            weight=weight,
            token_weight=self.agg.token_weight,
            terms=self.terms,
            needs_entropy=self.needs_entropy,
            stat_names=tuple(n for n, _ in stats),
            stat_kinds=tuple(k for _, k in stats),
        )
