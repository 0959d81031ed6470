"""Pipeline parallelism in verl's engine (verl 0.9.1, `pipeline_model_parallel_size > 1`): what the switch checks.

Nothing else is pipeline-specific: verl builds one stage's GPTModel per rank (pre_process / post_process) and
hands EVERY stage the same micro-batches (transformer_impl.py `make_batch_generator`), so every stage builds the
same prefix tree, and the step's ScheduleOptions carry megatron's pipeline group (ParallelGroups reads every axis
of parallel_state); `run_schedule` then runs megatron-branch's pipelined replay / packed schedule
(schedule/pipeline.py: 1F1B leaf waves, root pieces) across the stages. Its StepResult (logprobs, entropies) is
broadcast from the last stage to every stage; verl reads the outputs on the last stage only, as megatron's own
schedule returns them there.

Refused, one line each, at engine start (the project's pipeline rules, rules/schedule.py `check_pipeline`, in
verl's names): interleaved (virtual) stages (VPP: the tree schedules run one contiguous block of layers per
stage; megatron's interleaved schedule would need the tree walk split across model chunks), the naive schedule,
a layer count PP does not divide, and a mixture-of-experts model at expert parallel size > 1 (the project's
pipeline runs MoE at EP 1 only). verl's value model (PPO's critic: its one-output head on the last stage) is
pipelined like the policy (tests/distributed/test_pipeline_critic.py). A MoE model at EP 1 runs: each stage's
router losses and routing replay under schedule/moe.py, verl's router replay R3 and R2 per stage (R2: each stage
hands its own layers' records, verl_moe.r2_record, joined by verl's pp_gather); shown against verl's own PP path
in tests/distributed/test_verl_pp_moe.py. A hybrid (gated delta net) model runs too (each stage's prefix cache
holds its GDN layers' fork states), shown against per-rollout training in
tests/distributed/test_verl_hybrid_parallel.py (verl's own path cannot pack GDN on CPU). verl's engine builds no
Mamba-2 hybrid (its GPTModel path), so the rules' Mamba-2 refusal has no verl case.
"""

from __future__ import annotations

from typing import Any

from megatron_branch.errors import SettingError
from megatron_branch.integration.verl_step import VerlBranchError
from megatron_branch.rules import check_pipeline
from megatron_branch.spelling import VERL

__all__ = ["refuse_pipeline"]


def refuse_pipeline(engine_config: Any, options: Any, tf_config: Any = None, *, moe: bool = False) -> None:
    """One line (VerlBranchError) for what branch replay cannot pipeline; with `tf_config` (the built model),
    the model's kind too. A no-op without pipeline parallelism."""
    pp = engine_config.pipeline_model_parallel_size
    virtual = engine_config.virtual_pipeline_model_parallel_size
    if pp == 1 and virtual in (None, 1):
        return
    kw: dict[str, Any] = {}
    if tf_config is not None:
        kw = dict(
            num_layers=int(tf_config.num_layers),
            hybrid=getattr(tf_config, "experimental_attention_variant", None) is not None,
            moe=moe,
            ep=int(engine_config.expert_model_parallel_size),
        )
    # auto is checked as replay, what it falls back to (both picks pipeline; root pieces make it replay: verl_auto)
    schedule = "replay" if options.schedule == "auto" else options.schedule
    try:
        check_pipeline(
            schedule,
            pp=pp,
            virtual=virtual,
            root_pieces=int(options.schedule_options.get("root_pieces", 1)),
            **kw,
        )
    except SettingError as e:
        raise VerlBranchError(f"branch replay in verl's engine: {e.spelled(VERL)}") from None
