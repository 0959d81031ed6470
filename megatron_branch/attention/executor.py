"""An executor runs THE visibility plan (attention/plan.py); this file is its contract and its thin autograd Function.

SHAPE LEGEND (Megatron sequence-first, rows first everywhere):
    sq query rows   sk_j keys of key block j   b batch   n query heads   g kv heads (g divides n)   h head dim
    q, dout        [sq, b, n, h]          ks[j], vs[j]   [sk_j, b, g, h] (compact kv heads; blocks read in place)
    out            [sq, b, n, h] acc      lse            [sq, b, n] acc      acc = fp32 (fp64 for fp64 inputs)
    dq             [sq, b, n, h] acc      dks[j], dvs[j] [sk_j, b, g, h] acc

ring-flash-attention's shape (zhuzilin): an executor is two plain functions,
    forward(q, ks, vs, plan, scale) -> (out, lse)      attention of q over the plan's key blocks only;
    backward(dout, q, ks, vs, out, lse, plan, scale) -> (dq, dks, dvs)
where backward receives the MERGED out/lse of every key block the queries saw (on one rank: these blocks; under
context parallelism: every ring step's), so P = exp(S - lse) is exactly this call's columns of the full softmax and
D = rowsum(dO * O) the full row's D: dq summed over calls, dk/dv of each block are the exact gradient. Rows the plan
never touches come back as out 0, lse -inf (lse_merge reads that as "no mass").

A plan cut with a sliding window also has `bands` (attention/window.py): an executor runs them like its other calls
(the dense executors read them through `BlockPlan.dense_mask`). A sink is not the executor's business: it is merged
once after all calls (attention/merge.py `add_sink`), and the backward receives the merged out/lse including it.

The same executor serves one rank (`PlanAttention`, below) and every block of the ring (parallel/ring.py), so a
backend means the same at CP1 and under CP. The executors (attention/dispatch.py `EXECUTORS`):
    merge      fused kernels per rectangle, sibling rows grouped, equal causal squares batched (the fast path)
    packed     one dense masked pass over the call's keys, FlashAttention-2's backward formulas with the given lse
    reference  plain masked softmax, differentiated by autograd (the float64 oracle; backward recomputes it)
    flex       FlexAttention with a mask from the plan's runs (GPU; forward-only on CPU, as torch allows)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.attention.merge import add_sink, sink_grad
from megatron_branch.attention.plan import BlockPlan

Tensors = Sequence[torch.Tensor]
Forward = Callable[[torch.Tensor, Tensors, Tensors, BlockPlan, float], tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]


@dataclass(frozen=True, kw_only=True)
class Executor:
    """One way to run a plan: a forward and a backward function (see the module docstring)."""

    name: str
    forward: Forward
    backward: Backward
    backward_on_cpu: bool = True
    """False when the kernel has no backward on CPU (torch's FlexAttention): training there is refused up front."""

    def check_grad(self, q: torch.Tensor, tensors: Tensors) -> None:
        """Refuse, before any work, a differentiable call this executor cannot differentiate on q's device."""
        if (
            not self.backward_on_cpu
            and q.device.type == "cpu"
            and torch.is_grad_enabled()
            and any(t.requires_grad for t in (q, *tensors))
        ):
            raise RuntimeError(
                f"the {self.name!r} attention backend has no backward on CPU (torch refuses it); "
                "run it under torch.no_grad() or use the 'merge' backend"
            )


def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out 0 [sq,b,n,h], lse -inf [sq,b,n]) in the accumulation dtype: what rows that see nothing get."""
    from megatron_branch.attention.kernels import lse_dtype

    acc = lse_dtype(q.dtype)
    sq, b, n, h = q.shape
    return q.new_zeros(sq, b, n, h, dtype=acc), q.new_full((sq, b, n), float("-inf"), dtype=acc)


def zero_grads(q: torch.Tensor, ks: Tensors) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """dq [sq,b,n,h] and dk/dv per block [sk_j,b,g,h], zeros in the accumulation dtype."""
    from megatron_branch.attention.kernels import lse_dtype

    acc = lse_dtype(q.dtype)
    dks = [torch.zeros(k.shape, dtype=acc, device=k.device) for k in ks]
    return torch.zeros(q.shape, dtype=acc, device=q.device), dks, [torch.zeros_like(d) for d in dks]


class PlanAttention(torch.autograd.Function):
    """Thin autograd wrapper of one executor over one plan (one rank). Inputs: q, plan, scale, executor, the
    number of key blocks m, the attention sink [n] (None: no sink; attention/merge.py `add_sink`), then k_0..,
    v_0.."""

    @staticmethod
    def forward(ctx: Any, q, plan, scale, executor, m, sink, *kv):  # noqa: ANN001, ANN205
        ks, vs = kv[:m], kv[m:]
        with torch.no_grad():
            out, lse = executor.forward(q, ks, vs, plan, scale)
            if sink is not None:  # once, after every key block: the row's final denominator
                out, lse = add_sink(out, lse, sink)
        sq, b, n, h = q.shape
        result = out.to(q.dtype).reshape(sq, b, n * h)  # [sq, b, n*h]
        # backward needs the inputs, the merged output and lse; nothing per rectangle
        ctx.save_for_backward(q, result, lse, *ks, *vs)
        ctx.plan, ctx.scale, ctx.executor, ctx.m, ctx.sink = plan, scale, executor, m, sink
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, result, lse, *kv = ctx.saved_tensors
        m = ctx.m
        ks, vs = kv[:m], kv[m:]
        sq, b, n, h = q.shape
        dout, out = grad.reshape(sq, b, n, h), result.view(sq, b, n, h)
        dq, dks, dvs = ctx.executor.backward(dout, q, ks, vs, out, lse, ctx.plan, ctx.scale)
        needs = ctx.needs_input_grad
        d_sink = sink_grad(dout, out, lse, ctx.sink) if needs[5] else None
        grads_k = [own(d, k) if needs[6 + j] else None for j, (d, k) in enumerate(zip(dks, ks))]
        grads_v = [own(d, v) if needs[6 + m + j] else None for j, (d, v) in enumerate(zip(dvs, vs))]
        return (dq.to(q.dtype) if needs[0] else None, None, None, None, None, d_sink, *grads_k, *grads_v)


def own(d: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A key block's gradient in the block's dtype, in a storage of its own: autograd may keep it as a cached
    leaf's .grad (replay's dK/dV accumulator), which must not hold a larger buffer alive."""
    d = d.to(like.dtype)
    return d if d.untyped_storage().nbytes() == d.numel() * d.element_size() else d.clone()


def pull_back(
    outputs: tuple[torch.Tensor, torch.Tensor],
    inputs: Sequence[torch.Tensor],
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Autograd through ONE call's differentiable (out_c [b,n,sq,h], lse_c [b,n,sq]) with the gradient the MERGED
    (out [b,n,sq,h], lse [b,n,sq]) receives, dout [b,n,sq,h]: how an executor whose forward is plain differentiable
    math serves the ring. With w = exp(lse_c - lse) (this call's share of each row's softmax mass), the log-sum-exp
    merge out = sum_c w_c out_c gives d out_c = w * dout and d lse_c = w * rowsum(dout * (out_c - out))."""
    o_c, lse_c = outputs
    w = torch.exp(lse_c.detach() - lse).nan_to_num(0.0)  # 0 where this call sees nothing (-inf - -inf: nan)
    d_lse = w * (dout * (o_c.detach() - out)).sum(-1)
    return torch.autograd.grad([o_c, lse_c], list(inputs), [w.unsqueeze(-1) * dout, d_lse])
