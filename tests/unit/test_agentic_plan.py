"""`plan` on an agentic tree (issue 31 item 7, planner half): the bench's tree description, its exact positions
(the bench's count, checked against the prefix tree) and FLOPs naive vs tree (checked against a brute-force count
over the tree's distinct prefixes); bad descriptions one line, exit 2."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_branch.cli import main
from megatron_branch.data import PrefixTree
from megatron_branch.data.random_trees import agentic_tree_rollouts
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan.agentic import TurnTreeShape, turn_tree_flops, turn_tree_replay_saved
from megatron_branch.plan.flops import (
    LOGITS_MATMULS,
    attention_flops_per_pair,
    layer_matmul_flops_per_token,
    logits_flops_per_row,
    step_flops,
)
from megatron_branch.plan.measure import measure_step
from megatron_branch.plan.memory import step_peak
from megatron_branch.plan.model import Layout, RolloutShape
from megatron_branch.plan.presets import MODEL_PRESETS
from megatron_branch.testing import tiny_qwen2

SHAPES = [  # (prompt, leaves, turns, turn, observation, forks after)
    (11, 8, 4, 5, 3, (1, 3)),
    (7, 6, 3, 2, 4, (2,)),
    (5, 3, 2, 3, 0, ()),
]


def tree_shape(p: int, g: int, t: int, s: int, o: int, at: tuple[int, ...]) -> TurnTreeShape:
    return TurnTreeShape(
        prompt_length=p, responses=g, turn_length=s, turns=t, observation=o, branch_at_turns=at
    )


@pytest.mark.parametrize("shape", SHAPES, ids=["forks_1_3", "fork_2", "no_forks"])
def test_counts_and_flops_are_the_trees(shape: tuple) -> None:
    p, g, t, s, o, at = shape
    tree = tree_shape(*shape)
    rs = agentic_tree_rollouts(vocab_size=37, prompt_len=p, n=g, turns=t, turn_len=s, observation_len=o,
                               branch_at_turns=at)  # fmt: skip
    pt = PrefixTree.build(rs, vocab_size=37)
    assert tree.positions == (pt.positions_logical, pt.positions_computed)
    # brute force: every distinct prefix is one computed position attending to its own length in keys; those
    # longer than the prompt predict a response token (one output-projection row each)
    prefixes = {tuple(r.prompt + r.response)[:k] for r in rs for k in range(1, p + len(r.response) + 1)}
    assert len(prefixes) == pt.positions_computed
    arch = MODEL_PRESETS["qwen2.5-7b"]
    want = (
        3 * layer_matmul_flops_per_token(arch) * len(prefixes)
        + 3 * attention_flops_per_pair(arch) * sum(len(x) for x in prefixes)
        + LOGITS_MATMULS * logits_flops_per_row(arch) * sum(len(x) > p for x in prefixes)
    )
    fl = turn_tree_flops(arch, tree)
    assert fl["tree"] == pytest.approx(want, rel=1e-12)
    flat = RolloutShape(prompt_length=p, responses=g, response_length=tree.response_length)
    assert fl["naive"] == step_flops(arch, flat, "naive").total
    if not at:  # no forks below the prompt: the flat shape's packed FLOPs, the planner's own count
        assert fl["tree"] == pytest.approx(step_flops(arch, flat, "packed").total, rel=1e-12)
    else:
        assert fl["tree"] < step_flops(arch, flat, "packed").total < fl["naive"]


def test_plan_json_reports_the_tree(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "qwen2.5-7b", "--prompt-length", "8192", "--responses", "8", "--response-length",
            "1000", "--turns", "6", "--observation-length", "1000", "--branch-at-turns", "2,4", "--gpus", "8",
            "--gpu", "h100", "--json"]  # fmt: skip
    assert main(argv) in (0, 1)
    out = capsys.readouterr().out.strip().splitlines()
    t = json.loads(out[-1])["turn_tree"]
    tree = tree_shape(8192, 8, 6, 1000, 1000, (2, 4))
    assert (t["positions_logical"], t["positions_computed"]) == tree.positions
    # by hand: 8 x (8192 + 6*1000 + 5*1000); 8192 + 2*(2*2000) + 4*(2*2000) + 8*(2000 + 1000)
    assert tree.positions == (8 * 19192, 8192 + 8000 + 16000 + 24000)
    assert t["flops"]["ratio"] > 1 and any(line.startswith("agentic tree: 6 turns") for line in out)
    assert any("not modelled in the layout search" in line for line in out)
    rep = t["replay_saved_bytes_one_rank"]
    assert 0 < rep["tree"] < rep["flat"]
    # the tree's replay is priced segment by segment (no chunk model yet), beside the plan's own chunks
    assert rep["chunk_tokens"] is None and json.loads(out[-1])["chunk_tokens"] == 4096


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            ["--turns", "3", "--branch-at-turns", "3"],
            "--branch-at-turns must be strictly increasing turns in (0",
        ),
        (
            ["--observation-length", "4"],
            "--observation-length and --branch-at-turns describe turns: give --turns",
        ),
        (
            ["--turns", "3", "--branch-at-turns", "1,2", "--responses", "6"],
            "--responses 6 must be divisible by",
        ),
        (
            ["--turns", "3", "--shared-response-length", "2"],
            "--shared-response-length and --turns both shape",
        ),
        (["--turns", "-1"], "--turns -1 / --observation-length 0 must be >= 0"),
    ],
)
def test_bad_tree_is_one_line_exit_2(argv: list[str], match: str, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["plan", "--model", "qwen2.5-7b", "--prompt-length", "64", "--responses", "8", "--response-length", "16",
            "--gpus", "1", "--gpu", "h100"]  # fmt: skip
    assert main([*base, *argv]) == 2
    cap = capsys.readouterr()
    assert match in cap.err.strip() and len(cap.err.strip().splitlines()) == 1 and not cap.out


TURN_HEAVY = (
    16,
    8,
    3,
    16,
    24,
    (1, 2),
)  # the path's turns outweigh the prompt: its cache is no rounding error
TOL = 0.04  # the step's saved bytes against the meter, as tests/unit/test_plan.py holds the planner's other terms


@pytest.mark.parametrize("schedule,recompute", [("replay", False), ("replay", True), ("packed", False)])
def test_tree_memory_against_the_meter(schedule: str, recompute: bool) -> None:
    """replay's peak for the tree (the deepest path's segments, their cached K/V and sums, a leaf micro-batch)
    equals the activation meter within TOL; the flat shape's plan (what the layout search uses) bounds it from
    above and is far off with forks (1.5x-1.8x), so a tree model that fell back to it would fail."""
    initialize_parallel(ParallelConfig())
    for (p, g, t, s, o, at), (h, layers, dtype) in [
        ((64, 8, 4, 4, 4, (1, 3)), (32, 2, torch.float32)),
        ((128, 8, 3, 8, 16, (2,)), (64, 3, torch.float64)),
        ((200, 4, 2, 6, 6, ()), (32, 2, torch.float32)),
        (TURN_HEAVY, (32, 2, torch.float32)),
    ]:
        arch, model = tiny_qwen2(h, layers, dtype, vocab_size=37)
        tree = tree_shape(p, g, t, s, o, at)
        rs = agentic_tree_rollouts(vocab_size=37, prompt_len=p, n=g, turns=t, turn_len=s, observation_len=o,
                                   branch_at_turns=at)  # fmt: skip
        got = measure_step(model, tree.flat(), vocab=37, schedule=schedule, branch_micro_batch=4,
                           recompute=recompute, rollouts=rs)  # fmt: skip
        assert got.positions_computed == tree.positions[1]
        kw = dict(act_bytes=dtype.itemsize, branch_micro_batch=4, segment_recompute=recompute)
        flat = step_peak(arch, tree.flat(), Layout(), schedule=schedule, layer_recompute=False, **kw).saved
        assert got.saved_peak <= flat, (got, flat)
        if schedule == "replay":
            planned = turn_tree_replay_saved(arch, tree, **kw)
            assert planned == pytest.approx(got.saved_peak, rel=TOL)
            if recompute:  # no graph held on the path: the meter's bytes exactly
                assert planned == got.saved_peak
            assert flat > (1.5 if at else 1.0) * got.saved_peak * (1 - TOL)


@pytest.mark.parametrize("planted", ["no_kv_sums", "only_the_prompt_cached"])
def test_planted_path_error_is_caught(planted: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison can fail: under segment recompute a model that forgot the path's dK/dV sums, or cached only
    the prompt's K/V, is 8-10% off the meter on a turn-heavy tree."""
    from megatron_branch.plan import activations

    initialize_parallel(ParallelConfig())
    p, g, t, s, o, at = TURN_HEAVY
    arch, model = tiny_qwen2(32, 2, torch.float32, vocab_size=37)
    tree = tree_shape(*TURN_HEAVY)
    rs = agentic_tree_rollouts(vocab_size=37, prompt_len=p, n=g, turns=t, turn_len=s, observation_len=o,
                               branch_at_turns=at)  # fmt: skip
    got = measure_step(model, tree.flat(), vocab=37, branch_micro_batch=4, recompute=True, rollouts=rs)
    real = activations.layer_kv_bytes
    if planted == "no_kv_sums":
        monkeypatch.setattr(activations, "kv_grad_bytes", lambda dm, n: 0)
    else:
        monkeypatch.setattr(activations, "layer_kv_bytes", lambda dm, n: real(dm, n) if n == p else 0)
    wrong = turn_tree_replay_saved(arch, tree, act_bytes=4, branch_micro_batch=4, segment_recompute=True)
    assert wrong != pytest.approx(got.saved_peak, rel=TOL)
