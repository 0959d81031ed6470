"""PPO's critic under the project's pipeline parallelism (schedule/pipeline.py), world 2 (PP2).

    python tests/distributed/launch.py 2 -k pipeline_critic

The critic (models/critic.py) is cut into two stages: the embedding and layers 0-1 on stage 0, layers 2-3, the
final norm and the value head on stage 1, where the clipped value loss (losses/value.py) runs. The oracle is HF in
float64 with exact norms: its final hidden states through the same head, every rollout alone through the value
loss's own per-rollout formula. The tree shares prompts and response beginnings and every rollout carries its own
returns and old values, so a shared token's one value meets different returns in different rollouts. Per parameter,
on each stage: float64 1e-9, float32 1e-5 (with tied embeddings); the value loss equals the oracle's and every
metric is the same on BOTH stages (the last stage's are broadcast); the scoring pass's values equal the oracle's.
Planted: the last stage drops the gradient of the hidden states it received (the value loss's gradient never
reaches stage 0), and the metrics not broadcast from the last stage.

Then `train` with PPO at parallel.pp=2 == parallel.tp=2 (and through a PP2 checkpoint), and verl's value model at
PP2 with the switch == verl's own pipeline path.
"""

from __future__ import annotations

import dataclasses
import random
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_helpers import shared_tmp
from test_objectives_parallel import VOCAB, _close
from test_pipeline import _hf, pp_pass
from test_train_loop import ALGOS, _cfg
from train_helpers import run_steps

from megatron_branch.checkpoint.param_map import hf_to_mcore_state, mcore_to_hf_state
from megatron_branch.checkpoint.stages import gather_model_state, load_stage
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import Aggregation, ValueObjective
from megatron_branch.models import ModelArch, build_critic
from megatron_branch.parallel.groups import ParallelConfig, ParallelGroups, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, pipeline_stage, run_schedule
from megatron_branch.schedule import pipeline as pipeline_mod
from megatron_branch.testing import random_tree_rollouts
from megatron_branch.train.models import unwrap

HEAD = ("value_head.weight", "value_head.bias")


def _rollouts() -> list[Rollout]:
    """Two prompt groups, two levels of branching; per-rollout returns and old values on every response token."""
    rng = random.Random(41)
    return [
        dataclasses.replace(
            r,
            token_fields={
                "values": tuple(rng.uniform(-1, 1) for _ in r.response),
                "returns": tuple(rng.uniform(-1, 1) for _ in r.response),
            },
        )
        for r in random_tree_rollouts(groups=2, prompt_len=7, branches=3, levels=2, seg_len=(2, 5), seed=42)
    ]


def _oracle(
    hf: torch.nn.Module, head: dict[str, torch.Tensor], rollouts: list[Rollout], objective: ValueObjective
) -> tuple[float, list[torch.Tensor], dict[str, torch.Tensor]]:
    """(value loss, each rollout's values at its response rows, gradients by HF / head name)."""
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    bound = objective.bind(tree)
    w, b = (head[n].clone().requires_grad_() for n in HEAD)
    hf.zero_grad(set_to_none=True)
    loss, values = 0.0, []
    for i, r in enumerate(rollouts):
        seq = torch.tensor([list(r.prompt) + list(r.response)])
        h = hf.model(input_ids=seq).last_hidden_state[0, :-1]  # [L-1, h]: the row before each token
        v = (h @ w.t() + b).squeeze(-1)  # [L-1]
        term, _ = bound.rollout_loss(i, v)
        term.backward()
        loss += float(term)
        values.append(v.detach()[len(r.prompt) - 1 :])
    grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    return loss, values, {**grads, HEAD[0]: w.grad, HEAD[1]: b.grad}


def _stage_critic(
    hf: torch.nn.Module, head: dict[str, torch.Tensor], groups: ParallelGroups, dtype: torch.dtype
) -> torch.nn.Module:
    """This rank's stage of the critic, loaded from the oracle's weights (the head on the last stage only)."""
    arch = ModelArch.from_hf_config(hf.config)
    critic = build_critic(arch, dtype=dtype, pp=groups.pp_size, pp_rank=groups.pp_rank)
    assert hasattr(critic, "value_head") == (groups.pp_rank == groups.pp_size - 1)
    state = {**hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1)), **head}
    frozen = [
        p for n, p in critic.named_parameters() if not p.requires_grad
    ]  # the unused vocabulary projection
    load_stage(critic, ((k, v.to(dtype)) for k, v in state.items()), groups)  # asserts every parameter filled
    assert all(not p.requires_grad for p in frozen)
    return critic


def _grads(
    hf: torch.nn.Module,
    critic: torch.nn.Module,
    rollouts: list[Rollout],
    objective: ValueObjective,
    groups: ParallelGroups,
    schedule: str,
    **options: Any,
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """(metrics on this rank, whole-model gradients by HF / head name) of one gradient pass."""
    metrics, full = pp_pass(critic, rollouts, objective, groups, schedule, **options)
    head = {n: full.pop(n) for n in HEAD}
    got = mcore_to_hf_state(full, ModelArch.from_hf_config(hf.config))
    return metrics, {**{n: g for n, g in got.items() if n != "lm_head.weight"}, **head}


def _same_on_every_stage(metrics: dict[str, float], groups: ParallelGroups) -> bool:
    parts: list[Any] = [None] * groups.pp_size
    dist.all_gather_object(parts, metrics, group=groups.pp)
    return all(p == parts[0] for p in parts)


def _case(dtype: torch.dtype, *, tie: bool = False) -> tuple[Any, ...]:
    hf, rollouts = _hf(tie=tie), _rollouts()
    g = torch.Generator().manual_seed(5)
    head = {
        HEAD[0]: torch.randn(1, hf.config.hidden_size, generator=g, dtype=torch.float64),
        HEAD[1]: torch.randn(1, generator=g, dtype=torch.float64),
    }
    objective = ValueObjective(agg=Aggregation.of_batch(rollouts), clip=0.2)
    want = _oracle(hf, head, rollouts, objective)
    groups = initialize_parallel(ParallelConfig(pp=2))
    return hf, rollouts, objective, want, groups, _stage_critic(hf, head, groups, dtype)


@pytest.mark.world(2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32_tied"])
def test_pipeline_critic_value_loss_pp2(dtype: torch.dtype) -> None:
    """fp32 with tied embeddings: the last stage's copy of the embedding (the unused vocabulary projection) gets no
    gradient, and megatron's embedding-group sum leaves stage 0's."""
    hf, rollouts, objective, (want_loss, want_values, want), groups, critic = _case(
        dtype, tie=dtype == torch.float32
    )
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    runs: list[tuple[str, dict[str, Any]]] = [("replay", {}), ("packed", {}), ("replay", {"root_pieces": 3})]
    if dtype == torch.float64:  # the other order, segment recompute and the unshared baseline, once
        runs += [("replay", {"pipeline_order": "gpipe", "recompute": True}), ("naive-fused", {})]
    for schedule, options in runs:
        metrics, grads = _grads(hf, critic, rollouts, objective, groups, schedule, **options)
        assert metrics["critic/loss"] == pytest.approx(want_loss, rel=tol), (schedule, options)
        assert metrics["critic/vf_loss"] == pytest.approx(want_loss, rel=tol), (schedule, options)
        assert 0 < metrics["critic/vf_clipfrac"] < 1, (schedule, options)
        assert _same_on_every_stage(metrics, groups), (schedule, options)
        _close(grads, want, tol)
    # the scoring pass (the values GAE reads): the last stage's values, broadcast to every stage
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    opts = ScheduleOptions(groups=groups, vocab_size=VOCAB, keep_logprobs=True, chunk_tokens=None)
    with torch.no_grad():
        res = run_schedule("replay", critic, tree, None, opts, forward_only=True)
    for i, v in enumerate(want_values):
        torch.testing.assert_close(res.rollout_logprobs(tree, i), v, rtol=tol, atol=tol)


def _drop_input_gradient(backward: Any) -> Any:
    def dropped(self: Any, run: Any, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        g = backward(self, run, *args, **kwargs)
        return None if g is None else torch.zeros_like(g)

    return dropped


@pytest.mark.world(2)
@pytest.mark.parametrize("bug", ["last_stage_drops_input_gradient", "metrics_not_broadcast"])
def test_pipeline_critic_planted_bugs_are_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hf, rollouts, objective, (_, _, want), groups, critic = _case(torch.float64)
    metrics, grads = _grads(hf, critic, rollouts, objective, groups, "replay")
    assert _same_on_every_stage(metrics, groups) and _worst(grads, want) <= 1e-9  # the unplanted run is exact
    if bug == "last_stage_drops_input_gradient":
        if groups.pp_rank == groups.pp_size - 1:  # the value loss's gradient stops at the last stage's input
            monkeypatch.setattr(
                pipeline_stage._Stage, "backward", _drop_input_gradient(pipeline_stage._Stage.backward)
            )
        metrics, grads = _grads(hf, critic, rollouts, objective, groups, "replay")
        assert _worst(grads, want) > 1e-3, bug
    else:  # every stage keeps its own (stage 0: empty) statistics
        monkeypatch.setattr(pipeline_mod, "broadcast_from_last", lambda t, groups: t)
        metrics, _ = _grads(hf, critic, rollouts, objective, groups, "replay")
        assert not _same_on_every_stage(metrics, groups), bug


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(((got[n].double() - g).norm() / g.norm()).item() for n, g in want.items())


@pytest.mark.world(2)
def test_pipeline_critic_train_ppo_two_steps_equal_tp2() -> None:
    """`train` with PPO (a critic, GAE on its values) at parallel.pp=2 equals the run at parallel.tp=2 (both one DP
    replica, so both sample with the same stream): tokens, rewards, both losses and gradient norms, and every
    parameter of the policy and of the critic after the second step, float64 1e-9 (the rewards are 0 without a
    warm-up; GAE on the critic's values still gives every token an advantage). So does a PP2 run saved after the
    first step and resumed for the second (the critic's stages in the checkpoint); that checkpoint loads at
    parallel.tp=2 with the same policy and critic."""
    tmp = shared_tmp()
    try:
        f64 = ("model.dtype=float64", "trainer.total_training_steps=2", "model.arch.vocab_size=22", "rollout.n=4",
               *ALGOS["ppo"])  # fmt: skip
        ref, mref = run_steps(_cfg(tmp / "tp2", *f64, "parallel.tp=2"))
        want = [gather_model_state(unwrap(m), ref.groups) for m in (ref.policy, ref.actor.critic.model)]
        got, mgot = run_steps(_cfg(tmp / "pp2", *f64, "parallel.pp=2"))
        assert (got.groups.pp_size, got.groups.dp_size) == (2, 1)
        for x, y in zip(mref, mgot, strict=True):
            assert x["_tokens"] == y["_tokens"] and x["_rewards"] == y["_rewards"], x["step"]
            for k in ("loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
                assert y[k] == pytest.approx(x[k], rel=1e-9, abs=1e-12), (x["step"], k)
            assert x["critic/grad_norm"] > 0 and x["actor/grad_norm"] > 0, x["step"]
        _same_models(want, got)
        # the critic's stages in the checkpoint: one step at PP2, saved, resumed at PP2 for the second
        part, _ = run_steps(_cfg(tmp / "part", *f64, "parallel.pp=2", "trainer.total_training_steps=1"))
        part.save()
        saved = [gather_model_state(unwrap(m), part.groups) for m in (part.policy, part.actor.critic.model)]
        # ... which loads at parallel.tp=2 (megatron's dist checkpointing reshards the stages, the head included)
        _same_models(
            saved, _resumed(_cfg(tmp / "part", *f64, "parallel.tp=2", "trainer.total_training_steps=1"))
        )
        again, magain = run_steps(_cfg(tmp / "part", *f64, "parallel.pp=2", "trainer.resume_mode=auto"))
        assert again.step == 2 and magain[-1]["_tokens"] == mgot[-1]["_tokens"]
        _same_models(want, again)
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)


def _resumed(cfg: Any) -> Any:
    """A Trainer of `cfg` resumed from its newest checkpoint (no step run)."""
    from megatron_branch.train.loop import Trainer

    tr = Trainer(dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, resume_mode="auto")))
    assert tr.step == cfg.trainer.total_training_steps
    return tr


def _same_models(want: list[dict[str, torch.Tensor]], tr: Any) -> None:
    """The trainer's policy and critic equal `want` (whole-model tensors), 1e-9 per tensor."""
    for a, m in zip(want, (tr.policy, tr.actor.critic.model), strict=True):
        b = gather_model_state(unwrap(m), tr.groups)
        assert a.keys() == b.keys()
        for k in a:
            assert float((a[k] - b[k]).norm() / a[k].norm().clamp(min=1e-30)) <= 1e-9, k


@pytest.mark.world(2)
def test_pipeline_critic_verl_pp2_switch_equals_verl() -> None:
    """verl's value model (PPO's critic, its one-output head on the last stage) at pipeline_model_parallel_size=2:
    with the switch (megatron-branch's pipelined schedule) == without (megatron's own pipeline schedule):
    compute_values on the collecting rank, every gradient on EACH stage (fp32 1e-5), verl's vf_loss."""
    pytest.importorskip("verl", reason="the verl extra is not installed (make setup-verl)")
    import os

    from megatron.core import parallel_state as ps
    from verl_helpers import critic_config, grpo_batch, make_worker, max_rel_step_error, run_step, set_switch
    from verl_helpers import shared_policy_dir as verl_policy_dir

    os.environ.setdefault("MASTER_PORT", "0")  # verl's Worker reads it; the process group already exists
    hf = verl_policy_dir()
    critic = critic_config(ppo_mini_batch_size=16)

    def td() -> Any:
        return grpo_batch(seed=9, groups=4, critic=True)

    set_switch(False)
    base = run_step(make_worker(hf, pp=2, value=True, optimizer="sgd"), td, critic=critic)
    set_switch(True)
    try:
        tree = run_step(make_worker(hf, pp=2, value=True, optimizer="sgd"), td, critic=critic)
    finally:
        set_switch(False)
    assert tree.engine.startswith("BranchReplay") and not base.engine.startswith("BranchReplay")
    collects = ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
    assert (base.log_probs is None) == (tree.log_probs is None) == (not collects)
    err, name = max_rel_step_error(base, tree)
    assert err <= 1e-5, f"critic pp2 stage {dist.get_rank()} {name}: {err:.2e}"
    if collects:
        torch.testing.assert_close(tree.log_probs, base.log_probs, rtol=1e-5, atol=1e-5)
        got, want = float(tree.metrics["critic/vf_loss"][0]), float(base.metrics["critic/vf_loss"][0])
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert (
            tree.metrics["tree/positions_computed"][0] < tree.metrics["tree/positions_logical"][0]
        )  # shared
