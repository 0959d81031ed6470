"""FLOPs of one training step (all ranks together) for naive, packed and replay, counted from the rollout shape.

2 FLOPs per multiply-add. Forward per token position: the layer matmuls (QKV, output projection, SwiGLU's three;
a MoE layer's router and its top-k experts' SwiGLUs, plus a shared expert);
per (query, visible key) pair and layer: q.k and p.v (4 * heads * head_dim). Backward = 2 x forward for matmuls
and attention (as benchmarks/schedule_speed.py counts). The output projection runs only on rows that predict a
token (the fused logprob path, losses/fused_logprobs.py) and, as implemented, costs 4 matmuls per row instead of 3:
one forward pass (row max, sum-exp and target from the same chunk of logits) and, in backward, a recompute plus
the two gradient matmuls.

Recompute adds forwards: the engine's segment recompute one more forward (with its fused logprob
forward) of every segment that has children;
megatron's full recompute one more forward of every layer.

Sliding windows (gpt-oss): a windowed layer's query at path position p sees keys p - W + 1 .. p only
(attention/window.py; the one visibility plan's band, for a branch's ancestors too), so that layer counts only
those pairs (`windowed_pairs`); full layers count every causal pair. Sinks add one logit per row and head (no
pair), biases per-token adds: neither is a matmul FLOP. YaRN changes only the cos / sin tables.

Hybrid models (Qwen3.5): attention pairs only in the full-attention layers; a gated delta net layer's projections
are dense FLOPs per token, its convolution and chunked delta rule `linear_attention` FLOPs per sequence
(plan/layers.py, exact counts of the kernel's matmuls). naive runs each rollout as one sequence; the tree
schedules run each segment as one sequence from its parent's state (models/gdn.py BranchGatedDeltaNet).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.layers import (
    attention_matmul_flops_per_token,
    gdn_matmul_flops_per_token,
    gdn_mixer_flops,
)
from megatron_branch.plan.mamba import is_mamba_hybrid, kind_count, pattern_matmul_flops_per_token, scan_flops
from megatron_branch.plan.mla import decompress_flops, mla_flops_per_pair
from megatron_branch.plan.model import Layout, RolloutShape

LOGITS_MATMULS = 4
"""Output-projection matmuls per target row in the fused logprob path (forward 1, backward 3)."""


def layer_matmul_flops_per_token(arch: ModelArch) -> int:
    """Forward FLOPs of one token through every layer's matmuls (no attention scores, no output projection). A MoE
    layer's MLP slot: the router (h x E), the token's top-k experts (each a SwiGLU of width I) and the shared expert
    with its gate, instead of the dense SwiGLU."""
    if is_mamba_hybrid(arch):  # one block per layer (plan/mamba.py)
        return pattern_matmul_flops_per_token(arch)
    full = arch.num_full_layers * attention_matmul_flops_per_token(arch)
    total = full + (arch.num_linear_layers * gdn_matmul_flops_per_token(arch) if arch.is_hybrid else 0)
    if arch.is_moe:
        h = arch.hidden_size
        moe = (
            2 * h * arch.num_experts
            + arch.moe_top_k * 2 * 3 * h * arch.moe_ffn_hidden_size
            + 2 * 3 * h * arch.shared_expert_ffn_hidden_size
            + (2 * h if arch.shared_expert_gate else 0)
        )
        total += len(arch.moe_layers) * (moe - 2 * 3 * h * arch.ffn_hidden_size)
    return total


def attention_flops_per_pair(arch: ModelArch) -> int:
    """Forward FLOPs of one (query, visible key) pair over all full-attention layers."""
    assert arch.head_dim is not None
    if is_mamba_hybrid(arch):  # its "*" blocks only
        return kind_count(arch, "*") * 4 * arch.num_attention_heads * arch.head_dim
    if arch.multi_latent:  # q.k over qk_nope + qk_rope, p.v over v_head_dim (plan/mla.py)
        return arch.num_full_layers * mla_flops_per_pair(arch)
    return arch.num_full_layers * 4 * arch.num_attention_heads * arch.head_dim


def linear_attention_flops(
    arch: ModelArch, sequences: list[tuple[int, int]], *, backward: bool = True
) -> float:
    """Convolution + delta-rule FLOPs of every GDN layer over `sequences` ((length, count) pairs); forward and
    backward, or forward only. A Mamba hybrid: its M layers' conv and SSD scan (plan/mamba.py)."""
    if is_mamba_hybrid(arch):
        return scan_flops(arch, sequences, backward=backward)
    if not arch.is_hybrid:
        return 0.0
    total = 0
    for length, count in sequences:
        fwd, bwd = gdn_mixer_flops(arch, length)
        total += count * (fwd + (bwd if backward else 0))
    return float(arch.num_linear_layers * total)


def logits_flops_per_row(arch: ModelArch) -> int:
    """One matmul of a target row with the output projection."""
    return 2 * arch.hidden_size * arch.vocab_size


def causal_pairs(n: int, ancestors: int = 0) -> int:
    """(query, key) pairs of n tokens attending causally to themselves and fully to `ancestors` keys."""
    return n * ancestors + n * (n + 1) // 2


def windowed_pairs(n: int, ancestors: int, window: int | None) -> int:
    """(query, key) pairs of n tokens at path positions ancestors .. ancestors + n - 1, each seeing the last
    `window` positions up to itself (None: all of them, `causal_pairs`)."""
    if window is None:
        return causal_pairs(n, ancestors)

    def upto(m: int) -> int:  # sum over q = 1..m of min(q, window): the pairs of the first m path positions
        return m * (m + 1) // 2 if m <= window else window * (window + 1) // 2 + (m - window) * window

    return upto(ancestors + n) - upto(ancestors)


def attention_flops(arch: ModelArch, n: int, ancestors: int = 0) -> int:
    """Forward FLOPs of q.k and p.v of n tokens after `ancestors` path positions over all attention layers: every
    causal pair in a full layer, only the pairs inside the window in a sliding one (gpt-oss)."""
    if arch.sliding_window is None:
        return attention_flops_per_pair(arch) * causal_pairs(n, ancestors)
    assert arch.head_dim is not None and not arch.is_hybrid
    per_pair = 4 * arch.num_attention_heads * arch.head_dim
    return sum(per_pair * windowed_pairs(n, ancestors, arch.window_of(i)) for i in range(arch.num_layers))


@dataclass(frozen=True, kw_only=True)
class StepFlops:
    """One step's FLOPs split by kind; forward and backward together, recompute included."""

    dense: float
    """Layer matmuls (forward + backward + recomputed forwards)."""
    attention: float
    """Attention scores and weighted values over visible pairs."""
    logits: float
    """Output projection of the target rows (the fused logprob's passes)."""
    positions: int
    """Token positions run forward once."""
    recomputed_positions: int
    linear_attention: float = 0.0
    """Gated delta net layers' convolution and chunked delta rule, or Mamba-2 layers' conv and SSD scan (hybrids;
    0 otherwise)."""
    decompress: float = 0.0
    """Replay of an MLA model: every leaf micro-batch decompressing the cached latent of its path (plan/mla.py)."""

    @property
    def total(self) -> float:
        return self.dense + self.attention + self.logits + self.linear_attention + self.decompress


def step_flops(
    arch: ModelArch,
    shape: RolloutShape,
    schedule: str,
    layout: Layout | None = None,
    *,
    branch_micro_batch: int = 8,
) -> StepFlops:
    """FLOPs of the whole step (every prompt group, every rank) for `schedule` (`branch_micro_batch`: replay's leaf
    micro-batches, each of which decompresses an MLA model's cached latent)."""
    layout = layout or Layout()
    tok, row = layer_matmul_flops_per_token(arch), logits_flops_per_row(arch)
    N, G, R, L = shape.prompts, shape.responses, shape.root_length, shape.leaf_length
    if schedule == "stop_gradient":
        # the announced system's form: the shared root runs forward only (its state is not trained), the responses
        # forward + backward against its cached K/V; the gradient is NOT that of naive training
        own = N * G * attention_flops(arch, L, R)
        return StepFlops(
            dense=tok * (N * R + 3 * N * G * L),
            attention=N * attention_flops(arch, R) + 3 * own,
            logits=row * LOGITS_MATMULS * N * G * L,  # each response token, the first predicted by the root
            positions=shape.positions_computed,
            recomputed_positions=0,
            linear_attention=linear_attention_flops(arch, [(R, N)], backward=False)
            + linear_attention_flops(arch, [(L, N * G)]),
        )
    # naive (megatron's output layer) computes every row's logits; the tree schedules send only the rows that
    # predict a response token through the output projection (schedule/chunks.py make_chunk, targets="loss")
    if schedule == "naive":
        sequences = [(shape.rollout_length, N * G)]
        positions = shape.positions_logical
        attn = N * G * attention_flops(arch, shape.rollout_length)  # forward, every pair once
        fwd_again, attn_again = 0, 0
        rows_again = 0
        target_rows = N * G * (shape.rollout_length - 1)
        sequences_again: list[tuple[int, int]] = []
    else:
        sequences = [(R, N), (L, N * G)] if G > 1 else [(shape.rollout_length, N)]
        positions = shape.positions_computed
        attn = N * (attention_flops(arch, R) + G * attention_flops(arch, L, R))
        # tree targets: every response token once (the first one predicted by the last prompt row, fork tokens by
        # their parent's last row)
        target_rows = N * (shape.response_length if G == 1 else shape.shared_response_length + G * L)
        fwd_again, attn_again = 0, 0
        rows_again = 0
        sequences_again = []
        if schedule == "replay" and layout.recompute in ("selective", "full") and G > 1:
            fwd_again, attn_again = (
                N * R,
                N * attention_flops(arch, R),
            )  # the root is recomputed at its backward
            sequences_again = [(R, N)]
            # with its fused logprob forward (1 pass over its target rows: the shared response tokens and the forks)
            rows_again = N * (shape.shared_response_length + G)
    if layout.recompute == "full":  # per-layer checkpointing: every layer's forward once more
        fwd_again, attn_again = fwd_again + positions, attn_again + attn
        sequences_again = sequences_again + sequences
    decompress = 0
    if (
        schedule == "replay" and G > 1 and arch.multi_latent and layout.cp == 1
    ):  # the latent cache (plan/mla.py)
        rows = N * -(-G // min(branch_micro_batch, G)) * R  # each leaf micro-batch reads its root's rows
        decompress = decompress_flops(arch, rows)
        decompress += decompress_flops(arch, rows, backward=False) if layout.recompute == "full" else 0
    return StepFlops(
        dense=tok * (3 * positions + fwd_again),
        attention=float(3 * attn + attn_again),
        logits=row * (LOGITS_MATMULS * target_rows + rows_again),
        positions=positions,
        recomputed_positions=fwd_again,
        linear_attention=linear_attention_flops(arch, sequences)
        + linear_attention_flops(arch, sequences_again, backward=False),
        decompress=float(decompress),
    )
