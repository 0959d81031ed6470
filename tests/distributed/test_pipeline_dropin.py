"""The drop-in get_forward_backward_func under pipeline parallelism (PP2, world-2 launch) against megatron's OWN
pipeline schedule (forward_backward_pipelining_without_interleaving, megatron's p2p, one rollout per
micro-batch, the naive per-rollout loss), on the same stage models, float32 1e-5 per parameter.

    python tests/distributed/launch.py 2 -k pipeline_dropin

- untreed: rollouts that share nothing, all of one length (megatron's fixed message shape): parity with megatron;
- treed: shared prompts and response beginnings of varied lengths (megatron with `variable_seq_lengths`, which
  exchanges shapes first): the drop-in equals megatron's naive pipeline step;
- the rollouts are read on the FIRST stage only (the others pass data_iterator=None, as megatron's loaders leave
  them) and the loss dicts come back on the last stage only, as megatron's pipeline schedules return them;
- interleaved (virtual) stages are refused in one line.
"""

from __future__ import annotations

import random

import pytest
import torch
from dropin_helpers import VOCAB, build_patched_gpt, megatron_naive_step, reduce_like_megatron, tiny_arch

from megatron_branch.checkpoint.stages import gather_model_grads
from megatron_branch.data import Rollout
from megatron_branch.errors import UserError
from megatron_branch.integration import get_forward_backward_func
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.testing import random_tree_rollouts


def _untreed() -> list[Rollout]:
    rng = random.Random(7)
    return [
        Rollout(prompt=[1 + k] + [rng.randrange(VOCAB) for _ in range(5)],
                response=[rng.randrange(VOCAB) for _ in range(4)], advantage=rng.uniform(-1, 1))
        for k in range(4)
    ]  # fmt: skip


def _treed() -> list[Rollout]:
    return random_tree_rollouts(vocab_size=VOCAB, groups=2, prompt_len=9, branches=3, levels=2, seed=3)


def _dropin(model: torch.nn.Module, rollouts: list[Rollout], schedule: str, first: bool) -> list[dict]:
    batches = [rollouts[i : i + 2] for i in range(0, len(rollouts), 2)]
    fb = get_forward_backward_func(2, None, schedule=schedule, vocab_size=VOCAB, branch_micro_batch=2)
    return fb(
        forward_step_func=None, data_iterator=iter(batches) if first else None, model=[model],
        num_microbatches=len(batches), seq_length=0, micro_batch_size=2,
    )  # fmt: skip


@pytest.mark.world(2)
@pytest.mark.parametrize("batch", ["untreed", "treed"])
@pytest.mark.parametrize("schedule", ["replay", "packed"])
def test_dropin_pp2_matches_megatron_pipeline(batch: str, schedule: str) -> None:
    groups = initialize_parallel(ParallelConfig(pp=2))
    rollouts = _untreed() if batch == "untreed" else _treed()
    model = build_patched_gpt(tiny_arch(), seed=5, pp=2, pp_rank=groups.pp_rank)
    lengths = {len(r.prompt) + len(r.response) for r in rollouts}
    if len(lengths) > 1:
        model.config.variable_seq_lengths = True  # megatron exchanges each message's shape first
    ref_losses = megatron_naive_step(model, rollouts, seq_length=max(lengths))
    ref = gather_model_grads(model, groups)
    model.zero_grad(set_to_none=True)
    model.config.variable_seq_lengths = False
    losses = _dropin(model, rollouts, schedule, first=groups.first_stage)
    got = gather_model_grads(model, groups)
    assert ref.keys() == got.keys() and ref
    for name, want in ref.items():
        err = ((got[name] - want).norm() / want.norm()).item()
        assert err <= 1e-5, f"pp2 {batch} {schedule} {name}: {err:.2e}"
    if groups.last_stage:
        want_loss = sum(float(d["lm loss"][0]) for d in ref_losses)
        assert reduce_like_megatron(losses) == pytest.approx(want_loss, rel=1e-5)
    else:
        assert losses == [] and ref_losses == []


@pytest.mark.world(2)
def test_dropin_refuses_interleaved_stages() -> None:
    with pytest.raises(
        UserError, match="vp_size=2: interleaved \\(virtual\\) pipeline stages are not supported"
    ):
        get_forward_backward_func(2, 2)
    groups = initialize_parallel(ParallelConfig(pp=2))
    model = build_patched_gpt(tiny_arch(), seed=5, pp=2, pp_rank=groups.pp_rank)
    fb = get_forward_backward_func(schedule="replay", vocab_size=VOCAB)
    with pytest.raises(UserError, match="interleaved"):
        fb(
            forward_step_func=None,
            data_iterator=[iter([]), iter([])],
            model=[model, model],
            num_microbatches=1,
        )
    with pytest.raises(UserError, match="schedule=naive has no pipeline parallelism"):
        get_forward_backward_func(2, None, schedule="naive")
