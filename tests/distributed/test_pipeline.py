"""The tree schedules under pipeline parallelism (schedule/pipeline.py) against the single-rank float64 oracle.

    python tests/distributed/launch.py 2 -k pipeline     # PP2 (untied and tied embeddings), orders, planted bugs
    python tests/distributed/launch.py 4 -k pipeline     # PP4, TP2 x PP2 + SP, CP2 x PP2, DP2 x PP2

Every layout also runs replay with its roots cut into 3 sequence pieces (`root_pieces`, data/pieces.py), which
flow through the stages like micro-batches; PP2 also with segment recompute, forward-only (DPO's scoring pass),
the order and overlap of the pieces on the stages, and two planted bugs of the pieces.

The oracle is HF in float64 with exact norms, every rollout alone through the objective's own per-rollout loss
(naive training's formula; tests/distributed/test_objectives_parallel.py). Per parameter: float64 1e-9, float32
1e-5. The trees share prompts and response beginnings (two levels of branching) and the tokens carry per-rollout
old/ref logprobs and per-token advantages, so a shared token has different loss terms in different rollouts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from test_objectives_parallel import VOCAB, _close, _dpo_rollouts, _m, _mask, _objective, _oracle, _rollouts

from megatron_branch.checkpoint.param_map import hf_to_mcore_state, mcore_to_hf_state
from megatron_branch.checkpoint.stages import gather_model_grads, load_stage
from megatron_branch.data import PrefixTree, Rollout, write_rollouts_jsonl
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, ParallelGroups, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, pipeline_stage
from megatron_branch.schedule import pipeline as pipeline_mod
from megatron_branch.schedule.prefix_cache import PrefixCache
from megatron_branch.testing import exact_hf_norms, tiny_hf_config, tiny_hf_model

LAYERS = 4
LAYOUTS = {
    2: {"pp2": ParallelConfig(pp=2)},
    4: {
        "pp4": ParallelConfig(pp=4),
        "tp2pp2sp": ParallelConfig(tp=2, pp=2, sequence_parallel=True),
        "cp2pp2": ParallelConfig(cp=2, pp=2),
        "dp2pp2": ParallelConfig(pp=2),  # two pipelines, one prompt group each
    },
}


def _hf(*, tie: bool = False) -> torch.nn.Module:
    config = tiny_hf_config("llama", vocab_size=VOCAB, num_layers=LAYERS, tie=tie)
    return exact_hf_norms(tiny_hf_model(config, seed=9, dtype=torch.float64))


def _stage_policy(hf: torch.nn.Module, groups: ParallelGroups, dtype: torch.dtype) -> torch.nn.Module:
    """This rank's stage of the policy, loaded from the oracle's weights (tied: the last stage's copy too)."""
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(
        arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel, pp=groups.pp_size,
        pp_rank=groups.pp_rank,
    )  # fmt: skip
    state = hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(groups.tp_size))
    load_stage(model, ((k, v.to(dtype)) for k, v in state.items()), groups)  # asserts every parameter filled
    return model


def _pp_grads(
    hf: torch.nn.Module,
    model: torch.nn.Module,
    rollouts: list[Rollout],
    objective: object,
    groups: ParallelGroups,
    schedule: str,
    **options: Any,
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """(global metrics, whole-model gradients by HF name) of one gradient pass (accumulate + finalize)."""
    metrics, full = pp_pass(model, rollouts, objective, groups, schedule, **options)
    return metrics, mcore_to_hf_state(full, ModelArch.from_hf_config(hf.config))


def pp_pass(
    model: torch.nn.Module,
    rollouts: list[Rollout],
    objective: object,
    groups: ParallelGroups,
    schedule: str,
    **options: Any,
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """(global metrics, whole-model gradients by megatron name) of one gradient pass (accumulate + finalize)."""
    from megatron_branch.update import UpdatePlan, accumulate_gradients, finalize, reduce_metrics

    kw = {"branch_micro_batch": 2, **options} if schedule == "replay" else options
    plan = UpdatePlan(
        opts=ScheduleOptions(groups=groups, vocab_size=VOCAB, **{"chunk_tokens": None, **kw}),
        schedule=schedule,
    )
    model.zero_grad(set_to_none=True)
    acc = accumulate_gradients(model, rollouts, objective, plan)  # type: ignore[arg-type]
    finalize(model, plan)  # SP norms over TP, SUM over DP x CP, the tied embedding over its two stages
    return reduce_metrics(acc, objective, groups), gather_model_grads(model, groups)


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    return max(((got[n].double() - g).norm() / g.norm()).item() for n, g in want.items())


def _policy_case(layout: str, dtype: torch.dtype, *, tie: bool = False) -> None:
    hf, rollouts = _hf(tie=tie), _rollouts()
    objective = _objective(rollouts)
    want_loss, want = _oracle(hf, rollouts, objective)
    groups = initialize_parallel(LAYOUTS[dist.get_world_size()][layout])
    model = _stage_policy(hf, groups, dtype)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    runs: list[tuple[str, dict[str, Any]]] = [("replay", {}), ("packed", {}), ("replay", {"root_pieces": 3})]
    if layout == "pp2":  # the other order, segment recompute and the unshared baseline, once
        runs += [
            ("replay", {"pipeline_order": "gpipe"}),
            ("replay", {"recompute": True}),
            ("replay", {"recompute": True, "root_pieces": 3}),
            ("naive-fused", {}),
            # small subtrees packed by a token budget (schedule/walk.py), the whole forest in one chunk, and with
            # segment recompute the roots too large for a budget of 16 tokens cached
            ("replay", {"chunk_tokens": 10_000}),
            ("replay", {"chunk_tokens": 16, "recompute": True}),
        ]
    for schedule, options in runs:
        metrics, grads = _pp_grads(hf, model, rollouts, objective, groups, schedule, **options)
        assert metrics["actor/loss"] == pytest.approx(want_loss, rel=tol), (schedule, options)
        _close(grads, want, tol)
        assert 0 < metrics["actor/pg_clipfrac"] < 1 and metrics["actor/entropy"] > 0


@pytest.mark.world(2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_pipeline_policy_objective_pp2(dtype: torch.dtype, tie: bool) -> None:
    _policy_case("pp2", dtype, tie=tie)


@pytest.mark.world(4)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("layout", list(LAYOUTS[4]))
def test_pipeline_policy_objective_world4(layout: str, dtype: torch.dtype) -> None:
    _policy_case(layout, dtype, tie=layout == "tp2pp2sp")


@pytest.mark.world(2)
def test_pipeline_masked_policy_and_dpo_pp2() -> None:
    """Loss masks (issue 31) through the stages: GRPO with seq-mean-token-sum (an all-context rollout must not
    count) under replay, packed, root pieces and the unshared naive-fused baseline, and IPO over trained tokens;
    float64 1e-9 against HF per rollout."""
    from megatron_branch.losses import Aggregation, DPOObjective

    hf, rollouts = _hf(), _mask(_rollouts(), seed=71)
    objective = _objective(rollouts)
    objective.agg = Aggregation.of_batch(rollouts, "seq-mean-token-sum")
    want_loss, want = _oracle(hf, rollouts, objective)
    groups = initialize_parallel(LAYOUTS[2]["pp2"])
    model = _stage_policy(hf, groups, torch.float64)
    for schedule, options in [
        ("replay", {}),
        ("packed", {}),
        ("replay", {"root_pieces": 3}),
        ("naive-fused", {}),
    ]:
        metrics, grads = _pp_grads(hf, model, rollouts, objective, groups, schedule, **options)
        assert metrics["actor/loss"] == pytest.approx(want_loss, rel=1e-9), (schedule, options)
        _close(grads, want, 1e-9)

    pairs = [dataclasses.replace(r, loss_mask=[*_m(r)[:-1], 1]) for r in _mask(_dpo_rollouts(), seed=72)]
    dpo = DPOObjective(num_pairs=4, beta=0.5, loss_type="ipo")
    hf.zero_grad(set_to_none=True)
    pis = []
    for r in pairs:
        seq = torch.tensor([list(r.prompt) + list(r.response)])
        lp = (
            torch.log_softmax(hf(input_ids=seq).logits[0, :-1], dim=-1).gather(1, seq[0, 1:, None]).squeeze(1)
        )
        pis.append((lp[len(r.prompt) - 1 :] * torch.tensor(_m(r), dtype=lp.dtype)).sum())
    oracle, _ = dpo.loss(PrefixTree.build(pairs, vocab_size=VOCAB), torch.stack(pis))
    oracle.backward()
    want = {n: p.grad.clone() for n, p in hf.named_parameters()}
    for schedule in ("replay", "packed"):
        metrics, grads = _pp_grads(hf, model, pairs, dpo, groups, schedule)
        assert metrics["actor/loss"] == pytest.approx(float(oracle), rel=1e-9)
        _close(grads, want, 1e-9)


def _dpo_case(layout: str, dtype: torch.dtype) -> None:
    """DPO: the forward-only pass (scored through the pipeline, broadcast from the last stage), then the
    linearised gradient pass, against autograd through HF's per-rollout logprob sums."""
    from megatron_branch.losses import DPOObjective

    hf, rollouts = _hf(), _dpo_rollouts()
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    assert tree.positions_computed < tree.positions_logical
    dpo = DPOObjective(num_pairs=4, beta=0.5, loss_type="sigmoid")
    hf.zero_grad(set_to_none=True)
    pis = []
    for r in rollouts:
        seq = torch.tensor([list(r.prompt) + list(r.response)])
        logq = torch.log_softmax(hf(input_ids=seq).logits[0, :-1], dim=-1)
        pis.append(logq.gather(1, seq[0, 1:, None]).squeeze(1)[len(r.prompt) - 1 :].sum())
    oracle, _ = dpo.loss(tree, torch.stack(pis))
    oracle.backward()
    want = {n: p.grad.clone() for n, p in hf.named_parameters()}
    groups = initialize_parallel(LAYOUTS[dist.get_world_size()][layout])
    model = _stage_policy(hf, groups, dtype)
    tol = 1e-9 if dtype == torch.float64 else 1e-5
    runs: list[tuple[str, dict[str, Any]]] = [("replay", {}), ("packed", {})]
    if layout == "pp2":  # the scoring pass through root pieces (forward-only), then their gradient pass
        runs.append(("replay", {"root_pieces": 2}))
    for schedule, options in runs:
        metrics, grads = _pp_grads(hf, model, rollouts, dpo, groups, schedule, **options)
        assert metrics["actor/loss"] == pytest.approx(float(oracle), rel=tol)
        _close(grads, want, tol)


@pytest.mark.world(2)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_pipeline_dpo_pp2(dtype: torch.dtype) -> None:
    _dpo_case("pp2", dtype)


@pytest.mark.world(4)
@pytest.mark.parametrize("layout", list(LAYOUTS[4]))
def test_pipeline_dpo_world4(layout: str) -> None:
    _dpo_case(layout, torch.float64)


# ---- the order and the planted bugs (PP2) ----------------------------------------------------------------------
def _events(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record this stage's chunk forwards (F<rows>) and backwards (B<rows>), in order."""
    log: list[str] = []
    real_f, real_b = pipeline_mod._Stage.forward, pipeline_mod._Stage.backward

    def forward(self: Any, chunk: Any, received: Any, **kw: Any) -> Any:
        log.append(f"F{chunk.num_real}{'c' if kw['capture'] else ''}")
        return real_f(self, chunk, received, **kw)

    def backward(self: Any, run: Any, *args: Any) -> Any:
        log.append(f"B{run.chunk.num_real}{'c' if run.captured else ''}")
        return real_b(self, run, *args)

    monkeypatch.setattr(pipeline_mod._Stage, "forward", forward)
    monkeypatch.setattr(pipeline_mod._Stage, "backward", backward)
    return log


@pytest.mark.world(2)
def test_pipeline_leaf_waves_run_in_1f1b_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """One prompt, three leaf micro-batches of one leaf (lengths 3, 2, 4): the root forward first, then on stage 0
    one warm-up forward, 1F1B, the cool-down; on the last stage forward/backward alternate; the root's backward
    last, once. gpipe: all three forwards, then all backwards."""
    from megatron_branch.losses import PolicyGradientObjective

    prompt = [5, 6, 7, 8, 9]
    rollouts = [Rollout(prompt=prompt, response=r, advantage=a) for r, a in
                (([1, 2, 3], 1.0), ([2, 3], -0.5), ([3, 4, 5, 6], 0.25))]  # fmt: skip
    hf = _hf()
    objective = PolicyGradientObjective.grpo([r.advantage for r in rollouts], 9)
    groups = initialize_parallel(ParallelConfig(pp=2))
    model = _stage_policy(hf, groups, torch.float64)
    log = _events(monkeypatch)
    expect = {
        "1f1b": {0: "F5c F3 F2 B3 F4 B2 B4 B5c", 1: "F5c F3 B3 F2 B2 F4 B4 B5c"},
        "gpipe": {0: "F5c F3 F2 F4 B3 B2 B4 B5c", 1: "F5c F3 F2 F4 B3 B2 B4 B5c"},
    }
    for order, want in expect.items():
        log.clear()
        _pp_grads(
            hf, model, rollouts, objective, groups, "replay", branch_micro_batch=1, pipeline_order=order
        )
        assert " ".join(log) == want[groups.pp_rank], (order, log)


@pytest.mark.world(2)
@pytest.mark.parametrize("bug", ["stage_drops_prefix_gradient", "root_backward_before_leaves"])
def test_pipeline_planted_bugs_are_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hf, rollouts = _hf(), _rollouts()
    objective = _objective(rollouts)
    _, want = _oracle(hf, rollouts, objective)
    groups = initialize_parallel(ParallelConfig(pp=2))
    model = _stage_policy(hf, groups, torch.float64)
    _, grads = _pp_grads(hf, model, rollouts, objective, groups, "replay")
    assert _worst(grads, want) <= 1e-9  # the unplanted run is exact
    if bug == "stage_drops_prefix_gradient":
        if groups.pp_rank == 0:  # one stage forgets its layers' accumulated dK/dV (messages unchanged)
            monkeypatch.setattr(PrefixCache, "injection", lambda self, seg, captured: ([], []))
    else:
        monkeypatch.setattr(pipeline_mod._Pipeline, "run_segment", _early_backward)
    _, grads = _pp_grads(hf, model, rollouts, objective, groups, "replay")
    assert _worst(grads, want) > 1e-3, bug


@pytest.mark.world(2)
@pytest.mark.parametrize("schedule", ["replay", "packed", "naive-fused"])
def test_pipeline_runs_the_schedule_hooks_on_every_stage(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller's hook (schedule/hooks.py) is bound once per step on every stage and sees every forward of the
    stage (the last stage's and the others'); planted: the non-last stages' forwards outside the hooks."""
    from hook_helpers import CountingHook

    from megatron_branch.schedule import run_schedule

    hf, rollouts = _hf(), _rollouts()
    objective = _objective(rollouts)
    groups = initialize_parallel(ParallelConfig(pp=2))
    model = _stage_policy(hf, groups, torch.float64)
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)

    def step() -> tuple[CountingHook, Any]:
        hook = CountingHook()
        opts = ScheduleOptions(
            groups=groups, vocab_size=VOCAB, branch_micro_batch=2, hooks=(hook,), chunk_tokens=None
        )
        model.zero_grad(set_to_none=True)
        return hook, run_schedule(schedule, model, tree, objective, opts)

    hook, res = step()
    assert hook.events == [f"bind {schedule}", "run", "finish"]
    assert len(hook.rows) == res.forwards > 0, (groups.pp_rank, len(hook.rows), res.forwards)
    # a non-last stage's forward runs the hooks in schedule/pipeline_stage.py
    monkeypatch.setattr(pipeline_stage, "hook_forwards", lambda model, opts, where: contextlib.nullcontext())
    hook, res = step()
    assert (len(hook.rows) == res.forwards) == (groups.pp_rank == 1)  # only the last stage's forwards counted


def _early_backward(self: Any, seg_id: int) -> None:
    """A planted replay step: B(X) right after F(X), before any child has added its dK/dV (every stage alike)."""
    chunk = self._chunk([seg_id])
    received = self.link.recv_forward(self.stage.shape(chunk))
    run = self._forward(chunk, received, capture=True, grad=True)
    self.link.send_forward(run.output)
    self.positions += chunk.num_real
    self.cache.push(seg_id, run.captured, chunk.cache_rows, meta=chunk.cache_meta)
    outputs, grads = self.cache.injection(seg_id, run.captured)
    grad_output = self.link.recv_backward(self.stage.shape(chunk))
    self.link.send_backward(self.stage.backward(run, grad_output, outputs, grads))
    self._record(run)
    self.path.append(seg_id)
    self.run_children(self.tree.segments[seg_id].children)
    self.path.pop()
    self.cache.drop(seg_id)


# ---- root pieces: their order, their overlap, planted bugs (PP2) ---------------------------------------------------
@pytest.mark.world(2)
def test_root_pieces_run_forward_in_order_and_backward_in_reverse(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 5-token prompt cut into pieces of 2, 2, 1: every stage runs the pieces' forwards in order (each
    capturing its K/V), the leaf wave in 1F1B, then the pieces' backwards in reverse order."""
    from megatron_branch.losses import PolicyGradientObjective

    prompt = [5, 6, 7, 8, 9]
    rollouts = [Rollout(prompt=prompt, response=r, advantage=a) for r, a in
                (([1, 2, 3], 1.0), ([2, 3], -0.5), ([3, 4, 5, 6], 0.25))]  # fmt: skip
    hf = _hf()
    objective = PolicyGradientObjective.grpo([r.advantage for r in rollouts], 9)
    groups = initialize_parallel(ParallelConfig(pp=2))
    model = _stage_policy(hf, groups, torch.float64)
    log = _events(monkeypatch)
    _pp_grads(hf, model, rollouts, objective, groups, "replay", branch_micro_batch=1, root_pieces=3)
    want = {0: "F2c F2c F1c F3 F2 B3 F4 B2 B4 B1c B2c B2c", 1: "F2c F2c F1c F3 B3 F2 B2 F4 B4 B1c B2c B2c"}
    assert " ".join(log) == want[groups.pp_rank], log


@pytest.mark.world(2)
def test_root_pieces_overlap_on_the_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pieces fill the pipeline: stage 0 runs F(piece j + 1) while stage 1 runs F(piece j), and stage 1 runs
    B(piece j - 1) while stage 0 runs B(piece j). Each piece's forward and backward is slowed by 0.3 s (so that
    the order of the intervals is the schedule's, not the machine's); one clock (CLOCK_MONOTONIC) for both ranks."""
    import time

    from megatron_branch.losses import PolicyGradientObjective

    rollouts = [Rollout(prompt=[5, 6, 7, 8, 9, 10], response=r, advantage=a) for r, a in
                (([1, 2], 1.0), ([2, 3], -0.5))]  # fmt: skip
    hf = _hf()
    objective = PolicyGradientObjective.grpo([r.advantage for r in rollouts], 4)
    groups = initialize_parallel(ParallelConfig(pp=2))
    model = _stage_policy(hf, groups, torch.float64)
    spans: list[tuple[str, float, float]] = []
    real_f, real_b = pipeline_mod._Stage.forward, pipeline_mod._Stage.backward

    def timed(kind: str, real: Any, is_piece: Any) -> Any:
        def run(self: Any, first: Any, *args: Any, **kw: Any) -> Any:
            t0 = time.monotonic()
            out = real(self, first, *args, **kw)
            if is_piece(first, kw):
                time.sleep(0.3)
                spans.append((kind, t0, time.monotonic()))
            return out

        return run

    monkeypatch.setattr(pipeline_mod._Stage, "forward", timed("F", real_f, lambda c, kw: kw["capture"]))
    monkeypatch.setattr(
        pipeline_mod._Stage, "backward", timed("B", real_b, lambda run, kw: bool(run.captured))
    )
    _pp_grads(hf, model, rollouts, objective, groups, "replay", root_pieces=3)
    every: list[Any] = [None, None]
    dist.all_gather_object(every, spans, group=groups.pp)
    f = [[s for s in stage if s[0] == "F"] for stage in every]  # per stage: F(piece 0), F(1), F(2)
    b = [[s for s in stage if s[0] == "B"] for stage in every]  # per stage: B(piece 2), B(1), B(0)
    assert [len(x) for x in f + b] == [3, 3, 3, 3]
    for j in range(2):
        assert f[0][j + 1][1] < f[1][j][2], (j, f)  # stage 0's next piece starts before stage 1's ends
        assert b[1][j + 1][1] < b[0][j][2], (j, b)  # backward: from the last stage, the same overlap


@pytest.mark.world(2)
@pytest.mark.parametrize("bug", ["piece_backward_before_later_pieces", "piece_blind_to_earlier_pieces"])
def test_root_pieces_planted_bugs_are_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    hf, rollouts = _hf(), _rollouts()
    objective = _objective(rollouts)
    _, want = _oracle(hf, rollouts, objective)
    groups = initialize_parallel(ParallelConfig(pp=2))
    model = _stage_policy(hf, groups, torch.float64)
    _, grads = _pp_grads(hf, model, rollouts, objective, groups, "replay", root_pieces=3)
    assert _worst(grads, want) <= 1e-9  # the unplanted run is exact
    if bug == "piece_backward_before_later_pieces":
        monkeypatch.setattr(pipeline_mod._Pipeline, "run_segment", _pieces_backward_in_forward_order)
    else:
        real = pipeline_mod.split_roots
        monkeypatch.setattr(pipeline_mod, "split_roots", lambda tree, k: _blind_pieces(tree, real(tree, k)))
    _, grads = _pp_grads(hf, model, rollouts, objective, groups, "replay", root_pieces=3)
    assert _worst(grads, want) > 1e-3, bug


def _pieces_backward_in_forward_order(
    self: Any, seg_id: int, _real: Any = pipeline_mod._Pipeline.run_segment
) -> None:
    """A planted walk of a root chain: the pieces' forwards, the leaves, then B(piece 0) first, so each piece's
    backward runs before the later pieces have added their dK/dV (every stage alike, so the messages match)."""
    seg = self.tree.segments[seg_id]
    if seg.parent >= 0 or len(seg.children) != 1:
        return _real(self, seg_id)
    chain = [seg_id]
    while len(self.tree.segments[chain[-1]].children) == 1:
        chain.append(self.tree.segments[chain[-1]].children[0])
    runs = []
    for sid in chain:
        chunk = self._chunk([sid])
        run = self._forward(chunk, self.link.recv_forward(self.stage.shape(chunk)), capture=True, grad=True)
        self.link.send_forward(run.output)
        self.positions += chunk.num_real
        self.cache.push(sid, run.captured, chunk.cache_rows, meta=chunk.cache_meta)
        self.path.append(sid)
        runs.append((sid, chunk, run))
    self.run_children(self.tree.segments[chain[-1]].children)
    for sid, chunk, run in runs:  # the planted order: forward order
        outputs, grads = self.cache.injection(sid, run.captured)
        grad_output = self.link.recv_backward(self.stage.shape(chunk))
        self.link.send_backward(self.stage.backward(run, grad_output, outputs, grads))
        self._record(run)
    for sid in reversed(chain):
        self.path.pop()
        self.cache.drop(sid)


def _blind_pieces(tree: PrefixTree, cut: PrefixTree) -> PrefixTree:
    """The cut tree with every piece attending to itself only (its earlier pieces dropped from its ancestors; the
    leaves below still see them all)."""

    cut_roots = [tree.segments[r] for r in tree.roots if tree.segments[r].children]
    pieces = {
        s.id for s in cut.segments if any(r.offset <= s.offset < r.offset + r.length for r in cut_roots)
    }
    blind = tuple(dataclasses.replace(s, ancestors=()) if s.id in pieces else s for s in cut.segments)
    return PrefixTree(rollouts=cut.rollouts, segments=blind, leaves=cut._leaves)


# ---- the command ------------------------------------------------------------------------------------------------
COMMAND_LAYOUTS = {
    2: [("pp2", ["--pp", "2"])],
    4: [("tp2pp2sp", ["--tp", "2", "--pp", "2", "--sequence-parallel"])],
}


@pytest.mark.world(2, 4)
def test_grad_command_pipeline_matches_hf(capsys: pytest.CaptureFixture[str]) -> None:
    """`megatron-branch grad --pp N` (float32, megatron DDP + finalize_model_grads) against the HF float64 oracle
    (the command's own loss: on-policy GRPO, token-mean), every rollout's logprobs on rank 0 complete."""
    from megatron_branch.cli import main
    from megatron_branch.testing import hf_policy_gradient

    rollouts = _rollouts()
    box: list[str | None] = [tempfile.mkdtemp(prefix="pp_grad_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    d = Path(str(box[0]))
    if dist.get_rank() == 0:
        config = tiny_hf_config("qwen2", vocab_size=VOCAB, num_layers=LAYERS, heads=4, kv_heads=2)
        tiny_hf_model(config, seed=4).save_pretrained(d / "hf")
        write_rollouts_jsonl(d / "r.jsonl", [Rollout(prompt=r.prompt, response=r.response, advantage=r.advantage)
                                             for r in rollouts])  # fmt: skip
    dist.barrier()
    from transformers import AutoModelForCausalLM

    hf = exact_hf_norms(AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.float64))
    _, want = hf_policy_gradient(hf, rollouts)
    for name, flags in COMMAND_LAYOUTS[dist.get_world_size()]:
        for schedule in ("replay", "packed"):
            out = d / f"{name}_{schedule}.safetensors"
            capsys.readouterr()
            rc = main(["grad", "--hf", str(d / "hf"), "--rollouts", str(d / "r.jsonl"), "--out", str(out),
                       "--schedule", schedule, "--branch-micro-batch", "2", *flags])  # fmt: skip
            lines = capsys.readouterr().out.strip().splitlines()
            assert rc == 0, (name, schedule)
            dist.barrier()
            _close(load_file(out), want, 1e-5)
            if dist.get_rank() == 0:
                assert json.loads(lines[-1])["pp"] == 2
