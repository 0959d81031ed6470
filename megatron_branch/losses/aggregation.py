"""Loss aggregation over the GLOBAL logical batch (all micro-batches, all DP ranks), never per micro-batch.

With l_{i,t} the per-token loss of response token t of rollout i, N rollouts and |o_i| = len(response_i):

    token-mean                sum_{i,t} l / sum_i |o_i|
    seq-mean-token-mean       (1/N) sum_i (1/|o_i|) sum_t l
    seq-mean-token-sum        (1/N) sum_i sum_t l
    seq-mean-token-sum-norm   sum_{i,t} l / (N * L_norm)        (L_norm given: `norm`)

Every mode is a weighted sum over (rollout, token) pairs with a weight per rollout fixed by N, sum |o_i| and
L_norm of the GLOBAL batch (NeMo-RL's global normalisation). So a batch split into micro-batches or DP shards adds
up to exactly the same loss and gradient. verl instead averages per micro-batch and then averages the micro-batch
means without weights, and takes L_norm as the padded width of a micro-batch, both of which depend on how the batch
is split; we do not copy that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_branch.data import Rollout

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@dataclass(kw_only=True)
class Aggregation:
    """How per-token terms are averaged; the counts are those of the GLOBAL logical batch."""

    mode: str = "token-mean"
    """One of AGG_MODES (verl's names)."""
    num_rollouts: int
    """N: rollouts in the global batch (all micro-batches, all DP ranks)."""
    num_tokens: int
    """sum_i |o_i|: response tokens in the global batch (a shared token counts once per rollout)."""
    norm: float | None = None
    """L_norm for seq-mean-token-sum-norm (required there, refused elsewhere)."""

    def __post_init__(self) -> None:
        if self.mode not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation {self.mode!r}; choose one of {', '.join(AGG_MODES)}")
        if self.num_rollouts <= 0 or self.num_tokens <= 0:
            raise ValueError("the batch has no rollouts or no response tokens")
        if self.mode == "seq-mean-token-sum-norm":
            if self.norm is None or not self.norm > 0:
                raise ValueError("seq-mean-token-sum-norm needs a positive L_norm (--loss-agg-norm)")
        elif self.norm is not None:
            raise ValueError(f"a normaliser is only used by seq-mean-token-sum-norm, not {self.mode}")

    @classmethod
    def of_batch(
        cls, rollouts: Sequence[Rollout], mode: str = "token-mean", norm: float | None = None
    ) -> Aggregation:
        """The aggregation of the global batch `rollouts` (every rollout of the update, on every rank)."""
        return cls(
            mode=mode,
            num_rollouts=len(rollouts),
            num_tokens=sum(len(r.response) for r in rollouts),
            norm=norm,
        )

    def rollout_weight(self, response_len: int) -> float:
        """The weight of each per-token term of a rollout with `response_len` response tokens."""
        if self.mode == "token-mean":
            return 1.0 / self.num_tokens
        if self.mode == "seq-mean-token-mean":
            return 1.0 / (self.num_rollouts * response_len)
        if self.mode == "seq-mean-token-sum":
            return 1.0 / self.num_rollouts
        assert self.norm is not None
        return 1.0 / (self.num_rollouts * self.norm)

    @property
    def token_weight(self) -> float:
        """The weight of a token mean over the global batch (the metrics' clip fractions, ppo_kl)."""
        return 1.0 / self.num_tokens
