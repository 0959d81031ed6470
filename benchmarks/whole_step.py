"""Whole RL steps against a fair pipeline: generation, scoring and update per schedule, round-robin, one process.

Every variant is a full `train` run (tests/unit/test_train_baselines.py: they sample the same tokens and train the
same parameters) built from the same config and seed; each RL step is run for every variant in turn (the order
rotated by one per step, step 1 untimed) and split into phases:

    generation   `rollout.n` samples per prompt: prefix-shared (`rollout.share_prefix: true`) or every sample its
                 own prefill (`/noshare`, what an engine without prefix caching does)
    scoring      forward-only old logprobs (the policy: verl's recomputed `old_log_prob`) and reference logprobs
                 (`actor.kl_loss_coef` > 0), both through the variant's schedule
    update       the optimizer step(s): forward + backward through the schedule, megatron DDP and optimizer

The baseline is `naive-fused/noshare`: each rollout alone on the engine's fused kernels, sampled without prefix
sharing. Each phase's speed-up is quoted next to its analytic FLOP limit (the baseline's FLOPs over the shared
FLOPs of the same phase: bench/flops.py for scoring and update, prefill + decode below for generation).

    python benchmarks/whole_step.py --prompt-len 4096 --n 8 --prompts 2 --steps 4          # long prompt
    python benchmarks/whole_step.py --demo --steps 6                                        # the demo's shape

Writes OUT/whole_step.json and prints a markdown table. Only ratios within one run mean anything; take it on a
quiet machine (the JSON records the load average before and after).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

VARIANTS = ("replay", "packed", "naive-fused", "naive-fused/noshare", "packed-nosharing/noshare")
"""The default set (replay: with its default chunks, schedule.chunk_tokens 4096); also `replay-nochunks` (replay with
schedule.chunk_tokens null, the bench's variant)."""
BASELINE = "naive-fused/noshare"
PHASES = ("gen", "score", "update")


def overrides(args: argparse.Namespace, variant: str, out: Path) -> list[str]:
    schedule, _, share = variant.partition("/")
    # replay-nochunks: the bench's variant (chunk_tokens off: one forward per segment)
    chunks = ["schedule.chunk_tokens=null"] if schedule == "replay-nochunks" else []
    schedule = schedule.removesuffix("-nochunks")
    common = [*chunks, f"schedule.name={schedule}",
              f"rollout.share_prefix={'false' if share == 'noshare' else 'true'}",
              f"model.dtype={args.dtype}", f"trainer.total_training_steps={args.steps}", "warmup.steps=0",
              f"actor.kl_loss_coef={args.kl}", "logging.progress_bar=false", "logging.tensorboard=false",
              "logging.plot=false", "checkpoint.hf_export=false", "trainer.save_freq=-1",
              f"trainer.default_local_dir={out / variant.replace('/', '-')}"]  # fmt: skip
    if args.demo:
        return common
    context = args.prompt_len + args.response + 16
    return [
        f"model.arch={{family: llama, hidden_size: {args.hidden}, num_layers: {args.layers}, num_attention_heads: 4,"
        f" num_query_groups: 2, ffn_hidden_size: {4 * args.hidden}, max_position_embeddings: {context}}}",
        "tokenizer.type=sentencepiece", "tokenizer.model_type=char", "data.task=needles",
        f"data.task_args={{length: {args.prompt_len - 8}, num_needles: 1}}", "data.num_prompts=64",
        f"data.train_batch_size={args.prompts}", f"rollout.n={args.n}", f"rollout.response_length={args.response}",
        "rollout.temperature=1.0", "optim.lr=1e-4", *common,
    ]  # fmt: skip


def generation_flops(arch: Any, rollouts: list[Any], n: int, shared: bool) -> float:
    """Forward FLOPs of sampling `rollouts` (n per prompt, no tree sampling): prefill (each prompt once, or n
    times) + decode (every fed token against the keys it sees) + the logits of every sampled token."""
    from megatron_branch.bench.flops import per_pair_flops, per_position_flops, per_row_head_flops

    tok, row, pair = per_position_flops(arch), per_row_head_flops(arch), per_pair_flops(arch)
    prompts = [len(r.prompt) for r in rollouts[::n]]
    prefill = sum(tok * p + pair * p * (p + 1) / 2 + row for p in prompts) * (1 if shared else n)
    decode = 0.0
    for r in rollouts:
        P, m = len(r.prompt), len(r.response)
        decode += sum(tok + row + pair * (P + j + 1) for j in range(m - 1))  # fed tokens 0..m-2
    return prefill + decode


def phase_flops(arch: Any, rollouts: list[Any], n: int, variant: str, epochs: int) -> dict[str, float]:
    from megatron_branch.bench.flops import variant_flops
    from megatron_branch.data import PrefixTree

    schedule, _, share = variant.partition("/")
    f = variant_flops(arch, PrefixTree.build(rollouts))[schedule]
    return {
        "gen": generation_flops(arch, rollouts, n, shared=share != "noshare"),
        "score": 2 * f.forward,  # old + reference logprobs
        "update": epochs * f.step,
    }


def one_step(tr: Any) -> tuple[dict[str, float], list[Any]]:
    """One RL step of Trainer `tr`, timed by phase; returns (seconds per phase, the step's rollouts)."""
    from megatron_branch.update import attach_scores

    t0 = time.perf_counter()
    rollouts, rewards, _ = tr._sample(tr.order.next_batch())
    t1 = time.perf_counter()
    old = attach_scores(tr.actor.policy.ddp, rollouts, "old_logprobs", tr.actor.plan, only_missing=False)
    t2 = time.perf_counter()
    metrics = tr.actor.update(old, rewards, reference=tr.reference)
    t3 = time.perf_counter()
    tr.step += 1
    ref = metrics["timing_s/ref"]
    return {"gen": t1 - t0, "score": t2 - t1 + ref, "update": t3 - t2 - ref}, rollouts


def one_layout() -> None:
    """All the variants' Trainers live at once in this process, on ONE parallel layout: `Trainer` initialises
    megatron's parallel state (and frees the previous groups, which the earlier Trainers' DDP still use), so here
    the first call's groups are kept and later calls only re-seed, as initialize_parallel does."""
    import torch
    from megatron.core import tensor_parallel

    import megatron_branch.train.loop as loop

    first: dict[str, Any] = {}
    real = loop.initialize_parallel

    def initialize(layout: Any, *, seed: int = 1234) -> Any:
        if "groups" not in first:
            first["groups"], first["layout"] = real(layout, seed=seed), layout
        assert layout == first["layout"], "every variant runs on the same layout"
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        return first["groups"]

    loop.initialize_parallel = initialize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", action="store_true", help="the demo's config (examples/configs/demo.yaml)")
    ap.add_argument(
        "--prompt-len", type=int, default=4096, help="prompt tokens P (needles task, char tokens)"
    )
    ap.add_argument("--n", type=int, default=8, help="rollouts per prompt G")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per RL step")
    ap.add_argument("--response", type=int, default=32, help="most tokens per response")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4, help="RL steps per variant (the first is untimed)")
    ap.add_argument("--kl", type=float, default=0.001, help="actor.kl_loss_coef (> 0: reference scoring)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default="bench-out/whole_step")
    args = ap.parse_args()

    from megatron_branch.train.config_io import load_config
    from megatron_branch.train.loop import Trainer

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if BASELINE not in variants:
        variants.insert(0, BASELINE)
    config = "examples/configs/demo.yaml" if args.demo else None
    load_before = os.getloadavg()
    one_layout()
    trainers = {v: Trainer(load_config(config, overrides(args, v, out))) for v in variants}
    times: dict[str, dict[str, list[float]]] = {v: {p: [] for p in PHASES} for v in variants}
    tokens: dict[str, list[Any]] = {v: [] for v in variants}
    flops: dict[str, dict[str, float]] = {}
    shape: list[Any] = []
    for step in range(args.steps):
        k = step % len(variants)
        for v in variants[k:] + variants[:k]:  # round-robin, order rotated each step
            t, rollouts = one_step(trainers[v])
            tokens[v].append([r.response for r in rollouts])
            shape = rollouts
            if step == 0:
                tr = trainers[v]
                flops[v] = phase_flops(tr.arch, rollouts, tr.cfg.rollout.n, v, tr.cfg.actor.ppo_epochs)
                continue  # the first step is a warm-up (first-call allocations)
            for p in PHASES:
                times[v][p].append(t[p])
        print(f"step {step + 1}/{args.steps} done", flush=True)
    rows = summarize(variants, times, flops, tokens)
    report = dict(
        args=vars(args), load_average_before=load_before, load_average_after=os.getloadavg(),
        prompt_tokens=len(shape[0].prompt), rollouts_per_step=len(shape), baseline=BASELINE, rows=rows,
    )  # fmt: skip
    (out / "whole_step.json").write_text(json.dumps(report, indent=1) + "\n")
    print(markdown(report))


def summarize(variants: list[str], times: dict, flops: dict, tokens: dict) -> list[dict[str, Any]]:
    med = {v: {p: statistics.median(times[v][p]) for p in PHASES} for v in variants}
    for v in variants:
        med[v]["total"] = sum(med[v][p] for p in PHASES)
        flops[v]["total"] = sum(flops[v][p] for p in PHASES)
    minimal = {p: min(flops[v][p] for v in variants) for p in (*PHASES, "total")}
    rows = []
    for v in variants:
        row: dict[str, Any] = {"variant": v, "same_tokens_as_baseline": tokens[v] == tokens[BASELINE]}
        for p in (*PHASES, "total"):
            speedup = med[BASELINE][p] / med[v][p] if med[v][p] > 0 else float("nan")
            limit = flops[BASELINE][p] / minimal[p]
            row[p] = dict(median_s=med[v][p], gflop=flops[v][p] / 1e9, speedup=speedup, limit=limit,
                          fraction_of_limit=speedup / limit,
                          gflops_per_s=flops[v][p] / med[v][p] / 1e9 if med[v][p] > 0 else None)  # fmt: skip
            if p != "total":
                row[p]["times_s"] = times[v][p]
        rows.append(row)
    return rows


def markdown(report: dict[str, Any]) -> str:
    head = ("| variant | generation | scoring (old + ref) | update | whole step | whole-step speed-up (limit) |\n"
            "|---|---|---|---|---|---|")  # fmt: skip
    lines = [head]
    for r in report["rows"]:
        cells = [f"{r[p]['median_s']:.2f} s ({r[p]['speedup']:.2f}x / {r[p]['limit']:.2f}x)" for p in PHASES]
        t = r["total"]
        lines.append(f"| {r['variant']} | {' | '.join(cells)} | {t['median_s']:.2f} s | {t['speedup']:.2f}x "
                     f"({t['limit']:.2f}x, {t['fraction_of_limit']:.0%}) |")  # fmt: skip
    return "\n".join(lines) + (
        f"\n\nP = {report['prompt_tokens']} tokens, {report['rollouts_per_step']} rollouts per step; each cell: median "
        f"seconds (speed-up over {report['baseline']} / its analytic FLOP limit); load average before/after "
        f"{report['load_average_before'][0]:.1f} / {report['load_average_after'][0]:.1f}"
    )


if __name__ == "__main__":
    main()
