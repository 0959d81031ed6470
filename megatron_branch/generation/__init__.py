"""Rollout generation: sampling from the policy with each prompt prefilled once and its branches decoded together
against the prompt's cached K/V (see docs/generation.md)."""

from megatron_branch.generation.multi_turn import Environment, EnvStep, MultiTurnParams
from megatron_branch.generation.sampler import BranchSampler
from megatron_branch.generation.sampling import choose_tokens, sampling_logits
from megatron_branch.generation.types import (
    GenerationOutput,
    GenerationStats,
    Generator,
    Sample,
    SamplingParams,
)

__all__ = [
    "BranchSampler",
    "EnvStep",
    "Environment",
    "MultiTurnParams",
    "GenerationOutput",
    "GenerationStats",
    "Generator",
    "Sample",
    "SamplingParams",
    "choose_tokens",
    "sampling_logits",
]
