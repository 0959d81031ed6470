"""Split one chunk of the prefix tree over the ranks of a context-parallel group (zigzag per segment).

SHAPE LEGEND (positions only; sequence-first like Megatron):
    s      rows of the unsplit chunk (its real tokens, `Chunk.token_index`)
    s_loc  rows held by one CP rank (equal on every rank: zigzag pieces are padded to equal length)
    meta   [2, s_loc] long: row 0 tree segment id (-1 = padding), row 1 offset of the token inside its segment
    m_loc  targets whose PREDECESSOR row this rank holds

Load balance for causal attention (zigzag, as ring-flash-attention's zigzag_ring_flash_attn and megatron-core's
`get_batch_on_this_cp_rank`): each segment's tokens are cut into 2*cp equal pieces (the last ones padded when the
length does not divide), rank r takes pieces r and 2cp-1-r, so every rank gets one early and one late piece of every
segment and the same amount of causal work. Padding tokens carry segment id -1: the ring's mask hides them from
every query and gives their own rows no key, so they never change a result. Position ids travel with the tokens
(RoPE uses them directly), so the reordering needs no RoPE slicing.

Targets: a target token is predicted by the row of its predecessor; the rank holding that row computes its logprob.
A fork token (first token of a child segment) is therefore handled where the parent's LAST token lives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.errors import UserError

if TYPE_CHECKING:  # runtime import would be circular (schedule.common imports this module)
    from megatron_branch.schedule.chunks import Chunk


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


def tree_related(tree: PrefixTree) -> torch.Tensor:
    """[S, S] bool: related[q, k] iff segment k is an ancestor of segment q or q itself (the tree's own relation)."""
    return tree.segment_relation()


def zigzag_offsets(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """Offsets inside a segment of `length` tokens that rank `cp_rank` holds, pieces r and 2cp-1-r; -1 = padding.

    Every rank gets 2 * ceil(length / 2cp) entries.
    """
    piece = -(-length // (2 * cp_size))
    first = torch.arange(cp_rank * piece, (cp_rank + 1) * piece)
    second = torch.arange((2 * cp_size - 1 - cp_rank) * piece, (2 * cp_size - cp_rank) * piece)
    offs = torch.cat([first, second])  # [2 * piece]
    return torch.where(offs < length, offs, torch.full_like(offs, -1))


def split_chunk(
    tree: PrefixTree, chunk: Chunk, cp_size: int, cp_rank: int, *, pad_to_multiple: int = 1
) -> CPChunk:
    """Rank `cp_rank`'s share of `chunk` (built WITHOUT padding); local rows padded to `pad_to_multiple` (SP: tp)."""
    from megatron_branch.schedule.chunks import lookup  # here: schedule imports this module

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

    # unsplit chunk row of every packed index (chunk rows follow chunk.token_index)
    rows = torch.where(real, lookup(chunk.token_index, token_index), torch.full_like(seg, -1))  # [s_loc]
    assert bool((rows[real] >= 0).all()), "a local token is not in the chunk"

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


def check_cp_fits(tree: PrefixTree, cp_size: int) -> None:
    """Refuse (UserError) a CP size under which some CP rank would hold no real token in the whole step.

    Why this rule: nothing BREAKS when a rank holds only padding (the ring gives padding rows no key and hides them
    from every query, and a rank with no target back-propagates a zero loss; tests/distributed cover a 2-token tree
    on 4 ranks), but such a rank only pays for the ring and computes nothing: a layout that cannot be meant.
    Zigzag gives rank r a real token of a segment of length L iff L > r * ceil(L / 2cp), which for the LAST rank
    (cp-1, the hardest to fill) holds iff L >= cp. Every chunk of every schedule is a set of whole segments, so
    every rank computes something in the step iff the tree's longest segment has at least cp tokens.
    """
    if cp_size <= 1:
        return
    longest = max((s.length for s in tree.segments), default=0)
    if longest < cp_size:
        raise UserError(
            f"--cp {cp_size} is larger than the tokens allow: the longest prefix-tree segment has {longest} "
            f"tokens, so context-parallel rank {cp_size - 1} would hold no real token (use --cp <= {longest})"
        )
