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
