"""Per-layer activation checkpointing inside chunks (ScheduleOptions.recompute_layers, models/layer_checkpoint.py).

Exact against naive per-rollout training per parameter (float64 1e-9, float32 1e-5) in replay (with and without
segment recompute: with it, the planner's `recompute full`), packed and naive-fused, on a tree whose shared
response tokens carry different advantages; every layer of every forward under grad really rebuilt once; scoring
untouched; the recomputation captures nothing; planted bugs caught; the activation meter's peak drops by what the
planner predicts. TP2 + SP and CP2: tests/distributed/test_ring_cp.py.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch.utils.checkpoint import CheckpointError, checkpoint

from megatron_branch.attention.context import LocalContext
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch
from megatron_branch.models import layer_checkpoint as lc
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import Layout, RolloutShape
from megatron_branch.plan.measure import measure_step
from megatron_branch.plan.memory import step_peak
from megatron_branch.schedule import ScheduleOptions, StepResult, run_schedule, score_rollouts
from megatron_branch.testing import random_tree_rollouts, tiny_branch_model, tiny_qwen2

VOCAB = 37
TOL = {torch.float64: 1e-9, torch.float32: 1e-5}
PLAN_TOL = 0.04  # test_plan.py's tolerance for planner bytes against the meter (measured: within 0.3%)
# two levels below the prompt: the first response tokens are shared by rollouts with different advantages
TREE = dict(prompt_len=7, branches=3, levels=2, seed=202)
CASES = {
    "replay+recompute (full)": ("replay", {"recompute": True}),
    "replay": ("replay", {}),
    "packed": ("packed", {}),
    "naive-fused": ("naive-fused", {}),
}


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


@pytest.fixture(scope="module")
def models() -> dict[torch.dtype, torch.nn.Module]:
    return {dtype: tiny_branch_model(dtype) for dtype in TOL}


def step(
    model: torch.nn.Module, rollouts: list[Rollout], schedule: str, **kw: Any
) -> tuple[dict[str, torch.Tensor], StepResult]:
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule,
        model,
        tree,
        obj,
        ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, **{"chunk_tokens": None, **kw}),
    )
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, res


def max_rel_err(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    return max(((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-30)).item() for n in want)


def count_recomputations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Spy on the recomputations (each enters count_recomputed once); returns the live list of calls."""
    calls: list[int] = []
    real = lc.count_recomputed

    def spy() -> Any:
        calls.append(1)
        return real()

    monkeypatch.setattr(lc, "count_recomputed", spy)
    return calls


@pytest.mark.parametrize("dtype", list(TOL), ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_exact_against_naive(
    models: dict[torch.dtype, torch.nn.Module], case: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, rollouts = models[dtype], random_tree_rollouts(**TREE)
    want, ref = step(model, rollouts, "naive")
    calls = count_recomputations(monkeypatch)
    schedule, kw = CASES[case]
    got, res = step(model, rollouts, schedule, recompute_layers=True, **kw)
    assert max_rel_err(got, want) <= TOL[dtype]
    torch.testing.assert_close(
        res.target_logprobs, ref.target_logprobs, equal_nan=True, rtol=TOL[dtype], atol=0
    )
    # every layer of every forward run under grad was rebuilt once in backward: nothing silently kept whole
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    no_grad = sum(1 for s in tree.segments if s.children) if kw.get("recompute") else 0
    assert len(calls) == model.config.num_layers * (res.forwards - no_grad) > 0


def test_scoring_is_untouched(
    models: dict[torch.dtype, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forward-only (no_grad) never checkpoints: the same numbers bit for bit, and checkpoint is never called."""
    model, rollouts = models[torch.float64], random_tree_rollouts(**TREE)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    plain = score_rollouts("replay", model, tree, ScheduleOptions(vocab_size=VOCAB, chunk_tokens=None))
    used: list[int] = []
    monkeypatch.setattr(lc, "checkpoint", lambda *a, **k: used.append(1) or checkpoint(*a, **k))
    ckpt = score_rollouts(
        "replay", model, tree, ScheduleOptions(vocab_size=VOCAB, recompute_layers=True, chunk_tokens=None)
    )
    assert used == []
    for a, b in zip(plain.logprobs, ckpt.logprobs, strict=True):
        assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


def test_recomputation_captures_nothing(
    models: dict[torch.dtype, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Attention inside backward (the recomputation) runs with capture off and its context re-attached."""
    model, rollouts = models[torch.float64], random_tree_rollouts(**TREE)
    seen: list[tuple[bool, bool]] = []  # (in backward, capture)
    real = LocalContext.attend

    def attend(self: LocalContext, *a: Any, **kw: Any) -> torch.Tensor:
        seen.append((torch._C._current_graph_task_id() != -1, self.capture))
        return real(self, *a, **kw)

    monkeypatch.setattr(LocalContext, "attend", attend)
    step(model, rollouts, "replay", recompute_layers=True)
    in_backward = [capture for backward, capture in seen if backward]
    assert in_backward and not any(in_backward)  # recomputed (re-attached: attend ran), never captured
    assert any(capture for backward, capture in seen if not backward)  # the first forwards did capture


def test_planted_bug_capture_during_recompute_keeps_rebuilt_layers_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A recomputation that captured again would keep every rebuilt layer's graph alive (through the captured
    K/V) until the segment's backward ends: the recomputation-captures-nothing test fails, and the meter sees it."""
    arch, model = tiny_arch_model(32, 2)
    shape = RolloutShape(prompt_length=64, responses=8, response_length=8)
    good = measure_step(model, shape, vocab=VOCAB, branch_micro_batch=4, recompute_layers=True).saved_peak
    monkeypatch.setattr(LocalContext, "for_recompute", lambda self: self)
    bad = measure_step(model, shape, vocab=VOCAB, branch_micro_batch=4, recompute_layers=True).saved_peak
    assert bad > good
    with pytest.raises(AssertionError):
        test_recomputation_captures_nothing({torch.float64: tiny_branch_model(torch.float64)}, monkeypatch)


def test_planted_bug_missing_reattach_is_caught(
    models: dict[torch.dtype, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the re-attach the recomputation runs megatron's own attention (no context in backward): torch's
    checkpoint sees it save other tensors than the forward did and the step fails instead of training wrong."""
    monkeypatch.setattr(lc, "attached", lambda core, ctx: contextlib.nullcontext())
    for schedule in ("replay", "packed"):
        with pytest.raises(CheckpointError):
            step(models[torch.float64], random_tree_rollouts(**TREE), schedule, recompute_layers=True)


def test_planted_bug_reentrant_checkpoint_is_caught(
    models: dict[torch.dtype, torch.nn.Module], monkeypatch: pytest.MonkeyPatch
) -> None:
    """megatron's reentrant checkpoint runs the forward under no_grad: the K/V a segment captures for its children
    come out without a graph, so replay cannot inject the children's dK/dV into them."""
    model, rollouts = models[torch.float64], random_tree_rollouts(**TREE)
    want, _ = step(model, rollouts, "naive")
    real = lc.checkpoint
    monkeypatch.setattr(lc, "checkpoint", lambda fn, *a, **k: real(fn, *a, use_reentrant=True))
    with pytest.raises(RuntimeError, match="does not require grad"):
        step(model, rollouts, "replay", recompute_layers=True)
    # what the module docstring says was measured: chunks that capture nothing (leaves reading cached K/V) would
    # be exact even reentrant, their dK/dV reach the cached leaves through the reentrant inner backward
    monkeypatch.setattr(lc, "checkpoint", lambda fn, *a, **k: real(fn, *a, use_reentrant=not fn.ctx.capture))
    got, _ = step(model, rollouts, "replay", recompute_layers=True)
    assert max_rel_err(got, want) <= TOL[torch.float64]


def test_refused_where_it_would_do_nothing(models: dict[torch.dtype, torch.nn.Module]) -> None:
    with pytest.raises(ValueError, match="naive schedule"):
        step(models[torch.float64], random_tree_rollouts(**TREE), "naive", recompute_layers=True)


def tiny_arch_model(hidden: int, layers: int) -> tuple[ModelArch, torch.nn.Module]:
    """test_plan.py's tiny Qwen2 (float32)."""
    return tiny_qwen2(hidden, layers, torch.float32, vocab_size=VOCAB)


@pytest.mark.slow
@pytest.mark.parametrize("segment_recompute", [False, True])
def test_meter_peak_drops_as_the_planner_predicts(
    segment_recompute: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The activation meter against plan/memory.py's `full` terms (layer inputs + one rebuilt layer + the head),
    with the tolerance test_plan.py uses; and the drop from keeping every layer's graph."""
    arch, model = tiny_arch_model(48, 3)
    shape = RolloutShape(prompt_length=300, responses=12, response_length=16)

    def measured(layers: bool) -> int:
        return measure_step(
            model,
            shape,
            vocab=VOCAB,
            branch_micro_batch=4,
            recompute=segment_recompute,
            recompute_layers=layers,
        ).saved_peak

    def planned(layers: bool) -> int:
        return step_peak(
            arch,
            shape,
            Layout(),
            act_bytes=4,
            branch_micro_batch=4,
            segment_recompute=segment_recompute,
            layer_recompute=layers,
        ).saved

    kept, ckpt = measured(False), measured(True)
    assert ckpt < 0.6 * kept
    assert planned(True) == pytest.approx(ckpt, rel=PLAN_TOL)
    assert planned(False) - planned(True) == pytest.approx(kept - ckpt, rel=PLAN_TOL)
    # planted: a meter blind to what the recomputation rebuilds (no count_recomputed) is far below the planner
    monkeypatch.setattr(lc, "count_recomputed", contextlib.nullcontext)
    assert abs(planned(True) - measured(True)) > PLAN_TOL * planned(True)


def test_patched_megatron_spec_checkpoints_too() -> None:
    """A user's patched megatron spec (integration.patch_layer_spec) gets the same layer: replay with
    recompute_layers on megatron's plain GPTModel is exact against naive (float32, 1e-5)."""
    from dropin_helpers import build_patched_gpt, tiny_arch

    from megatron_branch.models.layer_checkpoint import uses_layer_checkpointing

    model, rollouts = build_patched_gpt(tiny_arch()), random_tree_rollouts(**TREE)
    assert uses_layer_checkpointing(model)
    want, _ = step(model, rollouts, "naive")
    got, _ = step(model, rollouts, "replay", recompute=True, recompute_layers=True, fused_logprobs=False)
    assert max_rel_err(got, want) <= TOL[torch.float32]


def test_packed_meter_peak_matches_the_planner() -> None:
    """packed (the whole tree in one checkpointed chunk): layer inputs + the larger of head and one layer."""
    arch, model = tiny_arch_model(32, 2)
    shape = RolloutShape(prompt_length=64, responses=8, response_length=8)
    got = measure_step(model, shape, vocab=VOCAB, schedule="packed", recompute_layers=True)
    pk = step_peak(arch, shape, Layout(), schedule="packed", act_bytes=4, layer_recompute=True)
    assert pk.saved == pytest.approx(got.saved_peak, rel=PLAN_TOL)
    kept = measure_step(model, shape, vocab=VOCAB, schedule="packed").saved_peak
    assert got.saved_peak < 0.6 * kept
