"""Root pieces: the same prefix tree with each shared root cut into a chain of sequence pieces.

Under pipeline parallelism a root (the long shared prompt) is one chunk that crosses the stages one after
another, so while it runs forward (and again backward) pp - 1 of the pp stages wait. Cut into k pieces, the root
becomes a chain of k segments (piece j the only child of piece j - 1, the root's children under the last piece),
and replay's walk runs them like inner segments: piece j attends to pieces < j through each stage's cached K/V
(the prefix cache, schedule/prefix_cache.py, unchanged) and hands its own state down; its backward comes after
every later piece's, which has added its dK/dV into piece j's cached leaves by then. So the pieces flow through
the stages like micro-batches (schedule/pipeline.py) and the computation is the unsplit root's exactly: the same
visibility (an ancestor chain is what a causal prefix is), the same loss rows, the same gradient, summed in
another order.

What does not change (tested in tests/unit/test_root_pieces.py): the packed layout (every token keeps its packed
index, so targets, token weights, kept logprobs and the objective's per-token quantities are the unsplit tree's),
the rollouts, the token-level attention mask, the positions computed. What changes: segment ids (pre-order
renumbered), a piece is not a maximal run of shared tokens (a segment with one child, as a rollout that is a
strict prefix of another already makes).

Every shared segment is cut, a root or an inner segment with children: when a batch's prompts share their first
tokens (a BOS token, a system prompt) the tree's root is that common part and each prompt is an inner segment, which
must be cut too for the pieces to do anything. Segments without children (the leaves: one rollout's own tokens, a
leaf micro-batch of the wave already) are not cut; a segment shorter than k is cut into one-token pieces. Pieces have equal lengths, the first `length % k` one token
longer (later pieces attend to more keys, so they cost more: the planner charges the bubble for the last one,
plan/pipeline.py).
"""

from __future__ import annotations

from megatron_branch.data.prefix_tree import PrefixTree, Segment


def piece_lengths(length: int, pieces: int) -> list[int]:
    """Lengths of the min(pieces, length) pieces of a `length`-token root, in order (equal, the first ones one
    token longer when `pieces` does not divide `length`)."""
    assert length > 0 and pieces > 0
    k = min(pieces, length)
    q, r = divmod(length, k)
    return [q + 1] * r + [q] * (k - r)


def split_roots(tree: PrefixTree, pieces: int) -> PrefixTree:
    """`tree` with every shared segment (a root or inner segment with children) cut into `pieces` chained segments
    (see the module doc); the tree itself when `pieces` is 1 or nothing is cut."""
    if pieces == 1 or all(len(piece_lengths(s.length, pieces)) == 1 or not s.children for s in tree.segments):
        return tree
    # old id -> new ids (one, or a shared segment's pieces in order); pre-order is kept: the pieces take its place
    new_ids: list[list[int]] = []
    n = 0
    for s in tree.segments:
        k = len(piece_lengths(s.length, pieces)) if s.children else 1
        new_ids.append(list(range(n, n + k)))
        n += k

    def last(old: int) -> int:  # the new segment that ends where `old` ends (a parent, a rollout's leaf)
        return new_ids[old][-1]

    out: list[Segment] = []
    for s in tree.segments:
        ids = new_ids[s.id]
        above = tuple(i for a in s.ancestors for i in new_ids[a])
        parent = last(s.parent) if s.parent >= 0 else -1
        at = 0
        for j, (sid, length) in enumerate(zip(ids, piece_lengths(s.length, len(ids)), strict=True)):
            children = (ids[j + 1],) if j + 1 < len(ids) else tuple(new_ids[c][0] for c in s.children)
            ancestors = above + tuple(ids[:j])
            out.append(
                Segment(id=sid, parent=ids[j - 1] if j else parent, children=children, depth=len(ancestors),
                        tokens=s.tokens[at : at + length], start_position=s.start_position + at,
                        offset=s.offset + at, length=length, ancestors=ancestors)
            )  # fmt: skip
            at += length
    leaves = tuple(last(tree.rollout_segments(i)[-1]) for i in range(len(tree.rollouts)))
    return PrefixTree(rollouts=tree.rollouts, segments=tuple(out), leaves=leaves)
