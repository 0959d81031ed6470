"""Prefix state: what a segment hands its descendants, per layer KIND, and how a cache of it is kept exact.

SHAPE LEGEND (per layer, per cached segment; Megatron sequence-first):
    rows  the segment's cached rows on this rank (its real tokens; under CP this rank's zigzag shard)
    kv    attention: k, v [rows, b, g, h] -- every descendant attends to the K/V of ALL its ancestors
    fork  a recurrent layer (gated delta net, the hybrid models): e.g. the state after the segment's last token
          [b, heads, dk, dv] and the causal conv's last (kernel - 1) inputs [b, conv_dim, kernel - 1] -- a child
          continues from its DIRECT parent's state only

The protocol, the same for every kind (schedule/prefix_cache.py implements it once, for every kind):
    1. a layer that hands something down calls `context.hand_down(layer, KIND, tensors)` during the forward of a
       chunk with `capture` on (attention does it inside `attend`): the tensors stay in the chunk's graph;
    2. the schedule caches them as DETACHED leaves that require grad (`kind.leaves`), per segment and layer;
    3. a descendant's chunk reads them through `context.handed_down(layer)`: the leaves of every cached ancestor
       on the path, root first (`reads="path"`), or of the direct parent only (`reads="parent"`); its backward
       accumulates into the leaves' .grad, summed over all children exactly like dK/dV;
    4. after the last child, ONE `torch.autograd.backward([loss, captured...], [1, leaf.grad...])` pushes the sum
       through the segment (`kind.sources` picks, in the final forward's capture, the tensors matching the
       trainable leaves), then the cache entry is dropped.
Inside ONE chunk (packed: the whole tree; replay: a micro-batch of sibling leaves) a layer finds the tree in
`context.tree` (ChunkTree: each chunk segment's rows and its parent, in the chunk or handed down), so packed and
scoring need nothing else. A new kind is a `StateKind(...)` and a layer that calls these two methods: no schedule
changes (tests/unit/test_prefix_state.py adds a toy recurrent kind from the test file alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

Tensors = tuple[torch.Tensor, ...]


def compact(t: torch.Tensor) -> torch.Tensor:
    """`t` in a storage of its own holding exactly its elements: `t` itself when it already is, else a copy.

    Why: megatron's V is a VIEW of the fused QKV output ([s, b, (n + 2g) h]), so keeping V (for backward, or in
    replay's cache) would keep every row's queries and keys alive with it: (n + 2g) d values per row instead of
    g d. The attention contexts make K/V compact before the executor saves them and before they are handed down,
    so a cached row costs exactly 2 g d values per layer and the QKV buffer is freed after the projection
    (issue 19's compact prefix cache; tests/unit/test_plan.py plants the view and catches it)."""
    if t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size():
        return t
    return t.contiguous() if not t.is_contiguous() else t.clone()


@dataclass(frozen=True, kw_only=True)
class StateKind:
    """One kind of prefix state (see the module docstring)."""

    name: str
    reads: Literal["path", "parent"]
    """Which cached ancestors' state a descendant reads: all of them, root first (attention K/V), or the direct
    parent's only (a recurrent state at the fork)."""
    per_row: bool
    """The tensors are per token, [rows, ...] (attention K/V): only the segment's cached rows are handed down, and
    replay-stopgrad's constant prompt rows are rows of them. Otherwise the tensors are the state at the fork,
    handed down whole (constant only when the whole segment is prompt)."""

    def leaves(self, tensors: Tensors, rows: int, frozen: int, grad: bool) -> tuple[Tensors, Tensors]:
        """(what descendants read, the trainable leaves among them) for a segment whose first `frozen` rows are
        held constant (replay-stopgrad; 0 = exact) and whose cached rows are `rows`; `grad=False` (scoring):
        plain detached tensors, nothing trainable."""
        if not self.per_row:
            if not grad or frozen >= rows:
                return tuple(t.detach() for t in tensors), ()
            read = tuple(t.detach().requires_grad_() for t in tensors)
            return read, read
        # the rows of the chunk's own (compact) K/V storage: nothing else is kept alive but, under sequence
        # parallelism, the chunk's < tp padding rows (a copy would double the root's K/V while its graph lives)
        if not grad or frozen >= rows:
            return tuple(t[:rows].detach() for t in tensors), ()
        trainable = tuple(t[frozen:rows].detach().requires_grad_() for t in tensors)
        if frozen == 0:
            return trainable, trainable
        # a copy, unlike the exact path's in-place blocks: replay-stopgrad is a comparison, not a fast path
        read = tuple(torch.cat([t[:frozen].detach(), lf]) for t, lf in zip(tensors, trainable))
        return read, trainable

    def sources(self, tensors: Tensors, rows: int, frozen: int) -> Tensors:
        """The tensors of the segment's (final) forward that the trainable leaves stand for, in their order."""
        if frozen >= rows:
            return ()
        return tuple(t[frozen:rows] for t in tensors) if self.per_row else tuple(tensors)

    def visible(self, path: Sequence[Tensors]) -> list[Tensors]:
        """Of the path's cached states (root first), those a descendant reads."""
        return list(path) if self.reads == "path" else list(path[-1:])


ATTENTION_KV = StateKind(name="attention-kv", reads="path", per_row=True)
"""Attention layers: every descendant attends to the K/V rows of all its ancestors."""


@dataclass(frozen=True)
class Handoff:
    """What one layer handed down in one forward: its kind and tensors (in the forward's graph)."""

    kind: StateKind
    tensors: Tensors


CACHED = -1
"""ChunkSegment.parent: the parent is not in the chunk; its state is handed down (`context.handed_down`)."""


@dataclass(frozen=True)
class ChunkSegment:
    """One tree segment of a chunk: rows [start, end) of the chunk, and its parent: the index of another chunk
    segment (earlier in the chunk), CACHED, or None (a root)."""

    start: int
    end: int
    parent: int | None


@dataclass(frozen=True)
class ChunkTree:
    """The tree inside one chunk, for layers whose state flows along it (rows not in a segment: padding)."""

    segments: tuple[ChunkSegment, ...]
