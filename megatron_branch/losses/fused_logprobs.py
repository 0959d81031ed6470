"""Token log-probabilities straight from hidden states: the output projection fused with the logprob, by row chunks.

Shape legend:
    m  rows (one per predicted token)   h  hidden size   v  this rank's vocabulary slice (padded vocab / tp)

At long context the logits are the largest activation of all: 16K rows x 152K vocabulary in fp32 is ~10 GB per
rank, and a logprob's backward needs its softmax. This computes `logp = log_softmax(hidden @ W^T)[target]` one row
chunk at a time and keeps only hidden, W and one log-sum-exp per row; the backward recomputes each chunk's logits
(the fused linear + cross-entropy idea of Liger-Kernel and Apple's Cut Cross-Entropy). The math per chunk is the
vocab-parallel logprob of losses/logprobs.py (max, sum-exp and target all-reduced over the TP group, padded
vocabulary columns excluded), and `vocab_parallel_logprobs` on materialised logits is the reference it is tested
against.

With `entropy`, the same passes also give each row's full-vocabulary entropy (for the entropy bonus of RL
objectives), still without materialising logits.

The gradient w.r.t. `hidden` is this rank's partial sum over its vocabulary slice; the caller routes `hidden`
through megatron's `copy_to_tensor_model_parallel_region` (or the sequence-parallel gather), whose backward sums
the partials over TP, exactly as megatron's ColumnParallelLinear does for its input.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _tp(group: Any) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, n_real: int, dtype: torch.dtype) -> torch.Tensor:
    """[c, h] x [v, h] -> [c, v] logits in `dtype`, padded vocabulary columns at -inf.

    The GEMM runs in the model's dtype (bf16 tensor cores on GPU, as megatron's output layer does), the softmax
    math in `dtype` (at least float32, as megatron's cross-entropy upcasts); never a float32 copy of the weight."""
    x = (h @ w.t()).to(dtype)  # [c, v]
    if n_real < x.shape[1]:
        x[:, n_real:] = float("-inf")
    return x


class _FusedLinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(  # noqa: ANN205
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        target: torch.Tensor,
        vocab_size: int,
        group: Any,
        rows: int,
        with_entropy: bool,
    ):
        rank, size = _tp(group)
        m, v_local = hidden.shape[0], weight.shape[0]
        start = rank * v_local
        n_real = max(0, min(v_local, vocab_size - start))  # real vocabulary columns in this slice
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        local = (target >= start) & (target < start + v_local)  # [m]
        idx = (target - start).clamp(0, v_local - 1)  # [m]
        # ONE pass over the vocabulary per chunk (one GEMM): this slice's row max r, S = sum e^(x-r),
        # U = sum (x-r) e^(x-r) (entropy) and the raw target logit; the slices' partial sums are then rescaled
        # to the global max M (the log-sum-exp merge of online softmax, Milakov & Gimelshein 2018): two small
        # collectives over [m] rows, as before, and no second projection GEMM in forward.
        r = torch.empty(m, dtype=dtype, device=hidden.device)
        s = torch.empty(m, dtype=dtype, device=hidden.device)
        u = torch.zeros(m if with_entropy else 0, dtype=dtype, device=hidden.device)
        tgt = torch.empty(m, dtype=dtype, device=hidden.device)
        for i in range(0, m, rows):
            x = _chunk_logits(hidden[i : i + rows], weight, n_real, dtype)  # [c, v]
            mx = x.max(dim=-1).values  # [c]; -inf where the whole slice is padding
            mx = torch.where(mx.isinf(), torch.zeros_like(mx), mx)
            x -= mx[:, None]
            e = x.exp()  # [c, v]; padding: 0
            r[i : i + rows], s[i : i + rows] = mx, e.sum(dim=-1)
            if with_entropy:  # real columns only: padding is -inf * 0
                u[i : i + rows] = (x[:, :n_real] * e[:, :n_real]).sum(dim=-1)
            t = x.gather(1, idx[i : i + rows, None]).squeeze(1) + mx
            tgt[i : i + rows] = torch.where(local[i : i + rows], t, torch.zeros_like(t))
        if size > 1:
            top = r.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
            scale = torch.where(s > 0, (r - top).exp(), torch.zeros_like(s))  # [m]; empty slice: 0
            parts = [tgt, s * scale, *([(u + (r - top) * s) * scale] if with_entropy else [])]
            both = torch.stack(parts)
            dist.all_reduce(both, group=group)
            tgt, s, r = both[0], both[1], top
            if with_entropy:
                u = both[2]
        lse = r + s.log()  # [m] log-sum-exp over the whole vocabulary
        ent = s.log() - u / s if with_entropy else lse[:0]  # [m] or empty
        ctx.save_for_backward(hidden, weight, idx, local, lse, ent)
        ctx.rows, ctx.n_real, ctx.with_entropy = rows, n_real, with_entropy
        # fp32 (fp64 for fp64) whatever the model dtype: megatron's cross-entropy returns fp32 for bf16 logits, and
        # the objective's ratios and weights are computed from these (precision.py)
        return tgt - lse, ent

    @staticmethod
    def backward(  # noqa: ANN205
        ctx: Any, grad: torch.Tensor, grad_ent: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, idx, local, lse, ent = ctx.saved_tensors
        dtype = lse.dtype
        d_hidden = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
        d_weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device)
        g_all = grad.to(dtype)
        use_ent = ctx.with_entropy and grad_ent is not None and bool(grad_ent.ne(0).any())
        neg_g = -g_all
        g_ent = grad_ent.to(dtype) if use_ent else None
        # elementwise work in place on the recomputed chunk: it is memory-bound, one pass over [c, v] per op
        for i in range(0, hidden.shape[0], ctx.rows):
            h, c = hidden[i : i + ctx.rows], slice(i, i + ctx.rows)
            logq = _chunk_logits(h, weight, ctx.n_real, dtype)
            logq -= lse[c, None]  # [c, v] log-softmax (padding: -inf)
            p = logq.exp() if use_ent else logq.exp_()  # [c, v] softmax (padding: 0)
            if use_ent:  # dH / dx_j = -p_j (log p_j + H): local columns only, H and lse are global
                t = logq.add_(ent[c, None]).mul_(p).masked_fill_(p == 0, 0.0)  # padding: 0 * -inf
                g = p.mul_(neg_g[c, None]).sub_(t.mul_(g_ent[c, None]))  # type: ignore[index]
            else:
                g = p.mul_(neg_g[c, None])  # d logp / d logits = onehot - softmax
            g.scatter_add_(1, idx[c, None], (g_all[c] * local[c])[:, None])
            if g.dtype == h.dtype:  # float32 / float64 models: in place, no temporaries
                torch.mm(g, weight, out=d_hidden[c])  # [c, h]
                torch.addmm(d_weight, g.t(), h, out=d_weight)  # [v, h] (addmm.out: flop counters see it)
            else:  # bf16 / fp16: the logits' gradient in the model dtype, as megatron's linear backward sees it
                gm = g.to(h.dtype)
                d_hidden[c] = gm @ weight
                d_weight += gm.t() @ h
        return d_hidden.to(hidden.dtype), d_weight.to(weight.dtype), None, None, None, None, None


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    tp_group: Any = None,
    chunk_rows: int = 256,
) -> torch.Tensor:
    """log p(target | hidden) with logits = hidden [m, h] @ weight[v_local, h]^T sharded over `tp_group` -> [m].

    Never holds more than `chunk_rows` rows of logits. `vocab_size` is the real (unpadded) vocabulary.
    """
    return fused_linear_logprobs_entropy(
        hidden, weight, target, vocab_size=vocab_size, tp_group=tp_group, chunk_rows=chunk_rows, entropy=False
    )[0]


def fused_linear_logprobs_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    tp_group: Any = None,
    chunk_rows: int = 256,
    entropy: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(logp [m], H [m]): the target logprob and the full-vocabulary entropy H = -sum_v p log p of each row, both
    differentiable, from the same passes (one extra sum per row; no extra collective). entropy=False: (logp, None).

    Backward of H (vocab-parallel): dH/dx_j = -p_j (log p_j + H) on this rank's columns, with the global lse and
    H saved from the forward, so the backward needs no collective beyond the caller's input-gradient sum.
    """
    assert hidden.dim() == 2 and weight.dim() == 2 and target.shape == hidden.shape[:1]
    assert hidden.dtype == weight.dtype, f"hidden {hidden.dtype} vs output weight {weight.dtype}"
    logp, ent = _FusedLinearLogprob.apply(hidden, weight, target, vocab_size, tp_group, chunk_rows, entropy)
    return logp, (ent if entropy else None)
