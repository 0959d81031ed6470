"""`megatron-branch grad`'s command line: the contract's own flags, and every setting's flag generated from the
dataclass the train config uses for it (commands/flags.py), so a default, a choice and a help text are written once.

    schedule     ScheduleConfig (assembly/spec.py): --schedule (grad's contract: replay | packed | naive),
                 --backend (the executor registry), --branch-micro-batch, --recompute, --root-pieces,
                 --recompute-layers (alias --enable-gradient-checkpointing: train's schedule key)
    layout       ParallelLayout (parallel/layout.py): --tp --cp --pp --ep --sequence-parallel
    precision    RunSpec.dtype, RunSpec.grad_sync
    objective    ObjectiveConfig (losses/config.py), verl's names; the older flags kept as aliases; grad's
                 contract default objective is pg (the linear policy gradient), every other default is the
                 dataclass's (the KL estimator: low_var_kl, verl's actor default)
    moe          MoEConfig: --moe-<field>; --routing-replay = --moe-router-replay R3
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_branch import outputs, spelling
from megatron_branch.commands.flags import (
    _number_or_text,
    _positive_float,
    _positive_int,
    _positive_int_or_off,
    add_fields,
    read_fields,
)
from megatron_branch.data.rollouts import CONTEXT_OVERRIDE_FLAG

SCHEDULE = {
    "flags": {
        "name": "--schedule",
        "enable_gradient_checkpointing": "--recompute-layers",
        "memory_budget_gb": "--memory-budget",
    },
    "dests": {
        "name": "schedule",
        "enable_gradient_checkpointing": "recompute_layers",
        "memory_budget_gb": "memory_budget",
    },
}
"""How grad spells ScheduleConfig's fields (its contract's flags)."""
OBJECTIVE_ALIASES = {
    "clip_ratio_low": ["--clip-low"],
    "clip_ratio_high": ["--clip-high"],
    "clip_ratio_c": ["--clip-c"],
    "kl_loss_coef": ["--kl-coef"],
    "kl_loss_type": ["--kl-type"],
    "entropy_coeff": ["--entropy-coef"],
    "loss_agg_mode": ["--loss-agg"],
    "dpo_beta": ["--beta"],
}
"""The objective flags' older spellings (they keep working)."""
GRAD_DEFAULTS = {"policy_loss": "pg"}
"""Where grad's contract fixes another default than the dataclass: its loss is the linear policy gradient."""
SPELLING = spelling.FLAGS
"""How grad's messages name a setting: its flag (spelling.py's flag column)."""


def add_grad_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of grad: the contract's own, then the generated ones (see the module doc)."""
    _contract_flags(p)
    add_setting_flags(p)
    outputs.add_overwrite_argument(p)


def _contract_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hf",
        required=True,
        help="Hugging Face folder (config.json + safetensors): Llama, Qwen2, Qwen3, Qwen3.5/3.6, or a mixture of "
        "experts (Qwen3-MoE, Mixtral, Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next)",
    )
    p.add_argument(
        "--rollouts", required=True, help='JSONL: {"prompt": [ids], "response": [ids], "advantage": x}'
    )
    p.add_argument(
        "--out", required=True, help="where to write the gradients (.safetensors, HF names; see --overwrite)"
    )
    p.add_argument("--logprobs-out", default=None, help="write each rollout's response logprobs (JSONL)")
    p.add_argument(
        CONTEXT_OVERRIDE_FLAG,
        action="store_true",
        help="accept rollouts longer than the model's max_position_embeddings (RoPE extrapolates; off by default)",
    )
    p.add_argument(
        "--plugin",
        dest="plugins",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (dotted, or a .py file) before the objective is looked up (repeatable)",
    )


def add_setting_flags(p: argparse.ArgumentParser) -> None:
    """The flags generated from the run's dataclasses (see the module doc)."""
    from megatron_branch.assembly.spec import MoEConfig, RunSpec, ScheduleConfig
    from megatron_branch.losses.config import ObjectiveConfig
    from megatron_branch.parallel.layout import ParallelLayout
    from megatron_branch.rules import GRAD_SCHEDULES

    s = p.add_argument_group("schedule")
    add_fields(s, ScheduleConfig, **SCHEDULE, choices={"name": (*GRAD_SCHEDULES, "auto")},
               types_={"branch_micro_batch": _positive_int, "chunk_tokens": _positive_int_or_off,
                       "memory_budget_gb": _positive_float}, notes={"name": "grad runs replay, packed or naive; auto: packed when its planned activation peak fits "
               "--memory-budget (on a GPU the free device memory) and the tree is at most one chunk of "
               "--chunk-tokens, replay otherwise (plan/auto.py)."},
               aliases={"enable_gradient_checkpointing": ["--enable-gradient-checkpointing"]})  # fmt: skip
    lay = p.add_argument_group("layout (world = tp * cp * pp * dp under torchrun)")
    add_fields(lay, ParallelLayout, skip=("dp",), types_={"ep": _positive_int})
    add_fields(p.add_argument_group("precision"), RunSpec, skip=_all_but(RunSpec, "dtype", "grad_sync"))
    o = p.add_argument_group("objective (verl's names, older flags as aliases)")
    add_fields(o, ObjectiveConfig, flags={"policy_loss": "--objective"}, aliases=OBJECTIVE_ALIASES,
               types_={"rollout_rs_threshold": _number_or_text},
               defaults=GRAD_DEFAULTS, notes={"policy_loss": "grad's contract default: pg."})  # fmt: skip
    m = p.add_argument_group("mixture of experts")
    add_fields(m, MoEConfig, prefix="moe-")
    m.add_argument(
        "--routing-replay", dest="moe_router_replay", action="store_const", const="R3", default="disabled",
        help="route recorded tokens to their routed_experts (= --moe-router-replay R3)",
    )  # fmt: skip


def _all_but(cls: type, *keep: str) -> list[str]:
    import dataclasses

    return [f.name for f in dataclasses.fields(cls) if f.name not in keep]


def run_spec(args: argparse.Namespace, arch: Any = None) -> Any:
    """The RunSpec the flags describe (assembly/spec.py)."""
    from megatron_branch.assembly.spec import MoEConfig, RunSpec, ScheduleConfig
    from megatron_branch.parallel.layout import ParallelLayout

    return RunSpec(
        hf_path=args.hf, arch=arch, layout=ParallelLayout(**read_fields(args, ParallelLayout)),
        schedule=ScheduleConfig(**read_fields(args, ScheduleConfig, dests=SCHEDULE["dests"])),
        objective=objective_config(args), dtype=args.dtype, grad_sync=args.grad_sync,
        moe=MoEConfig(**read_fields(args, MoEConfig, prefix="moe_")),
    )  # fmt: skip


def objective_config(args: argparse.Namespace) -> Any:
    """The one objective config (losses/config.py) from the flags: each objective flag's dest is its field."""
    from megatron_branch.losses import ObjectiveConfig

    return ObjectiveConfig(**read_fields(args, ObjectiveConfig))
