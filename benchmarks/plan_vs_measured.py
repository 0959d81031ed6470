"""The planner against measurements on this machine (deterministic byte and FLOP counts, no timing).

    python benchmarks/plan_vs_measured.py                          # single-rank sizes: meter, cache, FLOPs
    python benchmarks/plan_vs_measured.py --rehearsal r.json       # vs the long-context rehearsal's per-rank
                                                                   # meter peaks (benchmarks/scale_rehearsal.py --json)

The CP2 / TP2 comparisons run under torchrun in tests/distributed/test_plan_parallel.py.
"""

from __future__ import annotations

import argparse
import json

import torch

from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.plan import Layout, RolloutShape
from megatron_branch.plan.flops import step_flops
from megatron_branch.plan.measure import measure_step
from megatron_branch.plan.memory import step_peak

SIZES = [  # (hidden, layers, dtype, shape, segment recompute)
    (32, 2, torch.float32, RolloutShape(prompt_length=64, responses=8, response_length=8), False),
    (32, 2, torch.float32, RolloutShape(prompt_length=64, responses=8, response_length=8), True),
    (64, 3, torch.float64, RolloutShape(prompt_length=200, responses=6, response_length=24, shared_response_length=8),
     False),
    (48, 2, torch.float32, RolloutShape(prompt_length=300, responses=12, response_length=16), True),
    (64, 2, torch.float32, RolloutShape(prompt_length=1024, responses=16, response_length=32), False),
]  # fmt: skip


def single_rank() -> None:
    initialize_parallel(ParallelConfig())
    print("| model | shape (P, G, S, K) | dtype | recompute | meter peak | planner | ratio | cache measured | "
          "planner | matmul FLOPs (FlopCounterMode) | planner | ratio |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for h, layers, dtype, shape, rc in SIZES:
        torch.manual_seed(0)
        arch = ModelArch(family="qwen2", vocab_size=37, hidden_size=h, num_layers=layers, num_attention_heads=4,
                         num_query_groups=2, ffn_hidden_size=2 * h, qkv_bias=True)  # fmt: skip
        model = build_model(arch, dtype=dtype)
        got = measure_step(model, shape, vocab=37, branch_micro_batch=4, recompute=rc, count_flops=True)
        pk = step_peak(arch, shape, Layout(), act_bytes=dtype.itemsize, branch_micro_batch=4,
                       segment_recompute=rc, layer_recompute=False)  # fmt: skip
        fl = step_flops(arch, shape, "replay", Layout(recompute="selective" if rc else "none"))
        mat = fl.dense + fl.logits
        print(f"| h{h} L{layers} | {shape.prompt_length}, {shape.responses}, {shape.response_length}, "
              f"{shape.shared_response_length} | {str(dtype)[6:]} | {'segment' if rc else 'none'} | "
              f"{got.saved_peak:,} | {pk.saved:,} | {pk.saved / got.saved_peak:.3f} | {got.cached_kv:,} | "
              f"{pk.cached_kv:,} | {got.matmul_flops:.4g} | {mat:.4g} | {mat / got.matmul_flops:.3f} |")  # fmt: skip


def rehearsal(path: str) -> int:
    """Compare with the rehearsal's JSON: {layout: {tp, cp, sequence_parallel, ranks: [{activation_peak_mb}]}}."""
    data = json.loads(open(path).read())
    worst = 0.0
    for name, res in data.items():
        meta = res.get("args", {})
        prompt, g, s = meta.get("prompt", 131008), meta.get("rollouts", 16), meta.get("response", 64)
        arch = ModelArch(family="llama", vocab_size=64, hidden_size=meta.get("hidden", 32),
                         num_layers=meta.get("layers", 1), num_attention_heads=4, num_query_groups=2,
                         ffn_hidden_size=2 * meta.get("hidden", 32))  # fmt: skip
        shape = RolloutShape(prompt_length=prompt, responses=g, response_length=s)
        layout = Layout(tp=res["tp"], cp=res["cp"], sequence_parallel=res["sequence_parallel"])
        pk = step_peak(arch, shape, layout, act_bytes=4, segment_recompute=False, layer_recompute=False)
        measured = max(r["activation_peak_mb"] for r in res["ranks"]) * 2**20
        ratio = pk.saved / measured
        worst = max(worst, abs(ratio - 1))
        print(
            f"{name}: measured {measured / 2**20:.1f} MB per rank, planner {pk.saved / 2**20:.1f} MB ({ratio:.3f})"
        )
    return 0 if worst <= 0.15 else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rehearsal", default=None, help="the JSON of benchmarks/scale_rehearsal.py --json")
    args = ap.parse_args()
    if args.rehearsal:
        raise SystemExit(rehearsal(args.rehearsal))
    single_rank()


if __name__ == "__main__":
    main()
