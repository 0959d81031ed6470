"""One run assembly: RunSpec (spec.py) -> rules.check -> build_engine (engine.py)."""

from megatron_branch.assembly.engine import (
    Engine,
    build_engine,
    build_stage,
    load_hf_weights,
    prepare_for_layout,
    schedule_options,
)
from megatron_branch.assembly.spec import MoEConfig, RunSpec, ScheduleConfig

__all__ = [
    "Engine",
    "MoEConfig",
    "RunSpec",
    "ScheduleConfig",
    "build_engine",
    "build_stage",
    "load_hf_weights",
    "prepare_for_layout",
    "schedule_options",
]
