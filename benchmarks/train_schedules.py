"""The demo's RL run under each schedule on the same seed: reward curves (they must coincide in float64) and the
wall time of a whole RL step (generation + scoring + update) per schedule. The fair, round-robin timing of whole
steps by phase against `naive-fused` with unshared sampling, next to the FLOP limits: benchmarks/whole_step.py.

    python benchmarks/train_schedules.py [--dtype float64] [--steps 40] [--out bench-out/train_schedules]

Writes OUT/<schedule>/ (each a full run folder), OUT/train_schedules.png (reward per step, one line per schedule)
and OUT/train_schedules.json (per-schedule median step / generation / update seconds, max reward difference to
naive). Runs one after another in this process: on a noisy machine compare medians, and rerun on a quiet one.

`replay-stopgrad` is the INEXACT comparison baseline (the prompt's K/V as constants, what the announced system
trains). With it, the summary also gets its gradient error against exact replay at the first RL step (the same
rollouts: both runs sample them from the same warmed-up policy), the relative Frobenius norm per parameter
(median and max), and OUT/stopgrad_vs_replay.png (its reward curve next to exact replay's).

    python benchmarks/train_schedules.py --schedules replay,replay-stopgrad --steps 40
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

SCHEDULES = ("naive", "naive-fused", "packed-nosharing", "packed", "replay", "replay-stopgrad")


def first_step_gradient_error(overrides: list[str], config: str, out: Path) -> dict[str, Any]:
    """Per-parameter relative Frobenius error of replay-stopgrad's gradient against exact replay's, on the first
    RL step's first mini-batch (the rollouts both runs sample first, the objective their update uses, without a
    KL term: the demo has none)."""
    from megatron_branch.losses import build_objective
    from megatron_branch.parallel.grads import param_grad
    from megatron_branch.train.config_io import load_config
    from megatron_branch.train.loop import Trainer
    from megatron_branch.update.step import accumulate_gradients

    shutil.rmtree(out, ignore_errors=True)
    cfg = load_config(config, [*overrides, "schedule.name=replay", f"trainer.default_local_dir={out}"])
    tr = Trainer(cfg)
    rollouts, rewards, _ = tr._sample(tr.order.next_batch())
    lo, hi = tr.actor._mini_batches(rollouts, cfg.rollout.n)[0]
    index = [j // cfg.rollout.n for j in range(lo, hi)]  # each rollout's prompt instance
    batch = tr.algo.estimator.compute(rollouts[lo:hi], rewards[lo:hi], index, cfg.algorithm)
    obj = build_objective(dataclasses.replace(tr.algo.objective, kl_loss_coef=0.0), batch)
    ddp = tr.actor.policy.ddp
    grads: dict[str, dict[str, Any]] = {}
    for sched in ("replay", "replay-stopgrad"):
        ddp.zero_grad_buffer()
        ddp.zero_grad(set_to_none=True)
        accumulate_gradients(ddp, batch, obj, dataclasses.replace(tr.actor.plan, schedule=sched))
        grads[sched] = {n: param_grad(p).detach().double().clone() for n, p in ddp.module.named_parameters()}
    exact, stop = grads["replay"], grads["replay-stopgrad"]
    err = {n: float((stop[n] - exact[n]).norm() / exact[n].norm().clamp_min(1e-300)) for n in exact}
    total = float(
        sum((stop[n] - exact[n]).square().sum() for n in exact).sqrt()
        / sum(exact[n].square().sum() for n in exact).sqrt()
    )
    worst = max(err, key=err.get)
    return {
        "rollouts": len(batch),
        "median": statistics.median(err.values()),
        "max": err[worst],
        "max_param": worst,
        "whole_gradient": total,
        "per_param": err,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/configs/demo.yaml")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="bench-out/train_schedules")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args()

    from megatron_branch.train.config_io import load_config
    from megatron_branch.train.loop import Trainer
    from megatron_branch.train.metrics import read_metrics

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {}
    common = [f"model.dtype={args.dtype}", f"trainer.total_training_steps={args.steps}",
              "logging.progress_bar=false", "checkpoint.hf_export=false", "trainer.save_freq=-1"]  # fmt: skip
    for sched in args.schedules.split(","):
        cfg = load_config(
            args.config, [f"schedule.name={sched}", *common, f"trainer.default_local_dir={out / sched}"]
        )
        Trainer(cfg).run()
        rows[sched] = read_metrics(out / sched / "metrics.jsonl")
        print(f"{sched}: done ({len(rows[sched])} steps)", flush=True)

    base = rows.get("naive")
    exact = rows.get("replay")
    summary = {}
    for sched, r in rows.items():
        summary[sched] = {
            "step_s_median": statistics.median(m["timing_s/step"] for m in r),
            "gen_s_median": statistics.median(m["timing_s/gen"] for m in r),
            "update_s_median": statistics.median(m["timing_s/update_actor"] for m in r),
            "positions_logical": r[0]["positions_logical"],
            "positions_computed": r[0]["positions_computed"],
            "reward_first10": sum(m["reward_mean"] for m in r[:10]) / min(10, len(r)),
            "reward_last10": sum(m["reward_mean"] for m in r[-10:]) / min(10, len(r)),
            "max_abs_reward_diff_vs_naive": (
                max(abs(a["reward_mean"] - b["reward_mean"]) for a, b in zip(r, base)) if base else None
            ),
            "max_abs_reward_diff_vs_replay": (
                max(abs(a["reward_mean"] - b["reward_mean"]) for a, b in zip(r, exact)) if exact else None
            ),
        }
    if "replay-stopgrad" in rows:
        ge = first_step_gradient_error(common, args.config, out / "grad_error")
        (out / "stopgrad_grad_error.json").write_text(json.dumps(ge, indent=1) + "\n")
        summary["replay-stopgrad"]["grad_error_vs_exact"] = {k: v for k, v in ge.items() if k != "per_param"}
    (out / "train_schedules.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    styles = {"naive": ("-", 4.0), "packed": ("--", 2.5), "replay": (":", 2.0)}
    for sched, r in rows.items():
        if sched == "replay-stopgrad":  # inexact: its curve is shown apart (stopgrad_vs_replay.png)
            continue
        ls, lw = styles.get(sched, ("-", 1.5))
        ax[0].plot([m["step"] for m in r], [m["reward_mean"] for m in r], ls, lw=lw, label=sched)
    ax[0].set_title(f"mean reward per RL step ({args.dtype}, same seed)")
    ax[0].set_xlabel("step")
    ax[0].legend()
    names = list(summary)
    ax[1].bar(names, [summary[n]["gen_s_median"] for n in names], label="generation")
    ax[1].bar(names, [summary[n]["update_s_median"] for n in names],
              bottom=[summary[n]["gen_s_median"] for n in names], label="update")  # fmt: skip
    ax[1].set_title("median seconds per RL step (noisy machine)")
    ax[1].legend()
    fig.tight_layout()
    fig.savefig(out / "train_schedules.png", dpi=90)
    print(f"wrote {out / 'train_schedules.png'}")
    if exact is not None and "replay-stopgrad" in rows:
        plot_stopgrad(rows, summary, args.dtype, out / "stopgrad_vs_replay.png")


def plot_stopgrad(rows: dict[str, list[dict]], summary: dict, dtype: str, path: Path) -> None:
    """replay-stopgrad's reward curve next to exact replay's (the comparison docs/training.md shows)."""
    import matplotlib.pyplot as plt

    ge = summary["replay-stopgrad"]["grad_error_vs_exact"]
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for sched, label in (("replay", "replay (exact)"), ("replay-stopgrad", "stop-gradient (NOT exact)")):
        r = rows[sched]
        ax.plot([m["step"] for m in r], [m["reward_mean"] for m in r], "-" if sched == "replay" else "--",
                lw=2.0, label=label)  # fmt: skip
    ax.set_title(
        f"mean reward per RL step ({dtype}, same seed)\nstop-gradient's first-step gradient error vs exact: "
        f"median {ge['median']:.2g}, max {ge['max']:.2g} per parameter",
        fontsize=9,
    )
    ax.set_xlabel("step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
