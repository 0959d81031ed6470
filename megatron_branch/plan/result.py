"""The planner's answer for one layout (`Plan`) and the names of its memory terms.

`memory` holds the per-rank device bytes by term (TERMS_IN_TOTAL sum to "total"; plan/costs.py memory_terms),
`host_memory` the host bytes (HOST_TERMS; plan/optimizer.py), `step_time` the estimate by part (plan/costs.py
step_time); `to_json` is what `megatron-branch plan --json` prints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.model import GPU, Layout, RolloutShape
from megatron_branch.plan.optimizer import OptimizerChoice
from megatron_branch.precision import BYTES, long_name

TERMS_IN_TOTAL = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "cached_kv",
    "cached_latent",
    "cached_ssm_state",
    "kv_grads",
    "ring_buffers",
    "logits",
    "dispatcher",
    "allocator_margin",
)


DTYPE_BYTES = {n: BYTES[long_name(n)] for n in ("bf16", "float32")}
"""--dtype: the model's parameter and activation dtype (bf16 training; float32 as `megatron-branch grad` runs)."""


HOST_TERMS = ("host_master_params", "host_optimizer_state", "host_grad_staging", "host_runtime")


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The planner's answer for one layout."""

    model: str
    arch: ModelArch
    shape: RolloutShape
    gpu: GPU
    gpus: int
    layout: Layout
    schedule: str
    memory: dict[str, int]
    """Per-rank bytes by term, and "total"."""
    flops: dict[str, float]
    step_time: dict[str, Any]
    fits: bool
    dtype: str = "bf16"
    notes: list[str] = field(default_factory=list)
    optimizer: OptimizerChoice = field(default_factory=OptimizerChoice)
    """Where the optimizer state lives (megatron's distributed optimizer / offload)."""
    host_memory: dict[str, int] = field(default_factory=dict)
    """Host bytes per rank by term, "total" per rank and "per_node" (every rank of a node)."""
    branch_micro_batch: int = 8
    """Replay: sibling leaves per forward."""
    root_pieces: int = 1
    """Replay under PP: the sequence pieces each root is cut into (data/pieces.py; 1 = whole roots)."""
    chunk_tokens: int | None = None
    """Replay: the token budget of its packed chunks it was priced with (ScheduleOptions.chunk_tokens; None: no
    chunks, and for the other schedules)."""
    rejected: list[dict[str, Any]] = field(default_factory=list)
    """The search: for every other layout, its best choice and why it does not fit (empty for a fixed plan)."""

    @property
    def fits_device(self) -> bool:
        return self.memory["total"] <= self.gpu.memory_bytes

    @property
    def fits_host(self) -> bool:
        return self.host_memory.get("per_node", 0) <= self.gpu.host_memory_bytes

    def why_not(self) -> str:
        """One line: which memory does not fit, by how much, and its largest term."""
        out = []
        if not self.fits_device:
            out.append(
                f"device {self.memory['total'] / 1e9:.1f} GB > {self.gpu.memory_gb:g} GB (largest "
                f"{self.largest_term} {self.memory[self.largest_term] / 1e9:.1f} GB)"
            )
        if not self.fits_host:
            out.append(
                f"host {self.host_memory['per_node'] / 1e9:.0f} GB per node > {self.gpu.host_memory_gb:g} GB"
            )
        return "; ".join(out) or "fits"

    @property
    def largest_term(self) -> str:
        terms = {k: v for k, v in self.memory.items() if k in TERMS_IN_TOTAL}
        return max(terms, key=terms.__getitem__)

    def layout_json(self) -> dict[str, Any]:
        """The layout's JSON: tp, cp, dp, pp, recompute; a MoE model's ep and etp (its experts' tensor-parallel
        size: tp, or 1 with every expert whole on each TP rank) too."""
        moe = {"ep": self.layout.ep, "etp": self.layout.expert_tp} if self.arch.is_moe else {}
        return {**self.layout.as_dict(), **moe}

    def to_json(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "model": self.model,
            "gpu": {
                "name": self.gpu.name,
                "count": self.gpus,
                "memory_gb": self.gpu.memory_gb,
                "tflops": self.gpu.tflops,
                "link_gbps": self.gpu.link_gbps,
                "host_memory_gb": self.gpu.host_memory_gb,
                "host_link_gbps": self.gpu.host_link_gbps,
                "gpus_per_node": self.gpu.gpus_per_node,
            },
            "shape": {
                "prompt_length": self.shape.prompt_length,
                "responses": self.shape.responses,
                "response_length": self.shape.response_length,
                "prompts": self.shape.prompts,
                "shared_response_length": self.shape.shared_response_length,
                "positions_logical": self.shape.positions_logical,
                "positions_computed": self.shape.positions_computed,
            },
            "schedule": self.schedule,
            "dtype": self.dtype,
            "layout": self.layout_json(),
            "memory_bytes_per_rank": dict(self.memory),
            "gpu_memory_bytes": self.gpu.memory_bytes,
            "largest_term": self.largest_term,
            "flops": dict(self.flops),
            "step_time_s": self.step_time["total"],
            "step_time": dict(self.step_time),
            "notes": list(self.notes),
            "optimizer": self.optimizer.as_dict(),
            "branch_micro_batch": self.branch_micro_batch,
            "root_pieces": self.root_pieces,
            "chunk_tokens": self.chunk_tokens,
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "host_memory_bytes_per_node": self.host_memory.get("per_node", 0),
            "host_memory_bytes_per_rank": {k: v for k, v in self.host_memory.items() if k != "per_node"},
            "host_memory_bytes": self.gpu.host_memory_bytes,
            "rejected": list(self.rejected),
        }
