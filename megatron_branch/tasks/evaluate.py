"""Held-out evaluation of a policy on prompt rows: greedy (or sampled) responses scored by the reward.

Used to decide when a supervised warm-up has done its job (the demo warms up until the greedy reward on held-out
prompts crosses a threshold, so that RL starts with room to improve) and to report held-out reward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_branch.tasks.dataset import PromptRow
from megatron_branch.tasks.reward import RewardFn, score_responses
from megatron_branch.tokenizer.protocol import Tokenizer

if TYPE_CHECKING:  # the generation package imports megatron-core; reading prompts and rewards should not
    from megatron_branch.generation.types import Generator


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    reward_mean: float
    """Mean reward over all responses."""
    exact: float
    """Fraction of responses whose stripped text equals the row's "answer" (0 when rows have no answer)."""
    responses: tuple[str, ...]
    """The decoded responses, prompt-major (n per row)."""


def evaluate(
    generator: Generator,
    tokenizer: Tokenizer,
    rows: Sequence[PromptRow],
    reward: RewardFn,
    *,
    max_new_tokens: int,
    n: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
) -> EvalResult:
    """Generate `n` responses per row (greedy by default, stopping at eos), decode, score."""
    from megatron_branch.generation.types import SamplingParams

    params = SamplingParams(
        n=n, max_new_tokens=max_new_tokens, temperature=temperature, stop_token_ids=(tokenizer.eos_id,)
    )
    gen = None if params.greedy else torch.Generator().manual_seed(seed)
    out = generator.generate([tokenizer.encode(r.prompt) for r in rows], params, generator=gen)
    texts = [tokenizer.decode(s.response) for s in out.flat()]
    per_row = [r for r in rows for _ in range(n)]
    rewards = score_responses(reward, per_row, texts)
    exact = [("answer" in r.fields and t.strip() == str(r.fields["answer"])) for r, t in zip(per_row, texts)]
    return EvalResult(
        reward_mean=sum(rewards) / len(rewards), exact=sum(exact) / len(exact), responses=tuple(texts)
    )
