"""Helpers shared by the recurrent-state tests (gated delta nets, Mamba-2): the fork-heavy tree they train on, and
planted bugs in where a gated delta net segment starts (models/gdn.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_branch.data import Rollout
from megatron_branch.models.gdn import BranchGatedDeltaNet


def rollouts() -> list[Rollout]:
    """Forks at depths 1, 2 and 3; a 1-token response ([4]); a response that is a prefix of another ([1, 2]);
    segments shorter than the conv's K-1 = 3 inputs ([1], [2], [9]) and than 2 x CP (mostly padding on a CP rank);
    a 70-token prompt (two of the delta rule's 64-position chunks) whose branches fork mid-chunk."""
    g = torch.Generator().manual_seed(11)
    p = [int(x) for x in torch.randint(0, 37, (9,), generator=g)]
    q = [int(x) for x in torch.randint(0, 37, (70,), generator=g)]
    return [
        Rollout(prompt=p, response=[1, 2, 3, 5, 6, 7], advantage=1.0),
        Rollout(prompt=p, response=[1, 2, 3, 5, 8], advantage=-0.5),
        Rollout(prompt=p, response=[1, 2], advantage=0.3),
        Rollout(prompt=p, response=[1, 9], advantage=-1.2),
        Rollout(prompt=p, response=[4], advantage=0.8),
        Rollout(prompt=q, response=[5], advantage=0.7),
        Rollout(prompt=q, response=[5, 9, 11], advantage=-1.1),
    ]


START_BUGS = ("zero_parent_state", "drop_parent_tail")
"""zero_parent_state: a child starts from a zero recurrent state; drop_parent_tail: without its parent's conv
inputs."""


def plant_start_bug(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    """Break `BranchGatedDeltaNet._start` on purpose for every segment with a parent (in the chunk or cached)."""
    assert bug in START_BUGS, bug
    original = BranchGatedDeltaNet._start

    def planted(
        self: BranchGatedDeltaNet, parent: int | None, *args: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        S, tail = original(self, parent, *args)
        if parent is None:  # a root starts from zeros anyway
            return S, tail
        if bug == "zero_parent_state":
            return torch.zeros_like(S), tail
        return S, torch.zeros_like(tail)

    monkeypatch.setattr(BranchGatedDeltaNet, "_start", planted)


def plant_wrong_rollout_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break where a segment starts on purpose: a segment whose parent's state was handed down (replay's prefix
    cache) starts from the state handed down before it in this layer, when that one differs: the recurrent state
    and conv inputs of ANOTHER prefix, i.e. a shared token's GDN state taken from the wrong rollout."""
    from megatron_branch.attention.prefix_state import CACHED

    original = BranchGatedDeltaNet._start
    last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def planted(
        self: BranchGatedDeltaNet, parent: int | None, *args: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        S, tail = original(self, parent, *args)
        if parent != CACHED:
            return S, tail
        prev = last.get(self.layer_number)
        last[self.layer_number] = (S, tail)
        if prev is not None and prev[0].shape == S.shape and not torch.equal(prev[0], S):
            return prev
        return S, tail

    monkeypatch.setattr(BranchGatedDeltaNet, "_start", planted)
