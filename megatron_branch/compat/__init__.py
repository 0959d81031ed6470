"""Compatibility layers for running megatron-core where it assumes CUDA, apex or TransformerEngine."""

from megatron_branch.compat.cpu import CompatError, CpuRNGStatesTracker, apply_cpu_shims, needs_cpu_shims

__all__ = ["CompatError", "CpuRNGStatesTracker", "apply_cpu_shims", "needs_cpu_shims"]
