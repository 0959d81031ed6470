"""Context parallelism that scales: no [sq, sk]-sized tensor in a CP forward+backward, and the scaled-down rehearsal.

    python tests/distributed/launch.py 2 -k ring_memory
    python tests/distributed/launch.py 4 -k ring_memory
    python tests/distributed/launch.py 8 -k cp8

A torch dispatch mode (`LargestTensorMode`) sees every op, inside the ring's autograd Function and the backward
too, and records the largest storage created. The sequences are long enough that any [sq, sk] tensor would exceed
the O(s * h) bound many times over (asserted, and a dense block is shown to be caught). The rehearsal test runs
benchmarks/scale_rehearsal.py's code path (megatron_branch.bench.rehearsal.run_step) on a batch of the target's
shape with a short prompt and compares it with the CP1 step of the same batch and weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_branch.attention.kernels import math_attention_forward
from megatron_branch.bench.rehearsal import (
    LargestTensorMode,
    RehearsalBatch,
    StepReport,
    max_relative_error,
    rehearsal_arch,
    run_step,
)
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.parallel.cp_layout import tree_related
from megatron_branch.parallel.ring import RingStats, ring_tree_attention
from megatron_branch.schedule.chunks import make_chunk, split_chunk

N, G, H = 4, 2, 8  # query heads, kv heads, head dim


def _long_tree(cp: int) -> PrefixTree:
    """A prompt of 512 * cp tokens and 4 branches of about 128 * cp: ~512 prompt and ~512 branch rows per rank."""
    gen = torch.Generator().manual_seed(5)
    p = [int(x) for x in torch.randint(0, 37, (512 * cp,), generator=gen)]
    rs = [
        Rollout(
            prompt=p,
            response=[i] + [int(x) for x in torch.randint(0, 37, (128 * cp - 1 - i,), generator=gen)],
            advantage=1.0,
        )
        for i in range(4)
    ]
    return PrefixTree.build(rs, vocab_size=37)


@pytest.mark.world(2, 4)
@pytest.mark.parametrize("kind", ["packed", "replay"])
def test_ring_memory_largest_tensor_is_linear(kind: str) -> None:
    group, rank, cp = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    tree = _long_tree(cp)
    prompt = tree.segments[0]
    if kind == "packed":
        ext, segs = (), list(range(len(tree.segments)))
    else:  # replay: the branches against this rank's cached shard of the prompt
        ext, segs = (prompt.id,), list(prompt.children)
    part = split_chunk(tree, make_chunk(tree, segs, external=ext), cp, rank)
    metas = [split_chunk(tree, make_chunk(tree, [a]), cp, rank).meta for a in ext] + [part.meta]
    k_meta = torch.cat(metas, dim=1)
    sq, sk = part.num_local, k_meta.shape[1]
    gen = torch.Generator().manual_seed(11 + rank)
    q = torch.randn(sq, 1, N, H, generator=gen, requires_grad=True)
    k = torch.randn(sk, 1, G, H, generator=gen, requires_grad=True)
    v = torch.randn(sk, 1, G, H, generator=gen, requires_grad=True)
    stats, mode = RingStats(), LargestTensorMode()
    with mode:
        out = ring_tree_attention(q, k, v, part.meta, k_meta, tree_related(tree), H**-0.5, group, stats=stats)
        out.backward(torch.ones_like(out))
    bound = 2 * sk * N * H * 4  # O(s * h): the expanded keys of one block, the fp32 dK/dV accumulator
    quadratic = N * sq * sk * 4  # the [b, n, sq, sk] fp32 scores of a dense block
    assert quadratic > 16 * bound, (sq, sk)  # the sizes are long enough for the bound to mean something
    assert mode.nbytes <= bound, (mode.nbytes, mode.op, mode.shape, bound)
    assert q.grad is not None and bool(torch.isfinite(q.grad).all()) and k.grad.abs().sum() > 0
    assert stats.kv_messages == 2 * (cp - 1) and stats.grad_messages == cp
    # the recorder bites: the dense math kernel on one block of the same sizes is caught
    dense = LargestTensorMode()
    with dense, torch.no_grad():
        qb = q.detach().permute(1, 2, 0, 3)
        kb = k.detach().repeat_interleave(N // G, dim=2).permute(1, 2, 0, 3)
        math_attention_forward(qb, kb, kb, None, H**-0.5)
    assert dense.nbytes >= quadratic > 16 * bound


def _check_step(res: StepReport, ref: StepReport, tol: float) -> None:
    assert abs(res.loss - ref.loss) <= tol * max(1.0, abs(ref.loss)), (res.loss, ref.loss)
    err, where = max_relative_error(res.grads, ref.grads)
    assert err <= tol, f"{where}: relative grad error {err:.2e} > {tol}"
    cp = res.cp
    for r in res.ranks:
        rows = r.local_rows * 2  # the prompt's local rows plus as many cached keys: a generous O(s) row count
        assert r.largest_tensor_mb * 2**20 <= 8 * rows * 32 * 4, r  # O(s * hidden), hidden 32, fp32
        assert r.grad_messages > 0 and r.kv_messages > 0 and r.blocks_computed > 0
        assert r.activation_peak_mb < ref.ranks[0].activation_peak_mb / cp * 2.5, (r, ref.ranks[0])


def _reference(batch: RehearsalBatch) -> StepReport:
    """The CP1 step, computed on rank 0 only (no collectives) and broadcast: one reference for every rank.

    A failure on rank 0 reaches every rank (which would otherwise wait in the broadcast until the timeout)."""
    box: list[StepReport | str | None] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = run_step(batch, rehearsal_arch(vocab=batch.vocab), None)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            box[0] = f"rank 0 reference failed: {type(e).__name__}: {e}"
    dist.broadcast_object_list(box, src=0)
    assert isinstance(box[0], StepReport), box[0]
    return box[0]


@pytest.mark.world(2)
def test_ring_memory_rehearsal_scaled_down() -> None:
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    cp = dist.get_world_size()
    batch = RehearsalBatch(prompt=1024 * cp - 64)
    groups = initialize_parallel(ParallelConfig(cp=cp))
    ref = _reference(batch)
    res = run_step(batch, rehearsal_arch(vocab=batch.vocab), groups)
    _check_step(res, ref, 1e-5)


@pytest.mark.world(8)
def test_cp8_rehearsal_scaled_down() -> None:
    """CP8 and TP2 x CP4 with sequence parallel, as the full rehearsal runs them, on a 4,032-token prompt."""
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    batch = RehearsalBatch(prompt=4032)
    arch = rehearsal_arch(vocab=batch.vocab)
    initialize_parallel(ParallelConfig(cp=8))  # the reference needs megatron's parallel_state (TP size 1)
    ref = _reference(batch)
    for cfg in (ParallelConfig(cp=8), ParallelConfig(tp=2, cp=4, sequence_parallel=True)):
        res = run_step(batch, arch, initialize_parallel(cfg))
        _check_step(res, ref, 1e-5)
