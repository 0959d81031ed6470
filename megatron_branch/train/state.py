"""The loop's resumable state besides the weights: the prompt order and position, and every RNG.

`PromptOrder` is a pure function of (seed, epoch): the permutation of an epoch is recomputed from its seed, so
the only state to checkpoint is the number of prompts consumed. `RngState` captures the torch CPU generator,
Python's `random`, numpy's global generator and the sampler's own `torch.Generator` (one per rank: DP ranks sample
different prompts with different streams). A run resumed at another layout cannot take the old ranks' streams:
`restart_rng` seeds fresh ones from the run's seeds and the step (the loop says so in one line).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass(kw_only=True)
class PromptOrder:
    """Global batches of prompt indices, epoch after epoch (shuffled per epoch with `seed + epoch`)."""

    num_prompts: int
    """Prompts in the dataset."""
    batch_size: int
    """Prompts per step (global, all DP ranks)."""
    shuffle: bool = True
    """Shuffle each epoch."""
    seed: int = 0
    """Seed of the per-epoch permutations."""
    consumed: int = 0
    """Prompts handed out so far (the data position; checkpointed)."""

    def __post_init__(self) -> None:
        assert self.num_prompts > 0 and self.batch_size > 0

    def _epoch(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_prompts))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_prompts, generator=g).tolist()

    def next_batch(self) -> list[int]:
        """The next `batch_size` prompt indices (an epoch boundary continues into the next permutation)."""
        out: list[int] = []
        while len(out) < self.batch_size:
            epoch, offset = divmod(self.consumed, self.num_prompts)
            order = self._epoch(epoch)
            take = min(self.batch_size - len(out), self.num_prompts - offset)
            out.extend(order[offset : offset + take])
            self.consumed += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.consumed = int(state["consumed"])


def capture_rng(sampler: torch.Generator) -> dict[str, Any]:
    """This process's RNG states (torch CPU, Python, numpy, the sampler's generator)."""
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "sampler": sampler.get_state(),
    }


def restore_rng(state: dict[str, Any], sampler: torch.Generator) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    sampler.set_state(state["sampler"])


def restart_rng(sampler: torch.Generator, *, seed: int, rollout_seed: int, step: int, dp_rank: int) -> None:
    """Fresh RNG streams for a run resumed at another layout (the saved ones are per rank of the old layout):
    a pure function of the run's seeds, the step and this rank's DP replica, so every rerun draws the same."""
    base = seed * 1_000_003 + step
    torch.manual_seed(base)
    random.seed(base)
    np.random.seed(base % 2**32)
    sampler.manual_seed((rollout_seed * 1_000_003 + dp_rank) * 1_000_033 + step)
