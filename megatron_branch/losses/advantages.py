"""Advantages: group-relative (GRPO, Dr. GRPO) from scalar rewards, and GAE (PPO) from per-token rewards and values.

GRPO (verl `compute_grpo_outcome_advantage`, TRL): within a group (the rollouts of one prompt),
    A_i = (r_i - mean_group) / (std_group + eps)          std the SAMPLE standard deviation (N - 1)
    A_i = r_i - mean_group                                 with norm_by_std=False (Dr. GRPO)
A group of one rollout, or one whose rewards are all equal, gets 0.

GAE (Schulman et al. 2016; verl `compute_gae_advantage_return`), per rollout over its response tokens t = 0..n-1:
    delta_t = r_t + gamma V_{t+1} - V_t      (V_n = 0)
    A_t = delta_t + gamma lambda A_{t+1},    R_t = A_t + V_t

Both are registered estimators (losses/registry.py, verl's `register_adv_est`): `grpo` groups by the prompt
instance (`index`, verl's uid), `gae` puts the outcome score on the last response token and needs the critic's
`values` (the loop scores them first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from megatron_branch.data import Rollout
from megatron_branch.errors import SettingError, UserError
from megatron_branch.losses.registry import register_adv_est


@dataclass(kw_only=True)
class AdvantageConfig:
    """What the advantage estimators read (verl's algorithm keys)."""

    norm_adv_by_std_in_grpo: bool = True
    """GRPO: divide by the group's standard deviation (False = Dr. GRPO)."""
    gamma: float = 1.0
    """GAE discount."""
    lam: float = 1.0
    """GAE lambda."""

    def __post_init__(self) -> None:
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if not 0 <= v <= 1:
                raise SettingError(lambda s, n=name, v=v: f"{s.name(n)} must be in [0, 1], got {v}")


def prompt_groups(rollouts: Sequence[Rollout]) -> list[list[int]]:
    """Rollout indices grouped by identical prompt, in first-appearance order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, r in enumerate(rollouts):
        groups.setdefault(r.prompt, []).append(i)
    return list(groups.values())


def group_advantages(
    rewards: Sequence[float],
    groups: Sequence[Sequence[int]] | Sequence[Hashable],
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> list[float]:
    """GRPO advantages of `rewards`; `groups` is either a list of index lists or one group key per reward."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    if groups and not isinstance(groups[0], (list, tuple)):
        keyed: dict[Hashable, list[int]] = {}
        for i, key in enumerate(groups):
            keyed.setdefault(key, []).append(i)
        index_groups = list(keyed.values())
    else:
        index_groups = [list(g) for g in groups]  # type: ignore[arg-type]
    if sorted(i for g in index_groups for i in g) != list(range(len(r))):
        raise ValueError("groups must cover every reward exactly once")
    adv = torch.zeros_like(r)
    for g in index_groups:
        x = r[g]
        if len(g) < 2 or bool((x == x[0]).all()):
            continue  # nothing to compare against: no signal
        centred = x - x.mean()
        adv[g] = centred / (x.std(unbiased=True) + eps) if norm_by_std else centred
    return adv.tolist()


def with_group_advantages(
    rollouts: Sequence[Rollout], rewards: Sequence[float], *, norm_by_std: bool = True, eps: float = 1e-6
) -> list[Rollout]:
    """`rollouts` with `advantage` set from their scalar `rewards`, grouped by prompt."""
    adv = group_advantages(rewards, prompt_groups(rollouts), norm_by_std=norm_by_std, eps=eps)
    return [dataclasses.replace(r, advantage=a) for r, a in zip(rollouts, adv)]


def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    mask: Sequence[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages [n], returns [n]) of one rollout from per-token rewards [n] and values [n].

    `mask` (the rollout's loss_mask; None = all trained): as verl's `compute_gae_advantage_return`, a context token
    (a tool's output) is skipped: the recursion carries the next trained token's value and advantage across it."""
    assert rewards.shape == values.shape and rewards.dim() == 1
    adv = torch.zeros_like(rewards, dtype=torch.float64)
    last = next_v = 0.0
    for t in range(rewards.numel() - 1, -1, -1):
        delta = float(rewards[t]) + gamma * next_v - float(values[t])
        if mask is None or mask[t]:
            next_v, last = float(values[t]), delta + gamma * lam * last
        adv[t] = last
    return adv, adv + values.to(torch.float64)


def with_gae(rollouts: Sequence[Rollout], *, gamma: float = 1.0, lam: float = 1.0) -> list[Rollout]:
    """`rollouts` with per-token `advantages` and `returns` from their `rewards` and `values` fields."""
    out = []
    for i, r in enumerate(rollouts):
        rew, val = r.field("rewards"), r.field("values")
        if rew is None or val is None:
            missing = "rewards" if rew is None else "values"
            raise UserError(
                f"missing field {missing!r} (one per response token) for GAE", where=r.describe(i)
            )
        adv, ret = gae(
            torch.tensor(rew, dtype=torch.float64),
            torch.tensor(val, dtype=torch.float64),
            gamma=gamma,
            lam=lam,
            mask=r.loss_mask,
        )
        fields = {**r.token_fields, "advantages": tuple(adv.tolist()), "returns": tuple(ret.tolist())}
        out.append(dataclasses.replace(r, token_fields=fields))
    return out


@register_adv_est("grpo", group_relative=True)
def grpo_advantages(
    rollouts: Sequence[Rollout], rewards: Sequence[float], index: Sequence[Hashable], cfg: AdvantageConfig
) -> list[Rollout]:
    """Group-relative advantages over the rollouts of each prompt instance (`index`)."""
    adv = group_advantages(rewards, list(index), norm_by_std=cfg.norm_adv_by_std_in_grpo)
    return [dataclasses.replace(r, advantage=a) for r, a in zip(rollouts, adv)]


@register_adv_est("gae", needs_values=True)
def gae_advantages(
    rollouts: Sequence[Rollout], rewards: Sequence[float], index: Sequence[Hashable], cfg: AdvantageConfig
) -> list[Rollout]:
    """PPO: the outcome score on the last response token, the critic's `values`, GAE per rollout."""
    scored = [
        dataclasses.replace(
            r, token_fields={**r.token_fields, "rewards": (0.0,) * (len(r.response) - 1) + (float(s),)}
        )
        for r, s in zip(rollouts, rewards)
    ]
    return with_gae(scored, gamma=cfg.gamma, lam=cfg.lam)
