"""Chunks: targets (incl. fork tokens) and key layout, the index lookup, and the user's 2.1M-position batch shape."""

from __future__ import annotations

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.schedule.chunks import lookup, make_chunk


def test_lookup() -> None:
    index = torch.tensor([7, 3, 11, 5])
    assert lookup(index, torch.tensor([3, 4, 11, 7, 100, -1])).tolist() == [1, -1, 2, 0, -1, -1]
    assert lookup(torch.tensor([], dtype=torch.long), torch.tensor([1])).tolist() == [-1]


def test_targets_match_the_predecessor_relation() -> None:
    rs = [
        Rollout(prompt=[1, 2, 3], response=[4, 5], advantage=1.0),
        Rollout(prompt=[1, 2, 3], response=[6], advantage=1.0),
        Rollout(prompt=[1, 2, 3], response=[6, 8, 9], advantage=1.0),
    ]
    tree = PrefixTree.build(rs)
    for segs, ext in [(range(len(tree.segments)), ()), ([tree.roots[0]], ())] + [
        ([c], tree.segments[c].ancestors) for c in range(len(tree.segments)) if tree.segments[c].parent >= 0
    ]:
        chunk = make_chunk(tree, list(segs), external=ext, targets="all")
        pred = tree.predecessor
        want = sorted(
            int(u)
            for u in range(tree.num_tokens)
            if pred[u] >= 0 and int(pred[u]) in set(chunk.token_index.tolist())
        )
        assert chunk.targets.tolist() == want
        # every target's row holds its predecessor
        assert torch.equal(chunk.token_index[chunk.target_rows], pred[chunk.targets])
        # the default keeps the targets in some rollout's response: here the fork tokens and everything after
        loss = make_chunk(tree, list(segs), external=ext)
        response = tree.response_counts() > 0
        assert loss.targets.tolist() == [t for t in want if response[t]]
        assert torch.equal(loss.token_index[loss.target_rows], pred[loss.targets])


def test_sixteen_rollouts_of_128k_prompt() -> None:
    """The user's target shape: 16 x 128K = 2.1M logical positions; the tree computes the prompt once."""
    P, G, S = 131072, 16, 256
    prompt = torch.randint(0, 32000, (P,), generator=torch.Generator().manual_seed(0)).tolist()
    rs = [Rollout(prompt=prompt, response=[g] + [5] * (S - 1), advantage=1.0) for g in range(G)]
    tree = PrefixTree.build(rs)
    assert tree.positions_logical == G * (P + S) and tree.positions_logical > 2_100_000
    assert tree.positions_computed == P + G * S
    root = tree.roots[0]
    first = make_chunk(tree, [root])
    assert first.layout.num_keys == P and first.targets.numel() == G  # the 16 fork tokens: no prompt row
    assert make_chunk(tree, [root], targets="all").targets.numel() == P - 1 + G  # + the prompt's next tokens
    leaf = make_chunk(tree, [tree.segments[root].children[3]], external=[root])
    assert leaf.layout.num_keys == P + S and leaf.layout.num_queries == S and leaf.targets.numel() == S - 1
