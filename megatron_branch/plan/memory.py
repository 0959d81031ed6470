"""Per-rank memory of one training step, by term: what THIS engine keeps alive, counted from its code.

Two kinds of terms:
  * static: weights, gradients, optimizer state (Megatron-LM's `theoretical_memory_usage`: bf16 weights 2 B,
    fp32 main grads 4 B, fp32 master copy + Adam moments 12 B = 18 B/param; the distributed optimizer shards the
    12 B over the data-parallel x context-parallel group, which is megatron's optimizer sharding group; float32
    weights are their own master: 8 B; the offload's host terms: plan/optimizer.py);
  * per chunk: the tensors autograd saves for backward, one storage counted once, exactly as the activation meter
    (megatron_branch/memory.py) counts them, plus transient buffers the meter does not see (ring blocks, logits
    chunks) and a stated allocator margin.

The per-chunk terms (what each layer saves, per kind of layer): plan/activations.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from megatron_branch.data.pieces import piece_lengths
from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.activations import (
    Dims,
    cdiv,
    chunk_saved_bytes,
    dispatcher_bytes,
    exchange_buffer_bytes,
    kv_grad_bytes,
    layer_cache_bytes,
    linear_state_bytes,
    linear_state_grad_bytes,
    local_rows,
    logits_bytes,
    ring_buffer_bytes,
)
from megatron_branch.plan.model import Layout, RolloutShape, parameter_count
from megatron_branch.plan.pipeline import (
    moe_stage_parameters_per_rank,
    stage_parameters,
    stage_parameters_per_rank,
)

ALLOCATOR_MARGIN_FRACTION = 0.08
"""Caching-allocator fragmentation allowance on top of the counted terms (a stated assumption, not measured)."""


ALLOCATOR_MARGIN_FIXED = 2 * 2**30
"""CUDA context, NCCL buffers, cuBLAS workspace (a stated assumption)."""


def static_bytes(
    arch: ModelArch,
    layout: Layout,
    *,
    distributed_optimizer: bool = True,
    param_bytes: int = 2,
    stage: int | None = None,
) -> dict[str, int]:
    """Weights (bf16: 2 B), gradients (fp32 main grads), optimizer state (fp32 master + Adam m, v) on one rank.
    A MoE model's routed experts are split over EP x expert TP (tp, or 1: every expert whole on each TP rank) and
    their optimizer state over the expert data-parallel group (tp / etp * cp * dp / ep); everything else over TP,
    its optimizer state over DP x CP. Under PP a rank holds its stage's parameters only (plan/pipeline.py):
    `stage` (a dense model) that stage's, default the heavier stage's; the optimizer state shards those."""
    pc = parameter_count(arch)
    replicated = pc["replicated"]  # norms, routers, row-parallel biases are not TP-sharded
    experts = pc["experts"] // (layout.expert_tp * layout.ep)
    # the vocabulary rows the engine pads to a multiple of tp (embedding and an untied output layer: arch.py)
    pad = (arch.padded_vocab_size(layout.tp) - arch.vocab_size) * arch.hidden_size
    pad *= 1 if arch.tie_word_embeddings else 2
    dense = (pc["total"] - pc["experts"] - replicated + pad) // layout.tp + replicated
    per_rank = dense + experts
    if layout.pp > 1 and arch.is_moe:  # the heaviest stage's layers, its routed experts (plan/pipeline.py)
        dense, experts = moe_stage_parameters_per_rank(arch, layout)
        per_rank = dense + experts
    elif layout.pp > 1:  # the stage's layers and vocab x h (plan/pipeline.py; dense models)
        per_rank = dense = (
            stage_parameters_per_rank(arch, layout)
            if stage is None
            else stage_parameters(arch, layout, stage)
        )
    assert stage is None or (layout.pp > 1 and not arch.is_moe), "a stage's bytes: dense models under PP"
    shard = layout.dp * layout.cp  # megatron's distributed optimizer shards over DP x CP
    state = (
        4 if param_bytes < 4 else 0
    ) + 8  # fp32 master (bf16 parameters only) + Adam m, v: plan/optimizer.py
    distributed = (state * dense) // shard + (state * experts) // layout.expert_dp
    return {
        "parameters": param_bytes * per_rank,
        "gradients": 4 * per_rank,
        "optimizer_state": distributed if distributed_optimizer else state * per_rank,
        "optimizer_state_no_distributed": state * per_rank,
        "optimizer_state_distributed": distributed,
        "parameters_per_rank": per_rank,
        "expert_parameters_per_rank": experts,
    }


@dataclass(frozen=True, kw_only=True)
class Peak:
    """The saved-for-backward peak of a step on one rank and the transient buffers beside it."""

    activations: int
    """Saved activations of the chunks alive at the peak (for replay: the path's graphs and the running chunk)."""
    cached_kv: int
    """Replay: cached ancestor K/V not already counted in a live graph (with per-layer checkpointing, at a
    recomputed segment's backward: its captured K/V, held outside autograd in place of its released cache entry
    until the injection)."""
    kv_grads: int
    """Replay: their dK/dV accumulators."""
    ring_buffers: int
    logits: int
    dispatcher: int = 0
    """MoE: the all-to-all dispatcher's transient buffers of the largest chunk's layer."""
    cached_state: int = 0
    """Replay of a Mamba hybrid: the SSM state + conv tail each M layer hands down at the fork (plan/mamba.py); its
    accumulators are in kv_grads."""

    @property
    def saved(self) -> int:
        """What the activation meter measures: activations + cached K/V (+ Mamba fork states) + accumulators."""
        return self.activations + self.cached_kv + self.cached_state + self.kv_grads


def step_peak(
    arch: ModelArch,
    shape: RolloutShape,
    layout: Layout,
    *,
    schedule: str = "replay",
    act_bytes: int = 2,
    branch_micro_batch: int = 8,
    logprob_chunk_rows: int = 256,
    segment_recompute: bool | None = None,
    layer_recompute: bool | None = None,
    gdn_kernel: str = "fla",
    stage: int | None = None,
    root_pieces: int = 1,
    chunk_tokens: int | None = None,
) -> Peak:
    """Peak per-rank memory of one step. Prompt groups run one after another (replay runs root by root; packed
    and naive see one group's rollouts at a time per DP rank only for naive, whole tree for packed).
    `gdn_kernel`: a hybrid's delta-rule kernel ("fla" on GPU, "torch" where it runs megatron's torch path).
    Under pipeline parallelism (layout.pp > 1) the peak of pipeline stage `stage` (default: the larger of the
    first and the last stage, plan/pipeline.py): its layers, the output layer on the last one, and the
    micro-batches megatron's 1F1B order keeps alive on it (pp - stage; packed: one chunk per prompt group).
    `root_pieces`: replay's roots cut into that many sequence pieces (data/pieces.py; under PP): with segment
    recompute each piece is recomputed at its own backward, so the root's backward holds one piece's graph.
    `chunk_tokens`: replay's token budget (ScheduleOptions.chunk_tokens; None: the walk, segment by segment):
    whole prompt groups that fit run as packed chunks of as many groups as fit (nothing cached), else the leaves
    run in chunks of as many as fit instead of branch_micro_batch, leaves over the budget in micro-batches of
    branch_micro_batch as without one (replay_chunk_leaves)."""
    if layout.pp > 1 and stage is None:
        return heavier_stage_peak(
            arch, shape, layout, schedule=schedule, act_bytes=act_bytes, branch_micro_batch=branch_micro_batch,
            logprob_chunk_rows=logprob_chunk_rows, segment_recompute=segment_recompute,
            layer_recompute=layer_recompute, gdn_kernel=gdn_kernel, root_pieces=root_pieces,
            chunk_tokens=chunk_tokens,
        )  # fmt: skip
    dm = Dims.of(arch, layout, act_bytes, gdn_kernel=gdn_kernel)
    if stage is not None:
        dm = dataclasses.replace(dm, head=stage == layout.pp - 1, stage=stage)
    alive = 1 if stage is None else layout.pp - stage  # micro-batches in flight on this stage (1F1B)
    cp = layout.cp
    seg_rc = layout.recompute in ("selective", "full") if segment_recompute is None else segment_recompute
    lay_rc = layout.recompute == "full" if layer_recompute is None else layer_recompute
    R, L, G = shape.root_length, shape.leaf_length, shape.responses
    if schedule == "naive" or G == 1:
        n = shape.rollout_length
        r = local_rows(n, 1, layout)
        # naive (megatron's output layer) scores every row; a one-response tree only its response tokens
        m = cdiv(n - 1 if schedule == "naive" else shape.response_length, cp)
        alive = min(alive, cdiv(shape.prompts, layout.dp))  # under PP one-rollout groups flow as a wave
        # one rollout per chunk: a packed chunk's terms (nothing cached)
        return packed_peak(dm, r, m, cp=cp, layer_recompute=lay_rc, sequences=[(n, 1)],
                           logprob_chunk_rows=logprob_chunk_rows, alive=alive)  # fmt: skip
    groups = cdiv(shape.prompts, layout.dp)  # prompt groups on this DP rank
    if schedule == "packed" and layout.pp > 1:  # a wave of one-group chunks (schedule/pipeline.py)
        alive, groups = min(alive, groups), 1
    if schedule == "packed":  # every group of this DP rank in one chunk
        r = groups * (local_rows(R, 1, layout) + local_rows(L, G, layout))
        r = local_rows(r, 1, Layout(tp=layout.tp, sequence_parallel=layout.sequence_parallel))
        m = cdiv(groups * (shape.shared_response_length + G * L), cp)  # every response token once
        seqs = [(R, groups), (L, groups * G)]  # a GDN layer: each whole segment its own sequence
        return packed_peak(dm, r, m, cp=cp, layer_recompute=lay_rc, sequences=seqs,
                           logprob_chunk_rows=logprob_chunk_rows, alive=alive)  # fmt: skip
    assert schedule == "replay", schedule
    if chunk_tokens is not None and R + G * L <= chunk_tokens:
        return _group_chunks_peak(dm, shape, layout, chunk_tokens, groups, alive=alive, layer_recompute=lay_rc,
                                  logprob_chunk_rows=logprob_chunk_rows)  # fmt: skip
    r_root = local_rows(R, 1, layout)
    # only rows that predict a response token reach the output projection (schedule/chunks.py, targets="loss"):
    # the root's shared response tokens and one fork token per child
    m_root = cdiv(shape.shared_response_length + G, cp)
    b = (
        min(branch_micro_batch, G)
        if chunk_tokens is None
        else replay_chunk_leaves(L, G, chunk_tokens, branch_micro_batch)
    )
    alive = min(alive, cdiv(G, b))  # a wave's leaf micro-batches alive at once on this stage
    r_leaf = local_rows(L, b, layout)
    m_leaf = cdiv(b * (L - 1), cp)
    root = chunk_saved_bytes(
        dm, r_root, m_root, cp=cp, layer_recompute=lay_rc, capture=True, sequences=[(R, 1)]
    )
    leaf = chunk_saved_bytes(
        dm, r_leaf, m_leaf, ext=r_root, cp=cp, layer_recompute=lay_rc, sequences=[(L, b)]
    )
    # the root's K/V (full-attention layers) and, for a hybrid, the GDN states its children start from
    state = dm.linear_layers * linear_state_bytes(dm) if dm.linear_layers else 0
    ssm = mamba_fork_state(dm)  # a Mamba hybrid's M layers: (states, their accumulators), plan/mamba.py
    cached = dm.attn_layers * layer_cache_bytes(dm, r_root) + state + ssm[0]  # MLA: its latent (plan/mla.py)
    state_grads = (dm.linear_layers * linear_state_grad_bytes(dm) if dm.linear_layers else 0) + ssm[1]
    grads = kv_grad_bytes(dm, r_root) + state_grads  # fp32 for bf16 leaves (WideSum)
    # phase 1, the last leaf micro-batch before its backward: root graph (unless recomputed) + cache + grads + leaf
    # (the root's captured K/V, when its graph is kept, are the cache's storage: counted once)
    root_graph = 0 if seg_rc else root["held"]
    phase_leaves = root_graph + cached + grads + alive * (leaf["kv"] + leaf["other"])
    # phase 2, the root's own backward: grads + the root's graph (+ the cache, unless recomputed). With segment
    # recompute the root's cache entry is released before its forward runs again (schedule/prefix_cache.py
    # `release`: only the accumulated grads are kept) and its recomputed K/V take its place: one copy, not two.
    # Without any recompute this never exceeds phase 1 (which holds the same graph).
    # (a hybrid's GDN fork states stay counted once: the recomputed states replace the released ones)
    released = dm.attn_layers * layer_cache_bytes(dm, r_root) if seg_rc else 0
    if seg_rc and root_pieces > 1:
        # one piece recomputed at a time: the longest, with the root's loss rows (a bound); the earlier pieces stay
        # cached and only the piece's own entry is released (the last piece's: the shortest, a bound)
        p = piece_lengths(R, root_pieces)[0]
        root = chunk_saved_bytes(dm, local_rows(p, 1, layout), m_root, cp=cp, layer_recompute=lay_rc,
                                 capture=True, sequences=[(p, 1)])  # fmt: skip
        last = piece_lengths(R, root_pieces)[-1]
        released = dm.attn_layers * layer_cache_bytes(dm, local_rows(last, 1, layout))
    root_kv = root["kv"] if seg_rc else 0
    phase_root = cached - released + root_kv + root["other"] + grads
    ring = max(
        ring_buffer_bytes(dm, r_root, r_root, cp),
        ring_buffer_bytes(dm, r_leaf, r_root + r_leaf, cp),
        exchange_buffer_bytes(dm, max(r_root, r_leaf)),
    )
    logits = max(logits_bytes(dm, m_root, logprob_chunk_rows), logits_bytes(dm, m_leaf, logprob_chunk_rows))
    dispatch = max(dispatcher_bytes(dm, r_root), dispatcher_bytes(dm, r_leaf))
    if phase_root > phase_leaves:
        # under per-layer checkpointing the recomputed root's captured K/V live outside autograd in place of the
        # released cache entry until the injection (the meter sees them registered with it): counted as cached_kv
        outside = root_kv if lay_rc else 0
        return Peak(
            activations=root_kv - outside + root["other"],
            cached_kv=cached - released + outside - ssm[0],
            kv_grads=grads,
            ring_buffers=ring,
            logits=logits,
            dispatcher=dispatch,
            cached_state=ssm[0],
        )
    return Peak(
        activations=root_graph + alive * (leaf["kv"] + leaf["other"]),
        cached_kv=cached - ssm[0],
        kv_grads=grads,
        ring_buffers=ring,
        logits=logits,
        dispatcher=dispatch,
        cached_state=ssm[0],
    )


def mamba_fork_state(dm: Dims) -> tuple[int, int]:
    """(bytes, accumulator bytes) of the state every M layer of a Mamba hybrid hands down at the fork (0, 0 for
    other models; plan/mamba.py)."""
    if dm.arch.hybrid_override_pattern is None:
        return 0, 0
    from megatron_branch.plan.mamba import kind_count, mamba_state_bytes, mamba_state_grad_bytes

    layers = kind_count(dm.arch, "M")
    return layers * mamba_state_bytes(dm), layers * mamba_state_grad_bytes(dm)


def packed_peak(
    dm: Dims,
    r: int,
    m: int,
    *,
    cp: int,
    layer_recompute: bool,
    sequences: list[tuple[int, int]],
    logprob_chunk_rows: int,
    alive: int = 1,
) -> Peak:
    """One packed chunk of r local rows and m local targets (`alive` of them in flight under PP): its saved tensors
    and the transient buffers beside them (also `schedule: auto`'s packed side, plan/auto.py)."""
    c = chunk_saved_bytes(dm, r, m, cp=cp, layer_recompute=layer_recompute, sequences=sequences)
    return Peak(
        activations=alive * (c["kv"] + c["other"]),
        cached_kv=0,
        kv_grads=0,
        ring_buffers=max(ring_buffer_bytes(dm, r, r, cp), exchange_buffer_bytes(dm, r)),
        logits=logits_bytes(dm, m, logprob_chunk_rows),
        dispatcher=dispatcher_bytes(dm, r),
    )


def replay_chunk_leaves(leaf_length: int, responses: int, chunk_tokens: int, branch_micro_batch: int) -> int:
    """Leaves per chunk of replay's token budget (schedule/walk.py packed_groups): as many as fit; leaves each
    larger than the budget in micro-batches of branch_micro_batch, as without a budget."""
    if leaf_length > chunk_tokens:
        return min(branch_micro_batch, responses)
    return max(1, min(responses, chunk_tokens // leaf_length))


def _group_chunks_peak(
    dm: Dims,
    shape: RolloutShape,
    layout: Layout,
    chunk_tokens: int,
    groups: int,
    *,
    alive: int,
    layer_recompute: bool,
    logprob_chunk_rows: int,
) -> Peak:
    """Replay whose prompt groups each fit its token budget: chunks of k whole groups, each a packed chunk against
    no cache (schedule/walk.py run_forest), priced as packed's k-group chunk."""
    R, L, G = shape.root_length, shape.leaf_length, shape.responses
    k = min(groups, chunk_tokens // (R + G * L))
    r = k * (local_rows(R, 1, layout) + local_rows(L, G, layout))
    r = local_rows(r, 1, Layout(tp=layout.tp, sequence_parallel=layout.sequence_parallel))
    m = cdiv(k * (shape.shared_response_length + G * L), layout.cp)  # every response token once
    return packed_peak(dm, r, m, cp=layout.cp, layer_recompute=layer_recompute, sequences=[(R, k), (L, k * G)],
                       logprob_chunk_rows=logprob_chunk_rows, alive=min(alive, cdiv(groups, k)))  # fmt: skip


def margin_bytes(counted: int) -> int:
    return int(ALLOCATOR_MARGIN_FRACTION * counted) + ALLOCATOR_MARGIN_FIXED


def heavier_stage_peak(arch: ModelArch, shape: RolloutShape, layout: Layout, **kw: Any) -> Peak:
    """The step's peak on the first and on the last pipeline stage (step_peak at `stage`), the
    larger of the two; a GDN hybrid's middle stages too (their layers' kinds may differ)."""
    stages = range(layout.pp) if arch.is_hybrid else (0, layout.pp - 1)
    peaks = [step_peak(arch, shape, layout, stage=s, **kw) for s in stages]
    return max(peaks, key=lambda p: p.saved + p.ring_buffers + p.logits)
