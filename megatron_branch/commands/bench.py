"""`megatron-branch bench`: the variants a user could run instead, on the same rollouts, round-robin in one process.

    megatron-branch bench --preset A --json out/A.json --plot out/            # the issue's configuration A
    megatron-branch bench --preset memory-G --json out/mem.json --plot out/   # peak memory against G
    megatron-branch bench --prompt 512,1024,2048 --branches 8 --layers 2 --hidden 128 --vocab 4096

Variants (--variants, comma separated; naive-fused, the baseline, is always run):
    naive-fused, packed-nosharing, repeat-prefix, naive, packed, replay, replay+recompute, replay+recompute-full
    (every replay variant packs small subtrees into chunks of <= 4096 tokens: ScheduleOptions.chunk_tokens),
    replay-nochunks (replay with chunk_tokens off: one forward per segment),
    auto (packed when its planned activation peak fits --memory-budget GB or the free memory and the tree is at
    most one chunk of 4096 tokens, else replay)
Every speed-up is quoted against naive-fused (each rollout alone on the same model, fused attention kernel and
fused logprob as replay: what a user runs today), next to the analytic limit (naive-fused FLOPs / the tree's
minimal FLOPs, causal attention counted as causal). Presets: A, B, C, memory-G, hybrid, moe, agentic, demo,
small-prompts, tiny, gpu-1b; flags override them (demo, small-prompts: issue 33's tables,
benchmarks/issue33_tables.sh).
Timings on a shared machine are only comparable within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from megatron_branch.errors import UserError
from megatron_branch.outputs import (
    add_overwrite_argument,
    atomic_dir,
    check_output_dir,
    check_output_file,
    write_text,
)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_turn_flags(p: argparse.ArgumentParser) -> None:
    """The agentic tree description (data/random_trees.py agentic_tree_rollouts), one spelling for bench and plan;
    its rules: random_trees.check_turn_tree."""
    p.add_argument(
        "--turns", type=int, default=None, help="an agentic tree: policy turns of --response tokens"
    )
    p.add_argument(
        "--observation-length", type=int, default=None, help="tokens of each tool output (loss_mask 0)"
    )
    p.add_argument(
        "--branch-at-turns", type=_ints, default=None, help="fork in 2 after these turns, e.g. 2,4"
    )


def add_bench_command(sub: Any) -> None:
    from megatron_branch.bench.config import PRESETS

    p = sub.add_parser(
        "bench",
        help="fair round-robin benchmark of the schedules against unshared baselines",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default=None, help="named configuration")
    p.add_argument("--prompt", type=_ints, default=None, help="prompt length(s) P, e.g. 1024 or 512,1024")
    p.add_argument("--branches", type=_ints, default=None, help="responses per prompt G, e.g. 8 or 4,8,16,32")
    p.add_argument("--response", type=int, default=None, help="tokens per response S")
    p.add_argument("--levels", type=int, default=None, help="levels of the response tree (1: G leaves)")
    p.add_argument("--groups", type=int, default=None, help="prompt groups in the tree, each with G rollouts")
    p.add_argument(
        "--min-prompt", type=int, default=None, help="with --groups: prompt lengths from this to P"
    )
    p.add_argument(
        "--memory-budget", type=float, default=None, help="auto's budget in GB (default: free device memory)"
    )
    add_turn_flags(p)
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab", "experts", "top-k", "expert-ffn"):
        p.add_argument(f"--{name}", type=int, default=None, help=f"model {name}")
    p.add_argument("--tie", action="store_true", default=None, help="tie embedding and output layer")
    p.add_argument(
        "--full-attention-interval",
        type=int,
        default=None,
        metavar="K",
        help="a Qwen3.5-style hybrid: every K-th layer full attention, the others gated delta net (0: none)",
    )
    p.add_argument("--variants", default=None, help="comma-separated variants (default: all)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds after the warm-up (default 3)")
    p.add_argument("--micro", type=int, default=None, help="replay's branch_micro_batch (default 8)")
    p.add_argument("--dtype", default=None, help="float32 (default), float64, bfloat16, float16")
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--no-meter", action="store_true", help="skip the activation-meter step")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak TFLOP/s, to report MFU")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--profile", default=None, metavar="VARIANT", help="profile one step; top ops in the report"
    )
    p.add_argument("--json", default=None, help="write every number to this JSON file")
    p.add_argument("--markdown", default=None, help="write the tables to this markdown file")
    p.add_argument(
        "--plot", default=None, help="write PNGs of speed-up and peak memory vs G and vs P into this folder"
    )
    add_overwrite_argument(p)
    p.set_defaults(func=run_bench_command)


def config_from_args(args: argparse.Namespace) -> Any:
    from megatron_branch.bench.config import PRESETS, BenchConfig, bench_model, model_flags

    fields: dict[str, Any] = dict(PRESETS[args.preset]) if args.preset else {}
    model_kw = model_flags(fields.pop("model", bench_model()))
    for k in model_kw:
        if getattr(args, k, None) is not None:
            model_kw[k] = getattr(args, k)
    flags = dict(
        prompts=args.prompt, branches=args.branches, response=args.response, levels=args.levels, groups=args.groups,
        min_prompt=args.min_prompt, memory_budget_gb=args.memory_budget, turns=args.turns,
        observation=args.observation_length, branch_at_turns=args.branch_at_turns,
        rounds=args.rounds, micro=args.micro, dtype=args.dtype, device=args.device, peak_tflops=args.peak_tflops,
        seed=args.seed, profile=args.profile,
    )  # fmt: skip
    fields.update({k: v for k, v in flags.items() if v is not None})
    if args.variants is not None:
        fields["variants"] = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    if args.no_meter:
        fields["meter"] = False
    return BenchConfig(model=bench_model(**model_kw), **fields)


def plot_impossible(cfg: Any) -> str | None:
    """Why --plot cannot draw this grid, or None: a plot is drawn against P or G with at least two values
    (bench/report.py `plot`); a one-point grid (presets A, B, C) used to write no PNG and say nothing."""
    if len(cfg.prompts) >= 2 or len(cfg.branches) >= 2:
        return None
    return (
        f"bench: --plot draws nothing for this grid: it is one point (P={cfg.prompts[0]}, G={cfg.branches[0]}) "
        "and a plot needs two values or more of --prompt or --branches (e.g. --branches 4,8,16); no plot folder "
        "is written"
    )


def run_bench_command(args: argparse.Namespace) -> int:
    from megatron_branch.bench.report import PLOT_MARKER, json_text, markdown, plot
    from megatron_branch.bench.runner import run_bench

    cfg = config_from_args(args)
    # the outputs rule (docs/errors.md), checked before the (long) run: parents must exist, --overwrite to replace
    for path in (args.json, args.markdown):
        if path:
            check_output_file(path, overwrite=args.overwrite)
    if args.plot:
        import importlib.util

        check_output_dir(args.plot, overwrite=args.overwrite, marker=PLOT_MARKER, what="plot folder")
        if importlib.util.find_spec("matplotlib") is None:
            raise UserError("--plot needs matplotlib (pip install 'megatron-branch[bench]')")
    no_plot = plot_impossible(cfg) if args.plot else None
    if no_plot:  # said before the run (it may be long) and again at the end
        print(no_plot, file=sys.stderr, flush=True)
    report = run_bench(cfg)
    text = markdown(report)
    print(text)
    for line in report["warnings"]:  # also on stderr: a figure read off the table must not miss them
        print(line, file=sys.stderr, flush=True)
    if args.json:
        write_text(args.json, json_text(report), overwrite=args.overwrite)
    if args.markdown:
        write_text(args.markdown, text, overwrite=args.overwrite)
    if no_plot:
        print(no_plot, file=sys.stderr, flush=True)
    elif args.plot:
        with atomic_dir(args.plot, overwrite=args.overwrite, marker=PLOT_MARKER, what="plot folder") as tmp:
            names = [p.name for p in plot(report, tmp)]
            (tmp / PLOT_MARKER).write_text(json.dumps({"plots": names}) + "\n")
        for name in names:
            print(f"wrote {Path(args.plot) / name}")
    return 0
