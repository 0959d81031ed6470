"""Agentic tree shapes for the bench (issue 31 item 7): a prompt, policy turns, tool outputs (loss_mask 0) and forks
at turns; positions logical / computed counted exactly, and `bench --turns ...` running such a tree."""

from __future__ import annotations

import json

import pytest

from megatron_branch.cli import main
from megatron_branch.data import PrefixTree
from megatron_branch.data.random_trees import agentic_positions, agentic_tree_rollouts

SHAPES = [
    dict(prompt_len=11, n=8, turns=4, turn_len=5, observation_len=3, branch_at_turns=(1, 3)),
    dict(prompt_len=7, n=6, turns=3, turn_len=2, observation_len=4, branch_at_turns=(2,)),
    dict(prompt_len=5, n=3, turns=2, turn_len=3, observation_len=0),
]


@pytest.mark.parametrize("shape", SHAPES, ids=["forks_1_3", "fork_2", "no_forks"])
def test_agentic_tree_counts_are_exact(shape: dict) -> None:
    rs = agentic_tree_rollouts(vocab_size=37, **shape)
    tree = PrefixTree.build(rs, vocab_size=37)
    logical, computed = agentic_positions(**shape)
    assert (tree.positions_logical, tree.positions_computed) == (logical, computed)
    if shape == SHAPES[0]:  # by hand: 8 x (11 + 4*5 + 3*3); 11 + 2*(5+3) + 4*(2*(5+3)) + 8*(5)
        assert (logical, computed) == (320, 11 + 16 + 64 + 40)
    t, s, o = shape["turns"], shape["turn_len"], shape["observation_len"]
    for r in rs:  # loss_mask 0 exactly on the observations
        want = ([True] * s + [False] * o) * (t - 1) + [True] * s
        assert list(r.loss_mask or [True] * len(r.response)) == want
    assert len(rs) == shape["n"] and len({tuple(r.response) for r in rs}) == shape["n"]


def test_bench_runs_an_agentic_tree(tmp_path, capsys) -> None:  # noqa: ANN001
    out = tmp_path / "b.json"
    argv = ["bench", "--preset", "tiny", "--turns", "3", "--response", "4", "--observation-length", "3",
            "--branch-at-turns", "1", "--branches", "4", "--prompt", "16", "--rounds", "1",
            "--variants", "replay", "--no-meter", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    rows = {r["variant"]: r for r in json.loads(out.read_text())["rows"]}
    logical, computed = agentic_positions(
        prompt_len=16, n=4, turns=3, turn_len=4, observation_len=3, branch_at_turns=(1,)
    )
    assert rows["replay"]["positions_logical"] == rows["naive-fused"]["positions_computed"] == logical
    assert rows["replay"]["positions_computed"] == computed
    assert rows["replay"]["loss"] == pytest.approx(rows["naive-fused"]["loss"], rel=1e-4, abs=1e-6)


@pytest.mark.parametrize(
    "argv,match",
    [
        (
            ["--turns", "3", "--branch-at-turns", "3"],
            "--branch-at-turns must be strictly increasing turns in (0, --turns 3)",
        ),
        (
            ["--observation-length", "4"],
            "--observation-length and --branch-at-turns describe turns: give --turns",
        ),
        (["--turns", "3", "--levels", "2"], "--levels and --turns both shape the response tree"),
        (
            ["--turns", "3", "--branch-at-turns", "1,2", "--branches", "6"],
            "--branches 6 must be divisible by 2 ** len",
        ),
    ],
)
def test_bad_agentic_shape_is_one_line_exit_2(argv: list[str], match: str, capsys) -> None:  # noqa: ANN001
    assert main(["bench", "--preset", "tiny", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert match in err and len(err.splitlines()) == 1
