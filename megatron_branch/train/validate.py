"""The training config's rules between fields, run when a TrainConfig is built (each field's type is checked
while building: config_io.py), and how a refusal names the config's keys (`SPELLING`).

Rules of a shared type are checked where they live and only re-spelled here: the run settings (rules/), the
sampler's (SamplingParams, built from the rollout section: `sampling_params`), the optimizer's (update/optimizer.py),
the model's (ModelArch, read from config.json or model.arch: `model_arch`). One UserError line per mistake, before
any work.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from megatron_branch import rules
from megatron_branch.assembly.spec import RunSpec
from megatron_branch.errors import SettingError, UserError
from megatron_branch.losses.config import ObjectiveConfig
from megatron_branch.models.arch import ModelArch
from megatron_branch.parallel.layout import ParallelLayout
from megatron_branch.spelling import config_spelling
from megatron_branch.train.algorithm import AlgorithmConfig, resolve_algorithm

SPELLING = config_spelling(
    {"actor": ObjectiveConfig, "algorithm": AlgorithmConfig, "parallel": ParallelLayout}
)
"""How the config names a setting in a refusal: `parallel.cp`, `schedule.name=naive`, `actor.clip_ratio_c`."""


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise UserError(f"{name} must be positive, got {value}")


def validate(cfg: Any) -> None:
    """Checks that need several fields (each field's type is checked while building). One line per error."""
    a, act, r, d, t = cfg.algorithm, cfg.actor, cfg.rollout, cfg.data, cfg.trainer
    for name, v in [
        ("data.train_batch_size", d.train_batch_size),
        ("data.num_prompts", d.num_prompts),
        ("actor.ppo_epochs", act.ppo_epochs),
        ("actor.ppo_mini_batch_size", act.ppo_mini_batch_size),
        ("actor.ppo_micro_batch_size", act.ppo_micro_batch_size),
        ("trainer.total_training_steps", t.total_training_steps),
        ("optim.lr", cfg.optim.lr),
        ("schedule.branch_micro_batch", cfg.schedule.branch_micro_batch),
        ("schedule.chunk_tokens", cfg.schedule.chunk_tokens),
        ("tokenizer.vocab_size", cfg.tokenizer.vocab_size),
        ("data.max_prompt_length", d.max_prompt_length),
    ]:
        _positive(name, v)
    if t.save_freq == 0 or t.save_freq < -1:
        raise UserError(f"trainer.save_freq must be a positive number of steps or -1, got {t.save_freq}")
    if r.top_k == 0 or r.top_k < -1:  # verl's spelling of "off" (-1); the sampler's is 0
        raise UserError(f"rollout.top_k must be a positive number of tokens or -1 (off), got {r.top_k}")
    try:
        sampling_params(cfg)  # the sampler's own rules (SamplingParams, rules.check_sampling), in config keys
        algo = resolve_algorithm(cfg)
        rules.check(run_spec(cfg))  # the run's settings; the model's rules once it is read (check_model)
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    if algo.estimator is not None and algo.estimator.group_relative and r.n == 1:
        chosen = (
            f"algorithm.adv_estimator={a.adv_estimator}" if a.adv_estimator else f"algorithm.name={a.name}"
        )
        raise UserError(
            f"rollout.n=1 with {chosen}: a group of one has a zero group-relative advantage, "
            "so nothing would be learned; use rollout.n >= 2"
        )
    mini = act.ppo_mini_batch_size or d.train_batch_size
    if mini > d.train_batch_size or d.train_batch_size % mini:
        raise UserError(
            f"actor.ppo_mini_batch_size={mini} must divide data.train_batch_size={d.train_batch_size}"
        )
    if act.ppo_micro_batch_size is not None and mini % act.ppo_micro_batch_size:
        raise UserError(
            f"actor.ppo_micro_batch_size={act.ppo_micro_batch_size} must divide the mini-batch ({mini} prompts)"
        )
    if algo.offline:
        if d.pairs_file is None:
            raise UserError(
                f"algorithm.name={a.name} needs data.pairs_file (JSONL of prompt/chosen/rejected)"
            )
    elif d.task is None and d.train_files is None:
        raise UserError(f"algorithm.name={a.name} needs data.task or data.train_files")
    elif d.task is None and d.reward is None and not r.multi_turn.enable:
        raise UserError("data.train_files needs data.reward (module:function)")
    check_multi_turn(cfg)
    if d.reward is not None and (d.reward.count(":") != 1 or not all(d.reward.split(":"))):
        raise UserError(f"data.reward must look like module:function, got {d.reward!r}")
    if cfg.model.hf_path is None and cfg.model.arch is None:
        raise UserError("model: give model.hf_path (an HF folder) or model.arch (a config-defined model)")
    if cfg.tokenizer.type == "hf" and cfg.tokenizer.path is None and cfg.model.hf_path is None:
        raise UserError("tokenizer.type=hf needs tokenizer.path or model.hf_path")
    check_model(cfg)
    check_optimizer(cfg)
    w = cfg.warmup
    if w.steps < 0 or w.batch_size <= 0 or w.eval_every <= 0 or w.eval_prompts <= 0:
        raise UserError("warmup: steps >= 0, batch_size, eval_every and eval_prompts > 0")
    if w.until_exact is not None and not 0 < w.until_exact <= 1:
        raise UserError(f"warmup.until_exact must be in (0, 1], got {w.until_exact}")
    if cfg.checkpoint.keep_last is not None and cfg.checkpoint.keep_last <= 0:
        raise UserError(f"checkpoint.keep_last must be positive, got {cfg.checkpoint.keep_last}")


def sampling_params(cfg: Any, turn_end_ids: tuple[int, ...] | None = None) -> Any:
    """The sampler's SamplingParams from the rollout section (its rules: generation/types.py, rules/); a
    SettingError in the library's names (train re-spells it: SPELLING). rollout.top_k -1 (off) is its 0.
    `turn_end_ids`: rollout.multi_turn.turn_end as token ids (known once the tokenizer is; a stand-in before)."""
    from megatron_branch.generation.multi_turn import MultiTurnParams
    from megatron_branch.generation.types import SamplingParams

    r = cfg.rollout
    m = r.multi_turn
    multi_turn = None
    if m.enable:
        ends = turn_end_ids if turn_end_ids is not None else (0,)  # the task may name them (train/data.py)
        multi_turn = MultiTurnParams(
            turn_end_token_ids=ends, max_assistant_turns=m.max_assistant_turns, max_user_turns=m.max_user_turns,
            max_tool_response_length=m.max_tool_response_length, branch_at_turns=tuple(m.branch_at_turns),
        )  # fmt: skip
    return SamplingParams(
        n=r.n, max_new_tokens=r.response_length, temperature=r.temperature, top_k=max(r.top_k, 0), top_p=r.top_p,
        branch_at=tuple(r.branch_at), branch_factor=r.branch_factor, share_prefix=r.share_prefix,
        multi_turn=multi_turn,
    )  # fmt: skip


def check_multi_turn(cfg: Any) -> None:
    """rollout.multi_turn: settings that would do nothing are refused; the environment's reward is the reward."""
    m, d = cfg.rollout.multi_turn, cfg.data
    if not m.enable:
        changed = [
            f.name for f in dataclasses.fields(m)
            if f.name != "enable" and getattr(m, f.name) != getattr(type(m)(), f.name)
        ]  # fmt: skip
        if changed:
            raise UserError(f"rollout.multi_turn.{changed[0]} needs rollout.multi_turn.enable=true")
        return
    if d.reward is not None:
        raise UserError(
            "data.reward with rollout.multi_turn.enable=true: the environment's rewards are the reward"
        )
    if cfg.warmup.until_exact is not None:
        raise UserError(
            "warmup.until_exact with rollout.multi_turn.enable=true: its greedy check has no environment"
        )
    if m.environment is None and d.task is None:
        raise UserError("rollout.multi_turn.enable=true needs rollout.multi_turn.environment (module:Class)")
    if m.environment is not None and (m.environment.count(":") != 1 or not all(m.environment.split(":"))):
        raise UserError(f"rollout.multi_turn.environment must look like module:Class, got {m.environment!r}")


def optimizer_settings(cfg: Any, *, lr: float, decay_steps: int | None = None) -> Any:
    """The update's OptimizerSettings from the optim section (its rules: update/optimizer.py)."""
    from megatron_branch.update.optimizer import OptimizerSettings

    o = cfg.optim
    try:
        return OptimizerSettings(
            lr=lr, min_lr=min(o.min_lr, lr), weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
            eps=o.adam_eps, clip_grad=o.clip_grad, warmup_steps=o.lr_warmup_steps, decay_steps=decay_steps,
            decay_style=o.lr_decay_style, use_distributed_optimizer=o.use_distributed_optimizer,
            optimizer_cpu_offload=o.optimizer_cpu_offload, optimizer_offload_fraction=o.optimizer_offload_fraction,
            overlap_cpu_optimizer_d2h_h2d=o.overlap_cpu_optimizer_d2h_h2d,
            use_precision_aware_optimizer=o.use_precision_aware_optimizer, main_grads_dtype=o.main_grads_dtype,
            exp_avg_dtype=o.exp_avg_dtype, exp_avg_sq_dtype=o.exp_avg_sq_dtype,
        )  # fmt: skip
    except ValueError as e:
        raise UserError(f"optim: {e}") from None


def check_optimizer(cfg: Any) -> None:
    """The optim section is one megatron can run for model.dtype on this machine."""
    import torch

    from megatron_branch.update.optimizer import check_supported

    settings = optimizer_settings(cfg, lr=cfg.optim.lr)
    try:
        check_supported(settings, getattr(torch, cfg.model.dtype))
    except ValueError as e:
        raise UserError(f"optim: {e}") from None


def model_arch(cfg: Any, vocab_size: int | None = None) -> ModelArch:
    """The policy's ModelArch: from model.hf_path's config.json, or from model.arch (vocab from the tokenizer)."""
    if cfg.model.hf_path is not None:
        from megatron_branch.checkpoint.hf_io import load_hf_config

        where = str(Path(cfg.model.hf_path) / "config.json")
        if not Path(where).is_file():
            raise UserError("model.hf_path has no config.json", where=where)
        return ModelArch.from_hf_config(load_hf_config(cfg.model.hf_path), where=where)
    a = cfg.model.arch
    assert a is not None
    return a.resolve(vocab_size or 1)


def run_spec(cfg: Any, arch: ModelArch | None = None) -> RunSpec:
    """The run assembly's RunSpec of the config (assembly/spec.py): its sections ARE the spec's parts;
    `schedule.name: auto` is checked and built as replay, what it falls back to (train/auto_schedule.py)."""
    schedule = cfg.schedule
    if schedule.name == rules.AUTO_SCHEDULE:
        schedule = dataclasses.replace(schedule, name="replay")
    return RunSpec(
        hf_path=cfg.model.hf_path, arch=arch, layout=cfg.parallel, schedule=schedule, objective=cfg.actor,
        dtype=cfg.model.dtype, training=True, moe=cfg.moe,
        init_seed=cfg.model.init_seed,
    )  # fmt: skip


def check_model(cfg: Any) -> None:
    """The architecture exists and splits over parallel.tp and parallel.pp, and the run's rules hold for it
    (rules.check_model; reads only config.json)."""
    arch = model_arch(cfg)
    if arch.is_moe and cfg.moe.expert_capacity_factor is not None:
        # train runs no schedule that drops tokens per rollout (the sampler and the update share prefixes)
        raise UserError(
            "moe.expert_capacity_factor: token dropping is not exact under sharing (an expert's capacity depends "
            "on which tokens share its batch); train dropless (null)"
        )
    try:
        rules.check_model(run_spec(cfg, arch))
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    try:
        arch.check_tensor_parallel(cfg.parallel.tp, etp=cfg.parallel.etp)
    except UserError as e:
        raise UserError(f"parallel.tp: {e}") from None
    check_moe(cfg, arch)
    if cfg.data.max_prompt_length is not None:
        check_fits_context(
            cfg,
            max_prompt_tokens=cfg.data.max_prompt_length,
            context=arch.max_position_embeddings,
            where="config",
        )


def check_fits_context(cfg: Any, *, max_prompt_tokens: int, context: int, where: str) -> None:
    """A prompt plus the longest response must fit the model's context (RoPE table)."""
    need = max_prompt_tokens + cfg.rollout.response_length
    if need > context:
        raise UserError(
            f"prompt ({max_prompt_tokens} tokens) + rollout.response_length ({cfg.rollout.response_length}) = "
            f"{need} exceeds the model's context of {context} tokens",
            where=where,
        )


def check_moe(cfg: Any, arch: Any) -> None:
    """The moe section and parallel.ep against a MoE architecture (one line each, in config keys; the run's
    MoE rules: rules.check)."""
    m, p = cfg.moe, cfg.parallel
    if not arch.is_moe:
        return
    try:
        m.options()
        arch.check_expert_parallel(p.ep, tp=p.tp, etp=p.etp)
    except UserError as e:
        raise UserError(f"parallel.ep: {e}") from None
    except ValueError as e:
        raise UserError(f"moe.{e}") from None
