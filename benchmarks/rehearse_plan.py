"""Rehearse a planned layout on this CPU: a preset's per-rank shapes, scaled down, per term against the planner.

Issue 19 item 5. The planner picks a layout for the 2.1M-position target (for Qwen2.5-32B on 8 x H20: TP8, recompute
full). This runs that layout under torchrun (world = tp x cp, gloo) with the preset's own widths (hidden, heads,
KV groups, head dim, ffn: every per-rank tensor shape of the real run) but fewer layers, a smaller vocabulary and a
shorter batch, or the true sequence length at a narrower width (`--width-scale`), and prints, per rank, each of
the planner's saved terms (activations, cached K/V, dK/dV accumulators) next to the activation meter's split at
its peak (memory.KINDS), with the ratio. Deterministic byte counts: the machine's load changes only the wall time.

    python benchmarks/rehearse_plan.py --model qwen2.5-32b --tp 8 --recompute full      # full width, short batch
    python benchmarks/rehearse_plan.py --model qwen2.5-32b --tp 8 --width-scale 16 --prompt 16384   # long, narrow
    python benchmarks/rehearse_plan.py --model qwen2.5-32b --tp 8 --recompute full --dtype bfloat16  # the plan's dtype
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

MODES = {"none": (False, False), "selective": (True, False), "full": (True, True)}


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-32b", help="a planner preset")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--recompute", choices=list(MODES), default="full")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument(
        "--vocab", type=int, default=1024, help="the head's vocabulary (the logits term scales with it)"
    )
    ap.add_argument("--width-scale", type=int, default=1, help="divide hidden, head dim and ffn by this")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--responses", type=int, default=16)
    ap.add_argument("--response", type=int, default=16)
    ap.add_argument("--branch-micro-batch", type=int, default=8)
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the model's dtype (the plan's is bfloat16; bf16 runs keep the dK/dV sums in fp32)",
    )
    ap.add_argument("--json", default=None, help="write rank 0's table as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def scaled_arch(args: argparse.Namespace):  # noqa: ANN201 (a ModelArch; imported lazily)
    from megatron_branch.plan import MODEL_PRESETS

    a = MODEL_PRESETS[args.model]
    k = args.width_scale
    return dataclasses.replace(
        a,
        num_layers=args.layers,
        vocab_size=args.vocab,
        hidden_size=a.hidden_size // k,
        head_dim=(a.head_dim or a.hidden_size // a.num_attention_heads) // k,
        ffn_hidden_size=a.ffn_hidden_size // k,
        max_position_embeddings=max(a.max_position_embeddings, args.prompt + args.response),
        tie_word_embeddings=False,
    )


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from megatron_branch.models import build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.plan import Layout, RolloutShape
    from megatron_branch.plan.measure import measure_step, per_term
    from megatron_branch.plan.memory import step_peak

    sp = args.tp > 1
    groups = initialize_parallel(ParallelConfig(tp=args.tp, cp=args.cp, sequence_parallel=sp))
    arch = scaled_arch(args)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    model = build_model(arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=sp)
    shape = RolloutShape(prompt_length=args.prompt, responses=args.responses, response_length=args.response)
    seg, lay = MODES[args.recompute]
    got = measure_step(model, shape, vocab=args.vocab, branch_micro_batch=args.branch_micro_batch, recompute=seg,
                       recompute_layers=lay, groups=groups)  # fmt: skip
    pk = step_peak(arch, shape, Layout(tp=args.tp, cp=args.cp, recompute=args.recompute), act_bytes=dtype.itemsize,
                   branch_micro_batch=args.branch_micro_batch, segment_recompute=seg, layer_recompute=lay)  # fmt: skip
    rows = {term: [m, p] for term, (m, p) in per_term(got, pk).items()}
    rows["total saved"] = [got.saved_peak, pk.saved]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, rows)
    if dist.get_rank() != 0:
        return
    print(f"{args.model} per rank at TP{args.tp} x CP{args.cp}, recompute {args.recompute}: hidden "
          f"{arch.hidden_size}, {arch.num_attention_heads // args.tp} query heads / "
          f"{arch.num_query_groups // args.tp} KV groups per rank, head dim {arch.head_dim}, ffn "
          f"{arch.ffn_hidden_size // args.tp} per rank, {arch.num_layers} layer(s), vocabulary {args.vocab}; "
          f"{args.prompt} + {args.responses} x {args.response} positions, {args.dtype}")  # fmt: skip
    print("\n| term | meter (MB, ranks min-max) | planner (MB) | planner / meter (worst rank) |")
    print("|---|---:|---:|---:|")
    for term in rows:
        ms = [g[term][0] for g in gathered]
        ps = [g[term][1] for g in gathered]
        worst = max((p / m if m else float("inf") if p else 1.0 for m, p in zip(ms, ps, strict=True)),
                    key=lambda r: abs(r - 1))  # fmt: skip
        print(f"| {term} | {min(ms) / 2**20:.2f}-{max(ms) / 2**20:.2f} | {min(ps) / 2**20:.2f}-{max(ps) / 2**20:.2f}"
              f" | {worst:.4f} |")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": gathered}, f, indent=1)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.worker:
        worker(args)
        return
    world = args.tp * args.cp
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           "--local-ranks-filter=0", os.path.abspath(__file__), "--worker", *(argv or sys.argv[1:])]  # fmt: skip
    sys.exit(subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}).returncode)


if __name__ == "__main__":
    main()
