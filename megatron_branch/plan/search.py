"""The planner: evaluate a layout (memory by term, FLOPs, step time) and search the layouts that fit.

Step-time model (stated assumptions, not measurements):
  * compute = executed FLOPs per rank / (peak bf16 FLOP/s x MFU), MFU = 0.45 for every kind of FLOP;
  * ring attention (CP): per layer and chunk, W-1 K/V block hops forward, W-1 again in backward (the K/V travel
    once more) and W dK/dV hops in fp32 (parallel/ring.py); each hop is posted before the block is computed, so
    the transfer hides behind the attention compute when the ring's time is at most the attention time; only the
    excess is exposed;
  * the head exchange (CP, a hybrid's gated delta net layers, parallel/head_exchange.py): per GDN layer and chunk
    two all-to-alls forward and two backward, each rank sending (W-1) blocks of its rows; counted as exposed (the
    layer waits for them);
  * tensor + sequence parallel: per layer 2 all-gathers and 2 reduce-scatters of [s, h] forward and again
    backward, not overlapped;
  * gradient reduction over DP x CP (all-reduce of the fp32 grads; with the distributed optimizer a
    reduce-scatter of them and an all-gather of the parameters), counted as exposed (conservative: megatron can
    overlap it with backward); a MoE model's expert grads (and their optimizer shards) over the expert
    data-parallel group (cp * dp / ep);
  * the optimizer offload: host<->device copies of the offloaded shards' gradients and parameters and the host
    Adam step, counted as exposed (plan/optimizer.py);
  * expert parallelism (MoE, alltoall dispatcher): per MoE layer and token, its k copies of [h] go out and come
    back (dispatch + combine) forward and again backward, (ep - 1)/ep of them to another rank, not overlapped;
    routing assumed balanced (the load-balancing losses' aim);
  * pipeline parallelism: the bubble of the tree's waves and the stage-to-stage messages (plan/pipeline.py).
GPU links at the GPU's stated bandwidth within a node, at `node_link_gbps` for a group that spans nodes
(megatron's rank order: tp fastest, then cp, dp, pp; plan/pipeline.py), host links at `host_link_gbps`.

The search (`plan`) tries every layout (TP dividing the heads, CP, PP dividing the layers (replay and packed,
dense models), DP <= prompt groups, EP for MoE, recompute), every optimizer choice (plain, distributed,
distributed + offload of 1/4 .. all of the state) and branch micro-batches (8, 4, 2, 1, at most G) that are not
fixed, and returns the fastest that fits on the device AND in the node's host memory (ties: the larger branch
micro-batch, then the least memory, then the plain optimizer); `rejected` says for every layout why its best
choice does not fit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from megatron_branch.errors import SettingError, UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.flops import StepFlops, attention_flops_per_pair, causal_pairs, step_flops
from megatron_branch.plan.layers import gdn_exchange_bytes
from megatron_branch.plan.memory import Dims, Peak, cdiv, local_rows, margin_bytes, static_bytes, step_peak
from megatron_branch.plan.model import GPU, RECOMPUTE, Layout, RolloutShape
from megatron_branch.plan.optimizer import (
    OptimizerChoice,
    choices,
    grad_reduce_bytes,
    offload_seconds,
    optimizer_bytes,
)
from megatron_branch.plan.pipeline import link_bytes_per_s, pipeline_seconds, root_pieces_searched
from megatron_branch.rules import (
    check_gdn_context_parallel,
    check_pipeline,
    check_run,
    gdn_context_parallel_sizes,
)

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
    optimizer: OptimizerChoice = field(default_factory=OptimizerChoice)
    """Where the optimizer state lives (megatron's distributed optimizer / offload)."""
    host_memory: dict[str, int] = field(default_factory=dict)
    """Host bytes per rank by term, "total" per rank and "per_node" (every rank of a node)."""
    branch_micro_batch: int = 8
    """Replay: sibling leaves per forward."""
    root_pieces: int = 1
    """Replay under PP: the sequence pieces each root is cut into (data/pieces.py; 1 = whole roots)."""
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
            "layout": {**self.layout.as_dict(), **({"ep": self.layout.ep} if self.arch.is_moe else {})},
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
            "fits_device": self.fits_device,
            "fits_host": self.fits_host,
            "host_memory_bytes_per_node": self.host_memory.get("per_node", 0),
            "host_memory_bytes_per_rank": {k: v for k, v in self.host_memory.items() if k != "per_node"},
            "host_memory_bytes": self.gpu.host_memory_bytes,
            "rejected": list(self.rejected),
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


HOST_TERMS = ("host_master_params", "host_optimizer_state", "host_grad_staging", "host_runtime")


def memory_terms(
    arch: ModelArch,
    shape: RolloutShape,
    layout: Layout,
    schedule: str,
    *,
    dtype: str = "bf16",
    optimizer: OptimizerChoice | None = None,
    peak: Peak | None = None,
    **kw: Any,
) -> dict[str, int]:
    """Per-rank device bytes by term and the total (default: the distributed optimizer, no offload; `peak`: the
    step's peak when already computed)."""
    e = DTYPE_BYTES[dtype]
    st = static_bytes(arch, layout, param_bytes=e)
    opt = sharded_optimizer_bytes(arch, layout, optimizer or OptimizerChoice(), param_bytes=e)
    pk: Peak = peak or step_peak(arch, shape, layout, schedule=schedule, act_bytes=e, **kw)
    mem = {
        "parameters": st["parameters"],
        "gradients": st["gradients"],
        "optimizer_state": opt["device"],
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


def param_shards(arch: ModelArch, layout: Layout) -> list[tuple[int, int]]:
    """(parameters on one rank, ranks their optimizer state and gradients are reduced over): the dense ones over
    DP x CP; a MoE model's routed experts over the expert data-parallel group (cp * dp / ep)."""
    st = static_bytes(arch, layout)
    experts = st["expert_parameters_per_rank"]
    out = [(st["parameters_per_rank"] - experts, layout.dp * layout.cp)]
    return out + ([(experts, layout.expert_dp)] if experts else [])


def sharded_optimizer_bytes(
    arch: ModelArch, layout: Layout, choice: OptimizerChoice, *, param_bytes: int
) -> dict[str, int]:
    """plan/optimizer.py's optimizer_bytes summed over `param_shards` (the host runtime counted once)."""
    parts = [
        optimizer_bytes(n, over, choice, param_bytes=param_bytes) for n, over in param_shards(arch, layout)
    ]
    out = {k: sum(p[k] for p in parts) for k in parts[0]}
    out["host_runtime"] = parts[0]["host_runtime"]
    return out


def host_terms(
    arch: ModelArch, layout: Layout, gpu: GPU, optimizer: OptimizerChoice, *, dtype: str
) -> dict[str, int]:
    """Host bytes per rank by term, their total, and per node (gpu.gpus_per_node ranks, or the world if fewer)."""
    e = DTYPE_BYTES[dtype]
    opt = sharded_optimizer_bytes(arch, layout, optimizer, param_bytes=e)
    out = {k: opt[k] for k in HOST_TERMS}
    out["total"] = sum(out.values())
    out["per_node"] = out["total"] * min(gpu.gpus_per_node, layout.world)
    return out


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
    return groups * dm.attn_layers * total  # GDN layers of a hybrid have no ring


def _chunk_rows(shape: RolloutShape, layout: Layout, schedule: str) -> list[int]:
    """Local rows of every chunk one rank runs per prompt group (and again for a recomputed root), as the head
    exchange sees them: packed one chunk; replay the root, each response's leaf rows, the recomputed root."""
    if schedule == "packed" or shape.responses == 1:
        return [local_rows(shape.positions_computed // shape.prompts, 1, layout)]
    r_root = local_rows(shape.root_length, 1, layout)
    chunks = [r_root] + [local_rows(shape.leaf_length, 1, layout)] * shape.responses
    if layout.recompute in ("selective", "full"):
        chunks.append(r_root)
    return chunks


def _exchange_bytes_per_rank(arch: ModelArch, shape: RolloutShape, layout: Layout, schedule: str) -> float:
    """Bytes one rank sends in head exchanges over the step (a hybrid's GDN layers under CP; forward + backward,
    plus per-layer recompute's second forward), at 2-byte activations."""
    if layout.cp == 1 or schedule == "naive" or not arch.is_hybrid:
        return 0.0
    groups = cdiv(shape.prompts, layout.dp)
    passes = 3 if layout.recompute == "full" else 2  # forward, backward (and the recomputed forward)
    sent = [
        gdn_exchange_bytes(arch, r, tp=layout.tp, cp=layout.cp, e=2)
        for r in _chunk_rows(shape, layout, schedule)
    ]
    per_layer = passes * sum(sent)
    if schedule == "replay" and shape.responses > 1 and layout.recompute in ("selective", "full"):
        per_layer -= (passes - 1) * sent[0]  # the root's first forward keeps no graph: no backward of its own
    return float(groups * arch.num_linear_layers * per_layer)


def step_time(
    arch: ModelArch,
    shape: RolloutShape,
    layout: Layout,
    gpu: GPU,
    schedule: str,
    fl: StepFlops,
    dtype: str = "bf16",
    optimizer: OptimizerChoice | None = None,
    branch_micro_batch: int = 8,
    root_pieces: int = 1,
) -> dict[str, Any]:
    world = layout.world
    rate = gpu.tflops * 1e12 * MFU
    compute = fl.total / world / rate
    attention = fl.attention / world / rate
    ring = (
        _ring_bytes_per_rank(arch, shape, layout, schedule)
        * DTYPE_BYTES[dtype]
        / 2
        / link_bytes_per_s(gpu, layout, "cp")
    )
    exposed_ring = max(0.0, ring - attention)
    exchange = (
        _exchange_bytes_per_rank(arch, shape, layout, schedule)
        * DTYPE_BYTES[dtype]
        / 2
        / link_bytes_per_s(gpu, layout, "cp")
    )
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
            / layout.pp  # each rank runs its stage's layers
            / link_bytes_per_s(gpu, layout, "tp")
        )
    opt = optimizer or OptimizerChoice()
    link = link_bytes_per_s(gpu, layout, "dp", "cp")  # the gradient reduction's (and EP's, inside dp x cp)
    grads, host = 0.0, {"offload_transfer": 0.0, "host_optimizer_step": 0.0}
    for n, over in param_shards(arch, layout):
        grads += grad_reduce_bytes(n, over, opt, param_bytes=DTYPE_BYTES[dtype]) / link
        part = offload_seconds(n, over, opt, link_gbps=gpu.host_link_gbps, adam_gbps=gpu.host_adam_gbps)
        host = {k: host[k] + part[k] for k in host}
    a2a = 0.0
    if arch.is_moe and layout.ep > 1:
        rows = (fl.positions + fl.recomputed_positions) / layout.world  # tokens routed per rank (SP rows)
        per_token = 4 * arch.moe_top_k * arch.hidden_size * DTYPE_BYTES[dtype] * (layout.ep - 1) / layout.ep
        a2a = (
            1.5 * rows * per_token * len(arch.moe_layers) / link
        )  # forward x1 (+ recompute), backward x2 -> 3/2
    pipe = pipeline_seconds(
        arch, shape, layout, gpu, schedule, fl, rate=rate, act_bytes=DTYPE_BYTES[dtype],
        branch_micro_batch=branch_micro_batch, root_pieces=root_pieces,
    )  # fmt: skip
    return {
        "total": compute
        + exposed_ring
        + exchange
        + tp
        + grads
        + a2a
        + host["offload_transfer"]
        + host["host_optimizer_step"]
        + pipe["pipeline_bubble"]
        + pipe["pipeline_messages"],
        **host,
        "expert_alltoall": a2a,
        **pipe,
        "compute": compute,
        "attention_compute": attention,
        "ring": ring,
        "ring_exposed": exposed_ring,
        "ring_hidden": ring <= attention,
        "head_exchange": exchange,
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
    optimizer: OptimizerChoice | None = None,
    memo: dict[Any, Any] | None = None,
    **kw: Any,
) -> Plan:
    """The plan of one fixed layout and optimizer choice (default: the distributed optimizer, no offload). `memo`:
    a dict the search shares between the evaluations of one layout (its FLOPs and peaks do not depend on the
    optimizer choice)."""
    memo = {} if memo is None else memo
    optimizer = optimizer or OptimizerChoice()
    if layout.world != gpus:
        raise UserError(f"tp * cp * pp * dp = {layout.world} must equal --gpus {gpus}")
    arch.check_tensor_parallel(layout.tp)
    arch.check_expert_parallel(layout.ep, tp=layout.tp)
    try:
        check_pipeline(
            schedule, pp=layout.pp, num_layers=arch.num_layers, hybrid=arch.is_hybrid, moe=arch.is_moe,
            root_pieces=kw.get("root_pieces", 1),
        )  # fmt: skip
    except SettingError as e:
        raise UserError(str(e)) from None
    if layout.dp > shape.prompts:
        raise UserError(
            f"--dp {layout.dp} needs at least as many prompt groups (--prompts {shape.prompts}): "
            "whole prefix groups go to DP ranks"
        )
    check_run(schedule, cp=layout.cp)
    if arch.is_hybrid:
        check_gdn_context_parallel(
            key_heads=arch.linear_num_key_heads,
            value_heads=arch.linear_num_value_heads,
            tp=layout.tp,
            cp=layout.cp,
        )
    if dtype not in DTYPE_BYTES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    pkey = ("peak", layout, schedule, dtype, tuple(sorted(kw.items())))
    if pkey not in memo:
        memo[pkey] = step_peak(arch, shape, layout, schedule=schedule, act_bytes=DTYPE_BYTES[dtype], **kw)
    mem = memory_terms(arch, shape, layout, schedule, dtype=dtype, optimizer=optimizer, peak=memo[pkey])
    host = host_terms(arch, layout, gpu, optimizer, dtype=dtype)
    fkey = ("flops", layout, schedule)
    if fkey not in memo:
        fl = {s: step_flops(arch, shape, s, layout if s == schedule else Layout()) for s in SCHEDULES}
        memo[fkey] = fl, step_flops(arch, shape, "stop_gradient").total
    fl, stop_gradient = memo[fkey]
    mine = fl[schedule]
    flops = {
        "naive": fl["naive"].total,
        "packed": fl["packed"].total,
        "replay": fl["replay"].total,
        "stop_gradient": stop_gradient,
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
    if optimizer.offload_fraction:
        notes.append(
            f"offload {optimizer.offload_fraction:g}: that fraction of the optimizer state and its fp32 master "
            "copy in host memory, stepped by the host (megatron's HybridDeviceOptimizer; optim."
            "optimizer_cpu_offload + optimizer_offload_fraction, with use_distributed_optimizer and "
            "use_precision_aware_optimizer)"
        )
    if layout.recompute == "full":
        notes.append(
            "full = segment recompute + per-layer activation checkpointing inside every chunk (grad "
            "--recompute --recompute-layers): each layer keeps its input, one layer is rebuilt at a time "
            "in backward, one more forward of every layer"
        )
    if layout.pp > 1:
        notes.append(
            f"pp {layout.pp}: the heavier end stage's memory ({arch.num_layers // layout.pp} layers, vocab x h, "
            "the micro-batches 1F1B keeps alive on the first stage); the bubble is the root chunk crossing the "
            "stages one after another (cut into root pieces: its dearest piece) plus (pp - 1) leaf micro-batches "
            "per wave (plan/pipeline.py); train's "
            "sampler under PP runs a whole-model copy (not counted here: sample with an external engine at "
            "this size)"
        )
    if arch.is_hybrid:
        notes.append(
            f"hybrid ({arch.num_linear_layers} gated delta net + {arch.num_full_layers} full-attention layers): GDN "
            "layers planned with fla's kernel (plan/layers.py), no K/V and no ring; replay hands each GDN layer's "
            "state at the fork down (S + conv tail, with its gradient accumulator); under CP each rank runs a block "
            "of the GDN heads over whole sequences (the head exchange: two all-to-alls per layer each way)"
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
        step_time=step_time(
            arch,
            shape,
            layout,
            gpu,
            schedule,
            mine,
            dtype,
            optimizer,
            branch_micro_batch=kw.get("branch_micro_batch", 8),
            root_pieces=kw.get("root_pieces", 1),
        ),
        fits=mem["total"] <= gpu.memory_bytes and host["per_node"] <= gpu.host_memory_bytes,
        dtype=dtype,
        notes=notes,
        optimizer=optimizer,
        host_memory=host,
        branch_micro_batch=kw.get("branch_micro_batch", 8),
        root_pieces=kw.get("root_pieces", 1),
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
    pp: int | None = None,
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
        for p in (pp,) if pp else [p for p in (1, 2, 4, 8) if (gpus // t) % p == 0]:
            if (gpus // t) % p or not _runs(schedule, 1, p, arch):
                continue
            rest = gpus // (t * p)
            for c in (cp,) if cp else [c for c in range(1, rest + 1) if rest % c == 0]:
                if rest % c or not _runs(schedule, c, 1, arch) or not _splits_gdn_heads(arch, t, c):
                    continue
                d = rest // c
                if (dp and d != dp) or d > shape.prompts:
                    continue
                for e in _expert_parallel_sizes(arch, t, c * d, ep):
                    for rc in (recompute,) if recompute else RECOMPUTE:
                        out.append(Layout(tp=t, cp=c, dp=d, pp=p, recompute=rc, ep=e))
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


def _runs(schedule: str, cp: int, pp: int, arch: ModelArch) -> bool:
    """The schedule can run at this CP / PP size (rules.py: naive has no CP and no PP; PP divides the layers)."""
    try:
        check_run(schedule, cp=cp)
        check_pipeline(schedule, pp=pp, num_layers=arch.num_layers, hybrid=arch.is_hybrid, moe=arch.is_moe)
    except UserError:
        return False
    return True


def _splits_gdn_heads(arch: ModelArch, tp: int, cp: int) -> bool:
    """A hybrid's GDN heads split into cp head blocks on a TP rank (rules.check_gdn_context_parallel)."""
    if not arch.is_hybrid:
        return True
    sizes = gdn_context_parallel_sizes(
        key_heads=arch.linear_num_key_heads, value_heads=arch.linear_num_value_heads, tp=tp
    )
    return cp in sizes


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
    pp: int | None = None,
    ep: int | None = None,
    distributed_optimizer: bool | None = None,
    offload_fraction: float | None = None,
    branch_micro_batch: int | None = None,
    root_pieces: int | str | None = None,
    **kw: Any,
) -> Plan:
    """The recommended plan: among the layouts x optimizer choices x branch micro-batches that fit on the device
    and in host memory (fixed fields kept), the fastest (full recompute costs one more forward of every layer and
    offload its copies and host step, so they win only where nothing lighter fits); if none fits, the one needing
    least device memory. `rejected` lists, per other layout, its best choice and why it does not fit.
    `root_pieces`: None = whole roots; K = replay's roots in K pieces (PP layouts only); "auto" = searched per PP
    layout (plan/pipeline.py root_pieces_searched). Not searched by default: train's sampler cannot run the pipeline
    layouts pieces favour at these sizes (a whole-model copy per rank, docs/parallelism.md), so the default answer
    stays one that every entry point runs."""
    if gpus <= 0:
        raise UserError(f"--gpus must be positive, got {gpus}")
    if schedule not in SCHEDULES:
        raise UserError(f"--schedule must be one of {', '.join(SCHEDULES)}")
    if branch_micro_batch is not None and branch_micro_batch <= 0:
        raise UserError(f"--branch-micro-batch must be positive, got {branch_micro_batch}")
    if root_pieces == "auto" and schedule != "replay":
        raise UserError(f"--root-pieces auto applies to --schedule replay only, not {schedule}")
    if isinstance(root_pieces, int):  # without PP or for another schedule: the rule's own line (pp: any > 1)
        check_pipeline(schedule, pp=pp or 2, root_pieces=root_pieces)
    if cp:  # a fixed CP size the rules refuse: their own line, not the search's "no layout" (which hides why)
        check_run(schedule, cp=cp)
        if tp and arch.is_hybrid:
            check_gdn_context_parallel(
                key_heads=arch.linear_num_key_heads, value_heads=arch.linear_num_value_heads, tp=tp, cp=cp
            )
    fixed_pp = pp or (gpus // (tp * cp * dp) if tp and cp and dp and gpus % (tp * cp * dp) == 0 else 0)
    if tp and cp and dp and recompute and fixed_pp and (ep or not arch.is_moe):
        layouts = [Layout(tp=tp, cp=cp, dp=dp, pp=fixed_pp, recompute=recompute, ep=ep or 1)]
        layout_given = True
    else:
        layouts = candidate_layouts(
            arch, shape, gpus, tp=tp, cp=cp, dp=dp, pp=pp, recompute=recompute, schedule=schedule, ep=ep
        )
        layout_given = False
    if root_pieces == "auto" or (isinstance(root_pieces, int) and root_pieces > 1):  # pieces need a pipeline
        layouts = [lay for lay in layouts if lay.pp > 1]
    if not layouts:
        raise UserError(
            f"no layout of {gpus} GPUs satisfies the fixed --tp/--cp/--pp/--dp (dp <= --prompts {shape.prompts}, "
            f"tp dividing the heads, pp the layers)"
        )
    opts = choices(distributed_optimizer, offload_fraction)
    bmbs = (branch_micro_batch,) if branch_micro_batch else micro_batches(shape, schedule)
    best_per_layout = []
    memo: dict[Any, Any] = {}  # FLOPs per layout, peaks per layout and micro-batch: computed once
    for lay in layouts:
        plans = [
            evaluate(
                model,
                arch,
                shape,
                gpu,
                gpus,
                lay,
                schedule,
                optimizer=o,
                memo=memo,
                branch_micro_batch=b,
                root_pieces=k,
                **kw,
            )
            for o in opts
            for b in bmbs
            for k in _pieces(root_pieces, shape, lay, schedule)
        ]
        fitting = [p for p in plans if p.fits]
        best_per_layout.append(min(fitting, key=_speed) if fitting else min(plans, key=_need))
    fitting = [p for p in best_per_layout if p.fits]
    best = min(fitting, key=_speed) if fitting else min(best_per_layout, key=_need)
    if layout_given:
        return best
    rejected = [_rejection(p) for p in best_per_layout if p is not best and not p.fits]
    return dataclasses.replace(best, rejected=rejected)


def _pieces(
    root_pieces: int | str | None, shape: RolloutShape, layout: Layout, schedule: str
) -> tuple[int, ...]:
    """The root piece counts to evaluate `layout` at (plan's `root_pieces`)."""
    if root_pieces == "auto":
        return root_pieces_searched(shape, layout, schedule)
    return (root_pieces or 1,)  # type: ignore[return-value]


def micro_batches(shape: RolloutShape, schedule: str) -> tuple[int, ...]:
    """Branch micro-batches the search tries: 8, 4, 2, 1 (at most G; replay only, the others ignore it)."""
    if schedule != "replay":
        return (8,)
    return tuple(b for b in (8, 4, 2, 1) if b <= max(shape.responses, 1)) or (1,)


def _speed(p: Plan) -> tuple:
    return (
        round(p.step_time["total"], 6),
        -p.branch_micro_batch,
        p.memory["total"],
        p.optimizer.distributed,
        p.root_pieces,
    )


def _need(p: Plan) -> tuple:
    return (p.memory["total"], p.host_memory.get("per_node", 0), p.step_time["total"])


def _rejection(p: Plan) -> dict[str, Any]:
    return {
        "layout": {**p.layout.as_dict(), **({"ep": p.layout.ep} if p.arch.is_moe else {})},
        "optimizer": p.optimizer.name,
        "branch_micro_batch": p.branch_micro_batch,
        "root_pieces": p.root_pieces,
        "memory_bytes_per_rank": p.memory["total"],
        "host_memory_bytes_per_node": p.host_memory.get("per_node", 0),
        "largest_term": p.largest_term,
        "reason": p.why_not(),
    }


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
                f"{n} x {p.gpu.name} (tp {lay.tp}, cp {lay.cp}, pp {lay.pp}, dp {lay.dp}{ep}, recompute {lay.recompute})"
            )
            break
    need = p.memory["total"] / 1e9
    out.append(f"a GPU with at least {need:.0f} GB at this layout")
    same = {"dtype": p.dtype, "branch_micro_batch": p.branch_micro_batch, "root_pieces": p.root_pieces}
    if p.layout.recompute != "full":
        full = dataclasses.replace(p.layout, recompute="full")
        q = evaluate(p.model, p.arch, p.shape, p.gpu, p.gpus, full, p.schedule, optimizer=p.optimizer, **same)
        if q.fits:
            out.append("per-layer activation checkpointing inside chunks (recompute full)")
    if p.optimizer.offload_fraction < 1:
        host = OptimizerChoice(distributed=True, offload_fraction=1.0)
        q = evaluate(p.model, p.arch, p.shape, p.gpu, p.gpus, p.layout, p.schedule, optimizer=host, **same)
        if q.fits:
            out.append("the optimizer state on the host (optim.optimizer_cpu_offload, fraction 1)")
    out.append("activation offload (not in the engine yet)")
    return out


def attention_pairs(shape: RolloutShape, schedule: str) -> int:
    """Visible (query, key) pairs of the step (for the bench comparison)."""
    N, G, R, L = shape.prompts, shape.responses, shape.root_length, shape.leaf_length
    if schedule == "naive":
        return N * G * causal_pairs(shape.rollout_length)
    return N * (causal_pairs(R) + G * causal_pairs(L, R))


__all__ = [
    "OptimizerChoice",
    "Plan",
    "attention_flops_per_pair",
    "attention_pairs",
    "evaluate",
    "plan",
    "what_would_fit",
]
