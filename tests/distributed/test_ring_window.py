"""Sliding windows and attention sinks (gpt-oss) through the ring under context parallelism.

    python tests/distributed/launch.py 2 -k ring_window

Every rank builds the same tree and tensors (seeded) and runs the one-rank attention (tests/unit/test_window_sink.py
holds it to transformers' gpt_oss eager attention) unsplit; the ring's rows, dq/dk/dv and the sink's gradient (each
rank's share, summed over the CP group as the gradient finaliser does) equal it in float64. Layers of two windows
alternate over ONE chunk's `RingPlans` (gpt-oss alternates sliding and full layers): each window plans once, the
key metadata travels once. Planted: the sink merged at every ring step (not once per row) fails.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from test_ring_cp import _local_keys, _take

from megatron_branch.attention.dispatch import attention, executor
from megatron_branch.attention.merge import add_sink
from megatron_branch.data import PrefixTree
from megatron_branch.parallel import ring as ring_mod
from megatron_branch.parallel.cp_layout import tree_related
from megatron_branch.parallel.ring import RingPlans, RingStats, ring_tree_attention
from megatron_branch.schedule.chunks import make_chunk, split_chunk
from megatron_branch.testing import random_tree_rollouts


def _sink(n: int) -> torch.Tensor:
    """The learned sink logits [n] of the test (one per query head)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(5), dtype=torch.float64)


def _ring_vs_one_rank(backend: str, external: bool) -> float:
    """Worst |ring - one rank| over outputs and gradients (dsink summed over CP), layers of windows 3, None, 3
    over one chunk's RingPlans."""
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    rs = random_tree_rollouts(groups=2, prompt_len=6, branches=3, levels=3, seg_len=(1, 6), seed=1)
    tree = PrefixTree.build(rs, vocab_size=37)
    if external:  # replay-like: the children of a depth-2 segment against its cached path
        parent = next(s for s in tree.segments if s.depth == 2 and s.children)
        ext, segs = parent.ancestors + (parent.id,), list(parent.children)
    else:
        ext, segs = (), list(range(len(tree.segments)))
    chunk = make_chunk(tree, segs, external=ext)
    layout = chunk.layout
    sq, sk, n, g, h = layout.num_queries, layout.num_keys, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(s, 1, x, h, generator=gen, dtype=torch.float64) for s, x in ((sq, n), (sk, g), (sk, g))
    )
    sink = _sink(n)
    dout = torch.randn(sq, 1, n * h, generator=gen, dtype=torch.float64)
    seg_start = torch.tensor([s.start_position for s in tree.segments])
    part = split_chunk(tree, chunk, cp, rank, pad_to_multiple=2)
    k_meta, k_idx = _local_keys(tree, ext, part, cp, rank)
    real, kreal = part.rows >= 0, k_idx >= 0
    plans, stats = RingPlans(), RingStats()
    worst = 0.0
    for window in (3, None, 3):  # alternating layers over one chunk's plans
        ref_in = [x.clone().requires_grad_() for x in (q, k, v, sink)]
        ref = attention(
            *ref_in[:3], layout, backend="reference", scale=h**-0.5, window=window, sink=ref_in[3]
        )
        ref.backward(dout)
        ql, kl, vl = (_take(x, idx).requires_grad_() for x, idx in ((q, part.rows), (k, k_idx), (v, k_idx)))
        sl = sink.clone().requires_grad_()
        out = ring_tree_attention(
            ql, kl, vl, part.meta, k_meta, tree_related(tree), h**-0.5, group,
            executor=executor(backend), stats=stats, plans=plans, window=window, seg_start=seg_start, sink=sl,
        )  # fmt: skip
        out.backward(_take(dout, part.rows))
        d_sink = sl.grad.clone()
        dist.all_reduce(d_sink, group=group)  # each rank's rows' share, summed over CP
        pairs = [
            (out[real], ref.detach()[part.rows[real]]),
            (ql.grad[real], ref_in[0].grad[part.rows[real]]),
            (kl.grad[kreal], ref_in[1].grad[k_idx[kreal]]),
            (vl.grad[kreal], ref_in[2].grad[k_idx[kreal]]),
            (d_sink, ref_in[3].grad),
        ]
        worst = max(worst, *((a - b).abs().max().item() for a, b in pairs))
    assert set(plans.by_window) == {3, None} and len(plans.metas) == cp
    return worst


@pytest.mark.world(2)
@pytest.mark.parametrize("backend,external", [("merge", False), ("merge", True), ("packed", True)])
def test_ring_window_and_sink_equal_one_rank(backend: str, external: bool) -> None:
    worst = _ring_vs_one_rank(backend, external)
    assert worst < 1e-11, worst


@pytest.mark.world(2)
def test_ring_planted_sink_per_step_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planted: the sink merged into every ring step's merge as well (counted per step, not once per row)."""
    real = ring_mod.lse_merge

    def per_step(out, lse, o, lo):  # noqa: ANN001, ANN202
        merged = real(out, lse, o, lo)
        return add_sink(*merged, _sink(lse.shape[-1]))

    monkeypatch.setattr(ring_mod, "lse_merge", per_step)
    assert _ring_vs_one_rank("merge", False) > 1e-3
