"""THE visibility plan: which (query rows, key columns) see each other, as rectangles the fused kernels take.

SHAPE LEGEND (positions only; nothing here holds activations):
    sq        query rows of the call (a chunk on one rank, or a CP rank's rows of it)
    sk_j      key rows of key block j (replay: the cached ancestors' blocks, then the chunk's own keys; under CP
              one ring block, or this rank's local blocks); key COLUMNS are numbered over the blocks end to end
    runs      maximal row ranges of ONE tree segment with consecutive offsets (a segment gives 1 run per chunk on
              one rank, at most 2 per CP rank under the zigzag split); key runs never straddle a block boundary

The planner's one input is runs of (segment, offset) on both sides plus, per query run, the key runs it sees IN
FULL (its ancestors). The rule: a query (segment a, offset i) sees a key of a key run it sees in full; it sees a key
(a, j) of its OWN segment iff j <= i; nothing else. A query run against a key run of its own segment with offset
difference d = i0 - j0 splits into rows that see nothing, rows that see the whole run, and rows in between, which
see a full rectangle of the run's first keys and a causal SQUARE (sq == sk, top-left aligned): the two shapes the
fused kernels take (attention/kernels.py: non-causal, and causal with sq == sk).

`plan_block` turns that into a `BlockPlan`:
    full    FullGroups: query row ranges that see exactly the same key columns, ONE non-causal call per key piece
            for all of them (the G sibling branches of a prefix share their ancestors: one call over all their
            rows); each row is in at most one group;
    causal  CausalRuns: causal squares of equal size laid diagonally end to end (sibling branches of equal length,
            every rollout of a packed batch without sharing, the two zigzag pieces of a segment on a CP rank) batched
            into ONE causal call.
    bands   with a sliding window (attention/window.py): the rows the window's edge crosses, small masked calls.
A block the tree (or the window) hides entirely has an empty plan: nothing is computed. Both sources of runs reach the planner
through attention/plan_sources.py (an AttentionLayout on one rank, per-token metadata under CP).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_branch.attention.window import Band, band_tiles, split_rows

Range = tuple[int, int]  # [start, end) of rows or columns


@dataclass(frozen=True, kw_only=True)
class Runs:
    """Rows as runs: run t covers rows [start[t], start[t] + length[t]) holding offsets [offset[t], offset[t] +
    length[t]) of tree segment `segment[t]` (any hashable int; ids no query has stand for key-only rows)."""

    start: tuple[int, ...]
    length: tuple[int, ...]
    segment: tuple[int, ...]
    offset: tuple[int, ...]
    position: tuple[int, ...] = ()
    """Per run: the PATH position of its first row (its index along its root-to-leaf path, attention/window.py);
    empty when unknown, which only a plan without a sliding window allows."""

    def __len__(self) -> int:
        return len(self.start)

    def by_segment(self) -> dict[int, list[int]]:
        """segment id -> indices of its runs, in row order."""
        out: dict[int, list[int]] = {}
        for t, s in enumerate(self.segment):
            out.setdefault(s, []).append(t)
        return out


def runs_from_meta(meta: torch.Tensor, breaks: Iterable[int] = ()) -> Runs:
    """[2, s] metadata (segment id, -1 = padding; offset) -> its runs, also cut at the rows `breaks` (key block
    starts); O(s) vectorised work, O(runs) Python objects. Padding rows are in no run."""
    assert meta.dim() == 2 and meta.shape[0] == 2, tuple(meta.shape)
    seg, off = meta[0], meta[1]  # [s]
    s = seg.numel()
    if s == 0:
        return Runs(start=(), length=(), segment=(), offset=())
    brk = torch.ones(s, dtype=torch.bool, device=meta.device)  # [s]: a run starts here
    brk[1:] = (seg[1:] != seg[:-1]) | (off[1:] != off[:-1] + 1)
    cuts = [b for b in breaks if 0 < b < s]
    if cuts:
        brk[torch.tensor(cuts, device=meta.device)] = True
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


@dataclass(frozen=True)
class Piece:
    """Key columns [start, end) of key block `block` (local to the block): read in place, never copied."""

    block: int
    start: int
    end: int


@dataclass(frozen=True, kw_only=True)
class FullGroup:
    """Query row ranges that all see, unmasked, the same key columns: one non-causal call per piece."""

    rows: tuple[Range, ...]
    pieces: tuple[Piece, ...]

    @property
    def num_rows(self) -> int:
        return sum(e - a for a, e in self.rows)

    @property
    def num_cols(self) -> int:
        return sum(p.end - p.start for p in self.pieces)


@dataclass(frozen=True, kw_only=True)
class CausalRun:
    """`count` causal squares of `size`, laid end to end: square i is query rows row + i*size .. over key columns
    col + i*size .. of `block`, row row + i*size + x seeing columns col + i*size .. col + i*size + x."""

    row: int
    block: int
    col: int
    size: int
    count: int = 1

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.count * self.size)

    @property
    def cols(self) -> slice:
        return slice(self.col, self.col + self.count * self.size)


@dataclass(frozen=True, kw_only=True)
class BlockPlan:
    """The visibility of sq query rows over key blocks of `block_sizes`: every visible pair in exactly one
    rectangle. `q`, `k`, `sees` are the description it was cut from (flex builds its mask from them)."""

    num_queries: int
    block_sizes: tuple[int, ...]
    full: tuple[FullGroup, ...] = ()
    causal: tuple[CausalRun, ...] = ()
    causal_fresh: tuple[bool, ...] = ()
    """Per causal run: none of its rows is in a full group or an earlier run (its result is written, not merged)."""
    bands: tuple[Band, ...] = ()
    """The sliding window's edges (always merged: their rows may be in a group or a run too)."""
    window: int | None = None
    """The sliding window the plan was cut with (None: every ancestor key in full)."""
    q: Runs = field(default_factory=lambda: Runs(start=(), length=(), segment=(), offset=()))
    k: Runs = field(default_factory=lambda: Runs(start=(), length=(), segment=(), offset=()))
    sees: tuple[tuple[int, ...], ...] = ()
    """Per query run: the key runs it sees in full."""
    _derived: dict = field(default_factory=dict, compare=False, repr=False)
    """What executors derive from the plan (a dense mask, flex's block mask), built once: every layer reuses it."""

    def derived(self, key: object, build: Callable[[], Any]) -> Any:
        """`build()` once per plan and key; later calls return the same object (never mutate it)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    @property
    def empty(self) -> bool:
        """True when the blocks are hidden entirely: nothing to compute."""
        return not self.full and not self.causal and not self.bands

    @property
    def num_keys(self) -> int:
        return sum(self.block_sizes)

    @property
    def kernel_calls(self) -> int:
        """Fused kernel calls per forward (the same number per backward): what grouping and batching save."""
        return sum(len(g.pieces) for g in self.full) + len(self.causal) + len(self.bands)

    @property
    def visible_pairs(self) -> int:
        """Visible (query, key) pairs: the attention work, counted exactly (causal counted as causal)."""
        full = sum(g.num_rows * g.num_cols for g in self.full)
        causal = sum(c.count * c.size * (c.size + 1) // 2 for c in self.causal)
        return full + causal + sum(b.visible_pairs for b in self.bands)

    def block_starts(self) -> list[int]:
        starts = [0]
        for n in self.block_sizes:
            starts.append(starts[-1] + n)
        return starts

    def dense_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """bool [sq, sk] over the blocks' columns end to end, True = visible (the dense oracle's view; O(sq * sk)),
        built once per plan and device."""
        dev = torch.device("cpu" if device is None else device)
        return self.derived(("dense_mask", str(dev)), lambda: self._build_dense_mask(dev))

    def _build_dense_mask(self, device: torch.device) -> torch.Tensor:
        starts = self.block_starts()
        mask = torch.zeros(self.num_queries, self.num_keys, dtype=torch.bool, device=device)
        for grp in self.full:
            for a, e in grp.rows:
                for p in grp.pieces:
                    mask[a:e, starts[p.block] + p.start : starts[p.block] + p.end] = True
        for run in self.causal:
            tri = torch.ones(run.size, run.size, dtype=torch.bool, device=device).tril()
            for i in range(run.count):
                r, c = run.row + i * run.size, starts[run.block] + run.col + i * run.size
                mask[r : r + run.size, c : c + run.size] = tri
        for band in self.bands:
            c = starts[band.block] + band.col
            mask[band.row : band.row + band.rows, c : c + band.cols] |= band.mask(device)
        return mask


def _coalesce(ranges: Iterable[Range]) -> tuple[Range, ...]:
    """Sort and merge touching ranges (fewer, larger kernel calls)."""
    out: list[list[int]] = []
    for a, e in sorted(ranges):
        if out and out[-1][1] >= a:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([a, e])
    return tuple((a, e) for a, e in out)


def _same_segment(
    m: int, qa: int, n: int, ka: int
) -> tuple[list[tuple[int, int, Range]], tuple[int, int, int] | None]:
    """Query run (m rows, offsets qa..) vs key run of its OWN segment (n keys, offsets ka..), all run-local:
    ([(row lo, row hi, key cols seen in full)], causal square (row, col, size) or None)."""
    d = qa - ka  # local row i sees local key columns [0, i + d]
    none_end = min(max(-d, 0), m)  # rows [0, none_end) see nothing
    all_start = min(max(n - d, none_end), m)  # rows [all_start, m) see all n keys (i + d >= n)
    full = [(all_start, m, (0, n))] if all_start < m else []
    if none_end == all_start:
        return full, None
    lead = none_end + d  # keys [0, lead) are seen by every partial row; then the square starts at column lead
    if lead > 0:
        full.append((none_end, all_start, (0, lead)))
    return full, (none_end, lead, all_start - none_end)


def _run_rectangles(q: Runs, k: Runs, sees: Sequence[Iterable[int]], window: int | None = None):  # noqa: ANN202
    """Per query run: (row sub-range -> key columns seen in full), its causal squares and, with a window, its
    bands (global positions; attention/window.py for the window's three row ranges)."""
    k_by_seg = k.by_segment()
    rows_cols: dict[Range, list[Range]] = {}
    squares: list[tuple[int, int, int]] = []  # (row, global col, size)
    bands: list[tuple[int, int, int, int, int]] = []  # (row, rows, global col, cols, shift)
    for t in range(len(q)):
        q0, m, qs, qa = q.start[t], q.length[t], q.segment[t], q.offset[t]
        spans: list[tuple[int, int, Range]] = []
        pairs = [(u, False) for u in sees[t]] + [(u, True) for u in k_by_seg.get(qs, ())]
        for u, own in pairs:
            k0, n = k.start[u], k.length[u]
            a = m  # rows [0, a) see the run as without a window
            if window is not None:
                d = q.position[t] - k.position[u]
                a, e = split_rows(m, n, d, window)
                bands += band_tiles(q0, k0, a, e, n, d, window)
            if not own:
                spans += [(0, a, (k0, k0 + n))] if a > 0 else []
                continue
            full, square = _same_segment(a, qa, n, k.offset[u])
            spans += [(lo, hi, (k0 + c0, k0 + c1)) for lo, hi, (c0, c1) in full]
            if square is not None:
                squares.append((q0 + square[0], k0 + square[1], square[2]))
        # cut the run's rows where what they see in full changes: every row lands in ONE group
        cuts = sorted({0, m, *(x for lo, hi, _ in spans for x in (lo, hi))})
        for lo, hi in zip(cuts, cuts[1:]):
            cols = [c for a, e, c in spans if a <= lo and hi <= e]
            if cols:
                rows_cols[(q0 + lo, q0 + hi)] = cols
    return rows_cols, squares, bands


def _locate(a: int, e: int, starts: Sequence[int]) -> list[Piece]:
    """Global key columns [a, e) -> block-local pieces (a range may span block boundaries)."""
    out = []
    for j in range(len(starts) - 1):
        lo, hi = max(a, starts[j]), min(e, starts[j + 1])
        if lo < hi:
            out.append(Piece(j, lo - starts[j], hi - starts[j]))
    return out


def _batch_squares(squares: list[tuple[int, int, int]], starts: Sequence[int]) -> list[CausalRun]:
    """Causal squares -> runs: consecutive squares of one size laid diagonally end to end in one block batch."""
    runs: list[CausalRun] = []
    for row, col, size in squares:
        (piece,) = _locate(col, col + size, starts)  # key runs never straddle a block: neither do squares
        last = runs[-1] if runs else None
        if (
            last is not None
            and last.size == size
            and last.block == piece.block
            and last.rows.stop == row
            and last.cols.stop == piece.start
        ):
            runs[-1] = CausalRun(
                row=last.row, block=last.block, col=last.col, size=size, count=last.count + 1
            )
        else:
            runs.append(CausalRun(row=row, block=piece.block, col=piece.start, size=size))
    return runs


def plan_block(
    q: Runs,
    k: Runs,
    sees: Sequence[Iterable[int]],
    num_queries: int,
    block_sizes: Sequence[int],
    *,
    window: int | None = None,
) -> BlockPlan:
    """THE planner: the rectangles of query runs `q` over key runs `k` (global columns over the blocks of
    `block_sizes`, no run straddling a block); `sees[t]` = the key runs query run t sees in full; `window`: a
    sliding window over path positions (both sides' runs then carry `position`)."""
    sees = tuple(tuple(s) for s in sees)
    assert len(sees) == len(q), (len(sees), len(q))
    assert window is None or (window > 0 and len(q.position) == len(q) and len(k.position) == len(k)), (
        "a sliding window needs a positive size and the runs' path positions"
    )
    starts = [0]
    for n in block_sizes:
        starts.append(starts[-1] + n)
    rows_cols, squares, band_rows = _run_rectangles(q, k, sees, window)
    groups: dict[tuple[Range, ...], list[Range]] = {}  # key columns -> the row ranges that see them
    for rows, cols in rows_cols.items():
        groups.setdefault(_coalesce(cols), []).append(rows)
    full = tuple(
        FullGroup(rows=_coalesce(r), pieces=tuple(p for a, e in c for p in _locate(a, e, starts)))
        for c, r in groups.items()
    )
    causal = tuple(_batch_squares(squares, starts))
    covered = bytearray(num_queries)  # rows written so far: full groups first, then the causal runs in order
    for grp in full:
        for a, e in grp.rows:
            assert not any(covered[a:e]), "a row in two full groups"
            covered[a:e] = b"\x01" * (e - a)
    fresh = []
    for run in causal:
        a, e = run.rows.start, run.rows.stop
        fresh.append(not any(covered[a:e]))
        covered[a:e] = b"\x01" * (e - a)
    bands = []
    for row, rows, col, cols, shift in band_rows:
        (piece,) = _locate(col, col + cols, starts)  # inside one key run, so inside one block
        bands.append(
            Band(
                row=row, rows=rows, block=piece.block, col=piece.start, cols=cols, shift=shift, window=window
            )
        )
    return BlockPlan(
        num_queries=num_queries,
        block_sizes=tuple(block_sizes),
        full=full,
        causal=causal,
        causal_fresh=tuple(fresh),
        bands=tuple(bands),
        window=window,
        q=q,
        k=k,
        sees=sees,
    )
