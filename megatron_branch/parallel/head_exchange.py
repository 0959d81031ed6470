"""The head exchange: context parallelism for a layer whose heads are independent along the whole sequence (the gated
delta net layers of the hybrids), by two all-to-alls over the CP group.

SHAPE LEGEND (one TP rank's heads; W the CP group's size, r this rank):
    s      rows of the UNSPLIT chunk: its real tokens in tree order (the chunk's segments end to end)
    s_loc  rows each CP rank holds: its zigzag share of every segment, padded (parallel/cp_layout.py)
    c      channels of ONE head block (which channels a block holds is the layer's business: models/gdn_heads.py)
    rows   [W, s_loc] long: the unsplit row of every rank's local rows (-1 = padding; cp_layout.zigzag_rows)
    to_tree    x [s_loc, W, c] (this rank's rows, block j bound for rank j)  ->  [s, c] (every row, block r)
    to_ranks   y [s, c] (every row, block r)  ->  [s_loc, W, c] (this rank's rows, block j from rank j; padding 0)

Why: a recurrent layer (the delta rule's state, the causal conv) needs every earlier position of a row's path, which
under CP lives on other ranks. Its heads, though, are independent. So the first all-to-all trades this rank's
share of the positions of ALL its heads for ALL positions of a W-th of its heads; the layer then runs its
single-rank tree code unchanged over the whole chunk for those heads (each segment from its parent's state), and
the second all-to-all trades back. Exact (the same per-head computation as CP1), and the recurrent work divides by
W. megatron-core's Mamba context parallelism (ssm/mamba_context_parallel.py: `_all_to_all_cp2hp`, the undo of the
attention load balancing, `_all_to_all_hp2cp`) makes the same trade for Mamba heads over a plain sequence; here the
un-permutation is the tree chunk's zigzag row map instead of a fixed reordering of 2W pieces.

Traffic per layer and chunk (forward; backward the same again): each rank sends (W-1)/W of its [s_loc, W c] input
and of its [s, c] output, i.e. (W-1) s_loc c elements each way (plan/activations.py counts it; `RingStats` counts it).

The all-to-all is in ring-flash-attention's shape: plain `all_to_all_forward` / `all_to_all_backward` functions
and a thin autograd.Function. An all-to-all of equal blocks is its own transpose (rank i's block j becomes rank j's
block i, and the adjoint sends it back the same way), so backward is the same exchange of the gradient blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.parallel.ring import RingStats


def all_to_all_forward(x: torch.Tensor, group: Any) -> torch.Tensor:
    """x [W, ...] (block j bound for rank j) -> [W, ...] (block i received from rank i)."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def all_to_all_backward(dy: torch.Tensor, group: Any) -> torch.Tensor:
    """The adjoint of `all_to_all_forward`: the same exchange, of the gradient blocks (module docstring)."""
    return all_to_all_forward(dy, group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # noqa: ANN401
        ctx.group = group
        return all_to_all_forward(x, group)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN401
        return all_to_all_backward(dy, ctx.group), None


class CPHeadExchange:
    """The head exchange of one chunk's forward over `group` (the chunk's CP group, passed in; see the module
    docstring). The row map is built on first use (only a layer that exchanges needs it) and kept for the chunk's
    other layers and a layer checkpoint's recomputation."""

    def __init__(
        self,
        *,
        group: Any,
        size: int,
        rank: int,
        num_rows: int,
        rows: Callable[[], torch.Tensor],
        device: torch.device,
        stats: RingStats | None = None,
    ) -> None:
        self.group, self.size, self.rank, self.num_rows = group, size, rank, num_rows
        self.device, self.stats = device, stats
        self._rows_of = rows
        self._rows: torch.Tensor | None = None
        self._order: torch.Tensor | None = None

    @property
    def rows(self) -> torch.Tensor:
        """[W, s_loc] long: the unsplit row of every rank's local rows (-1 = padding)."""
        if self._rows is None:
            rows = self._rows_of().to(self.device)
            assert rows.shape[0] == self.size, (rows.shape, self.size)
            self._rows = rows
        return self._rows

    @property
    def order(self) -> torch.Tensor:
        """[s] long: where each unsplit row sits among the received [W * s_loc] rows (`rows` inverted)."""
        if self._order is None:
            self._order = self._tree_order()
        return self._order

    def _tree_order(self) -> torch.Tensor:
        flat = self.rows.reshape(-1)  # [W * s_loc]: rank-major, as the all-to-all delivers them
        real = (flat >= 0).nonzero().squeeze(1)
        order = torch.full((self.num_rows,), -1, dtype=torch.long, device=self.device)
        order[flat[real]] = real
        assert bool((order >= 0).all()), "every row of the chunk is held by exactly one CP rank"
        return order

    def to_tree(self, x: torch.Tensor) -> torch.Tensor:
        """x [s_loc, W, c] -> [s, c]: every row of the chunk in tree order, this rank's block."""
        s_loc, w, c = x.shape
        assert w == self.size and s_loc == self.rows.shape[1], (x.shape, self.rows.shape)
        got = self._exchange(x.transpose(0, 1))  # [W, s_loc, c]: rank i's rows of this rank's block
        return got.reshape(w * s_loc, c).index_select(0, self.order)

    def to_ranks(self, y: torch.Tensor) -> torch.Tensor:
        """y [s, c] -> [s_loc, W, c]: this rank's rows, block j from rank j (padding rows 0)."""
        s, c = y.shape
        assert s == self.num_rows, (y.shape, self.num_rows)
        rows = self.rows  # [W, s_loc]
        send = y.index_select(0, rows.clamp(min=0).reshape(-1)).reshape(*rows.shape, c)  # [W, s_loc, c]
        send = torch.where((rows >= 0)[..., None], send, torch.zeros((), dtype=y.dtype, device=y.device))
        return self._exchange(send).transpose(0, 1)  # [s_loc, W, c]

    def _exchange(self, blocks: torch.Tensor) -> torch.Tensor:
        if self.stats is not None:
            sent = blocks[0].numel() * blocks.element_size() * (self.size - 1)  # blocks stay home for rank r
            self.stats.exchange_messages += self.size - 1
            self.stats.exchange_bytes += sent
        return _AllToAll.apply(blocks, self.group)
