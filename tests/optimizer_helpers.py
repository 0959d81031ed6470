"""The optimizer settings the bf16, distributed-optimizer and offload tests share (megatron's OptimizerConfig
fields, passed as keyword arguments to the tests' trainee builders)."""

from __future__ import annotations

OFFLOAD = {
    "use_distributed_optimizer": True,
    "use_precision_aware_optimizer": True,
    "optimizer_cpu_offload": True,
}
"""megatron's hybrid CPU/GPU optimizer (the fraction is each test's own)."""

VARIANTS = {
    "plain": {},
    "distributed": {"use_distributed_optimizer": True},
    "offload": {**OFFLOAD, "optimizer_offload_fraction": 0.5},
}
"""The optimizer variants every bf16 / distributed-optimizer parity test runs."""
