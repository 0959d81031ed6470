"""verl's MegatronEngine with and without the branch-replay switch at DP2 and TP2 (gloo, CPU), through verl's
TrainingWorker: compute_log_prob and every gradient shard equal at fp32 1e-5; positions computed < logical.

At DP2 each rank's share is two of verl's mini-batches (verl divides the mini-batch size by DP), so the update takes
two optimizer steps: both steps' gradients are compared, with megatron's SGD as the optimizer (Adam's first step
would turn fp32 noise on gradient elements near its eps into differences of the second step's gradients: run_step
in tests/verl_helpers.py, docs/verl.md "Optimizer steps in the tests").

    python tests/distributed/launch.py 2 -k verl

Skipped (on every rank alike) without the verl extra.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")

from verl_helpers import (  # noqa: E402
    actor_config,
    critic_config,
    dp_share,
    grpo_batch,
    make_worker,
    max_rel_step_error,
    run_step,
    set_switch,
    shared_policy_dir,
)


@pytest.mark.world(2)
@pytest.mark.parametrize(
    ("tp", "multi_turn"), [(1, False), (2, False), (1, True)], ids=["dp2", "tp2", "dp2_multi_turn"]
)
def test_verl_engine_switch_parallel(tp: int, multi_turn: bool) -> None:
    """multi_turn: verl's response_mask with tool tokens 0 inside responses (and one response all tool output)."""
    os.environ.setdefault("MASTER_PORT", "0")  # verl's Worker reads it; the process group already exists
    hf = shared_policy_dir()
    dp = dist.get_world_size() // tp
    rank = dist.get_rank() // tp  # megatron's default order: tp fastest, so ranks 0,1 are one TP group at TP2

    def td():  # 4 prompt groups of 4: at DP2 each rank gets 2 whole groups (prompts per step % DP == 0)
        return dp_share(grpo_batch(seed=5, groups=4, multi_turn=multi_turn), rank, dp)

    set_switch(False)
    base = run_step(make_worker(hf, tp=tp, optimizer="sgd"), td)
    set_switch(True)
    tree = run_step(make_worker(hf, tp=tp, optimizer="sgd"), td)
    set_switch(False)
    assert tree.engine.startswith("BranchReplay") and not base.engine.startswith("BranchReplay")
    assert base.steps == dp  # one mini-batch per DP rank of the step's
    assert (base.log_probs is None) == (tree.log_probs is None) == (dist.get_rank() % tp != 0)
    if base.log_probs is not None:  # the collecting rank of each DP replica
        torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree.entropy, base.entropy, rtol=1e-5, atol=1e-5)
    err, name = max_rel_step_error(base, tree)
    assert err <= 1e-5, f"tp={tp} rank {dist.get_rank()} {name}: {err:.2e}"
    if base.metrics:  # the rank that collects outputs (tp rank 0)
        got, want = float(tree.metrics["actor/pg_loss"][0]), float(base.metrics["actor/pg_loss"][0])
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]
        assert tree.metrics["tree/prompts_split_over_dp"][0] == 0  # whole groups per rank (prompts % DP == 0)


@pytest.mark.world(2)
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-sum"])
def test_verl_one_pass_global_normalisers_dp2(agg: str) -> None:
    """DP2: verl's loss normalised by the GLOBAL counts (all-reduced over DP by verl) inside the one-pass update:
    every gradient shard equals verl's and the two-pass path's."""
    from megatron_branch.integration.verl import BranchOptions

    os.environ.setdefault("MASTER_PORT", "0")
    hf = shared_policy_dir()

    def td():
        return dp_share(grpo_batch(seed=10, groups=4), dist.get_rank(), 2)

    actor = actor_config(loss_agg_mode=agg)
    set_switch(False)
    base = run_step(make_worker(hf, optimizer="sgd"), td, actor=actor)
    set_switch(True)
    runs = []
    for one_pass in (True, False):
        worker = make_worker(hf, optimizer="sgd")
        worker.engine.branch_options = BranchOptions(schedule="replay", one_pass=one_pass)
        runs.append(run_step(worker, td, actor=actor))
    set_switch(False)
    assert [r.metrics["tree/update_passes"][0] for r in runs] == [1, 2]
    assert base.steps == 2
    for got in runs:
        err, name = max_rel_step_error(base, got)
        assert err <= 1e-5, f"{agg} rank {dist.get_rank()} {name}: {err:.2e}"


@pytest.mark.world(2)
@pytest.mark.parametrize("tp", [1, 2], ids=["dp2", "tp2"])
def test_verl_critic_switch_parallel(tp: int) -> None:
    """PPO's critic (verl's value model, its one-output head replicated over TP, the sequence gathered under SP):
    compute_values and every gradient shard equal at fp32 1e-5, with and without the switch."""
    os.environ.setdefault("MASTER_PORT", "0")
    hf = shared_policy_dir()
    dp = dist.get_world_size() // tp
    rank = dist.get_rank() // tp

    def td():
        return dp_share(grpo_batch(seed=9, groups=4, critic=True), rank, dp)

    critic = critic_config(ppo_mini_batch_size=16)
    set_switch(False)
    base = run_step(make_worker(hf, tp=tp, value=True, optimizer="sgd"), td, critic=critic)
    set_switch(True)
    tree = run_step(make_worker(hf, tp=tp, value=True, optimizer="sgd"), td, critic=critic)
    set_switch(False)
    assert tree.engine.startswith("BranchReplay") and not base.engine.startswith("BranchReplay")
    assert base.steps == dp
    if base.log_probs is not None:  # the values, on the collecting rank of each DP replica
        torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
    err, name = max_rel_step_error(base, tree)
    assert err <= 1e-5, f"critic tp={tp} rank {dist.get_rank()} {name}: {err:.2e}"
    if base.metrics:
        got, want = float(tree.metrics["critic/vf_loss"][0]), float(base.metrics["critic/vf_loss"][0])
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert tree.metrics["tree/update_passes"][0] == 1
