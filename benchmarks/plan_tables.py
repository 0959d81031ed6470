"""The planner's tables for the 2.1M-position targets (docs/planner.md): deterministic arithmetic, no timing.

Two shapes of 16 rollouts x 131,072 positions on one node of 8 GPUs:
  * LONG_RESPONSES: a 122,880-token prompt shared by 16 responses of 8,192 tokens;
  * ISSUE_TARGET: a 130,048-token prompt shared by 16 responses of 1,024 tokens (the announced system's shape,
    `plan --model qwen2.5-32b --prompt-length 130048 --responses 16 --response-length 1024 --gpus 8 --gpu h20`).
Per model and GPU: every layout (CP8, TP2 x CP4, TP4 x CP2, TP8) and recompute mode with its best optimizer choice
(plain, distributed, distributed + offload) and branch micro-batch, its device and host memory and step time, then
the search's recommendation. Add a preset to MODELS to tabulate it.

    python benchmarks/plan_tables.py            # markdown on stdout
"""

from __future__ import annotations

from megatron_branch.errors import UserError
from megatron_branch.plan import GPU_PRESETS, MODEL_PRESETS, Layout, RolloutShape, plan

LONG_RESPONSES = RolloutShape(prompt_length=122880, responses=16, response_length=8192)
ISSUE_TARGET = RolloutShape(prompt_length=130048, responses=16, response_length=1024)
MODELS = ("qwen2.5-7b", "qwen2.5-32b")
TERMS = ("parameters", "gradients", "optimizer_state", "activations", "cached_kv", "kv_grads", "ring_buffers",
         "logits", "allocator_margin")  # fmt: skip
LAYOUTS = [(1, 8), (2, 4), (4, 2), (8, 1)]


def gb(b: float) -> str:
    return f"{b / 1e9:.1f}"


def table(model: str, gpu: str, shape: RolloutShape) -> str:
    arch, g = MODEL_PRESETS[model], GPU_PRESETS[gpu]
    head = "| layout | recompute | optimizer | bmb | fits | total GB | " + " | ".join(TERMS)
    head += " | host GB/node | step s | ring hidden |"
    lines = [head, "|" + "---|" * (9 + len(TERMS))]
    for tp, cp in LAYOUTS:
        for rc in ("none", "selective", "full"):
            try:  # the best optimizer choice and branch micro-batch of this layout
                p = plan(model, arch, shape, g, 8, tp=tp, cp=cp, dp=1, recompute=rc)
            except UserError:
                continue  # tp does not divide the heads
            m = p.memory
            cells = [f"TP{tp} x CP{cp}", rc, p.optimizer.name, str(p.branch_micro_batch)]
            cells += ["yes" if p.fits else f"no ({p.largest_term})", gb(m["total"])]
            cells += [gb(m[t]) for t in TERMS]
            cells += [f"{p.host_memory['per_node'] / 1e9:.0f}", f"{p.step_time['total']:.0f}"]
            cells += ["yes" if p.step_time["ring_hidden"] else "no"]
            lines.append("| " + " | ".join(cells) + " |")
    best = plan(model, arch, shape, g, 8)
    lay = best.layout
    verdict = (
        f"recommended: TP{lay.tp} x CP{lay.cp}, recompute {lay.recompute}, optimizer {best.optimizer.name}, "
        f"branch micro-batch {best.branch_micro_batch}: {gb(best.memory['total'])} GB per rank, host "
        f"{best.host_memory['per_node'] / 1e9:.0f} GB per node, step ~{best.step_time['total']:.0f} s"
        if best.fits
        else f"does not fit in any layout; least memory: TP{lay.tp} x CP{lay.cp} {lay.recompute}, optimizer "
        f"{best.optimizer.name}, at {gb(best.memory['total'])} GB (largest term {best.largest_term})"
    )
    return f"**{model} on 8 x {gpu}** ({g.memory_gb:g} GB, {g.tflops:g} TFLOP/s): {verdict}\n\n" + "\n".join(
        lines
    )


def flops_table(shape: RolloutShape) -> str:
    lines = [
        "| model | naive PFLOP | packed PFLOP | replay PFLOP (none / selective / full) | naive / replay | "
        "stop-gradient PFLOP | replay / stop-gradient |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    from megatron_branch.plan import evaluate

    for model in MODELS:
        arch = MODEL_PRESETS[model]
        ps = {rc: evaluate(model, arch, shape, GPU_PRESETS["h20"], 8, Layout(cp=8, recompute=rc)) for rc in
              ("none", "selective", "full")}  # fmt: skip
        f = ps["none"].flops
        rep = " / ".join(f"{p.flops['replay'] / 1e15:.1f}" for p in ps.values())
        ratio = " / ".join(f"{p.flops['ratio']:.2f}" for p in ps.values())
        sg = " / ".join(f"{p.flops['replay'] / p.flops['stop_gradient']:.2f}" for p in ps.values())
        lines.append(
            f"| {model} | {f['naive'] / 1e15:.1f} | {f['packed'] / 1e15:.1f} | {rep} | {ratio} | "
            f"{f['stop_gradient'] / 1e15:.1f} | {sg} |"
        )
    return "\n".join(lines)


def main() -> None:
    for title, shape in (("ISSUE_TARGET", ISSUE_TARGET), ("LONG_RESPONSES", LONG_RESPONSES)):
        print(
            f"### {title}: {shape.prompt_length:,}-token prompt + {shape.responses} x {shape.response_length:,}: "
            f"{shape.positions_logical:,} logical positions, {shape.positions_computed:,} distinct\n"
        )
        print(flops_table(shape), end="\n\n")
        for model in MODELS:
            for gpu in ("h20", "h100", "h200"):
                print(table(model, gpu, shape), end="\n\n")


if __name__ == "__main__":
    main()
