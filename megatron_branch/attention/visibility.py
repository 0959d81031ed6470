"""The tree's visibility as rectangles: which (query rows, key rows) pairs see each other, never as a dense mask.

SHAPE LEGEND (positions only; nothing here holds activations):
    sq, sk   query / key rows of one block (a CP rank's rows, or a whole chunk)
    meta     [2, s] long: row 0 tree segment id (-1 = padding), row 1 offset of the token inside its segment
    R        runs of a block: maximal row ranges of ONE segment with consecutive offsets (under the zigzag split a
             segment gives at most 2 runs per rank), so a plan costs O(R_q * depth) Python work, never O(sq * sk)

The rule (the prefix tree's mask): a query token (segment a, offset i) sees a key token (segment b, offset j) iff
b is a proper ancestor of a, or b == a and j <= i; padding sees nothing and is seen by nothing. For one (query run,
key run) pair that leaves three shapes:
    hidden     b unrelated to a, or the key run lies wholly after the query run in the same segment;
    all        b a proper ancestor of a, or the key run lies wholly before the query run in the same segment;
    causal with an offset d = i0 - j0 (same segment, overlapping): row r of the run sees key columns [0, r + d].
The last is cut into rows that see nothing, rows that see everything (a full rectangle), and the rows in between,
which see a full rectangle of key columns [0, i_a + d) plus a causal SQUARE (sq == sk, top-left aligned) -- the two
shapes the fused kernels take (attention/kernels.py: non-causal, and causal with sq == sk).

A `BlockPlan` is the whole visibility of one (query block, key block) pair: full rectangles grouped by their key
columns (rows that see the same key ranges go through ONE fused call, as the merge backend groups sibling branches
by their ancestor ranges) and causal squares. `plan_from_meta` builds it from per-token metadata (the ring under
context parallelism: tokens zigzag-reordered); `plan_from_layout` from an `AttentionLayout` (one rank, the merge
backend's description), so both paths can share one description of the tree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from megatron_branch.attention.layout import AttentionLayout

Range = tuple[int, int]  # [start, end) of rows or columns


@dataclass(frozen=True, kw_only=True)
class Runs:
    """Rows as maximal runs of consecutive offsets inside one segment (padding rows dropped).

    Run t covers rows [start[t], start[t] + length[t]) holding offsets [offset[t], offset[t] + length[t]) of tree
    segment `segment[t]`.
    """

    start: tuple[int, ...]
    length: tuple[int, ...]
    segment: tuple[int, ...]
    offset: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.start)

    def by_segment(self) -> dict[int, list[int]]:
        """segment id -> indices of its runs, in row order."""
        out: dict[int, list[int]] = {}
        for t, s in enumerate(self.segment):
            out.setdefault(s, []).append(t)
        return out


def runs_from_meta(meta: torch.Tensor) -> Runs:
    """[2, s] metadata -> its runs; O(s) vectorised work, O(R) Python objects."""
    assert meta.dim() == 2 and meta.shape[0] == 2, tuple(meta.shape)
    seg, off = meta[0], meta[1]  # [s]
    s = seg.numel()
    if s == 0:
        return Runs(start=(), length=(), segment=(), offset=())
    brk = torch.ones(s, dtype=torch.bool, device=meta.device)  # [s]: a run starts here
    brk[1:] = (seg[1:] != seg[:-1]) | (off[1:] != off[:-1] + 1)
    starts = brk.nonzero().flatten()  # [R']
    ends = torch.cat([starts[1:], starts.new_tensor([s])])
    keep = seg[starts] >= 0  # drop padding runs
    starts, ends = starts[keep], ends[keep]
    return Runs(
        start=tuple(starts.tolist()),
        length=tuple((ends - starts).tolist()),
        segment=tuple(seg[starts].tolist()),
        offset=tuple(off[starts].tolist()),
    )


@dataclass(frozen=True, kw_only=True)
class FullGroup:
    """Query row ranges that all see, unmasked, the same key column ranges: one non-causal fused call."""

    rows: tuple[Range, ...]
    cols: tuple[Range, ...]

    @property
    def num_rows(self) -> int:
        return sum(e - a for a, e in self.rows)

    @property
    def num_cols(self) -> int:
        return sum(e - a for a, e in self.cols)


@dataclass(frozen=True, kw_only=True)
class CausalSquare:
    """Query rows [r, r + n) over key columns [c, c + n): row r + i sees columns c .. c + i (one causal fused call)."""

    row: int
    col: int
    size: int


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """The visibility of one (query block, key block) pair: every visible pair in exactly one rectangle."""

    full: tuple[FullGroup, ...] = ()
    causal: tuple[CausalSquare, ...] = ()

    @property
    def empty(self) -> bool:
        """True when the block is hidden entirely: nothing to compute."""
        return not self.full and not self.causal

    def fits(self, sq: int, sk: int) -> bool:
        """Every rectangle lies inside [0, sq) x [0, sk) (a plan made for other metadata would not)."""
        rows = [e for g in self.full for _, e in g.rows] + [c.row + c.size for c in self.causal]
        cols = [e for g in self.full for _, e in g.cols] + [c.col + c.size for c in self.causal]
        return max(rows, default=0) <= sq and max(cols, default=0) <= sk

    @property
    def kernel_calls(self) -> int:
        return len(self.full) + len(self.causal)

    @property
    def visible_pairs(self) -> int:
        """Number of visible (query, key) pairs: the attention work, counted exactly (causal counted as causal)."""
        full = sum(g.num_rows * g.num_cols for g in self.full)
        return full + sum(c.size * (c.size + 1) // 2 for c in self.causal)


def _coalesce(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """Sort and merge touching ranges (fewer, larger kernel calls)."""
    out: list[list[int]] = []
    for a, e in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1][1] = e
        else:
            out.append([a, e])
    return tuple((a, e) for a, e in out)


def _same_segment(q0: int, m: int, qa: int, k0: int, n: int, ka: int, full: dict, causal: list) -> None:
    """Query run (rows q0.., offsets qa.., m rows) vs key run of the SAME segment (cols k0.., offsets ka.., n)."""
    d = qa - ka  # row i sees local key columns [0, i + d]
    none_end = min(max(-d, 0), m)  # rows [0, none_end) see nothing
    all_start = min(max(n - 1 - d, 0), m)  # rows [all_start, m) see all n keys
    if all_start < m:
        full.setdefault((q0 + all_start, q0 + m), []).append((k0, k0 + n))
    if (
        none_end < all_start
    ):  # the partial rows: a full rectangle of the keys before the diagonal, then a square
        lead = none_end + d  # keys [0, lead) are seen by every partial row
        if lead > 0:
            full.setdefault((q0 + none_end, q0 + all_start), []).append((k0, k0 + lead))
        causal.append(CausalSquare(row=q0 + none_end, col=k0 + lead, size=all_start - none_end))


def plan_block(q: Runs, k: Runs, ancestors: Mapping[int, Iterable[int]]) -> BlockPlan:
    """The rectangles of query runs `q` over key runs `k`; `ancestors[s]` = proper ancestors of segment s."""
    k_by_seg = k.by_segment()
    full: dict[Range, list[Range]] = {}  # query row range -> key column ranges it sees unmasked
    causal: list[CausalSquare] = []
    for t in range(len(q)):
        q0, m, qs, qa = q.start[t], q.length[t], q.segment[t], q.offset[t]
        for a in ancestors[qs]:
            for u in k_by_seg.get(a, ()):
                full.setdefault((q0, q0 + m), []).append((k.start[u], k.start[u] + k.length[u]))
        for u in k_by_seg.get(qs, ()):
            _same_segment(q0, m, qa, k.start[u], k.length[u], k.offset[u], full, causal)
    groups: dict[tuple[Range, ...], list[Range]] = {}  # key column ranges -> the row ranges that see them
    for rows, cols in full.items():
        groups.setdefault(_coalesce(cols), []).append(rows)
    return BlockPlan(
        full=tuple(FullGroup(rows=_coalesce(r), cols=c) for c, r in groups.items()), causal=tuple(causal)
    )


def ancestors_from_related(related: torch.Tensor, segments: Iterable[int]) -> dict[int, tuple[int, ...]]:
    """{segment: its proper ancestors} for `segments`, from the [S, S] ancestor-or-self relation of the tree."""
    out: dict[int, tuple[int, ...]] = {}
    for s in set(segments):
        row = related[s].nonzero().flatten().tolist()
        out[s] = tuple(a for a in row if a != s)
    return out


def plan_from_meta(q_meta: torch.Tensor, k_meta: torch.Tensor, related: torch.Tensor) -> BlockPlan:
    """Convenience: the plan of a (query block, key block) pair given as per-token metadata."""
    q, k = runs_from_meta(q_meta), runs_from_meta(k_meta)
    return plan_block(q, k, ancestors_from_related(related, q.segment))


def plan_from_layout(layout: AttentionLayout) -> BlockPlan:
    """The same description for a single-rank chunk: ancestor ranges in full (grouped), own keys causal."""
    groups: dict[tuple[Range, ...], list[Range]] = {}
    causal = []
    for seg in layout.segments:
        if seg.ancestor_ranges:
            groups.setdefault(_coalesce(seg.ancestor_ranges), []).append((seg.q_start, seg.q_end))
        causal.append(CausalSquare(row=seg.q_start, col=seg.self_k_start, size=seg.length))
    return BlockPlan(
        full=tuple(FullGroup(rows=_coalesce(r), cols=c) for c, r in groups.items()), causal=tuple(causal)
    )
