"""What megatron's precision-aware optimizer options cost in accuracy (docs/training.md): they are NOT exact.

One tiny policy (megatron-core GPTModel, 2 layers, hidden 32), one fixed batch of branching rollouts, the exact
replay schedule, N Adam updates (lr 1e-3, clipping 1.0, weight decay 0.01), in one process on CPU. Each run's
total update of the master weights (fp32, or float64 for the reference) is compared with a float64 run of the same
start, per parameter (worst and median relative error of the update), and with the standard bf16 run:

    fp32                plain optimizer, float32 weights (exact training in float32)
    bf16                bf16 weights, megatron's distributed optimizer: fp32 main grads, fp32 master + moments
    bf16 offload        the same through megatron's CPU offload (precision-aware path, dtypes fp32: == bf16)
    bf16 main grads     offload + main_grads_dtype=bf16: gradients accumulated and reduced in bf16 (megatron's code)
    bf16 exp_avg        bf16 + Adam's first moment stored in bf16 (EMULATED: rounded to bf16 after every step)
    bf16 exp_avg_sq     bf16 + Adam's second moment stored in bf16 (EMULATED, as above)

megatron keeps lowered moments only in TransformerEngine's FusedAdam (CUDA; its hybrid optimizer keeps them in
fp32), so on CPU their cost is emulated by rounding the stored moments to bf16 (round-to-nearest-even) after every
step, which is what storing them in bf16 does; the kernel's own arithmetic is fp32 either way.

    python benchmarks/precision_aware_cost.py [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch

VOCAB = 37


def _run(
    groups: Any, dtype: torch.dtype, steps: int, *, round_state: str | None = None, **settings: Any
) -> dict:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.losses import Aggregation, PolicyObjective
    from megatron_branch.schedule import ScheduleOptions
    from megatron_branch.testing import random_tree_rollouts, tiny_branch_model
    from megatron_branch.train.policy import Trainee
    from megatron_branch.update import OptimizerSettings, UpdatePlan, update_step
    from megatron_branch.update.optimizer import inner_optimizers

    start = tiny_branch_model(torch.float64, seed=3, scale=1.0)
    model = tiny_branch_model(dtype, seed=3, scale=1.0)
    with torch.no_grad():  # every run starts from the float64 weights rounded once to its dtype
        for p, q in zip(model.parameters(), start.parameters()):
            p.copy_(q)
    opt = OptimizerSettings(lr=1e-3, weight_decay=0.01, clip_grad=1.0, **settings)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    tr = Trainee(model, dtype=dtype, settings=opt, pgc=pgc)
    rollouts = random_tree_rollouts(groups=2, prompt_len=8, branches=4, levels=2, seg_len=(2, 4), seed=11)
    obj = PolicyObjective(agg=Aggregation.of_batch(rollouts))
    plan = UpdatePlan(
        opts=ScheduleOptions(groups=groups, vocab_size=VOCAB), schedule="replay", pg_collection=pgc
    )
    (inner,) = inner_optimizers(tr.optimizer)
    losses = []
    for _ in range(steps):
        res = update_step(tr.ddp, rollouts, obj, plan, optimizer=tr.optimizer, scheduler=tr.scheduler)
        losses.append(res.metrics["actor/loss"])
        if round_state:
            for state in inner.optimizer.state.values():
                state[round_state].copy_(state[round_state].to(torch.bfloat16))
    return {"master": _master(inner, model), "start": {n: p.detach().double() for n, p in start.named_parameters()},
            "loss": losses[-1]}  # fmt: skip


def _master(inner: Any, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights the optimizer steps (fp32 master copies for bf16 weights), whole (one rank: one shard each)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    out = {}
    for name, p in model.named_parameters():
        if isinstance(inner, DistributedOptimizer):
            main = inner._get_main_param_and_optimizer_states(p)["param"]
            out[name] = main.detach().double().view(p.shape)
        else:
            out[name] = p.detach().double()
    return out


def _errors(got: dict, ref: dict) -> tuple[float, float]:
    errs = []
    for n, w in ref["master"].items():
        d = w - ref["start"][n]
        if d.norm() > 0:
            errs.append(float((got["master"][n] - w).norm() / d.norm()))
    return max(errs), statistics.median(errs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    groups = initialize_parallel(ParallelConfig())
    offload = {
        "use_distributed_optimizer": True,
        "use_precision_aware_optimizer": True,
        "optimizer_cpu_offload": True,
    }
    runs = {
        "float64 (reference)": (torch.float64, {}, None),
        "fp32": (torch.float32, {}, None),
        "bf16": (torch.bfloat16, {"use_distributed_optimizer": True}, None),
        "bf16 offload": (torch.bfloat16, offload, None),
        "bf16 main grads": (torch.bfloat16, {**offload, "main_grads_dtype": "bf16"}, None),
        "bf16 exp_avg (emulated)": (torch.bfloat16, {"use_distributed_optimizer": True}, "exp_avg"),
        "bf16 exp_avg_sq (emulated)": (torch.bfloat16, {"use_distributed_optimizer": True}, "exp_avg_sq"),
    }
    out = {name: _run(groups, dt, args.steps, round_state=r, **kw) for name, (dt, kw, r) in runs.items()}
    ref, base = out["float64 (reference)"], out["bf16"]
    rows = []
    print(f"{args.steps} updates; relative error of each parameter's update (master weights)")
    print("| run | vs float64: worst | median | vs bf16: worst | median | final loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in out.items():
        w, m = _errors(r, ref)
        bw, bm = _errors(r, base) if name != "float64 (reference)" else (float("nan"),) * 2
        rows.append({"run": name, "worst": w, "median": m, "worst_vs_bf16": bw, "median_vs_bf16": bm,
                     "loss": r["loss"]})  # fmt: skip
        print(f"| {name} | {w:.1e} | {m:.1e} | {bw:.1e} | {bm:.1e} | {r['loss']:.6f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
