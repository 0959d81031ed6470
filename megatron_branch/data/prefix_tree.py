"""The prefix tree: a radix tree over the full token sequences of a batch of rollouts.

It is the single source of truth for positions, attention visibility, loss weights and fork tokens. Every
distinct prefix of every rollout is computed exactly once: a shared prompt, a shared beginning of several
responses, identical rollouts, or one rollout being a strict prefix of another all collapse onto the same
segments. The training schedules, the attention layout and the context-parallel splitter all derive from it.

Packed layout: the segments concatenated in depth-first pre-order. Pre-order puts every ancestor before its
descendants and makes every subtree one contiguous range, of segment ids and of packed tokens; both facts are
relied on below (the causal `tril` in `attention_mask`, the ranges in `subtree_segments`).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_branch.data.rollouts import Rollout, validate_token_ids
from megatron_branch.errors import UserError

__all__ = ["PrefixTree", "Rollout", "Segment"]


@dataclass(frozen=True, kw_only=True)
class Segment:
    """A maximal run of tokens shared by exactly the same set of rollouts (an edge of the radix tree)."""

    id: int  # index in PrefixTree.segments (depth-first pre-order)
    parent: int  # -1 for a root
    children: tuple[int, ...]  # in first-appearance order
    depth: int  # 0 for roots
    tokens: tuple[int, ...]
    start_position: int  # position id of the first token: a branch continues from its parent's end
    offset: int  # start of this segment in the packed layout
    length: int
    ancestors: tuple[int, ...]  # root..parent, in order

    def __post_init__(self) -> None:
        assert self.length == len(self.tokens) > 0, "segments are never empty"


class _Node:
    """Mutable radix-tree node used only while building."""

    __slots__ = ("tokens", "children", "by_first", "ends", "sid")

    def __init__(self, tokens: tuple[int, ...]) -> None:
        self.tokens = tokens
        self.children: list[_Node] = []
        self.by_first: dict[int, _Node] = {}
        self.ends: list[int] = []  # rollouts whose full sequence ends exactly at the end of this node
        self.sid = -1

    def add_child(self, child: _Node) -> None:
        self.children.append(child)
        self.by_first[child.tokens[0]] = child

    def split(self, at: int) -> None:
        """Keep tokens[:at] here; the rest moves into a new only child that inherits children and ends."""
        assert 0 < at < len(self.tokens)
        rest = _Node(self.tokens[at:])
        rest.children, rest.by_first, rest.ends = self.children, self.by_first, self.ends
        self.tokens = self.tokens[:at]
        self.children, self.by_first, self.ends = [], {}, []
        self.add_child(rest)


def _insert(root: _Node, seq: tuple[int, ...], rollout: int) -> None:
    node, pos, n = root, 0, len(seq)
    while pos < n:
        child = node.by_first.get(seq[pos])
        if child is None:  # nothing shares this continuation: a fresh leaf takes the whole rest
            leaf = _Node(seq[pos:])
            node.add_child(leaf)
            node, pos = leaf, n
            break
        length = len(child.tokens)
        if seq[pos : pos + length] == child.tokens:  # whole edge matches: one C-speed comparison
            node, pos = child, pos + length
            continue
        common = 1  # the first token matched via by_first
        while pos + common < n and seq[pos + common] == child.tokens[common]:
            common += 1
        child.split(common)  # also places a boundary where a strict-prefix rollout ends
        node, pos = child, pos + common
    node.ends.append(rollout)


def _keys(r: Rollout) -> tuple:
    """Rollout r's sequence keyed by (token, its recorded experts): with MoE routing replay two rollouts share a
    position only where the token AND the routing recorded for it agree, so every packed token has one record."""
    rec = r.routed_experts
    rows = [None] * len(r.sequence) if rec is None else [row.numpy().tobytes() for row in rec]
    return tuple(zip(r.prompt + r.response, rows, strict=True))


class PrefixTree:
    """Radix tree over prompt+response of every rollout; build it with `PrefixTree.build`."""

    def __init__(
        self, *, rollouts: tuple[Rollout, ...], segments: tuple[Segment, ...], leaves: tuple[int, ...]
    ):
        self.rollouts = rollouts
        self._relation: torch.Tensor | None = None
        self._response_starts: tuple[int, ...] | None = None
        self.segments = segments
        self.roots = tuple(s.id for s in segments if s.parent == -1)
        self._leaves = leaves  # segment where each rollout's sequence ends
        self.num_tokens = sum(s.length for s in segments)
        self.positions_computed = self.num_tokens
        self.positions_logical = sum(len(r.prompt) + len(r.response) for r in rollouts)

        # Subtree sizes: pre-order makes subtree(s) == ids [s, s + size), so walk backwards adding to parents.
        size = [1] * len(segments)
        for s in reversed(segments):
            if s.parent >= 0:
                size[s.parent] += size[s.id]
        self._subtree_size = size

        n = self.num_tokens
        lengths = torch.tensor([s.length for s in segments], dtype=torch.long)
        offsets = torch.tensor([s.offset for s in segments], dtype=torch.long)
        starts = torch.tensor([s.start_position for s in segments], dtype=torch.long)
        self.tokens = torch.tensor([t for s in segments for t in s.tokens], dtype=torch.long)
        self.segment_ids = torch.repeat_interleave(torch.arange(len(segments)), lengths)
        arange = torch.arange(n, dtype=torch.long)
        self.position_ids = arange - offsets[self.segment_ids] + starts[self.segment_ids]
        # Within a segment the predecessor is the previous packed token; a segment's first token is
        # predicted by its parent's last token (which is not the previous packed token for later siblings).
        self.predecessor = arange - 1
        first_pred = torch.tensor(
            [
                segments[s.parent].offset + segments[s.parent].length - 1 if s.parent >= 0 else -1
                for s in segments
            ],
            dtype=torch.long,
        )
        self.predecessor[offsets] = first_pred
        self.fork_tokens = torch.tensor([s.offset for s in segments if s.parent >= 0], dtype=torch.long)
        self._indices_cache: dict[int, torch.Tensor] = {}

    @classmethod
    def build(cls, rollouts: Sequence[Rollout], *, vocab_size: int | None = None) -> PrefixTree:
        """Build the radix tree; children are in first-appearance order, so the result is deterministic."""
        rollouts = tuple(rollouts)
        if not rollouts:
            raise UserError("no rollouts to build a prefix tree from")
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0
        ):
            raise UserError(f"vocab_size must be a positive int, got {vocab_size!r}")
        for i, r in enumerate(rollouts):
            if not isinstance(r, Rollout):
                raise UserError(f"rollout {i}: expected a Rollout, got {type(r).__name__}")
            if vocab_size is not None:
                # Rollout itself validated ids >= 0; the vocabulary bound is known only here.
                validate_token_ids(r.prompt, name="prompt", where=f"rollout {i}", vocab_size=vocab_size)
                validate_token_ids(r.response, name="response", where=f"rollout {i}", vocab_size=vocab_size)

        root = _Node(())
        keyed = any(r.routed_experts is not None for r in rollouts)
        for i, r in enumerate(rollouts):
            _insert(root, _keys(r) if keyed else r.prompt + r.response, i)

        # Depth-first pre-order numbering, iteratively (deep chains must not hit the recursion limit).
        specs: list[dict] = []
        leaves = [-1] * len(rollouts)
        stack: list[tuple[_Node, int]] = [(c, -1) for c in reversed(root.children)]
        offset = 0
        while stack:
            node, parent = stack.pop()
            node.sid = len(specs)
            if parent >= 0:
                p = specs[parent]
                p["children"].append(node.sid)
                start, depth, ancestors = (
                    p["start_position"] + p["length"],
                    p["depth"] + 1,
                    p["ancestors"] + (parent,),
                )
            else:
                start, depth, ancestors = 0, 0, ()
            specs.append(
                dict(id=node.sid, parent=parent, children=[], depth=depth,
                     tokens=tuple(k[0] for k in node.tokens) if keyed else node.tokens,
                     start_position=start, offset=offset, length=len(node.tokens), ancestors=ancestors)
            )  # fmt: skip
            offset += len(node.tokens)
            for i in node.ends:
                leaves[i] = node.sid
            stack.extend((c, node.sid) for c in reversed(node.children))
        assert all(leaf >= 0 for leaf in leaves)
        segments = tuple(Segment(**{**spec, "children": tuple(spec["children"])}) for spec in specs)
        return cls(rollouts=rollouts, segments=segments, leaves=tuple(leaves))

    def with_rollouts(self, rollouts: Sequence[Rollout]) -> PrefixTree:
        """This tree for `rollouts` that hold the same token sequences in the same order (their advantages and
        per-token fields may differ: old/ref logprobs attached since): the structure is reused, not rebuilt."""
        rollouts = tuple(rollouts)
        assert len(rollouts) == len(self.rollouts) and all(
            a.prompt == b.prompt and a.response == b.response for a, b in zip(rollouts, self.rollouts)
        ), "with_rollouts needs the same token sequences"
        tree = copy.copy(self)  # segments, tensors and the structural caches are shared (they read no field)
        tree.rollouts = rollouts
        return tree

    # ---- per-rollout views -------------------------------------------------------------------------------

    def _check_rollout(self, i: int) -> None:
        if not 0 <= i < len(self.rollouts):
            raise IndexError(f"rollout index {i} out of range for {len(self.rollouts)} rollouts")

    def rollout_segments(self, i: int) -> tuple[int, ...]:
        """Root..leaf segment path of rollout i; its sequence ends exactly at the end of the last one."""
        self._check_rollout(i)
        leaf = self._leaves[i]
        return self.segments[leaf].ancestors + (leaf,)

    def rollout_indices(self, i: int) -> torch.Tensor:
        """Packed indices of all tokens of rollout i, in sequence order."""
        cached = self._indices_cache.get(i)
        if cached is None:
            segs = [self.segments[s] for s in self.rollout_segments(i)]
            cached = torch.cat([torch.arange(s.offset, s.offset + s.length) for s in segs])
            self._indices_cache[i] = cached
        return cached

    def response_indices(self, i: int) -> torch.Tensor:
        """Packed indices of rollout i's response tokens, in order."""
        return self.rollout_indices(i)[len(self.rollouts[i].prompt) :]

    def token_field(self, name: str, i: int) -> torch.Tensor:
        """float64 values of per-token field `name` of rollout i, aligned with `response_indices(i)`."""
        fields = self.rollouts[i].token_fields
        if name not in fields:
            raise UserError(f"rollout {i} has no token field {name!r} (has: {sorted(fields)})")
        return torch.tensor(fields[name], dtype=torch.float64)

    # ---- loss weights ------------------------------------------------------------------------------------

    def token_weights(
        self,
        per_rollout: Sequence[float] | torch.Tensor,
        dtype: torch.dtype = torch.float64,
        *,
        trained_only: bool = False,
    ) -> torch.Tensor:
        """[N]: w[t] = sum of per_rollout[i] over the rollouts i whose RESPONSE contains packed token t.

        Only response membership counts: a token that is prompt for one rollout and response for another gets
        only the latter's weight. Sums are exact slice additions in rollout order (no cumulative-sum
        cancellation error), so tokens in no response are exactly 0. `trained_only`: only the rollouts for which
        t is TRAINED (loss_mask 1) count; the same token may be trained for one rollout and context for another.
        """
        values = torch.as_tensor(per_rollout, dtype=dtype).flatten()
        if values.numel() != len(self.rollouts):
            raise UserError(
                f"token_weights needs one value per rollout ({len(self.rollouts)}), got {values.numel()}"
            )
        weights = torch.zeros(self.num_tokens, dtype=dtype)
        for i, r in enumerate(self.rollouts):
            if trained_only and r.loss_mask is not None:
                trained = torch.tensor(r.trained_positions(), dtype=torch.long)
                weights[self.response_indices(i)[trained]] += values[i]  # one rollout: indices are distinct
                continue
            response_start = len(r.prompt)  # logical position where the response begins
            for sid in self.rollout_segments(i):
                s = self.segments[sid]
                lo = max(s.start_position, response_start) - s.start_position
                if lo < s.length:
                    weights[s.offset + lo : s.offset + s.length] += values[i]
        return weights

    def response_counts(self) -> torch.Tensor:
        """[N] long: how many rollouts have packed token t in their response."""
        return self.token_weights(torch.ones(len(self.rollouts), dtype=torch.long), dtype=torch.long)

    def num_response_tokens_logical(self) -> int:
        """Sum of len(response): every response token, trained or context (loss_mask 0)."""
        return sum(len(r.response) for r in self.rollouts)

    def num_trained_tokens_logical(self) -> int:
        """Sum of the rollouts' trained response tokens (loss_mask 1): what token-mean losses divide by."""
        return sum(r.num_trained for r in self.rollouts)

    # ---- structure ---------------------------------------------------------------------------------------

    def attention_mask(self) -> torch.Tensor:
        """bool [N, N]: mask[q, k] iff token k is an ancestor-or-self of token q on q's path.

        Ancestor segments precede their descendants in the packed layout, so "ancestor-or-same segment"
        combined with the causal k <= q is exactly the rule (within a segment it is plain causality).
        """
        related = self.segment_relation()
        mask = related[self.segment_ids][:, self.segment_ids]
        return mask.tril_()

    def response_starts(self) -> tuple[int, ...]:
        """Per segment: the offset inside it of its first token that is a RESPONSE token of some rollout (its
        length when none is), computed once. A token is in some rollout's response iff its position id reaches the
        shortest prompt among the rollouts through its segment; only those tokens carry a loss or a logprob, so
        only their predecessors' rows need the output projection (schedule/chunks.py)."""
        if self._response_starts is None:
            shortest = [None] * len(self.segments)  # shortest prompt among the rollouts through each segment
            for i, r in enumerate(self.rollouts):
                for sid in self.rollout_segments(i):
                    if shortest[sid] is None or len(r.prompt) < shortest[sid]:
                        shortest[sid] = len(r.prompt)
            self._response_starts = tuple(
                min(s.length, max(0, shortest[s.id] - s.start_position)) for s in self.segments
            )
        return self._response_starts

    def segment_relation(self) -> torch.Tensor:
        """bool [S, S]: related[q, k] iff segment k is an ancestor of segment q or q itself (computed once).

        The token-level tree mask, the ring's block masks under context parallelism and the CP split all derive
        from this one relation.
        """
        if self._relation is None:
            num = len(self.segments)
            related = torch.eye(num, dtype=torch.bool)
            for s in self.segments:
                if s.ancestors:
                    related[s.id, list(s.ancestors)] = True
            self._relation = related
        return self._relation

    def unpack(self) -> list[tuple[int, ...]]:
        """Every rollout's full sequence rebuilt from the segments (round-trips exactly)."""
        return [
            tuple(t for sid in self.rollout_segments(i) for t in self.segments[sid].tokens)
            for i in range(len(self.rollouts))
        ]

    def subtree_segments(self, root: int) -> tuple[int, ...]:
        """Pre-order ids of the subtree at segment `root` (a contiguous id range)."""
        return tuple(range(root, root + self._subtree_size[root]))

    def num_tokens_of_root(self, root: int) -> int:
        """Computed positions in the subtree at `root` (for data-parallel balancing)."""
        return sum(self.segments[s].length for s in self.subtree_segments(root))

    def groups(self) -> list[tuple[int, ...]]:
        """Rollout indices grouped by root segment (prompt groups), in root order, ascending within a group."""
        by_root: dict[int, list[int]] = {r: [] for r in self.roots}
        for i in range(len(self.rollouts)):
            by_root[self.rollout_segments(i)[0]].append(i)
        return [tuple(by_root[r]) for r in self.roots]

    @property
    def max_depth(self) -> int:
        return max(s.depth for s in self.segments)

    def describe(self) -> str:
        ratio = self.positions_logical / self.positions_computed
        return (
            f"PrefixTree: {len(self.rollouts)} rollouts, {len(self.roots)} roots, {len(self.segments)} segments, "
            f"max depth {self.max_depth}; positions logical {self.positions_logical:,} / computed "
            f"{self.positions_computed:,} ({ratio:.2f}x)"
        )

    def __repr__(self) -> str:
        return f"<{self.describe()}>"
