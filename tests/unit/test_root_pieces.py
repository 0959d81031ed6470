"""Root pieces (data/pieces.py): a root cut into a chain of sequence pieces is the same tree for every token, and
replay over the pieces is the unsplit computation (one process; the pipeline, where the pieces are used, is tested
under torchrun in tests/distributed/test_pipeline.py).

Trees share prompts and response beginnings; a rollout that is a strict prefix of another and a root shorter than
the piece count are included.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_schedules import TOL, assert_grads_close, make_pair

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.data.pieces import piece_lengths, split_roots
from megatron_branch.errors import UserError
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.schedule.replay import run_replay
from megatron_branch.testing import random_tree_rollouts

TREES = {
    "shared_prompt": dict(prompt_len=9, branches=4, levels=1, seed=11),
    "two_levels": dict(prompt_len=7, branches=3, levels=2, seed=12),
    "three_groups": dict(groups=3, prompt_len=6, branches=3, levels=2, seed=13),
}


def _odd_rollouts() -> list[Rollout]:
    """A 3-token root (shorter than 5 pieces), a rollout that ends inside another's response, a childless root."""
    return [
        Rollout(prompt=[1, 2, 3], response=[4, 5, 6], advantage=1.0),
        Rollout(prompt=[1, 2, 3], response=[4, 5], advantage=-0.5),  # a strict prefix of the first
        Rollout(prompt=[1, 2, 3], response=[7], advantage=0.25),
        Rollout(prompt=[9, 8, 7, 6], response=[5, 4], advantage=0.75),  # alone: its root has no children
    ]


def _cases() -> list[list[Rollout]]:
    return [random_tree_rollouts(**kw) for kw in TREES.values()] + [_odd_rollouts()]


def test_piece_lengths_cover_the_root_evenly() -> None:
    assert (
        piece_lengths(10, 4) == [3, 3, 2, 2]
        and piece_lengths(3, 5) == [1, 1, 1]
        and piece_lengths(7, 1) == [7]
    )
    for length in range(1, 40):
        for k in range(1, 9):
            got = piece_lengths(length, k)
            assert sum(got) == length and len(got) == min(k, length) and max(got) - min(got) <= 1


@pytest.mark.parametrize("pieces", [2, 3, 5])
@pytest.mark.parametrize("case", range(4))
def test_the_split_tree_is_the_same_tree_for_every_token(case: int, pieces: int) -> None:
    """Packed tokens, positions, predecessors, the token-level attention mask, loss weights, response rows and
    every rollout's indices are the unsplit tree's; each root with children is a chain of its pieces."""
    rollouts = _cases()[case]
    tree = PrefixTree.build(rollouts)
    cut = split_roots(tree, pieces)
    for name in ("tokens", "position_ids", "predecessor"):
        assert torch.equal(getattr(cut, name), getattr(tree, name)), name
    assert torch.equal(cut.attention_mask(), tree.attention_mask())  # the same visibility, token for token
    assert torch.equal(cut.response_counts(), tree.response_counts())
    assert torch.equal(_response_rows(cut), _response_rows(tree))
    assert [cut.rollout_indices(i).tolist() for i in range(len(rollouts))] == [
        tree.rollout_indices(i).tolist() for i in range(len(rollouts))
    ]
    assert cut.groups() == tree.groups() and len(cut.roots) == len(tree.roots)
    assert cut.positions_computed == tree.positions_computed and cut.unpack() == tree.unpack()
    for old, new in zip(tree.roots, cut.roots, strict=True):
        seg = tree.segments[old]
        chain = [new]
        while len(cut.segments[chain[-1]].children) == 1 and len(chain) < len(
            piece_lengths(seg.length, pieces)
        ):
            chain.append(cut.segments[chain[-1]].children[0])
        want = piece_lengths(seg.length, pieces) if seg.children else [seg.length]
        assert [cut.segments[c].length for c in chain] == want
        assert [cut.segments[c].ancestors for c in chain] == [tuple(chain[:j]) for j in range(len(chain))]
    assert split_roots(tree, 1) is tree


def _response_rows(tree: PrefixTree) -> torch.Tensor:
    """[N] bool: packed tokens some rollout's response holds (tree.response_starts, per token)."""
    starts = tree.response_starts()
    out = torch.zeros(tree.num_tokens, dtype=torch.bool)
    for s in tree.segments:
        out[s.offset + starts[s.id] : s.offset + s.length] = True
    return out


@pytest.fixture(scope="module")
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


def _grads(model, arch, tree, rollouts, run, **opts):  # noqa: ANN001, ANN202
    from megatron_branch.checkpoint.param_map import mcore_to_hf_state
    from megatron_branch.checkpoint.tp import gather_full_grads

    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    res = run(
        model,
        tree,
        obj,
        ScheduleOptions(vocab_size=arch.vocab_size, keep_logprobs=True, **{"chunk_tokens": None, **opts}),
    )
    return res, mcore_to_hf_state(gather_full_grads(model, None), arch)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_replay_over_pieces_equals_naive(dtype: torch.dtype, _single_process: None) -> None:
    """replay's walk over the cut tree (pieces as inner segments: each reads the earlier pieces' cached K/V and
    sends its dK/dV back) gives naive's loss, logprobs and gradient per parameter (fp64 1e-9, fp32 1e-5), with and
    without segment recompute."""
    _, model, arch = make_pair("llama", False, dtype, seed=3)
    for rollouts in (random_tree_rollouts(**TREES["two_levels"]), _odd_rollouts()):
        tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
        want, want_g = _grads(model, arch, tree, rollouts, lambda *a: run_schedule("naive", *a))
        for recompute in (False, True):
            got, got_g = _grads(model, arch, split_roots(tree, 3), rollouts, run_replay, recompute=recompute)
            assert got.loss == pytest.approx(want.loss, rel=TOL[dtype])
            torch.testing.assert_close(got.target_logprobs, want.target_logprobs, rtol=TOL[dtype], atol=0,
                                       equal_nan=True)  # fmt: skip
            assert_grads_close(got_g, want_g, TOL[dtype])
            base, _ = _grads(model, arch, tree, rollouts, run_replay, recompute=recompute)
            # every shared segment (root or inner, with children) is cut: its extra pieces each run once more
            extra = sum(len(piece_lengths(x.length, 3)) - 1 for x in tree.segments if x.children)
            assert got.forwards == base.forwards + extra * (
                2 if recompute else 1
            )  # the pieces ran on their own


def test_a_piece_that_does_not_see_the_earlier_pieces_is_caught(_single_process: None) -> None:
    """Planted: each piece attends only to itself (its ancestors dropped from the layout): the gradient is wrong."""
    _, model, arch = make_pair("llama", False, torch.float64, seed=3)
    rollouts = random_tree_rollouts(**TREES["shared_prompt"])
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    _, want = _grads(model, arch, tree, rollouts, lambda *a: run_schedule("naive", *a))
    cut = split_roots(tree, 3)
    _, good = _grads(model, arch, cut, rollouts, run_replay)
    assert_grads_close(good, want, 1e-9)
    pieces = {s.id for s in cut.segments if _in_a_cut_root(tree, s.offset)}
    blind = [dataclasses.replace(s, ancestors=()) if s.id in pieces else s for s in cut.segments]
    _, bad = _grads(model, arch, PrefixTree(rollouts=cut.rollouts, segments=tuple(blind), leaves=cut._leaves),
                    rollouts, run_replay)  # fmt: skip
    with pytest.raises(AssertionError, match="relative error"):
        assert_grads_close(bad, want, 1e-3)


def _in_a_cut_root(tree: PrefixTree, offset: int) -> bool:
    """Whether packed token `offset` lies in a root with children (a root split_roots cuts)."""
    return any(tree.segments[r].children and tree.segments[r].offset <= offset <
               tree.segments[r].offset + tree.segments[r].length for r in tree.roots)  # fmt: skip


def test_root_pieces_are_refused_without_a_pipeline(_single_process: None) -> None:
    """rules.check_pipeline through the library entry (run_schedule at pp 1), in the API's names, one line."""
    _, model, arch = make_pair("llama", False, torch.float32)
    rollouts = _odd_rollouts()
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    opts = ScheduleOptions(vocab_size=arch.vocab_size, root_pieces=4, chunk_tokens=None)
    with pytest.raises(UserError) as e:
        run_schedule("replay", model, tree, obj, opts)
    assert str(e.value).startswith("ScheduleOptions.root_pieces=4 needs pipeline parallelism (pp_size > 1)")
    with pytest.raises(ValueError, match="root_pieces must be positive"):
        ScheduleOptions(vocab_size=arch.vocab_size, root_pieces=0)
