"""PPO's critic through the tree: verl's value model (a GPTModel with a one-output head, `model_type ==
"value_model"`) in verl's engine with and without the switch, through verl's TrainingWorker on CPU (as
tests/unit/test_verl_engine.py): compute_values (values per response token in verl's layout) and update_critic
(verl's value_loss: clipped, each loss_agg_mode) equal fp32 1e-5, every parameter's gradient, verl's critic
metrics; the update runs in one tree pass (value_loss is per token); planted: a shared token's value withheld.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from verl_helpers import (  # noqa: E402
    critic_config,
    grpo_batch,
    make_worker,
    max_rel_grad_error,
    one_rank_world,
    run_step,
    set_switch,
)

pytestmark = pytest.mark.slow

single_process = pytest.fixture(scope="module", name="single_process")(one_rank_world)

CRITIC_METRICS = ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "loss")


def _critic_step(
    hf: str, *, switch: bool, agg: str = "token-mean", one_pass: bool = True, dynamic_bsz: bool = False
) -> object:
    from megatron_branch.integration.verl import BranchOptions

    set_switch(switch)
    try:
        worker = make_worker(hf, value=True, dynamic_bsz=dynamic_bsz)
        if switch:
            worker.engine.branch_options = BranchOptions(schedule="replay", one_pass=one_pass)
        return run_step(
            worker, lambda: grpo_batch(seed=8, critic=True), critic=critic_config(loss_agg_mode=agg)
        )
    finally:
        set_switch(False)


@pytest.fixture(scope="module")
def critic_both(single_process: str) -> tuple:
    return _critic_step(single_process, switch=False), _critic_step(single_process, switch=True)


def test_switch_selects_the_branch_value_engine(critic_both: tuple) -> None:
    base, tree = critic_both
    assert base.engine == "CpuMegatronEngineWithValueHead"
    assert tree.engine == "BranchReplayCpuMegatronEngineWithValueHead"


def test_compute_values_match_verl(critic_both: tuple) -> None:
    base, tree = critic_both
    assert base.log_probs.abs().sum() > 0 and base.entropy is None
    torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)


def test_update_critic_matches_verl(critic_both: tuple) -> None:
    base, tree = critic_both
    err, name = max_rel_grad_error(base.grads, tree.grads)
    assert err <= 1e-5, f"{name}: {err:.2e}"
    assert tree.metrics["tree/update_passes"][0] == 1
    assert tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]
    for key in CRITIC_METRICS:
        got, want = float(tree.metrics[key][0]), float(base.metrics[key][0])
        assert math.isclose(got, want, rel_tol=1e-5, abs_tol=1e-6), (key, got, want)
    assert float(base.metrics["critic/vf_clipfrac"][0]) > 0  # the clip is exercised


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_value_loss_modes_one_and_two_passes(single_process: str, agg: str) -> None:
    base = _critic_step(single_process, switch=False, agg=agg)
    one = _critic_step(single_process, switch=True, agg=agg)
    two = _critic_step(single_process, switch=True, agg=agg, one_pass=False)
    assert two.metrics["tree/update_passes"][0] == 2
    for got in (one, two):
        err, name = max_rel_grad_error(base.grads, got.grads)
        assert err <= 1e-5, f"{name}: {err:.2e}"


def test_dynamic_batch_size(single_process: str) -> None:
    """verl's token-budget micro-batches (they may cut a group): values and every gradient still verl's."""
    base = _critic_step(single_process, switch=False, dynamic_bsz=True)
    tree = _critic_step(single_process, switch=True, dynamic_bsz=True)
    torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
    err, name = max_rel_grad_error(base.grads, tree.grads)
    assert err <= 1e-5, f"{name}: {err:.2e}"


def test_planted_bug_shared_value_withheld_is_caught(single_process: str, critic_both: tuple) -> None:
    from megatron_branch.integration import verl_onepass

    base, _ = critic_both
    orig = verl_onepass._BoundOnePass._live

    def unshared(
        self: verl_onepass._BoundOnePass, k: int, where: torch.Tensor, values: torch.Tensor
    ) -> object:
        counts = torch.bincount(self.o.slots.tokens[k], minlength=len(where))
        where = where.clone()
        where[counts > 1] = -1
        return orig(self, k, where, values)

    verl_onepass._BoundOnePass._live = unshared  # type: ignore[method-assign]
    try:
        bad = _critic_step(single_process, switch=True)
    finally:
        verl_onepass._BoundOnePass._live = orig  # type: ignore[method-assign]
    assert max_rel_grad_error(base.grads, bad.grads)[0] > 1e-3
