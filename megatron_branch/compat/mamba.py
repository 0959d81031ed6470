"""Shims that let megatron-core 0.16.1's MambaMixer (ssm/mamba_mixer.py) be BUILT where mamba_ssm / einops are
absent; its forward is never megatron's (models/mamba.py runs transformers' torch SSD scan and gated norm).

0. megatron's mamba_mixer imports, at module level, its dynamic-inference tensor ops
   (inference/contexts/attention_context/triton/tensor_ops.py), which import triton; where triton is absent that
   module is a stub whose three functions raise CompatError (only megatron's dynamic inference calls them, never
   this engine). `importable_mamba_mixer` installs it before the first import (models/mamba.py).
megatron's MambaMixer refuses to construct without mamba_ssm (`HAVE_MAMBA_SSM`: its Triton scan and gated norm,
CUDA only) and without einops (`HAVE_EINOPS`, in mamba_mixer and mamba_context_parallel: its forward's
rearranges). The constructor itself uses neither: it builds in_proj / out_proj, conv1d, dt_bias, A_log, D and the
gated norm (`ExtendedRMSNorm`, a subclass of a MagicMock without mamba_ssm: built as transformers'
NemotronHRMSNormGated instead, which BranchMambaMixer rebuilds with the model's eps in any case). Each
shim flips one flag, only where the package is missing, first checking that the name still exists (`CompatError`
otherwise); tests/unit/test_nemotron_h.py fails when one is removed or megatron changes what it patches.
`torch.cuda.current_device()` in the constructor is compat/cpu.py's shim 1.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

from megatron_branch.compat.cpu import CompatError, _resolve, apply_shims

__all__ = ["apply_mamba_shims", "importable_mamba_mixer"]
_TENSOR_OPS = "megatron.core.inference.contexts.attention_context.triton.tensor_ops"
_TENSOR_OP_NAMES = ("tensor_get_slice_after", "tensor_masked_update", "tensor_merge")


def importable_mamba_mixer() -> None:
    """Shim 0: where triton is absent, a stub for megatron's triton tensor ops (idempotent; a no-op with triton)."""
    if _TENSOR_OPS in sys.modules or importlib.util.find_spec("triton") is not None:
        return
    stub = types.ModuleType(_TENSOR_OPS)
    stub.__doc__ = "megatron_branch.compat.mamba: stub (no triton); megatron's dynamic inference only."

    def refuse(*_: Any, **__: Any) -> None:
        raise CompatError("megatron's dynamic-inference Mamba path needs triton (absent here)")

    for name in _TENSOR_OP_NAMES:
        setattr(stub, name, refuse)
    sys.modules[_TENSOR_OPS] = stub


_APPLIED: dict[str, bool] = {}
_MIXER = "megatron.core.ssm.mamba_mixer"
_CP = "megatron.core.ssm.mamba_context_parallel"


def _gated_norm(hidden_size: int, eps: float, group_size: int, dtype: Any = None, **_: Any) -> Any:
    """transformers' NemotronHRMSNormGated (norm after the gate, per group), built where megatron builds
    mamba_ssm's RMSNormGated (`ExtendedRMSNorm`)."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

    return NemotronHRMSNormGated(hidden_size, group_size=group_size, eps=eps).to(dtype)


def _shim_no_mamba_ssm() -> None:
    mod, _ = _resolve(_MIXER, "HAVE_MAMBA_SSM")
    _resolve(_MIXER, "ExtendedRMSNorm")
    mod.HAVE_MAMBA_SSM = (
        True  # the constructor's check only: models/mamba.py calls none of mamba_ssm's kernels
    )
    mod.ExtendedRMSNorm = _gated_norm  # without mamba_ssm, a subclass of a MagicMock


def _shim_no_einops() -> None:
    for name in (_MIXER, _CP):
        mod, _ = _resolve(name, "HAVE_EINOPS")
        mod.HAVE_EINOPS = True  # the constructors' check only: models/mamba.py's forward uses no einops


def apply_mamba_shims(*, force: bool = False) -> list[str]:
    """Apply the Mamba shims this machine needs (all of them with `force`). Returns the names applied by this call."""
    importable_mamba_mixer()
    shims: dict[str, Callable[[], None]] = {}
    if force or importlib.util.find_spec("mamba_ssm") is None:
        shims["mamba_no_mamba_ssm"] = _shim_no_mamba_ssm
    if force or importlib.util.find_spec("einops") is None:
        shims["mamba_no_einops"] = _shim_no_einops
    return apply_shims(shims, _APPLIED, force=True)


def applied_mamba_shims() -> list[str]:
    return [n for n, ok in _APPLIED.items() if ok]
