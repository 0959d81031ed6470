"""The dense executors of THE plan: `packed` and `reference`, plain math over the plan's dense mask.

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    sq query rows   sk keys of the call (its key blocks end to end)   b batch   n query heads   g kv heads
    h head dim   r = n // g
    q, dout [sq, b, n, h]    ks[j], vs[j] [sk_j, b, g, h]    out [sq, b, n, h] acc    lse [sq, b, n] acc
    inside: qb [b, n, sq, h], kb/vb [b, g, sk, h] (the blocks concatenated: these are oracles, not fast paths),
            mask [sq, sk] bool from `BlockPlan.dense_mask`

Both are exact and slow (O(sq * sk) scores, the way SDPA with a dense tree mask runs), and independent of each other
in the part that matters, the backward:
    packed     the math kernels of attention/kernels.py: FlashAttention-2's backward formulas with the GIVEN (merged)
               out and lse (dS = P * (dP - D));
    reference  plain masked softmax with no tricks, differentiated by AUTOGRAD: its backward recomputes the forward
               with grad enabled and pulls back the merged result's gradient through this call's (out_c, lse_c):
               with w = exp(lse_c - lse), d out_c = w * dout and d lse_c = w * rowsum(dout * (out_c - out)) (the
               derivative of the log-sum-exp merge), so autograd itself serves the ring.
Neither expands K/V: the query heads are viewed as [g, r] and K/V broadcast over r.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from megatron_branch.attention.executor import Executor, empty_result, pull_back, zero_grads
from megatron_branch.attention.kernels import lse_dtype, math_attention_backward, math_attention_forward
from megatron_branch.attention.plan import BlockPlan


def _internal(q: torch.Tensor, ks: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """q [sq,b,n,h] -> [b,n,sq,h]; key blocks -> one [b,g,sk,h] tensor (a copy; these executors are oracles)."""
    k = ks[0] if len(ks) == 1 else torch.cat(list(ks))
    return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3)


def _rows_first(x: torch.Tensor) -> torch.Tensor:
    """[b, n, sq, ...] -> [sq, b, n, ...]."""
    return x.permute(2, 0, 1, 3) if x.dim() == 4 else x.permute(2, 0, 1)


def _split(d: torch.Tensor, ks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """[b, g, sk, h] gradient of the concatenated keys -> per block [sk_j, b, g, h]."""
    d = d.permute(2, 0, 1, 3)
    return list(torch.split(d, [k.shape[0] for k in ks])) if len(ks) > 1 else [d]


# ---------------------------------------------------------------------------------------------------------------
# packed: the math kernels, explicit backward with the given out/lse
# ---------------------------------------------------------------------------------------------------------------


def packed_forward(q, ks, vs, plan: BlockPlan, scale: float):  # noqa: ANN001, ANN201
    if plan.empty:
        return empty_result(q, vs)
    (qb, kb), (_, vb) = _internal(q, ks), _internal(q, vs)
    o, lse = math_attention_forward(qb, kb, vb, plan.dense_mask(q.device), scale)  # [b,n,sq,h], [b,n,sq]
    return _rows_first(o).to(lse.dtype), _rows_first(lse)


def packed_backward(dout, q, ks, vs, out, lse, plan: BlockPlan, scale: float):  # noqa: ANN001, ANN201
    if plan.empty:
        return zero_grads(q, ks, vs)
    (qb, kb), (_, vb) = _internal(q, ks), _internal(q, vs)
    dq, dk, dv = math_attention_backward(
        dout.permute(1, 2, 0, 3),
        qb,
        kb,
        vb,
        out.permute(1, 2, 0, 3),
        lse.permute(1, 2, 0),
        plan.dense_mask(q.device),
        scale,
    )
    acc = lse_dtype(q.dtype)
    return _rows_first(dq).to(acc), [d.to(acc) for d in _split(dk, ks)], [d.to(acc) for d in _split(dv, vs)]


# ---------------------------------------------------------------------------------------------------------------
# reference: plain softmax + autograd
# ---------------------------------------------------------------------------------------------------------------


def _softmax_attention(q, k, v, mask, scale):  # noqa: ANN001, ANN202
    """Plain masked softmax in the accumulation dtype, differentiable everywhere (rows that see nothing: out 0,
    lse -inf, zero gradient). q [b,n,sq,h], k/v [b,g,sk,h] -> out [b,n,sq,h], lse [b,n,sq]."""
    b, n, sq, h = q.shape
    g = k.shape[1]
    qg = q.reshape(b, g, n // g, sq, h)  # query head j = (group j // r, member j % r)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) * scale  # [b, g, r, sq, sk]
    s = s.masked_fill(~mask, float("-inf"))
    empty = ~mask.any(-1)  # [sq]
    s = s.masked_fill(empty[:, None], 0.0)  # finite scores on empty rows, masked out below
    out = torch.matmul(torch.softmax(s, dim=-1), v.unsqueeze(2)).masked_fill(empty[:, None], 0.0)
    lse = torch.logsumexp(s, dim=-1).masked_fill(empty, float("-inf"))
    return out.reshape(b, n, sq, v.shape[-1]), lse.reshape(b, n, sq)


def _reference_inputs(q, ks, vs):  # noqa: ANN001, ANN202
    acc = lse_dtype(q.dtype)
    (qb, kb), (_, vb) = _internal(q, ks), _internal(q, vs)
    return qb.to(acc), kb.to(acc), vb.to(acc)


def reference_forward(q, ks, vs, plan: BlockPlan, scale: float):  # noqa: ANN001, ANN201
    if plan.empty:
        return empty_result(q, vs)
    o, lse = _softmax_attention(*_reference_inputs(q, ks, vs), plan.dense_mask(q.device), scale)
    return _rows_first(o), _rows_first(lse)


def reference_backward(dout, q, ks, vs, out, lse, plan: BlockPlan, scale: float):  # noqa: ANN001, ANN201
    if plan.empty:
        return zero_grads(q, ks, vs)
    acc = lse_dtype(q.dtype)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in _reference_inputs(q, ks, vs)]
        o_c, lse_c = _softmax_attention(*leaves, plan.dense_mask(q.device), scale)  # [b,n,sq,h], [b,n,sq]
        dq, dk, dv = pull_back(
            (o_c, lse_c),
            leaves,
            dout.to(acc).permute(1, 2, 0, 3),
            out.to(acc).permute(1, 2, 0, 3),
            lse.to(acc).permute(1, 2, 0),
        )
    return _rows_first(dq), _split(dk, ks), _split(dv, vs)


PACKED = Executor(name="packed", forward=packed_forward, backward=packed_backward)
REFERENCE = Executor(name="reference", forward=reference_forward, backward=reference_backward)
