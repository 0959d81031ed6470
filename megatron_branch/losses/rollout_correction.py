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
rollout_logprobs. Rejection sampling (`rollout_rs`, which removes tokens from the loss mask) is not built here.
"""

from __future__ import annotations

import torch

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
