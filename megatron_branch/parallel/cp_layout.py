"""The zigzag layout of a chunk over the ranks of a context-parallel group (schedule/chunks.py `split_chunk` cuts it).

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

from collections.abc import Sequence

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.errors import UserError


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


def zigzag_rows(
    lengths: Sequence[int], cp_size: int, cp_rank: int, *, pad_to_multiple: int = 1
) -> torch.Tensor:
    """[s_loc] row of the UNSPLIT chunk (segments of `lengths` end to end, no padding) that each of rank
    `cp_rank`'s local rows holds, -1 = padding: each segment's zigzag pieces in chunk order, then the padding that
    makes s_loc a multiple of `pad_to_multiple` (the same on every rank). schedule/chunks.py `split_chunk` cuts a
    chunk by it, and the head exchange of a gated delta net layer (parallel/head_exchange.py) reads every rank's."""
    parts, start = [], 0
    for length in lengths:
        offs = zigzag_offsets(length, cp_size, cp_rank)
        parts.append(torch.where(offs >= 0, offs + start, offs))
        start += length
    rows = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
    extra = -rows.numel() % pad_to_multiple
    return torch.cat([rows, torch.full((extra,), -1, dtype=torch.long)])


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
