"""Shims that let megatron-core 0.16.1's CPU-offload optimizer (HybridDeviceOptimizer) run on a CPU-only machine.

megatron's HybridDeviceOptimizer (optimizer/cpu_offloading/hybrid_optimizer.py; `optimizer_cpu_offload`,
`optimizer_offload_fraction`) splits the parameters it is given by `param.is_cuda`: the first
`offload_fraction` of the device parameters (by element count) get a pinned host copy (`.cpu().pin_memory()`),
a torch AdamW on the host steps that copy from a host copy of the gradient, and a post-step hook copies it back to
the device parameter; the rest step on the device. Copies run on CUDA streams (`torch.cuda.current_stream()`,
`torch.cuda.Stream()`, events). On a machine without CUDA every tensor is a host tensor, so megatron would offload
nothing and then fail looking up the device twin of a host parameter; pinning and streams raise without CUDA.

On CPU the host plays both parts. Each shim below replaces one of those assumptions (compat/cpu.py's pattern:
applied only without CUDA, idempotent, loud when megatron renames its target):

1. `hybrid_optimizer.torch`: a view of torch whose `cuda` streams and events are synchronous no-ops (a copy on
   the CPU is complete when it returns) and whose factories ignore `pin_memory` (no pinned allocator without
   CUDA). Only that module sees it.
2. `HybridDeviceOptimizer._get_sub_optimizer_param_groups`: while megatron splits the parameters, the tensors it
   was given (the distributed optimizer's shards) and the device-side copies it makes answer `is_cuda` True, the
   host copies (`.cpu()` and what is made of them) False, and `.pin_memory()` returns the tensor
   (`cpu_plays_device`). So megatron's own split runs: which
   parameters are copied, which stay, the fp32 copies, the maps between them. megatron always asks for the
   update "in fp32" (`param_update_in_fp32=True`: a `.float()` master copy of every non-fp32 parameter, meant to
   widen bf16 / fp16); for a float64 parameter that would narrow the update, so during the split `.float()` of a
   float64 tensor keeps it float64 (the master copy is float64: CPU float64 runs stay exact).
3. `HybridDeviceOptimizer._move_new_state_to_right_device` (after a checkpoint load): megatron moves the device
   optimizer's state `.to("cuda")`; here both sides are the CPU, so the state is re-linked without a move.
4. `optimizer_config.is_te_min_version`: megatron requires `use_precision_aware_optimizer` with the offload (the
   hybrid optimizer reuses that flag's code path), and `OptimizerConfig.__post_init__` then compares
   TransformerEngine's version, which is None without TE (TypeError). Without TE the answer is "no" (False).

Everything else (gradients staged to the host copies, the host AdamW step, the copy back, the state sync with
the distributed optimizer, checkpoints) is megatron's code. tests/unit/test_offload.py shows the offload path runs
and equals the plain optimizer; on a GPU nothing here runs (tests/gpu/test_gpu_offload.py checks the state is on
the host there).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from megatron_branch.compat.cpu import CompatError, _CpuTorchView, _resolve

__all__ = ["apply_offload_fixes", "cpu_plays_device", "offload_shims"]

_MODULE = "megatron.core.optimizer.cpu_offloading.hybrid_optimizer"


class _SyncStream:
    """A CUDA stream's interface on the CPU, where every copy is synchronous."""

    def wait_stream(self, other: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> _SyncEvent:
        return _SyncEvent()

    def synchronize(self) -> None:
        return None


class _SyncEvent:
    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None


class _SyncCuda:
    """`torch.cuda` as hybrid_optimizer.py uses it: streams and events only."""

    def current_stream(self, device: Any = None) -> _SyncStream:
        return _SyncStream()

    def default_stream(self, device: Any = None) -> _SyncStream:
        return _SyncStream()

    def Stream(self, *a: Any, **kw: Any) -> _SyncStream:  # noqa: N802 - torch.cuda.Stream
        return _SyncStream()

    def stream(self, s: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def is_available(self) -> bool:
        return False


class _HostOnlyTorch(_CpuTorchView):
    """torch for hybrid_optimizer.py on CPU: synchronous `cuda` streams, factories without `pin_memory`."""

    def __getattr__(self, name: str) -> Any:
        if name == "cuda":
            return _SyncCuda()
        attr = super().__getattr__(name)
        if name in ("zeros", "ones", "empty", "tensor", "full"):
            return _unpinned(attr)
        return attr


def _unpinned(fn: Any) -> Any:
    @functools.wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    return wrapped


def _shim_streams() -> None:
    mod, real = _resolve(_MODULE, "torch")
    _resolve(_MODULE, "HybridDeviceOptimizer")
    if not isinstance(real, _HostOnlyTorch):
        mod.torch = _HostOnlyTorch(real)


@contextlib.contextmanager
def cpu_plays_device() -> Iterator[None]:
    """While active, the CPU plays both the device and the host: every CPU tensor answers `is_cuda` True except
    host copies, which are what `.cpu()` returns (a copy, as a device-to-host copy is) and what `.detach()`,
    `.clone()`, `.float()` and `.pin_memory()` make of a host copy. `.pin_memory()` of a CPU tensor returns it (no
    pinned memory without CUDA); `.float()` of a float64 tensor returns it (an update "in fp32" of a float64
    parameter stays float64). Scoped to megatron's parameter split; torch.Tensor's methods are restored on exit."""
    host: set[int] = set()
    alive: list[torch.Tensor] = []  # host copies stay referenced while the scope lasts: their ids stay unique
    names = ("cpu", "detach", "clone", "float", "pin_memory")
    real = {n: getattr(torch.Tensor, n) for n in names}

    def mark(t: torch.Tensor) -> torch.Tensor:
        host.add(id(t))
        alive.append(t)
        return t

    def cpu(t: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
        return mark(real["clone"](t) if t.device.type == "cpu" else real["cpu"](t, *a, **kw))

    def derived(name: str) -> Any:
        def method(t: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
            keep = (name == "pin_memory" and t.device.type == "cpu") or (
                name == "float" and t.dtype == torch.float64
            )
            out = t if keep else real[name](t, *a, **kw)
            return mark(out) if id(t) in host else out

        return method

    torch.Tensor.is_cuda = property(  # type: ignore[assignment,method-assign]
        lambda t: t.device.type == "cuda" or (t.device.type == "cpu" and id(t) not in host)
    )
    torch.Tensor.cpu = cpu  # type: ignore[method-assign]
    for n in names[1:]:
        setattr(torch.Tensor, n, derived(n))
    try:
        yield
    finally:
        del torch.Tensor.is_cuda  # back to TensorBase's own
        for n, fn in real.items():
            setattr(torch.Tensor, n, fn)


def _method(name: str) -> tuple[type, Any]:
    _, cls = _resolve(_MODULE, "HybridDeviceOptimizer")
    fn = getattr(cls, name, None)
    if fn is None:
        raise CompatError(
            f"megatron-core changed: {_MODULE}.HybridDeviceOptimizer.{name} is gone; megatron-branch's CPU shims "
            "target megatron-core 0.16.1"
        )
    return cls, fn


def _shim_split() -> None:
    cls, orig = _method("_get_sub_optimizer_param_groups")
    if getattr(orig, "_megatron_branch_cpu", False):
        return

    @functools.wraps(orig)
    def _get_sub_optimizer_param_groups(self: Any, offload_fraction: float) -> Any:
        with cpu_plays_device():
            return orig(self, offload_fraction)

    _get_sub_optimizer_param_groups._megatron_branch_cpu = True  # type: ignore[attr-defined]
    cls._get_sub_optimizer_param_groups = _get_sub_optimizer_param_groups


def _move_new_state_in_place(self: Any) -> None:
    """megatron's `_move_new_state_to_right_device` where host and device are one: re-link, do not move."""
    for optimizer in self.sub_optimizers:
        for param, state in optimizer.state.items():
            orig_param = self.inner_param_to_orig_param.get(param, param)
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    self.state[orig_param][k] = state[k] = v.to("cpu")


def _shim_state_move() -> None:
    cls, orig = _method("_move_new_state_to_right_device")
    if getattr(orig, "_megatron_branch_cpu", False):
        return
    _move_new_state_in_place._megatron_branch_cpu = True  # type: ignore[attr-defined]
    cls._move_new_state_to_right_device = _move_new_state_in_place


def _shim_te_version() -> None:
    mod, real = _resolve("megatron.core.optimizer.optimizer_config", "is_te_min_version")
    utils, get_te_version = _resolve("megatron.core.utils", "get_te_version")
    if getattr(real, "_megatron_branch_cpu", False):
        return

    @functools.wraps(real)
    def is_te_min_version(version: str, check_equality: bool = True) -> bool:
        if get_te_version() is None:  # TransformerEngine is not installed
            return False
        return real(version, check_equality)

    is_te_min_version._megatron_branch_cpu = True  # type: ignore[attr-defined]
    mod.is_te_min_version = is_te_min_version


# --- a megatron-core 0.16.1 bug, fixed on every device -----------------------------------------------------------
# With the offload the distributed optimizer hands each main shard its gradient as `decoupled_grad` (the
# precision-aware path), and `_set_sub_optimizer_grads` turns it into `.grad` only for the host copies and the
# fp32 copies of bf16 / fp16 parameters. A parameter that stays on the device and needs no fp32 copy (a float32
# parameter with offload_fraction < 1) keeps `.grad` None, so the device optimizer (torch or TE Adam, which read
# `.grad`) silently never steps it (measured: those parameters unchanged after 3 steps). The fix hands such a
# parameter its `decoupled_grad` as `.grad` after megatron's own method; nothing else changes.
_FIXED: dict[str, bool] = {}


def _set_device_grads(self: Any) -> None:
    if self.gpu_optimizer is None:
        return
    for group in self.gpu_optimizer.param_groups:
        for p in group["params"]:
            if p in self.fp32_param_to_orig_param:  # an fp32 copy: megatron set its .grad
                continue
            grad = getattr(p, "decoupled_grad", None)
            if grad is not None:
                p.grad = grad


def apply_offload_fixes() -> list[str]:
    """Apply the device-gradient fix once (on any device). Returns the names applied by this call."""
    if _FIXED.get("offload_device_grads"):
        return []
    cls, orig = _method("_set_sub_optimizer_grads")
    _method("_init_sub_optimizers")

    @functools.wraps(orig)
    def _set_sub_optimizer_grads(self: Any) -> None:
        orig(self)
        _set_device_grads(self)

    _set_sub_optimizer_grads._megatron = orig  # type: ignore[attr-defined]
    cls._set_sub_optimizer_grads = _set_sub_optimizer_grads
    _FIXED["offload_device_grads"] = True
    return ["offload_device_grads"]


def offload_shims() -> dict[str, Any]:
    """The shims, by name, for compat/optimizer.py's applier."""
    return {
        "offload_streams": _shim_streams,
        "offload_param_split": _shim_split,
        "offload_state_move": _shim_state_move,
        "optimizer_config_te_version": _shim_te_version,
    }
