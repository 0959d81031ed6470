"""Replay's bookkeeping of prefix state, written ONCE for every layer kind (attention/prefix_state.py).

Shape legend: per cached segment and layer, the tensors its layer kind hands down (attention: k, v [rows, b, g, h],
this rank's rows; a recurrent kind: its state at the fork); `rows` the segment's cached rows on this rank.

The cycle for a segment X (schedule/replay.py drives it):
    push     X's forward captured, per layer, a Handoff (kind, tensors in X's graph); the cache keeps the
             kind's DETACHED leaves (requiring grad when training), registered with the activation meter;
    external a descendant's chunk reads, per layer, what its kind reads of the path (all ancestors' K/V, or the
             direct parent's state), as leaves: its backward accumulates into their gradient accumulator,
             summed over every child;
    injection  after the last child: the (outputs, grads) of X's ONE `torch.autograd.backward([loss,
             captured...], [1, accumulated...])`, pairing the trainable leaves with the tensors of X's final forward
             (the recomputed one under `recompute`) they stand for;
    drop     after that backward, the entry goes (the leaves and their accumulators live until then).
Nothing here knows a layer kind: adding one (the gated delta net's state at the fork) needs no change here.

The accumulator of a leaf is its own `.grad` (autograd adds each child's gradient in place) when the leaf is float32
or float64. A bf16 / fp16 leaf gets an fp32 accumulator instead (`WideSum`): each child's gradient, rounded to the
leaf's dtype once by the executor as in naive training, is added into fp32 and `.grad` is cleared, so the sum over
G children is not rounded to bf16 G times (precision.py; docs/design.md "bf16"; tests/unit/test_bf16.py plants a
bf16 accumulator and catches it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from megatron_branch.attention.prefix_state import Handoff, StateKind, Tensors
from megatron_branch.memory import track_extra
from megatron_branch.precision import accumulation_dtype, is_half


@dataclass
class WideSum:
    """The fp32 gradient accumulators of a segment's half-precision leaves (one slot per trainable leaf; None for
    a float32 / float64 leaf, whose `.grad` is its accumulator, or before its first gradient)."""

    sums: list[torch.Tensor | None] = field(default_factory=list)

    @classmethod
    def attach(cls, leaves: Tensors) -> WideSum:
        """Hook every half-precision leaf: after autograd put a child's gradient in its `.grad`, move it here."""
        out = cls(sums=[None] * len(leaves))
        for j, leaf in enumerate(leaves):
            if is_half(leaf.dtype):
                # registered before the meter's own hook (track_extra runs after), so the meter never counts the
                # transient bf16 .grad, only the fp32 sum (below)
                leaf.register_post_accumulate_grad_hook(lambda t, j=j: out.add(j, t))
        return out

    def add(self, j: int, leaf: torch.Tensor) -> None:
        g, leaf.grad = leaf.grad, None
        if g is None:
            return
        if self.sums[j] is None:
            self.sums[j] = g.to(accumulation_dtype(g.dtype))  # a storage of its own, fp32
            track_extra([self.sums[j]], kind="registered_grad")  # the activation meter's dK/dV accumulator
        else:
            self.sums[j].add_(g)

    def grad(self, j: int, leaf: torch.Tensor) -> torch.Tensor | None:
        """What the children sent into leaf j: its fp32 sum, or its own `.grad`."""
        s = self.sums[j] if j < len(self.sums) else None
        return s if s is not None else leaf.grad


@dataclass(frozen=True)
class _Entry:
    kind: StateKind
    read: Tensors  # what descendants read
    trainable: Tensors  # the leaves among them whose gradient is injected
    wide: WideSum  # fp32 accumulators of half-precision leaves


class PrefixCache:
    """What the cached segments of the current path hand their descendants, per layer."""

    def __init__(self, *, grad: bool) -> None:
        self.grad = grad  # False: scoring (plain detached tensors, nothing trainable)
        self.entries: dict[int, dict[int, _Entry]] = {}  # segment -> layer -> entry
        self.meta: dict[int, torch.Tensor] = {}  # segment -> metadata of its cached rows (CP: [2, rows])
        self.rows: dict[int, tuple[int, int]] = {}  # segment -> (cached rows, frozen rows)
        self.released: dict[int, dict[int, list[torch.Tensor | None]]] = {}  # segment -> layer -> leaf grads

    def push(
        self,
        seg_id: int,
        captured: dict[int, Handoff],
        rows: int,
        *,
        frozen: int = 0,
        meta: torch.Tensor | None,
    ) -> None:
        """Cache what segment `seg_id` handed down (its first `frozen` rows held constant: replay-stopgrad)."""
        entries = {}
        for layer, h in captured.items():
            read, trainable = h.kind.leaves(h.tensors, rows, frozen, self.grad)
            entries[layer] = _Entry(h.kind, read, trainable, WideSum.attach(trainable))
        self.entries[seg_id] = entries
        self.rows[seg_id] = (rows, frozen)
        if meta is not None:
            self.meta[seg_id] = meta
        # the cache is activation memory too: an active ActivationMeter counts it (a no-op otherwise)
        track_extra(t for e in entries.values() for t in e.read)

    def external(self, path: Sequence[int]) -> dict[int, list[Tensors]]:
        """layer -> what a chunk below `path` (cached segments, root first) reads, as each layer's kind reads it
        (blocks in place, never concatenated)."""
        if not path:
            return {}
        out = {}
        for layer, entry in self.entries[path[0]].items():
            states = [self.entries[a][layer].read for a in path]
            out[layer] = entry.kind.visible(states)
        return out

    def external_meta(self, path: Sequence[int]) -> torch.Tensor | None:
        """[2, c] metadata of the path's cached rows in `external`'s order (None: the context needs none)."""
        metas = [self.meta[a] for a in path if a in self.meta]
        return torch.cat(metas, dim=1) if metas else None

    def release(self, seg_id: int) -> None:
        """Free `seg_id`'s cached state, keeping only what its descendants sent into it (after the last child,
        before its forward is recomputed: the recomputed state then replaces the entry, never sits beside it)."""
        self.released[seg_id] = self._grads(seg_id)
        # a float32 / float64 leaf's `.grad` is counted by the activation meter until its leaf is garbage; it
        # outlives the leaf now, so it is counted on its own (a no-op without a meter; WideSum's sums already are)
        entries = self.entries.pop(seg_id)
        track_extra(
            (leaf.grad for e in entries.values() for leaf in e.trainable if leaf.grad is not None),
            kind="registered_grad",
        )

    def _grads(self, seg_id: int) -> dict[int, list[torch.Tensor | None]]:
        """layer -> what the descendants sent into each trainable leaf of `seg_id` (None: nothing)."""
        if seg_id in self.released:
            return self.released[seg_id]
        entries = self.entries[seg_id]
        return {
            layer: [e.wide.grad(j, leaf) for j, leaf in enumerate(e.trainable)]
            for layer, e in entries.items()
        }

    def injection(
        self, seg_id: int, captured: dict[int, Handoff]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(outputs, grads) that push the descendants' summed gradient through `seg_id`'s final forward, whose
        capture is `captured`: every trainable leaf that received a gradient, with the tensor it stands for (the
        gradient rounded to that tensor's dtype once, here)."""
        received = self._grads(seg_id)
        rows, frozen = self.rows[seg_id]
        outputs, grads = [], []
        for layer, h in captured.items():
            srcs = h.kind.sources(h.tensors, rows, frozen)
            for src, g in zip(srcs, received[layer], strict=True):
                if g is not None:
                    outputs.append(src)
                    grads.append(g.to(src.dtype))
        return outputs, grads

    def drop(self, seg_id: int) -> None:
        """Forget `seg_id`'s entry (after its backward: the leaves and their accumulators are held until then)."""
        self.entries.pop(seg_id, None)
        self.released.pop(seg_id, None)
        self.rows.pop(seg_id)
        self.meta.pop(seg_id, None)
