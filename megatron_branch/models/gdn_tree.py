"""The gated delta net over a chunk's prefix tree: each segment continues from its parent's state at the fork.

SHAPE LEGEND (one TP rank; heads and conv channels are this rank's share, megatron's GatedDeltaNet):
    s   chunk rows (the whole chunk, gathered under sequence parallel)   b batch (1: a chunk is one packed sequence)
    n   segments of one batch (one depth of the chunk's tree), right-padded to the longest, L rows
    cd  conv channels [q | k | v]   K conv kernel   H value heads, dk / dv key / value head width
    state at the fork (what a segment hands its children, `GDN_STATE`):
        S     [1, H, dk, dv] float32: the delta rule's recurrent state after the segment's last token
        tail  [1, cd, K-1]: the conv's last K-1 INPUTS along the path (a segment shorter than K-1 keeps part of
              its parent's tail)

A segment's GDN output is the naive sequence's output at those positions because both halves of the layer are
causal recurrences over the path: the depthwise conv at position t reads inputs t-K+1..t (the tail supplies those
before the segment), and the delta rule reads the state after t-1 (megatron's `torch_chunk_gated_delta_rule` takes
it as `initial_state`, and returns the state after the last token with `output_final_state`).

Siblings (segments at the same depth of the chunk's tree) run as ONE batch of the rule, right-padded: on a padded
position beta = 0 and g = 0, so the delta rule's update there is exactly the identity (v_beta = k_beta = 0 makes
the position's corrected value v_new = 0, and g = 0 leaves the decay cumsum unchanged), and the final state is the
state after each row's last real token; padded outputs are discarded. Each row's tail is gathered at its own
length. Depths run one after the other (a child needs its parent's final state).

Precision: megatron's rule computes in float32 whatever the model dtype, and its chunking (64 positions) starts at
each segment's first token, not at the rollout's: a tree schedule equals naive to float32 rounding (the bound is
stated and tested in tests/unit/test_gdn_replay.py), not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from megatron_branch.attention.prefix_state import CACHED, ChunkTree, StateKind

GDN_STATE = StateKind(name="gdn-state", reads="parent", per_row=False)
"""A gated-delta-net layer's state at the fork (S, tail): read by the DIRECT children only, handed down whole."""

State = tuple[torch.Tensor, torch.Tensor]  # (S [n, H, dk, dv] float32, tail [n, cd, K-1])
Conv = tuple[torch.Tensor, torch.Tensor | None]
"""The depthwise causal conv's (weight [cd, 1, K], bias [cd] or None): megatron's conv1d, or a CP head block of it."""


def tree_depths(tree: ChunkTree) -> list[list[int]]:
    """The chunk's segments grouped by depth in the chunk (a root or a child of a cached parent: depth 0), each
    depth after its parents'."""
    depth: list[int] = []
    for seg in tree.segments:
        depth.append(0 if seg.parent is None or seg.parent == CACHED else depth[seg.parent] + 1)
    out: list[list[int]] = [[] for _ in range(max(depth, default=-1) + 1)]
    for i, d in enumerate(depth):
        out[d].append(i)
    return out


def hand_down_states(ctx: Any, layer_number: int, kind: StateKind, states: dict[int, State]) -> None:
    """A recurrent layer's states at each segment's end, one row per segment in chunk order (replay: one segment),
    handed down through the context (the gated delta net's and the Mamba layer's, models/gdn.py, models/mamba.py)."""
    n = len(ctx.tree.segments)
    down = states[0] if n == 1 else tuple(torch.cat([states[i][j] for i in range(n)]) for j in (0, 1))
    ctx.hand_down(layer_number, kind, down)


@dataclass(frozen=True)
class Rows:
    """Where n segments' rows sit in the chunk: index [n, L] (padding: the segment's first row), valid [n, L]."""

    index: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor  # [n]

    @classmethod
    def of(cls, spans: list[tuple[int, int]], device: torch.device) -> Rows:
        lengths = torch.tensor([b - a for a, b in spans], dtype=torch.long, device=device)
        L = int(lengths.max())
        ar = torch.arange(L, device=device)
        starts = torch.tensor([a for a, _ in spans], dtype=torch.long, device=device)
        valid = ar[None, :] < lengths[:, None]  # [n, L]
        index = torch.where(valid, starts[:, None] + ar[None, :], starts[:, None])
        return cls(index=index, valid=valid, lengths=lengths)


@dataclass(frozen=True)
class GDNDims:
    """This rank's widths of one GatedDeltaNet (megatron's names)."""

    qk: int  # q (= k) channels on this rank
    v: int  # v channels on this rank
    heads_k: int
    heads_v: int
    dk: int
    dv: int
    kernel: int


def conv_with_tail(
    x: torch.Tensor, tail: torch.Tensor, lengths: torch.Tensor, conv: Conv, *, roots: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of x [n, cd, L] continuing inputs `tail` [n, cd, K-1] -> (pre-activation out
    [n, cd, L], new tail [n, cd, K-1]: the last K-1 inputs before each row's length).

    The conv is megatron's own call, `conv1d(x)[..., :L]` (nn.Conv1d's F.conv1d with padding K-1, groups cd: its
    K-1 zero padding is the zero tail of a root), plus, unless every row is a root (`roots`), the tail's share of the
    first K-1 outputs (the conv is linear: the inputs before the segment only reach its first K-1 outputs). So a
    root segment's conv is megatron's bit for bit, with megatron's shapes and FLOPs (plan/layers.py counts them;
    tests/unit/test_plan_hybrid.py checks the count)."""
    n, cd, L = x.shape
    k1 = tail.shape[-1]
    weight, bias = conv
    out = F.conv1d(x, weight, bias, padding=k1, groups=cd)[..., :L]  # [n, cd, L]
    if not roots:  # the first K-1 outputs also see the tail: conv(cat(tail, 0)) without bias, its K-1 outputs
        head = F.conv1d(torch.cat([tail, torch.zeros_like(tail)], dim=-1), weight, None, groups=cd)
        m = min(k1, L)
        out = torch.cat([out[..., :m] + head[..., :m], out[..., m:]], dim=-1)
    full = torch.cat([tail.to(x.dtype), x], dim=-1)  # [n, cd, K-1+L]: the inputs along the path
    idx = (lengths[:, None] + torch.arange(k1, device=x.device)[None, :])[:, None, :].expand(n, cd, k1)
    return out, full.gather(2, idx)


def delta_rule_segments(
    qkv: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    rows: Rows,
    start: State,
    *,
    dims: GDNDims,
    conv: Conv,
    roots: bool,
    act: Callable[[torch.Tensor], torch.Tensor],
    l2norm: Callable[[torch.Tensor], torch.Tensor] | None,
    rule: Callable[..., tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, State]:
    """n segments of one depth, each from its start state: qkv [s, cd] (pre-conv), g/beta [s, H] of the chunk,
    start (S [n,H,dk,dv], tail [n,cd,K-1]; `roots`: every row is a root, its tail zero) -> (core output
    [n, L, H, dv], final (S, tail))."""
    n, L = rows.index.shape
    x = qkv[rows.index]  # [n, L, cd]
    keep = rows.valid[..., None]  # [n, L, 1]
    g_r = torch.where(keep, g[rows.index], torch.zeros((), dtype=g.dtype, device=g.device))  # [n, L, H]
    beta_r = torch.where(keep, beta[rows.index], torch.zeros((), dtype=beta.dtype, device=beta.device))
    pre, tail = conv_with_tail(x.transpose(1, 2), start[1], rows.lengths, conv, roots=roots)
    y = act(pre).transpose(1, 2)  # [n, L, cd]
    q, k, v = torch.split(y, [dims.qk, dims.qk, dims.v], dim=-1)
    q = q.reshape(n, L, -1, dims.dk)
    k = k.reshape(n, L, -1, dims.dk)
    v = v.reshape(n, L, -1, dims.dv)
    if l2norm is not None:
        q, k = l2norm(q.contiguous()), l2norm(k.contiguous())
    rep = dims.heads_v // dims.heads_k
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    out, S = rule(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g=g_r.contiguous(),
        beta=beta_r.contiguous(),
        initial_state=start[0],
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    return out, (S, tail)
