"""The bf16 bound's figures (docs/design.md "bf16: what exact means"): each schedule's bf16 gradient error against
float64 naive training of the same weights and batch, next to naive's own bf16 error.

    OMP_NUM_THREADS=1 python benchmarks/bf16_bound.py [--seeds 0 1 2 3 4] [--branches 8] [--json out.json]
    OMP_NUM_THREADS=1 python benchmarks/bf16_bound.py --branch-micro-batch 1 --plant-bf16-dkdv   # the planted bug

Per seed (weights and batch): the relative L2 error of every parameter tensor's fp32 main gradient, the loss's
relative error and the largest absolute logprob error, for naive / packed / replay in bf16; then, per schedule, the
ratio to naive's error (worst tensor, median tensor). `--plant-bf16-dkdv` sums replay's dK/dV in bf16 (the bug
tests/unit/test_bf16.py catches sharply): what it does to this end-to-end bound. Timings are not measured.
"""

from __future__ import annotations

import argparse
import json
import statistics

from megatron_branch.bench.precision import SCHEDULES, measure, ratios
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--branches", type=int, default=8, help="leaves per inner response node")
    ap.add_argument(
        "--branch-micro-batch", type=int, default=8, help="replay: leaves per chunk (1: one sum each)"
    )
    ap.add_argument(
        "--plant-bf16-dkdv", action="store_true", help="sum replay's dK/dV in bf16 (a planted bug)"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    groups = initialize_parallel(ParallelConfig())
    if args.plant_bf16_dkdv:
        from megatron_branch.schedule import prefix_cache

        prefix_cache.accumulation_dtype = lambda dtype: dtype  # the bug: the leaf's own bf16
    rows = []
    print("seed schedule  grad err (min / median / max over tensors)   loss err   logprob err   "
          "ratio to naive (median / worst tensor, loss, logprobs)")  # fmt: skip
    for seed in args.seeds:
        errs = measure(
            seed, groups=groups, branches=args.branches, branch_micro_batch=args.branch_micro_batch
        )
        for s in SCHEDULES:
            g = sorted(errs[s]["grads"].values())
            line = f"{seed:4d} {s:8s}  {g[0]:.2e} / {statistics.median(g):.2e} / {g[-1]:.2e}   "
            line += f"{errs[s]['loss']:.2e}   {errs[s]['logprobs']:.2e}"
            row = {
                "seed": seed,
                "schedule": s,
                **{k: errs[s][k] for k in ("loss", "logprobs")},
                "grads": errs[s]["grads"],
            }
            if s != "naive":
                r = ratios(errs, s)
                t = sorted(v for k, v in r.items() if k not in ("loss", "logprobs"))
                line += f"   {statistics.median(t):.2f} / {t[-1]:.2f}, {r['loss']:.2f}, {r['logprobs']:.2f}"
                row["ratios"] = r
            print(line, flush=True)
            rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
