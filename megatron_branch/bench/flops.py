"""Analytic FLOPs of one training step (forward + backward) under each variant, causal attention counted as causal.

Per token position: the matmuls of every layer (QKV, attention output projection, SwiGLU gate/up/down; a hybrid's
gated delta net layers their in/out projections), 2 FLOPs per multiply-add, counted by the planner's functions
(plan/flops.py: ONE count for both; a GDN layer's convolution and chunked delta rule per sequence, its backward as
plan/layers.py counts it). Per row that reaches the output projection: 2 * hidden * vocab. Per (query, visible key) pair:
4 * heads * head_dim per layer (q.k and p.v), counting exactly the keys a position may see (position id p sees p + 1
keys on its path; a rollout of length L alone has L(L+1)/2 pairs), never the dense square. Backward = 2 x forward.
replay+recompute adds one more forward of every inner segment (and of the output-projection rows it predicts);
replay+recompute-full (with per-layer checkpointing) also one more forward of every layer at every position.
This is what each method must compute; kernels that compute masked work (megatron's unfused attention in `naive`,
the dense mask of the `packed` attention backend) or extra passes (the fused logprob's second pass over the
vocabulary, and its recomputation in backward) execute more. `torch.utils.flop_counter` is not used: it counts 0
for SDPA on CPU and counts causal attention as dense (docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_branch.data import PrefixTree
from megatron_branch.models import ModelArch
from megatron_branch.plan.flops import (
    attention_flops_per_pair,
    layer_matmul_flops_per_token,
    linear_attention_flops,
)
from megatron_branch.schedule.chunks import make_chunk


@dataclass(frozen=True)
class Flops:
    """Forward FLOPs of one step, by part, and the step's forward + backward total."""

    dense: float  # token positions x per-position layer matmuls
    head: float  # output-projection rows x 2 * hidden * vocab
    attention: float  # (query, visible key) pairs x per-pair FLOPs
    extra_forward: float = (
        0.0  # recomputation (replay+recompute): forward only, its backward is the one above
    )
    linear: float = 0.0  # a hybrid's GDN convolution + delta rule, forward (per sequence: plan/layers.py)
    linear_backward: float = 0.0  # and its backward (not exactly 2 x forward: plan/layers.py)

    @property
    def forward(self) -> float:
        return self.dense + self.head + self.attention + self.linear

    @property
    def step(self) -> float:
        return (
            3 * (self.dense + self.head + self.attention)
            + self.linear
            + self.linear_backward
            + self.extra_forward
        )


def per_position_flops(arch: ModelArch) -> float:
    """Forward layer matmul FLOPs of one token position (output projection excluded): the planner's count
    (plan/flops.py), full-attention and GDN layers each by their own projections, a MoE layer by its router and
    top-k experts."""
    return float(layer_matmul_flops_per_token(arch))


def per_row_head_flops(arch: ModelArch) -> float:
    return 2.0 * arch.hidden_size * arch.vocab_size


def per_pair_flops(arch: ModelArch) -> float:
    """Forward FLOPs of one (query, visible key) pair over the full-attention layers (the planner's count)."""
    return float(attention_flops_per_pair(arch))


def _linear(arch: ModelArch, lengths: list[int]) -> tuple[float, float]:
    """(forward, backward) GDN convolution + delta-rule FLOPs over sequences of `lengths` (plan/flops.py)."""
    seqs = [(n, 1) for n in lengths]
    forward = linear_attention_flops(arch, seqs, backward=False)
    return forward, linear_attention_flops(arch, seqs) - forward


def variant_flops(arch: ModelArch, tree: PrefixTree) -> dict[str, Flops]:
    """Variant name (bench.config.VARIANTS) -> its analytic FLOPs on `tree`. A hybrid's GDN layers run every rollout
    as one sequence in the unshared variants and every tree segment as one sequence (from its parent's state) in
    the tree ones, as plan/flops.py counts them."""
    tok, row, pair = per_position_flops(arch), per_row_head_flops(arch), per_pair_flops(arch)
    lengths = [len(r.prompt) + len(r.response) for r in tree.rollouts]
    loss_rows = [len(r.response) - (0 if r.prompt else 1) for r in tree.rollouts]
    causal = pair * sum(n * (n + 1) // 2 for n in lengths)
    rollouts = _linear(arch, lengths)
    unshared = Flops(tok * sum(lengths), row * sum(loss_rows), causal, 0.0, *rollouts)
    # megatron's output layer: every row's logits
    naive = Flops(tok * sum(lengths), row * sum(lengths), causal, 0.0, *rollouts)
    whole = make_chunk(
        tree, range(len(tree.segments))
    )  # the tree's loss targets, as packed and replay select them
    segments = _linear(arch, [s.length for s in tree.segments])
    shared = Flops(
        tok * tree.positions_computed,
        row * whole.targets.numel(),
        pair * float((tree.position_ids + 1).sum()),
        0.0,
        *segments,
    )
    inner = [s for s in tree.segments if s.children]
    inner_rows = sum(make_chunk(tree, [s.id], external=s.ancestors).targets.numel() for s in inner)
    again = (
        tok * sum(s.length for s in inner)
        + row * inner_rows
        + pair * sum(s.start_position * s.length + s.length * (s.length + 1) // 2 for s in inner)
        + _linear(arch, [s.length for s in inner])[0]
    )
    recompute = Flops(shared.dense, shared.head, shared.attention, again, *segments)
    # each position has one forward under grad, whose layers are rebuilt once in backward (not the head)
    full = Flops(
        shared.dense,
        shared.head,
        shared.attention,
        again + shared.dense + shared.attention + shared.linear,
        *segments,
    )
    return {
        "naive-fused": unshared,
        "packed-nosharing": unshared,
        "repeat-prefix": shared,
        "naive": naive,
        "packed": shared,
        "replay": shared,
        "replay+recompute": recompute,
        "replay+recompute-full": full,
        "replay-nochunks": shared,  # packing small subtrees changes the forwards' count, not their FLOPs
        "auto": shared,  # packed or replay: the same FLOPs
        "minimal": shared,
    }
