"""`train` with the fair baselines: `naive-fused`, `packed-nosharing` and `rollout.share_prefix=false` run the
same RL run as `replay` (same tokens, same rewards, same parameters at 1e-9 in float64 over 5 steps), and the
independent sampler pays what an engine without prefix caching pays (n prefills per prompt)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_train_loop import _cfg, _max_rel, _params, _run, task  # noqa: F401 (task: fixture)

from megatron_branch.errors import UserError
from megatron_branch.generation import BranchSampler, SamplingParams
from megatron_branch.rules import AUTO_SCHEDULE, TRAIN_SCHEDULES
from megatron_branch.schedule import SCHEDULES
from megatron_branch.train.config import ScheduleConfig
from megatron_branch.train.config_io import load_config

RUNS = {
    "replay": ("schedule.name=replay",),
    "naive-fused": ("schedule.name=naive-fused",),
    "packed-nosharing": ("schedule.name=packed-nosharing",),
    "replay, share_prefix=false": ("schedule.name=replay", "rollout.share_prefix=false"),
    "naive-fused, share_prefix=false": ("schedule.name=naive-fused", "rollout.share_prefix=false"),
}


@pytest.mark.slow
def test_fair_baselines_train_the_same_run_float64(task: Path, tmp_path: Path) -> None:  # noqa: F811
    runs = {}
    for k, (name, extra) in enumerate(RUNS.items()):
        cfg = _cfg(task, tmp_path / str(k), "model.dtype=float64", "trainer.total_training_steps=5",
                   "rollout.n=3", *extra)  # fmt: skip
        runs[name] = _run(cfg)
    ref, mref = runs["replay"]
    assert len({tuple(m["_rewards"]) for m in mref}) > 1  # the policy moved: not a trivially constant run
    for name, (tr, rows) in runs.items():
        for x, y in zip(mref, rows, strict=True):
            assert x["_tokens"] == y["_tokens"], (name, x["step"])
            assert x["_rewards"] == y["_rewards"], (name, x["step"])
        assert _max_rel(_params(ref), _params(tr)) < 1e-9, name
    shared, unshared = mref[-1], runs["replay, share_prefix=false"][1][-1]
    assert unshared["gen/prefill_positions"] == 3 * shared["gen/prefill_positions"]  # n = 3 prefills a prompt
    assert runs["naive-fused"][1][-1]["positions_computed"] == shared["positions_logical"]
    assert shared["positions_computed"] < shared["positions_logical"]


def test_train_schedules_are_the_engine_schedules() -> None:
    """Every schedule `train` accepts is one the engine runs, and the config's choices are rules' list."""
    import typing

    hints = typing.get_type_hints(ScheduleConfig)
    assert typing.get_args(hints["name"]) == (*TRAIN_SCHEDULES, AUTO_SCHEDULE)  # auto: one of them, per batch
    assert set(TRAIN_SCHEDULES) <= set(SCHEDULES)


def test_config_refuses_forks_without_sharing(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"rollout.share_prefix=false .* rollout.branch_at"):
        load_config(None, ["data.task=needles", "rollout.share_prefix=false", "rollout.branch_at=[2]",
                           "rollout.response_length=4", f"trainer.default_local_dir={tmp_path}"])  # fmt: skip
    with pytest.raises(ValueError, match="SamplingParams.share_prefix"):
        SamplingParams(n=4, max_new_tokens=4, branch_at=(2,), share_prefix=False)


def test_unshared_sampler_same_draws_n_prefills() -> None:
    """share_prefix=False: the same samples from the same generator; each prompt prefilled n times."""
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    arch = ModelArch(family="llama", vocab_size=50, hidden_size=16, num_layers=2, num_attention_heads=2,
                     num_query_groups=1, ffn_hidden_size=32, max_position_embeddings=64)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(arch, dtype=torch.float64).eval()
    sampler = BranchSampler(model, vocab_size=50)
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
    outs = {}
    for share in (True, False):
        p = SamplingParams(n=4, max_new_tokens=6, stop_token_ids=(3,), share_prefix=share)
        outs[share] = sampler.generate(prompts, p, generator=torch.Generator().manual_seed(5))
    a, b = outs[True], outs[False]
    assert [[s.response for s in g] for g in a.samples] == [[s.response for s in g] for g in b.samples]
    assert [[s.prompt_index for s in g] for g in b.samples] == [[0] * 4, [1] * 4]
    for ga, gb in zip(a.samples, b.samples):
        for sa, sb in zip(ga, gb):
            assert max(abs(x - y) for x, y in zip(sa.logprobs, sb.logprobs)) < 1e-12
    assert a.stats.prompt_prefills == [1, 1] and b.stats.prompt_prefills == [4, 4]
    assert b.stats.prefill_positions == 4 * a.stats.prefill_positions == 4 * 8
    assert b.stats.num_prompts == 2 and b.stats.num_samples == 8


def test_one_tree_per_batch(task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """An RL step builds its batch's prefix tree ONCE (update/step.TreeCache): DP share, micro-batch, reference
    scoring, the update of each epoch and the step's metrics reuse it."""
    from megatron_branch.data import PrefixTree
    from megatron_branch.train.loop import Trainer

    cfg = _cfg(task, tmp_path / "run", "trainer.total_training_steps=2", "actor.kl_loss_coef=0.01",
               "actor.ppo_epochs=2")  # fmt: skip
    tr = Trainer(cfg)
    built = []
    build = PrefixTree.build
    monkeypatch.setattr(
        PrefixTree, "build", classmethod(lambda cls, rs, **kw: built.append(1) or build(rs, **kw))
    )
    for _ in range(2):
        tr.train_step()
    assert tr.needs_reference
    assert len(built) == 2 == tr.actor.plan.trees.builds  # one per step's batch
