"""Token-additive RL objectives on the LOGICAL batch.

A schedule evaluates the objective on the targets it has in hand (a chunk of the packed tree, or one rollout in the
naive schedule). The objective must therefore be a sum over (rollout, response token) terms; its normalisation is
fixed once for the logical batch (what naive training would count), never per chunk or micro-batch.

`PolicyGradientObjective` is the on-policy GRPO form used by `megatron-branch grad`:
    L = -(1/T) * sum_i sum_{t in response_i} A_i * logp(i, t),   T = total response tokens (logical)
A token shared by k rollouts appears once in the tree and carries the sum of their weights (PrefixTree.token_weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_branch.data import PrefixTree


@dataclass(kw_only=True)
class PolicyGradientObjective:
    """Linear policy-gradient loss; `coef[i]` multiplies every response logprob of rollout i."""

    coef: torch.Tensor
    """[num_rollouts] float64: A_i / T (or any per-rollout scalar already normalised on the logical batch)."""

    @classmethod
    def grpo(cls, advantages: Sequence[float], num_response_tokens: int) -> PolicyGradientObjective:
        """On-policy GRPO: coef_i = A_i / T with T the GLOBAL logical response-token count (all DP ranks)."""
        if num_response_tokens <= 0:
            raise ValueError("the batch has no response tokens")
        return cls(coef=torch.tensor(list(advantages), dtype=torch.float64) / num_response_tokens)

    def tree_weights(self, tree: PrefixTree) -> torch.Tensor:
        """[N] weight of each packed token's logprob (sum over the rollouts whose response holds it)."""
        return tree.token_weights(self.coef)

    def rollout_weights(self, tree: PrefixTree, i: int) -> torch.Tensor:
        """[len_i] weight of each token of rollout i alone (prompt tokens 0): the naive schedule's view."""
        r = tree.rollouts[i]
        w = torch.zeros(len(r.prompt) + len(r.response), dtype=torch.float64)
        w[len(r.prompt) :] = self.coef[i]
        return w

    @staticmethod
    def loss(logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """-sum w * logp over the given targets (weights cast to logp's dtype)."""
        return -(logp * weights.to(logp.dtype)).sum()
