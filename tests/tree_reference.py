"""Slow reference derivations from unpacked rollouts, for tests only (the package never imports this file).

Each function here restates a `PrefixTree` quantity the naive way, rollout by rollout, using nothing of the
tree but each rollout's packed index list (`rollout_indices`), which tests check separately against the
rollout's own tokens. Quadratic or worse; never call these on real batches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_branch.data import PrefixTree

__all__ = ["attention_mask_from_rollouts", "prefix_index_map", "token_weights_from_rollouts"]


def attention_mask_from_rollouts(tree: PrefixTree) -> torch.Tensor:
    """bool [N, N]: mask[q, k] iff some rollout's index list holds k at a position <= that of q."""
    n = tree.num_tokens
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i in range(len(tree.rollouts)):
        idx = tree.rollout_indices(i)
        rows, cols = idx.unsqueeze(1), idx.unsqueeze(0)
        # Row p of the rollout sees its positions 0..p: a lower-triangular block scattered to packed indices.
        mask[rows, cols] |= torch.ones(len(idx), len(idx), dtype=torch.bool).tril()
    return mask


def prefix_index_map(tree: PrefixTree) -> dict[tuple[int, ...], int]:
    """Every distinct prefix of every rollout -> the packed index of its last token.

    Asserts that equal prefixes share one packed index (sharing is exact) and different prefixes never do.
    """
    by_prefix: dict[tuple[int, ...], int] = {}
    by_index: dict[int, tuple[int, ...]] = {}
    for i, rollout in enumerate(tree.rollouts):
        seq = rollout.prompt + rollout.response
        for j, t in enumerate(tree.rollout_indices(i).tolist()):
            prefix = seq[: j + 1]
            assert by_prefix.setdefault(prefix, t) == t, (
                f"prefix of rollout {i} at {j} maps to two packed tokens"
            )
            assert by_index.setdefault(t, prefix) == prefix, f"packed token {t} holds two different prefixes"
    return by_prefix


def token_weights_from_rollouts(tree: PrefixTree, per_rollout: Sequence[float]) -> torch.Tensor:
    """float64 [N]: per_rollout[i] summed, in rollout order, over the response tokens of each rollout i."""
    weights = [0.0] * tree.num_tokens
    for i, rollout in enumerate(tree.rollouts):
        for t in tree.rollout_indices(i).tolist()[len(rollout.prompt) :]:
            weights[t] += float(per_rollout[i])
    return torch.tensor(weights, dtype=torch.float64)
