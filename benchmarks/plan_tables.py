"""The planner's tables for the 2.1M-position target (docs/planner.md): deterministic arithmetic, no timing.

16 rollouts x 131,072 positions (a 122,880-token prompt shared by 16 responses of 8,192 tokens) on one node of
8 x H20 / H100 / H200, for Qwen2.5-7B and Qwen2.5-32B, in the layouts CP8, TP2 x CP4, TP4 x CP2 (TP8 for 32B).

    python benchmarks/plan_tables.py            # markdown on stdout
"""

from __future__ import annotations

from megatron_branch.errors import UserError
from megatron_branch.plan import GPU_PRESETS, MODEL_PRESETS, Layout, RolloutShape, evaluate, plan

SHAPE = RolloutShape(prompt_length=122880, responses=16, response_length=8192)
TERMS = ("parameters", "gradients", "optimizer_state", "activations", "cached_kv", "kv_grads", "ring_buffers",
         "logits", "allocator_margin")  # fmt: skip
LAYOUTS = [(1, 8), (2, 4), (4, 2), (8, 1)]


def gb(b: float) -> str:
    return f"{b / 1e9:.1f}"


def table(model: str, gpu: str) -> str:
    arch, g = MODEL_PRESETS[model], GPU_PRESETS[gpu]
    head = "| layout | recompute | fits | total GB | " + " | ".join(TERMS) + " | step s | ring hidden |"
    lines = [head, "|" + "---|" * (6 + len(TERMS))]
    for tp, cp in LAYOUTS:
        for rc in ("none", "selective", "full"):
            try:
                p = evaluate(model, arch, SHAPE, g, 8, Layout(tp=tp, cp=cp, recompute=rc))
            except UserError:
                continue  # tp does not divide the heads
            m = p.memory
            cells = [f"TP{tp} x CP{cp}", rc, "yes" if p.fits else f"no ({p.largest_term})", gb(m["total"])]
            cells += [gb(m[t]) for t in TERMS]
            cells += [f"{p.step_time['total']:.0f}", "yes" if p.step_time["ring_hidden"] else "no"]
            lines.append("| " + " | ".join(cells) + " |")
    best = plan(model, arch, SHAPE, g, 8)
    lay = best.layout
    verdict = (
        f"recommended: TP{lay.tp} x CP{lay.cp}, recompute {lay.recompute}, {gb(best.memory['total'])} GB per rank, "
        f"step ~{best.step_time['total']:.0f} s"
        if best.fits
        else f"does not fit in any layout; least memory: TP{lay.tp} x CP{lay.cp} {lay.recompute} at "
        f"{gb(best.memory['total'])} GB (largest term {best.largest_term})"
    )
    return f"**{model} on 8 x {gpu}** ({g.memory_gb:g} GB, {g.tflops:g} TFLOP/s): {verdict}\n\n" + "\n".join(
        lines
    )


def flops_table() -> str:
    lines = [
        "| model | naive PFLOP | packed PFLOP | replay PFLOP (none / selective / full) | naive / replay | "
        "stop-gradient PFLOP | replay / stop-gradient |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for model in ("qwen2.5-7b", "qwen2.5-32b"):
        arch = MODEL_PRESETS[model]
        ps = {rc: evaluate(model, arch, SHAPE, GPU_PRESETS["h20"], 8, Layout(cp=8, recompute=rc)) for rc in
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
    print(f"Shape: {SHAPE.positions_logical:,} logical positions, {SHAPE.positions_computed:,} distinct.\n")
    print(flops_table(), end="\n\n")
    for model in ("qwen2.5-7b", "qwen2.5-32b"):
        for gpu in ("h20", "h100", "h200"):
            print(table(model, gpu), end="\n\n")


if __name__ == "__main__":
    main()
