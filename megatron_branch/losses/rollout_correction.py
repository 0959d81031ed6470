"""Rollout correction: truncated importance sampling of the rollout engine's logprobs (verl's `rollout_is`).

The inference engine that sampled a rollout reports its own logprobs (`rollout_logprobs`, one per response token);
the trainer's `old_logprobs` differ from them by the engines' numerics (bf16 kernels, batch-variant reductions).
verl 0.9.1 (`rollout_corr_helper.compute_rollout_correction_weights`) weights each token's policy term by
w = pi_old / pi_rollout, truncated (TIS):

    token      w_{i,t} = min(exp(clamp(old_{i,t} - rollout_{i,t}, -20, 20)), threshold)
    sequence   w_i     = min(exp(clamp(sum_t (old_{i,t} - rollout_{i,t}), -20, 20)), threshold)   every token of i

or, with a lower bound (IcePop, masked IS: verl's threshold "lower_upper"), the raw weight where it lies in
[lower, threshold] and 0 elsewhere.

The weights are data (no gradient), one per (rollout, token) pair: at a token shared by rollouts i and j the two
policy terms carry w_i and w_j (a sequence weight is its rollout's whole response's). Metrics (token means over the
global batch): `rollout_corr/rollout_is_mean`, and `training/rollout_probs_diff_mean` = mean |p_train - p_rollout|
(p = exp(logprob); p_train at the current policy), verl's name, reported whenever every rollout carries
rollout_logprobs.

Rejection sampling (verl's `rollout_rs`, `rollout_rs_threshold`): criteria on log(old / rollout) per token or per
rollout reject tokens or whole rollouts. A rejected token leaves the loss exactly as a loss_mask 0 does: the
rollout's loss_mask is ANDed with the keep mask BEFORE the trees and the aggregation's counts are built (verl's
compute_rollout_correction_and_add_to_batch rewrites response_mask the same way), so there is one mechanism, the
per-pair mask of losses/pairs.py. The mask is verl's own compute_rollout_rejection_mask on the global batch
(response_mask = loss_mask), its metrics under verl's `rollout_corr/` names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from megatron_branch.data import Rollout
from megatron_branch.errors import UserError
from megatron_branch.losses.pairs import TokenPairs

SAFETY_BOUND = 20.0
"""verl's clamp of a log-weight before exp."""
IS_MODES = ("token", "sequence")


def rollout_is_weights(
    pairs: TokenPairs, level: str, threshold: float, lower: float | None = None
) -> torch.Tensor:
    """[P] IS weight of every pair (module doc): truncated at `threshold` (TIS), or with `lower` zeroed outside
    [lower, threshold] (IcePop: masked IS). old_logprobs and rollout_logprobs are required."""
    assert level in IS_MODES, level
    old, _ = pairs.field("old_logprobs")
    rollout, _ = pairs.field("rollout_logprobs")
    log_ratio = old - rollout  # [P]
    if level == "sequence":
        per_rollout = torch.zeros(len(pairs.tree.rollouts), dtype=torch.float64)
        log_ratio = pairs.rollout_values(per_rollout.index_add_(0, pairs.rollout, log_ratio))
    raw = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()
    if lower is None:
        return raw.clamp(max=threshold)
    return torch.where((raw >= lower) & (raw <= threshold), raw, torch.zeros_like(raw))


def reject_rollouts(
    batch: Sequence[Rollout], rollout_rs: str, threshold: str | float, *, refuse_empty: bool = False
) -> tuple[list[Rollout], dict[str, float]]:
    """(the GLOBAL batch with rejected tokens' loss_mask 0, verl's `rollout_corr/rollout_rs_*` metrics) through
    verl's compute_rollout_rejection_mask (module doc). old_logprobs and rollout_logprobs are required.
    `refuse_empty`: a batch left with no trained token is a UserError (grad: nothing to differentiate; train skips
    such an update instead, train/policy.py)."""
    try:
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask
    except ImportError:
        raise UserError(
            "rollout_rs needs verl, which is not installed (make setup-verl; docs/verl.md)"
        ) from None
    width = max(len(r.response) for r in batch)
    log_ratio = torch.zeros(len(batch), width, dtype=torch.float64)  # [R, W] old - rollout, verl's layout
    mask = torch.zeros_like(log_ratio)  # [R, W] verl's response_mask = loss_mask, 0 on the padding
    for i, r in enumerate(batch):
        fields = [r.field(name) for name in ("old_logprobs", "rollout_logprobs")]
        if any(f is None for f in fields):
            raise UserError("rollout_rs needs 'old_logprobs' and 'rollout_logprobs'", where=r.describe(i))
        k = len(r.response)
        log_ratio[i, :k] = torch.tensor(fields[0], dtype=torch.float64) - torch.tensor(
            fields[1], dtype=torch.float64
        )
        mask[i, :k] = torch.tensor(r.loss_mask or (True,) * k, dtype=torch.float64)
    keep, metrics = compute_rollout_rejection_mask(log_ratio, mask, rollout_rs, threshold)
    out = [
        dataclasses.replace(r, loss_mask=tuple(bool(v) for v in (keep[i, : len(r.response)] > 0.5).tolist()))
        for i, r in enumerate(batch)
    ]
    if refuse_empty and not any(r.num_trained for r in out):
        raise UserError(
            f"rollout_rs={rollout_rs!r} at rollout_rs_threshold={threshold!r} rejects every response token: "
            "nothing is left to train"
        )
    return out, {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}
