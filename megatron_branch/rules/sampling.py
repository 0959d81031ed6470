"""The sampler's rules: how tree sampling forks (inside the response at token counts, or after finished turns of
a multi-turn rollout) and what independent rollouts (no shared prefix) refuse. Each field is valid on its own
(generation/types.py SamplingParams, generation/multi_turn.py MultiTurnParams); these are the rules between them.

The rules are listed in the package doc (megatron_branch/rules/__init__.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_branch.errors import SettingError


def check_sampling(
    *,
    n: int,
    max_new_tokens: int,
    branch_at: Sequence[int],
    branch_factor: int,
    share_prefix: bool,
    branch_at_turns: Sequence[int] = (),
) -> None:
    """The rules between sampling settings (see the module doc), each field valid on its own (SamplingParams):
    tree sampling (`branch_at`, or a multi-turn rollout's `branch_at_turns`) needs prefix sharing, forks inside
    the response and ends with n leaves."""
    at, turns = list(branch_at), list(branch_at_turns)
    if at and turns:
        raise SettingError(
            lambda s: (
                f"{s.name('branch_at')} and {s.name('branch_at_turns')} both fork rollouts: use one or the other"
            )
        )
    forks, key, shared = (
        (turns, "branch_at_turns", "earlier turns") if turns else (at, "branch_at", "a response start")
    )
    if not share_prefix and forks:
        raise SettingError(
            lambda s: (
                f"{s.value('share_prefix', 'false')} samples every rollout on its own (its own prefill); "
                f"{s.name(key)} forks rollouts that share {shared}: use one or the other"
            )
        )
    if at != sorted(set(at)) or any(not 0 < k < max_new_tokens for k in at):
        raise SettingError(
            lambda s: (
                f"{s.name('branch_at')} must be strictly increasing token counts in (0, "
                f"{s.value('max_new_tokens', max_new_tokens)}), got {at}"
            )
        )  # branch_at_turns' own rule: check_multi_turn
    if n % branch_factor ** len(forks):
        raise SettingError(
            lambda s: (
                f"{s.value('n', n)} must be divisible by {s.name('branch_factor')} ** len({s.name(key)}) = "
                f"{branch_factor ** len(forks)}"
            )
        )


def check_multi_turn(
    *, turn_end_token_ids: Sequence[int], branch_at_turns: Sequence[int], max_assistant_turns: int | None
) -> None:
    """The turn loop's own rules (generation/multi_turn.py MultiTurnParams): a turn-end token to stop a policy
    turn at, forks after finished turns (increasing, >= 1, before the last turn allowed)."""
    ends, at = list(turn_end_token_ids), list(branch_at_turns)
    if not ends or any(t < 0 for t in ends):
        raise SettingError(
            lambda s: f"{s.name('turn_end')} must name at least one token that ends a policy turn, got {ends}"
        )
    limit = max_assistant_turns
    if at != sorted(set(at)) or any(t < 1 or (limit is not None and t >= limit) for t in at):
        raise SettingError(
            lambda s: (
                f"{s.name('branch_at_turns')} must be strictly increasing turn counts >= 1"
                + ("" if limit is None else f" below {s.value('max_assistant_turns', limit)}")
                + f", got {at}"
            )
        )
