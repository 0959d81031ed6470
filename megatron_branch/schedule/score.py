"""Forward-only scoring: per-rollout response logprobs (and entropies) of a model over a prefix tree.

It serves the old-policy logprobs of PPO/GRPO, the reference model's logprobs (KL, DPO), DPO's first pass and
evaluation. It runs the chosen schedule's own forward under `torch.no_grad` (replay: one root-to-leaf path of K/V
alive at a time), so the numbers are bit-identical to that schedule's training forward in the same dtype.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.schedule.common import ScheduleOptions, StepResult


@dataclass(kw_only=True)
class Scores:
    """What scoring returns; rollout order is the tree's."""

    logprobs: list[torch.Tensor]
    """Per rollout: [len(response)] float64 logprob of each response token (NaN for a first response token
    with an empty prompt: nothing predicts it). For a critic: the value at each token's predecessor row."""
    entropy: list[torch.Tensor] | None
    """Per rollout: [len(response)] entropy of the distribution that predicted each token, when asked."""
    result: StepResult
    """The schedule's record (positions, forwards)."""
    loss_masks: list[tuple[bool, ...] | None] | None = None
    """Per rollout: its loss_mask (None: every response token trained)."""

    def sums(self) -> torch.Tensor:
        """[R] float64: sum of each rollout's response logprobs over the scored TRAINED tokens (DPO's pi: a
        context token, loss_mask 0, is not part of what the policy chose)."""
        masks = self.loss_masks or [None] * len(self.logprobs)
        return torch.stack(
            [
                (lp if m is None else lp[torch.tensor(m, dtype=torch.bool)]).nan_to_num(0.0).sum()
                for lp, m in zip(self.logprobs, masks, strict=True)
            ]
        )


def score_rollouts(
    schedule: str,
    model: torch.nn.Module,
    tree: PrefixTree,
    opts: ScheduleOptions,
    *,
    entropy: bool = False,
) -> Scores:
    """Score every rollout of `tree` with `model` through `schedule` (forward only; no gradient anywhere)."""
    from megatron_branch.schedule import run_schedule  # the registry lives in the package

    opts = dataclasses.replace(opts, keep_logprobs=True, keep_entropy=entropy)
    with torch.no_grad():
        res = run_schedule(schedule, model, tree, None, opts, forward_only=True)
    n = len(tree.rollouts)
    return Scores(
        logprobs=[res.rollout_logprobs(tree, i) for i in range(n)],
        entropy=[res.rollout_entropy(tree, i) for i in range(n)] if entropy else None,
        result=res,
        loss_masks=[r.loss_mask for r in tree.rollouts],
    )
