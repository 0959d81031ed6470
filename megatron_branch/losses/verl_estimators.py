"""Any verl outcome advantage estimator through verl's own function: `algorithm.adv_estimator: verl:<name>`.

Shape legend: R rollouts of the batch, W its longest response.

verl 0.9.1's estimators (`core_algos.get_adv_estimator_fn`) read the outcome score on the last response token
(`token_level_rewards` [R, W]), the response mask and the prompt instance of each rollout (`index`, verl's uid), as
verl's trainer passes them (`ray_trainer.compute_advantage`); the per-token advantages they return become each
rollout's `advantages` field. Estimators that read more than that are refused in one line: `gae` (the critic's
values: use the native `gae`), `remax` (a greedy rollout's reward per prompt, which the sampler does not produce),
`gdpo` (several reward dimensions), `optimal_token_baseline` / `tir_optimal_token_baseline` (the actor's
sum_pi_squared).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from megatron_branch.data import Rollout
from megatron_branch.errors import SettingError
from megatron_branch.losses.registry import AdvantageEstimator, register_adv_family

PREFIX = "verl:"
NEEDS_MORE = {
    "gae": "the critic's values (use the native gae)",
    "remax": "a greedy rollout's reward per prompt, which the sampler does not produce",
    "gdpo": "several reward dimensions",
    "optimal_token_baseline": "the actor's sum_pi_squared",
    "tir_optimal_token_baseline": "the actor's sum_pi_squared",
}
"""verl estimators that read more than the outcome scores, the mask and the uid: why each is refused."""


def _verl_fn(member: str) -> Any:
    name = PREFIX + member
    try:
        from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, get_adv_estimator_fn
    except ImportError:
        raise SettingError(
            lambda s: (
                f"{s.value('adv_estimator', name)} needs verl, which is not installed (make setup-verl; docs/verl.md)"
            )
        ) from None
    if member in NEEDS_MORE:
        raise SettingError(lambda s: f"{s.value('adv_estimator', name)} needs {NEEDS_MORE[member]}")
    if member not in ADV_ESTIMATOR_REGISTRY:
        known = ", ".join(sorted(k for k in ADV_ESTIMATOR_REGISTRY if k not in NEEDS_MORE))
        raise SettingError(
            lambda s: f"unknown {s.name('adv_estimator')} {name!r}; verl's usable here: {known}"
        )
    return get_adv_estimator_fn(member)


@register_adv_family(PREFIX)
def verl_estimator(member: str) -> AdvantageEstimator:
    """The estimator "verl:<member>" (checked now: before any work)."""
    fn = _verl_fn(member)

    def compute(
        rollouts: Sequence[Rollout], rewards: Sequence[float], index: Sequence[Hashable], cfg: Any
    ) -> list[Rollout]:
        import numpy as np
        from verl.trainer.config import AlgoConfig

        width = max(len(r.response) for r in rollouts)
        mask = torch.zeros(len(rollouts), width, dtype=torch.float64)  # [R, W]
        scores = torch.zeros_like(mask)
        for i, (r, s) in enumerate(zip(rollouts, rewards)):
            mask[i, : len(r.response)] = 1.0
            scores[i, len(r.response) - 1] = float(s)  # the outcome on the last response token
        algo = AlgoConfig(gamma=cfg.gamma, lam=cfg.lam, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo)
        uid = np.array([str(k) for k in index], dtype=object)
        adv, _ = fn(token_level_rewards=scores, response_mask=mask, index=uid, config=algo)
        return [
            dataclasses.replace(
                r,
                token_fields={**r.token_fields, "advantages": tuple(adv[i, : len(r.response)].tolist())},
            )
            for i, r in enumerate(rollouts)
        ]

    return AdvantageEstimator(name=PREFIX + member, compute=compute, group_relative=True)
