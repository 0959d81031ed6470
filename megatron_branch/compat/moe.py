"""Shims that let megatron-core 0.16.1's MoELayer (transformer/moe/) run without CUDA or TransformerEngine, and
keep a float64 run's router in float64.

Measured on CPU (/work/shared/notes/moe-hybrid-verl-on-cpu.md, docs/design.md "Mixture of experts"). Like
compat/cpu.py, each shim replaces exactly one assumption, is applied only where it is needed, is idempotent, and
first checks that the names it patches still exist (`CompatError` otherwise); tests/unit/test_compat_moe.py fails
when one is removed or megatron changes what it patches. On CPU the first four never change a result: they route
the same computation to the CPU.

1. `token_dispatcher.torch` (no CUDA): the all-to-all dispatcher makes a CUDA side stream for its device-to-host
   copies (`torch.cuda.Stream()` in its constructor, `current_stream`, `stream(...)`, `record_event()` in
   `_maybe_dtoh_and_synchronize`). The module sees a view of torch whose `cuda` has CPU stand-ins: host tensors
   need no copy and no synchronisation, so every stream operation is a no-op.
2. `token_dispatcher.maybe_move_tensor_to_cpu` (no CUDA): on a GPU the split sizes come back as numpy arrays
   (`as_numpy=True`), which `all_to_all_single` takes as lists; a CPU tensor is returned unchanged, and gloo refuses
   tensors as split sizes under expert parallelism. The shim gives a host tensor the GPU path's result, a numpy
   array.
3. `moe_utils.te_general_gemm` (TransformerEngine absent, also on a GPU): the router's gating linear
   (`RouterGatingLinearFunction`) tests `te_general_gemm is not None`, but the name is bound only inside the TE
   import's try (NameError). The shim binds it to None, the value megatron's fallback branch expects.
4. `moe_utils.torch` (no CUDA): `track_moe_metrics(force_initialize=True)` allocates its tracker on
   device="cuda"; the module sees compat/cpu.py's view of torch whose factories map "cuda" to the CPU.
6. `tensor_parallel.mappings._gather_along_first_dim` / `_reduce_scatter_along_first_dim` with split sizes (no
   CUDA): under TP x EP the dispatcher gathers a variable number of tokens per TP rank (`output_splits_tp`) with
   torch.distributed.all_gather / reduce_scatter over lists of unequal tensors, which gloo refuses (all_gather:
   "invalid tensor size"; reduce_scatter: not implemented). The shim does the same exchange with equal-sized
   collectives: every rank's rows zero-padded to the largest split, then the padding cut (a sum of zero rows for
   the reduce-scatter), so the result is the same tensor bit for bit. Without split sizes megatron's own path runs.
5. `moe_utils.torch` softmax (everywhere): megatron computes the router's scores with
   `torch.softmax(..., dtype=torch.float32)` (top-k and aux-loss scores), an up-cast for bf16/fp16 but a DOWN-cast
   for a float64 run, which would bound float64 exactness at float32's 1e-7. The view computes such a softmax in
   float64 when its input is float64; every other dtype is unchanged (float32 and below: the same call).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_branch.compat.cpu import CompatError, _CpuTorchView, _resolve, apply_shims, needs_cpu_shims

__all__ = ["apply_moe_shims", "applied_moe_shims", "needs_te_shim"]

_APPLIED: dict[str, bool] = {}
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_UTILS = "megatron.core.transformer.moe.moe_utils"


def needs_te_shim() -> bool:
    """True when TransformerEngine is absent: megatron's router gating then hits an unbound te_general_gemm."""
    return importlib.util.find_spec("transformer_engine") is None


# --- 1. CUDA streams in the all-to-all dispatcher --------------------------------------------------------------
class _HostEvent:
    def synchronize(self) -> None:  # host tensors are ready when the op returns
        pass


class _HostStream:
    """Stands for a CUDA stream on the host: work is already ordered, so waiting and recording do nothing."""

    def wait_stream(self, other: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _HostEvent:
        return _HostEvent()

    def synchronize(self) -> None:
        pass


class _HostCuda:
    """The `torch.cuda` the dispatcher sees without CUDA: streams and events as no-ops, the rest torch's own."""

    Stream = _HostStream
    Event = _HostEvent

    def __init__(self, real: Any) -> None:
        self._real = real
        self._current = _HostStream()

    def current_stream(self, device: Any = None) -> _HostStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: Any) -> Iterator[None]:
        yield

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


class _HostStreamsTorchView:
    """torch as token_dispatcher.py sees it on CPU: `torch.cuda` replaced by `_HostCuda`, everything else torch."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self.cuda = _HostCuda(real.cuda)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _shim_dispatcher_streams() -> None:
    mod, real = _resolve(_DISPATCHER, "torch")
    _, cls = _resolve(_DISPATCHER, "MoEAlltoAllTokenDispatcher")
    for attr in ("cuda_dtoh_stream", "_maybe_dtoh_and_synchronize"):
        if not hasattr(cls, attr):
            raise CompatError(
                f"megatron-core changed: {_DISPATCHER}.MoEAlltoAllTokenDispatcher.{attr} is gone"
            )
    if not isinstance(real, _HostStreamsTorchView):
        mod.torch = _HostStreamsTorchView(real)


# --- 2. split sizes as the GPU path gives them -------------------------------------------------------------------
def _shim_split_sizes() -> None:
    mod, real = _resolve(_DISPATCHER, "maybe_move_tensor_to_cpu")
    if getattr(real, "_megatron_branch_shim", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()  # what the CUDA branch returns: all_to_all_single takes it as a list
        return real(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._megatron_branch_shim = True  # type: ignore[attr-defined]
    mod.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu


# --- 3. te_general_gemm without TransformerEngine ----------------------------------------------------------------
def _shim_te_gemm() -> None:
    mod, fn = _resolve(_UTILS, "RouterGatingLinearFunction")
    if "te_general_gemm" not in fn.forward.__code__.co_names:
        raise CompatError(
            f"megatron-core changed: {_UTILS}.RouterGatingLinearFunction no longer reads te_general_gemm"
        )
    if not hasattr(mod, "te_general_gemm"):
        mod.te_general_gemm = None  # the value megatron's torch fallback is written for


# --- 4 and 5. moe_utils' torch: CPU factories, float64 softmax -----------------------------------------------------
class _Float64SoftmaxView:
    """torch whose `softmax(x, dtype=float32)` keeps a float64 `x` in float64 (megatron's float32 is a floor)."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def softmax(self, input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if kwargs.get("dtype") == torch.float32 and input.dtype == torch.float64:
            kwargs["dtype"] = torch.float64
        return self._real.softmax(input, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _views(module_torch: Any) -> list[Any]:
    out, t = [], module_torch
    while isinstance(t, (_CpuTorchView, _Float64SoftmaxView)):
        out.append(t)
        t = t._real
    return out


def _shim_utils_factories() -> None:
    mod, real = _resolve(_UTILS, "torch")
    _resolve(_UTILS, "track_moe_metrics")
    if not any(isinstance(v, _CpuTorchView) for v in _views(real)):
        mod.torch = _CpuTorchView(real)


def _shim_float64_softmax() -> None:
    mod, real = _resolve(_UTILS, "torch")
    for name in ("topk_routing_with_score_function", "compute_routing_scores_for_aux_loss"):
        _resolve(_UTILS, name)
    if not any(isinstance(v, _Float64SoftmaxView) for v in _views(real)):
        mod.torch = _Float64SoftmaxView(real)


# --- 6. variable-size TP collectives on gloo -----------------------------------------------------------------------
_MAPPINGS = "megatron.core.tensor_parallel.mappings"


def _shim_uneven_tp_collectives() -> None:
    import torch.distributed as dist

    mod, gather = _resolve(_MAPPINGS, "_gather_along_first_dim")
    _, scatter = _resolve(_MAPPINGS, "_reduce_scatter_along_first_dim")
    if getattr(gather, "_megatron_branch_shim", False):
        return

    def _gather_along_first_dim(
        input_: Any, group: Any, output_split_sizes: Any = None, *args: Any, **kw: Any
    ) -> Any:
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, *args, **kw)
        sizes = [int(n) for n in output_split_sizes]
        rows = max(sizes)
        padded = input_.new_zeros(rows, *input_.shape[1:])
        padded[: input_.shape[0]] = input_
        out = input_.new_empty(group.size() * rows, *input_.shape[1:])
        dist.all_gather_into_tensor(out, padded.contiguous(), group=group)
        return torch.cat([out[r * rows : r * rows + n] for r, n in enumerate(sizes)])

    def _reduce_scatter_along_first_dim(
        input_: Any, group: Any, input_split_sizes: Any = None, *args: Any, **kw: Any
    ) -> Any:
        if input_split_sizes is None or group.size() == 1:
            return scatter(input_, group, input_split_sizes, *args, **kw)
        sizes = [int(n) for n in input_split_sizes]
        rows = max(sizes)
        parts = input_.split(sizes, dim=0)
        padded = input_.new_zeros(group.size() * rows, *input_.shape[1:])
        for r, part in enumerate(parts):
            padded[r * rows : r * rows + sizes[r]] = part
        out = input_.new_empty(rows, *input_.shape[1:])
        dist.reduce_scatter_tensor(out, padded, group=group)
        return out[: sizes[group.rank()]]

    _gather_along_first_dim._megatron_branch_shim = True  # type: ignore[attr-defined]
    mod._gather_along_first_dim = _gather_along_first_dim
    mod._reduce_scatter_along_first_dim = _reduce_scatter_along_first_dim


def apply_moe_shims(*, force: bool = False) -> list[str]:
    """Apply the MoE shims this machine needs (all of them with `force`). Returns the names applied by this call."""
    shims: dict[str, Callable[[], None]] = {}
    if force or needs_cpu_shims():
        shims["moe_dispatcher_streams"] = _shim_dispatcher_streams
        shims["moe_split_sizes"] = _shim_split_sizes
        shims["moe_utils_factories"] = _shim_utils_factories
        shims["moe_uneven_tp_collectives"] = _shim_uneven_tp_collectives
    if force or needs_te_shim():
        shims["moe_te_gemm"] = _shim_te_gemm
    shims["moe_float64_softmax"] = _shim_float64_softmax
    return apply_shims(shims, _APPLIED, force=True)


def applied_moe_shims() -> list[str]:
    return [n for n, ok in _APPLIED.items() if ok]
