"""PrefixTree: property tests against naive per-rollout derivations, plus explicit shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tree_reference import attention_mask_from_rollouts, prefix_index_map, token_weights_from_rollouts

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.errors import UserError
from megatron_branch.testing import rollout_set_strategy

rollout_sets = rollout_set_strategy
PROPERTY = settings(max_examples=60, deadline=None)


def _sequences(rollouts: list[Rollout]) -> list[tuple[int, ...]]:
    return [r.prompt + r.response for r in rollouts]


@PROPERTY
@given(rollout_sets())
def test_unpack_round_trips_and_counts_distinct_prefixes(rollouts: list[Rollout]) -> None:
    tree = PrefixTree.build(rollouts)
    seqs = _sequences(rollouts)
    assert tree.unpack() == seqs
    distinct = {seq[: j + 1] for seq in seqs for j in range(len(seq))}
    assert tree.positions_computed == tree.num_tokens == len(distinct)
    assert tree.positions_logical == sum(len(s) for s in seqs)
    # Each distinct prefix has exactly one packed token (prefix_index_map asserts the bijection).
    assert set(prefix_index_map(tree)) == distinct
    for i, seq in enumerate(seqs):
        idx = tree.rollout_indices(i)
        assert tree.tokens[idx].tolist() == list(seq)
        assert tree.position_ids[idx].tolist() == list(range(len(seq)))
        assert tree.predecessor[idx].tolist() == [-1] + idx[:-1].tolist()
        path = tree.rollout_segments(i)
        last = tree.segments[path[-1]]
        assert last.offset + last.length - 1 == idx[-1].item()  # the sequence ends exactly at the leaf's end


@PROPERTY
@given(rollout_sets())
def test_attention_mask_matches_reference(rollouts: list[Rollout]) -> None:
    tree = PrefixTree.build(rollouts)
    mask = tree.attention_mask()
    assert mask.dtype == torch.bool and mask.shape == (tree.num_tokens, tree.num_tokens)
    assert torch.equal(mask, attention_mask_from_rollouts(tree))


@PROPERTY
@given(rollout_sets(), st.data())
def test_response_tokens_and_weights(rollouts: list[Rollout], data: st.DataObject) -> None:
    tree = PrefixTree.build(rollouts)
    for i, r in enumerate(rollouts):
        assert tree.tokens[tree.response_indices(i)].tolist() == list(r.response)
        for name, values in r.token_fields.items():
            assert tree.token_field(name, i).tolist() == list(values)
    per_rollout = data.draw(st.lists(st.floats(-3.0, 3.0), min_size=len(rollouts), max_size=len(rollouts)))
    weights = tree.token_weights(per_rollout)
    assert weights.dtype == torch.float64
    assert torch.allclose(weights, token_weights_from_rollouts(tree, per_rollout), rtol=0, atol=1e-12)
    in_some_response = torch.zeros(tree.num_tokens, dtype=torch.bool)
    for i in range(len(rollouts)):
        in_some_response[tree.response_indices(i)] = True
    assert (weights[~in_some_response] == 0).all()  # exactly zero, not cancellation noise
    counts = tree.response_counts()
    assert counts.dtype == torch.long
    assert torch.equal(counts, token_weights_from_rollouts(tree, [1.0] * len(rollouts)).long())
    assert int(counts.sum()) == tree.num_response_tokens_logical() == sum(len(r.response) for r in rollouts)


@PROPERTY
@given(rollout_sets())
def test_segment_structure(rollouts: list[Rollout]) -> None:
    tree = PrefixTree.build(rollouts)
    offset = 0
    for s in tree.segments:
        assert s.offset == offset and s.length == len(s.tokens) > 0  # packed = pre-order concatenation
        offset += s.length
        assert s.ancestors == (tree.segments[s.parent].ancestors + (s.parent,) if s.parent >= 0 else ())
        assert s.depth == len(s.ancestors)
        assert s.start_position == sum(tree.segments[a].length for a in s.ancestors)
        assert all(tree.segments[c].parent == s.id for c in s.children)
        assert list(s.children) == sorted(s.children)
        first_tokens = [tree.segments[c].tokens[0] for c in s.children]
        assert len(set(first_tokens)) == len(first_tokens)  # a radix tree: siblings differ at once
        # Compressed: an inner segment with one child exists only because some rollout ends there.
        if len(s.children) == 1:
            assert any(tree.rollout_segments(i)[-1] == s.id for i in range(len(rollouts)))
        sub = tree.subtree_segments(s.id)
        assert sub[0] == s.id and all(s.id in tree.segments[d].ancestors for d in sub[1:])
    assert offset == tree.num_tokens
    assert tree.roots == tuple(s.id for s in tree.segments if s.parent == -1)
    assert sum(tree.num_tokens_of_root(r) for r in tree.roots) == tree.num_tokens
    groups = tree.groups()
    assert sorted(i for g in groups for i in g) == list(range(len(rollouts)))
    for root, group in zip(tree.roots, groups):
        assert all(tree.rollout_segments(i)[0] == root for i in group)
    firsts = sorted(s.offset for s in tree.segments if s.parent >= 0)
    assert tree.fork_tokens.tolist() == firsts
    for f in firsts:  # a fork token is predicted by the last token of its parent segment
        parent = tree.segments[tree.segments[int(tree.segment_ids[f])].parent]
        assert int(tree.predecessor[f]) == parent.offset + parent.length - 1
    assert tree.segment_ids.tolist() == [s.id for s in tree.segments for _ in range(s.length)]
    again = PrefixTree.build(rollouts)
    assert again.segments == tree.segments  # deterministic


def _prompt_and_group(prompt: list[int], responses: list[list[int]]) -> list[Rollout]:
    return [Rollout(prompt=prompt, response=r, advantage=1.0) for r in responses]


def test_one_prompt_group_forking_at_first_response_token() -> None:
    rollouts = _prompt_and_group([1, 2, 3, 4, 5], [[10 + g, 20, 30] for g in range(4)])
    tree = PrefixTree.build(rollouts)
    assert tree.positions_computed == 5 + 4 * 3
    assert tree.positions_logical == 4 * 8
    assert tree.roots == (0,)
    assert tree.segments[0].tokens == (1, 2, 3, 4, 5) and tree.segments[0].children == (1, 2, 3, 4)
    assert [tree.segments[c].tokens[0] for c in (1, 2, 3, 4)] == [10, 11, 12, 13]  # first-appearance order
    assert tree.fork_tokens.tolist() == [5, 8, 11, 14]
    assert tree.predecessor[tree.fork_tokens].tolist() == [4, 4, 4, 4]
    assert tree.response_counts().tolist() == [0] * 5 + [1] * 12
    assert tree.groups() == [(0, 1, 2, 3)]
    assert "17" in tree.describe() and "32" in tree.describe()


def test_two_level_shared_response_beginning() -> None:
    tree = PrefixTree.build(_prompt_and_group([1, 2], [[3, 4, 5], [3, 4, 6], [7, 8]]))
    assert [s.tokens for s in tree.segments] == [(1, 2), (3, 4), (5,), (6,), (7, 8)]
    assert [s.depth for s in tree.segments] == [0, 1, 2, 2, 1]
    assert tree.position_ids.tolist() == [0, 1, 2, 3, 4, 4, 2, 3]
    assert tree.response_counts().tolist() == [0, 0, 2, 2, 1, 1, 1, 1]


def test_three_level_shared_response_beginning() -> None:
    responses = [[3, 4, 5, 6], [3, 4, 5, 7], [3, 4, 8], [3, 9], [10]]
    tree = PrefixTree.build(_prompt_and_group([1, 2], responses))
    assert [s.tokens for s in tree.segments] == [(1, 2), (3,), (4,), (5,), (6,), (7,), (8,), (9,), (10,)]
    assert [s.children for s in tree.segments[:4]] == [(1, 8), (2, 7), (3, 6), (4, 5)]
    assert tree.max_depth == 4
    assert tree.rollout_segments(0) == (0, 1, 2, 3, 4)
    assert tree.positions_computed == 2 + 8
    assert tree.response_counts().tolist() == [0, 0, 4, 3, 2, 1, 1, 1, 1, 1]
    assert torch.equal(tree.attention_mask(), attention_mask_from_rollouts(tree))


def test_forest_of_three_prompt_groups() -> None:
    rollouts = (
        _prompt_and_group([1, 1], [[5], [6]])
        + _prompt_and_group([2, 2, 2], [[5, 5]])
        + _prompt_and_group([3], [[7], [8], [9]])
    )
    rollouts.append(Rollout(prompt=[1, 1], response=[4]))  # joins the first group out of order
    tree = PrefixTree.build(rollouts)
    assert len(tree.roots) == 3
    assert tree.groups() == [(0, 1, 6), (2,), (3, 4, 5)]
    assert [tree.num_tokens_of_root(r) for r in tree.roots] == [5, 5, 4]
    mask = tree.attention_mask()
    first, second = tree.subtree_segments(tree.roots[0]), tree.subtree_segments(tree.roots[1])
    q = tree.segments[second[0]].offset
    assert not mask[q, : tree.segments[first[-1]].offset + 1].any()  # roots never see each other


def test_identical_duplicates_share_everything() -> None:
    rollouts = [Rollout(prompt=[1, 2], response=[3, 4], advantage=a) for a in (0.5, -1.0, 2.0)]
    tree = PrefixTree.build(rollouts)
    assert len(tree.segments) == 1 and tree.positions_computed == 4 and tree.positions_logical == 12
    assert tree.token_weights([0.5, -1.0, 2.0]).tolist() == [0.0, 0.0, 1.5, 1.5]
    assert tree.response_counts().tolist() == [0, 0, 3, 3]
    assert tree.unpack() == [(1, 2, 3, 4)] * 3


def test_rollout_that_is_a_prefix_of_another() -> None:
    # The shorter one is inserted second: the existing segment must be split where it ends.
    long, short = Rollout(prompt=[1, 2], response=[3, 4, 5]), Rollout(prompt=[1], response=[2, 3])
    tree = PrefixTree.build([long, short])
    assert [s.tokens for s in tree.segments] == [(1, 2, 3), (4, 5)]
    assert tree.rollout_segments(1) == (0,) and tree.rollout_segments(0) == (0, 1)
    # Token 2 is prompt for `long` but response for `short`: only response membership counts.
    assert tree.token_weights([10.0, 1.0]).tolist() == [0.0, 1.0, 11.0, 10.0, 10.0]
    reverse = PrefixTree.build([short, long])
    assert [s.tokens for s in reverse.segments] == [(1, 2, 3), (4, 5)]


def test_empty_prompt_is_allowed() -> None:
    tree = PrefixTree.build([Rollout(prompt=[], response=[7, 8]), Rollout(prompt=[7], response=[9])])
    assert tree.unpack() == [(7, 8), (7, 9)]
    assert tree.response_counts().tolist() == [1, 1, 1]  # token 7 is prompt for the second rollout


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(prompt=[1], response=[]), ["response", "empty"]),
        (dict(prompt=[1, -2], response=[3]), ["prompt", "token 1", "negative"]),
        (dict(prompt=[1], response=[3, True]), ["response", "token 1", "True"]),
        (dict(prompt=[1], response=[3, 2.0]), ["response", "token 1"]),
        (dict(prompt=[1], response=[3], advantage=float("nan")), ["advantage", "finite"]),
        (
            dict(prompt=[1], response=[3], token_fields={"old_logprobs": (0.1, 0.2)}),
            ["old_logprobs", "mismatch"],
        ),
    ],
)
def test_rollout_validation(kwargs: dict, words: list[str]) -> None:
    with pytest.raises(UserError) as info:
        Rollout(**kwargs)
    message = str(info.value)
    assert "\n" not in message and all(w in message for w in words), message


def test_build_errors() -> None:
    with pytest.raises(UserError, match="no rollouts"):
        PrefixTree.build([])
    good = Rollout(prompt=[1], response=[2])
    with pytest.raises(
        UserError, match=r"rollout 1: response token 1 is id 50, out of range for vocab_size 50"
    ):
        PrefixTree.build([good, Rollout(prompt=[1], response=[2, 50])], vocab_size=50)
    with pytest.raises(UserError, match="rollout 1: expected a Rollout"):
        PrefixTree.build([good, {"prompt": [1], "response": [2]}])  # type: ignore[list-item]
    with pytest.raises(UserError, match="one value per rollout"):
        PrefixTree.build([good]).token_weights([1.0, 2.0])


def test_lists_tensors_and_numpy_style_ints_are_normalised() -> None:
    r = Rollout(prompt=torch.tensor([1, 2]), response=[3], token_fields={"x": [1]})
    assert r.prompt == (1, 2) and type(r.prompt[0]) is int and r.token_fields == {"x": (1.0,)}
