"""The planner against measurements on this machine (deterministic byte and FLOP counts, no timing).

    python benchmarks/plan_vs_measured.py                          # single-rank sizes: meter, cache, FLOPs
    python benchmarks/plan_vs_measured.py --rehearsal r.json [--prompt P ...]   # vs the rehearsal's per-rank
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
from megatron_branch.testing import tiny_arch, tiny_hf_config

SIZES = [  # (family, hidden, layers, dtype, shape, segment recompute)
    ("qwen2", 32, 2, torch.float32, RolloutShape(prompt_length=64, responses=8, response_length=8), False),
    ("qwen2", 32, 2, torch.float32, RolloutShape(prompt_length=64, responses=8, response_length=8), True),
    ("qwen2", 64, 3, torch.float64,
     RolloutShape(prompt_length=200, responses=6, response_length=24, shared_response_length=8), False),
    ("qwen2", 48, 2, torch.float32, RolloutShape(prompt_length=300, responses=12, response_length=16), True),
    ("qwen2", 64, 2, torch.float32, RolloutShape(prompt_length=1024, responses=16, response_length=32), False),
    # Qwen3: q/k norms and a free head_dim (4 heads x 16 = 64 wide attention in a hidden of 32)
    ("qwen3", 32, 2, torch.float32, RolloutShape(prompt_length=64, responses=8, response_length=8), False),
    ("qwen3", 32, 2, torch.float32, RolloutShape(prompt_length=64, responses=8, response_length=8), True),
]  # fmt: skip


def tiny(family: str, hidden: int, layers: int) -> ModelArch:
    """Qwen2: 4 heads / 2 kv of hidden / 4, QKV bias; Qwen3: the same heads of 16 with q/k norms (ffn 2 x hidden)."""
    if family == "qwen2":
        return tiny_arch("qwen2", hidden=hidden, layers=layers)
    return ModelArch.from_hf_config(
        tiny_hf_config(family, hidden_size=hidden, num_layers=layers, ffn=2 * hidden)
    )


def single_rank() -> None:
    initialize_parallel(ParallelConfig())
    print("| model | shape (P, G, S, K) | dtype | recompute | meter peak | planner | ratio | cache measured | "
          "planner | matmul FLOPs (FlopCounterMode) | planner | ratio |")  # fmt: skip
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for family, h, layers, dtype, shape, rc in SIZES:
        torch.manual_seed(0)
        arch = tiny(family, h, layers)
        model = build_model(arch, dtype=dtype)
        got = measure_step(model, shape, vocab=37, branch_micro_batch=4, recompute=rc, count_flops=True)
        pk = step_peak(arch, shape, Layout(), act_bytes=dtype.itemsize, branch_micro_batch=4,
                       segment_recompute=rc, layer_recompute=False)  # fmt: skip
        fl = step_flops(arch, shape, "replay", Layout(recompute="selective" if rc else "none"))
        mat = fl.dense + fl.logits
        print(f"| {family} h{h} L{layers} | {shape.prompt_length}, {shape.responses}, {shape.response_length}, "
              f"{shape.shared_response_length} | {str(dtype)[6:]} | {'segment' if rc else 'none'} | "
              f"{got.saved_peak:,} | {pk.saved:,} | {pk.saved / got.saved_peak:.3f} | {got.cached_kv:,} | "
              f"{pk.cached_kv:,} | {got.matmul_flops:.4g} | {mat:.4g} | {mat / got.matmul_flops:.3f} |")  # fmt: skip


def rehearsal(path: str, args: argparse.Namespace) -> int:
    """Compare with the rehearsal's JSON ({layout: {tp, cp, sequence_parallel, positions_logical, ranks: [...]}});
    the batch and model are the rehearsal's (benchmarks/scale_rehearsal.py), given by the same flags."""
    data = json.loads(open(path).read())
    arch = ModelArch(family="llama", vocab_size=64, hidden_size=args.hidden, num_layers=args.layers,
                     num_attention_heads=4, num_query_groups=2, ffn_hidden_size=2 * args.hidden)  # fmt: skip
    shape = RolloutShape(prompt_length=args.prompt, responses=args.rollouts, response_length=args.response)
    worst = 0.0
    for name, res in data.items():
        assert res["positions_logical"] == shape.positions_logical, (
            "pass the rehearsal's --prompt/--rollouts/..."
        )
        layout = Layout(tp=res["tp"], cp=res["cp"], sequence_parallel=res["sequence_parallel"])
        pk = step_peak(arch, shape, layout, act_bytes=4, segment_recompute=False, layer_recompute=False)
        measured = max(r["activation_peak_mb"] for r in res["ranks"]) * 2**20
        ratio = pk.saved / measured
        worst = max(worst, abs(ratio - 1))
        print(f"| {name} | {measured / 2**20:.2f} | {pk.saved / 2**20:.2f} | {ratio:.3f} |")
    return 0 if worst <= 0.15 else 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rehearsal", default=None, help="the JSON of benchmarks/scale_rehearsal.py --json")
    ap.add_argument(
        "--rollouts", type=int, default=16, help="--rehearsal: its batch and model (its defaults)"
    )
    ap.add_argument("--prompt", type=int, default=131_008)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=32)
    args = ap.parse_args()
    if args.rehearsal:
        print(
            "| layout | measured activation peak per rank (MB) | planner (MB) | ratio |\n|---|---:|---:|---:|"
        )
        raise SystemExit(rehearsal(args.rehearsal, args))
    single_rank()


if __name__ == "__main__":
    main()
