"""A chunk: the tokens of one model forward, and the attention layout the prefix tree gives them.

Shape legend (sequence first, as megatron): s chunk tokens (padded), c cached ancestor tokens (external keys).

Every schedule is a sequence of chunks. A chunk holds whole segments of the prefix tree: the whole tree (`packed`),
one segment or a micro-batch of sibling leaf segments (`replay`). Keys are laid out as
[external ancestors in path order (c) | chunk tokens (s)]; each segment sees its ancestors fully and itself
causally, wherever those ancestors live. Padding (for sequence parallel, s % tp == 0) is one extra causal segment
that no real query sees, so it never changes a result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.data import PrefixTree


@dataclass(frozen=True, kw_only=True)
class Chunk:
    segments: tuple[int, ...]
    """Segment ids computed in this forward, in packed (DFS) order."""
    external: tuple[int, ...]
    """Ancestor segment ids whose K/V come from the cache, root first; their keys precede the chunk's."""
    token_index: torch.Tensor
    """[s_real] packed tree index of each real chunk token."""
    input_ids: torch.Tensor
    """[s] token ids (padding: 0)."""
    position_ids: torch.Tensor
    """[s] original position ids (padding: 0)."""
    layout: AttentionLayout
    """Which keys each query row sees."""
    targets: torch.Tensor
    """[m] packed indices of the tokens PREDICTED in this chunk (their predecessor is a chunk token; by default only
    tokens in some rollout's response, see `make_chunk`)."""
    target_rows: torch.Tensor
    """[m] chunk row whose logits predict each target (a fork row appears once per child)."""

    @property
    def num_real(self) -> int:
        return int(self.token_index.numel())


def make_chunk(
    tree: PrefixTree,
    segments: Sequence[int],
    *,
    external: Sequence[int] = (),
    pad_to_multiple: int = 1,
    targets: str = "loss",
) -> Chunk:
    """Build the chunk for `segments` whose ancestors outside the chunk are `external` (cached).

    targets: "loss" (default) predicts only tokens that are in some rollout's response (every token an RL loss or
    a kept logprob can use, incl. the first response token, predicted by the last prompt row, and fork tokens);
    "all" predicts every token with a predecessor in the chunk. Only target rows reach the output projection, so
    "loss" keeps a long prompt's rows out of the vocabulary projection entirely.
    """
    if targets not in ("loss", "all"):
        raise ValueError(f"targets must be 'loss' or 'all', got {targets!r}")
    segs = [tree.segments[i] for i in segments]
    ext_off: dict[int, int] = {}
    c = 0
    for a in external:
        ext_off[a] = c
        c += tree.segments[a].length
    chunk_off: dict[int, int] = {}
    s_real = 0
    for seg in segs:
        chunk_off[seg.id] = s_real
        s_real += seg.length
    s = -(-s_real // pad_to_multiple) * pad_to_multiple

    qsegs = []
    for seg in segs:
        ranges = []
        for a in seg.ancestors:
            if a in chunk_off:
                start = c + chunk_off[a]
            elif a in ext_off:
                start = ext_off[a]
            else:
                raise AssertionError(f"segment {seg.id}: ancestor {a} is neither cached nor in the chunk")
            ranges.append((start, start + tree.segments[a].length))
        q0 = chunk_off[seg.id]
        qsegs.append(
            QuerySegment(
                q_start=q0, q_end=q0 + seg.length, ancestor_ranges=_coalesce(ranges), self_k_start=c + q0
            )
        )
    if s > s_real:  # padding: its own causal segment, invisible to every real query
        qsegs.append(QuerySegment(q_start=s_real, q_end=s, ancestor_ranges=(), self_k_start=c + s_real))
    layout = AttentionLayout(num_queries=s, num_keys=c + s, segments=tuple(qsegs))

    token_index = torch.cat([torch.arange(seg.offset, seg.offset + seg.length) for seg in segs])  # [s_real]
    pad = s - s_real
    input_ids = torch.cat([tree.tokens[token_index], torch.zeros(pad, dtype=torch.long)])
    position_ids = torch.cat([tree.position_ids[token_index], torch.zeros(pad, dtype=torch.long)])

    # Targets: every packed token whose predecessor is a chunk token. Within a segment that is the next token; at a
    # segment's last token it is the FIRST token of each child (the fork tokens), one row per child. Built from the
    # chunk's segments alone: O(chunk + children), never a table over the whole tree (replay makes many chunks).
    # With targets="loss", a segment's targets start at its first response token (tree.response_starts).
    first = tree.response_starts() if targets == "loss" else None
    tgt, rows = [], []
    for seg in segs:
        r0 = chunk_off[seg.id]
        j0 = 1 if first is None else max(1, first[seg.id])  # first in-segment offset predicted here
        tgt.append(torch.arange(seg.offset + j0, seg.offset + seg.length))  # [l-j0] next tokens
        rows.append(torch.arange(r0 + j0 - 1, r0 + seg.length - 1))
        kids = [c for c in seg.children if first is None or first[c] == 0]  # fork tokens that carry a loss
        if kids:
            tgt.append(torch.tensor([tree.segments[c].offset for c in kids], dtype=torch.long))
            rows.append(torch.full((len(kids),), r0 + seg.length - 1, dtype=torch.long))
    targets, order = torch.sort(torch.cat(tgt))  # packed order: a deterministic summation order
    target_rows = torch.cat(rows)[order]
    return Chunk(
        segments=tuple(segments),
        external=tuple(external),
        token_index=token_index,
        input_ids=input_ids,
        position_ids=position_ids,
        layout=layout,
        targets=targets,
        target_rows=target_rows,
    )


def lookup(index: torch.Tensor, query: torch.Tensor) -> torch.Tensor:
    """Position of each `query` value in `index` (distinct values), -1 where absent.

    O((n + m) log n) by sort + searchsorted: no table the size of the whole tree, which a long-context tree
    (millions of positions) and a replay of many chunks cannot afford per chunk.
    """
    if index.numel() == 0:
        return torch.full_like(query, -1)
    sorted_index, order = torch.sort(index)
    pos = torch.searchsorted(sorted_index, query).clamp(max=index.numel() - 1)
    return torch.where(sorted_index[pos] == query, order[pos], torch.full_like(query, -1))


def _coalesce(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Merge adjacent key ranges (a path's ancestors are contiguous in both layouts): fewer, larger kernel calls."""
    out: list[list[int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return tuple((a, b) for a, b in out)
