"""The prefix-state seam is real: a layer KIND defined in this file alone (a toy recurrent mixer with a causal conv,
the shape of the gated delta net's state at the fork) trains exactly through replay and packed, with no package
change, next to attention layers (a hybrid model in miniature).

The toy mixer hands down (h after the segment's last token [b, d], the conv's last K-1 inputs [b, K-1, d]); a child
continues from its DIRECT parent's state only (`reads="parent"`), and the gradient every child sends into it is
summed and back-propagated once through the parent by replay's one bookkeeping (schedule/prefix_cache.py), exactly
like dK/dV. Float64 against the naive per-rollout schedule, per parameter; planted bugs: a child reading a zeroed
state, and a child whose gradient into the state is dropped.
"""

from __future__ import annotations

import pytest
import torch

from megatron_branch.attention.context import TakesBranchContext
from megatron_branch.attention.prefix_state import CACHED, ChunkSegment, StateKind
from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.schedule import ScheduleOptions, run_schedule, score_rollouts
from megatron_branch.testing import random_tree_rollouts

VOCAB, D, K = 29, 8, 3  # vocabulary, width, conv kernel
TOY = StateKind(name="toy-recurrent", reads="parent", per_row=False)
"""The new kind, defined here: the state at the fork, read by the direct children only."""


class ToyRecurrent(torch.nn.Module, TakesBranchContext):
    """u = causal conv_K(x); h_t = a * h_{t-1} + u_t W_in; y = h W_out (x, y [s, b, D]). Hands down (h_last, tail)."""

    zero_parent_state = False  # planted bug: a child reads zeros instead of its parent's state
    detach_parent_state = False  # planted bug: a child's gradient into its parent's state is dropped

    def __init__(self, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.conv = torch.nn.Parameter(torch.randn(K, D, dtype=torch.float64) * 0.5)
        self.decay = torch.nn.Parameter(torch.rand(D, dtype=torch.float64) * 0.8)
        self.w_in = torch.nn.Parameter(torch.randn(D, D, dtype=torch.float64) * 0.3)
        self.w_out = torch.nn.Parameter(torch.randn(D, D, dtype=torch.float64) * 0.3)

    def _initial(self, seg: ChunkSegment, states: dict, b: int):  # noqa: ANN202
        if seg.parent is None:  # a root: zero state, zero conv history
            return torch.zeros(b, D, dtype=torch.float64), torch.zeros(b, K - 1, D, dtype=torch.float64)
        if seg.parent != CACHED:  # the parent ran earlier in this chunk (packed)
            return states[seg.parent]
        ((h, tail),) = self.context.handed_down(
            self.layer_number
        )  # the DIRECT parent's state, from the cache
        if self.zero_parent_state:
            return torch.zeros_like(h), torch.zeros_like(tail)
        if self.detach_parent_state:
            return h.detach(), tail.detach()
        return h, tail

    def _segment(self, x: torch.Tensor, h: torch.Tensor, tail: torch.Tensor):  # noqa: ANN202
        """x [L, b, D] from state (h [b, D], tail [b, K-1, D]) -> (y [L, b, D], h_last, new tail)."""
        full = torch.cat([tail.transpose(0, 1), x])  # [K-1+L, b, D]
        L = x.shape[0]
        u = sum(self.conv[j] * full[K - 1 - j : K - 1 - j + L] for j in range(K))  # [L, b, D]
        hs = []
        for t in range(L):
            h = self.decay * h + u[t] @ self.w_in
            hs.append(h)
        return torch.stack(hs) @ self.w_out, h, full[-(K - 1) :].transpose(0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        ctx = self.context
        segs = (ChunkSegment(0, s, None),) if ctx is None else ctx.tree.segments  # naive: one sequence
        out = torch.zeros_like(x)  # rows in no segment (padding) stay 0
        states: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, seg in enumerate(segs):
            y, h, tail = self._segment(x[seg.start : seg.end], *self._initial(seg, states, b))
            out = out.index_copy(0, torch.arange(seg.start, seg.end), y)
            states[i] = (h, tail)
        if ctx is not None and ctx.capture:  # replay caches one segment per captured chunk
            assert len(segs) == 1
            ctx.hand_down(self.layer_number, TOY, states[0])
        return out


class ToyAttention(torch.nn.Module, TakesBranchContext):
    """Plain attention through the attached context (the engine's executors), causal softmax without one."""

    def __init__(self, layer_number: int, n: int = 4, g: int = 2) -> None:
        super().__init__()
        self.layer_number, self.n, self.g, self.h = layer_number, n, g, D // n * 2
        self.q = torch.nn.Linear(D, n * self.h, dtype=torch.float64)
        self.kv = torch.nn.Linear(D, 2 * g * self.h, dtype=torch.float64)
        self.o = torch.nn.Linear(n * self.h, D, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        q = self.q(x).view(s, b, self.n, self.h)
        k, v = self.kv(x).view(s, b, 2, self.g, self.h).unbind(2)
        scale = self.h**-0.5
        if self.context is not None:
            return self.o(self.context.attend(self.layer_number, q, k, v, scale))
        r = self.n // self.g
        att = torch.einsum("qbgrh,kbgh->bgrqk", q.view(s, b, self.g, r, self.h), k) * scale
        att = att.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
        return self.o(torch.einsum("bgrqk,kbgh->qbgrh", att, v).reshape(s, b, -1))


class ToyHybrid(torch.nn.Module):
    """embed -> recurrent -> attention -> recurrent (residual) -> logits; megatron's call shape (ids, pos, mask)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = torch.nn.Embedding(VOCAB, D, dtype=torch.float64)
        self.mixers = torch.nn.ModuleList([ToyRecurrent(1), ToyAttention(2), ToyRecurrent(3)])
        self.head = torch.nn.Linear(D, VOCAB, dtype=torch.float64)

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, mask: object) -> torch.Tensor:
        x = self.embed(ids[0])[:, None]  # [s, 1, D]
        for m in self.mixers:
            x = x + m(x)
        return self.head(x).transpose(0, 1)  # [1, s, v]


def _step(
    model: ToyHybrid, tree: PrefixTree, schedule: str, **kw: object
) -> tuple[float, dict[str, torch.Tensor]]:
    obj = PolicyGradientObjective.grpo(
        [r.advantage for r in tree.rollouts], tree.num_response_tokens_logical()
    )
    model.zero_grad(set_to_none=True)
    res = run_schedule(
        schedule, model, tree, obj, ScheduleOptions(vocab_size=VOCAB, **{"chunk_tokens": None, **kw})
    )
    return res.loss, {n: p.grad.clone() for n, p in model.named_parameters()}


def _close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    for name, g in want.items():
        err = ((got[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err <= tol, f"{name}: relative error {err:.2e} > {tol}"


@pytest.fixture(scope="module")
def case() -> tuple[ToyHybrid, PrefixTree, tuple[float, dict[str, torch.Tensor]]]:
    tree = PrefixTree.build(
        random_tree_rollouts(vocab_size=VOCAB, levels=2, branches=3, seed=4), vocab_size=VOCAB
    )
    assert (
        max(s.depth for s in tree.segments) == 2
    )  # grandchildren: the state must come from the DIRECT parent
    model = ToyHybrid()
    return model, tree, _step(model, tree, "naive")


@pytest.mark.parametrize(
    "schedule,kw",
    [
        ("packed", {}),
        ("replay", {}),
        ("replay", {"branch_micro_batch": 1}),
        ("replay", {"recompute": True}),
        ("replay", {"backend": "reference"}),
    ],
)
def test_new_layer_kind_is_exact_through_the_schedules(case, schedule: str, kw: dict) -> None:  # noqa: ANN001
    model, tree, (loss, grads) = case
    got_loss, got = _step(model, tree, schedule, **kw)
    assert got_loss == pytest.approx(loss, rel=1e-12)
    _close(got, grads, 1e-9)


def test_new_layer_kind_scores_like_naive(case) -> None:  # noqa: ANN001
    model, tree, _ = case
    want = score_rollouts("naive", model, tree, ScheduleOptions(vocab_size=VOCAB))
    for schedule in ("packed", "replay"):
        got = score_rollouts(schedule, model, tree, ScheduleOptions(vocab_size=VOCAB, chunk_tokens=None))
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=0, equal_nan=True)


@pytest.mark.parametrize("bug", ["zero_parent_state", "detach_parent_state"])
def test_planted_bug_in_the_handed_down_state_is_caught(
    case, bug: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # noqa: ANN001
    """A child reading zeros (wrong forward) or dropping its gradient into the parent's state (wrong backward):
    replay's gradient is then clearly wrong; packed, which never hands a state down, is untouched."""
    model, tree, (_, grads) = case
    monkeypatch.setattr(ToyRecurrent, bug, True)
    _, packed = _step(model, tree, "packed")
    _close(packed, grads, 1e-9)
    _, bad = _step(model, tree, "replay")
    with pytest.raises(AssertionError, match="relative error"):
        _close(bad, grads, 1e-3)  # not a rounding-level difference
