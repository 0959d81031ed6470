"""The two sources of the one planner's runs (attention/plan.py `plan_block`): an AttentionLayout on one rank, and
per-token metadata under context parallelism. Both end in the same `plan_block` call.

SHAPE LEGEND (positions only):
    sq, sk_j   query rows / key rows of key block j (columns numbered over the blocks end to end)
    meta       [2, s] long: row 0 tree segment id (-1 = padding), row 1 offset of the token inside its segment
    related    [S, S] bool: related[a, b] iff segment b is an ancestor of a or a itself (the tree's relation)

From a layout: query segment i is query run i (offsets 0..); the key axis is cut at every own-key and ancestor-range
boundary (and at the block starts), each piece of a segment's own keys is a key run of that segment (its offset
inside the segment), every other piece a key-only run; query run i sees in full the pieces inside its ancestor
ranges. From metadata: the runs of consecutive offsets (also cut at block starts), query run t seeing in full the
key runs of its segment's proper ancestors. A layout's plan is built once per layout and block sizes (every layer of
a chunk reuses it, `AttentionLayout.derived`); the ring keeps its per-step plans for all layers of a forward.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch

from megatron_branch.attention.layout import AttentionLayout
from megatron_branch.attention.plan import BlockPlan, Runs, plan_block, runs_from_meta


def _block_cuts(block_sizes: Sequence[int]) -> list[int]:
    cuts, start = [], 0
    for n in block_sizes:
        start += n
        cuts.append(start)
    return cuts


def layout_runs(
    layout: AttentionLayout, block_sizes: Sequence[int], *, positions: bool = False
) -> tuple[Runs, Runs, list[list[int]]]:
    """(query runs, key runs, sees) of a layout whose keys come as blocks of `block_sizes`; with `positions`, the
    runs carry their path positions (a sliding window needs them)."""
    segs = layout.segments
    assert sum(block_sizes) == layout.num_keys, (tuple(block_sizes), layout.num_keys)
    owner: list[tuple[int, int, int]] = sorted((s.self_k_start, s.self_k_end, i) for i, s in enumerate(segs))
    for (_, e0, i0), (a1, _, i1) in zip(owner, owner[1:]):
        assert e0 <= a1, f"segments {i0} and {i1} own the same keys"
    bounds = {0, layout.num_keys, *_block_cuts(block_sizes)}
    bounds.update(x for s in segs for r in s.ancestor_ranges for x in r)
    bounds.update(x for a, e, _ in owner for x in (a, e))
    cuts = sorted(bounds)
    own_starts = [a for a, _, _ in owner]
    k_start, k_len, k_seg, k_off = [], [], [], []
    for a, e in zip(cuts, cuts[1:]):
        j = bisect.bisect_right(own_starts, a) - 1
        if j >= 0 and a < owner[j][1]:  # inside segment owner[j]'s own keys
            seg, off = owner[j][2], a - owner[j][0]
        else:  # nobody's own keys (cached ancestors under a layout): a key-only run no query owns
            seg, off = len(segs) + len(k_start), 0
        k_start.append(a)
        k_len.append(e - a)
        k_seg.append(seg)
        k_off.append(off)
    sees = []
    for s in segs:
        mine: list[int] = []
        for a, e in s.ancestor_ranges:  # pieces are cut at every range boundary: whole pieces inside [a, e)
            mine += range(bisect.bisect_left(k_start, a), bisect.bisect_left(k_start, e))
        sees.append(mine)
    q_pos, k_pos = _path_positions(layout, k_start, k_seg) if positions else ((), ())
    q = Runs(
        start=tuple(s.q_start for s in segs),
        length=tuple(s.length for s in segs),
        segment=tuple(range(len(segs))),
        offset=(0,) * len(segs),
        position=q_pos,
    )
    k = Runs(
        start=tuple(k_start),
        length=tuple(k_len),
        segment=tuple(k_seg),
        offset=tuple(k_off),
        position=k_pos,
    )
    return q, k, sees


def _path_positions(
    layout: AttentionLayout, k_start: Sequence[int], k_seg: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Path positions of the query runs (one per segment) and key runs of a layout: a segment's ancestor ranges,
    root first, are its whole path above it (replay's cached path, a packed tree's ancestors), so its first token
    sits at position sum(len(ancestor ranges)) and an ancestor key at its index along them. A key's position
    is the same for every segment that sees it (it is one tree token); asserted."""
    segs = layout.segments
    q_pos = tuple(s.num_ancestor_keys for s in segs)
    pos: dict[int, int] = {}  # key run -> path position of its first key
    for u, (a, seg) in enumerate(zip(k_start, k_seg)):
        if seg < len(segs):  # a segment's own keys
            pos[u] = q_pos[seg] + (a - segs[seg].self_k_start)
    for s in segs:
        depth = 0
        for ra, re in sorted(s.ancestor_ranges):
            for u in range(bisect.bisect_left(k_start, ra), bisect.bisect_left(k_start, re)):
                p = depth + k_start[u] - ra
                assert pos.setdefault(u, p) == p, f"key run {u}: path position {pos[u]} and {p}"
            depth += re - ra
    return q_pos, tuple(pos.get(u, 0) for u in range(len(k_start)))


def plan_from_layout(
    layout: AttentionLayout, block_sizes: Sequence[int] | None = None, *, window: int | None = None
) -> BlockPlan:
    """The plan of a single-rank chunk over key blocks of `block_sizes` (None: one block), with a sliding `window`
    over path positions (None: none), built once per layout, block sizes and window."""
    sizes = (layout.num_keys,) if block_sizes is None else tuple(block_sizes)

    def build() -> BlockPlan:
        q, k, sees = layout_runs(layout, sizes, positions=window is not None)
        return plan_block(q, k, sees, layout.num_queries, sizes, window=window)

    return layout.derived(("plan", sizes, window), build)


def ancestors_from_related(related: torch.Tensor, segments: Iterable[int]) -> dict[int, tuple[int, ...]]:
    """{segment: its proper ancestors} for `segments`, from the [S, S] ancestor-or-self relation of the tree."""
    out: dict[int, tuple[int, ...]] = {}
    for s in set(segments):
        row = related[s].nonzero().flatten().tolist()
        out[s] = tuple(a for a in row if a != s)
    return out


def meta_sees(q: Runs, k: Runs, ancestors: dict[int, tuple[int, ...]]) -> list[list[int]]:
    """Per query run: the key runs of its segment's proper ancestors."""
    k_by_seg = k.by_segment()
    return [[u for a in ancestors[s] for u in k_by_seg.get(a, ())] for s in q.segment]


def plan_from_meta(
    q_meta: torch.Tensor,
    k_meta: torch.Tensor,
    related: torch.Tensor,
    block_sizes: Sequence[int] | None = None,
    *,
    q_runs: Runs | None = None,
    ancestors: dict[int, tuple[int, ...]] | None = None,
    window: int | None = None,
    seg_start: torch.Tensor | None = None,
) -> BlockPlan:
    """The plan of query rows `q_meta` [2, sq] over key rows `k_meta` [2, sk] (blocks of `block_sizes` end to end;
    None: one block). `q_runs`/`ancestors`: the query side, when the caller reuses it over many key blocks.
    `window`: a sliding window over path positions, `seg_start` [S] the path position of each segment's first
    token (a token's path position = its segment's start + its offset)."""
    sizes = (k_meta.shape[1],) if block_sizes is None else tuple(block_sizes)
    assert sum(sizes) == k_meta.shape[1], (sizes, tuple(k_meta.shape))
    q = runs_from_meta(q_meta) if q_runs is None else q_runs
    k = runs_from_meta(k_meta, breaks=_block_cuts(sizes)[:-1])
    anc = ancestors_from_related(related, q.segment) if ancestors is None else ancestors
    if window is not None:
        assert seg_start is not None, "a sliding window needs the segments' path positions"
        q, k = (_with_positions(x, seg_start) for x in (q, k))
    return plan_block(q, k, meta_sees(q, k, anc), q_meta.shape[1], sizes, window=window)


def _with_positions(runs: Runs, seg_start: torch.Tensor) -> Runs:
    """The runs with their path positions: segment start + offset."""
    start = seg_start.tolist()
    return replace(runs, position=tuple(start[s] + o for s, o in zip(runs.segment, runs.offset)))
