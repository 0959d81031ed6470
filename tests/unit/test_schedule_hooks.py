"""The schedule-hook seam (schedule/hooks.py): a per-step feature registered by the caller is bound once per step,
runs around the step, sees EVERY model forward of every schedule with the rows it runs, and finishes once; the
gradients are the hook-free ones (a hook that attaches nothing changes nothing). Pipeline stages: tests/distributed/
test_pipeline.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hook_helpers import CountingHook

from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import HOOKS, SCHEDULES, ScheduleOptions, run_schedule
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def _case(seed: int = 7):  # noqa: ANN202
    torch.manual_seed(seed)
    arch = ModelArch.from_hf_config(tiny_hf_config("llama"))
    model = build_model(arch, dtype=torch.float64)
    rollouts = random_tree_rollouts(prompt_len=6, branches=3, levels=2, seed=seed)
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    return arch, model, tree, obj


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_a_caller_hook_sees_every_forward_and_changes_nothing(schedule: str) -> None:
    arch, model, tree, obj = _case()
    opts = ScheduleOptions(vocab_size=arch.vocab_size, branch_micro_batch=2, chunk_tokens=None)
    model.zero_grad(set_to_none=True)
    plain = run_schedule(schedule, model, tree, obj, opts)
    want = _grads(model)
    hook = CountingHook()
    model.zero_grad(set_to_none=True)
    res = run_schedule(schedule, model, tree, obj, ScheduleOptions(vocab_size=arch.vocab_size, branch_micro_batch=2,
                                                                   hooks=(hook,), chunk_tokens=None))  # fmt: skip
    assert hook.events == [f"bind {schedule}", "run", "finish"]
    assert len(hook.rows) == res.forwards == plain.forwards > 0  # every model forward, no other
    assert res.stats["counting/forwards"] == res.forwards
    for where in hook.rows:  # each forward says which rows it runs
        assert (where.token_index is not None) != bool(where.rollouts)
    got = _grads(model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert res.loss == plain.loss


def test_forward_only_scoring_runs_the_hooks_too() -> None:
    arch, model, tree, _ = _case()
    hook = CountingHook()
    with torch.no_grad():
        res = run_schedule("replay", model, tree, None, ScheduleOptions(vocab_size=arch.vocab_size,
                           keep_logprobs=True, hooks=(hook,), chunk_tokens=None), forward_only=True)  # fmt: skip
    assert hook.events == ["bind replay", "run", "finish"] and len(hook.rows) == res.forwards


def test_the_router_plan_is_a_registered_hook_and_binds_nothing_for_a_dense_model() -> None:
    from megatron_branch.schedule.moe import ROUTER_PLAN

    assert ROUTER_PLAN in HOOKS
    arch, model, tree, _ = _case()
    assert (
        ROUTER_PLAN.bind(
            "replay", model, tree, ScheduleOptions(vocab_size=arch.vocab_size, chunk_tokens=None)
        )
        is None
    )


def test_planted_bug_a_forward_outside_the_hooks_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """If replay's chunk forward skipped `hook_forwards`, the count of hooked forwards would fall short."""
    from megatron_branch.schedule import common

    monkeypatch.setattr(common, "hook_forwards", lambda model, opts, where: contextlib.nullcontext())
    arch, model, tree, obj = _case()
    hook = CountingHook()
    res = run_schedule(
        "replay",
        model,
        tree,
        obj,
        ScheduleOptions(vocab_size=arch.vocab_size, hooks=(hook,), chunk_tokens=None),
    )
    assert len(hook.rows) != res.forwards


def test_a_caller_hook_composes_with_the_router_plan_and_sees_its_counting_pass() -> None:
    """A MoE policy with a balancing loss: the router plan (registered) binds first and runs its counting pass, a
    caller's hook binds after it and sees the counting pass's forwards as well as the step's; the gradients are
    the ones without the caller's hook, bit for bit."""
    from megatron_branch.losses.router import MoEOptions, RouterLossConfig

    arch = ModelArch.from_hf_config(tiny_hf_config("qwen3_moe", ffn=48, moe={"norm_topk_prob": False}))
    torch.manual_seed(3)
    model = build_model(arch, dtype=torch.float64)
    rollouts = random_tree_rollouts(prompt_len=5, branches=3, levels=2, seed=9)
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    moe = MoEOptions(losses=RouterLossConfig(aux_loss_coeff=0.1))
    model.zero_grad(set_to_none=True)
    plain = run_schedule(
        "replay", model, tree, obj, ScheduleOptions(vocab_size=arch.vocab_size, moe=moe, chunk_tokens=None)
    )
    want = _grads(model)
    hook = CountingHook()
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        "replay",
        model,
        tree,
        obj,
        ScheduleOptions(vocab_size=arch.vocab_size, moe=moe, hooks=(hook,), chunk_tokens=None),
    )
    assert hook.events == ["bind replay", "run", "finish"]
    assert len(hook.rows) == 2 * res.forwards  # the counting pass (forward-only) and the step
    assert any(k.startswith("moe/") or "router" in k or "aux" in k for k in res.stats), sorted(res.stats)
    assert {k: v for k, v in res.stats.items() if k != "counting/forwards"} == plain.stats
    got = _grads(model)
    for name in want:
        assert torch.equal(got[name], want[name]), name
