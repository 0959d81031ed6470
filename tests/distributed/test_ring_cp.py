"""Context parallelism: ring attention with tree masks, and the packed/replay schedules under CP.

    python tests/distributed/launch.py 2 -k ring
    python tests/distributed/launch.py 4 -k ring
    python tests/distributed/launch.py 8 -k cp8

Every rank builds the same trees and the same random tensors (seeded), runs the unsplit single-process reference
locally, and compares its own rows of the CP result to it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from megatron_branch.attention.dispatch import EXECUTORS
from megatron_branch.attention.reference import reference_attention
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.parallel.cp_layout import tree_related
from megatron_branch.parallel.ring import RingStats, ring_tree_attention
from megatron_branch.schedule.chunks import make_chunk, split_chunk

# ---------------------------------------------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------------------------------------------


def _tree(kind: str) -> PrefixTree:
    gen = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return [int(x) for x in torch.randint(0, 37, (n,), generator=gen)]

    if kind == "causal":  # one sequence, 11 tokens: not a multiple of 2*cp
        rs = [Rollout(prompt=rand(5), response=rand(6), advantage=1.0)]
    elif kind == "branches":  # a prompt and three branches
        p = rand(9)
        rs = [Rollout(prompt=p, response=[i + 1] + rand(2 + i), advantage=float(i) - 1) for i in range(3)]
    else:  # two levels: a shared response beginning under the prompt, plus a second root
        p = rand(9)
        rs = []
        for i in range(5):
            shared = [3, 4] if i < 3 else [5]
            rs.append(Rollout(prompt=p, response=shared + rand(3 + i), advantage=float(i) - 2))
        rs.append(Rollout(prompt=[1, 2, 3], response=[4, 5], advantage=1.0))
    return PrefixTree.build(rs, vocab_size=37)


def _cp() -> tuple[object, int, int]:
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


def _local_keys(tree: PrefixTree, external: tuple[int, ...], chunk_part, cp: int, rank: int):  # noqa: ANN001, ANN202
    """This rank's key rows: [its shard of every external ancestor | its chunk rows] -> (meta [2,sk], ref key idx)."""
    metas, idx = [], []
    c = 0
    for a in external:
        part = split_chunk(tree, make_chunk(tree, [a], external=tree.segments[a].ancestors), cp, rank)
        metas.append(part.meta)
        idx.append(torch.where(part.rows >= 0, part.rows + c, part.rows))
        c += tree.segments[a].length
    metas.append(chunk_part.meta)
    idx.append(torch.where(chunk_part.rows >= 0, chunk_part.rows + c, chunk_part.rows))
    return torch.cat(metas, dim=1), torch.cat(idx)


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Rows idx of x ([s, ...]); padding rows (-1) are zeros."""
    out = x[idx.clamp(min=0)].clone()
    out[idx < 0] = 0
    return out


# ---------------------------------------------------------------------------------------------------------------
# ring attention vs the unsplit reference
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("kind,external", [("causal", 0), ("branches", 0), ("twolevel", 0), ("twolevel", 2)])
def test_ring_attention_matches_reference(kind: str, external: int, dtype: torch.dtype, tol: float) -> None:
    group, rank, cp = _cp()
    tree = _tree(kind)
    if external:  # replay-like: the children of a depth-1 segment against cached ancestors (root, parent)
        parent = next(s for s in tree.segments if s.depth == 1 and s.children)
        ext, segs = parent.ancestors + (parent.id,), list(parent.children)
    else:
        ext, segs = (), list(range(len(tree.segments)))
    chunk = make_chunk(tree, segs, external=ext)
    layout = chunk.layout
    sq, sk, n, g, h = layout.num_queries, layout.num_keys, 4, 2, 8
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sq, 1, n, h, generator=gen, dtype=dtype, requires_grad=True)
    k = torch.randn(sk, 1, g, h, generator=gen, dtype=dtype, requires_grad=True)
    v = torch.randn(sk, 1, g, h, generator=gen, dtype=dtype, requires_grad=True)
    dout = torch.randn(sq, 1, n * h, generator=gen, dtype=dtype)
    ref = reference_attention(q, k, v, layout, scale=h**-0.5)
    ref.backward(dout)

    part = split_chunk(tree, chunk, cp, rank, pad_to_multiple=2)
    k_meta, k_idx = _local_keys(tree, ext, part, cp, rank)
    assert (sk - layout.num_queries) == sum(tree.segments[a].length for a in ext)
    ql = _take(q.detach(), part.rows).requires_grad_()
    kl = _take(k.detach(), k_idx).requires_grad_()
    vl = _take(v.detach(), k_idx).requires_grad_()
    stats = RingStats()
    out = ring_tree_attention(ql, kl, vl, part.meta, k_meta, tree_related(tree), h**-0.5, group, stats=stats)
    out.backward(_take(dout, part.rows))

    real, kreal = part.rows >= 0, k_idx >= 0
    torch.testing.assert_close(out[real], ref.detach()[part.rows[real]], atol=tol, rtol=tol)
    assert out[~real].abs().max().item() == 0 if (~real).any() else True
    torch.testing.assert_close(ql.grad[real], q.grad[part.rows[real]], atol=tol, rtol=tol)
    torch.testing.assert_close(kl.grad[kreal], k.grad[k_idx[kreal]], atol=tol, rtol=tol)
    torch.testing.assert_close(vl.grad[kreal], v.grad[k_idx[kreal]], atol=tol, rtol=tol)
    # a real ring: CP-1 K/V blocks forward (+CP-1 in the backward ring), CP dK/dV hops, only one-block messages
    assert stats.kv_messages == 2 * (cp - 1) and stats.grad_messages == cp
    assert stats.kv_block_shapes <= {(2, *kl.shape)}
    assert stats.max_kv_rows_held <= 2 * kl.shape[0] < cp * kl.shape[0] or cp == 2
    # every row of the real sequence sees something somewhere: the whole result is covered
    covered = torch.zeros(sq, dtype=torch.long)
    covered[part.rows[real]] = 1
    dist.all_reduce(covered, group=group)
    assert bool((covered == 1).all())


def _blocks(x: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """Rows of x as separate leaf tensors of `sizes` (replay's cached shards, then the chunk's rows)."""
    return [p.detach().clone().requires_grad_() for p in torch.split(x, sizes)]


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("backend", ["merge", "packed", "reference", "flex"])
def test_ring_runs_each_executor_exactly(backend: str) -> None:
    """Every executor of the plan runs every ring block, the cached ancestors' shards read as separate blocks (in
    place, never concatenated): float64 against the unsplit reference, per block gradient (flex: forward only on
    CPU, where torch has no flex backward)."""
    group, rank, cp = _cp()
    tree = _tree("twolevel")
    parent = next(s for s in tree.segments if s.depth == 1 and s.children)
    ext, segs = parent.ancestors + (parent.id,), list(parent.children)
    chunk = make_chunk(tree, segs, external=ext)
    layout = chunk.layout
    sq, sk, n, g, h = layout.num_queries, layout.num_keys, 4, 2, 8
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(sq, 1, n, h, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sk, 1, g, h, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sk, 1, g, h, generator=gen, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(sq, 1, n * h, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v, layout, scale=h**-0.5)
    ref.backward(dout)

    part = split_chunk(tree, chunk, cp, rank)
    k_meta, k_idx = _local_keys(tree, ext, part, cp, rank)
    sizes = [
        split_chunk(tree, make_chunk(tree, [a], external=tree.segments[a].ancestors), cp, rank).num_local
        for a in ext
    ]
    sizes.append(part.num_local)
    ql = _take(q.detach(), part.rows).requires_grad_()
    ks, vs = _blocks(_take(k.detach(), k_idx), sizes), _blocks(_take(v.detach(), k_idx), sizes)
    stats = RingStats()
    grad = EXECUTORS[backend].backward_on_cpu
    with torch.set_grad_enabled(grad):
        out = ring_tree_attention(
            ql,
            ks,
            vs,
            part.meta,
            k_meta,
            tree_related(tree),
            h**-0.5,
            group,
            executor=EXECUTORS[backend],
            stats=stats,
        )
    real, kreal = part.rows >= 0, k_idx >= 0
    torch.testing.assert_close(out[real], ref.detach()[part.rows[real]], atol=1e-10, rtol=1e-10)
    assert stats.kv_block_shapes <= {(2, sum(sizes), 1, g, h)}  # one message: every local block, g heads
    if not grad:
        with pytest.raises(RuntimeError, match="no backward on CPU"):
            ring_tree_attention(
                ql, ks, vs, part.meta, k_meta, tree_related(tree), 0.5, group, executor=EXECUTORS[backend]
            )
        return
    out.backward(_take(dout, part.rows))
    torch.testing.assert_close(ql.grad[real], q.grad[part.rows[real]], atol=1e-10, rtol=1e-10)
    dk, dv = torch.cat([b.grad for b in ks]), torch.cat([b.grad for b in vs])
    torch.testing.assert_close(dk[kreal], k.grad[k_idx[kreal]], atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(dv[kreal], v.grad[k_idx[kreal]], atol=1e-10, rtol=1e-10)
    for b in (
        *ks,
        *vs,
    ):  # each block's gradient in a storage of its own (what replay keeps as a leaf's .grad)
        assert b.grad.untyped_storage().nbytes() == b.grad.numel() * b.grad.element_size()


@pytest.mark.world(2)
def test_ring_refuses_a_baseline_without_ring_executor() -> None:
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.schedule import ScheduleOptions

    groups = initialize_parallel(ParallelConfig(cp=2))
    with pytest.raises(ValueError, match="one-rank benchmark baseline"):
        ScheduleOptions(groups=groups, vocab_size=37, backend="repeat")
    for name in EXECUTORS:
        assert ScheduleOptions(groups=groups, vocab_size=37, backend=name).backend == name


@pytest.mark.world(4)
def test_ring_skips_hidden_blocks() -> None:
    """A 2-token sequence on 4 ranks: rank r holds offsets {r, 7-r} (< 2 real), so most blocks are hidden."""
    group, rank, cp = _cp()
    tree = PrefixTree.build([Rollout(prompt=[1], response=[2], advantage=1.0)], vocab_size=37)
    part = split_chunk(tree, make_chunk(tree, [0]), cp, rank)
    q = torch.randn(part.num_local, 1, 2, 4, dtype=torch.float64)
    stats = RingStats()
    out = ring_tree_attention(q, q, q, part.meta, part.meta, tree_related(tree), 0.5, group, stats=stats)
    # rank 0 (token 0) sees only its own block; rank 1 (token 1) sees blocks 0 and 1; ranks 2, 3 hold padding only
    assert stats.blocks_computed == [1, 2, 0, 0][rank]
    assert stats.blocks_skipped == cp - stats.blocks_computed
    if rank >= 2:
        assert out.abs().max().item() == 0


# ---------------------------------------------------------------------------------------------------------------
# the full model: packed / replay under CP (and TP x CP) vs the single-process naive schedule
# ---------------------------------------------------------------------------------------------------------------

ARCH = dict(
    family="qwen2",
    vocab_size=37,
    hidden_size=32,
    num_layers=2,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    qkv_bias=True,
)


def _model_case(
    schedule: str,
    dtype: torch.dtype,
    *,
    tp: int,
    cp: int,
    tol: float,
    recompute_layers: bool = False,
    backend: str | None = None,
) -> None:
    from megatron_branch.losses import PolicyGradientObjective
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.grads import finalize_grads
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.schedule import ScheduleOptions, run_schedule

    sp = tp > 1
    groups = initialize_parallel(ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp))
    assert groups.cp_size == cp and groups.dp_size == 1
    model = build_model(ModelArch(**ARCH), dtype=dtype, tp=tp, sequence_parallel=sp)
    assert model.config.context_parallel_size == 1  # megatron's own CP paths stay off; the ring does CP
    src = dist.get_global_rank(groups.cp, 0)
    for p in model.parameters():  # identical replicas over CP (they are seeded alike; make sure)
        dist.broadcast(p.data, src=src, group=groups.cp)
    tree = _tree("twolevel")
    obj = PolicyGradientObjective.grpo(
        [r.advantage for r in tree.rollouts], tree.num_response_tokens_logical()
    )
    common = dict(vocab_size=37, keep_logprobs=True)
    no_cp = dataclasses.replace(groups, cp=None, cp_size=1)

    # reference: the naive schedule, run locally on every rank (no CP involved)
    ref = run_schedule("naive", model, tree, obj, ScheduleOptions(groups=no_cp, **common))
    finalize_grads(model, tp_group=groups.tp, dp_cp_group=None, sequence_parallel=sp)
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    name, recompute = schedule.split("-")[0], schedule.endswith("recompute")
    stats = RingStats()
    opts = ScheduleOptions(
        groups=groups,
        **common,
        recompute=recompute,
        recompute_layers=recompute_layers,
        branch_micro_batch=2,
        chunk_tokens=None,  # the walk itself (chunks off): a tiny tree would be one chunk
        ring_stats=stats,
        backend=backend,
    )
    with _recomputed_layers() as order:
        res = run_schedule(name, model, tree, obj, opts)
    finalize_grads(model, tp_group=groups.tp, dp_cp_group=groups.dp_cp, sequence_parallel=sp)

    assert abs(res.loss - ref.loss) <= tol * max(1.0, abs(ref.loss)), (res.loss, ref.loss)
    for i in range(len(tree.rollouts)):
        torch.testing.assert_close(
            res.rollout_logprobs(tree, i), ref.rollout_logprobs(tree, i), atol=tol, rtol=tol
        )
    for n, p in model.named_parameters():
        rel = ((p.grad - ref_grads[n]).norm() / ref_grads[n].norm().clamp(min=1e-30)).item()
        assert rel <= tol, f"{n}: rel grad err {rel:.3g} > {tol}"
    # a real ring: per layer, each forward sends CP-1 K/V blocks, each backward CP-1 K/V blocks and CP dK/dV blocks
    layers, inner = ARCH["num_layers"], sum(1 for s in tree.segments if s.children)
    backwards = res.forwards - (
        inner if recompute else 0
    )  # recompute: the no-grad first forwards have no backward
    # per-layer checkpointing: every backward first runs each layer's forward (and its ring) once more
    again = backwards if recompute_layers else 0
    assert stats.kv_messages == (cp - 1) * layers * (res.forwards + backwards + again)
    assert stats.grad_messages == (cp * layers * backwards if cp > 1 else 0)  # TP only: no ring at all
    assert len(order) == layers * again
    # the recomputations (collectives inside backward under CP and TP) ran in the same order on every rank
    orders = [None] * dist.get_world_size()
    dist.all_gather_object(orders, order)
    assert all(o == order for o in orders)
    model.zero_grad(set_to_none=True)


@contextlib.contextmanager
def _recomputed_layers() -> Iterator[list[int]]:
    """The layer numbers the layer checkpoint recomputes, in order (models/layer_checkpoint.py `attached`)."""
    from megatron_branch.models import layer_checkpoint

    order: list[int] = []
    real = layer_checkpoint.attached

    def spy(core: Any, ctx: Any) -> Any:
        order.append(core.layer_number)
        return real(core, ctx)

    layer_checkpoint.attached = spy
    try:
        yield order
    finally:
        layer_checkpoint.attached = real


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("schedule", ["packed", "replay", "replay-recompute"])
def test_ring_cp_model_matches_naive(schedule: str, dtype: torch.dtype, tol: float) -> None:
    _model_case(schedule, dtype, tp=1, cp=dist.get_world_size(), tol=tol)


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("backend", ["packed", "reference"])
@pytest.mark.parametrize("schedule", ["packed", "replay"])
def test_ring_cp_model_each_executor_matches_naive(schedule: str, backend: str) -> None:
    """`backend` means the same under CP as on one rank: each executor runs every ring block, float64 per
    parameter against the single-rank naive schedule (merge, the default, is test_ring_cp_model_matches_naive)."""
    _model_case(schedule, torch.float64, tp=1, cp=dist.get_world_size(), tol=1e-9, backend=backend)


@pytest.mark.world(2, 4)
def test_ring_cp_flex_scores_match_naive() -> None:
    """The flex executor under CP (forward-only on CPU: scoring) gives the naive schedule's logprobs."""
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.schedule import ScheduleOptions, score_rollouts

    cp = dist.get_world_size()
    groups = initialize_parallel(ParallelConfig(cp=cp))
    model = build_model(ModelArch(**ARCH), dtype=torch.float64)
    for p in model.parameters():
        dist.broadcast(p.data, src=0, group=groups.cp)
    tree = _tree("twolevel")
    no_cp = dataclasses.replace(groups, cp=None, cp_size=1)
    ref = score_rollouts("naive", model, tree, ScheduleOptions(groups=no_cp, vocab_size=37))
    for schedule in ("packed", "replay"):
        got = score_rollouts(
            schedule,
            model,
            tree,
            ScheduleOptions(groups=groups, vocab_size=37, backend="flex", chunk_tokens=None),
        )
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, equal_nan=True)


@pytest.mark.world(2)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-9), (torch.float32, 1e-5)])
@pytest.mark.parametrize("tp,cp", [(1, 2), (2, 1)], ids=["cp2", "tp2sp"])
def test_recompute_layers_model_matches_naive(tp: int, cp: int, dtype: torch.dtype, tol: float) -> None:
    """The planner's `recompute full` (segment recompute + per-layer checkpointing) under CP2 (the ring runs
    again inside backward) and TP2 + SP (the sequence all-gathers run again): exact against naive."""
    _model_case("replay-recompute", dtype, tp=tp, cp=cp, tol=tol, recompute_layers=True)


@pytest.mark.world(4)
@pytest.mark.parametrize("schedule", ["packed", "replay"])
def test_ring_tp2_cp2_model_matches_naive(schedule: str) -> None:
    _model_case(schedule, torch.float32, tp=2, cp=2, tol=1e-5)


@pytest.mark.world(8)
def test_cp8_model_matches_naive() -> None:
    """CP8 on 8 processes: replay (prefix shards kept on their owners across branches) in fp64."""
    _model_case("replay", torch.float64, tp=1, cp=8, tol=1e-9)
