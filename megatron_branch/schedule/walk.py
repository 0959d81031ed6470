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

On one rank a wave is its micro-batches one after another (forward + backward each); on a pipeline stage it is
megatron's 1F1B over the stages. The order of every forward and backward is the walk's, so both compute the same
sums (tests/unit/test_schedules.py, tests/distributed/test_pipeline.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from megatron_branch.data import PrefixTree


def child_groups(tree: PrefixTree, children: tuple[int, ...], micro: int) -> Iterator[list[int]]:
    """Inner children one at a time; leaf children in micro-batches of `micro` (replay's order, also under
    pipeline parallelism)."""
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


class DepthFirstWalk:
    """The walk (see the module doc); a subclass sets `tree`, `path` and `micro` and gives the three steps."""

    tree: PrefixTree
    path: list[int]
    """The cached ancestors of what runs next, root first (the walk keeps it)."""
    micro: int
    """Leaves per micro-batch (ScheduleOptions.branch_micro_batch)."""

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

    def run_children(self, children: Sequence[int]) -> None:
        """Inner children one at a time; runs of consecutive leaf micro-batches as one wave each."""
        wave: list[list[int]] = []
        for group in self._child_groups(tuple(children)):
            if len(group) == 1 and self.tree.segments[group[0]].children:
                if wave:
                    self.run_wave(wave)
                wave = []
                self.run_segment(group[0])
            else:
                wave.append(group)
        if wave:
            self.run_wave(wave)

    def _child_groups(self, children: tuple[int, ...]) -> Iterator[list[int]]:
        return child_groups(self.tree, children, self.micro)

    # ---- the steps -----------------------------------------------------------------------------------------------
    def open_segment(self, seg_id: int) -> Any:
        """F(X) of a segment with children, its state cached; returns what close_segment needs."""
        raise NotImplementedError

    def close_segment(self, seg_id: int, opened: Any) -> None:
        """B(X) once, after its whole subtree (or, scoring, only its results), and drop its cache."""
        raise NotImplementedError

    def run_wave(self, groups: list[list[int]]) -> None:
        """Independent leaf micro-batches (each a list of leaf segments) reading the path's cache."""
        raise NotImplementedError
