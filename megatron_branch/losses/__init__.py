"""Log-probabilities over vocab-parallel logits and RL objectives defined on the logical batch."""

from megatron_branch.losses.logprobs import reference_logprobs, vocab_parallel_logprobs
from megatron_branch.losses.objective import PolicyGradientObjective

__all__ = ["PolicyGradientObjective", "reference_logprobs", "vocab_parallel_logprobs"]
