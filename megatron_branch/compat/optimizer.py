"""Shims that let megatron-core 0.16.1's optimizer (get_megatron_optimizer, FP32Optimizer, grad clipping) run on CPU.

megatron-core's optimizer package allocates its bookkeeping tensors on device "cuda" (FP32Optimizer's loss scale,
the mixed-precision optimizers' found-inf and overflow buffers, grad clipping's norm and zero-count buffers, the
grad scaler), asserts `param.grad.type() == 'torch.cuda.FloatTensor'` before scaling by the clip coefficient, and
falls back (without TE or apex) to a local L2 norm that also builds on "cuda" (measured; docs/design.md). Like
compat/cpu.py, each shim below replaces exactly one of those assumptions, is applied only when CUDA is absent (or
forced), is idempotent, and checks that the name it patches still exists (`CompatError` otherwise);
tests/unit/test_update.py guards them. On a GPU nothing here runs: megatron's own code does everything.

1. `optimizer.torch`, `clip_grads.torch`, `grad_scaler.torch`: a view of torch whose factories map device "cuda"
   to the CPU (the same view compat/cpu.py gives the pipeline schedules). Only those three modules see it.
2. `clip_grads.l2_norm_impl` (the local fallback only): the same L2 norm of a tensor list, on the tensors' device
   and in their dtype (float64 runs keep a float64 norm; the fallback rounds it to float32 on "cuda").
3. `optimizer.clip_grad_by_total_norm_fp32`: the same scaling (max_norm / (total + 1e-6) when below 1, in
   place) without the CUDA-type assertion, which also refuses float64 gradients.

The distributed optimizer's two CPU assumptions (CUDA parameter types, float32-only main gradients) are shimmed in
compat/distrib_optimizer.py, the mixed-precision optimizer's (CUDA parameter types: bf16 / fp16 parameters) in
compat/float16_optimizer.py, the CPU-offload optimizer's (CUDA streams, pinned memory, `is_cuda` as the device
split) in compat/offload.py; `apply_optimizer_shims` applies them all.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_branch.compat.cpu import _CpuTorchView, _resolve, apply_shims
from megatron_branch.compat.distrib_optimizer import distrib_optimizer_shims
from megatron_branch.compat.float16_optimizer import float16_optimizer_shims
from megatron_branch.compat.offload import offload_shims

__all__ = ["apply_optimizer_shims"]

_APPLIED: dict[str, bool] = {}
_MODULES = (
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
)


def _shim_factories() -> None:
    for name in _MODULES:
        mod, real = _resolve(name, "torch")
        if not isinstance(real, _CpuTorchView):
            mod.torch = _CpuTorchView(real)


def local_l2_norm(
    chunk_size: int, noop_flag: Any, tensor_lists: list[list[torch.Tensor]], per_tensor: bool, *args: Any
):  # noqa: ANN201
    """amp_C.multi_tensor_l2norm's contract: ([norm of every tensor of the lists], None), on the tensors' device."""
    tensors = [t for lst in tensor_lists for t in lst]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32), None
    dtype = torch.promote_types(tensors[0].dtype, torch.float32)
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.to(dtype)) for t in tensors]))
    return total.reshape(1), None


def _shim_l2_norm() -> None:
    clip, impl = _resolve("megatron.core.optimizer.clip_grads", "l2_norm_impl")
    utils, local = _resolve("megatron.core.utils", "local_multi_tensor_l2_norm")
    if impl is local:  # only megatron's CPU-unsafe fallback is replaced, never TE's or apex's kernel
        clip.l2_norm_impl = local_l2_norm


def clip_grad_by_total_norm(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """megatron's clip_grad_by_total_norm_fp32 without its CUDA-type assertion: scale the grads in place."""
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [getattr(p, attr).detach() for p in parameters if getattr(p, attr, None) is not None]
    clip_coeff = max_norm / (total_norm + 1.0e-6)
    if clip_coeff < 1.0:
        for g in grads:
            g.mul_(clip_coeff)


def _shim_clip() -> None:
    opt, _ = _resolve("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32")
    opt.clip_grad_by_total_norm_fp32 = clip_grad_by_total_norm


_SHIMS = {
    "optimizer_factories": _shim_factories,
    "optimizer_l2_norm": _shim_l2_norm,
    "optimizer_clip": _shim_clip,
    **distrib_optimizer_shims(),
    **float16_optimizer_shims(),
    **offload_shims(),
}


def apply_optimizer_shims(*, force: bool = False) -> list[str]:
    """Apply every optimizer shim once (when CUDA is absent, or `force`). Returns the names applied by this call."""
    return apply_shims(_SHIMS, _APPLIED, force=force)
