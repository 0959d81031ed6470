"""verl's MegatronEngine with and without the branch-replay switch at DP2 and TP2 (gloo, CPU), through verl's
TrainingWorker: compute_log_prob and every gradient shard equal at fp32 1e-5; positions computed < logical.

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
    dp_share,
    grpo_batch,
    make_worker,
    max_rel_grad_error,
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
    base = run_step(make_worker(hf, tp=tp), td)
    set_switch(True)
    tree = run_step(make_worker(hf, tp=tp), td)
    set_switch(False)
    assert tree.engine.startswith("BranchReplay") and not base.engine.startswith("BranchReplay")
    assert (base.log_probs is None) == (tree.log_probs is None) == (dist.get_rank() % tp != 0)
    if base.log_probs is not None:  # the collecting rank of each DP replica
        torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree.entropy, base.entropy, rtol=1e-5, atol=1e-5)
    err, name = max_rel_grad_error(base.grads, tree.grads)
    assert err <= 1e-5, f"tp={tp} rank {dist.get_rank()} {name}: {err:.2e}"
    if base.metrics:  # the rank that collects outputs (tp rank 0)
        got, want = float(tree.metrics["actor/pg_loss"][0]), float(base.metrics["actor/pg_loss"][0])
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]
        assert tree.metrics["tree/prompts_split_over_dp"][0] == 0  # whole groups per rank (prompts % DP == 0)
