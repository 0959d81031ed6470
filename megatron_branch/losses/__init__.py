"""Log-probabilities over vocab-parallel logits and RL objectives defined on the logical batch.

config.py      the one objective config (verl's names) every objective is built from
registry.py    register_policy_loss / register_adv_est, build_objective, plugins (verl's registries)
objective.py   the interface every schedule calls, the update's hooks, and the linear policy gradient ("pg")
token.py       the base of per-token objectives (bind once, sum over (rollout, token) pairs)
pairs.py       the (rollout, token) pair index the per-token objectives share
aggregation.py the four loss-aggregation modes over the GLOBAL batch
policy.py      GRPO / PPO clipped surrogate, dual clip, KL (k1/k2/k3), entropy bonus ("vanilla", alias "grpo")
policy_modes.py verl's other loss modes natively: "gspo" (a sequence-level ratio), "cispo", "sapo", "geo_mean"
value.py       PPO's clipped value loss (the critic)
advantages.py  group-relative advantages (GRPO, Dr. GRPO) and GAE: estimators "grpo", "gae"
estimators.py  verl's outcome estimators: "rloo", "opo", "grpo_passk", "reinforce_plus_plus(_baseline)"
verl_estimators.py any other verl outcome estimator through verl's own function ("verl:<name>")
cov_modes.py   Clip-Cov and KL-Cov ("clip_cov", "kl_cov": a batch-wide covariance ranking of (rollout, token) pairs)
verl_loss.py   any verl policy loss through verl's own function ("verl:<loss_mode>", two passes)
dpo.py         DPO (sigmoid) and IPO on preference pairs ("dpo")

Importing this package registers every built-in objective and estimator (one import line each, below).
"""

from megatron_branch.losses.advantages import (
    AdvantageConfig,
    gae,
    group_advantages,
    with_gae,
    with_group_advantages,
)
from megatron_branch.losses.aggregation import AGG_MODES, Aggregation
from megatron_branch.losses.config import KL_ALIASES, ObjectiveConfig
from megatron_branch.losses.cov_modes import ClipCovObjective, KLCovObjective
from megatron_branch.losses.dpo import DPOObjective, preference_pairs
from megatron_branch.losses.estimators import (
    grpo_passk_advantages,
    opo_advantages,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from megatron_branch.losses.logprobs import reference_logprobs, vocab_parallel_logprobs
from megatron_branch.losses.objective import (
    AdvantagePolicyGradient,
    ObjectiveBase,
    PolicyGradientObjective,
    Prepared,
)
from megatron_branch.losses.policy import PolicyObjective, kl_penalty
from megatron_branch.losses.policy_modes import (
    CISPOObjective,
    GMPOObjective,
    GSPOObjective,
    SAPOObjective,
)
from megatron_branch.losses.registry import (
    build_objective,
    get_adv_estimator,
    load_plugins,
    objective_class,
    register_adv_est,
    register_policy_loss,
)
from megatron_branch.losses.token import TokenObjective
from megatron_branch.losses.value import ValueObjective
from megatron_branch.losses.verl_estimators import verl_estimator
from megatron_branch.losses.verl_loss import VerlPolicyLoss

__all__ = [
    "AGG_MODES",
    "AdvantageConfig",
    "AdvantagePolicyGradient",
    "CISPOObjective",
    "ClipCovObjective",
    "GMPOObjective",
    "GSPOObjective",
    "KLCovObjective",
    "SAPOObjective",
    "KL_ALIASES",
    "Aggregation",
    "DPOObjective",
    "ObjectiveBase",
    "ObjectiveConfig",
    "PolicyGradientObjective",
    "PolicyObjective",
    "Prepared",
    "TokenObjective",
    "ValueObjective",
    "VerlPolicyLoss",
    "build_objective",
    "gae",
    "grpo_passk_advantages",
    "opo_advantages",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "get_adv_estimator",
    "group_advantages",
    "kl_penalty",
    "load_plugins",
    "objective_class",
    "preference_pairs",
    "reference_logprobs",
    "register_adv_est",
    "register_policy_loss",
    "verl_estimator",
    "vocab_parallel_logprobs",
    "with_gae",
    "with_group_advantages",
]
