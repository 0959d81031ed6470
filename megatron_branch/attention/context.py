"""The branch context: what one forward of a chunk tells the model's layers. A small protocol, three implementations.

SHAPE LEGEND (Megatron sequence-first, this rank's rows):
    s  chunk rows   c  rows of the cached ancestors the chunk reads (replay)   b batch (1)
    n  query heads, g kv heads (on this TP rank)   h head dim
    attend: q [s,b,n,h], k/v [s,b,g,h] -> [s,b,n*h];   handed-down K/V blocks [c_j,b,g,h], root first

    LocalContext   one rank: an AttentionLayout, THE plan built from it, the chosen executor (this file)
    RingContext    context parallelism: per-token metadata, the ring calling the chosen executor per block
                   (parallel/context.py); for a recurrent layer the chunk's tree and the head exchange
                   (parallel/head_exchange.py)
    DecodeContext  one decode step of generation: each prompt's K/V in place + each branch's own path
                   (generation/kv_cache.py)
The schedule picks one through its chunk (`Chunk.context` / `CPChunk.context`); layers never ask which. What a
segment hands its descendants (attention K/V, or another layer kind's state at the fork) goes through
`hand_down` / `handed_down` (attention/prefix_state.py has the protocol); `tree` is the chunk's tree for layer kinds
whose state flows along it. `attach_context` attaches one context to every module that reads it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch

from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.prefix_state import (
    ATTENTION_KV,
    ChunkTree,
    Handoff,
    StateKind,
    Tensors,
    compact,
)

KV = tuple[torch.Tensor, torch.Tensor]


class HeadExchange(Protocol):
    """Context parallelism for a layer whose heads are independent along the whole sequence: the CP group's ranks
    each run a block of the heads over every row of the chunk (parallel/head_exchange.py CPHeadExchange; the gated
    delta net, models/gdn.py, and the Mamba-2 mixer, models/mamba.py). Shapes: s_loc this rank's rows, W blocks (CP ranks), s the unsplit chunk's rows."""

    size: int
    """W: the CP group's size (the number of head blocks)."""
    rank: int
    """This rank's block."""

    def to_tree(self, x: torch.Tensor) -> torch.Tensor:
        """x [s_loc, W, c] (this rank's rows, block j for rank j) -> [s, c] (every row in tree order, this block)."""
        ...

    def to_ranks(self, y: torch.Tensor) -> torch.Tensor:
        """y [s, c] (every row, this block) -> [s_loc, W, c] (this rank's rows, block j from rank j)."""
        ...


@runtime_checkable
class BranchContext(Protocol):
    """What a layer may ask of the forward it runs in."""

    capture: bool
    """Record what this chunk hands its descendants (`captured`, in the autograd graph); replay needs it."""
    captured: dict[int, Handoff]
    """layer_number -> what the layer handed down in this forward (filled when `capture`)."""
    recompute_layers: bool
    """Run each transformer layer under activation checkpointing (models/layer_checkpoint.py)."""
    tree: ChunkTree | None
    """The tree inside the chunk, in the rows of the UNSPLIT chunk (None where the context has none)."""
    exchange: HeadExchange | None
    """Context parallelism for a layer whose heads are independent (a gated delta net): trades this rank's rows of
    all heads for every row of the chunk of a block of heads, and back (None: every row is here)."""

    def attend(
        self,
        layer_number: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of the chunk's queries: q [s,b,n,h], k/v [s,b,g,h] -> [s,b,n*h]; `window`: the layer's sliding
        window over path positions (attention/window.py; None: none), `sink` [n]: its learned sink logits."""
        ...

    def hand_down(self, layer_number: int, kind: StateKind, tensors: Tensors) -> None:
        """Record what this chunk hands its descendants for `layer_number` (a no-op unless `capture`)."""
        ...

    def handed_down(self, layer_number: int) -> list[Tensors]:
        """What the cached ancestors handed this chunk for `layer_number` (as the layer's kind reads it)."""
        ...

    def for_recompute(self) -> BranchContext:
        """The context a checkpointed layer's recomputation (in backward) runs with: the same, capturing nothing."""
        ...


@dataclass(kw_only=True)
class PrefixContext:
    """The prefix-state part every training context shares: handed-down states in, captured states out."""

    external: dict[int, list[Tensors]] = field(default_factory=dict)
    """layer_number -> what the cached ancestors hand this chunk, as the layer's kind reads it (attention: the
    path's K/V blocks root first, each (k, v) [c_j,b,g,h]); empty for a packed tree or a root segment. K/V blocks
    are handed to the executor as blocks, never concatenated (no copy of the path's K/V)."""
    capture: bool = False
    captured: dict[int, Handoff] = field(default_factory=dict)
    recompute_layers: bool = False
    tree: ChunkTree | None = None
    exchange: HeadExchange | None = None

    def hand_down(self, layer_number: int, kind: StateKind, tensors: Tensors) -> None:
        if self.capture:
            self.captured[layer_number] = Handoff(kind, tuple(tensors))

    def handed_down(self, layer_number: int) -> list[Tensors]:
        return self.external.get(layer_number, [])

    def _kv_blocks(
        self, layer_number: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """k/v [s,b,g,h] of the chunk -> (keys, values): the handed-down ancestors' blocks [c_j,b,g,h] root first,
        then the chunk's own, which it hands down (a capturing chunk). K and V are compacted first: they view the
        fused QKV output, so keep (and cache) them alone, not the buffer (prefix_state.compact)."""
        k, v = compact(k), compact(v)
        self.hand_down(layer_number, ATTENTION_KV, (k, v))
        blocks = [*self.handed_down(layer_number), (k, v)]
        return [kb for kb, _ in blocks], [vb for _, vb in blocks]

    def for_recompute(self) -> PrefixContext:
        """The same layout, handed-down states and metadata, but capturing nothing (the schedule's states come from
        the first forward, whose graph is the one gradients are injected into; a recomputed capture would be a
        copy outside that graph)."""
        return replace(self, capture=False, captured={})


@dataclass(kw_only=True)
class LocalContext(PrefixContext):
    """One rank: every row of the chunk is here; keys are [handed-down ancestors (c) | chunk (s)]."""

    layout: AttentionLayout
    """Which keys each query of the chunk may see. Keys are [external (c) | chunk (s)]."""
    backend: str | None = None
    """Attention backend name (attention.dispatch); None = `default_backend()`."""
    latent_cache: bool = False
    """Multi-latent attention layers hand down their compressed latent (c_kv + roped k_rope, MLA_LATENT) instead
    of per-head K/V and decompress the handed-down latents in each chunk (models/mla_latent.py); the schedules'
    chunks set it. False: every attention layer hands down K/V (the sampler's prefill, whose decode cache reads
    K/V)."""

    def attend(
        self,
        layer_number: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        *,
        window: int | None = None,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [s,b,n,h], k/v [s,b,g,h] -> [s, b, n*h]; the window cuts THE plan (its bands), the sink is merged once
        per row after every key block (attention/dispatch.py)."""
        ks, vs = self._kv_blocks(layer_number, k, v)  # keys: [ancestors (c) | chunk (s)]
        return self.attend_blocks(q, ks, vs, scale, window=window, sink=sink)

    def attend_blocks(
        self,
        q: torch.Tensor,
        ks: list[torch.Tensor],
        vs: list[torch.Tensor],
        scale: float,
        *,
        window: int | None = None,
        sink: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [s,b,n,h] over key/value blocks [c_j,b,g,h] (ancestors root first, then the chunk's own) -> [s,b,n*h];
        hands nothing down (a layer that hands down something else than its K/V calls this: MLA's latent)."""
        from megatron_branch.attention.dispatch import attention

        num_keys = sum(kb.shape[0] for kb in ks)
        assert num_keys == self.layout.num_keys and q.shape[0] == self.layout.num_queries, (
            f"layout {self.layout.num_queries}x{self.layout.num_keys} vs q {q.shape[0]} k {num_keys}"
        )
        return attention(q, ks, vs, self.layout, backend=self.backend, scale=scale, window=window, sink=sink)


class TakesBranchContext:
    """Mixin for modules that read the attached context: BranchCoreAttention, any other layer kind's mixer, and the
    layer itself (models/layer_checkpoint.py reads `recompute_layers` off it, token mixer or not). `attach_context`
    sets `context` on every such module of a model for one forward."""

    context: BranchContext | None = None


def context_modules(model: torch.nn.Module) -> list[TakesBranchContext]:
    return [m for m in model.modules() if isinstance(m, TakesBranchContext)]


@contextmanager
def attach_context(model: torch.nn.Module, ctx: BranchContext | None) -> Iterator[BranchContext | None]:
    """Attach `ctx` to every module of `model` that reads a context, for the duration of one forward."""
    mods = context_modules(model)
    assert mods, "the model has no BranchCoreAttention: build it with megatron_branch.models.build_model"
    for m in mods:
        m.context = ctx
    try:
        yield ctx
    finally:
        for m in mods:
            m.context = None
