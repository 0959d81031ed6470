"""Replay's depth-first walk over the prefix tree, written ONCE: one rank (schedule/replay.py) and every pipeline
stage (schedule/pipeline.py) run this walk and differ only in its three steps.

    run_segment(X)     open_segment(X)                F(X): forward capturing X's state, cached for its subtree
                       X joins the path (the cached ancestors of what runs next)
                       run_children(X's children)
                       X leaves the path
                       close_segment(X, opened)       B(X) once, with the SUM of the subtree's gradients; drop
    run_children(C)    inner children one at a time (recursively); consecutive leaf micro-batches
                       (`branch_micro_batch` leaves each, `child_groups`) as ONE wave: run_wave(groups), flushed
                       before the next inner child and at the end
A childless segment walked on its own (a root without branches) is a wave of one micro-batch of itself.

With a token budget (`chunk_tokens`, ScheduleOptions) the groups are packed sub-forests instead (issue 33 item 1):
consecutive children whose WHOLE subtree has at most `chunk_tokens` tokens are packed, subtree by subtree in
pre-order, into one chunk of at most that many tokens that runs against the path's cache like a leaf micro-batch
(one forward and one backward: inside it the subtrees attend as in `packed`); a child whose subtree is larger is
walked as before: an inner child alone (F, its children, B), consecutive leaves over the budget in micro-batches of
`branch_micro_batch` exactly as without a budget (long responses keep the micro-batch a plan searched). At the top
(`run_forest`) the roots are the children of an empty path, so many small prompt groups share one chunk (a childless
root over the budget still runs alone, as without a budget). Exact as before: a chunk's
layout lets each segment see its own ancestors only, wherever they live (schedule/chunks.py make_chunk).

On one rank a wave is its micro-batches one after another (forward + backward each); on a pipeline stage it is
megatron's 1F1B over the stages. The order of every forward and backward is the walk's, so both compute the same
sums (tests/unit/test_schedules.py, tests/distributed/test_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from megatron_branch.data import PrefixTree


def child_groups(
    tree: PrefixTree, children: tuple[int, ...], micro: int, chunk_tokens: int | None = None
) -> Iterator[list[int]]:
    """Inner children one at a time; leaf children in micro-batches of `micro` (replay's order, also under
    pipeline parallelism). With `chunk_tokens`: small subtrees packed by tokens (`packed_groups`)."""
    if chunk_tokens is not None:
        yield from packed_groups(tree, children, chunk_tokens, micro)
        return
    batch: list[int] = []
    for c in children:
        if tree.segments[c].children:
            yield [c]
        else:
            batch.append(c)
            if len(batch) == micro:
                yield batch
                batch = []
    if batch:
        yield batch


def packed_groups(
    tree: PrefixTree, children: tuple[int, ...], budget: int, micro: int = 1
) -> Iterator[list[int]]:
    """Consecutive children whose whole subtrees fit `budget` tokens, packed (each subtree in pre-order) into
    groups of at most `budget` tokens; an inner child whose subtree is larger alone, as `[child]`; consecutive
    leaves larger than the budget in micro-batches of `micro` leaves (any other child ends the run of them)."""
    batch: list[int] = []  # small subtrees, packed by tokens
    tokens = 0
    big: list[int] = []  # leaves over the budget, by count
    for c in children:
        size = tree.num_tokens_of_root(c)  # the subtree's tokens (a contiguous id range)
        big_leaf = size > budget and not tree.segments[c].children
        if big and (not big_leaf or len(big) == micro):
            yield big
            big = []
        if size > budget or tokens + size > budget:
            if batch:
                yield batch
            batch, tokens = [], 0
        if big_leaf:
            big.append(c)
        elif size > budget:
            yield [c]
        else:
            batch.extend(tree.subtree_segments(c))
            tokens += size
    if big:
        yield big
    if batch:
        yield batch


class DepthFirstWalk:
    """The walk (see the module doc); a subclass sets `tree`, `path` and `micro` and gives the three steps."""

    tree: PrefixTree
    path: list[int]
    """The cached ancestors of what runs next, root first (the walk keeps it)."""
    micro: int
    """Leaves per micro-batch (ScheduleOptions.branch_micro_batch)."""
    chunk_tokens: int | None = None
    """Tokens per packed sub-forest chunk (ScheduleOptions.chunk_tokens); None: leaf micro-batches only."""

    def run_forest(self, roots: Sequence[int]) -> None:
        """Every prompt group: root by root; with a token budget as the children of an empty path (small groups
        packed together)."""
        if self.chunk_tokens is None:
            for root in roots:
                self.run_segment(root)
        else:
            self.run_children(roots, micro=1)

    def run_segment(self, seg_id: int) -> None:
        """F(X), X's subtree, B(X) once; a childless X alone: a wave of one micro-batch."""
        if not self.tree.segments[seg_id].children:
            self.run_wave([[seg_id]])
            return
        opened = self.open_segment(seg_id)
        self.path.append(seg_id)
        self.run_children(self.tree.segments[seg_id].children)
        self.path.pop()
        self.close_segment(seg_id, opened)

    def run_children(self, children: Sequence[int], micro: int | None = None) -> None:
        """Inner children one at a time; runs of consecutive leaf micro-batches as one wave each (`micro` leaves
        each, default self.micro; the roots: 1)."""
        wave: list[list[int]] = []
        for group in child_groups(self.tree, tuple(children), micro or self.micro, self.chunk_tokens):
            if len(group) == 1 and self.tree.segments[group[0]].children:
                if wave:
                    self.run_wave(wave)
                wave = []
                self.run_segment(group[0])
            else:
                wave.append(group)
        if wave:
            self.run_wave(wave)

    # ---- the steps -----------------------------------------------------------------------------------------------
    def open_segment(self, seg_id: int) -> Any:
        """F(X) of a segment with children, its state cached; returns what close_segment needs."""
        raise NotImplementedError

    def close_segment(self, seg_id: int, opened: Any) -> None:
        """B(X) once, after its whole subtree (or, scoring, only its results), and drop its cache."""
        raise NotImplementedError

    def run_wave(self, groups: list[list[int]]) -> None:
        """Independent micro-batches reading the path's cache: each a list of leaf segments, or with a token budget
        packed sub-forests (whole subtrees in pre-order)."""
        raise NotImplementedError
