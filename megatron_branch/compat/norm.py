"""RMSNorm/LayerNorm builders for megatron-core specs that work without apex or TransformerEngine.

megatron-core's local spec uses `WrappedTorchNorm`, which refuses sequence parallel (it cannot mark its weights
for the tensor-parallel all-reduce of their gradients) and zero-centred weights. `TorchNorm` returns a torch norm
and marks its parameters `sequence_parallel = True` when the config asks for it, which is what megatron's
`finalize_model_grads` (and our own grad reduction) looks for; with `layernorm_zero_centered_gamma` it returns
`ZeroCenteredRMSNorm` (Qwen3.5's norm: the weight is an offset from one, as TE's `zero_centered_gamma`).

`GatedOutputNorm` is the norm in a gated delta net's `out_norm` slot (megatron's ssm/gated_delta_net.py): it sees
this TP rank's value heads only, so its weight's gradient is a partial sum; it sums it over the TP group itself in
backward (megatron's `copy_to_tensor_model_parallel_region`), with or without sequence parallel. (megatron-core
0.16.1's finalize_model_grads reduces a replicated norm over TP only when it is marked sequence_parallel or named
q/k_layernorm: a GDN out_norm under TP without SP would be left partial. The weight is therefore NOT marked
sequence_parallel: it is summed exactly once, here.) It computes HF's Qwen3_5RMSNormGated norm, w * x / rms(x),
never zero-centred.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class ZeroCenteredRMSNorm(torch.nn.Module):
    """y = x / rms(x) * (1 + weight); weight initialised to zeros (HF Qwen3_5RMSNorm, TE zero_centered_gamma)."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), eps=self.eps) * (1.0 + self.weight)


class TorchNorm:
    """Spec-compatible builder: `TorchNorm(config=..., hidden_size=..., eps=...)` returns a torch norm module."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        zero_centered = getattr(config, "layernorm_zero_centered_gamma", False)
        if config.normalization == "RMSNorm" and zero_centered:
            norm: torch.nn.Module = ZeroCenteredRMSNorm(hidden_size, eps, config.params_dtype)
        elif config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm" and not zero_centered:
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(
                f"normalization {config.normalization!r} (zero-centred: {zero_centered}) is not supported"
            )
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True  # read by megatron's finalize_model_grads and parallel/grads.py
        return norm


class GatedOutputNorm(torch.nn.Module):
    """w * x / rms(x) over the last dim, w's gradient summed over the TP group (see the module docstring).

    Built by megatron's GatedDeltaNet as `build_module(out_norm, config=, hidden_size=value_head_dim, eps=)`.
    """

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__()
        from megatron.core import parallel_state

        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # construction-time default, as megatron's own layers take it (get_tensor_model_parallel_group_if_none)
        self.tp_group = parallel_state.get_tensor_model_parallel_group(check_initialized=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if self.tp_group is not None and self.tp_group.size() > 1:
            from megatron.core.tensor_parallel.mappings import copy_to_tensor_model_parallel_region

            w = copy_to_tensor_model_parallel_region(
                w, group=self.tp_group
            )  # identity; backward: sum over TP
        return F.rms_norm(x, (x.shape[-1],), weight=w, eps=self.eps)
