"""Random rollout sets that share on purpose: a prompt per group and, with levels > 1, shared response beginnings.

The bench's rollouts (bench/runner.py), the examples' and the tests' (re-exported by megatron_branch.testing).
"""

from __future__ import annotations

import random

from megatron_branch.data.rollouts import Rollout


def random_tree_rollouts(
    *,
    vocab_size: int = 37,
    groups: int = 1,
    prompt_len: int = 9,
    branches: int = 4,
    levels: int = 1,
    seg_len: tuple[int, int] = (1, 5),
    seed: int = 0,
) -> list[Rollout]:
    """Rollouts sharing a prompt per group and, with levels > 1, shared response beginnings (a tree of depth
    `levels` below the prompt, `branches` children at the last level and 2 at inner levels)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab_size) for _ in range(n)]

    out: list[Rollout] = []
    for _ in range(groups):
        prompt = toks(prompt_len)
        frontier: list[list[int]] = [[]]
        for level in range(levels):
            fan = branches if level == levels - 1 else 2
            nxt = []
            for pre in frontier:
                firsts = rng.sample(range(vocab_size), fan)  # distinct first tokens: real branching
                for f in firsts:
                    nxt.append(pre + [f] + toks(rng.randint(*seg_len) - 1))
            frontier = nxt
        for resp in frontier:
            out.append(Rollout(prompt=prompt, response=resp, advantage=rng.uniform(-1.5, 1.5)))
    return out
