"""Random rollout sets that share on purpose: a prompt per group and, with levels > 1, shared response beginnings.

The bench's rollouts (bench/runner.py), the examples' and the tests' (re-exported by megatron_branch.testing).
"""

from __future__ import annotations

import random

from megatron_branch.data.rollouts import Rollout
from megatron_branch.errors import UserError


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


def agentic_tree_rollouts(
    *,
    vocab_size: int = 37,
    prompt_len: int = 9,
    n: int = 4,
    turns: int = 3,
    turn_len: int = 4,
    observation_len: int = 3,
    branch_at_turns: tuple[int, ...] = (),
    branch_factor: int = 2,
    seed: int = 0,
) -> list[Rollout]:
    """An agentic tree (the shape `train`'s multi-turn sampler makes, generation/multi_turn.py): one prompt, each
    rollout `turns` policy turns of `turn_len` tokens (loss_mask 1) with an observation of `observation_len` tokens
    (loss_mask 0) after every turn but the last; after turn t in `branch_at_turns` (and its observation) every
    trajectory forks into `branch_factor` continuations. `n` leaves (n / branch_factor ** len(branch_at_turns)
    trajectories start at the prompt); siblings begin with distinct tokens, so the tree is exactly that."""
    rng = random.Random(seed)
    at = sorted(set(branch_at_turns))
    roots = n // branch_factor ** len(at)
    assert roots * branch_factor ** len(at) == n and all(0 < t < turns for t in at), (n, at, turns)
    assert max(roots, branch_factor) <= vocab_size, "siblings need distinct first tokens"

    def turn(t: int, first: int | None) -> tuple[list[int], list[bool]]:
        ids = [rng.randrange(vocab_size) for _ in range(turn_len)]
        if first is not None:
            ids[0] = first
        obs = [rng.randrange(vocab_size) for _ in range(observation_len if t < turns else 0)]
        return ids + obs, [True] * turn_len + [False] * len(obs)

    prompt = [rng.randrange(vocab_size) for _ in range(prompt_len)]
    frontier = [
        ([], [], f) for f in rng.sample(range(vocab_size), roots)
    ]  # (tokens, mask, first of next turn)
    for t in range(1, turns + 1):
        grown = []
        for ids, mask, first in frontier:
            more, more_mask = turn(t, first)
            grown.append((ids + more, mask + more_mask))
        if t in at:
            frontier = [
                (ids, mask, f) for ids, mask in grown for f in rng.sample(range(vocab_size), branch_factor)
            ]
        else:
            frontier = [(ids, mask, None) for ids, mask in grown]
    return [
        Rollout(prompt=prompt, response=ids, loss_mask=mask, advantage=rng.uniform(-1.5, 1.5))
        for ids, mask, _ in frontier
    ]


def check_turn_tree(
    *,
    turns: int,
    observation: int,
    branch_at_turns: tuple[int, ...],
    leaves: tuple[int, ...],
    leaves_flag: str,
) -> None:
    """The agentic tree description's rules (bench and plan: one home), in the flags' names; `leaves`: the G values
    (given as `leaves_flag`)."""
    at = list(branch_at_turns)
    if turns < 0 or observation < 0:
        raise UserError(f"--turns {turns} / --observation-length {observation} must be >= 0")
    if not turns:
        if observation or at:
            raise UserError("--observation-length and --branch-at-turns describe turns: give --turns")
        return
    if at != sorted(set(at)) or any(not 0 < k < turns for k in at):
        raise UserError(
            f"--branch-at-turns must be strictly increasing turns in (0, --turns {turns}), got {at}"
        )
    bad = [g for g in leaves if g % 2 ** len(at)]
    if bad:
        raise UserError(
            f"{leaves_flag} {bad[0]} must be divisible by 2 ** len(--branch-at-turns) = {2 ** len(at)}"
        )


def agentic_segments(
    *,
    prompt_len: int,
    n: int,
    turns: int,
    turn_len: int,
    observation_len: int,
    branch_at_turns: tuple[int, ...] = (),
    branch_factor: int = 2,
) -> list[tuple[int, int, int]]:
    """The levels of `agentic_tree_rollouts`' tree, root first: (start, length, width) = the level's segments begin
    after `start` tokens (their ancestors' keys), are `length` tokens long, and there are `width` of them. The
    prompt is one segment; each span between forks (turns and observations) one level, `branch_factor` x wider
    than the one above."""
    at = sorted(set(branch_at_turns))
    length = turns * turn_len + (turns - 1) * observation_len
    bounds = [0, *(t * (turn_len + observation_len) for t in at), length]
    levels, width = [(0, prompt_len, 1)], n // branch_factor ** len(at)
    for lo, hi in zip(bounds, bounds[1:]):
        levels.append((prompt_len + lo, hi - lo, width))
        width *= branch_factor
    return levels


def agentic_positions(
    *,
    prompt_len: int,
    n: int,
    turns: int,
    turn_len: int,
    observation_len: int,
    branch_at_turns: tuple[int, ...] = (),
    branch_factor: int = 2,
) -> tuple[int, int]:
    """(logical, computed) positions of `agentic_tree_rollouts`' tree, by counting: every leaf its whole sequence
    vs the prompt once plus each tree level's tokens once per branch at that level."""  # fmt: skip
    levels = agentic_segments(
        prompt_len=prompt_len, n=n, turns=turns, turn_len=turn_len, observation_len=observation_len,
        branch_at_turns=branch_at_turns, branch_factor=branch_factor,
    )  # fmt: skip
    length = turns * turn_len + (turns - 1) * observation_len
    return n * (prompt_len + length), sum(size * width for _, size, width in levels)
