"""One pipeline stage's side of the tree schedules (schedule/pipeline.py drives it): a chunk's forward and backward
through THIS stage's layers, its message shape, and naive-fused's micro-batch. The messages themselves (receive,
send, the 1F1B order) and the walk are pipeline.py's.

SHAPE LEGEND: a chunk's message [rows, 1, h] (rows: the chunk's CP-local padded rows, split over TP under SP);
the last stage's output is the chunk's loss [].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_branch.attention.context import LocalContext, attach_context
from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.prefix_state import ChunkTree, Handoff, Tensors
from megatron_branch.data import PrefixTree
from megatron_branch.losses.objective import BoundObjective
from megatron_branch.parallel.pipeline import Shape, StageLink
from megatron_branch.schedule import unshared
from megatron_branch.schedule.chunks import Chunk, CPChunk
from megatron_branch.schedule.common import (
    ChunkOut,
    ScheduleOptions,
    Store,
    check_recompute_layers,
    chunk_rows,
    forward_chunk,
    model_device,
)
from megatron_branch.schedule.hooks import Rows, hook_forwards


@dataclass(frozen=True)
class _RolloutChunk:
    """naive-fused's micro-batch: rollouts laid end to end without sharing (unshared.py's packing), one rank."""

    rollouts: tuple[int, ...]
    input_ids: torch.Tensor
    """[s] token ids (padding to a multiple of TP under SP: 0)."""
    position_ids: torch.Tensor
    layout: AttentionLayout
    roots: ChunkTree
    num_real: int

    @classmethod
    def of(cls, tree: PrefixTree, rollouts: Sequence[int], opts: ScheduleOptions) -> _RolloutChunk:
        ids, pos, _, _, layout, roots = unshared._pack(tree, rollouts, opts.pad_to)
        real = sum(len(tree.rollouts[i].prompt) + len(tree.rollouts[i].response) for i in rollouts)
        return cls(tuple(rollouts), ids, pos, layout, roots, real)

    def context(self, tree: PrefixTree, opts: ScheduleOptions, **_: object) -> LocalContext:
        return LocalContext(
            layout=self.layout, backend=opts.backend, recompute_layers=opts.recompute_layers, tree=self.roots
        )


AnyChunk = Chunk | CPChunk | _RolloutChunk


@dataclass
class _Run:
    """One forward of one chunk on this stage, kept until its backward."""

    chunk: AnyChunk
    input: torch.Tensor | None
    """[rows, 1, h] what the previous stage sent (a fresh leaf: its .grad goes back), None on the first stage."""
    output: torch.Tensor
    """[rows, 1, h] what goes to the next stage; on the last stage the chunk's loss []."""
    captured: dict[int, Handoff]
    """layer -> what this stage's layers handed down (when captured)."""
    out: ChunkOut | None
    """The last stage's results of the chunk (loss, logprobs, stats); None elsewhere."""


class _Stage:
    """This rank's stage: one chunk's forward and backward through its layers (messages are the caller's)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tree: PrefixTree,
        objective: BoundObjective | None,
        opts: ScheduleOptions,
        link: StageLink,
        store: Store,
    ) -> None:
        self.model, self.tree, self.objective, self.opts, self.link = model, tree, objective, opts, link
        self.store = store  # naive-fused's head records its rollouts' results itself (unshared.py)
        self.base = _unwrap(model)
        self.device = model_device(model)

    def shape(self, chunk: AnyChunk) -> Shape:
        """The chunk's message on this rank: its (CP-local, padded) rows, split over TP under SP."""
        rows = int(chunk.input_ids.numel())
        if self.opts.sequence_parallel:
            rows //= self.opts.tp_size
        return (rows, 1, int(self.base.config.hidden_size))

    def forward(
        self,
        chunk: AnyChunk,
        received: torch.Tensor | None,
        *,
        external: dict[int, list[Tensors]],
        external_meta: torch.Tensor | None,
        capture: bool,
        grad: bool,
    ) -> _Run:
        x = None if received is None else received.detach().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            self.base.set_input_tensor(x)
            try:
                if self.link.last and isinstance(chunk, _RolloutChunk):  # naive-fused's own head and loss
                    loss = unshared._forward(self.model, self.tree, chunk.rollouts, self.objective, self.opts,
                                             self.store)  # fmt: skip
                    return _Run(chunk, x, loss, {}, None)
                if self.link.last:
                    out = forward_chunk(
                        self.model, self.tree, chunk, self.objective, self.opts,
                        external=external, capture=capture, external_meta=external_meta,
                    )  # fmt: skip
                    return _Run(chunk, x, out.loss, out.captured, out)
                check_recompute_layers(self.model, self.opts)
                ctx = chunk.context(
                    self.tree, self.opts, external=external, external_meta=external_meta, capture=capture,
                    device=self.device,
                )  # fmt: skip
                ids, pos = chunk.input_ids.to(self.device)[None], chunk.position_ids.to(self.device)[None]
                where = (
                    Rows(rollouts=chunk.rollouts, rows=ids.shape[1])
                    if isinstance(chunk, _RolloutChunk)
                    else chunk_rows(chunk, ids.shape[1])
                )
                with attach_context(self.model, ctx), hook_forwards(self.model, self.opts, where):
                    hidden = self.model(ids, pos, None)  # [rows, 1, h]: megatron returns the block's output
                return _Run(chunk, x, hidden, ctx.captured, None)
            finally:
                self.base.set_input_tensor(None)

    def backward(
        self,
        run: _Run,
        grad_output: torch.Tensor | None,
        outputs: Sequence[torch.Tensor] = (),
        grads: Sequence[torch.Tensor] = (),
    ) -> torch.Tensor | None:
        """Back-propagate the chunk's output (the next stage's gradient; 1 for the loss) together with
        `outputs`/`grads` (the accumulated prefix-state gradients of this stage's layers) in ONE backward; returns
        the gradient of the chunk's input for the previous stage (None on the first stage)."""
        head = torch.ones_like(run.output) if self.link.last else grad_output
        assert head is not None, "a stage that is not the last receives its output's gradient"
        pairs = [(o, g) for o, g in zip([run.output, *outputs], [head, *grads]) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if run.input is None:
            return None
        return run.input.grad if run.input.grad is not None else torch.zeros_like(run.input)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model
