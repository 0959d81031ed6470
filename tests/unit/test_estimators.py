"""verl's outcome estimators, native (losses/estimators.py), against verl 0.9.1's own functions on the same batch
(float64, 1e-12): groups of different sizes (one of a single rollout where verl allows it), responses of different
lengths, ties and an all-equal group."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from megatron_branch.data import Rollout
from megatron_branch.errors import UserError
from megatron_branch.losses.advantages import AdvantageConfig
from megatron_branch.losses.registry import get_adv_estimator

NATIVE = ["rloo", "opo", "grpo_passk", "reinforce_plus_plus", "reinforce_plus_plus_baseline"]


def batch(seed: int, *, singleton: bool) -> tuple[list[Rollout], list[float], list[str]]:
    rng = random.Random(seed)
    sizes = [4, 3, 5] + ([1] if singleton else [])
    rollouts, rewards, index = [], [], []
    for g, n in enumerate(sizes):
        for _ in range(n):
            rollouts.append(Rollout(prompt=(g + 1,), response=tuple(range(rng.randint(1, 6)))))
            rewards.append(rng.uniform(0, 1) if g else 1.0)  # group 0: all equal
            index.append(f"uid{g}")
    rewards[5] = rewards[6] = 2.0  # a tie at the top of group 1
    return rollouts, rewards, index


def verl_advantages(
    name: str, rollouts: list[Rollout], rewards: list[float], index: list[str], cfg
) -> torch.Tensor:  # noqa: ANN001
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    width = max(len(r.response) for r in rollouts)
    mask = torch.zeros(len(rollouts), width, dtype=torch.float64)
    scores = torch.zeros_like(mask)
    for i, (r, s) in enumerate(zip(rollouts, rewards)):
        mask[i, : len(r.response)] = 1.0
        scores[i, len(r.response) - 1] = s  # the outcome on the last response token
    algo = AlgoConfig(gamma=cfg.gamma, norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo)
    adv, _ = get_adv_estimator_fn(name)(
        token_level_rewards=scores, response_mask=mask, index=np.array(index, dtype=object), config=algo
    )
    return adv


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("name", NATIVE)
def test_native_estimator_equals_verls_function(name: str, norm: bool) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    cfg = AdvantageConfig(gamma=0.9, norm_adv_by_std_in_grpo=norm)
    rollouts, rewards, index = batch(3, singleton=name != "grpo_passk")
    want = verl_advantages(name, rollouts, rewards, index, cfg)
    got = get_adv_estimator(name).compute(rollouts, rewards, index, cfg)
    for i, r in enumerate(got):
        n = len(r.response)
        f64 = torch.float64
        mine = (
            torch.tensor(r.field("advantages"), dtype=f64)
            if r.advantage is None
            else torch.full((n,), r.advantage, dtype=f64)
        )
        assert mine.to(torch.float64).tolist() == pytest.approx(want[i, :n].tolist(), rel=1e-12, abs=1e-12), i
    assert any(r.advantage != 0 or r.field("advantages") for r in got)


def test_grpo_passk_refuses_a_group_of_one() -> None:
    rollouts, rewards, index = batch(3, singleton=True)
    with pytest.raises(UserError, match="grpo_passk needs at least 2 rollouts per prompt, got 1"):
        get_adv_estimator("grpo_passk").compute(rollouts, rewards, index, AdvantageConfig())


@pytest.mark.parametrize("name", ["rloo", "opo", "grpo_passk", "reinforce_plus_plus_baseline"])
def test_verl_family_equals_native(name: str) -> None:
    """`verl:<name>` (verl's own function, our layout) equals the native estimator, token by token."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    cfg = AdvantageConfig(gamma=0.9)
    rollouts, rewards, index = batch(4, singleton=name != "grpo_passk")
    via_verl = get_adv_estimator(f"verl:{name}").compute(rollouts, rewards, index, cfg)
    native = get_adv_estimator(name).compute(rollouts, rewards, index, cfg)
    for a, b in zip(via_verl, native):
        want = b.field("advantages") or (b.advantage,) * len(b.response)
        assert a.field("advantages") == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_verl_family_runs_verls_other_estimators_and_refuses_what_it_cannot_feed() -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    cfg = AdvantageConfig()
    rollouts, rewards, index = batch(5, singleton=False)
    want = verl_advantages("gpg", rollouts, rewards, index, cfg)
    got = get_adv_estimator("verl:gpg").compute(rollouts, rewards, index, cfg)
    for i, r in enumerate(got):
        assert r.field("advantages") == pytest.approx(
            want[i, : len(r.response)].tolist(), rel=1e-12, abs=1e-12
        )
    with pytest.raises(
        UserError, match="^--adv-estimator verl:remax needs a greedy rollout's reward per prompt"
    ):
        get_adv_estimator("verl:remax")
    with pytest.raises(UserError, match="^unknown --adv-estimator 'verl:nope'; verl's usable here: .*gpg"):
        get_adv_estimator("verl:nope")


def test_train_resolves_verl_estimators_before_any_work() -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    from pathlib import Path

    from megatron_branch.train.algorithm import resolve_algorithm
    from megatron_branch.train.config_io import load_config

    demo = str(Path(__file__).resolve().parents[2] / "examples" / "configs" / "demo.yaml")
    assert (
        resolve_algorithm(load_config(demo, ["algorithm.adv_estimator=verl:gpg"])).estimator.name
        == "verl:gpg"
    )
    with pytest.raises(UserError, match="algorithm.adv_estimator=verl:remax needs"):
        resolve_algorithm(load_config(demo, ["algorithm.adv_estimator=verl:remax"]))
