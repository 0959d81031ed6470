"""An RMSNorm/LayerNorm builder for megatron-core specs that works without apex or TransformerEngine.

megatron-core's local spec uses `WrappedTorchNorm`, which refuses sequence parallel (it cannot mark its weights
for the tensor-parallel all-reduce of their gradients). This builder returns the same torch module and marks its
parameters `sequence_parallel = True` when the config asks for it, which is what megatron's
`finalize_model_grads` (and our own grad reduction) looks for. It is used only where apex/TE norms are absent.
"""

from __future__ import annotations

from typing import Any

import torch


class TorchNorm:
    """Spec-compatible builder: `TorchNorm(config=..., hidden_size=..., eps=...)` returns a torch norm module."""

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:  # type: ignore[misc]
        if config.normalization == "RMSNorm":
            norm: torch.nn.Module = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        elif config.normalization == "LayerNorm":
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            raise ValueError(f"normalization {config.normalization!r} is not supported")
        if config.sequence_parallel:
            for p in norm.parameters():
                p.sequence_parallel = True  # read by megatron's finalize_model_grads and parallel/grads.py
        return norm
