"""Where the optimizer state lives, as the planner sees it: megatron's plain optimizer, its distributed optimizer
(state sharded over DP x CP) and its CPU offload (a fraction of that state and its fp32 master copy on the host).

Bytes per parameter on one rank (n = the rank's parameters after TP, s = dp * cp, f = offload fraction, e = the
parameter bytes), as Megatron-LM's `theoretical_memory_usage.py` counts them (18 B/param plain, 6 + 12 / s
distributed, for bf16) and as megatron-core 0.16's optimizer allocates them (update/optimizer.py runs it):

    device  parameters        e                    bf16 2 B; the DDP parameter buffer with the distributed optimizer
            gradients         4                    fp32 main grads (megatron's grad buffer, grad_reduce_in_fp32)
            optimizer state   (4 [master] + 8 [Adam m, v]) * (1 - f) / s      plain: s = 1, f = 0
    host    master copies     4 * f / s            the hybrid optimizer's fp32 copy of each offloaded shard
            optimizer state   8 * f / s            Adam's moments of the offloaded shards
            gradient staging  4 * f / s            the host copy of their gradients (pinned)
            runtime           HOST_RUNTIME_BYTES   per rank: CUDA context, pinned staging, the process itself

A float32 model has no separate master copy (megatron's fp32 path steps the parameter itself): 8 B of optimizer
state instead of 12 (the host copy of an offloaded float32 shard is then the master, 4 B, as for bf16).

Per step, the offloaded shards cost (stated assumptions, not measurements):
  * host <-> device traffic: the gradients down (4 B) and the updated parameters up (4 B, fp32 copied into the
    device parameter), 8 * f * n / s bytes per rank over the GPU's host link, counted as exposed;
  * the host Adam step: torch's fused CPU AdamW reads parameter, gradient, m, v and writes parameter, m, v
    (28 B per element), at the host memory bandwidth one rank gets, counted as exposed (megatron can overlap
    copies and host steps: overlap_cpu_optimizer_d2h_h2d; the planner does not count on it).
The gradient reduction: plain = all-reduce of the fp32 grads over DP x CP (2 (s-1)/s * 4 B per parameter),
distributed = reduce-scatter of the fp32 grads + all-gather of the updated parameters ((s-1)/s * (4 + e)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_branch.errors import UserError

HOST_RUNTIME_BYTES = 8 * 2**30
"""Host memory per rank besides the offloaded state (CUDA context, pinned buffers, the process): an assumption."""
HOST_ADAM_BYTES_PER_ELEMENT = 28
"""Bytes the fused CPU AdamW moves per element (read p, g, m, v; write p, m, v; fp32)."""
OFFLOAD_FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The offload fractions the search tries (megatron's optimizer_offload_fraction)."""


@dataclass(frozen=True, kw_only=True)
class OptimizerChoice:
    """megatron's optimizer options that decide where the state lives (update/optimizer.py's names)."""

    distributed: bool = True
    """use_distributed_optimizer: the master copy and moments sharded over DP x CP."""
    offload_fraction: float = 0.0
    """optimizer_cpu_offload with optimizer_offload_fraction = this (0 = no offload)."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise UserError(f"--offload-fraction must be in [0, 1], got {self.offload_fraction}")
        if self.offload_fraction > 0 and not self.distributed:
            raise UserError("--offload-fraction needs the distributed optimizer (megatron's rule)")

    @property
    def name(self) -> str:
        if not self.distributed:
            return "plain"
        return f"distributed + offload {self.offload_fraction:g}" if self.offload_fraction else "distributed"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "use_distributed_optimizer": self.distributed,
            "optimizer_cpu_offload": self.offload_fraction > 0,
            "optimizer_offload_fraction": self.offload_fraction,
        }


def choices(distributed: bool | None, offload_fraction: float | None) -> list[OptimizerChoice]:
    """The optimizer choices to search: the given ones fixed, the rest tried (offload only where distributed)."""
    if distributed is False and offload_fraction:
        raise UserError("--offload-fraction needs the distributed optimizer (megatron's rule)")
    out = []
    for d in (distributed,) if distributed is not None else (False, True):
        fracs = (offload_fraction,) if offload_fraction is not None else (OFFLOAD_FRACTIONS if d else (0.0,))
        out += [OptimizerChoice(distributed=d, offload_fraction=f) for f in fracs if d or not f]
    return out


def optimizer_bytes(
    per_rank: int, shard: int, choice: OptimizerChoice, *, param_bytes: int
) -> dict[str, int]:
    """Device and host bytes of one rank's optimizer state for `per_rank` parameters (module doc)."""
    master = 4 if param_bytes < 4 else 0  # fp32 (and wider) parameters are their own master copy
    s = shard if choice.distributed else 1
    f = choice.offload_fraction
    on_device = (master + 8) * per_rank * (1 - f) / s
    off = per_rank * f / s
    return {
        "device": int(on_device),
        "host_master_params": int(4 * off),
        "host_optimizer_state": int(8 * off),
        "host_grad_staging": int(4 * off),
        "host_runtime": HOST_RUNTIME_BYTES,
    }


def offload_seconds(
    per_rank: int, shard: int, choice: OptimizerChoice, *, link_gbps: float, adam_gbps: float
) -> dict[str, float]:
    """Host<->device transfer and host Adam step time of one rank per step (module doc)."""
    off = per_rank * choice.offload_fraction / (shard if choice.distributed else 1)
    return {
        "offload_transfer": 8 * off / (link_gbps * 1e9),
        "host_optimizer_step": HOST_ADAM_BYTES_PER_ELEMENT * off / (adam_gbps * 1e9),
    }


def grad_reduce_bytes(per_rank: int, shard: int, choice: OptimizerChoice, *, param_bytes: int) -> float:
    """Bytes one rank sends to reduce its gradients over DP x CP (and, distributed, gather the parameters)."""
    if shard == 1:
        return 0.0
    frac = (shard - 1) / shard
    if choice.distributed:
        return frac * per_rank * (4 + param_bytes)  # reduce-scatter fp32 grads, all-gather parameters
    return 2 * frac * per_rank * 4  # all-reduce fp32 grads
