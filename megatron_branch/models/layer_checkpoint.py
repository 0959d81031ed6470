"""Per-layer activation checkpointing inside a chunk (ScheduleOptions.recompute_layers; the planner's
`recompute full` together with replay's segment recompute).

Shape legend (Megatron, sequence first): s chunk rows on this rank (s/tp under sequence parallel), b batch (1),
h hidden. A checkpointed layer keeps only its input hidden_states [s, b, h] for backward; in backward its forward
runs once more and that one layer's graph lives until the layer's backward is done (one layer at a time).

The hook is megatron's own plug-in point: the layer spec's module (models/gpt.py `branch_layer_spec`) is
`BranchTransformerLayer`, megatron's TransformerLayer whose forward checkpoints itself while the BranchContext
attached to it says `recompute_layers` and grad is enabled. Without a context, or under no_grad (scoring, replay's
graph-free first forward of a recomputed segment), it IS megatron's layer. The layer takes the context itself
(TakesBranchContext: the schedule's `attach_context` sets it on every layer as on every token mixer), so a layer
with no token mixer (a hybrid's MLP-only "-" or MoE-only "E" layer: IdentityOp attention) is checkpointed too.

Why torch.utils.checkpoint(use_reentrant=False) and not megatron's `tensor_parallel.checkpoint`, which is
reentrant: a reentrant checkpoint runs the region's forward under no_grad and rebuilds the graph inside its own
backward. The K/V a segment captures for its children (BranchContext.captured) would then come out of the forward
without a graph, so replay could not inject the children's dK/dV into them (schedule/replay.py): the step fails
("does not require grad"; planted in the tests). The non-reentrant form keeps the region in the ordinary graph
(captured K/V keep their grad_fn) and only frees and rebuilds the saved tensors (torch.utils.checkpoint's note
on the two variants: the reentrant one "does not record the autograd graph" in forward, the non-reentrant one
does). Measured, not assumed: the dK/dV a checkpointed leaf chunk sends into the cached ancestor K/V it reads
survive either variant (the reentrant backward, torch's and megatron's alike, runs autograd.backward over the
rebuilt graph, which accumulates into every leaf it reaches); only the captured K/V need the non-reentrant form.

Traps handled here (tests/unit/test_layer_checkpoint.py plants each one):
  * the recomputation runs in backward, after `attach_context` has exited: it re-attaches the chunk's context
    (layout, cached K/V, CP metadata) to THIS layer's token mixer, if it has one, for its duration, then restores
    what was there;
  * multi-latent attention applies RoPE inside the layer, from its own `PositionRotaryEmbedding` whose position ids
    the model's forward hook sets and clears: the recomputation restores the first forward's ids (models/mla.py;
    without it a replayed branch would recompute with positions 0.., measured 30% off HF);
  * it captures nothing (`BranchContext.for_recompute`): the schedule's K/V are the first forward's, in the graph
    the gradients are injected into;
  * under CP the recomputation runs the ring again (collectives inside backward); every rank recomputes the same
    layers in the same order because every rank runs the same deterministic schedule and backward;
  * RNG: dropout is 0 in the models we build (models/arch.py); checkpoint's `preserve_rng_state` (the default)
    restores the CPU/CUDA generator state for the recomputation anyway;
  * the activation meter (memory.py): the layer input is saved by checkpoint as an ordinary saved tensor (the
    meter sees it), the rebuilt graph is counted by `count_recomputed`, and captured K/V, which the schedule keeps
    outside autograd's saved tensors once the region is checkpointed, are registered with `track_extra`;
  * a MoE layer: megatron's all-to-all dispatcher keeps the recomputed probs, and with them the rebuilt graph
    upstream of the router, until the layer's next forward; the recomputation drops them (planted:
    tests/unit/test_plan_moe.py test_planted_a_recomputed_moe_layer_that_keeps_its_graph).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.utils.checkpoint import checkpoint

from megatron_branch.attention.context import BranchContext, TakesBranchContext
from megatron_branch.attention.core_attention import BranchCoreAttention
from megatron_branch.memory import count_recomputed, track_extra
from megatron_branch.models.moe import attached_to_layer, layer_router_context, release_dispatcher_state
from megatron_branch.models.rotary import PositionRotaryEmbedding, rope_positions


class BranchTransformerLayer(TransformerLayer, TakesBranchContext):
    """megatron's TransformerLayer (same constructor, forward and state dict), checkpointed per the context
    attached to it (the chunk's, as on its token mixer; a layer without one reads it only here)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self.context
        if ctx is None or not ctx.recompute_layers or not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        # the hidden states go in as checkpoint's one saved input; the rest (masks, RoPE table, None's) by closure
        hidden = args[0] if args else kwargs.pop("hidden_states")
        run = _Checkpointed(self, ctx, args[1:], kwargs)
        return checkpoint(run, hidden, use_reentrant=False)


def context_reader(layer: TransformerLayer) -> Any:
    """The module of `layer` that reads the context: its core attention, or a mixer that takes the context
    whole (the hybrids' BranchGatedDeltaNet, BranchMambaMixer); None when neither is ours (an MLP / MoE-only
    layer: IdentityOp attention)."""
    core = getattr(layer.self_attention, "core_attention", None)
    if isinstance(core, BranchCoreAttention):
        return core
    return layer.self_attention if isinstance(layer.self_attention, TakesBranchContext) else None


class _Checkpointed:
    """The function checkpoint runs: the layer's forward; its first call is the forward, later ones recompute."""

    def __init__(self, layer: BranchTransformerLayer, ctx: BranchContext, args: tuple, kwargs: dict) -> None:
        self.layer, self.ctx, self.args, self.kwargs = layer, ctx, args, kwargs
        self.router_ctx = layer_router_context(
            layer
        )  # a MoE layer's rows (models/moe.py), re-attached likewise
        rope = getattr(layer.self_attention, "rotary_pos_emb", None)  # MLA's own (models/rotary.py)
        self.rope = rope if isinstance(rope, PositionRotaryEmbedding) else None
        self.positions = None if self.rope is None else self.rope.position_ids
        self.calls = 0

    def __call__(self, hidden: torch.Tensor) -> Any:
        self.calls += 1
        core = context_reader(self.layer)
        if self.calls == 1:  # the forward, with the schedule's context attached
            out = TransformerLayer.forward(self.layer, hidden, *self.args, **self.kwargs)
            if self.ctx.capture and core is not None and core.layer_number in self.ctx.captured:
                # the captured K/V are no longer saved by autograd (checkpoint dropped the region's saved
                # tensors) but the schedule holds them: count them as the meter did without checkpointing
                track_extra(self.ctx.captured[core.layer_number].tensors)
            return out
        router_ctx = None if self.router_ctx is None else self.router_ctx.for_recompute()
        try:
            with (
                attached(core, self.ctx.for_recompute()),
                attached_to_layer(self.layer, router_ctx),
                rope_positions(self.rope, self.positions),
                count_recomputed(),
            ):
                return TransformerLayer.forward(self.layer, hidden, *self.args, **self.kwargs)
        finally:
            # megatron's all-to-all dispatcher keeps its forward's probs as an attribute until the layer's next
            # forward (token_dispatcher.py MoEAlltoAllTokenDispatcher.dispatch_preprocess: `self.probs = probs`).
            # The recomputed probs carry the rebuilt graph, which nothing back-propagates: they would keep every
            # rebuilt tensor upstream of the router (the router's, the pre-MLP norm's, the attention's) alive until
            # then, every MoE layer's at once by the chunk's first layer (measured: up to 2x the planner's
            # full-recompute peak). In `finally`: checkpoint stops the recomputation by an exception once the last
            # saved tensor is rebuilt (torch.utils.checkpoint's early stop), after the dispatch.
            release_dispatcher_state(self.layer)


@contextmanager
def attached(core: Any, ctx: BranchContext) -> Iterator[None]:
    """`ctx` attached to one token mixer for a recomputation, then whatever was attached before (None: the
    recomputation runs in backward, after the schedule's `attach_context` has exited); no-op for a layer without
    one (core None)."""
    if core is None:
        yield
        return
    held, core.context = core.context, ctx
    try:
        yield
    finally:
        core.context = held


def uses_layer_checkpointing(model: torch.nn.Module) -> bool:
    """Whether `model` has layers that can checkpoint themselves (built from `branch_layer_spec`)."""
    return any(isinstance(m, BranchTransformerLayer) for m in model.modules())
