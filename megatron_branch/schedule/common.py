"""What every schedule shares: one chunk's forward (logprobs, entropy, loss), and the step's result (the options:
schedule/options.py).

Shape legend: s chunk tokens, m predicted targets, v vocabulary slice on this TP rank, b batch (1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.attention.context import BranchContext, attach_context
from megatron_branch.attention.prefix_state import Handoff, Tensors
from megatron_branch.data import PrefixTree
from megatron_branch.losses.fused_logprobs import fused_linear_logprobs_entropy
from megatron_branch.losses.logprobs import vocab_parallel_entropy, vocab_parallel_logprobs
from megatron_branch.losses.objective import BoundObjective
from megatron_branch.models.gpt import BranchGPTModel
from megatron_branch.models.layer_checkpoint import uses_layer_checkpointing
from megatron_branch.parallel.groups import comm_device
from megatron_branch.schedule.chunks import Chunk, CPChunk, make_chunk, split_chunk
from megatron_branch.schedule.hooks import Rows, hook_forwards
from megatron_branch.schedule.options import ScheduleOptions


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
    """[N] logprob of every packed token in some rollout's response (NaN elsewhere: prompt-only tokens are never
    predicted, see schedule/chunks.py make_chunk), when keep_logprobs."""
    target_entropy: torch.Tensor | None = None
    """[N] entropy of the row predicting every packed token (NaN where none), when keep_entropy."""
    stats: dict[str, float] = field(default_factory=dict)
    """The objective's metric contributions (already normalised on the global batch: they add over micro-batches
    and DP ranks), summed over this rank's chunks and CP."""

    def rollout_logprobs(self, tree: PrefixTree, i: int) -> torch.Tensor:
        """Logprobs of rollout i's response tokens, in order (from the packed targets)."""
        assert self.target_logprobs is not None, "run the schedule with keep_logprobs=True"
        return self.target_logprobs[tree.response_indices(i)]

    def rollout_entropy(self, tree: PrefixTree, i: int) -> torch.Tensor:
        """Entropies at rollout i's response tokens, in order."""
        assert self.target_entropy is not None, "run the schedule with keep_entropy=True"
        return self.target_entropy[tree.response_indices(i)]


@dataclass(kw_only=True)
class ChunkOut:
    """What one chunk's forward gives its schedule."""

    loss: torch.Tensor
    """[] the objective's loss over the chunk's targets (0 when scoring)."""
    stats: torch.Tensor
    """[K] float64 detached metric contributions (the objective's `stat_names`)."""
    logp: torch.Tensor
    """[m] logprob of each target (for a critic: the value at its row)."""
    entropy: torch.Tensor | None
    """[m] entropy of each target's row, when the objective or the options ask for it."""
    captured: dict[int, Handoff]
    """layer -> what this chunk hands its descendants (when captured; attention: its K/V)."""


class Store:
    """Host-side per-packed-token results of a step (logprobs, entropy), NaN where not predicted."""

    def __init__(self, tree: PrefixTree, opts: ScheduleOptions) -> None:
        n = tree.num_tokens
        self.logp = torch.full((n,), float("nan"), dtype=torch.float64) if opts.keep_logprobs else None
        self.entropy = torch.full((n,), float("nan"), dtype=torch.float64) if opts.keep_entropy else None
        self.loss = 0.0
        self.stats: torch.Tensor | None = None

    def add(self, targets: torch.Tensor, out: ChunkOut) -> None:
        """Record one counted chunk forward (the one whose loss is back-propagated)."""
        self.loss += float(out.loss.detach())
        self.stats = out.stats if self.stats is None else self.stats + out.stats
        if self.logp is not None:
            self.logp[targets] = out.logp.detach().to(device="cpu", dtype=torch.float64)
        if self.entropy is not None and out.entropy is not None:
            self.entropy[targets] = out.entropy.detach().to(device="cpu", dtype=torch.float64)

    def set_rows(self, idx: torch.Tensor, logp: torch.Tensor, entropy: torch.Tensor | None) -> None:
        if self.logp is not None:
            self.logp[idx] = logp.detach().to(device="cpu", dtype=torch.float64)
        if self.entropy is not None and entropy is not None:
            self.entropy[idx] = entropy.detach().to(device="cpu", dtype=torch.float64)

    def result(
        self, name: str, tree: PrefixTree, objective: BoundObjective | None, opts: ScheduleOptions, **kw: Any
    ) -> StepResult:
        """The step's result, summed over the CP group (each target was computed on exactly one CP rank)."""
        names = tuple(objective.stat_names) if objective is not None else ()
        stats = self.stats if self.stats is not None else torch.zeros(len(names), dtype=torch.float64)
        loss, stats = self.loss, stats.detach().cpu().to(torch.float64)
        logp, entropy = self.logp, self.entropy
        if opts.cp_size > 1:
            dev = comm_device(opts.cp_group)
            t = torch.cat([torch.tensor([loss], dtype=torch.float64), stats]).to(dev)
            dist.all_reduce(t, group=opts.cp_group)
            t = t.cpu()
            loss, stats = float(t[0]), t[1:]
            logp, entropy = _merge_over_cp(logp, opts), _merge_over_cp(entropy, opts)
        return StepResult(
            schedule=name,
            loss=loss,
            positions_logical=tree.positions_logical,
            target_logprobs=logp,
            target_entropy=entropy,
            stats=dict(zip(names, stats.tolist())),
            **kw,
        )


def _merge_over_cp(store: torch.Tensor | None, opts: ScheduleOptions) -> torch.Tensor | None:
    if store is None:
        return None
    dev = comm_device(opts.cp_group)
    held = ~torch.isnan(store)
    both = torch.stack([torch.where(held, store, torch.zeros_like(store)), held.to(store.dtype)]).to(
        dev
    )  # [2, N]
    dist.all_reduce(both, group=opts.cp_group)
    both = both.cpu()  # the store lives on the host
    return torch.where(both[1] > 0, both[0], torch.full_like(store, float("nan")))


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
    objective: BoundObjective | None,
    opts: ScheduleOptions,
    *,
    external: dict[int, list[Tensors]] | None = None,
    capture: bool = False,
    external_meta: torch.Tensor | None = None,
) -> ChunkOut:
    """Forward one chunk: the objective's loss over its targets, their logprobs [m] (and entropies), and what each
    layer hands down (captured). `external`: per layer, what the cached ancestors hand this chunk
    (schedule/prefix_cache.py). `objective=None` scores only (loss 0). Under CP only this rank's rows and targets;
    `external_meta` [2, c] describes the rows of the handed-down K/V.
    """
    dev = model_device(model)  # chunks are built on the host; the model may live on an accelerator
    check_recompute_layers(model, opts)
    ctx = chunk.context(
        tree, opts, external=external or {}, external_meta=external_meta, capture=capture, device=dev
    )
    want_entropy = opts.keep_entropy or (objective is not None and objective.needs_entropy)
    ids, pos = chunk.input_ids.to(dev)[None], chunk.position_ids.to(dev)[None]  # [1, s]
    target_rows, target_ids = chunk.target_rows.to(dev), tree.tokens[chunk.targets].to(dev)  # [m]
    with hook_forwards(model, opts, chunk_rows(chunk, ids.shape[1])):
        logp, ent = row_logprobs(model, ctx, ids, pos, target_rows, target_ids, opts, entropy=want_entropy)
    if objective is None:
        loss, stats = logp.new_zeros(()), torch.zeros(0, dtype=torch.float64)
    else:
        loss, stats = objective.chunk_loss(logp, chunk.targets, ent)
    return ChunkOut(loss=loss, stats=stats, logp=logp, entropy=ent, captured=ctx.captured)


def chunk_rows(chunk: Chunk | CPChunk, s: int) -> Rows:
    """The rows of a chunk's forward of `s` rows for the schedule hooks: packed index per row, -1 = padding."""
    rows = torch.full((s,), -1, dtype=torch.long)
    rows[: chunk.token_index.numel()] = chunk.token_index
    return Rows(token_index=rows)


def check_recompute_layers(model: torch.nn.Module, opts: ScheduleOptions) -> None:
    """recompute_layers needs layers that checkpoint themselves: refuse rather than silently keep everything."""
    if opts.recompute_layers and not uses_layer_checkpointing(model):
        raise ValueError(
            "recompute_layers needs the model's layers to be BranchTransformerLayer (models.build_model, or "
            "spec.module = BranchTransformerLayer in a patched layer spec)"
        )


def row_logprobs(
    model: torch.nn.Module,
    ctx: BranchContext,
    ids: torch.Tensor,
    pos: torch.Tensor,
    rows: torch.Tensor,
    targets: torch.Tensor,
    opts: ScheduleOptions,
    *,
    entropy: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One model forward of ids/pos [1, s] under `ctx`, then per loss row: the target's logprob (the critic's
    value) [m] and, if `entropy`, the full-vocabulary entropy [m]. `rows` [m] are the rows that predict
    `targets` [m]. Every schedule's forward ends here (forward_chunk, schedule/unshared.py)."""
    base = getattr(model, "module", model)  # megatron DDP wraps the GPTModel
    if isinstance(base, BranchGPTModel) and (opts.fused_logprobs or base.is_critic):
        with attach_context(model, ctx), base.hidden_states_only():
            hidden = model(ids, pos, None)  # [s (/tp under SP), 1, h] final hidden states
        if base.is_critic:  # the value head is replicated over TP: its input is gathered, not TP-summed
            return base.values(_to_replicated_region(hidden, opts)[:, 0].index_select(0, rows)), None  # [m]
        hidden = _to_output_region(hidden, opts)[:, 0]  # [s, h], TP-summed gradient in backward
        return fused_linear_logprobs_entropy(
            hidden.index_select(0, rows),
            _output_weight(base),  # [v/tp, h]
            targets,
            vocab_size=opts.vocab_size,
            tp_group=opts.tp_group,
            chunk_rows=opts.logprob_chunk_rows,
            entropy=entropy,
        )  # [m], [m] or None
    with attach_context(model, ctx):
        logits = model(ids, pos, None)  # [1, s, v]
    picked = logits[0].index_select(0, rows)  # [m, v]
    if getattr(
        base, "is_critic", False
    ):  # megatron's GPTModel with a one-output value head (verl's value model)
        return picked[:, 0].float(), None  # [m]: the value at each row (its head is float32 already)
    logp = vocab_parallel_logprobs(picked, targets, vocab_size=opts.vocab_size, tp_group=opts.tp_group)
    ent = (
        vocab_parallel_entropy(picked, vocab_size=opts.vocab_size, tp_group=opts.tp_group)
        if entropy
        else None
    )
    return logp, ent


def _output_weight(model: BranchGPTModel) -> torch.Tensor:
    """The output projection megatron's _postprocess uses: the shared embedding only when tied (megatron's
    `shared_embedding_or_output_weight` returns the embedding on any first stage, tied or not)."""
    if model.share_embeddings_and_output_weights:
        return model.shared_embedding_or_output_weight()
    return model.output_layer.weight


def _to_replicated_region(hidden: torch.Tensor, opts: ScheduleOptions) -> torch.Tensor:
    """The final hidden states whole on every TP rank for a head replicated over TP (the critic's value head):
    under SP all-gather the sequence (backward: keep this rank's slice), else identity (each TP rank already
    holds the whole input gradient, so nothing is summed)."""
    if opts.tp_size == 1 or opts.tp_group is None or not opts.sequence_parallel:
        return hidden
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(
        hidden, tensor_parallel_output_grad=False, group=opts.tp_group
    )


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
