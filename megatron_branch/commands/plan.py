"""`megatron-branch plan`: will this batch fit, in which layout, at what cost (arithmetic only, no GPU).

    megatron-branch plan --model PRESET|CONFIG.json --prompt-length P --responses G --response-length S
        [--prompts N] [--shared-response-length K] --gpus N --gpu h20|h100|h200
        [--gpu-memory-gb M --gpu-tflops T --link-gbps B] [--host-memory-gb H --host-link-gbps L]
        [--node-link-gbps B] [--tp N --cp N --pp N --dp N --recompute none|selective|full] [--ep N] [--etp 1]
        [--optimizer plain|distributed] [--offload-fraction F] [--branch-micro-batch B] [--root-pieces K|auto]
        [--chunk-tokens N] [--schedule replay|packed|naive] [--json]
        [--turns T [--observation-length O] [--branch-at-turns 2,4]]

A mixture-of-experts model (qwen3-30b-a3b, or a Qwen3-MoE / Mixtral / Qwen2-MoE config.json) adds expert
parallelism (--ep, searched when not given), its expert parameters per EP rank, the dispatcher's buffers and the
top-k experts' FLOPs. --etp 1 (grad's flag) prices every expert whole on each TP rank: expert weights, grads and
optimizer state x tp, each rank's own sequence shard through them, the expert grads summed over the expert
data-parallel group (default: the experts split over TP).
An agentic tree (--turns: --response-length tokens per policy turn, the bench's description, plan/agentic.py)
adds its exact positions, FLOPs naive vs tree and replay's one-rank peak for it (`turn_tree` in the JSON); the
layout search and memory per rank stay the flat shape's (prompt + G leaves of the whole response).
With --json the last stdout line is one JSON object: fits, layout {tp, cp, dp, pp, recompute} (+ ep, etp for MoE),
memory_bytes_per_rank (one key per term and total), flops {naive, replay, ratio, ...}, step_time_s, optimizer
{name, use_distributed_optimizer, optimizer_cpu_offload, optimizer_offload_fraction}, host_memory_bytes_per_node,
host_memory_bytes_per_rank (by term), branch_micro_batch, root_pieces (replay under PP: the sequence pieces each root
is cut into), chunk_tokens (replay's token budget per packed chunk, as grad's --chunk-tokens; null: off), rejected (per other layout: its best choice and why it
does not fit), and more. The command line and these keys are a stable contract. The text opens with the verdict
("fits: ..." or "does not fit: ... Would fit with: ...") and then describes the chosen (or the nearest, rejected)
layout. Exit status 0 when it fits, 1 when nothing fits (as `grep` answers "no": scripts can test it), 2 on bad
input.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

from megatron_branch.commands.bench import add_turn_flags
from megatron_branch.commands.flags import _positive_int_or_off
from megatron_branch.errors import UserError
from megatron_branch.plan.model import GPU_PRESETS, RECOMPUTE, Layout, RolloutShape, load_model
from megatron_branch.plan.presets import MODEL_PRESETS
from megatron_branch.plan.result import HOST_TERMS, TERMS_IN_TOTAL, Plan
from megatron_branch.plan.search import SCHEDULES, plan, what_would_fit
from megatron_branch.schedule.options import DEFAULT_CHUNK_TOKENS

NO_FIT = 1
"""plan's exit status when nothing fits (0: it fits; 2: bad input)."""


def add_plan_command(sub: Any) -> None:
    p = sub.add_parser("plan", help="per-rank memory, FLOPs, step time and a layout for a rollout batch")
    p.add_argument("--model", required=True, help=f"preset ({', '.join(MODEL_PRESETS)}) or an HF config.json")
    p.add_argument("--prompt-length", type=int, required=True)
    p.add_argument("--responses", type=int, required=True, help="responses per prompt (G)")
    p.add_argument("--response-length", type=int, required=True)
    p.add_argument("--prompts", type=int, default=1, help="prompt groups per step (default 1)")
    p.add_argument("--shared-response-length", type=int, default=0)
    add_turn_flags(
        p
    )  # an agentic tree (the bench's description): --response-length is each policy turn's tokens
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--gpu", choices=list(GPU_PRESETS), required=True)
    p.add_argument("--gpu-memory-gb", type=float, help="override the preset's memory (GB)")
    p.add_argument("--gpu-tflops", type=float, help="override the preset's dense bf16 TFLOP/s")
    p.add_argument("--link-gbps", type=float, help="override the preset's link bandwidth (GB/s)")
    p.add_argument("--host-memory-gb", type=float, help="host memory per node (GB; default 1024)")
    p.add_argument("--host-link-gbps", type=float, help="host<->GPU GB/s per GPU, all copying (default 25)")
    p.add_argument(
        "--host-adam-gbps", type=float, help="host memory GB/s one rank's CPU Adam gets (default 25)"
    )
    p.add_argument("--gpus-per-node", type=int, help="GPUs sharing one host's memory (default 8)")
    p.add_argument(
        "--node-link-gbps",
        type=float,
        help="per-GPU GB/s between nodes, for groups spanning nodes (default 50)",
    )
    p.add_argument("--tp", type=int)
    p.add_argument("--cp", type=int)
    p.add_argument("--dp", type=int)
    p.add_argument("--pp", type=int, help="pipeline stages (replay or packed; default: searched 1, 2, 4, 8)")
    p.add_argument("--recompute", choices=RECOMPUTE)
    p.add_argument("--ep", type=int, help="expert-parallel size of a MoE model (inside cp x dp)")
    p.add_argument(
        "--etp",
        type=int,
        help="expert tensor-parallel size of a MoE model, as grad's --etp: 1 (every expert whole on each TP rank) "
        "or tp (default: the experts split over TP)",
    )
    p.add_argument(
        "--schedule",
        choices=[*SCHEDULES, "auto"],
        default="replay",
        help="auto: packed when its plan fits the device and one rank's tree is at most one chunk of "
        "--chunk-tokens, replay otherwise (plan/auto.py, as grad --schedule auto)",
    )
    p.add_argument(
        "--optimizer",
        choices=["plain", "distributed"],
        help="megatron's plain or distributed optimizer (default: searched)",
    )
    p.add_argument(
        "--offload-fraction",
        type=float,
        help="optimizer state kept in host memory, 0..1 (megatron's CPU offload; default: searched)",
    )
    p.add_argument(
        "--branch-micro-batch", type=int, help="replay: sibling leaves per forward (default: searched 8..1)"
    )
    p.add_argument(
        "--root-pieces",
        type=_pieces,
        help="replay under PP: sequence pieces each root is cut into (default 1: whole roots; 'auto': searched "
        "1..16 per pipeline layout, pieces of at least 4096 tokens; plan/pipeline.py)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=_positive_int_or_off,
        default=DEFAULT_CHUNK_TOKENS,
        help=f"replay: tokens per packed chunk of small subtrees, as grad's --chunk-tokens (default "
        f"{DEFAULT_CHUNK_TOKENS}; 0: off, the walk segment by segment)",
    )
    p.add_argument(
        "--dtype",
        choices=["bf16", "float32"],
        default="bf16",
        help="parameter/activation dtype (grad runs float32)",
    )
    p.add_argument("--json", action="store_true", help="end with one JSON line (the stable contract)")
    p.set_defaults(func=run_plan)


def _pieces(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of pieces or 'auto', got {value!r}") from None


def run_plan(args: argparse.Namespace) -> int:
    name, arch = load_model(args.model)
    gpu = GPU_PRESETS[args.gpu]
    overrides = {
        k: v
        for k, v in (
            ("memory_gb", args.gpu_memory_gb),
            ("tflops", args.gpu_tflops),
            ("link_gbps", args.link_gbps),
            ("host_memory_gb", args.host_memory_gb),
            ("host_link_gbps", args.host_link_gbps),
            ("host_adam_gbps", args.host_adam_gbps),
            ("gpus_per_node", args.gpus_per_node),
            ("node_link_gbps", args.node_link_gbps),
        )
        if v is not None
    }
    if overrides:
        gpu = dataclasses.replace(gpu, name=f"{gpu.name}*", **overrides)
    tree = turn_tree(args)
    shape = tree.flat() if tree else RolloutShape(
        prompt_length=args.prompt_length,
        responses=args.responses,
        response_length=args.response_length,
        prompts=args.prompts,
        shared_response_length=args.shared_response_length,
    )  # fmt: skip
    kw = {
        "branch_micro_batch": args.branch_micro_batch,
        "root_pieces": args.root_pieces,
        "chunk_tokens": args.chunk_tokens,
        "dtype": args.dtype,
        "distributed_optimizer": None if args.optimizer is None else args.optimizer == "distributed",
        "offload_fraction": args.offload_fraction,
        "etp": args.etp,
    }

    def search(schedule: str) -> Any:
        return plan(name, arch, shape, gpu, args.gpus, tp=args.tp, cp=args.cp, dp=args.dp, pp=args.pp,
                    recompute=args.recompute, schedule=schedule, ep=args.ep, **kw)  # fmt: skip

    choice = None
    if args.schedule == "auto":  # the rule of grad --schedule auto, with the device's memory as the budget
        from megatron_branch.plan.auto import choose, plan_tokens

        packed = search("packed")
        # the tokens of packed's chunk on one rank, as step_peak counts replay's against --chunk-tokens
        choice = choose(packed.memory["total"], int(packed.gpu.memory_gb * 1e9),
                        tokens=plan_tokens(shape, packed.layout), chunk_tokens=args.chunk_tokens)  # fmt: skip
        if choice.schedule == "packed" and not packed.fits:  # the device fits, the host does not
            choice = dataclasses.replace(choice, schedule="replay", reason=f"packed: {packed.why_not()}")
        p = packed if choice.schedule == "packed" else search("replay")
    else:
        p = search(args.schedule)
    out = p.to_json()
    if choice is not None:
        out["schedule_auto"] = choice.to_json()
    if not p.fits:
        out["would_fit_with"] = what_would_fit(p, **kw)
    print(render(p, out.get("would_fit_with", [])))
    if tree is not None:
        out["turn_tree"] = turn_tree_report(tree, p)
        print(render_turn_tree(out["turn_tree"]))
    if choice is not None:
        print(f"schedule auto: {choice.schedule} ({choice.reason})")
    if args.json:
        print(json.dumps(out, sort_keys=True))
    return 0 if p.fits else NO_FIT


def turn_tree(args: argparse.Namespace) -> Any:
    """The agentic tree the flags describe (plan/agentic.py TurnTreeShape), or None without --turns."""
    from megatron_branch.data.random_trees import check_turn_tree
    from megatron_branch.plan.agentic import TurnTreeShape

    turns, obs, at = args.turns or 0, args.observation_length or 0, args.branch_at_turns or ()
    check_turn_tree(turns=turns, observation=obs, branch_at_turns=at, leaves=(args.responses,),
                    leaves_flag="--responses")  # fmt: skip
    if not turns:
        return None
    if args.shared_response_length:
        raise UserError(
            "--shared-response-length and --turns both shape the response tree: use one or the other"
        )
    RolloutShape(
        prompt_length=args.prompt_length,
        responses=args.responses,
        response_length=args.response_length,
        prompts=args.prompts,
    )  # fmt: skip  (the positive-size rules, in plan's words)
    return TurnTreeShape(prompt_length=args.prompt_length, responses=args.responses, turn_length=args.response_length,
                         turns=turns, observation=obs, branch_at_turns=tuple(at), prompts=args.prompts)  # fmt: skip


def turn_tree_report(tree: Any, p: Plan) -> dict[str, Any]:
    """The agentic tree's JSON: its description, exact positions, FLOPs naive vs tree."""
    from megatron_branch.plan.agentic import turn_tree_flops, turn_tree_replay_saved
    from megatron_branch.plan.memory import step_peak

    logical, computed = tree.positions
    replay = None
    mixed = p.arch.is_hybrid or p.arch.is_moe or p.arch.hybrid_override_pattern is not None  # not priced here
    if not mixed:  # the tree's replay peak: one rank's walk (tp = cp = pp = 1)
        kw = dict(act_bytes=2 if p.dtype == "bf16" else 4, branch_micro_batch=p.branch_micro_batch,
                  segment_recompute=p.layout.recompute != "none")  # fmt: skip
        flat = step_peak(p.arch, tree.flat(), Layout(), layer_recompute=False, **kw).saved
        # priced segment by segment (plan/agentic.py has no chunk model yet): say so beside plan's own chunk_tokens
        replay = {
            "tree": turn_tree_replay_saved(p.arch, tree, **kw),
            "flat": flat,
            **kw,
            "chunk_tokens": None,
        }
    return {
        "replay_saved_bytes_one_rank": replay,
        "turns": tree.turns, "observation_length": tree.observation, "branch_at_turns": list(tree.branch_at_turns),
        "turn_length": tree.turn_length, "positions_logical": logical, "positions_computed": computed,
        "flops": turn_tree_flops(p.arch, tree),
        "memory_model": "flat: prompt + G leaves of the whole response (the turn tree's sharing below the prompt "
        "is not modelled in the layout search, memory, step time or the FLOPs line above; its memory an upper bound "
        "as observed on CPU trees, not proven)",
    }  # fmt: skip


def render_turn_tree(t: dict[str, Any]) -> str:
    fl = t["flops"]
    return "\n".join([
        f"agentic tree: {t['turns']} turns of {t['turn_length']} + observations of {t['observation_length']}, forks "
        f"after turns {t['branch_at_turns']}: positions logical {t['positions_logical']:,}, computed "
        f"{t['positions_computed']:,} ({t['positions_logical'] / t['positions_computed']:.2f}x)",
        f"agentic tree FLOPs per step (no recompute): naive {fl['naive']:.3e}, tree (packed, replay) {fl['tree']:.3e}; "
        f"naive / tree = {fl['ratio']:.2f}x",
        *(
            [f"agentic tree replay saved-for-backward peak on one rank (tp 1 x cp 1 x pp 1, segment recompute "
             f"{r['segment_recompute']}, branch micro-batch {r['branch_micro_batch']}, no chunks): tree {r['tree'] / 1e9:.2f} GB, "
             f"flat {r['flat'] / 1e9:.2f} GB"]
            if (r := t["replay_saved_bytes_one_rank"]) else
            ["agentic tree replay memory: dense attention models only (hybrid / MoE not modelled)"]
        ),
        f"note: the layout, memory, FLOPs and step time above are for the {t['memory_model']}",
    ])  # fmt: skip


def _gb(b: float) -> str:
    return f"{b / 1e9:8.2f}"


def _exchanged(arch: Any) -> str:
    """Whose heads the head exchange carries: a Mamba-2 hybrid's M layers or a hybrid's gated delta nets."""
    return "Mamba" if arch.hybrid_override_pattern is not None else "GDN"


def render(p: Plan, fixes: list[str]) -> str:
    lay, mem, fl, t = p.layout, p.memory, p.flops, p.step_time
    s = p.shape
    lines = [
        verdict(p, fixes),
        f"{p.model}: {s.prompts} x ({s.prompt_length} prompt + {s.responses} x {s.response_length} response"
        + (f", {s.shared_response_length} shared" if s.shared_response_length else "")
        + f") = {s.positions_logical:,} positions ({s.positions_computed:,} distinct) on {p.gpus} x {p.gpu.name} "
        f"({p.gpu.memory_gb:g} GB, {p.gpu.tflops:g} TFLOP/s, {p.gpu.link_gbps:g} GB/s)",
        ("layout" if p.fits else "nearest layout (rejected)")
        + f": tp {lay.tp} x cp {lay.cp} x pp {lay.pp} x dp {lay.dp}"
        + (f" (ep {lay.ep}, etp {lay.expert_tp})" if p.arch.is_moe else "")
        + f", recompute {lay.recompute}, schedule {p.schedule}, {p.dtype}, optimizer {p.optimizer.name}, "
        f"branch micro-batch {p.branch_micro_batch}"
        + (f", root pieces {p.root_pieces}" if p.root_pieces > 1 else "")
        + (f", chunks of {p.chunk_tokens} tokens" if p.chunk_tokens else ""),
        "memory per rank (GB):",
    ]
    for k in TERMS_IN_TOTAL:
        if k == "cached_ssm_state" and not mem[k]:  # a Mamba hybrid's term only (plan/mamba.py)
            continue
        lines.append(f"  {k:<18}{_gb(mem[k])}")
    lines.append(f"  {'total':<18}{_gb(mem['total'])}   of {p.gpu.memory_gb:g}")
    lines.append(
        f"  (optimizer state without the distributed optimizer: {mem['optimizer_state_no_distributed'] / 1e9:.2f})"
    )
    if "expert_parameters" in mem:
        lines.append(
            f"  (of the parameters, routed experts on this rank: {mem['expert_parameters'] / 1e9:.2f}"
            + (", whole on each TP rank)" if lay.expert_tp < lay.tp else ")")
        )
    host = p.host_memory
    lines.append(
        f"optimizer: {p.optimizer.name}; host memory per rank (GB): "
        + ", ".join(f"{k.removeprefix('host_')} {host[k] / 1e9:.2f}" for k in HOST_TERMS)
        + f"; per node ({min(p.gpu.gpus_per_node, p.gpus)} ranks) {host['per_node'] / 1e9:.1f} of "
        f"{p.gpu.host_memory_gb:g}"
    )
    lines.append(
        f"FLOPs per step: naive {fl['naive']:.3e}, packed {fl['packed']:.3e}, replay {fl['replay']:.3e}; "
        f"naive / {p.schedule} = {fl['ratio']:.2f}x; stop-gradient (prompt state not trained, inexact) "
        f"{fl['stop_gradient']:.3e}, {p.schedule} / stop-gradient = {fl['this_schedule'] / fl['stop_gradient']:.2f}x"
    )
    ring = "hidden behind attention" if t["ring_hidden"] else f"{t['ring_exposed']:.2f} s exposed"
    lines.append(
        f"step time ~ {t['total']:.1f} s: compute {t['compute']:.1f} s (MFU {t['mfu_assumed']:g}), ring "
        f"{t['ring']:.2f} s ({ring}), "
        + (f"{_exchanged(p.arch)} head exchange {t['head_exchange']:.2f} s, " if t["head_exchange"] else "")
        + f"TP comm {t['tensor_parallel_comm']:.2f} s, grad reduce {t['grad_reduce']:.2f} s"
        + (f", expert all-to-all {t['expert_alltoall']:.2f} s" if p.arch.is_moe else "")
        + f", offload copies {t['offload_transfer']:.2f} s, host Adam {t['host_optimizer_step']:.2f} s"
        + f", pipeline bubble {t['pipeline_bubble']:.1f} s, stage messages {t['pipeline_messages']:.2f} s"
    )
    for n in p.notes:
        lines.append(f"note: {n}")
    if p.rejected:
        lines.append("the other layouts (each with its best optimizer choice and branch micro-batch):")
        for r in p.rejected:
            lay_r = r["layout"]
            lines.append(
                f"  tp {lay_r['tp']} x cp {lay_r['cp']} x pp {lay_r['pp']} x dp {lay_r['dp']}"
                + (f" (ep {lay_r['ep']}, etp {lay_r['etp']})" if "ep" in lay_r else "")
                + f", {lay_r['recompute']:<9} "
                f"{r['optimizer']}, bmb {r['branch_micro_batch']}: {r['reason']}"
            )
    return "\n".join(lines)


def verdict(p: Plan, fixes: list[str]) -> str:
    """The first line of the text: "fits: ..." or "does not fit: <why>. Would fit with: <fixes>"."""
    mem, host, lay = p.memory, p.host_memory, p.layout
    if p.fits:
        return (
            f"fits: {mem['total'] / 1e9:.1f} of {p.gpu.memory_gb:g} GB per rank at tp {lay.tp} x cp {lay.cp} x "
            f"pp {lay.pp} x dp {lay.dp}, recompute {lay.recompute}"
        )
    where = (
        f"needs {mem['total'] / 1e9:.1f} GB per rank, {p.gpu.memory_gb:g} GB available; largest term "
        f"{p.largest_term} ({mem[p.largest_term] / 1e9:.1f} GB)"
        if not p.fits_device
        else f"needs {host['per_node'] / 1e9:.0f} GB of host memory per node, {p.gpu.host_memory_gb:g} GB available"
    )
    return f"does not fit: {where}. Would fit with: " + "; ".join(fixes)
