"""attention/plan.py and plan_sources.py: THE visibility plan of the tree mask (one planner, two sources), and an
executor running it block by block as the ring does.

The plans are checked against the dense rule (small sizes only: the dense mask is the slow reference here), every
visible pair exactly once, for zigzag CP splits of random trees with cached ancestors and for single-rank layouts;
the merge executor's forward over two key blocks merged by lse and its merged-LSE backward against float64 autograd
through the reference attention.
"""

from __future__ import annotations

import pytest
import torch

from megatron_branch.attention.merge import lse_merge
from megatron_branch.attention.merge_executor import merge_backward, merge_forward
from megatron_branch.attention.plan import BlockPlan, plan_block, runs_from_meta
from megatron_branch.attention.plan_sources import (
    ancestors_from_related,
    meta_sees,
    plan_from_layout,
    plan_from_meta,
)
from megatron_branch.attention.reference import reference_attention
from megatron_branch.data import PrefixTree
from megatron_branch.parallel.cp_layout import tree_related
from megatron_branch.schedule.chunks import make_chunk, split_chunk
from megatron_branch.testing import random_tree_rollouts


def _dense_rule(q_meta: torch.Tensor, k_meta: torch.Tensor, related: torch.Tensor) -> torch.Tensor:
    """[sq, sk] bool from the per-token rule (the former ring `_block_mask`): the slow reference."""
    qs, qo, ks, ko = q_meta[0], q_meta[1], k_meta[0], k_meta[1]
    real = (qs >= 0)[:, None] & (ks >= 0)[None, :]
    rel = related[qs.clamp(min=0)][:, ks.clamp(min=0)]
    causal = (qs[:, None] != ks[None, :]) | (ko[None, :] <= qo[:, None])
    return real & rel & causal


def _coverage(plan: BlockPlan, sq: int, sk: int) -> torch.Tensor:
    """[sq, sk] int: how many calls of the plan cover each pair (must be the mask, as 0/1)."""
    cov = torch.zeros(sq, sk, dtype=torch.long)
    starts = plan.block_starts()
    for grp in plan.full:
        for a, e in grp.rows:
            for p in grp.pieces:
                cov[a:e, starts[p.block] + p.start : starts[p.block] + p.end] += 1
    for run in plan.causal:
        n = run.size
        for i in range(run.count):
            r, c = run.row + i * n, starts[run.block] + run.col + i * n
            cov[r : r + n, c : c + n] += torch.ones(n, n, dtype=torch.long).tril()
    for band in plan.bands:  # a sliding window's edges (tests/unit/test_window_sink.py), by their own mask
        c = starts[band.block] + band.col
        cov[band.row : band.row + band.rows, c : c + band.cols] += band.mask().long()
    return cov


def _trees() -> list[PrefixTree]:
    out = []
    for seed, (levels, branches, seg) in enumerate([(1, 3, (1, 9)), (2, 3, (2, 13)), (3, 2, (1, 6))]):
        rs = random_tree_rollouts(
            groups=2, prompt_len=11 + seed, branches=branches, levels=levels, seg_len=seg, seed=seed
        )
        out.append(PrefixTree.build(rs, vocab_size=37))
    return out


def _rank_keys(
    tree: PrefixTree, external: tuple[int, ...], segs: list[int], cp: int, rank: int
) -> torch.Tensor:
    """[2, sk] metadata of rank `rank`'s keys: its shards of the cached ancestors, then its chunk rows."""
    metas = [
        split_chunk(tree, make_chunk(tree, [a], external=tree.segments[a].ancestors), cp, rank).meta
        for a in external
    ]
    metas.append(split_chunk(tree, make_chunk(tree, segs, external=external), cp, rank).meta)
    return torch.cat(metas, dim=1)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_plans_cover_the_tree_mask_exactly_once(cp: int) -> None:
    checked = 0
    for tree in _trees():
        related = tree_related(tree)
        cases = [((), list(range(len(tree.segments))))]  # packed
        for s in tree.segments:  # replay: every inner segment's children against the cached path
            if s.children:
                cases.append((s.ancestors + (s.id,), list(s.children)))
        for external, segs in cases:
            chunk = make_chunk(tree, segs, external=external)
            for qr in range(cp):
                q_meta = split_chunk(tree, chunk, cp, qr, pad_to_multiple=2).meta
                for kr in range(cp):
                    k_meta = _rank_keys(tree, external, segs, cp, kr)
                    plan = plan_from_meta(q_meta, k_meta, related)
                    want = _dense_rule(q_meta, k_meta, related)
                    cov = _coverage(plan, q_meta.shape[1], k_meta.shape[1])
                    assert torch.equal(cov, want.long()), (cp, qr, kr, external, segs)
                    assert plan.empty == (not bool(want.any()))
                    assert plan.visible_pairs == int(want.sum())
                    for run in plan.causal:  # the fused causal kernel needs squares
                        assert run.size > 0 and run.count > 0
                    checked += 1
    assert checked >= 20 * cp * cp


def _unsplit_meta(tree: PrefixTree, segments: tuple[int, ...] | list[int]) -> torch.Tensor:
    """[2, s] metadata of the rows of `segments` laid end to end, in order (no CP split, no padding)."""
    seg = [torch.full((tree.segments[i].length,), i) for i in segments]
    off = [torch.arange(tree.segments[i].length) for i in segments]
    return torch.stack([torch.cat(seg), torch.cat(off)])


def test_one_description_for_layout_and_metadata() -> None:
    """A single-rank chunk's AttentionLayout and its per-token metadata give the same visibility (layout.dense_mask)."""
    for tree in _trees():
        related = tree_related(tree)
        cases = [((), list(range(len(tree.segments))))]
        for s in tree.segments:
            cases.append((s.ancestors, [s.id]))
            if s.children:
                cases.append((s.ancestors + (s.id,), list(s.children)))
        for external, segs in cases:
            chunk = make_chunk(tree, segs, external=external)
            mask = chunk.layout.dense_mask()
            assert torch.equal(_coverage(plan_from_layout(chunk.layout), *mask.shape), mask.long())
            q_meta, k_meta = _unsplit_meta(tree, segs), _unsplit_meta(tree, [*external, *segs])
            assert torch.equal(_coverage(plan_from_meta(q_meta, k_meta, related), *mask.shape), mask.long())


def test_runs_and_hidden_blocks_build_nothing() -> None:
    meta = torch.tensor([[3, 3, 3, -1, 3, 3, 5, 5], [0, 1, 2, 0, 7, 8, 0, 1]])
    runs = runs_from_meta(meta)
    assert runs.start == (0, 4, 6) and runs.length == (3, 2, 2) and runs.segment == (3, 3, 5)
    assert runs.offset == (0, 7, 0)
    # segment 5 unrelated to segment 3: a hidden block has an empty plan
    related = torch.eye(6, dtype=torch.bool)
    q = runs_from_meta(torch.tensor([[5, 5], [0, 1]]))
    k = runs_from_meta(torch.tensor([[3, 3], [0, 1]]))
    assert plan_block(q, k, meta_sees(q, k, ancestors_from_related(related, q.segment)), 2, [2]).empty


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_rectangles_forward_backward_match_reference(dtype: torch.dtype, tol: float) -> None:
    """Keys split into two blocks (as a ring would see them), merged forward, merged-LSE backward per rectangle."""
    rs = random_tree_rollouts(groups=1, prompt_len=13, branches=3, levels=2, seg_len=(2, 7), seed=5)
    tree = PrefixTree.build(rs, vocab_size=37)
    chunk = make_chunk(tree, list(range(len(tree.segments))))
    layout, related = chunk.layout, tree_related(tree)
    meta = _unsplit_meta(tree, chunk.segments)  # [2, s]
    s, b, n, g, h = layout.num_queries, 1, 4, 2, 8
    gen = torch.Generator().manual_seed(29)
    q = torch.randn(s, b, n, h, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(s, b, g, h, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(s, b, g, h, generator=gen, dtype=dtype, requires_grad=True)
    dout = torch.randn(s, b, n * h, generator=gen, dtype=dtype)
    ref = reference_attention(q, k, v, layout, scale=h**-0.5)
    ref.backward(dout)

    cut = s // 2
    blocks = [slice(0, cut), slice(cut, s)]  # one ring step each, compact kv heads read in place
    plans = [plan_from_meta(meta, meta[:, rows], related) for rows in blocks]
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out = lse = None
    for rows, plan in zip(blocks, plans):
        o, lo = merge_forward(qd, [kd[rows]], [vd[rows]], plan, h**-0.5)  # [s, b, n, h], [s, b, n]
        out, lse = lse_merge(out, lse, o, lo)
    torch.testing.assert_close(out.reshape(s, b, n * h).to(dtype), ref.detach(), atol=tol, rtol=tol)

    dq = torch.zeros(s, b, n, h, dtype=out.dtype)
    dk, dv = torch.zeros(s, b, g, h, dtype=out.dtype), torch.zeros(s, b, g, h, dtype=out.dtype)
    for rows, plan in zip(blocks, plans):
        dq_t, (dk_t,), (dv_t,) = merge_backward(
            dout.view(s, b, n, h), qd, [kd[rows]], [vd[rows]], out, lse, plan, h**-0.5
        )
        dq += dq_t
        dk[rows] += dk_t
        dv[rows] += dv_t
    torch.testing.assert_close(dq.to(dtype), q.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(dk.to(dtype), k.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(dv.to(dtype), v.grad, atol=tol, rtol=tol)


def _random_sizes(sk: int, gen: torch.Generator) -> list[int]:
    """A random cut of [0, sk) into 1-4 key blocks (some cut through a segment's own keys)."""
    cuts = sorted(
        {
            int(x)
            for x in torch.randint(1, sk, (int(torch.randint(0, 4, (1,), generator=gen)),), generator=gen)
        }
    )
    bounds = [0, *cuts, sk]
    return [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.slow
def test_layout_plans_over_any_key_blocks_cover_the_mask_once() -> None:
    """One planner for a layout, whatever the key blocks: a square cut by a block boundary becomes a square, a
    full rectangle and a square; every visible pair is still covered exactly once."""
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for tree in _trees():
        for s in tree.segments:
            external, segs = (
                (s.ancestors + (s.id,), list(s.children)) if s.children else (s.ancestors, [s.id])
            )
            layout = make_chunk(tree, segs, external=external).layout
            for _ in range(3):
                sizes = _random_sizes(layout.num_keys, gen) if layout.num_keys > 1 else [1]
                plan = plan_from_layout(layout, sizes)
                cov = _coverage(plan, layout.num_queries, layout.num_keys)
                assert torch.equal(cov, layout.dense_mask().long()), (sizes, segs, external)
                checked += 1
    assert checked > 30


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["merge", "packed", "reference"])
def test_executors_exact_over_random_key_blocks(backend: str) -> None:
    """Each executor on one rank over key blocks read in place, cut anywhere: float64 against the reference."""
    from megatron_branch.attention.dispatch import attention

    gen = torch.Generator().manual_seed(11)
    tree = _trees()[1]
    for s in [x for x in tree.segments if x.children][:3]:
        layout = make_chunk(tree, list(s.children), external=s.ancestors + (s.id,)).layout
        sizes = _random_sizes(layout.num_keys, gen)
        q = torch.randn(layout.num_queries, 1, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        k = torch.randn(layout.num_keys, 1, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        v = torch.randn(layout.num_keys, 1, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        ref = reference_attention(q, k, v, layout)
        dout = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        want = torch.autograd.grad(ref, (q, k, v), dout)
        ks = [b.detach().requires_grad_() for b in torch.split(k, sizes)]
        vs = [b.detach().requires_grad_() for b in torch.split(v, sizes)]
        out = attention(q, ks, vs, layout, backend=backend)
        dq, *dkv = torch.autograd.grad(out, (q, *ks, *vs), dout)
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(dq, want[0], rtol=0, atol=1e-11)
        torch.testing.assert_close(torch.cat(dkv[: len(ks)]), want[1], rtol=0, atol=1e-11)
        torch.testing.assert_close(torch.cat(dkv[len(ks) :]), want[2], rtol=0, atol=1e-11)
