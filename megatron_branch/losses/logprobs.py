"""Token log-probabilities from vocab-parallel logits, with the tensor-parallel group passed in.

Shape legend:
    m  rows (one per predicted token), v  this rank's vocabulary slice (padded vocab / tp)

Megatron's `vocab_parallel_cross_entropy` reads its group from global state and upcasts to float32, which would
cap float64 parity checks at ~1e-7; this is the same computation (max all-reduce, sum-exp all-reduce, target logit
all-reduce, softmax-minus-one-hot backward, as in megatron-core's tensor_parallel/cross_entropy.py) in the logits'
own dtype (at least float32), over row chunks so that the float32 temporaries of a 131K vocabulary stay bounded.
Vocabulary padding rows (ids >= the real vocab size) are excluded from the softmax, so padding never changes a
result. `reference_logprobs` is the slow single-rank path it is tested against.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _group_size(group: Any) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _group_rank(group: Any) -> int:
    return 0 if group is None else dist.get_rank(group)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, vocab_size: int, group: Any
    ) -> torch.Tensor:
        # logits [m, v], target [m] (global ids) -> logp [m]
        dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(dtype)
        v_local = x.shape[-1]
        start = _group_rank(group) * v_local
        # columns of this slice beyond the real vocabulary (a whole slice can be padding: small vocab, large TP)
        n_pad = min(v_local, max(0, start + v_local - vocab_size))
        if n_pad:
            x = x.clone()
            x[:, v_local - n_pad :] = float("-inf")  # padded vocabulary: never a candidate
        row_max = x.max(dim=-1).values  # [m]
        if _group_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max[:, None]  # [m, v]
        local = (target >= start) & (target < start + v_local)  # [m]
        idx = (target - start).clamp(0, v_local - 1)
        tgt_logit = torch.where(local, x.gather(1, idx[:, None]).squeeze(1), torch.zeros_like(row_max))  # [m]
        exp = x.exp()  # [m, v]
        sum_exp = exp.sum(dim=-1)  # [m]
        if _group_size(group) > 1:
            both = torch.stack([tgt_logit, sum_exp])  # one all-reduce for both
            dist.all_reduce(both, group=group)
            tgt_logit, sum_exp = both[0], both[1]
        logp = tgt_logit - sum_exp.log()  # [m]
        softmax = exp.div_(sum_exp[:, None])  # [m, v], in place: exp is not needed again
        ctx.save_for_backward(softmax, local, idx)
        ctx.in_dtype = logits.dtype
        return logp  # fp32 (fp64) for any logits dtype, as megatron's cross-entropy (precision.py)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local, idx = ctx.saved_tensors
        # d logp / d logits = onehot(target) - softmax (only the local slice of both)
        g = -softmax * grad.to(softmax.dtype)[:, None]  # [m, v]
        g.scatter_add_(1, idx[:, None], (grad.to(softmax.dtype) * local.to(softmax.dtype))[:, None])
        return g.to(ctx.in_dtype), None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    tp_group: Any = None,
    chunk_rows: int = 4096,
) -> torch.Tensor:
    """log p(target | row) for logits [m, v_local] sharded over `tp_group` along the vocabulary -> [m].

    `vocab_size` is the real (unpadded) vocabulary; every rank must pass the same rows in the same order.
    """
    assert logits.dim() == 2 and target.shape == logits.shape[:1]
    if logits.shape[0] <= chunk_rows:
        return _VocabParallelLogprob.apply(logits, target, vocab_size, tp_group)
    parts = [
        _VocabParallelLogprob.apply(
            logits[i : i + chunk_rows], target[i : i + chunk_rows], vocab_size, tp_group
        )
        for i in range(0, logits.shape[0], chunk_rows)
    ]
    return torch.cat(parts)


class _VocabParallelEntropy(torch.autograd.Function):
    """H = -sum_v p_v log p_v per row over vocab-parallel logits (the naive schedule's path; the fused one is in
    fused_logprobs.py). Backward: dH/dx_j = -p_j (log p_j + H), local columns, global H."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, vocab_size: int, group: Any) -> torch.Tensor:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        x = logits.to(dtype)
        v_local = x.shape[-1]
        start = _group_rank(group) * v_local
        n_real = max(0, min(v_local, vocab_size - start))
        x = x[:, :n_real]  # [m, v_real]: padded vocabulary is never a candidate
        row_max = x.max(dim=-1).values if n_real else torch.full(x.shape[:1], float("-inf"), dtype=dtype)
        if _group_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        x = x - row_max[:, None]
        e = x.exp()
        both = torch.stack([e.sum(dim=-1), (x * e).sum(dim=-1)])  # [2, m]: S, U
        if _group_size(group) > 1:
            dist.all_reduce(both, group=group)
        ent = both[0].log() - both[1] / both[0]  # [m]
        logq = x - both[0].log()[:, None]  # [m, v_real] log-softmax
        ctx.save_for_backward(logq, ent)
        ctx.shape, ctx.in_dtype = logits.shape, logits.dtype
        return ent  # fp32 (fp64), as the logprob

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        logq, ent = ctx.saved_tensors
        p = logq.exp()
        t = torch.where(p > 0, p * (logq + ent[:, None]), torch.zeros_like(p))
        g = torch.zeros(ctx.shape, dtype=logq.dtype, device=logq.device)
        g[:, : logq.shape[1]] = -t * grad.to(logq.dtype)[:, None]
        return g.to(ctx.in_dtype), None, None


def vocab_parallel_entropy(logits: torch.Tensor, *, vocab_size: int, tp_group: Any = None) -> torch.Tensor:
    """Full-vocabulary entropy of each row of vocab-parallel logits [m, v_local] -> [m] (differentiable)."""
    assert logits.dim() == 2
    return _VocabParallelEntropy.apply(logits, vocab_size, tp_group)


def reference_entropy(full_logits: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Slow path on unsharded logits [m, V_padded]: -sum p log p over the real vocabulary."""
    logq = torch.log_softmax(full_logits[:, :vocab_size], dim=-1)
    return -(logq.exp() * logq).sum(dim=-1)


def reference_logprobs(full_logits: torch.Tensor, target: torch.Tensor, *, vocab_size: int) -> torch.Tensor:
    """Slow path on unsharded logits [m, V_padded]: log_softmax over the real vocabulary."""
    return torch.log_softmax(full_logits[:, :vocab_size], dim=-1).gather(1, target[:, None]).squeeze(1)
