"""Pipeline parallelism in the update and the training loop (world-2 launch), float64, 1e-9 per parameter.

    python tests/distributed/launch.py 2 -k pipeline_train

- One optimizer step (megatron DDP + megatron's optimizer and scheduler, gradient clipping active) at PP2 equals the
  same step at PP1 on the same two ranks (DP2; DP2 == one rank is shown in test_objectives_parallel.py).
- A 3-step GRPO `train` run at parallel.pp=2 equals the run at parallel.tp=2 with schedule.name=naive (megatron's
  own attention, every rollout alone; both one DP replica, so both sample with the same stream): the same sampled
  tokens and rewards, losses, and every parameter after the last step; so does the run at parallel.pp=2 with
  schedule.root_pieces=3 (data/pieces.py), whose pipeline is checked to have cut every tree (a spy on
  split_roots: a config key that never reached the pipeline would give the same numbers). The sampler runs a
  whole-model copy refreshed from the stages (train/models.py whole_copy), the updates run the stages.
(PP2 checkpoints resuming at PP1: tests/distributed/test_resume_layouts.py.)
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from test_objectives_parallel import VOCAB, _objective, _rollouts
from test_pipeline import _hf, _stage_policy
from test_pipeline_pieces import spy_on_pieces
from test_train_loop import _cfg
from train_helpers import run_steps

from megatron_branch.checkpoint.param_map import mcore_to_hf_state
from megatron_branch.checkpoint.stages import gather_model_state
from megatron_branch.models import ModelArch
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions
from megatron_branch.train.models import unwrap


def _one_step(pp: int, schedule: str) -> dict[str, torch.Tensor]:
    """Whole-model parameters (HF names) after one update_step at `pp` stages on this world."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.parallel.ddp import wrap_megatron_ddp
    from megatron_branch.update import OptimizerSettings, UpdatePlan, build_optimizer, update_step

    hf, rollouts = _hf(), _rollouts()
    groups = initialize_parallel(ParallelConfig(pp=pp))
    model = _stage_policy(hf, groups, torch.float64)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    settings = OptimizerSettings(lr=0.05, weight_decay=0.01, clip_grad=0.01, warmup_steps=0)
    ddp = wrap_megatron_ddp(
        model, dtype=torch.float64, pg_collection=pgc, **settings.ddp_options(torch.float64)
    )
    optimizer, scheduler = build_optimizer(ddp, settings, dtype=torch.float64)
    plan = UpdatePlan(
        opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, branch_micro_batch=2, chunk_tokens=None), schedule=schedule,
        micro_batches=2, pg_collection=pgc,
    )  # fmt: skip
    res = update_step(ddp, rollouts, _objective(rollouts), plan, optimizer=optimizer, scheduler=scheduler)
    assert res.stepped and res.metrics["actor/grad_norm"] > 0.01  # clipping active
    arch = ModelArch.from_hf_config(hf.config)
    return mcore_to_hf_state(gather_model_state(model, groups), arch)


@pytest.mark.world(2)
@pytest.mark.parametrize("schedule", ["replay", "packed"])
def test_pipeline_optimizer_step_equals_pp1(schedule: str) -> None:
    want = _one_step(1, schedule)
    got = _one_step(2, schedule)
    assert got.keys() == want.keys()
    start = _hf().state_dict()
    for n, w in want.items():
        assert not torch.equal(w, start[n].to(w.dtype)), n  # the step moved every parameter
        err = ((got[n] - w).norm() / w.norm()).item()
        assert err <= 1e-9, f"{n}: {err:.2e}"


def _samerun_steps(mref: list[dict], mgot: list[dict]) -> None:
    """Two runs' steps: the same sampled tokens and rewards, losses and gradient norms within 1e-9."""
    for x, y in zip(mref, mgot, strict=True):
        assert x["_tokens"] == y["_tokens"] and x["_rewards"] == y["_rewards"], x["step"]
        assert abs(x["loss"] - y["loss"]) <= 1e-9 * max(1.0, abs(x["loss"])), x["step"]
        assert abs(x["actor/grad_norm"] - y["actor/grad_norm"]) <= 1e-9 * x["actor/grad_norm"], x["step"]


def _same_parameters(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-30)) <= 1e-9, k


@pytest.mark.world(2)
def test_pipeline_train_three_steps_equal_naive(monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = shared_tmp()
    try:
        # vocabulary 22: padded alike at TP2 and PP1 (megatron's random init draws the padded rows too)
        # a short supervised warm-up (through the pipelined update too) so that the sampled answers earn rewards
        f64 = ("model.dtype=float64", "trainer.total_training_steps=3", "model.arch.vocab_size=22",
               "warmup.steps=8", "warmup.batch_size=4", "warmup.lr=0.1", "rollout.n=4")  # fmt: skip
        ref, mref = run_steps(_cfg(tmp / "tp2", *f64, "parallel.tp=2", "schedule.name=naive"))
        a = gather_model_state(unwrap(ref.policy), ref.groups)  # before the next run lays out other groups
        assert all(m["actor/grad_norm"] > 0 for m in mref), "every step moves the policy"
        got, mgot = run_steps(_cfg(tmp / "pp2", *f64, "parallel.pp=2"))
        assert (got.groups.pp_size, got.groups.dp_size) == (2, 1) and got.actor.whole is not None
        _samerun_steps(mref, mgot)
        _same_parameters(a, gather_model_state(unwrap(got.policy), got.groups))
        cuts = spy_on_pieces(monkeypatch)
        cut, mcut = run_steps(_cfg(tmp / "pp2_pieces", *f64, "parallel.pp=2", "schedule.root_pieces=3"))
        # every pipelined pass was given 3 pieces; the RL steps' trees were cut (their prompts share the first token:
        # the root is that token, each prompt an inner segment with the rollouts under it, cut too); the warm-up's
        # one-answer-per-prompt trees have no long shared segment to cut
        assert cuts and all(k == 3 for k, _, _ in cuts), cuts
        assert sum(after > before for _, before, after in cuts) >= 3, cuts
        _samerun_steps(mref, mcut)
        _same_parameters(a, gather_model_state(unwrap(cut.policy), cut.groups))
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
