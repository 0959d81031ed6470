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


def test_gae_skips_context_tokens_as_verl_does() -> None:
    """With a loss_mask (tool tokens 0), GAE equals verl's compute_gae_advantage_return with that response_mask on
    the trained tokens (its returns, before verl whitens the advantages; float64 1e-12); without a mask it is
    unchanged (bit for bit)."""
    verl_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
    g = torch.Generator().manual_seed(4)
    n = 9
    r, v = torch.randn(n, generator=g, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64)
    mask = [True, True, False, False, False, True, True, False, True]
    adv, ret = gae(r, v, gamma=0.9, lam=0.8, mask=mask)
    want_adv, want_ret = verl_algos.compute_gae_advantage_return(
        r[None], v[None], torch.tensor(mask, dtype=torch.float64)[None], 0.9, 0.8
    )
    m = torch.tensor(mask)
    # verl then whitens its advantages over the batch (masked_whiten); its returns are the raw GAE + values
    torch.testing.assert_close(ret[m], want_ret[0][m], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(adv[m], (want_ret[0] - v)[m], rtol=1e-12, atol=1e-12)
    assert want_adv.shape == want_ret.shape
    plain, _ = gae(r, v, gamma=0.9, lam=0.8)
    assert not torch.allclose(plain[m], adv[m])  # the mask matters
    assert torch.equal(plain, gae(r, v, gamma=0.9, lam=0.8, mask=[True] * n)[0])
    rollout = Rollout(
        prompt=(1,), response=tuple(range(2, 2 + n)), loss_mask=mask,
        token_fields={"rewards": tuple(r.tolist()), "values": tuple(v.tolist())},
    )  # fmt: skip
    (out,) = with_gae([rollout], gamma=0.9, lam=0.8)
    assert out.field("advantages") == tuple(adv.tolist()) and out.loss_mask == tuple(mask)
