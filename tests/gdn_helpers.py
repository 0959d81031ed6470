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
