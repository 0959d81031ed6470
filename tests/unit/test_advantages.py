"""Group-relative advantages and GAE against formulas written out by hand."""

from __future__ import annotations

import pytest
import torch

from megatron_branch.data import Rollout
from megatron_branch.errors import UserError
from megatron_branch.losses.advantages import gae, group_advantages, with_gae, with_group_advantages


def test_group_advantages_sample_std_and_degenerate_groups() -> None:
    adv = group_advantages([1.0, 2.0, 3.0, 5.0, 5.0, 7.0], ["a", "a", "a", "b", "b", "c"])
    # group a: mean 2, sample std 1; group b: all equal -> 0; group c: one rollout -> 0
    assert adv == pytest.approx([-1 / (1 + 1e-6), 0.0, 1 / (1 + 1e-6), 0.0, 0.0, 0.0], abs=1e-15)
    dr = group_advantages([1.0, 2.0, 6.0], [[0, 1, 2]], norm_by_std=False)
    assert dr == pytest.approx([-2.0, -1.0, 3.0], abs=1e-15)
    with pytest.raises(ValueError, match="cover every reward"):
        group_advantages([1.0, 2.0], [[0]])


def test_with_group_advantages_groups_by_prompt() -> None:
    rs = [Rollout(prompt=p, response=(1,)) for p in [(1,), (2,), (1,), (2,)]]
    out = with_group_advantages(rs, [0.0, 1.0, 2.0, 1.0])
    s = torch.tensor([0.0, 2.0]).std().item()
    assert [r.advantage for r in out] == pytest.approx([-1 / (s + 1e-6), 0.0, 1 / (s + 1e-6), 0.0])


def test_gae_matches_the_discounted_sum_of_deltas() -> None:
    r = torch.tensor([0.5, -1.0, 0.0, 2.0], dtype=torch.float64)
    v = torch.tensor([0.1, 0.4, -0.3, 0.2], dtype=torch.float64)
    gamma, lam = 0.9, 0.8
    nxt = [0.4, -0.3, 0.2, 0.0]
    delta = [r[t].item() + gamma * nxt[t] - v[t].item() for t in range(4)]
    want = [sum((gamma * lam) ** k * delta[t + k] for k in range(4 - t)) for t in range(4)]
    adv, ret = gae(r, v, gamma=gamma, lam=lam)
    assert adv.tolist() == pytest.approx(want, abs=1e-14)
    assert ret.tolist() == pytest.approx([want[t] + v[t].item() for t in range(4)], abs=1e-14)
    adv1, _ = gae(r, v)  # gamma = lam = 1: reward-to-go minus the value
    assert adv1.tolist() == pytest.approx([r[t:].sum().item() - v[t].item() for t in range(4)], abs=1e-14)


def test_with_gae_needs_rewards_and_values() -> None:
    ok = Rollout(prompt=(1,), response=(2, 3), token_fields={"rewards": (0.0, 1.0), "values": (0.5, 0.5)})
    (out,) = with_gae([ok], gamma=1.0, lam=1.0)
    assert out.field("advantages") == pytest.approx((0.5, 0.5)) and out.field("returns") == pytest.approx(
        (1.0, 1.0)
    )
    with pytest.raises(UserError, match="r.jsonl:3: missing field 'values'"):
        with_gae([Rollout(prompt=(1,), response=(2,), token_fields={"rewards": (1.0,)}, where="r.jsonl:3")])
