"""Sliding-window attention in THE plan: which rows of a (query run, key run) pair the window cuts, and how.

SHAPE LEGEND (positions only; nothing here holds activations):
    m, n      rows of a query run, keys of a key run (run-local rows i in [0, m), columns c in [0, n))
    P, J      PATH positions of the query run's first row and the key run's first key: a token's index along its
              own root-to-leaf path (0 at the root's first token), the index the rollout's naive sequence has;
              siblings share positions, tree (row) order does not enter
    d = P - J position difference of the two runs' first tokens
    W         the window: a query at path position p sees a key at path position j iff 0 <= p - j < W
              (transformers' `sliding_window_overlay`: kv_idx > q_idx - sliding_window, on top of causal)

On a root-to-leaf path the tree rule already gives "ancestor keys in full, own keys causally" (attention/plan.py);
the window only removes keys further back than W - 1 positions. Run-local, row i sees columns
    [lo(i), hi(i))  with  lo(i) = clamp(i + d - W + 1, 0, n),  hi(i) = clamp(i + d + 1, 0, n)
(an ancestor run has d >= n, so hi = n). Rows split into three ranges:
    rows [0, a)   lo = 0: the window reaches back past the run's first key; the unwindowed shapes (a full
                  rectangle, or plan.py's full + causal square of its own segment) restricted to these rows;
    rows [a, e)   the window's edge crosses the run: BANDS, tiles of at most W rows over the columns the tile's
                  rows see, each run as one small masked call (row i' sees column c' iff 0 <= i' - c' + shift < W);
    rows [e, m)   the whole run lies outside the window: nothing (the key blocks they would read are skipped).
So a branch whose window does not reach its ancestors computes nothing over them; work is W per row, at most 2W
computed per band row (`Band.cols` <= tile + W - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, kw_only=True)
class Band:
    """Query rows [row, row + rows) over key columns [col, col + cols) of key block `block`, local row i seeing
    local column c iff 0 <= i - c + shift < window: the edge of a sliding window, one small masked call."""

    row: int
    rows: int
    block: int
    col: int
    cols: int
    shift: int
    window: int

    def mask(self, device: torch.device | str | None = None) -> torch.Tensor:
        """bool [rows, cols], True = visible."""
        i = torch.arange(self.rows, device=device).unsqueeze(1)  # [rows, 1]
        c = torch.arange(self.cols, device=device).unsqueeze(0)  # [1, cols]
        diff = i - c + self.shift  # [rows, cols]: path position of the row minus that of the key
        return (diff >= 0) & (diff < self.window)

    @property
    def visible_pairs(self) -> int:
        return int(self.mask().sum())


def split_rows(m: int, n: int, d: int, window: int) -> tuple[int, int]:
    """(a, e): rows [0, a) are unwindowed, rows [a, e) are band rows, rows [e, m) see nothing of the run."""
    a = min(max(window - d, 0), m)
    e = min(max(n + window - 1 - d, a), m)
    return a, e


def band_tiles(
    row0: int, col0: int, a: int, e: int, n: int, d: int, window: int
) -> list[tuple[int, int, int, int, int]]:
    """Band rows [a, e) of a run pair (query run's first row at global row row0, key run's first column at global
    column col0) -> [(global row, rows, global col, cols, shift)], tiles of at most `window` rows."""
    tiles = []
    for r in range(a, e, window):
        r2 = min(r + window, e)
        lo = min(max(r + d - window + 1, 0), n)  # first key the tile's first row sees
        hi = min(max(r2 - 1 + d + 1, 0), n)  # one past the last key the tile's last row sees
        tiles.append((row0 + r, r2 - r, col0 + lo, hi - lo, r + d - lo))
    return tiles
