"""Log-probabilities over vocab-parallel logits and RL objectives defined on the logical batch.

objective.py   the interface every schedule calls, and the linear policy gradient
pairs.py       the (rollout, token) pair index the per-token objectives share
aggregation.py the four loss-aggregation modes over the GLOBAL batch
policy.py      GRPO / PPO clipped surrogate, dual clip, KL (k1/k2/k3), entropy bonus
value.py       PPO's clipped value loss (the critic)
advantages.py  group-relative advantages (GRPO, Dr. GRPO) and GAE
dpo.py         DPO (sigmoid) and IPO on preference pairs
"""

from megatron_branch.losses.advantages import gae, group_advantages, with_gae, with_group_advantages
from megatron_branch.losses.aggregation import AGG_MODES, Aggregation
from megatron_branch.losses.dpo import DPOObjective, preference_pairs
from megatron_branch.losses.logprobs import reference_logprobs, vocab_parallel_logprobs
from megatron_branch.losses.objective import AdvantagePolicyGradient, PolicyGradientObjective
from megatron_branch.losses.policy import KL_ALIASES, PolicyObjective, kl_penalty
from megatron_branch.losses.value import ValueObjective

__all__ = [
    "AGG_MODES",
    "AdvantagePolicyGradient",
    "KL_ALIASES",
    "Aggregation",
    "DPOObjective",
    "PolicyGradientObjective",
    "PolicyObjective",
    "ValueObjective",
    "gae",
    "group_advantages",
    "kl_penalty",
    "preference_pairs",
    "reference_logprobs",
    "vocab_parallel_logprobs",
    "with_gae",
    "with_group_advantages",
]
