"""verl's outcome advantage estimators, natively: rloo, opo, grpo_passk, reinforce_plus_plus(_baseline).

Each takes one scalar reward r_i per rollout and the prompt instance of each (`index`, verl's uid: a group is the
rollouts sampled from one prompt), as verl 0.9.1's `core_algos.compute_*_outcome_advantage` do with the score on
the last response token. |o_i| = len(response_i), n = the group's size, mean/std over the group:

    rloo                         A_i = n/(n-1) (r_i - mean)  (the leave-one-out baseline); n = 1: A_i = r_i
    opo                          A_i = r_i - sum_j |o_j| r_j / sum_j |o_j|  (length-weighted baseline); n = 1: r_i
    grpo_passk                   the group's best rollout: (r_max - r_second) / (std + 1e-6) (std: unbiased; not
                                 divided with norm_adv_by_std_in_grpo false), every other 0; n >= 2
    reinforce_plus_plus          G_{i,t} = gamma^(|o_i|-1-t) r_i per token, whitened over the WHOLE batch's tokens
    reinforce_plus_plus_baseline r_i - mean, whitened over the whole batch's tokens (each rollout counted |o_i|
                                 times): one value per rollout

Whitening is verl's masked_whiten: (x - mu) / sqrt(var + 1e-8), mu and the unbiased var over every response token
of the batch (verl's masked means divide by count + 1e-8; so do these, to agree to the last digits). The batch is
the logical one: a rollout's tokens count once per rollout, whatever the tree shares.

remax is not native: it needs the reward of a greedy rollout per prompt (verl's reward_baselines), which the
sampler does not produce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence

import torch

from megatron_branch.data import Rollout
from megatron_branch.errors import UserError
from megatron_branch.losses.advantages import AdvantageConfig
from megatron_branch.losses.registry import register_adv_est

EPS = 1e-6
"""verl's epsilon of the group std."""


def _groups(index: Sequence[Hashable]) -> list[list[int]]:
    """Rollout indices per prompt instance, in first-appearance order."""
    out: dict[Hashable, list[int]] = {}
    for i, key in enumerate(index):
        out.setdefault(key, []).append(i)
    return list(out.values())


def _per_group(
    rewards: Sequence[float], index: Sequence[Hashable], fn: Callable[[torch.Tensor, list[int]], torch.Tensor]
) -> torch.Tensor:
    """[N] float64: fn(r_g, g) for every group g of two or more rollouts (r_g: its rewards), r_i for a group of one
    (verl's estimators leave a lone rollout's score as it is)."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    out = r.clone()
    for g in _groups(index):
        if len(g) > 1:
            out[g] = fn(r[g], g)
    return out


def _scalar(rollouts: Sequence[Rollout], adv: torch.Tensor) -> list[Rollout]:
    return [dataclasses.replace(r, advantage=float(a)) for r, a in zip(rollouts, adv)]


def _mean(x: torch.Tensor, count: float) -> torch.Tensor:
    return x.sum() / (count + 1e-8)  # verl_F.masked_mean's denominator


def _whiten_stats(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, 1/sqrt(var + 1e-8)) over every token of `values` (one [|o_i|] tensor per rollout): masked_whiten's."""
    flat = torch.cat(values)
    n = float(flat.numel())
    if n < 2:
        raise UserError("whitening the advantages needs at least two response tokens in the batch")
    mu = _mean(flat, n)
    var = _mean((flat - mu).square(), n) * (n / (n - 1))
    return mu, torch.rsqrt(var + 1e-8)


@register_adv_est("rloo", group_relative=True)
def rloo_advantages(
    rollouts: Sequence[Rollout], rewards: Sequence[float], index: Sequence[Hashable], cfg: AdvantageConfig
) -> list[Rollout]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): the baseline of rollout i is the mean of the others."""

    def loo(r: torch.Tensor, g: list[int]) -> torch.Tensor:
        n = len(g)
        return r * n / (n - 1) - r.mean() * n / (n - 1)  # verl's order of operations (the last digits agree)

    return _scalar(rollouts, _per_group(rewards, index, loo))


@register_adv_est("opo", group_relative=True)
def opo_advantages(
    rollouts: Sequence[Rollout], rewards: Sequence[float], index: Sequence[Hashable], cfg: AdvantageConfig
) -> list[Rollout]:
    """On-policy RL with the optimal (length-weighted) reward baseline (Hao et al. 2025)."""
    length = torch.tensor([float(len(x.response)) for x in rollouts], dtype=torch.float64)
    adv = _per_group(rewards, index, lambda r, g: r - (length[g] * r).sum() / length[g].sum())
    return _scalar(rollouts, adv)


@register_adv_est("grpo_passk", group_relative=True)
def grpo_passk_advantages(
    rollouts: Sequence[Rollout], rewards: Sequence[float], index: Sequence[Hashable], cfg: AdvantageConfig
) -> list[Rollout]:
    """Pass@k training (Chen et al. 2025): only each group's best rollout is credited, by its lead on the next."""
    r = torch.tensor(list(rewards), dtype=torch.float64)
    adv = torch.zeros_like(r)
    for g in _groups(index):
        if len(g) < 2:
            raise UserError(f"grpo_passk needs at least 2 rollouts per prompt, got {len(g)} (rollout.n)")
        top, at = torch.topk(r[g], 2)
        lead = top[0] - top[1]
        adv[g[int(at[0])]] = lead / (r[g].std() + EPS) if cfg.norm_adv_by_std_in_grpo else lead
    return _scalar(rollouts, adv)


@register_adv_est("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
    rollouts: Sequence[Rollout], rewards: Sequence[float], index: Sequence[Hashable], cfg: AdvantageConfig
) -> list[Rollout]:
    """REINFORCE++ (Hu 2025): discounted returns of the outcome reward, whitened over the batch (per token)."""
    returns = [
        float(s) * cfg.gamma ** torch.arange(len(r.response) - 1, -1, -1, dtype=torch.float64)
        for r, s in zip(rollouts, rewards)
    ]  # [|o_i|] each: the reward sits on the last response token
    mu, inv = _whiten_stats(returns)
    out = []
    for r, g in zip(rollouts, returns):
        fields = {**r.token_fields, "advantages": tuple(((g - mu) * inv).tolist())}
        out.append(dataclasses.replace(r, token_fields=fields))
    return out


@register_adv_est("reinforce_plus_plus_baseline", group_relative=True)
def reinforce_plus_plus_baseline_advantages(
    rollouts: Sequence[Rollout], rewards: Sequence[float], index: Sequence[Hashable], cfg: AdvantageConfig
) -> list[Rollout]:
    """REINFORCE++ with the group mean as baseline, whitened over the batch's tokens."""
    centred = _per_group(rewards, index, lambda r, g: r - r.mean())
    per_token = [centred[i].expand(len(x.response)) for i, x in enumerate(rollouts)]
    mu, inv = _whiten_stats(per_token)
    return _scalar(rollouts, (centred - mu) * inv)
