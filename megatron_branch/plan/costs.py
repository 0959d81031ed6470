"""What one layout costs: per-rank device memory by term, host memory, and the step-time estimate.

Step-time model (stated assumptions, not measurements):
  * compute = executed FLOPs per rank / (peak bf16 FLOP/s x MFU), MFU = 0.45 for every kind of FLOP;
  * ring attention (CP): per layer and chunk, W-1 K/V block hops forward, W-1 again in backward (the K/V travel
    once more) and W dK/dV hops in fp32 (parallel/ring.py); each hop is posted before the block is computed, so
    the transfer hides behind the attention compute when the ring's time is at most the attention time; only the
    excess is exposed;
  * the head exchange (CP, a hybrid's gated delta net layers or a Mamba-2 hybrid's M layers,
    parallel/head_exchange.py): per GDN / M layer and chunk two all-to-alls forward and two backward, each rank
    sending (W-1) blocks of its rows (an M layer's way back in float32); counted as exposed (the layer waits for
    them);
  * tensor + sequence parallel: per layer 2 all-gathers and 2 reduce-scatters of [s, h] forward and again
    backward (a Mamba hybrid's one-block layers: 1 and 1), not overlapped; with every expert whole on each TP rank
    (expert TP 1) a MoE layer without a shared expert gathers nothing for its experts (each rank routes its own
    sequence shard): 1 and 1;
  * gradient reduction over DP x CP (all-reduce of the fp32 grads; with the distributed optimizer a
    reduce-scatter of them and an all-gather of the parameters), counted as exposed (conservative: megatron can
    overlap it with backward); a MoE model's expert grads (and their optimizer shards) over the expert
    data-parallel group (tp / etp * cp * dp / ep: at expert TP 1 it spans the TP ranks too);
  * the optimizer offload: host<->device copies of the offloaded shards' gradients and parameters and the host
    Adam step, counted as exposed (plan/optimizer.py);
  * expert parallelism (MoE, alltoall dispatcher): per MoE layer and token, its k copies of [h] go out and come
    back (dispatch + combine) forward and again backward, (ep - 1)/ep of them to another rank, not overlapped;
    routing assumed balanced (the load-balancing losses' aim);
  * pipeline parallelism: the bubble of the tree's waves and the stage-to-stage messages (plan/pipeline.py).
GPU links at the GPU's stated bandwidth within a node, at `node_link_gbps` for a group that spans nodes
(megatron's rank order: tp fastest, then cp, dp, pp; plan/pipeline.py), host links at `host_link_gbps`.
"""

from __future__ import annotations

from typing import Any

from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.activations import Dims
from megatron_branch.plan.flops import StepFlops
from megatron_branch.plan.layers import gdn_exchange_bytes
from megatron_branch.plan.mamba import mamba_exchange_bytes
from megatron_branch.plan.memory import Peak, cdiv, local_rows, margin_bytes, static_bytes, step_peak
from megatron_branch.plan.model import GPU, Layout, RolloutShape
from megatron_branch.plan.optimizer import (
    OptimizerChoice,
    grad_reduce_bytes,
    offload_seconds,
    optimizer_bytes,
)
from megatron_branch.plan.pipeline import link_bytes_per_s, pipeline_seconds
from megatron_branch.plan.result import DTYPE_BYTES, HOST_TERMS, TERMS_IN_TOTAL

MFU = 0.45
"""Assumed fraction of peak FLOP/s a kernel reaches (dense and attention alike)."""


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
    latent = arch.multi_latent and layout.cp == 1
    mem = {
        "parameters": st["parameters"],
        "gradients": st["gradients"],
        "optimizer_state": opt["device"],
        "optimizer_state_no_distributed": st["optimizer_state_no_distributed"],
        "activations": pk.activations,
        # MLA on one rank per CP group: the prefix cache is the compressed latent, its own term (plan/mla.py)
        "cached_kv": 0 if latent else pk.cached_kv,
        "cached_latent": pk.cached_kv if latent else 0,
        # a Mamba hybrid's fork states (SSM state + conv tail per M layer; plan/mamba.py)
        "cached_ssm_state": pk.cached_state,
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
    DP x CP; a MoE model's routed experts over the expert data-parallel group (tp / etp * cp * dp / ep)."""
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


def _whole_expert_layers(arch: ModelArch, layout: Layout) -> int:
    """MoE layers with no TP collective around their experts: every expert whole on each TP rank (expert TP 1 <
    tp) and no shared expert (which stays split over TP and gathers the sequence like a dense MLP)."""
    if layout.expert_tp == layout.tp or arch.shared_expert_ffn_hidden_size or arch.hybrid_override_pattern:
        return 0
    return len(arch.moe_layers)


def _mamba_exchange_bytes_per_rank(
    arch: ModelArch, shape: RolloutShape, layout: Layout, schedule: str, *, e: int
) -> float:
    """Bytes one rank sends in head exchanges over the step (a Mamba-2 hybrid's M layers under CP; forward +
    backward, plus per-layer recompute's second forward) at e-byte activations: the way back carries the scan's
    float32 output whatever e is (plan/mamba.py mamba_exchange_bytes), so this one is not scaled from 2 bytes."""
    if layout.cp == 1 or schedule == "naive" or arch.hybrid_override_pattern is None:
        return 0.0
    groups = cdiv(shape.prompts, layout.dp)
    passes = 3 if layout.recompute == "full" else 2  # forward, backward (and the recomputed forward)
    sent = [
        mamba_exchange_bytes(arch, r, tp=layout.tp, cp=layout.cp, e=e)
        for r in _chunk_rows(shape, layout, schedule)
    ]
    per_layer = passes * sum(sent)
    if schedule == "replay" and shape.responses > 1 and layout.recompute in ("selective", "full"):
        per_layer -= (passes - 1) * sent[0]  # the root's first forward keeps no graph: no backward of its own
    return float(groups * arch.hybrid_override_pattern.count("M") * per_layer)


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
    ) + _mamba_exchange_bytes_per_rank(
        arch, shape, layout, schedule, e=DTYPE_BYTES[dtype]
    ) / link_bytes_per_s(gpu, layout, "cp")
    tp = 0.0
    if layout.tp > 1:
        rows = fl.positions / (layout.cp * layout.dp) + fl.recomputed_positions / (layout.cp * layout.dp)
        # 2 all-gathers + 2 reduce-scatters per layer each way; a Mamba hybrid's layer is ONE block: 1 + 1
        per_layer = 8 if arch.hybrid_override_pattern is None else 4
        tp = (
            per_layer
            * (layout.tp - 1)
            / layout.tp
            * rows
            * arch.hidden_size
            * DTYPE_BYTES[dtype]
            * (
                arch.num_layers - _whole_expert_layers(arch, layout) / 2
            )  # such a layer: its attention's 4 only
            / layout.pp  # each rank runs its stage's layers
            / link_bytes_per_s(gpu, layout, "tp")
        )
    opt = optimizer or OptimizerChoice()
    link = link_bytes_per_s(gpu, layout, "dp", "cp")  # the gradient reduction's (and EP's, inside dp x cp)
    # whole experts on each TP rank: their expert-DP group spans the TP ranks as well
    expert_link = link_bytes_per_s(gpu, layout, "tp", "dp", "cp") if layout.expert_tp < layout.tp else link
    grads, host = 0.0, {"offload_transfer": 0.0, "host_optimizer_step": 0.0}
    for i, (n, over) in enumerate(param_shards(arch, layout)):
        grads += grad_reduce_bytes(n, over, opt, param_bytes=DTYPE_BYTES[dtype]) / (
            expert_link if i else link
        )
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
