"""Replay with small subtrees packed by a token budget (ScheduleOptions.chunk_tokens; issue 33 item 1).

Sibling leaves, short inner subtrees and whole small prompt groups run as one packed chunk against their ancestors'
cached K/V (schedule/walk.py packed_groups). Checked in float64 against naive per-rollout training (1e-9 per
parameter, loss and every target's logprob), on forests that mix small groups with a group too large for the
budget (its root cached, its small subtrees packed) and with shared response beginnings carrying different
advantages; the forward count per step is asserted (one per chunk); a planted bug (a packed segment that also sees
a sibling's rows) is caught.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_branch.checkpoint.tp import gather_full_grads
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.data.random_trees import random_tree_rollouts
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, common, run_schedule
from megatron_branch.schedule.walk import packed_groups
from megatron_branch.testing import tiny_qwen2

VOCAB = 37


@pytest.fixture(scope="module", autouse=True)
def _single_process() -> None:
    initialize_parallel(ParallelConfig())


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    _, m = tiny_qwen2(32, 2, torch.float64, vocab_size=VOCAB, seed=0)
    return m


def forest() -> list[Rollout]:
    """Six small prompt groups (4-12 prompt tokens; two with shared response beginnings) and one large group
    (a 40-token prompt, two levels of shared response beginnings)."""
    out: list[Rollout] = []
    for i, (p, levels) in enumerate([(4, 1), (9, 2), (6, 1), (12, 1), (5, 2), (7, 1)]):
        out += random_tree_rollouts(vocab_size=VOCAB, prompt_len=p, branches=3, levels=levels, seed=500 + i)
    out += random_tree_rollouts(
        vocab_size=VOCAB, prompt_len=40, branches=3, levels=2, seg_len=(2, 6), seed=77
    )
    return out


def step(model: torch.nn.Module, rollouts: list[Rollout], schedule: str, **kw: object):  # noqa: ANN201
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule, model, tree, obj, ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, **kw)
    )
    grads = {n: g.clone() for n, g in gather_full_grads(model, None).items()}
    return tree, res, grads


def assert_same(res, grads, want_res, want_grads, tol: float = 1e-9) -> None:  # noqa: ANN001
    assert res.loss == pytest.approx(want_res.loss, rel=1e-10, abs=1e-14)
    torch.testing.assert_close(
        res.target_logprobs, want_res.target_logprobs, rtol=0, atol=1e-11, equal_nan=True
    )
    for name, want in want_grads.items():
        err = ((grads[name] - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


@pytest.mark.parametrize("budget", [8, 30, 64, 10_000])
@pytest.mark.parametrize("recompute", [False, True])
def test_packed_subtrees_equal_naive_in_float64(model: torch.nn.Module, budget: int, recompute: bool) -> None:
    rollouts = forest()
    tree, naive, naive_grads = step(model, rollouts, "naive")
    _, plain, _ = step(
        model, rollouts, "replay", recompute=recompute, chunk_tokens=None
    )  # the walk, chunks off
    _, res, grads = step(model, rollouts, "replay", chunk_tokens=budget, recompute=recompute)
    assert res.positions_computed == tree.positions_computed
    assert_same(res, grads, naive, naive_grads)
    # a budget below most segments walks them one by one (exact, more forwards); from 30 tokens on fewer forwards
    # than the leaf micro-batches of 8; one in all when the whole forest fits
    if budget >= 30:
        assert res.forwards < plain.forwards
    if budget >= tree.positions_computed:
        assert res.forwards == 1


def test_forwards_per_step_are_the_packed_groups(model: torch.nn.Module) -> None:
    """Counted, not timed: one forward per packed chunk, plus F (twice with recompute) of every subtree root too
    large for the budget; here the large group's root and two of the small groups' roots are cached."""
    rollouts = forest()
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    budget = 30

    def forwards(children: tuple[int, ...], per_root: int) -> int:
        n = 0
        for g in packed_groups(tree, children, budget):
            if len(g) == 1 and tree.segments[g[0]].children:  # walked: F, its children, B
                assert tree.num_tokens_of_root(g[0]) > budget
                n += per_root + forwards(tree.segments[g[0]].children, per_root)
            else:  # one chunk of whole subtrees within the budget
                assert sum(tree.segments[s].length for s in g) <= budget
                n += 1
        return n

    cached = [g for g in packed_groups(tree, tuple(tree.roots), budget) if len(g) == 1]
    assert len(cached) == 3
    for recompute, per_root in ((False, 1), (True, 2)):
        _, res, _ = step(model, rollouts, "replay", chunk_tokens=budget, recompute=recompute)
        assert res.forwards == forwards(tuple(tree.roots), per_root)
    assert forwards(tuple(tree.roots), 1) == 11  # the count itself, pinned (plain replay: 24)


def test_planted_sibling_visibility_is_caught(
    model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A packed chunk whose segments also see the previous segment's rows when it is not their ancestor (a leaf
    attending to a sibling's K/V): the float64 check must fail, by far more than rounding."""
    rollouts = forest()
    _, naive, naive_grads = step(model, rollouts, "naive")
    real = common.make_chunk  # what prepare_chunk builds every chunk with

    def leaky(tree: PrefixTree, segments, **kw):  # noqa: ANN001, ANN202
        c = real(tree, segments, **kw)
        qs = list(c.layout.segments)
        for i in range(1, len(segments)):
            if segments[i - 1] not in tree.segments[segments[i]].ancestors:
                prev = qs[i - 1]
                sib = (prev.self_k_start, prev.self_k_start + prev.length)
                qs[i] = dataclasses.replace(qs[i], ancestor_ranges=(*qs[i].ancestor_ranges, sib))
        return dataclasses.replace(c, layout=dataclasses.replace(c.layout, segments=tuple(qs)))

    monkeypatch.setattr(common, "make_chunk", leaky)
    _, res, grads = step(model, rollouts, "replay", chunk_tokens=30)
    with pytest.raises(AssertionError):
        assert_same(res, grads, naive, naive_grads, tol=1e-3)


def test_chunk_tokens_must_be_positive() -> None:
    with pytest.raises(ValueError, match="chunk_tokens must be positive"):
        ScheduleOptions(vocab_size=VOCAB, chunk_tokens=0)


def test_chunks_are_on_by_default_from_one_place(model: torch.nn.Module) -> None:
    """One default (schedule/options.py) for the engine's options and the run's config (grad, train, bench, verl's
    BranchOptions read one of the two); with it the whole small forest is ONE forward, and None turns it off."""
    from megatron_branch.assembly import ScheduleConfig
    from megatron_branch.schedule.options import DEFAULT_CHUNK_TOKENS

    assert (
        ScheduleOptions(vocab_size=VOCAB).chunk_tokens
        == ScheduleConfig().chunk_tokens
        == DEFAULT_CHUNK_TOKENS
    )
    tree, default, _ = step(model, forest(), "replay")
    assert tree.positions_computed <= DEFAULT_CHUNK_TOKENS and default.forwards == 1
    _, off, _ = step(model, forest(), "replay", chunk_tokens=None)
    assert off.forwards == 24  # the walk: every cached segment and every leaf micro-batch


def test_replay_stopgrad_walks_and_says_why(model: torch.nn.Module) -> None:
    """replay-stopgrad (an inexact comparison) freezes the prompt rows of cached segments: with the default chunks it
    still walks segment by segment, and the run's JSON says why (schedule/options.py chunks_ran) instead of a
    refusal."""
    from megatron_branch.schedule.options import DEFAULT_CHUNK_TOKENS, chunks_ran

    _, default, _ = step(model, forest(), "replay-stopgrad")
    _, off, _ = step(model, forest(), "replay-stopgrad", chunk_tokens=None)
    assert default.forwards == off.forwards > 1
    assert chunks_ran("replay-stopgrad", DEFAULT_CHUNK_TOKENS)["chunk_tokens_off"].startswith(
        "replay-stopgrad"
    )
    assert chunks_ran("replay", DEFAULT_CHUNK_TOKENS) == {"chunk_tokens": DEFAULT_CHUNK_TOKENS}
    assert chunks_ran("packed", DEFAULT_CHUNK_TOKENS) == {"chunk_tokens": None}


def test_scoring_with_packed_subtrees_is_naives(model: torch.nn.Module) -> None:
    """Forward only (old-policy / reference logprobs): the same walk, no graph; every target's logprob equals
    naive's."""
    rollouts = forest()
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    opts = ScheduleOptions(vocab_size=VOCAB, keep_logprobs=True, chunk_tokens=30)
    with torch.no_grad():
        got = run_schedule("replay", model, tree, None, opts, forward_only=True)
        want = run_schedule("naive", model, tree, None, opts, forward_only=True)
    torch.testing.assert_close(got.target_logprobs, want.target_logprobs, rtol=0, atol=1e-11, equal_nan=True)
    plain = ScheduleOptions(vocab_size=VOCAB, chunk_tokens=None)  # chunks off: the walk segment by segment
    assert got.forwards < run_schedule("replay", model, tree, None, plain, forward_only=True).forwards


def big_leaves_forest() -> tuple[list[Rollout], dict[str, int]]:
    """One prompt group whose root's children mix leaves over a budget of 8 tokens (A, B, C, F, H, I, J), small
    subtrees (D: a 2-token shared beginning and two 2-token leaves; E: a 3-token leaf) and an inner child over the
    budget (G: 4 shared tokens, two 6-token leaves), then two childless prompt groups of 12 tokens; every rollout
    its own advantage. Returns the rollouts and the segment of each name."""
    prompt = (1, 2, 3, 4, 5, 6)

    def resp(first: int, n: int) -> tuple[int, ...]:
        return (first, *[(first * 7 + k) % 36 + 1 for k in range(n - 1)])

    responses = {
        "A": resp(10, 12), "B": resp(11, 12), "C": resp(12, 10), "d1": (13, 20, 21, 22), "d2": (13, 20, 23, 24),
        "E": (14, 1, 2), "F": resp(15, 9), "g1": (16, 1, 2, 3, *resp(5, 6)), "g2": (16, 1, 2, 3, *resp(6, 6)),
        "H": resp(17, 10), "I": resp(18, 10), "J": resp(19, 10),
    }  # fmt: skip
    rollouts = [
        Rollout(prompt=prompt, response=r, advantage=0.3 * (i % 5) - 0.55)
        for i, r in enumerate(responses.values())
    ]
    rollouts += [Rollout(prompt=(30 + i, 31), response=resp(20 + i, 10), advantage=0.4 - i) for i in range(2)]
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    seg = {name: tree.rollout_segments(i)[-1] for i, name in enumerate(responses)}
    seg.update(
        D=tree.rollout_segments(3)[-2], G=tree.rollout_segments(7)[-2], root=tree.rollout_segments(0)[0]
    )
    seg.update(R2=tree.rollout_segments(12)[0], R3=tree.rollout_segments(13)[0])
    return rollouts, seg


def test_leaves_over_the_budget_keep_their_micro_batches(model: torch.nn.Module) -> None:
    """With a token budget, consecutive leaves each larger than it run in micro-batches of branch_micro_batch, as
    without a budget (a launcher's --branch-micro-batch is not silently dropped); a small subtree or an inner child
    ends such a run, small subtrees are still packed by tokens, an inner child over the budget is walked alone, and
    childless prompt groups over the budget run alone, as without a budget. Exact against naive in float64."""
    from megatron_branch.schedule.walk import child_groups

    rollouts, s = big_leaves_forest()
    tree = PrefixTree.build(rollouts, vocab_size=VOCAB)
    kids = tree.segments[s["root"]].children
    want = [["A", "B"], ["C"], ["D", "d1", "d2"], ["E"], ["F"], ["G"], ["H", "I"], ["J"]]
    assert list(child_groups(tree, kids, 2, 8)) == [[s[n] for n in g] for g in want]
    want3 = [["A", "B", "C"], ["D", "d1", "d2"], ["E"], ["F"], ["G"], ["H", "I", "J"]]
    assert list(child_groups(tree, kids, 3, 8)) == [[s[n] for n in g] for g in want3]
    assert list(child_groups(tree, tree.segments[s["G"]].children, 2, 8)) == [[s["g1"]], [s["g2"]]]
    assert list(child_groups(tree, tuple(tree.roots), 1, 8)) == [[s["root"]], [s["R2"]], [s["R3"]]]
    _, naive, naive_grads = step(model, rollouts, "naive")
    for recompute, per_root in ((False, 1), (True, 2)):
        _, res, grads = step(
            model, rollouts, "replay", chunk_tokens=8, branch_micro_batch=2, recompute=recompute
        )
        assert_same(res, grads, naive, naive_grads)
        # F(root), F(G) (each twice with recompute), the 8 groups under the root minus G, G's 2 leaves, R2, R3
        assert res.forwards == 2 * per_root + 7 + 2 + 2
