"""A shim that lets megatron-core 0.16.1's mixed-precision optimizer (Float16OptimizerWithFloat16Params) run on CPU.

`get_megatron_optimizer` wraps bf16 / fp16 parameters (OptimizerConfig.bf16 / fp16, without the distributed
optimizer) in `Float16OptimizerWithFloat16Params`: an fp32 main copy of every half-precision parameter, stepped by
Adam and copied back into the parameter after each step (megatron's mixed precision; fp16 adds its dynamic loss
scale). Its `__init__` sorts the parameters by `param.type()` into 'torch.cuda.HalfTensor' /
'torch.cuda.BFloat16Tensor' (an fp32 main copy is made) and 'torch.cuda.FloatTensor', and raises TypeError for
anything else, so every CPU parameter ('torch.BFloat16Tensor') is refused (measured: "Wrapped parameters must be
one of torch.cuda.FloatTensor, torch.cuda.HalfTensor, or torch.cuda.BFloat16Tensor. Received
torch.BFloat16Tensor").

The shim (compat/cpu.py's pattern: applied only without CUDA, idempotent, loud when megatron renames its target):
while `__init__` runs, the optimizer's CPU parameters answer `.type()` with their CUDA name
(compat/distrib_optimizer.py `cuda_type_names`, the same scoped attribute the distributed optimizer's shim uses,
removed afterwards). Everything else is megatron's: the fp32 copies, the gradient copy from DDP's fp32 `main_grad`,
clipping on the fp32 gradients, the step, the copy back, its checkpoint state (`fp32_from_fp16_params`). Its other
CUDA assumptions (the unity scale, found-inf buffers, the grad scaler's tensors) are the optimizer package's
"cuda" factories, which compat/optimizer.py already maps to the CPU. Guarded by tests/unit/test_bf16.py (the
refusal is still megatron's without the shim; the shim's target exists).
"""

from __future__ import annotations

import functools
from typing import Any

from megatron_branch.compat.cpu import CompatError, _resolve
from megatron_branch.compat.distrib_optimizer import cuda_type_names

__all__ = ["float16_optimizer_shims"]

_MODULE = "megatron.core.optimizer.optimizer"


def _shim_param_types() -> None:
    _, cls = _resolve(_MODULE, "Float16OptimizerWithFloat16Params")
    if getattr(cls.__init__, "_megatron_branch_cpu", False):
        return
    orig = cls.__init__
    if not hasattr(cls, "_copy_model_grads_to_main_grads"):  # the mixed-precision path this shim enables
        raise CompatError(
            f"megatron-core changed: {_MODULE}.Float16OptimizerWithFloat16Params no longer has "
            "_copy_model_grads_to_main_grads; megatron-branch's CPU shims target megatron-core 0.16.1"
        )

    @functools.wraps(orig)
    def __init__(self: Any, optimizer: Any, *a: Any, **kw: Any) -> None:  # noqa: N807
        params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer else []
        with cuda_type_names(params):
            orig(self, optimizer, *a, **kw)

    __init__._megatron_branch_cpu = True  # type: ignore[attr-defined]
    __init__._megatron = orig  # type: ignore[attr-defined]
    cls.__init__ = __init__


def float16_optimizer_shims() -> dict[str, Any]:
    """The shims, by name, for compat/optimizer.py's applier."""
    return {"float16_optimizer_param_types": _shim_param_types}
