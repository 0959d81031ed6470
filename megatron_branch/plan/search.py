"""The planner's search: evaluate a layout (plan/costs.py: memory by term, step time; plan/flops.py) and search
the layouts that fit.

The search (`plan`) tries every layout (TP dividing the heads, CP, PP dividing the layers (replay and packed,
dense models), DP <= prompt groups, EP for MoE, recompute), every optimizer choice (plain, distributed,
distributed + offload of 1/4 .. all of the state) and branch micro-batches (8, 4, 2, 1, at most G) that are not
fixed, and returns the fastest that fits on the device AND in the node's host memory (ties: the larger branch
micro-batch, then the least memory, then the plain optimizer); `rejected` says for every layout why its best
choice does not fit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_branch.errors import SettingError, UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.candidates import candidate_layouts, check_fixed_sizes
from megatron_branch.plan.costs import host_terms, memory_terms, step_time
from megatron_branch.plan.flops import attention_flops_per_pair, causal_pairs, step_flops
from megatron_branch.plan.memory import step_peak
from megatron_branch.plan.model import GPU, Layout, RolloutShape
from megatron_branch.plan.optimizer import OptimizerChoice, choices
from megatron_branch.plan.pipeline import root_pieces_searched
from megatron_branch.plan.result import DTYPE_BYTES, Plan
from megatron_branch.rules import (
    check_expert_tensor_parallel,
    check_gdn_context_parallel,
    check_pipeline,
    check_plannable,
    check_run,
)

SCHEDULES = ("replay", "packed", "naive")


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
    arch.check_tensor_parallel(layout.tp, etp=layout.etp)
    arch.check_expert_parallel(layout.ep, tp=layout.tp, etp=layout.etp)
    try:
        check_pipeline(
            schedule, pp=layout.pp, num_layers=arch.num_layers, moe=arch.is_moe, ep=layout.ep, ep_spans_dp=layout.ep_spans_dp,
            root_pieces=kw.get("root_pieces", 1),
            hybrid=arch.is_hybrid, mamba=arch.hybrid_override_pattern is not None, planner=True,
        )  # fmt: skip
    except SettingError as e:
        raise UserError(str(e)) from None
    if layout.dp > shape.prompts:
        raise UserError(
            f"--dp {layout.dp} needs at least as many prompt groups (--prompts {shape.prompts}): "
            "whole prefix groups go to DP ranks"
        )
    check_run(schedule, cp=layout.cp)
    check_plannable(arch, schedule=schedule, cp=layout.cp, tp=layout.tp)  # a Mamba-2 hybrid: its heads split
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
    bmb = kw.get("branch_micro_batch", 8)  # replay's leaf micro-batches: each decompresses MLA's latent
    fkey = ("flops", layout, schedule, bmb)
    if fkey not in memo:
        fl = {
            s: step_flops(arch, shape, s, layout if s == schedule else Layout(), branch_micro_batch=bmb)
            for s in SCHEDULES
        }
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
            if layout.expert_tp == layout.tp
            else f"MoE: {arch.num_experts} experts, top-{arch.moe_top_k}, EP {layout.ep}, expert TP 1: every expert "
            f"whole on each of the {layout.tp} TP ranks (their weights, gradients and optimizer state x {layout.tp}), "
            "each rank running its own sequence shard's routed rows through them (FLOPs per rank unchanged, no TP "
            f"gather of routed rows), their gradients summed over the expert data-parallel group ({layout.expert_dp} "
            "ranks); routing assumed balanced"
        )
    if arch.multi_latent:
        notes.append(
            "MLA: the prefix cache holds the compressed latent (cached_latent: kv_lora_rank + qk_rope_head_dim "
            "values per row and layer; per-head K/V in cached_kv under CP, where the ring carries K/V), each leaf "
            "micro-batch decompresses it again (FLOPs counted); MTP layers are not part of the policy (not priced)"
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
    if arch.hybrid_override_pattern is not None:
        p = arch.hybrid_override_pattern
        notes.append(
            f"Mamba-2 hybrid ({p.count('M')} Mamba-2 + {p.count('*')} attention + {p.count('-')} MLP + "
            f"{p.count('E')} MoE layers): each layer priced as its one block (plan/mamba.py), the Mamba layers with "
            "the torch SSD scan the engine runs without mamba_ssm (float32, chunked; mamba_ssm's kernel saves less); replay hands each Mamba layer's SSM state and "
            "conv tail down at the fork (cached_ssm_state: a copy of the last state), with its accumulator in "
            "kv_grads; under CP each rank runs a block of the Mamba heads (and their groups) over whole "
            "sequences (the head exchange: two all-to-alls per layer each way, the way back in float32); no PP"
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
        chunk_tokens=kw.get("chunk_tokens") if schedule == "replay" else None,
    )


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
    etp: int | None = None,
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
    stays one that every entry point runs. `chunk_tokens` (in kw): replay's token budget per packed chunk
    (ScheduleOptions.chunk_tokens; plan/memory.py step_peak), absent or None: priced without chunks. `etp`: the
    experts' tensor-parallel size, grad's --etp (None: tp; 1: every expert whole on each TP rank)."""
    if gpus <= 0:
        raise UserError(f"--gpus must be positive, got {gpus}")
    check_expert_tensor_parallel(etp, moe=arch.is_moe, tp=tp)  # rules/ (grad's): a dense model has no experts
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
        check_plannable(arch, schedule=schedule, cp=cp, tp=tp or 1)
        if tp and arch.is_hybrid:
            check_gdn_context_parallel(
                key_heads=arch.linear_num_key_heads, value_heads=arch.linear_num_value_heads, tp=tp, cp=cp
            )
    if pp:  # a fixed PP the rules refuse for this model (a Mamba-2 or GDN hybrid, a MoE at EP > 1): their own line
        spans = bool(tp and cp and ep) and Layout(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, dp=None).ep_spans_dp
        check_pipeline(
            schedule, pp=pp, moe=arch.is_moe, ep=ep or 1, hybrid=arch.is_hybrid, ep_spans_dp=spans,
            mamba=arch.hybrid_override_pattern is not None, planner=True,
        )  # fmt: skip
    check_fixed_sizes(gpus, tp=tp, cp=cp, pp=pp, dp=dp)
    if tp:  # a fixed TP the model refuses (gpt-oss's biased experts split over TP): its line, not "no layout"
        Layout(tp=tp, etp=etp)  # an --etp other than 1 or tp (parallel/layout.py)
        arch.check_tensor_parallel(tp, etp=etp)
    fixed_pp = pp or (gpus // (tp * cp * dp) if tp and cp and dp and gpus % (tp * cp * dp) == 0 else 0)
    if tp and cp and dp and recompute and fixed_pp and (ep or not arch.is_moe):
        layouts = [Layout(tp=tp, cp=cp, dp=dp, pp=fixed_pp, recompute=recompute, ep=ep or 1, etp=etp)]
        layout_given = True
    else:
        layouts = candidate_layouts(
            arch,
            shape,
            gpus,
            tp=tp,
            cp=cp,
            dp=dp,
            pp=pp,
            recompute=recompute,
            schedule=schedule,
            ep=ep,
            etp=etp,
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
        "layout": p.layout_json(),
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
        try:
            q = plan(p.model, p.arch, p.shape, p.gpu, n, schedule=p.schedule, **kw)
        except UserError:  # no layout of n GPUs (a Mamba hybrid: no CP, no PP, DP up to the prompt groups)
            continue
        if q.fits:
            lay = q.layout
            ep = f", ep {lay.ep}, etp {lay.expert_tp}" if p.arch.is_moe else ""
            out.append(
                f"{n} x {p.gpu.name} (tp {lay.tp}, cp {lay.cp}, pp {lay.pp}, dp {lay.dp}{ep}, recompute {lay.recompute})"
            )
            break
    need = p.memory["total"] / 1e9
    out.append(f"a GPU with at least {need:.0f} GB at this layout")
    same = {"dtype": p.dtype, "branch_micro_batch": p.branch_micro_batch, "root_pieces": p.root_pieces,
            "chunk_tokens": p.chunk_tokens}  # fmt: skip
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
