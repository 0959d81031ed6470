"""Clip-Cov and KL-Cov (losses/cov_modes.py): the selection is a ranking of the logical batch's (rollout, token)
pairs, so on the unshared batch it equals verl 0.9.1's own functions (same global generator state for clip_cov's
draw), and naive, packed and replay agree to 1e-9 although a shared token is selected for one rollout and not for
another (asserted)."""

from __future__ import annotations

import pytest
import torch
from test_policy_modes import CLIP, VOCAB, max_err, mode_rollouts, response_logprobs, run

from megatron_branch.data import PrefixTree
from megatron_branch.errors import UserError
from megatron_branch.losses import ObjectiveConfig, build_objective
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

SETTINGS = {
    "kl_cov": dict(kl_cov_ratio=0.1, ppo_kl_coef=0.3),
    "clip_cov": dict(clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0),
}


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def verl_grads(model, rollouts, mode):  # noqa: ANN001, ANN201
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig, PolicyLossConfig

    model.zero_grad(set_to_none=True)
    width = max(len(r.response) for r in rollouts)
    logp = torch.stack(
        [torch.nn.functional.pad(response_logprobs(model, r), (0, width - len(r.response))) for r in rollouts]
    )
    old, adv, mask = (torch.zeros_like(logp).detach() for _ in range(3))
    for i, r in enumerate(rollouts):
        k = len(r.response)
        old[i, :k] = torch.tensor(r.field("old_logprobs"), dtype=torch.float64)
        adv[i, :k] = torch.tensor(r.field("advantages"), dtype=torch.float64)
        mask[i, :k] = 1.0
    cfg = ActorConfig(
        strategy="megatron", ppo_mini_batch_size=1, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        clip_ratio_low=CLIP["clip_low"], clip_ratio_high=CLIP["clip_high"],
        policy_loss=PolicyLossConfig(loss_mode=mode, **SETTINGS[mode]),
    )  # fmt: skip
    torch.manual_seed(123)  # clip_cov draws with the global generator
    loss, metrics = get_policy_loss_fn(mode)(old, logp, adv, mask, "token-mean", cfg)
    loss.backward()
    return float(loss), metrics, {k: p.grad.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("mode", list(SETTINGS))
def test_cov_mode_equals_verl_and_is_exact_under_sharing(mode: str) -> None:
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    model = tiny_branch_model_for_test()
    rollouts = mode_rollouts(model, seed=11)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    want_loss, want_metrics, want = verl_grads(model, rollouts, mode)
    cfg = ObjectiveConfig(policy_loss=mode, clip_ratio_high=CLIP["clip_high"], **SETTINGS[mode])
    objective = build_objective(cfg, rollouts)
    for schedule, kw in [("naive", {}), ("packed", {}), ("replay", {"branch_micro_batch": 2})]:
        torch.manual_seed(123)
        res, got = run(model, tree, objective, schedule, **kw)
        assert res.loss == pytest.approx(want_loss, rel=1e-10), schedule
        assert max_err(got, want) <= 1e-9, schedule
    if mode == "clip_cov":
        assert res.stats["actor/pg_clipfrac"] == pytest.approx(want_metrics["actor/pg_clipfrac"], rel=1e-6)

    # the premise: the selection is per pair, and a shared token is selected for one rollout and not another
    from megatron_branch.schedule import ScheduleOptions, score_rollouts

    torch.manual_seed(123)
    prepared = objective.prepare(
        tree, score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB))
    )
    pairs, sel = TokenPairs(tree), prepared.objective.selected
    by_token: dict[int, set[bool]] = {}
    for p in range(pairs.num_pairs):
        by_token.setdefault(int(pairs.token[p]), set()).add(bool(sel[p]))
    assert sel.any() and any(len(v) == 2 for v in by_token.values())


def test_cov_modes_refuse_a_split_batch() -> None:
    model = tiny_branch_model_for_test()
    rollouts = mode_rollouts(model, seed=11)
    objective = build_objective(ObjectiveConfig(policy_loss="kl_cov"), rollouts)
    half = PrefixTree.build(rollouts[:3], vocab_size=VOCAB)
    with pytest.raises(UserError, match="kl_cov ranks the whole batch at once"):
        objective.prepare(half, object())


def tiny_branch_model_for_test() -> torch.nn.Module:
    from megatron_branch.testing import tiny_branch_model

    return tiny_branch_model(torch.float64, seed=3)
