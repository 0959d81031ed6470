"""What every schedule shares: one chunk's forward, logprobs and loss, and the step's result record.

Shape legend: s chunk tokens, m predicted targets, v vocabulary slice on this TP rank, b batch (1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.attention.core_attention import KV, BranchContext, attach_context
from megatron_branch.data import PrefixTree
from megatron_branch.losses.fused_logprobs import fused_linear_logprobs
from megatron_branch.losses.logprobs import vocab_parallel_logprobs
from megatron_branch.losses.objective import BoundObjective
from megatron_branch.models.gpt import BranchGPTModel
from megatron_branch.parallel.cp_layout import CPChunk, split_chunk, tree_related
from megatron_branch.parallel.groups import comm_device
from megatron_branch.schedule.chunks import Chunk, make_chunk


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
    cp_group: Any = None
    """Context-parallel group (None = no CP). With cp_size > 1 every chunk is split zigzag over it and attention
    runs as a ring (megatron_branch.parallel); parameter grads then need parallel.grads.finalize_grads."""
    cp_size: int = 1
    """Its size."""
    fused_logprobs: bool = True
    """Fuse the output projection with the logprob by row chunks (losses/fused_logprobs.py): a chunk's full logits
    are never materialised. Needs a BranchGPTModel; False (or another model) = megatron's output layer + logprobs."""
    logprob_chunk_rows: int = 1024
    """Rows of logits alive at once in the fused path."""

    def __post_init__(self) -> None:
        if self.cp_size > 1 and self.cp_group is None:
            raise ValueError(f"cp_size={self.cp_size} needs a cp_group")
        if self.vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {self.vocab_size}")
        if self.branch_micro_batch <= 0:
            raise ValueError(f"branch_micro_batch must be positive, got {self.branch_micro_batch}")
        if self.logprob_chunk_rows <= 0:
            raise ValueError(f"logprob_chunk_rows must be positive, got {self.logprob_chunk_rows}")

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
    target_logprobs: torch.Tensor | None = None
    """[N] logprob of every packed token that is in some rollout's response (NaN elsewhere), when keep_logprobs."""

    def rollout_logprobs(self, tree: PrefixTree, i: int) -> torch.Tensor:
        """Logprobs of rollout i's response tokens, in order (from the packed targets)."""
        assert self.target_logprobs is not None, "run the schedule with keep_logprobs=True"
        return self.target_logprobs[tree.response_indices(i)]


def prepare_chunk(
    tree: PrefixTree, segments: Sequence[int], opts: ScheduleOptions, *, external: Sequence[int] = ()
) -> Chunk | CPChunk:
    """The chunk of `segments` (cached ancestors `external`); under CP, this rank's zigzag share of it."""
    if opts.cp_size == 1:
        return make_chunk(tree, segments, external=external, pad_to_multiple=opts.pad_to)
    assert dist.get_world_size(opts.cp_group) == opts.cp_size, "cp_size must be the size of cp_group"
    full = make_chunk(tree, segments, external=external)
    return split_chunk(tree, full, opts.cp_size, dist.get_rank(opts.cp_group), pad_to_multiple=opts.pad_to)


def forward_chunk(
    model: torch.nn.Module,
    tree: PrefixTree,
    chunk: Chunk | CPChunk,
    objective: BoundObjective,
    opts: ScheduleOptions,
    *,
    external_kv: dict[int, list[KV]] | None = None,
    capture: bool = False,
    external_meta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[int, KV]]:
    """Forward one chunk; returns (loss over its targets, their logprobs [m], captured chunk K/V per layer).

    Under CP (`chunk` a CPChunk) only this rank's rows and targets; `external_meta` [2, c] describes the rows of
    `external_kv`.
    """
    ctx: BranchContext
    if isinstance(chunk, CPChunk):
        from megatron_branch.parallel.context import RingBranchContext

        ctx = RingBranchContext(
            q_meta=chunk.meta.to(model_device(model)),
            external_kv=external_kv or {},
            external_meta=None if external_meta is None else external_meta.to(model_device(model)),
            related=tree_related(tree).to(model_device(model)),
            cp_group=opts.cp_group,
            capture=capture,
        )
    else:
        ctx = BranchContext(
            layout=chunk.layout, external_kv=external_kv or {}, capture=capture, backend=opts.backend
        )
    dev = model_device(model)  # chunks are built on the host; the model may live on an accelerator
    ids, pos = chunk.input_ids.to(dev)[None], chunk.position_ids.to(dev)[None]  # [1, s]
    target_rows, target_ids = chunk.target_rows.to(dev), tree.tokens[chunk.targets].to(dev)  # [m]
    base = getattr(model, "module", model)  # megatron DDP wraps the GPTModel
    if opts.fused_logprobs and isinstance(base, BranchGPTModel):
        with attach_context(model, ctx), base.hidden_states_only():
            hidden = model(ids, pos, None)  # [s (/tp under SP), 1, h] final hidden states
        hidden = _to_output_region(hidden, opts)[:, 0]  # [s, h], TP-summed gradient in backward
        logp = fused_linear_logprobs(
            hidden.index_select(0, target_rows),
            _output_weight(base),  # [v/tp, h]
            target_ids,
            vocab_size=opts.vocab_size,
            tp_group=opts.tp_group,
            chunk_rows=opts.logprob_chunk_rows,
        )  # [m]
    else:
        with attach_context(model, ctx):
            logits = model(ids, pos, None)  # [1, s, v]
        rows = logits[0].index_select(0, target_rows)  # [m, v]
        logp = vocab_parallel_logprobs(rows, target_ids, vocab_size=opts.vocab_size, tp_group=opts.tp_group)
    return objective.chunk_loss(logp, chunk.targets), logp, ctx.captured


def _output_weight(model: BranchGPTModel) -> torch.Tensor:
    """The output projection megatron's _postprocess uses: the shared embedding only when tied (megatron's
    `shared_embedding_or_output_weight` returns the embedding on any first stage, tied or not)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _to_output_region(hidden: torch.Tensor, opts: ScheduleOptions) -> torch.Tensor:
    """What megatron's ColumnParallelLinear does to the output layer's input: under SP all-gather the sequence
    (backward: reduce-scatter), else identity (backward: all-reduce the partial input gradients over TP)."""
    if opts.tp_size == 1 or opts.tp_group is None:
        return hidden
    from megatron.core.tensor_parallel.mappings import (
        copy_to_tensor_model_parallel_region,
        gather_from_sequence_parallel_region,
    )

    if opts.sequence_parallel:
        return gather_from_sequence_parallel_region(
            hidden, tensor_parallel_output_grad=True, group=opts.tp_group
        )
    return copy_to_tensor_model_parallel_region(hidden, group=opts.tp_group)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def record_logprobs(store: torch.Tensor | None, chunk: Chunk | CPChunk, logp: torch.Tensor) -> None:
    if store is not None:  # the store lives on the host, indexed by packed position
        store[chunk.targets] = logp.detach().to(device=store.device, dtype=store.dtype)


def cache_rows(chunk: Chunk | CPChunk) -> int:
    """Rows of a chunk's K/V that descendants attend to: the real rows, or under CP every local row (padding is
    hidden by its metadata, and keeping it keeps every rank's cached shard the same length)."""
    return chunk.num_local if isinstance(chunk, CPChunk) else chunk.num_real


def reduce_over_cp(
    loss: float, store: torch.Tensor | None, opts: ScheduleOptions
) -> tuple[float, torch.Tensor | None]:
    """Under CP: the loss is the SUM of the ranks' terms; each target's logprob was computed on exactly one rank."""
    if opts.cp_size == 1:
        return loss, store
    dev = comm_device(opts.cp_group)
    t = torch.tensor([loss], dtype=torch.float64, device=dev)
    dist.all_reduce(t, group=opts.cp_group)
    if store is not None:
        held = ~torch.isnan(store)
        both = torch.stack([torch.where(held, store, torch.zeros_like(store)), held.to(store.dtype)]).to(
            dev
        )  # [2, N]
        dist.all_reduce(both, group=opts.cp_group)
        both = both.cpu()  # the store lives on the host
        store = torch.where(both[1] > 0, both[0], torch.full_like(store, float("nan")))
    return float(t[0]), store
