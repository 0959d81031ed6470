"""`megatron-branch train CONFIG.yaml [section.key=value ...] [--resume auto]`: on-policy RL post-training.

The config (one YAML file; docs/training.md is its reference) says what to train (model, tokenizer, data,
rollout, algorithm, actor, critic, optim, parallel, schedule, warmup, logging, checkpoint, trainer). Dotted
overrides change any field: `rollout.n=8 optim.lr=1e-5`. Everything is validated before any work; a mistake is
one line on stderr and exit status 2, and no run folder is left behind.
Under torchrun: `torchrun --nproc_per_node N -m megatron_branch train CONFIG.yaml parallel.tp=2` (world = tp * dp).
The run folder (trainer.default_local_dir) receives config.yaml, metrics.jsonl, tensorboard/, curves.png,
checkpoints/step_*/ and, at the end, policy_mcore/ and hf/. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_train_command(sub: Any) -> None:
    p = sub.add_parser(
        "train",
        help="RL post-training (GRPO / PPO / DPO) with exact shared-prefix replay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="YAML config file (see docs/training.md)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rollout.n=8 optim.lr=1e-5")
    p.add_argument(
        "--resume",
        choices=["auto", "disable"],
        default=None,
        help="auto: continue from the newest checkpoint",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved config (the file, the overrides and every default, as YAML) and exit",
    )
    p.set_defaults(func=run_train, collect_extra=True)


def fits_the_launch(cfg: Any) -> Any:
    """The layout against the launch's world size, inside the shared verdict: `parallel.dp=4` on 2 ranks is one
    line from rank 0 (checked later, in the trainer, every rank printed its own)."""
    from megatron_branch.errors import SettingError, launched_world_size
    from megatron_branch.train.validate import SPELLING

    try:
        cfg.parallel.data_parallel_size(launched_world_size())
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    return cfg


def run_train(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from megatron_branch.train.config_io import load_config

    overrides = list(args.overrides)
    if args.resume is not None:
        overrides.append(f"trainer.resume_mode={args.resume}")
    from megatron_branch.parallel.agree import check_on_every_rank

    # all checks that need no data, before any work; under torchrun the verdict is shared (printed once)
    cfg = check_on_every_rank(lambda: fits_the_launch(load_config(args.config, overrides)))
    if args.print_config:  # as Hydra's `--cfg job`: what would run, nothing done
        from megatron_branch.train.config_io import resolved_yaml

        if not dist.is_initialized() or dist.get_rank() == 0:
            print(resolved_yaml(cfg), end="", flush=True)
        return 0

    from megatron_branch.train.loop import Trainer
    from megatron_branch.train.metrics import read_metrics, run_summary

    main = not dist.is_initialized() or dist.get_rank() == 0
    try:
        trainer = Trainer(cfg)
    except KeyboardInterrupt:
        if main:
            print("interrupted before the first step: nothing was written", file=sys.stderr, flush=True)
        raise
    summary = trainer.run()
    if main:
        last = summary.pop("last", {})
        if not summary.get("nothing_to_do"):
            for line in run_summary(read_metrics(summary["metrics"])):
                print(line, flush=True)
            print(f"metrics:    {summary['metrics']}", flush=True)
            print(f"curves:     {summary['curves']}", flush=True)
            print(f"checkpoint: {summary['checkpoint']}", flush=True)
            if summary.get("hf"):
                print(f"hf export:  {summary['hf']}", flush=True)
        print(json.dumps({**summary, "reward_mean": last.get("reward_mean")}), flush=True)
    return 0
