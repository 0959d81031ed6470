"""A chunk: the tokens of one model forward, and the attention layout the prefix tree gives them.

Shape legend (sequence first, as megatron): s chunk tokens (padded), c cached ancestor tokens (external keys),
s_loc rows one context-parallel rank holds, m targets predicted in the chunk (on this rank).

Every schedule is a sequence of chunks. A chunk holds whole segments of the prefix tree: the whole tree (`packed`),
one segment or a micro-batch of sibling leaf segments (`replay`). Keys are laid out as
[external ancestors in path order (c) | chunk tokens (s)]; each segment sees its ancestors fully and itself
causally, wherever those ancestors live. Padding (for sequence parallel, s % tp == 0) is one extra causal segment
that no real query sees, so it never changes a result.

Two kinds answer the same questions (`context`, `cache_rows`, `cache_meta`, targets, ids), so the schedules never
branch on which one they hold: `Chunk` (one rank holds every row; a LocalContext) and `CPChunk` (this rank's zigzag
share under context parallelism, parallel/cp_layout.py; a RingContext). Both run the executor `opts.backend` names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_branch.attention.context import BranchContext, LocalContext
from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.attention.prefix_state import CACHED, ChunkSegment, ChunkTree, Tensors
from megatron_branch.data import PrefixTree
from megatron_branch.parallel.cp_layout import tree_related, zigzag_offsets, zigzag_rows
from megatron_branch.schedule.options import ScheduleOptions


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

    @property
    def cache_rows(self) -> int:
        """Rows of this chunk's K/V that descendants attend to: the real rows (padding is never a key)."""
        return self.num_real

    @property
    def cache_meta(self) -> torch.Tensor | None:
        """Metadata the descendants' context needs for the cached rows: none (the layout says it all)."""
        return None

    def context(
        self,
        tree: PrefixTree,
        opts: ScheduleOptions,
        *,
        external: dict[int, list[Tensors]],
        external_meta: torch.Tensor | None,
        capture: bool,
        device: torch.device,
    ) -> BranchContext:
        """The context of one forward of this chunk on one rank: its layout, tree, and the chosen executor."""
        assert external_meta is None
        return LocalContext(
            layout=self.layout,
            external=external,
            capture=capture,
            backend=opts.backend,
            recompute_layers=opts.recompute_layers,
            tree=self.tree(tree),
        )

    def tree(self, tree: PrefixTree) -> ChunkTree:
        """The chunk's segments (rows) and their parents: in the chunk, handed down (the last cached), or none."""
        index = {sid: i for i, sid in enumerate(self.segments)}
        out = []
        for i, sid in enumerate(self.segments):
            seg, rows = tree.segments[sid], self.layout.segments[i]
            if seg.parent in index:
                parent: int | None = index[seg.parent]
            elif seg.parent >= 0:
                assert self.external and self.external[-1] == seg.parent, "a cached parent is the path's last"
                parent = CACHED
            else:
                parent = None
            out.append(ChunkSegment(rows.q_start, rows.q_end, parent))
        return ChunkTree(segments=tuple(out))


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


@dataclass(frozen=True, kw_only=True)
class CPChunk:
    """This rank's share of a chunk; `chunk` is the unsplit reference it was cut from."""

    chunk: Chunk
    cp_size: int
    cp_rank: int
    token_index: torch.Tensor
    """[s_loc] packed tree index of each local row (-1 = padding)."""
    rows: torch.Tensor
    """[s_loc] row of the unsplit chunk each local row holds (-1 = padding): the map the tests compare through."""
    input_ids: torch.Tensor
    """[s_loc] token ids (padding: 0)."""
    position_ids: torch.Tensor
    """[s_loc] original position ids (padding: 0)."""
    meta: torch.Tensor
    """[2, s_loc] long (segment id, offset in segment); segment -1 = padding."""
    targets: torch.Tensor
    """[m_loc] packed indices of the targets predicted on this rank."""
    target_rows: torch.Tensor
    """[m_loc] local row whose logits predict each target."""

    @property
    def num_real(self) -> int:
        """Real positions of the whole (unsplit) chunk: what the schedules count as computed."""
        return self.chunk.num_real

    @property
    def num_local(self) -> int:
        return int(self.token_index.numel())

    @property
    def cache_rows(self) -> int:
        """Every local row: padding is hidden by its metadata, and keeping it keeps every rank's cached shard of a
        prefix the same length."""
        return self.num_local

    @property
    def cache_meta(self) -> torch.Tensor:
        """[2, s_loc] metadata of the cached rows: the ring's visibility for the descendants' queries."""
        return self.meta

    def context(
        self,
        tree: PrefixTree,
        opts: ScheduleOptions,
        *,
        external: dict[int, list[Tensors]],
        external_meta: torch.Tensor | None,
        capture: bool,
        device: torch.device,
    ) -> BranchContext:
        """The ring context over the context-parallel group (parallel/context.py), with the chosen executor; for a
        recurrent layer (a gated delta net) the unsplit chunk's tree and the head exchange over the same group."""
        from megatron_branch.parallel.context import RingContext  # the ring: only under CP
        from megatron_branch.parallel.head_exchange import CPHeadExchange

        return RingContext(
            q_meta=self.meta.to(device),
            external=external,
            external_meta=None if external_meta is None else external_meta.to(device),
            related=tree_related(tree).to(device),
            cp_group=opts.cp_group,
            capture=capture,
            backend=opts.backend,
            stats=opts.ring_stats,
            recompute_layers=opts.recompute_layers,
            tree=self.chunk.tree(tree),
            seg_start=torch.tensor([seg.start_position for seg in tree.segments], device=device),
            exchange=CPHeadExchange(
                group=opts.cp_group,
                size=self.cp_size,
                rank=self.cp_rank,
                num_rows=self.chunk.num_real,
                rows=lambda: self.all_rows(tree),
                device=device,
                stats=opts.ring_stats,
            ),
        )

    def all_rows(self, tree: PrefixTree) -> torch.Tensor:
        """[cp, s_loc] the unsplit chunk row of every CP rank's local rows (-1 = padding): `rows` of each rank."""
        lengths = chunk_lengths(tree, self.chunk)
        out = []
        for r in range(self.cp_size):
            # every rank has the same count before the final padding
            rows = zigzag_rows(lengths, self.cp_size, r)
            out.append(torch.cat([rows, rows.new_full((self.num_local - rows.numel(),), -1)]))
        return torch.stack(out)


def split_chunk(
    tree: PrefixTree, chunk: Chunk, cp_size: int, cp_rank: int, *, pad_to_multiple: int = 1
) -> CPChunk:
    """Rank `cp_rank`'s share of `chunk` (built WITHOUT padding); local rows padded to `pad_to_multiple` (SP: tp)."""
    assert chunk.layout.num_queries == chunk.num_real, (
        "split the unpadded chunk (make_chunk pad_to_multiple=1)"
    )
    seg_ids, offsets = [], []
    for sid in chunk.segments:
        offs = zigzag_offsets(tree.segments[sid].length, cp_size, cp_rank)
        seg_ids.append(torch.where(offs >= 0, torch.full_like(offs, sid), torch.full_like(offs, -1)))
        offsets.append(offs)
    seg = torch.cat(seg_ids)  # [s_loc before final padding]
    off = torch.cat(offsets)
    extra = -seg.numel() % pad_to_multiple  # the same on every rank: all ranks have equal lengths
    seg = torch.cat([seg, torch.full((extra,), -1, dtype=torch.long)])  # [s_loc]
    off = torch.cat([off, torch.full((extra,), -1, dtype=torch.long)])
    real = seg >= 0  # [s_loc]
    seg_offset = torch.tensor([s.offset for s in tree.segments], dtype=torch.long)  # [S]
    token_index = torch.where(real, seg_offset[seg.clamp(min=0)] + off, torch.full_like(seg, -1))  # [s_loc]

    # the unsplit chunk row of every local row (chunk rows follow chunk.token_index): THE zigzag row map, which a
    # gated delta net layer's head exchange also reads for every rank (parallel/cp_layout.py)
    lengths = chunk_lengths(tree, chunk)
    rows = zigzag_rows(lengths, cp_size, cp_rank, pad_to_multiple=pad_to_multiple)  # [s_loc]
    assert torch.equal(rows >= 0, real) and torch.equal(chunk.token_index[rows[real]], token_index[real])

    safe = token_index.clamp(min=0)
    input_ids = torch.where(real, tree.tokens[safe], torch.zeros_like(seg))
    position_ids = torch.where(real, tree.position_ids[safe], torch.zeros_like(seg))

    # targets whose predecessor row is local: local row of each packed index, then filter the chunk's targets
    pred = chunk.token_index[chunk.target_rows]  # [m] packed index of each target's predecessor
    pred_row = lookup(
        token_index, pred
    )  # [m] its local row, -1 when another rank holds it (padding: -1, never hit)
    mine = pred_row >= 0
    return CPChunk(
        chunk=chunk,
        cp_size=cp_size,
        cp_rank=cp_rank,
        token_index=token_index,
        rows=rows,
        input_ids=input_ids,
        position_ids=position_ids,
        meta=torch.stack([seg, off.clamp(min=0)]),
        targets=chunk.targets[mine],
        target_rows=pred_row[mine],
    )


def chunk_lengths(tree: PrefixTree, chunk: Chunk) -> list[int]:
    """Token counts of the chunk's segments, in chunk order (the unsplit chunk's rows: these end to end)."""
    return [tree.segments[sid].length for sid in chunk.segments]


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
