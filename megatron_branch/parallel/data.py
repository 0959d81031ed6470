"""Data parallel assignment: whole prefix groups go to DP ranks, balanced by COMPUTED positions.

Splitting a prefix group over DP ranks would compute its prefix on several ranks; balancing by rollout count would
ignore that one group may have a 128K prompt and another a 1K one. Greedy longest-processing-time assignment
(largest group first, to the least-loaded rank) is deterministic and within 4/3 of optimal (Graham, 1969).
"""

from __future__ import annotations

from megatron_branch.data import PrefixTree


def assign_groups(tree: PrefixTree, dp_size: int) -> list[list[int]]:
    """Rollout indices for each DP rank (sorted), from the prefix groups of `tree`."""
    assert dp_size >= 1
    groups = tree.groups()
    costs = [tree.num_tokens_of_root(root) for root in tree.roots]
    order = sorted(range(len(groups)), key=lambda g: (-costs[g], g))
    load = [0] * dp_size
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for g in order:
        r = min(range(dp_size), key=lambda k: (load[k], k))
        load[r] += costs[g]
        out[r].extend(groups[g])
    return [sorted(x) for x in out]
