"""Loss aggregation over the GLOBAL logical batch (all micro-batches, all DP ranks), never per micro-batch.

With l_{i,t} the per-token loss of response token t of rollout i, m_{i,t} its loss_mask (1 = trained; absent = all
ones), n_i = sum_t m_{i,t} the rollout's trained tokens and N' the rollouts with n_i > 0 (verl's `seq_mask`:
a rollout with no trained token counts in no sequence mean):

    token-mean                sum_{i,t} m l / sum_i n_i
    token-sum                 sum_{i,t} m l
    seq-mean-token-mean       (1/N') sum_i (1/n_i) sum_t m l
    seq-mean-token-sum        (1/N') sum_i sum_t m l
    seq-mean-token-sum-norm   sum_{i,t} m l / (N' * L_norm)        (L_norm given: `norm`, a constant)

verl's `agg_loss` (trainer/ppo/core_algos.py) with its loss_mask over the whole batch. The mask itself enters as
the absence of the masked (rollout, token) pairs (losses/pairs.py); here it enters the counts. Every mode is a
weighted sum over pairs with a weight per rollout fixed by N', sum n_i and L_norm of the GLOBAL batch (NeMo-RL's
global normalisation). So a batch split into micro-batches or DP shards adds up to exactly the same loss and
gradient. verl instead averages per micro-batch and then averages the micro-batch means without weights, and takes
L_norm as the padded width of a micro-batch, both of which depend on how the batch is split; we do not copy that.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_branch.data import Rollout

AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


@dataclass(kw_only=True)
class Aggregation:
    """How per-token terms are averaged; the counts are those of the GLOBAL logical batch."""

    mode: str = "token-mean"
    """One of AGG_MODES (verl's names)."""
    num_rollouts: int
    """N': rollouts in the global batch (all micro-batches, all DP ranks) with at least one trained token."""
    num_tokens: int
    """sum_i n_i: trained response tokens in the global batch (a shared token counts once per rollout)."""
    norm: float | None = None
    """L_norm for seq-mean-token-sum-norm (required there, refused elsewhere)."""
    batch_rollouts: int | None = None
    """N: every rollout of the global batch, those without a trained token included (verl's row count: its
    geo_mean's plain mean over rows, and what a loss reading the whole batch at once must see); None: N'."""

    def __post_init__(self) -> None:
        if self.mode not in AGG_MODES:
            raise ValueError(f"unknown loss aggregation {self.mode!r}; choose one of {', '.join(AGG_MODES)}")
        if self.num_rollouts <= 0 or self.num_tokens <= 0:
            raise ValueError(
                "the batch has no trained response tokens (no rollouts, or every loss_mask is 0)"
            )
        assert self.batch_rollouts is None or self.batch_rollouts >= self.num_rollouts, "N < N'"
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
            num_rollouts=sum(r.num_trained > 0 for r in rollouts),
            num_tokens=sum(r.num_trained for r in rollouts),
            norm=norm,
            batch_rollouts=len(rollouts),
        )

    @property
    def rows(self) -> int:
        """N: the global batch's rollouts, all-context ones included (`batch_rollouts`, else N')."""
        return self.num_rollouts if self.batch_rollouts is None else self.batch_rollouts

    def rollout_weight(self, trained: int) -> float:
        """The weight of each per-token term of a rollout with `trained` trained response tokens (0: the rollout
        has no term to weigh)."""
        if trained == 0:
            return 0.0
        if self.mode == "token-mean":
            return 1.0 / self.num_tokens
        if self.mode == "token-sum":
            return 1.0
        if self.mode == "seq-mean-token-mean":
            return 1.0 / (self.num_rollouts * trained)
        if self.mode == "seq-mean-token-sum":
            return 1.0 / self.num_rollouts
        assert self.norm is not None
        return 1.0 / (self.num_rollouts * self.norm)

    @property
    def token_weight(self) -> float:
        """The weight of a token mean over the global batch's trained tokens (the metrics' clip fractions, ppo_kl)."""
        return 1.0 / self.num_tokens
