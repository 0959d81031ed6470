"""The (rollout, response token) pairs of a prefix tree: the unit every per-token RL objective sums over.

Shape legend: P pairs (sum over rollouts of their scored, trained response tokens), m targets of a chunk, R rollouts.

A response token shared by k rollouts is ONE packed target but k loss terms, each with its own rollout's data
(advantage, old and reference logprob, return, aggregation weight). Binding builds, once per tree, the pairs in
rollout-major order (rollout i's pairs are the contiguous range start[i]:start[i+1], in response order) and
their order by packed token. A chunk's targets then find their pairs by two `searchsorted` calls (vectorised, no
table over the whole tree), and naive's rollout i finds its own by slicing: both evaluate the SAME per-pair
function on the same data, so the totals agree term by term.

A first response token of a rollout with an empty prompt has no predictor (no logprob anywhere): it has no pair.
A response token with loss_mask 0 for a rollout (context inside the response: a tool's output) has no pair for
that rollout either: no term of any objective, no count in any token mean. Masks are per rollout like advantages,
so a shared token may be a pair of one rollout and not of another; everything that sums over pairs (every
per-token objective, its metrics, objectives added later) is masked by construction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.errors import UserError


class TokenPairs:
    """Pair index of one tree (build once per bind)."""

    def __init__(self, tree: PrefixTree) -> None:
        rollout, token, position = [], [], []
        start = [0]
        for i, r in enumerate(tree.rollouts):
            idx = tree.response_indices(i)  # [len(response)] packed index of each response token
            j = torch.arange(len(r.response))
            if not r.prompt:  # nothing predicts the very first token
                idx, j = idx[1:], j[1:]
            if r.loss_mask is not None:  # context tokens (loss_mask 0) carry no term for this rollout
                keep = torch.tensor(r.loss_mask, dtype=torch.bool)[j]
                idx, j = idx[keep], j[keep]
            rollout.append(torch.full((j.numel(),), i, dtype=torch.long))
            token.append(idx)
            position.append(j)
            start.append(start[-1] + j.numel())
        self.tree = tree
        self.rollout = torch.cat(rollout)  # [P]
        self.token = torch.cat(token)  # [P] packed index
        self.position = torch.cat(position)  # [P] index of the token in its rollout's response (trained ones)
        prompt_len = torch.tensor([len(r.prompt) for r in tree.rollouts], dtype=torch.long)
        self.logical = prompt_len[self.rollout] + self.position - 1  # [P] row of naive's logp [L-1]
        self.start = start  # [R+1]
        self.sorted_token, self.order = torch.sort(self.token, stable=True)  # [P] by packed token

    @property
    def num_pairs(self) -> int:
        return int(self.token.numel())

    def in_chunk(self, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pair ids [q], row in `targets` of each [q]) for every pair whose token is among `targets` [m]."""
        targets = targets.cpu()
        lo = torch.searchsorted(self.sorted_token, targets, right=False)  # [m]
        hi = torch.searchsorted(self.sorted_token, targets, right=True)
        counts = hi - lo  # [m] rollouts whose response holds each target
        rows = torch.repeat_interleave(torch.arange(targets.numel()), counts)  # [q]
        first = torch.repeat_interleave(lo, counts)
        within = torch.arange(rows.numel()) - torch.repeat_interleave(
            torch.cumsum(counts, 0) - counts, counts
        )
        return self.order[first + within], rows

    def of_rollout(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(pair ids, row of naive's logp [L-1] of each) of rollout i, in response order."""
        pids = torch.arange(self.start[i], self.start[i + 1])
        return pids, self.logical[pids]

    def field(
        self, name: str, *, scalar: str | None = None, required: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(values [P] float64, present [P] bool) of per-token field `name` (else the rollout's scalar attribute
        `scalar`, broadcast). A rollout with neither: a UserError naming its file:line when `required`."""
        vals = torch.zeros(self.num_pairs, dtype=torch.float64)
        present = torch.zeros(self.num_pairs, dtype=torch.bool)
        for i, r in enumerate(self.tree.rollouts):
            sl = slice(self.start[i], self.start[i + 1])
            per_token = r.field(name)
            if per_token is not None:
                vals[sl] = torch.tensor(per_token, dtype=torch.float64)[self.position[sl]]
                present[sl] = True
            elif scalar is not None and getattr(r, scalar) is not None:
                vals[sl] = float(getattr(r, scalar))
                present[sl] = True
            elif required:
                what = f"{scalar!r} (or {name!r}, one per response token)" if scalar else repr(name)
                raise UserError(f"missing field {what}", where=r.describe(i))
        return vals, present

    def rollout_values(self, values: torch.Tensor) -> torch.Tensor:
        """[P] the per-rollout `values` [R] broadcast to every pair."""
        return values.to(torch.float64)[self.rollout]


Terms = Callable[
    [torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor]], tuple[torch.Tensor, list[torch.Tensor]]
]
"""(x [q], entropy [q] | None, data {name: [q]}) -> (loss per pair [q], one [q] tensor per stat)."""


class PairBound:
    """A per-token objective bound to one tree: sum over pairs of weight * terms(x, entropy, data).

    `stat_kinds[k]` says how stat k is averaged: "agg" with the loss's aggregation weight, "token" as a token
    mean over the global batch (1 / total response tokens).
    """

    def __init__(
        self,
        pairs: TokenPairs,
        *,
        data: dict[str, torch.Tensor],
        weight: torch.Tensor,
        token_weight: float,
        terms: Terms,
        needs_entropy: bool,
        stat_names: tuple[str, ...],
        stat_kinds: tuple[str, ...],
    ) -> None:
        assert len(stat_names) == len(stat_kinds)
        self.pairs, self.data, self.weight, self.token_weight = pairs, data, weight, token_weight
        self.terms, self.needs_entropy = terms, needs_entropy
        self.stat_names, self.stat_kinds = stat_names, stat_kinds

    def chunk_loss(
        self, logp: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pids, rows = self.pairs.in_chunk(targets)
        return self._loss(pids, rows, logp, entropy)

    def rollout_loss(
        self, i: int, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pids, rows = self.pairs.of_rollout(i)
        return self._loss(pids, rows, logp, entropy)

    def _loss(
        self, pids: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, entropy: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dev, dt = x.device, x.dtype
        rows_d = rows.to(dev)
        data = {
            k: v[pids].to(device=dev, dtype=v.dtype if v.dtype == torch.bool else dt)
            for k, v in self.data.items()
        }
        ent = entropy.index_select(0, rows_d) if entropy is not None else None
        per, stats = self.terms(x.index_select(0, rows_d), ent, data)  # [q], K x [q]
        w = self.weight[pids]  # [q] float64
        loss = (w.to(device=dev, dtype=dt) * per).sum()
        out = [
            (s.detach().to("cpu", torch.float64) * (w if kind == "agg" else self.token_weight)).sum()
            for s, kind in zip(stats, self.stat_kinds)
        ]
        return loss, torch.stack(out) if out else torch.zeros(0, dtype=torch.float64)
