"""Replay's depth-first walk, written once (schedule/walk.py): one rank (schedule/replay.py) and every pipeline stage
(schedule/pipeline.py) are its steps, not walks of their own; the walk's order on random trees: every inner segment
opened once and closed once after its whole subtree, every leaf in exactly one wave, in micro-batches, each wave run
with exactly its leaves' ancestors cached."""

from __future__ import annotations

import pytest

from megatron_branch.data import PrefixTree
from megatron_branch.schedule.pipeline import _Pipeline
from megatron_branch.schedule.replay import _Replay
from megatron_branch.schedule.walk import DepthFirstWalk
from megatron_branch.testing import random_tree_rollouts


def test_replay_and_the_pipeline_walk_with_the_one_walker() -> None:
    for cls in (_Replay, _Pipeline):
        assert issubclass(cls, DepthFirstWalk)
        for walk_method in ("run_segment", "run_children"):
            assert walk_method not in vars(cls), f"{cls.__name__} walks the tree itself ({walk_method})"


class Recorder(DepthFirstWalk):
    def __init__(self, tree: PrefixTree, micro: int) -> None:
        self.tree, self.path, self.micro = tree, [], micro
        self.events: list[tuple] = []

    def open_segment(self, seg_id: int) -> int:
        assert list(self.path) == list(self.tree.segments[seg_id].ancestors)
        self.events.append(("open", seg_id))
        return seg_id

    def close_segment(self, seg_id: int, opened: int) -> None:
        assert opened == seg_id and seg_id not in self.path
        self.events.append(("close", seg_id))

    def run_wave(self, groups: list[list[int]]) -> None:
        for g in groups:
            assert 1 <= len(g) <= self.micro
            for leaf in g:  # the wave reads exactly its leaves' cached ancestors
                assert list(self.path) == list(self.tree.segments[leaf].ancestors)
        self.events.append(("wave", tuple(tuple(g) for g in groups)))


@pytest.mark.parametrize("micro", [1, 2, 3])
@pytest.mark.parametrize("seed", [5, 6, 7])
def test_the_walk_opens_each_prefix_once_closes_it_after_its_subtree_and_runs_each_leaf_once(
    micro: int, seed: int
) -> None:
    tree = PrefixTree.build(
        random_tree_rollouts(groups=2, prompt_len=4, branches=3, levels=3, seg_len=(1, 3), seed=seed)
    )
    w = Recorder(tree, micro)
    w.run_children(tree.roots)
    inner = [s.id for s in tree.segments if s.children]
    leaves = [s.id for s in tree.segments if not s.children]
    opened = [e[1] for e in w.events if e[0] == "open"]
    closed = [e[1] for e in w.events if e[0] == "close"]
    ran = [leaf for e in w.events if e[0] == "wave" for g in e[1] for leaf in g]
    assert sorted(opened) == sorted(closed) == sorted(inner) and len(set(opened)) == len(opened)
    assert sorted(ran) == sorted(leaves) and len(set(ran)) == len(ran)
    pos = {e: i for i, e in enumerate(w.events) if e[0] != "wave"}
    where = {leaf: i for i, e in enumerate(w.events) if e[0] == "wave" for g in e[1] for leaf in g}
    for s in tree.segments:  # every descendant runs between its ancestors' open and close
        for a in s.ancestors:
            at = where[s.id] if not s.children else pos[("open", s.id)]
            assert pos[("open", a)] < at < pos[("close", a)]
    assert all(e[1] for e in w.events if e[0] == "wave"), "no empty waves"


def test_planted_bug_a_wave_run_after_its_parent_closed_is_caught() -> None:
    """A walk that held its leaf waves back until the end would run leaves with their ancestors gone."""

    class Late(Recorder):
        held: list[list[int]] = []

        def run_wave(self, groups: list[list[int]]) -> None:
            Late.held += groups

    tree = PrefixTree.build(random_tree_rollouts(prompt_len=4, branches=3, levels=2, seed=5))
    w = Late(tree, 2)
    w.run_children(tree.roots)
    with pytest.raises(AssertionError):
        Recorder.run_wave(w, Late.held)
