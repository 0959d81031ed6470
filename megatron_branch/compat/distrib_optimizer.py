"""Shims that let megatron-core 0.16.1's DistributedOptimizer (optimizer state sharded over DP x CP) run on CPU.

Measured on CPU (gloo): once compat/optimizer.py maps the optimizer package's "cuda" factories to the CPU, the
distributed optimizer's buffers, reduce-scatter / all-gather over megatron DDP's contiguous buffers, its sharded
state dict and its gloo paths all run; what remains is in `DistributedOptimizer` (each shim replaces one of
these, only without CUDA, idempotent, loud when megatron renames its target, compat/cpu.py's pattern):

1. `_build_model_and_main_param_groups` (called from `__init__`) sorts parameters by `param.type()` into
   'torch.cuda.HalfTensor' / 'torch.cuda.BFloat16Tensor' (an fp32 main copy is made) and 'torch.cuda.FloatTensor'
   (the optimizer steps on the parameter's own shard) and raises TypeError for anything else, so every CPU tensor
   ('torch.FloatTensor') and every float64 tensor is refused. The shim: while `__init__` runs, the model chunks'
   CPU parameters answer `.type()` with their CUDA name (an attribute on each parameter, removed afterwards;
   nothing else sees it). float64 answers 'torch.cuda.FloatTensor': megatron's fp32 path, in which the parameter
   is its own main parameter (no copy, no cast), the right semantics for a parameter already at least fp32.
2. `_copy_model_grads_to_main_grads` hands each main shard its gradient as `shard_model_grad.float()`: for a
   float64 parameter that is a float32 copy, which torch refuses as the float64 shard's `.grad`. The shim runs
   megatron's own method whenever no float64 parameter is present (every case megatron supports) and otherwise
   does the same copy with `.to(main_shard.dtype)` (which is `.float()` for every dtype megatron accepts).
3. With `optimizer_cpu_offload`, the fp32 path's main shards (`model_param.view(-1)[start:end]`, built while
   autograd records) are non-leaf tensors, and the HybridDeviceOptimizer, a torch Optimizer built over them,
   refuses them ("can't optimize a non-leaf Tensor"; megatron's offload is meant for bf16/fp16 parameters, whose
   shards are detached). The shim builds the shards under `torch.no_grad()` when offloading: the same views,
   leaves (`requires_grad` False; nothing reads it: optimizers read `.grad` / `.decoupled_grad`).
4. Checkpoints: megatron-core 0.16.1's default optimizer format (`fully_sharded_model_space`) builds
   ShardedTensors with `flattened_range`, which 0.16.1's own ShardedTensor refuses ("flattened_range is not
   supported"), so megatron-branch saves the `fully_reshardable` format (update/optimizer.py:
   `optimizer_sharded_state`; on CPU its gloo gather, `distrib_optim_fully_reshardable_mem_efficient`).
   `get_parameter_state_dp_zero` gathers the shards into float32 buffers, which would round a float64 run's
   master copy and moments; while it runs for an optimizer holding float64 shards, its float32 factories give
   float64 (nothing else changes: the same gather, in the state's own dtype).
5. Loading that format with torch's Adam (no TE / apex, so on every CPU): `_set_main_param_and_optimizer_states`
   copies every key of the parameter's optimizer state from the checkpoint's tensors, but torch keeps a
   per-parameter `step` there that the checkpoint does not hold (megatron restores it from the param groups):
   KeyError 'step'. The shim hands megatron's method the parameter's own `step` beside the checkpoint's tensors
   (copied onto itself: unchanged). And megatron's `load_state_dict` gives every parameter's state the SAME step
   tensor, which torch's Adam then increments in place once per parameter, so after one more step every bias
   correction is wrong (measured: the update 25% off; the same for the hybrid optimizer, whose fused CPU Adam
   increments a shared step once per parameter too); each parameter gets its own copy.

So on CPU megatron's distributed optimizer holds float64 parameters exactly (tests/distributed/test_distrib_optimizer.py:
== the plain optimizer at 1e-12 after 3 steps under DP2, CP2, DP2 x CP2). On a GPU nothing here runs, and
megatron's own refusal of float64 stands (update/optimizer.py says so before building). Guarded by
tests/unit/test_offload.py (each patched name exists; the refusals are still megatron's, so the shims are still
needed; scoped modes restore torch) and by the distributed test above.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterable
from typing import Any

import torch

from megatron_branch.compat.cpu import CompatError, _CpuTorchView, _resolve

__all__ = ["CUDA_TYPE_NAMES", "cuda_type_names", "distrib_optimizer_shims"]

_MODULE = "megatron.core.optimizer.distrib_optimizer"

CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float64: "torch.cuda.FloatTensor",  # megatron's fp32 path: the parameter is its own main parameter
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float16: "torch.cuda.HalfTensor",
}
"""What a CPU parameter of each dtype answers to `.type()` while the DistributedOptimizer is being built."""


class cuda_type_names:  # noqa: N801 - a context manager, used as `with cuda_type_names(params):`
    """While active, each CPU tensor of `params` answers `.type()` (no arguments) with its CUDA type name."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = [p for p in params if p.device.type == "cpu" and p.dtype in CUDA_TYPE_NAMES]

    def __enter__(self) -> cuda_type_names:
        for p in self.params:
            p.type = functools.partial(_type_as_cuda, p)  # an instance attribute shadows Tensor.type
        return self

    def __exit__(self, *exc: object) -> None:
        for p in self.params:
            del p.type


def _type_as_cuda(t: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kw: Any) -> Any:
    if dtype is None and not kw:
        return CUDA_TYPE_NAMES[t.dtype]
    return torch.Tensor.type(t, dtype, non_blocking, **kw)  # a conversion: torch's own


def _gone(name: str) -> CompatError:
    return CompatError(
        f"megatron-core changed: {_MODULE}.DistributedOptimizer.{name} is gone; megatron-branch's CPU shims "
        "target megatron-core 0.16.1"
    )


def _shim_init() -> None:
    _, cls = _resolve(_MODULE, "DistributedOptimizer")
    if getattr(cls.__init__, "_megatron_branch_cpu", False):
        return
    orig = cls.__init__
    if not hasattr(cls, "_build_model_and_main_param_groups"):
        raise _gone("_build_model_and_main_param_groups")

    @functools.wraps(orig)
    def __init__(
        self: Any, optimizer: Any, config: Any, grad_scaler: Any, init_state_fn: Any, *a: Any, **kw: Any
    ):  # noqa: ANN202, N807
        chunks = kw.get("model_chunks", a[0] if a else [])
        # offload: the fp32 path's shards are views of the parameters; built with autograd recording they are
        # non-leaf tensors, which the HybridDeviceOptimizer (a torch Optimizer) refuses (see 3. above)
        grad_mode = torch.no_grad() if config.optimizer_cpu_offload else contextlib.nullcontext()
        with cuda_type_names(p for chunk in chunks for p in chunk.parameters()), grad_mode:
            orig(self, optimizer, config, grad_scaler, init_state_fn, *a, **kw)

    __init__._megatron_branch_cpu = True  # type: ignore[attr-defined]
    cls.__init__ = __init__


def copy_model_grads_to_main_grads(self: Any, megatron_copy: Any) -> None:
    """megatron's `_copy_model_grads_to_main_grads`, with the gradient cast to the main shard's own dtype when a
    float64 parameter is present (megatron's own method otherwise)."""
    cfg = self.config
    if (
        self.is_stub_optimizer
        or self.ddp_config.use_megatron_fsdp
        or cfg.use_precision_aware_optimizer_no_fp8_or_ds_fp8  # decoupled_grad: megatron does not cast it
        or not any(p.dtype == torch.float64 for g in self.model_fp32_groups for p in g)
    ):
        return megatron_copy(self)
    pairs = [
        (self.model_float16_groups, self.shard_fp32_from_float16_groups),
        (self.model_fp32_groups, self.shard_fp32_groups),
    ]
    for model_groups, shard_groups in pairs:
        for model_group, shard_group in zip(model_groups, shard_groups):
            for model_param, shard in zip(model_group, shard_group):
                rng = self._get_model_param_range_map(model_param)["param"]
                assert rng.size == shard.nelement()
                shard.grad = model_param.main_grad.view(-1)[rng.start : rng.end].to(shard.dtype)
    return None


def _shim_grad_copy() -> None:
    _, cls = _resolve(_MODULE, "DistributedOptimizer")
    orig = getattr(cls, "_copy_model_grads_to_main_grads", None)
    if orig is None:
        raise _gone("_copy_model_grads_to_main_grads")
    if getattr(orig, "_megatron_branch_cpu", False):
        return

    @functools.wraps(orig)
    def _copy_model_grads_to_main_grads(self: Any) -> None:
        copy_model_grads_to_main_grads(self, orig)

    _copy_model_grads_to_main_grads._megatron_branch_cpu = True  # type: ignore[attr-defined]
    _copy_model_grads_to_main_grads._megatron = orig  # type: ignore[attr-defined]
    cls._copy_model_grads_to_main_grads = _copy_model_grads_to_main_grads


class _WidenedFloat32(_CpuTorchView):
    """torch whose factories give float64 where asked for float32 (and "cuda" is the CPU, as _CpuTorchView)."""

    def __getattr__(self, name: str) -> Any:
        attr = super().__getattr__(name)
        if name in ("zeros", "ones", "empty", "tensor", "full"):
            return _widened(attr)
        return attr


def _widened(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("dtype") == torch.float32:
            kwargs["dtype"] = torch.float64
        return fn(*args, **kwargs)

    return wrapped


def _holds_float64(opt: Any) -> bool:
    return any(p.dtype == torch.float64 for g in opt.optimizer.param_groups for p in g["params"])


def _shim_dp_zero_dtype() -> None:
    mod, cls = _resolve(_MODULE, "DistributedOptimizer")
    orig = getattr(cls, "get_parameter_state_dp_zero", None)
    if orig is None:
        raise _gone("get_parameter_state_dp_zero")
    if getattr(orig, "_megatron_branch_cpu", False):
        return

    @functools.wraps(orig)
    def get_parameter_state_dp_zero(self: Any, *a: Any, **kw: Any) -> Any:
        if self.is_stub_optimizer or not _holds_float64(self):
            return orig(self, *a, **kw)
        real = mod.torch
        mod.torch = _WidenedFloat32(real)
        try:
            return orig(self, *a, **kw)
        finally:
            mod.torch = real

    get_parameter_state_dp_zero._megatron_branch_cpu = True  # type: ignore[attr-defined]
    cls.get_parameter_state_dp_zero = get_parameter_state_dp_zero


def _shim_set_states() -> None:
    _, cls = _resolve(_MODULE, "DistributedOptimizer")
    orig = getattr(cls, "_set_main_param_and_optimizer_states", None)
    if orig is None:
        raise _gone("_set_main_param_and_optimizer_states")
    if getattr(orig, "_megatron_branch_cpu", False):
        return

    @functools.wraps(orig)
    def _set_main_param_and_optimizer_states(self: Any, model_param: Any, tensors: dict) -> Any:
        group, order = self.model_param_group_index_map[model_param]
        state = self.optimizer.state[self.optimizer.param_groups[group]["params"][order]]
        if isinstance(state.get("step"), torch.Tensor):  # torch Adam's, restored from the param groups
            state["step"] = state["step"].clone()  # its own tensor: megatron gave all of them one
            if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8 and "step" not in tensors:
                tensors = {**tensors, "step": state["step"]}  # megatron copies every state key
        return orig(self, model_param, tensors)

    _set_main_param_and_optimizer_states._megatron_branch_cpu = True  # type: ignore[attr-defined]
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states


def distrib_optimizer_shims() -> dict[str, Any]:
    """The shims, by name, for compat/optimizer.py's applier."""
    return {
        "distrib_optimizer_param_types": _shim_init,
        "distrib_optimizer_grad_copy": _shim_grad_copy,
        "distrib_optimizer_checkpoint_dtype": _shim_dp_zero_dtype,
        "distrib_optimizer_load_step": _shim_set_states,
    }
