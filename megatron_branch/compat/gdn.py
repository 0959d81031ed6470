"""Shims that let megatron-core 0.16.1's GatedDeltaNet (ssm/gated_delta_net.py) run where fla's kernels cannot.

megatron's GatedDeltaNet imports `l2norm` and `chunk_gated_delta_rule` from flash-linear-attention (fla), whose
Triton kernels need a GPU, and refuses to build without them (`HAVE_FLA`), although with
`config.deterministic_mode` it never calls `chunk_gated_delta_rule`: it runs torch's conv1d and its own
`torch_chunk_gated_delta_rule` (float32 inside, whatever the input dtype). Measured on CPU (docs/design.md). Each
shim below replaces exactly one assumption, is applied only where it is needed, is idempotent, and first checks that
the name it patches still exists (`CompatError` otherwise); tests/unit/test_compat_gdn.py fails when one is removed
or megatron changes what it patches.

1. `gated_delta_net.HAVE_FLA` and `gated_delta_net.l2norm` (where fla cannot run: no CUDA, or fla absent): the
   module builds, and q/k are L2-normalised by `l2norm` below, fla's formula x / sqrt(sum x^2 + eps) with its
   default eps 1e-6 (transformers' qwen3_5 computes the same, in float32). `deterministic_mode` (set by
   ModelArch.to_transformer_config from `gdn_uses_torch_path`) then selects the torch conv and delta rule.
2. `GatedDeltaNet._apply_gated_norm` (no CUDA only): megatron decorates it with `jit_fuser`, which is
   torch.compile in torch >= 2.2; on CPU that compiles with inductor and a C++ compiler on first call (tens of
   seconds, per shape). The shim restores the decorated function itself (`_torchdynamo_orig_callable`): the same
   math, eagerly.
3. `torch.cuda.current_device()` in the constructor (conv1d, dt_bias, A_log) is compat/cpu.py's shim 1.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch

from megatron_branch.compat.cpu import _resolve, apply_shims, needs_cpu_shims

__all__ = ["apply_gdn_shims", "gdn_uses_torch_path", "l2norm"]

_APPLIED: dict[str, bool] = {}
_MODULE = "megatron.core.ssm.gated_delta_net"


def gdn_uses_torch_path() -> bool:
    """True where megatron's GatedDeltaNet must run its torch path: no CUDA, or flash-linear-attention absent."""
    return needs_cpu_shims() or importlib.util.find_spec("fla") is None


def l2norm(x: torch.Tensor, dim: int = -1, eps: float = 1e-6) -> torch.Tensor:
    """fla.modules.l2norm's math in torch: x / sqrt(sum(x^2) + eps) over `dim`, in x's dtype."""
    return x * torch.rsqrt((x * x).sum(dim=dim, keepdim=True) + eps)


def _shim_fla_fallback() -> None:
    mod, _ = _resolve(_MODULE, "HAVE_FLA")
    _resolve(_MODULE, "torch_chunk_gated_delta_rule")  # the path deterministic_mode selects
    mod.HAVE_FLA = True
    mod.l2norm = l2norm  # never fla's Triton l2norm where the torch path runs


def _shim_uncompiled_gated_norm() -> None:
    mod, cls = _resolve(_MODULE, "GatedDeltaNet")
    if not hasattr(cls, "_apply_gated_norm"):
        from megatron_branch.compat.cpu import CompatError

        raise CompatError(f"megatron-core changed: {_MODULE}.GatedDeltaNet._apply_gated_norm is gone")
    fn = cls.__dict__["_apply_gated_norm"]
    orig = getattr(fn, "_torchdynamo_orig_callable", None)
    if orig is not None:
        cls._apply_gated_norm = orig


def apply_gdn_shims(*, force: bool = False) -> list[str]:
    """Apply the GDN shims this machine needs (all of them with `force`). Returns the names applied by this call."""
    shims: dict[str, Callable[[], None]] = {}
    if force or gdn_uses_torch_path():
        shims["gdn_fla_fallback"] = _shim_fla_fallback
    if force or needs_cpu_shims():
        shims["gdn_uncompiled_gated_norm"] = _shim_uncompiled_gated_norm
    return apply_shims(shims, _APPLIED, force=True)


def applied_gdn_shims() -> list[str]:
    return [n for n, ok in _APPLIED.items() if ok]
