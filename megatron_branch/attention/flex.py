"""The `flex` executor: FlexAttention with a BlockMask from the plan's runs (the GPU path for general trees).

SHAPE LEGEND (Megatron sequence-first at the boundary, SDPA layout inside):
    sq query rows   sk keys of the call (its key blocks end to end)   b batch   n query heads   g kv heads
    h head dim      R_q / R_k query / key runs of the plan (attention/plan.py)
    q [sq, b, n, h]   ks[j], vs[j] [sk_j, b, g, h]   out [sq, b, n, h] acc   lse [sq, b, n] acc
    inside: [b, n, sq, h] and k/v [b, g, sk, h] (flex reads GQA groups itself, enable_gqa); per-token metadata:
        q_run [sq], q_off [sq]   run of each query row (R_q = none) and its offset in its segment
        k_run [sk], k_off [sk]   the same for the keys (R_k = none)
        table [R_q + 1, R_k + 1] int8: 1 = the query run sees the key run in full, 2 = same segment (causal), 0 else
        q_pos [sq], k_pos [sk]   path positions (attention/window.py), only for a plan with a sliding window W

visible(q, k) = table[q_run, k_run] == 1 or (== 2 and k_off <= q_off), and q_pos - k_pos < W under a window: exactly
the plan's visibility from its runs, per (q, k), so no dense [sq, sk] mask is ever built. The BlockMask skips the all-invisible blocks (sibling branches'
keys), which is where flex's savings come from on GPU; metadata and BlockMask are built once per plan and device
and reused by every layer. Flex returns the lse, so it serves the ring like any executor; its backward recomputes
the forward under autograd and pulls the merged gradient back (executor.pull_back). On CUDA flex runs compiled (its
fused Triton kernel, with a backward); on CPU torch refuses flex's backward ("FlexAttention does not support
backward on CPU"), so there this executor is forward-only and says so before any work.
UNTESTED on GPU (none was lent): tests/gpu/test_gpu_attention.py checks it there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from megatron_branch.attention.executor import Executor, empty_result, pull_back, zero_grads
from megatron_branch.attention.kernels import lse_dtype
from megatron_branch.attention.plan import BlockPlan, Runs


def _per_token(runs: Runs, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(run index [size] (len(runs) = none), offset inside the segment [size], path position [size] (0 where the
    runs carry none)) of every row."""
    run, off = torch.full((size,), len(runs), dtype=torch.long), torch.zeros(size, dtype=torch.long)
    pos = torch.zeros(size, dtype=torch.long)
    for t in range(len(runs)):
        a, n = runs.start[t], runs.length[t]
        run[a : a + n] = t
        off[a : a + n] = torch.arange(runs.offset[t], runs.offset[t] + n)
        if runs.position:
            pos[a : a + n] = torch.arange(runs.position[t], runs.position[t] + n)
    return run, off, pos


def visibility_metadata(plan: BlockPlan, device: torch.device | str) -> dict[str, torch.Tensor]:
    """Per-token metadata of the plan's visibility (see the legend); O(sq + sk + R_q * R_k) memory."""
    q, k = plan.q, plan.k
    q_run, q_off, q_pos = _per_token(q, plan.num_queries)
    k_run, k_off, k_pos = _per_token(k, plan.num_keys)
    table = torch.zeros(len(q) + 1, len(k) + 1, dtype=torch.int8)
    k_by_seg = k.by_segment()
    for t, seen in enumerate(plan.sees):
        table[t, list(seen)] = 1
        table[t, k_by_seg.get(q.segment[t], [])] = 2
    meta = dict(q_run=q_run, q_off=q_off, k_run=k_run, k_off=k_off, table=table)
    if plan.window is not None:
        meta.update(q_pos=q_pos, k_pos=k_pos, window=torch.tensor(plan.window))
    return {name: x.to(device) for name, x in meta.items()}


def _mask_mod(meta: dict[str, torch.Tensor]) -> Any:
    q_run, q_off, k_run, k_off, table = (meta[x] for x in ("q_run", "q_off", "k_run", "k_off", "table"))

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        t = table[q_run[q_idx], k_run[kv_idx]]
        return (t == 1) | ((t == 2) & (k_off[kv_idx] <= q_off[q_idx]))

    if "window" not in meta:
        return mask_mod
    q_pos, k_pos, window = meta["q_pos"], meta["k_pos"], meta["window"]

    def windowed(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return mask_mod(b, h, q_idx, kv_idx) & (q_pos[q_idx] - k_pos[kv_idx] < window)

    return windowed


def build_block_mask(plan: BlockPlan, device: torch.device | str) -> Any:
    """A BlockMask (batch- and head-broadcast) of the plan, built once per plan and device."""
    dev = torch.device(device)

    def build() -> Any:
        meta = plan.derived(("flex_meta", str(dev)), lambda: visibility_metadata(plan, dev))
        return create_block_mask(
            _mask_mod(meta),
            None,
            None,
            plan.num_queries,
            plan.num_keys,
            device=dev,
            _compile=dev.type == "cuda",
        )

    return plan.derived(("block_mask", str(dev)), build)


@functools.cache
def _compiled_flex() -> Any:
    """flex_attention compiled once per process (its Triton kernel; eager flex materialises the scores)."""
    return torch.compile(flex_attention, dynamic=False)


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: BlockPlan, scale: float):  # noqa: ANN202
    """q [b,n,sq,h], k/v [b,g,sk,h] -> (out [b,n,sq,h], lse [b,n,sq])."""
    fn = _compiled_flex() if q.is_cuda else flex_attention
    out, aux = fn(
        q,
        k,
        v,
        block_mask=build_block_mask(plan, q.device),
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
        return_aux=AuxRequest(lse=True),
    )
    return out, aux.lse


def _inputs(q: torch.Tensor, ks: Sequence[torch.Tensor], vs: Sequence[torch.Tensor]):  # noqa: ANN202
    k = ks[0] if len(ks) == 1 else torch.cat(list(ks))  # flex takes one key tensor: the blocks end to end
    v = vs[0] if len(vs) == 1 else torch.cat(list(vs))
    return q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)


def flex_forward(q, ks, vs, plan: BlockPlan, scale: float):  # noqa: ANN001, ANN201
    if plan.empty:
        return empty_result(q)
    acc = lse_dtype(q.dtype)
    out, lse = _flex(*(t.detach() for t in _inputs(q, ks, vs)), plan, scale)  # flex checks requires_grad
    return out.permute(2, 0, 1, 3).to(acc), lse.permute(2, 0, 1).to(acc)


def flex_backward(dout, q, ks, vs, out, lse, plan: BlockPlan, scale: float):  # noqa: ANN001, ANN201
    if plan.empty:
        return zero_grads(q, ks)
    acc = lse_dtype(q.dtype)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in _inputs(q, ks, vs)]
        o_c, lse_c = _flex(*leaves, plan, scale)
        dq, dk, dv = pull_back(
            (o_c.to(acc), lse_c.to(acc)),
            leaves,
            dout.to(acc).permute(1, 2, 0, 3),
            out.to(acc).permute(1, 2, 0, 3),
            lse.to(acc).permute(1, 2, 0),
        )
    sizes = [k.shape[0] for k in ks]
    dks = torch.split(dk.permute(2, 0, 1, 3).to(acc), sizes)
    dvs = torch.split(dv.permute(2, 0, 1, 3).to(acc), sizes)
    return dq.permute(2, 0, 1, 3).to(acc), list(dks), list(dvs)


FLEX = Executor(name="flex", forward=flex_forward, backward=flex_backward, backward_on_cpu=False)
