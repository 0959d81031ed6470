"""The demo's RL run under each schedule on the same seed: reward curves (they must coincide in float64) and the
wall time of a whole RL step (generation + scoring + update) per schedule.

    python benchmarks/train_schedules.py [--dtype float64] [--steps 40] [--out bench-out/train_schedules]

Writes OUT/<schedule>/ (each a full run folder), OUT/train_schedules.png (reward per step, one line per schedule)
and OUT/train_schedules.json (per-schedule median step / generation / update seconds, max reward difference to
naive). Runs one after another in this process: on a noisy machine compare medians, and rerun on a quiet one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

SCHEDULES = ("naive", "packed", "replay")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="examples/configs/demo.yaml")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", default="bench-out/train_schedules")
    ap.add_argument("--schedules", default=",".join(SCHEDULES))
    args = ap.parse_args()

    from megatron_branch.train.config import load_config
    from megatron_branch.train.loop import Trainer
    from megatron_branch.train.metrics import read_metrics

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {}
    for sched in args.schedules.split(","):
        cfg = load_config(
            args.config,
            [f"schedule.name={sched}", f"model.dtype={args.dtype}", f"trainer.total_training_steps={args.steps}",
             f"trainer.default_local_dir={out / sched}", "logging.progress_bar=false", "checkpoint.hf_export=false",
             "trainer.save_freq=-1"],
        )  # fmt: skip
        Trainer(cfg).run()
        rows[sched] = read_metrics(out / sched / "metrics.jsonl")
        print(f"{sched}: done ({len(rows[sched])} steps)", flush=True)

    base = rows.get("naive")
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
        }
    (out / "train_schedules.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    styles = {"naive": ("-", 4.0), "packed": ("--", 2.5), "replay": (":", 2.0)}
    for sched, r in rows.items():
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


if __name__ == "__main__":
    main()
