"""The drop-in get_forward_backward_func under TP2 (with and without SP) matches megatron's own schedule running
the naive per-rollout step on the same TP2 model (float32 1e-5 per parameter, after finalising grads).

    python tests/distributed/launch.py 2 -k dropin
"""

from __future__ import annotations

import pytest
import torch
from dropin_helpers import (
    VOCAB,
    build_patched_gpt,
    dropin_step,
    megatron_naive_step,
    reduce_like_megatron,
    tiny_arch,
)

from megatron_branch.parallel.grads import finalize_grads
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import random_tree_rollouts


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.world(2)
@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("schedule", ["replay", "packed"])
def test_dropin_tp2_matches_megatron_naive(sp: bool, schedule: str) -> None:
    groups = initialize_parallel(ParallelConfig(tp=2, sequence_parallel=sp))
    rollouts = random_tree_rollouts(vocab_size=VOCAB, groups=2, prompt_len=9, branches=3, levels=2, seed=3)
    if sp:  # megatron's naive step under SP needs every sequence to divide by TP
        rollouts = [r for r in rollouts if (len(r.prompt) + len(r.response)) % 2 == 0]
        assert len(rollouts) >= 3
    model = build_patched_gpt(tiny_arch(), tp=2, sp=sp)
    ref_losses = megatron_naive_step(model, rollouts, tp_group=groups.tp)
    finalize_grads(model, tp_group=groups.tp, dp_cp_group=None, sequence_parallel=sp)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    losses = dropin_step(model, rollouts, schedule)
    finalize_grads(model, tp_group=groups.tp, dp_cp_group=None, sequence_parallel=sp)
    got = grads(model)
    assert reduce_like_megatron(losses) == pytest.approx(
        sum(float(d["lm loss"][0]) for d in ref_losses), rel=1e-5
    )
    assert ref.keys() == got.keys() and ref
    for name in ref:
        err = ((got[name] - ref[name]).norm() / ref[name].norm()).item()
        assert err <= 1e-5, f"tp2 sp={sp} {schedule} {name}: {err:.2e}"


@pytest.mark.world(2)
@pytest.mark.parametrize("sum_reduce", [False, True])
def test_dropin_dp2_through_megatron_ddp(sum_reduce: bool) -> None:
    """DP2 through megatron's own DDP and finalize_model_grads (set in the config, as a megatron run does): with
    DDP's default MEAN (1/dp scaling) and with a SUM (calculate_per_token_loss), the reduced main grads are the
    gradient of the global objective, as megatron's naive step over ALL rollouts on one rank computes it."""
    import copy

    import torch.distributed as dist
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.process_groups_config import ProcessGroupCollection

    groups = initialize_parallel(ParallelConfig())  # world 2, tp 1: dp 2
    rollouts = random_tree_rollouts(vocab_size=VOCAB, groups=4, prompt_len=9, branches=3, levels=2, seed=3)
    ref_model = build_patched_gpt(tiny_arch(), seed=5)
    megatron_naive_step(
        ref_model, rollouts
    )  # every rank alone, all rollouts: the global objective's gradient
    ref = grads(ref_model)

    model = build_patched_gpt(tiny_arch(), seed=5)
    config = model.config
    if sum_reduce:
        config = copy.copy(config)
        config.calculate_per_token_loss = True
    ddp = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True),
        model,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    model.config.no_sync_func = ddp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    mine = rollouts[dist.get_rank(groups.dp) :: 2]  # this DP rank's share (whole prefix groups not required)
    losses = dropin_step(ddp, mine, "replay")
    got = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    assert ref.keys() <= got.keys() and ref
    for name in ref:
        err = ((got[name] - ref[name]).norm() / ref[name].norm()).item()
        assert err <= 1e-5, f"dp2 sum={sum_reduce} {name}: {err:.2e}"
    # megatron's loss reduction: sum over micro-batches and dp x cp, then divide
    val = torch.vstack([d["lm loss"].view(-1).double() for d in losses]).sum(dim=0)
    dist.all_reduce(val, group=groups.dp_cp)
    want = sum(
        float(d["lm loss"][0]) for d in megatron_naive_step(build_patched_gpt(tiny_arch(), seed=5), rollouts)
    )
    assert float(val[0] / val[1]) == pytest.approx(want, rel=1e-5)
