"""The algorithm of a run, resolved once from the config: its objective, its advantage estimator, its data.

    algo = resolve_algorithm(cfg)      # imports algorithm.plugins, looks every name up in the registries

`algorithm.name` picks a recipe (the switch lives here and nowhere else; the loop, the data, the actor and the
config's checks ask `algo`):

    grpo   prompts sampled rollout.n times, group-relative advantages (estimator grpo), the clipped surrogate
    ppo    the same with GAE on a critic's values (estimator gae: it needs values, so a critic is trained)
    dpo    offline preference pairs (data.pairs_file; no sampling, no advantages), the dpo objective

`actor.policy_loss` and `algorithm.adv_estimator` replace the recipe's choices with any registered name
(losses/registry.py), a plugin's included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_branch.errors import SettingError
from megatron_branch.losses.advantages import AdvantageConfig
from megatron_branch.losses.registry import (
    AdvantageEstimator,
    get_adv_estimator,
    load_plugins,
    objective_class,
)

RECIPES: dict[str, tuple[str, str | None]] = {
    "grpo": ("vanilla", "grpo"),
    "ppo": ("vanilla", "gae"),
    "dpo": ("dpo", None),
}
"""algorithm.name -> (policy loss, advantage estimator; None = offline preference pairs)."""


@dataclass(kw_only=True)
class AlgorithmConfig(AdvantageConfig):
    """Which algorithm trains the policy (a recipe: objective, advantage estimator, data), and the estimators'
    settings (losses/advantages.py). Resolved once: train/algorithm.py."""

    name: Literal["grpo", "ppo", "dpo"] = "grpo"
    """grpo: group-relative advantages; ppo: critic + GAE; dpo: offline preference pairs (no sampling)."""
    adv_estimator: str | None = None
    """A registered advantage estimator (grpo, gae, or a plugin's); None = the algorithm's (grpo: grpo, ppo: gae).
    One that needs values trains a critic."""
    plugins: list[str] = field(default_factory=list)
    """Modules imported before any name is looked up (a dotted module or a .py file): they register their own
    objectives (@register_policy_loss, for actor.policy_loss) and estimators (@register_adv_est)."""


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """What the loop needs to know about the algorithm."""

    name: str
    """algorithm.name (the recipe)."""
    objective: Any
    """The actor's ObjectiveConfig with its policy_loss resolved (build_objective's input)."""
    estimator: AdvantageEstimator | None
    """None: offline preference pairs, nothing sampled, no advantages (DPO)."""
    requires_reference: bool
    """The objective reads ref_logprobs: a frozen copy of the initial policy scores them."""

    @property
    def offline(self) -> bool:
        """Trains on preference pairs read from data.pairs_file instead of sampled rollouts."""
        return self.estimator is None

    @property
    def trains_critic(self) -> bool:
        """The estimator reads a critic's values, so a critic is trained alongside (PPO)."""
        return self.estimator is not None and self.estimator.needs_values


def resolve_algorithm(cfg: Any) -> Algorithm:
    """The run's algorithm (plugins imported first). A SettingError (config spelling: train.validate.SPELLING)
    for an unknown name or a setting the recipe would ignore."""
    al = cfg.algorithm
    load_plugins(al.plugins)
    loss, est_name = RECIPES[al.name]
    if est_name is None and al.adv_estimator is not None:
        raise SettingError(
            lambda s: (
                f"{s.name('adv_estimator')} does nothing with {s.value('algorithm', al.name)} (offline "
                "preference pairs have no advantages)"
            )
        )
    policy_loss = cfg.actor.policy_loss or loss
    cls = objective_class(policy_loss)
    estimator = get_adv_estimator(al.adv_estimator or est_name) if est_name is not None else None
    return Algorithm(
        name=al.name,
        objective=dataclasses.replace(cfg.actor, policy_loss=policy_loss),
        estimator=estimator,
        requires_reference=cls.requires_reference(cfg.actor),
    )
