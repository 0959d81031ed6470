"""Rollout data: the `Rollout` record, its JSONL format, and the `PrefixTree` every other part derives from."""

from __future__ import annotations

from megatron_branch.data.prefix_tree import PrefixTree, Segment
from megatron_branch.data.rollouts import Rollout, read_rollouts_jsonl, write_rollouts_jsonl

__all__ = [
    "PrefixTree",
    "Rollout",
    "Segment",
    "read_rollouts_jsonl",
    "write_rollouts_jsonl",
]
