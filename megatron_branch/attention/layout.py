"""Which keys each query may see: the one layout description every attention backend consumes.

SHAPE LEGEND (Megatron sequence-first; this file only deals in positions, not tensors):
    Sq  number of query rows in the chunk (the chunk's own tokens)
    Sk  number of key rows (Sk >= Sq when the chunk attends to EXTERNAL cached ancestor keys:
        keys = [cached ancestor keys | chunk keys])
    The dense mask is [Sq, Sk] bool, True = may attend.

A chunk of packed branches is cut into query segments. Every query of a segment sees, in full, the key ranges of
its ancestors (the shared prefix, a parent branch, ...) and its own keys causally. This is the tree-attention
pattern of branch replay: a shared prefix's keys/values are computed once and every branch's suffix attends to them.
Padding is not special: model it as its own causal segment (or 1-token segments), so every row has at least one
visible key and no backend ever sees an empty softmax row by construction.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True, kw_only=True)
class QuerySegment:
    """Query rows [q_start, q_end) that share one set of ancestor key ranges.

    ancestor_ranges: key ranges [a, b) fully visible to every query of the segment (its ancestors' tokens).
    self_k_start: the segment's own keys are [self_k_start, self_k_start + (q_end - q_start)); causal: the segment's
        j-th query sees its i-th own key iff i <= j.
    """

    q_start: int
    q_end: int
    ancestor_ranges: tuple[tuple[int, int], ...] = ()
    self_k_start: int

    @property
    def length(self) -> int:
        return self.q_end - self.q_start

    @property
    def self_k_end(self) -> int:
        return self.self_k_start + self.length

    @property
    def num_ancestor_keys(self) -> int:
        return sum(b - a for a, b in self.ancestor_ranges)


@dataclass(frozen=True, kw_only=True)
class AttentionLayout:
    """The visibility pattern of one chunk: Sq queries over Sk keys, cut into query segments.

    The segments cover [0, Sq) exactly, without gaps or overlap (validated); they are stored in the order given.
    """

    num_queries: int  # Sq
    num_keys: int  # Sk
    segments: tuple[QuerySegment, ...]
    _derived: dict = field(default_factory=dict, compare=False, repr=False)
    """What backends derive from the layout (dense mask per device, block mask, kernel plan), built on the first
    layer's call and reused by every later layer of the chunk (a chunk has one layout). Not part of equality."""

    def derived(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """`build()` once per layout and key; later calls return the same object (never mutate it)."""
        if key not in self._derived:
            self._derived[key] = build()
        return self._derived[key]

    def __post_init__(self) -> None:
        sq, sk = self.num_queries, self.num_keys
        if sq < 0 or sk < 0:
            raise ValueError(f"num_queries={sq} and num_keys={sk} must be >= 0")
        # tuples, not lists: the layout is frozen and hashable (used as a cache key by backends)
        object.__setattr__(self, "segments", tuple(self.segments))
        covered = 0
        for idx, seg in enumerate(sorted(self.segments, key=lambda s: s.q_start)):
            where = f"segment {idx} (queries [{seg.q_start}, {seg.q_end}))"
            if seg.q_start != covered:
                kind = "overlaps the previous one" if seg.q_start < covered else f"leaves a gap at {covered}"
                raise ValueError(f"{where} {kind}: segments must cover [0, {sq}) disjointly")
            if seg.q_end <= seg.q_start:
                raise ValueError(f"{where} is empty or reversed")
            if seg.self_k_start < 0 or seg.self_k_end > sk:
                raise ValueError(
                    f"{where}: own keys [{seg.self_k_start}, {seg.self_k_end}) outside [0, {sk})"
                )
            for a, b in seg.ancestor_ranges:
                if not (0 <= a < b <= sk):
                    raise ValueError(f"{where}: ancestor range [{a}, {b}) is empty or outside [0, {sk})")
                if a < seg.self_k_end and seg.self_k_start < b:
                    # the own keys would then be visible twice, in part A unmasked and in part B causally
                    raise ValueError(f"{where}: ancestor range [{a}, {b}) overlaps the segment's own keys")
            ranges = sorted(seg.ancestor_ranges)
            for (_, b0), (a1, _) in zip(ranges, ranges[1:]):
                if a1 < b0:
                    raise ValueError(f"{where}: ancestor ranges overlap at key {a1}")
            covered = seg.q_end
        if covered != sq:
            raise ValueError(
                f"segments cover [0, {covered}) but num_queries={sq}: the cover must be complete"
            )

    def dense_mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """bool [Sq, Sk], True = query row may attend to key column (built once per layout and device)."""
        dev = torch.device("cpu" if device is None else device)
        return self.derived(("dense_mask", str(dev)), lambda: self._build_dense_mask(dev))

    def _build_dense_mask(self, device: torch.device) -> torch.Tensor:
        mask = torch.zeros(self.num_queries, self.num_keys, dtype=torch.bool, device=device)  # [Sq, Sk]
        for seg in self.segments:
            rows = slice(seg.q_start, seg.q_end)
            for a, b in seg.ancestor_ranges:
                mask[rows, a:b] = True
            n = seg.length
            causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()  # [n, n]
            mask[rows, seg.self_k_start : seg.self_k_end] = causal
        return mask

    @staticmethod
    def causal(s: int) -> AttentionLayout:
        """Plain causal attention: one segment, no ancestors, keys == queries."""
        segs = (QuerySegment(q_start=0, q_end=s, self_k_start=0),) if s > 0 else ()
        return AttentionLayout(num_queries=s, num_keys=s, segments=segs)

    @staticmethod
    def shared_prefix(prefix_len: int, branch_lens: list[int] | tuple[int, ...]) -> AttentionLayout:
        """Packed [prefix | branch_1 | ... | branch_G]: the prefix is causal, each branch sees the prefix + itself."""
        segs = [QuerySegment(q_start=0, q_end=prefix_len, self_k_start=0)] if prefix_len > 0 else []
        start = prefix_len
        ancestors = ((0, prefix_len),) if prefix_len > 0 else ()
        for n in branch_lens:
            segs.append(
                QuerySegment(q_start=start, q_end=start + n, ancestor_ranges=ancestors, self_k_start=start)
            )
            start += n
        return AttentionLayout(num_queries=start, num_keys=start, segments=tuple(segs))
