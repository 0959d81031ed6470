"""Helpers shared by the gated delta net tests: planted bugs in where a segment starts (models/gdn.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from megatron_branch.models.gdn import BranchGatedDeltaNet

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
