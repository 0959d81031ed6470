"""The planner: evaluate a layout (memory by term, FLOPs, step time) and search the layouts that fit.

Step-time model (stated assumptions, not measurements):
  * compute = executed FLOPs per rank / (peak bf16 FLOP/s x MFU), MFU = 0.45 for every kind of FLOP;
  * ring attention (CP): per layer and chunk, W-1 K/V block hops forward, W-1 again in backward (the K/V travel
    once more) and W dK/dV hops in fp32 (parallel/ring.py); each hop is posted before the block is computed, so
    the transfer hides behind the attention compute when the ring's time is at most the attention time; only the
    excess is exposed;
  * tensor + sequence parallel: per layer 2 all-gathers and 2 reduce-scatters of [s, h] forward and again
    backward, not overlapped;
  * gradient reduction over DP x CP (reduce-scatter + all-gather of fp32 grads with the distributed optimizer),
    counted as exposed (conservative: megatron can overlap it with backward); a MoE model's expert grads over
    the expert data-parallel group (cp * dp / ep);
  * expert parallelism (MoE, alltoall dispatcher): per MoE layer and token, its k copies of [h] go out and come
    back (dispatch + combine) forward and again backward, (ep - 1)/ep of them to another rank, not overlapped;
    routing assumed balanced (the load-balancing losses' aim).
All links at the GPU's stated bandwidth (one NVLink node).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.flops import StepFlops, attention_flops_per_pair, causal_pairs, step_flops
from megatron_branch.plan.memory import Dims, Peak, cdiv, local_rows, margin_bytes, static_bytes, step_peak
from megatron_branch.plan.model import GPU, RECOMPUTE, Layout, RolloutShape

MFU = 0.45
"""Assumed fraction of peak FLOP/s a kernel reaches (dense and attention alike)."""

SCHEDULES = ("replay", "packed", "naive")


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

    @property
    def largest_term(self) -> str:
        terms = {k: v for k, v in self.memory.items() if k in TERMS_IN_TOTAL}
        return max(terms, key=terms.__getitem__)

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
            "layout": {**self.layout.as_dict(), **({"ep": self.layout.ep} if self.arch.is_moe else {})},
            "memory_bytes_per_rank": dict(self.memory),
            "gpu_memory_bytes": self.gpu.memory_bytes,
            "largest_term": self.largest_term,
            "flops": dict(self.flops),
            "step_time_s": self.step_time["total"],
            "step_time": dict(self.step_time),
            "notes": list(self.notes),
        }


TERMS_IN_TOTAL = (
    "parameters",
    "gradients",
    "optimizer_state",
    "activations",
    "cached_kv",
    "kv_grads",
    "ring_buffers",
    "logits",
    "dispatcher",
    "allocator_margin",
)


DTYPE_BYTES = {"bf16": 2, "float32": 4}
"""--dtype: the model's parameter and activation dtype (bf16 training; float32 as `megatron-branch grad` runs)."""


def memory_terms(
    arch: ModelArch, shape: RolloutShape, layout: Layout, schedule: str, *, dtype: str = "bf16", **kw: Any
) -> dict[str, int]:
    """Per-rank bytes by term and the total (distributed optimizer)."""
    e = DTYPE_BYTES[dtype]
    st = static_bytes(arch, layout, param_bytes=e)
    pk: Peak = step_peak(arch, shape, layout, schedule=schedule, act_bytes=e, **kw)
    mem = {
        "parameters": st["parameters"],
        "gradients": st["gradients"],
        "optimizer_state": st["optimizer_state"],
        "optimizer_state_no_distributed": st["optimizer_state_no_distributed"],
        "activations": pk.activations,
        "cached_kv": pk.cached_kv,
        "kv_grads": pk.kv_grads,
        "ring_buffers": pk.ring_buffers,
        "logits": pk.logits,
        "dispatcher": pk.dispatcher,
    }
    if arch.is_moe:
        mem["expert_parameters"] = st["expert_parameters_per_rank"] * e
    counted = sum(mem[k] for k in TERMS_IN_TOTAL if k != "allocator_margin")
    mem["allocator_margin"] = margin_bytes(counted)
    mem["total"] = counted + mem["allocator_margin"]
    return mem


def _ring_bytes_per_rank(arch: ModelArch, shape: RolloutShape, layout: Layout, schedule: str) -> float:
    """Bytes one rank sends around the ring over the step (forward + backward, all layers, all chunks)."""
    cp = layout.cp
    if cp == 1 or schedule == "naive":
        return 0.0
    dm = Dims.of(arch, layout, 2)
    groups = cdiv(shape.prompts, layout.dp)
    if schedule == "packed" or shape.responses == 1:
        chunks = [local_rows(shape.positions_computed // shape.prompts, 1, layout)]
    else:
        r_root = local_rows(shape.root_length, 1, layout)
        leaf = local_rows(shape.leaf_length, 1, layout)
        chunks = [r_root] + [r_root + leaf] * shape.responses  # leaves send [cached | own] keys
        if layout.recompute in ("selective", "full"):
            chunks.append(r_root)
    per_row = 2 * dm.g * dm.d  # k and v
    total = 0.0
    for keys in chunks:
        kv = keys * per_row * dm.e
        total += (cp - 1) * kv * 2 + cp * keys * per_row * 4  # K/V forward + backward, dK/dV in fp32
    return groups * dm.layers * total


def step_time(
    arch: ModelArch,
    shape: RolloutShape,
    layout: Layout,
    gpu: GPU,
    schedule: str,
    fl: StepFlops,
    dtype: str = "bf16",
) -> dict[str, Any]:
    world = layout.world
    rate = gpu.tflops * 1e12 * MFU
    link = gpu.link_gbps * 1e9
    compute = fl.total / world / rate
    attention = fl.attention / world / rate
    ring = _ring_bytes_per_rank(arch, shape, layout, schedule) * DTYPE_BYTES[dtype] / 2 / link
    exposed_ring = max(0.0, ring - attention)
    tp = 0.0
    if layout.tp > 1:
        rows = fl.positions / (layout.cp * layout.dp) + fl.recomputed_positions / (layout.cp * layout.dp)
        tp = (
            8
            * (layout.tp - 1)
            / layout.tp
            * rows
            * arch.hidden_size
            * DTYPE_BYTES[dtype]
            * arch.num_layers
            / link
        )
    shard = layout.dp * layout.cp
    grads = 0.0
    st = static_bytes(arch, layout)
    dense_params = st["parameters_per_rank"] - st["expert_parameters_per_rank"]
    if shard > 1:
        grads = 2 * (shard - 1) / shard * dense_params * 4 / link
    if layout.expert_dp > 1:
        edp = layout.expert_dp
        grads += 2 * (edp - 1) / edp * st["expert_parameters_per_rank"] * 4 / link
    a2a = 0.0
    if arch.is_moe and layout.ep > 1:
        rows = (fl.positions + fl.recomputed_positions) / layout.world  # tokens routed per rank (SP rows)
        per_token = 4 * arch.moe_top_k * arch.hidden_size * DTYPE_BYTES[dtype] * (layout.ep - 1) / layout.ep
        a2a = (
            1.5 * rows * per_token * len(arch.moe_layers) / link
        )  # forward x1 (+ recompute), backward x2 -> 3/2
    return {
        "total": compute + exposed_ring + tp + grads + a2a,
        "expert_alltoall": a2a,
        "compute": compute,
        "attention_compute": attention,
        "ring": ring,
        "ring_exposed": exposed_ring,
        "ring_hidden": ring <= attention,
        "tensor_parallel_comm": tp,
        "grad_reduce": grads,
        "mfu_assumed": MFU,
    }


def evaluate(
    model: str,
    arch: ModelArch,
    shape: RolloutShape,
    gpu: GPU,
    gpus: int,
    layout: Layout,
    schedule: str = "replay",
    dtype: str = "bf16",
    **kw: Any,
) -> Plan:
    """The plan of one fixed layout."""
    if layout.world != gpus:
        raise UserError(f"tp * cp * dp = {layout.world} must equal --gpus {gpus}")
    arch.check_tensor_parallel(layout.tp)
    arch.check_expert_parallel(layout.ep, tp=layout.tp)
    if layout.dp > shape.prompts:
        raise UserError(
            f"--dp {layout.dp} needs at least as many prompt groups (--prompts {shape.prompts}): "
            "whole prefix groups go to DP ranks"
        )
    if schedule == "naive" and layout.cp > 1:
        raise UserError(
            "the naive schedule has no context parallelism; use --cp 1 or --schedule replay|packed"
        )
    if dtype not in DTYPE_BYTES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    mem = memory_terms(arch, shape, layout, schedule, dtype=dtype, **kw)
    fl = {s: step_flops(arch, shape, s, layout if s == schedule else Layout()) for s in SCHEDULES}
    mine = fl[schedule]
    flops = {
        "naive": fl["naive"].total,
        "packed": fl["packed"].total,
        "replay": fl["replay"].total,
        "stop_gradient": step_flops(arch, shape, "stop_gradient").total,
        "this_schedule": mine.total,
        "ratio": fl["naive"].total / mine.total,
        "attention_fraction": mine.attention / mine.total,
        "per_rank": mine.total / layout.world,
    }
    notes = []
    if arch.is_moe:
        notes.append(
            f"MoE: {arch.num_experts} experts, top-{arch.moe_top_k}, EP {layout.ep} (expert TP = TP); routing assumed "
            "balanced; with a load-balancing loss the tree schedules add one forward-only counting pass of the step"
        )
    if layout.recompute == "selective":
        notes.append(
            "selective = the engine's segment recompute (replay keeps no graph for a segment with children); "
            "megatron's core-attention recompute saves nothing here (fused attention stores no score matrix)"
        )
    if layout.recompute == "full":
        notes.append(
            "full = segment recompute + per-layer activation checkpointing inside every chunk (grad "
            "--recompute --recompute-layers): each layer keeps its input, one layer is rebuilt at a time "
            "in backward, one more forward of every layer"
        )
    return Plan(
        model=model,
        arch=arch,
        shape=shape,
        gpu=gpu,
        gpus=gpus,
        layout=layout,
        schedule=schedule,
        memory=mem,
        flops=flops,
        step_time=step_time(arch, shape, layout, gpu, schedule, mine, dtype),
        fits=mem["total"] <= gpu.memory_bytes,
        dtype=dtype,
        notes=notes,
    )


def candidate_layouts(
    arch: ModelArch,
    shape: RolloutShape,
    gpus: int,
    *,
    tp: int | None,
    cp: int | None,
    dp: int | None,
    recompute: str | None,
    schedule: str,
    ep: int | None = None,
) -> list[Layout]:
    out = []
    for t in (tp,) if tp else (1, 2, 4, 8):
        if gpus % t:
            continue
        try:
            arch.check_tensor_parallel(t)
        except UserError:
            continue
        for c in (cp,) if cp else [c for c in range(1, gpus // t + 1) if (gpus // t) % c == 0]:
            if (gpus // t) % c or (schedule == "naive" and c > 1):
                continue
            d = gpus // (t * c)
            if (dp and d != dp) or d > shape.prompts:
                continue
            for e in _expert_parallel_sizes(arch, t, c * d, ep):
                for rc in (recompute,) if recompute else RECOMPUTE:
                    out.append(Layout(tp=t, cp=c, dp=d, recompute=rc, ep=e))
    return out


def _expert_parallel_sizes(arch: ModelArch, tp: int, cp_dp: int, ep: int | None) -> list[int]:
    """EP sizes to try: the fixed one, else (MoE) every divisor of cp * dp that splits the experts."""
    if ep:
        return [ep] if cp_dp % ep == 0 else []
    if not arch.is_moe:
        return [1]
    out = []
    for e in range(1, cp_dp + 1):
        if cp_dp % e == 0:
            try:
                arch.check_expert_parallel(e, tp=tp)
            except UserError:
                continue
            out.append(e)
    return out


def plan(
    model: str,
    arch: ModelArch,
    shape: RolloutShape,
    gpu: GPU,
    gpus: int,
    *,
    tp: int | None = None,
    cp: int | None = None,
    dp: int | None = None,
    recompute: str | None = None,
    schedule: str = "replay",
    ep: int | None = None,
    **kw: Any,
) -> Plan:
    """The recommended plan: among the layouts that fit (fixed fields kept), the fastest (full recompute costs one
    more forward of every layer, so it wins only where nothing lighter fits); if none fits, the one needing least
    memory."""
    if gpus <= 0:
        raise UserError(f"--gpus must be positive, got {gpus}")
    if schedule not in SCHEDULES:
        raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)}")
    if tp and cp and dp and recompute and (ep or not arch.is_moe):
        layout = Layout(tp=tp, cp=cp, dp=dp, recompute=recompute, ep=ep or 1)
        return evaluate(model, arch, shape, gpu, gpus, layout, schedule, **kw)
    layouts = candidate_layouts(
        arch, shape, gpus, tp=tp, cp=cp, dp=dp, recompute=recompute, schedule=schedule, ep=ep
    )
    if not layouts:
        raise UserError(
            f"no layout of {gpus} GPUs satisfies the fixed --tp/--cp/--dp (dp <= --prompts {shape.prompts}, "
            f"tp dividing the heads)"
        )
    plans = [evaluate(model, arch, shape, gpu, gpus, lay, schedule, **kw) for lay in layouts]
    fitting = [p for p in plans if p.fits]
    if fitting:
        return min(fitting, key=lambda p: (p.step_time["total"], p.memory["total"]))
    return min(plans, key=lambda p: p.memory["total"])


def what_would_fit(p: Plan, **kw: Any) -> list[str]:
    """For a plan that does not fit: the smallest changes that would (more GPUs of this kind, a bigger GPU)."""
    out = []
    for n in (16, 32, 64):
        if n <= p.gpus:
            continue
        q = plan(p.model, p.arch, p.shape, p.gpu, n, schedule=p.schedule, **kw)
        if q.fits:
            lay = q.layout
            ep = f", ep {lay.ep}" if p.arch.is_moe else ""
            out.append(
                f"{n} x {p.gpu.name} (tp {lay.tp}, cp {lay.cp}, dp {lay.dp}{ep}, recompute {lay.recompute})"
            )
            break
    need = p.memory["total"] / 1e9
    out.append(f"a GPU with at least {need:.0f} GB at this layout")
    if p.layout.recompute != "full":
        q = evaluate(
            p.model,
            p.arch,
            p.shape,
            p.gpu,
            p.gpus,
            Layout(tp=p.layout.tp, cp=p.layout.cp, dp=p.layout.dp, recompute="full", ep=p.layout.ep),
            p.schedule,
            **kw,
        )
        if q.fits:
            out.append("per-layer activation checkpointing inside chunks (recompute full)")
    out.append("pipeline parallelism or optimizer/activation offload (not in the engine yet)")
    return out


def attention_pairs(shape: RolloutShape, schedule: str) -> int:
    """Visible (query, key) pairs of the step (for the bench comparison)."""
    N, G, R, L = shape.prompts, shape.responses, shape.root_length, shape.leaf_length
    if schedule == "naive":
        return N * G * causal_pairs(shape.rollout_length)
    return N * (causal_pairs(R) + G * causal_pairs(L, R))


__all__ = ["Plan", "attention_flops_per_pair", "attention_pairs", "evaluate", "plan", "what_would_fit"]
