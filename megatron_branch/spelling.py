"""One spelling per setting: how each entry point names a setting in its refusals, written in one table.

A rule (rules/, a config's `__post_init__`) words its refusal once through an errors.Spelling; each entry point
picks its column of this table:
    flag     `megatron-branch grad`'s command line (`--cp 2`); a setting not listed is its flag (`--recompute-layers`)
    config   `train`'s YAML keys (`parallel.cp=2`); a config section's fields are spelled `section.field`
             (`config_spelling`: actor.clip_ratio_c, parallel.tp), the table adds the rest
    api      a library caller's names (run_schedule's `schedule`, ScheduleOptions, SamplingParams): rules.API
A new setting a rule names gets one row here (None: that entry point has no such setting, the default applies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from megatron_branch.errors import Spelling

FLAG, CONFIG, LIBRARY = 0, 1, 2
"""The table's columns."""

SETTINGS: dict[str, tuple[str | None, str | None, str | None]] = {
    # setting: (grad's flag, train's config key, the library's name)
    "schedule": ("--schedule", "schedule.name", "schedule"),
    "tp": ("--tp", "parallel.tp", "tp_size"),
    "cp": ("--cp", "parallel.cp", "cp_size"),
    "pp": ("--pp", "parallel.pp", "pp_size"),
    "vp": (None, None, "vp_size"),
    "recompute": ("--recompute", "schedule.recompute", "ScheduleOptions.recompute"),
    "recompute_layers": (
        "--recompute-layers",
        "schedule.enable_gradient_checkpointing",
        "ScheduleOptions.recompute_layers",
    ),
    "backend": ("--backend", "schedule.backend", "ScheduleOptions.backend"),
    "root_pieces": ("--root-pieces", "schedule.root_pieces", "ScheduleOptions.root_pieces"),
    "n": (None, "rollout.n", "SamplingParams.n"),
    "max_new_tokens": (None, "rollout.response_length", "SamplingParams.max_new_tokens"),
    "temperature": (None, "rollout.temperature", "SamplingParams.temperature"),
    "top_k": (None, "rollout.top_k", "SamplingParams.top_k"),
    "top_p": (None, "rollout.top_p", "SamplingParams.top_p"),
    "stop_token_ids": (None, None, "SamplingParams.stop_token_ids"),
    "branch_at": (None, "rollout.branch_at", "SamplingParams.branch_at"),
    "branch_factor": (None, "rollout.branch_factor", "SamplingParams.branch_factor"),
    "share_prefix": (None, "rollout.share_prefix", "SamplingParams.share_prefix"),
    "branch_at_turns": (None, "rollout.multi_turn.branch_at_turns", "MultiTurnParams.branch_at_turns"),
    "turn_end": (None, "rollout.multi_turn.turn_end", "MultiTurnParams.turn_end_token_ids"),
    "max_assistant_turns": (
        None,
        "rollout.multi_turn.max_assistant_turns",
        "MultiTurnParams.max_assistant_turns",
    ),
    "max_user_turns": (None, "rollout.multi_turn.max_user_turns", "MultiTurnParams.max_user_turns"),
    "max_tool_response_length": (
        None,
        "rollout.multi_turn.max_tool_response_length",
        "MultiTurnParams.max_tool_response_length",
    ),
    "capacity_factor": (
        "--moe-expert-capacity-factor",
        "moe.expert_capacity_factor",
        "TransformerConfig.moe_expert_capacity_factor",
    ),
    "moe": ("--moe-* / --routing-replay", "moe.*", None),
    "policy_loss": ("--objective", None, None),
    "plugins": ("--plugin", None, None),
    "algorithm": (None, "algorithm.name", None),
    "dtype": ("--dtype", "model.dtype", None),
}


def column(which: int) -> dict[str, str]:
    """{setting: spelling} of one column (the settings that entry point names)."""
    return {k: v[which] for k, v in SETTINGS.items() if v[which] is not None}  # type: ignore[misc]


def config_spelling(sections: Mapping[str, type]) -> Spelling:
    """train's spelling: each section's fields as `section.field`, then the table's config column."""
    names = {
        f.name: f"{prefix}.{f.name}" for prefix, cls in sections.items() for f in dataclasses.fields(cls)
    }
    names.update(column(CONFIG))
    return Spelling(names=names, assign="=")


FLAGS = Spelling(names=column(FLAG))
"""grad's spelling: its flags (the objective's fields by their verl-named flags, `--objective` for policy_loss)."""
API = Spelling(names=column(LIBRARY), assign="=")
"""How a library caller names the settings (run_schedule's name, ScheduleOptions, SamplingParams)."""
VERL = Spelling(
    names={
        "pp": "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
        "vp": "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size",
        "ep": "actor_rollout_ref.actor.megatron.expert_model_parallel_size",
        "schedule": "BranchOptions.schedule",
        "root_pieces": "BranchOptions.schedule_options['root_pieces']",
    },
    assign="=",
)
"""How verl's engine names the settings its pipeline refusals mention (integration/verl_pp.py)."""
