"""What every schedule shares: one chunk's forward, logprobs and loss, and the step's result record.

Shape legend: s chunk tokens, m predicted targets, v vocabulary slice on this TP rank, b batch (1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_branch.attention.core_attention import KV, BranchContext, attach_context
from megatron_branch.data import PrefixTree
from megatron_branch.losses.logprobs import vocab_parallel_logprobs
from megatron_branch.schedule.chunks import Chunk


@dataclass(kw_only=True)
class ScheduleOptions:
    """How a step runs. Process groups are passed in here, never read from globals inside the math."""

    tp_group: Any = None
    """Tensor-parallel group of the model (None = no TP)."""
    tp_size: int = 1
    """Its size; chunks are padded to a multiple of it under sequence parallel."""
    sequence_parallel: bool = False
    """Whether the model was built with sequence parallel."""
    vocab_size: int
    """Real (unpadded) vocabulary size; padded logits are excluded from every softmax."""
    backend: str | None = None
    """Attention backend (attention.dispatch); None = the default chosen once for the device."""
    branch_micro_batch: int = 8
    """replay: how many sibling LEAF segments share one forward/backward."""
    recompute: bool = False
    """replay: keep no graph for a segment with children; recompute its forward at its backward."""
    keep_logprobs: bool = False
    """Return every target's logprob (detached) in the result."""

    def __post_init__(self) -> None:
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.branch_micro_batch <= 0:
            raise ValueError(f"branch_micro_batch must be positive, got {self.branch_micro_batch}")

    @property
    def pad_to(self) -> int:
        return self.tp_size if self.sequence_parallel else 1


@dataclass(kw_only=True)
class StepResult:
    schedule: str
    loss: float
    """The logical-batch loss (on this DP rank's share)."""
    positions_logical: int
    """Token positions naive training processes (sum of rollout lengths)."""
    positions_computed: int
    """Token positions this schedule ran forward once (naive: logical; packed/replay: distinct trie positions)."""
    positions_recomputed: int = 0
    """Extra forward positions spent on recomputation (replay with recompute)."""
    forwards: int = 0
    """Model forward calls."""
    logprobs: dict[int, float] | None = None
    target_logprobs: torch.Tensor | None = None
    """[N] logprob of every packed token as a target (NaN for roots' first tokens), when keep_logprobs."""
    extra: dict[str, Any] = field(default_factory=dict)

    def rollout_logprobs(self, tree: PrefixTree, i: int) -> torch.Tensor:
        """Logprobs of rollout i's response tokens, in order (from the packed targets)."""
        assert self.target_logprobs is not None, "run the schedule with keep_logprobs=True"
        return self.target_logprobs[tree.response_indices(i)]


def forward_chunk(
    model: torch.nn.Module,
    tree: PrefixTree,
    chunk: Chunk,
    weights: torch.Tensor,
    opts: ScheduleOptions,
    *,
    external_kv: dict[int, KV] | None = None,
    capture: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, KV]]:
    """Forward one chunk; returns (loss over its targets, their logprobs [m], captured chunk K/V per layer)."""
    ctx = BranchContext(
        layout=chunk.layout, external_kv=external_kv or {}, capture=capture, backend=opts.backend
    )
    with attach_context(model, ctx):
        logits = model(chunk.input_ids[None], chunk.position_ids[None], None)  # [1, s, v]
    rows = logits[0].index_select(0, chunk.target_rows)  # [m, v]
    logp = vocab_parallel_logprobs(
        rows, tree.tokens[chunk.targets], vocab_size=opts.vocab_size, tp_group=opts.tp_group
    )  # [m]
    loss = -(logp * weights[chunk.targets].to(logp.dtype)).sum()
    return loss, logp, ctx.captured


def record_logprobs(store: torch.Tensor | None, chunk: Chunk, logp: torch.Tensor) -> None:
    if store is not None:
        store[chunk.targets] = logp.detach().to(store.dtype)
