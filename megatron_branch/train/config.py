"""The training configuration: one YAML file, nested dataclasses, dotted command-line overrides.

    megatron-branch train CONFIG.yaml rollout.n=8 optim.lr=1e-5 actor.kl_loss_coef=0.001

Key names follow verl where verl has one (`rollout.n`, `actor.clip_ratio_low`, `actor.kl_loss_coef`,
`actor.loss_agg_mode`, `actor.ppo_epochs`, `actor.ppo_mini_batch_size`, `data.train_batch_size`,
`trainer.total_training_steps`, `trainer.save_freq`, `trainer.resume_mode`). Every field has a docstring
(docs/training.md is the reference). A mistake (unknown key, wrong type, impossible combination) is one
`UserError` line naming the key, raised before any work is done.

Sections that describe something the engine has one type for ARE that type (derived, not mirrored): `parallel` is
the ParallelLayout (parallel/layout.py), `actor` the ObjectiveConfig (losses/config.py) plus the update split,
`algorithm` the estimators' AdvantageConfig plus the recipe, `model.arch` a ModelArch (models/arch.py). Their
rules are checked where they live; refusals name the config key (`SPELLING`).
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from megatron_branch.errors import SettingError, Spelling, UserError
from megatron_branch.losses.advantages import AdvantageConfig
from megatron_branch.losses.config import ObjectiveConfig
from megatron_branch.models.arch import ModelArch, check_schedule_supports
from megatron_branch.models.hf_families import HYBRID_FAMILIES
from megatron_branch.parallel.layout import ParallelLayout
from megatron_branch.precision import DtypeName
from megatron_branch.rules import TRAIN_SCHEDULES, check_pipeline, check_precision, check_run, check_sampling
from megatron_branch.train.algorithm import resolve_algorithm
from megatron_branch.train.moe import MoEConfig, check_moe

# ---------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ArchConfig(ModelArch):
    """A config-defined architecture (random init), the demo's tiny policy: a ModelArch (models/arch.py) whose
    every field is a key; the fields below are the ones whose default differs. `resolve` is the validated arch."""

    family: str = "llama"
    """"llama" (no QKV bias), "qwen2" (QKV bias), "qwen3" (q/k norms), "qwen3_5" (a hybrid: set layer_types
    and the linear_* widths; q/k norms, zero-centred norms and the attention output gate by default), or a mixture of
    experts on megatron's MoELayer: "qwen3_moe" (q/k norms), "mixtral", "qwen2_moe" (QKV bias; a shared expert with
    shared_expert_ffn_hidden_size), or a MoE hybrid: "qwen3_5_moe", "qwen3_next" (as qwen3_5, with experts); MoE
    needs num_experts, moe_top_k and moe_ffn_hidden_size."""
    vocab_size: int | None = None  # type: ignore[assignment]
    """None = the tokenizer's vocabulary size."""
    hidden_size: int = 64
    """Model width."""
    num_layers: int = 2
    """Transformer layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int = 2
    """Key/value heads (GQA)."""
    ffn_hidden_size: int = 128
    """SwiGLU inner width."""
    max_position_embeddings: int = 1024
    """The model's context: prompt + response must fit."""
    qkv_bias: bool | None = None  # type: ignore[assignment]
    """Bias on the Q/K/V projections; None = the family's (qwen2, qwen2_moe: true)."""
    qk_norm: bool | None = None  # type: ignore[assignment]
    """RMSNorm on each head's query and key; None = the family's (qwen3, qwen3_moe and the hybrids: true)."""
    zero_centered_norm: bool | None = None  # type: ignore[assignment]
    """RMSNorm weights stored as offsets from one; None = the family's (the hybrids: true)."""
    attention_output_gate: bool | None = None  # type: ignore[assignment]
    """Gated full attention (sigmoid gate from q_proj); None = the family's (the hybrids: true)."""

    def __post_init__(self) -> None:
        self.resolve(1)  # ModelArch's own checks, before the tokenizer gives the vocabulary

    def resolve(self, vocab_size: int) -> ModelArch:
        """The ModelArch this section describes, its vocabulary `vocab_size` unless the config gives one."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelArch)}
        kw["vocab_size"] = self.vocab_size or vocab_size
        if kw["qkv_bias"] is None:
            kw["qkv_bias"] = self.family in ("qwen2", "qwen2_moe")
        if kw["qk_norm"] is None:
            kw["qk_norm"] = self.family in ("qwen3", "qwen3_moe", *HYBRID_FAMILIES)
        for name in ("zero_centered_norm", "attention_output_gate"):
            if kw[name] is None:
                kw[name] = self.family in HYBRID_FAMILIES
        return ModelArch(**kw)


@dataclass(kw_only=True)
class ModelConfig:
    """The policy (and, by default, the reference and the critic's trunk)."""

    hf_path: str | None = None
    """Hugging Face folder (config.json + safetensors: Llama, Qwen2, Qwen3, Qwen3.5/3.6 hybrids, the mixtures of
    experts Qwen3-MoE, Mixtral, Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next) to start from; loaded through the converter."""
    arch: ArchConfig | None = None
    """A config-defined architecture with random weights (used when hf_path is not given)."""
    dtype: DtypeName = "float32"
    """Parameter and compute dtype: float32; float64 (exactness checks); bfloat16: megatron's mixed precision (fp32
    main gradients, main parameters and Adam moments; softmax, logprobs and replay's dK/dV sums in fp32; exact to
    the bf16 bound of docs/design.md, not bitwise); float16 is refused (it needs a loss scale in every backward)."""
    init_seed: int = 0
    """Seed of the random init of a config-defined model."""


@dataclass(kw_only=True)
class TokenizerConfig:
    """How text becomes token ids."""

    type: Literal["sentencepiece", "hf"] = "sentencepiece"
    """"sentencepiece": a small model trained at start-up on the task's text (cached in the run folder);
    "hf": the tokenizer.json of an HF folder, through transformers."""
    path: str | None = None
    """hf: the folder holding the tokenizer (None = model.hf_path). sentencepiece: an existing .model file
    (None = train one at start-up)."""
    vocab_size: int = 128
    """sentencepiece training: vocabulary size (bpe/unigram; char uses the training alphabet)."""
    model_type: Literal["char", "bpe", "unigram"] = "char"
    """sentencepiece training: model type (char = one token per character, the embedded task's choice)."""


@dataclass(kw_only=True)
class DataConfig:
    """Prompts (and what the reward needs), or DPO pairs."""

    task: str | None = None
    """A built-in verifiable task (prompts and reward generated in-process), e.g. "kv_retrieval"."""
    task_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the built-in task (its sizes, e.g. num_pairs for kv_retrieval)."""
    num_prompts: int = 256
    """Built-in task: prompts generated (from data.seed)."""
    train_files: str | None = None
    """JSONL of prompts: {"prompt": text, ...whatever the reward needs}; used when no task is given."""
    reward: str | None = None
    """"module:function" taking (prompt, response_text, row) and returning a float; None = the task's own."""
    pairs_file: str | None = None
    """DPO: JSONL of {"prompt": text, "chosen": text, "rejected": text}."""
    train_batch_size: int = 4
    """Prompts per RL step (each sampled rollout.n times); DPO: pairs per step."""
    shuffle: bool = True
    """Shuffle the prompts each epoch (with data.seed; the position is checkpointed)."""
    seed: int = 1
    """Seed of the prompt order."""
    max_prompt_length: int | None = None
    """Longest prompt in tokens (longer prompts are an error); None = measured on the data at start-up."""


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling G continuations per prompt through the shared-prefix KV cache."""

    n: int = 4
    """G, rollouts per prompt (group size)."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    top_k: int = -1
    """Top-k sampling (-1 = off)."""
    response_length: int = 16
    """Max new tokens per rollout."""
    stop: list[str] = field(default_factory=list)
    """Stop strings (besides the tokenizer's end of sequence)."""
    branch_at: list[int] = field(default_factory=list)
    """Tree sampling: after these numbers of sampled tokens each branch forks again (shared response starts)."""
    branch_factor: int = 2
    """Tree sampling: children per fork (rollout.n must divide by branch_factor ** len(branch_at))."""
    share_prefix: bool = True
    """Prefill each prompt once for its n rollouts; false = every rollout its own prefill, as an engine without
    prefix caching samples (the fair generation baseline; the same tokens for the same seed)."""
    seed: int = 2
    """Seed of the sampler's generator (checkpointed)."""


@dataclass(kw_only=True)
class AlgorithmConfig(AdvantageConfig):
    """Which algorithm trains the policy (a recipe: objective, advantage estimator, data), and the estimators'
    settings (losses/advantages.py). Resolved once: train/algorithm.py."""

    name: Literal["grpo", "ppo", "dpo"] = "grpo"
    """grpo: group-relative advantages; ppo: critic + GAE; dpo: offline preference pairs (no sampling)."""
    adv_estimator: str | None = None
    """A registered advantage estimator (grpo, gae, or a plugin's); None = the algorithm's (grpo: grpo, ppo: gae).
    One that needs values trains a critic."""
    plugins: list[str] = field(default_factory=list)
    """Modules imported before any name is looked up (a dotted module or a .py file): they register their own
    objectives (@register_policy_loss, for actor.policy_loss) and estimators (@register_adv_est)."""


@dataclass(kw_only=True)
class ActorConfig(ObjectiveConfig):
    """The policy loss (losses/config.py: verl's keys, clipped surrogate + KL + entropy, DPO's beta) and how the
    batch is split into updates."""

    policy_loss: str | None = None  # type: ignore[assignment]
    """A registered objective (vanilla = grpo, pg, dpo, or a plugin's); None = the algorithm's (grpo, ppo:
    vanilla; dpo: dpo)."""
    entropy_metric: bool = True
    """Report actor/entropy even when entropy_coeff is 0."""
    ppo_epochs: int = 1
    """Passes over each step's rollouts."""
    ppo_mini_batch_size: int | None = None
    """Prompts per optimizer step (each with its rollout.n rollouts); None = the whole step's batch."""
    ppo_micro_batch_size: int | None = None
    """Prompts per gradient-accumulation micro-batch; None = the whole mini-batch."""


@dataclass(kw_only=True)
class CriticConfig:
    """PPO's value model (a scalar head on the policy's trunk, initialised from the policy's weights)."""

    cliprange_value: float = 0.5
    """Clip of the value update around the old values."""
    lr: float | None = None
    """Critic learning rate (None = optim.lr)."""
    ppo_epochs: int | None = None
    """Passes of the critic over each step's rollouts (None = actor.ppo_epochs)."""


@dataclass(kw_only=True)
class OptimConfig:
    """megatron-core's optimizer (Adam) and learning-rate scheduler."""

    lr: float = 1e-4
    """Peak learning rate."""
    min_lr: float = 0.0
    """Floor of the decay."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.999
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Gradient clipping by global norm (0 = off)."""
    lr_warmup_steps: int = 0
    """Linear warm-up optimizer steps."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up (to min_lr at the last optimizer step)."""
    use_distributed_optimizer: bool = False
    """megatron's distributed optimizer: the fp32 master copy and Adam's moments sharded over DP x CP (exact)."""
    optimizer_cpu_offload: bool = False
    """megatron's CPU-offload optimizer: optimizer_offload_fraction of the (sharded) optimizer state and master
    copy in host memory, stepped there (exact); needs use_distributed_optimizer and use_precision_aware_optimizer."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the fraction of the optimizer state (by elements) kept on the host."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With optimizer_cpu_offload on a GPU: overlap the host step with the host<->device copies."""
    use_precision_aware_optimizer: bool = False
    """megatron's precision-aware optimizer (the dtypes below; exact while they are fp32); needs
    use_distributed_optimizer."""
    main_grads_dtype: Literal["fp32", "bf16"] = "fp32"
    """Gradients reduced and stepped in this dtype (bf16: NOT exact, needs bf16 parameters)."""
    exp_avg_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Adam's first moment (not fp32: NOT exact; TransformerEngine's FusedAdam on a GPU only)."""
    exp_avg_sq_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Adam's second moment (as exp_avg_dtype)."""


@dataclass(kw_only=True)
class ScheduleConfig:
    """How the engine runs a batch of rollouts (all give the same gradient)."""

    name: Literal[TRAIN_SCHEDULES] = "replay"  # rules.TRAIN_SCHEDULES
    """replay (DFS over the prefix tree), packed (one pass), naive (one rollout at a time, megatron's own
    attention); the baselines without sharing on the engine's kernels: naive-fused (each rollout alone) and
    packed-nosharing (all rollouts block-diagonal in one pass); replay-stopgrad is NOT exact, a comparison only:
    the prompt's K/V as constants (the announced stop-gradient system)."""
    backend: Literal["merge", "packed", "reference"] | None = None
    """Attention backend override."""
    branch_micro_batch: int = 8
    """replay: sibling leaves per forward."""
    recompute: bool = False
    """replay: recompute inner segments at backward."""
    root_pieces: int = 1
    """replay under pipeline parallelism (parallel.pp > 1): cut each shared root (prompt) into this many sequence
    pieces, which flow through the stages like micro-batches (exact; 1 = whole roots; docs/parallelism.md)."""
    enable_gradient_checkpointing: bool = False
    """Per-layer activation checkpointing inside every chunk (ScheduleOptions.recompute_layers): each transformer
    layer keeps only its input and is recomputed in backward, one layer at a time; with `recompute` it is the
    planner's `recompute full`. verl's name (actor_rollout_ref.model.enable_gradient_checkpointing) rather than
    megatron's `recompute_granularity`: the engine has one granularity (every layer, non-reentrant), which a
    boolean states, and megatron's "selective" would mean something else here (planner: segment recompute)."""


@dataclass(kw_only=True)
class WarmupConfig:
    """A short supervised warm-up on the task's reference answers before RL (the demo uses it; say so)."""

    steps: int = 0
    """Most supervised optimizer steps before RL (0 = none)."""
    batch_size: int = 16
    """Prompts per warm-up step."""
    lr: float | None = None
    """Warm-up learning rate (None = optim.lr)."""
    until_exact: float | None = None
    """Adaptive warm-up: every eval_every steps decode held-out prompts greedily and stop once this fraction is
    exactly right (None = always run all steps). Stopping at the edge leaves RL room to improve."""
    eval_every: int = 20
    """Adaptive warm-up: steps between evaluations."""
    eval_prompts: int = 64
    """Adaptive warm-up: held-out prompts per evaluation (their own seed)."""


@dataclass(kw_only=True)
class LoggingConfig:
    """What is written besides metrics.jsonl."""

    tensorboard: bool = True
    """TensorBoard event files under OUT/tensorboard."""
    progress_bar: bool = True
    """A tqdm bar with reward and step time (rank 0)."""
    plot: bool = True
    """OUT/curves.png at each save and at the end."""


@dataclass(kw_only=True)
class CheckpointConfig:
    """What a checkpoint holds besides model, optimizer, scheduler, RNG and data position."""

    hf_export: bool = True
    """Export the final policy as an HF folder (OUT/hf) through the converter."""
    keep_last: int | None = None
    """Keep only the newest k checkpoints (None = all)."""


@dataclass(kw_only=True)
class TrainerConfig:
    """The run itself."""

    total_training_steps: int = 20
    """RL steps (one sample -> reward -> update round each)."""
    save_freq: int = -1
    """Checkpoint every k steps (-1 = only at the end)."""
    resume_mode: Literal["disable", "auto"] = "disable"
    """auto: continue from the newest checkpoint in the run folder."""
    default_local_dir: str = "runs/train"
    """Run folder: config.yaml, metrics.jsonl, tensorboard/, curves.png, checkpoints/, hf/."""
    seed: int = 0
    """Seed of torch/python/numpy RNGs (checkpointed)."""
    save_on_signal: bool = False
    """On SIGTERM (what a cluster scheduler sends before it kills a job) finish the current step, save a
    checkpoint and exit 0 (resume with --resume auto); false: SIGTERM ends the run at once."""


@dataclass(kw_only=True)
class TrainConfig:
    """The whole run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Policy model."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompts / pairs and reward."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """grpo / ppo / dpo."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """Policy loss and update split."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO value model."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and scheduler."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    """The rank layout under torchrun (parallel/layout.py; world = tp * cp * dp, dp = the rest by default); every
    CP rank samples the same rollouts redundantly."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Engine schedule."""
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    """Supervised warm-up."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Outputs besides metrics.jsonl."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint contents."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Steps, saving, resuming, run folder."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """A mixture-of-experts policy's router losses and routing replay (train/moe.py)."""

    def __post_init__(self) -> None:
        validate(self)


def _config_spelling() -> Spelling:
    names = {f.name: f"actor.{f.name}" for f in dataclasses.fields(ObjectiveConfig)}
    names.update({f.name: f"algorithm.{f.name}" for f in dataclasses.fields(AlgorithmConfig)})
    names.update({f.name: f"parallel.{f.name}" for f in dataclasses.fields(ParallelLayout)})
    names.update(
        algorithm="algorithm.name",
        schedule="schedule.name",
        recompute="schedule.recompute",
        root_pieces="schedule.root_pieces",
        recompute_layers="schedule.enable_gradient_checkpointing",
        backend="schedule.backend",
        share_prefix="rollout.share_prefix",
        branch_at="rollout.branch_at",
        dtype="model.dtype",
        moe="moe.*",
        capacity_factor="moe.expert_capacity_factor",
    )
    return Spelling(names=names, assign="=")


SPELLING = _config_spelling()
"""How the config names a setting in a refusal: `parallel.cp`, `schedule.name=naive`, `actor.clip_ratio_c`."""


# ---- building from dicts, with one-line errors ----------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    if origin is not None:
        return getattr(origin, "__name__", str(tp))
    return "null" if tp is type(None) else getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str) -> Any:
    """`value` as type `tp` or a UserError naming `key`. ints are accepted where floats are expected."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, key)
            except UserError:
                continue
        raise UserError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            close = difflib.get_close_matches(str(value), [str(a) for a in typing.get_args(tp)], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise UserError(f"{key} must be one of {_type_name(tp)}, got {value!r}{hint}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping of its fields, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if origin is list:
        if not isinstance(value, list):
            raise UserError(f"{key} must be a list, got {value!r}")
        (item,) = typing.get_args(tp)
        return [_convert(v, item, f"{key}[{j}]") for j, v in enumerate(value)]
    if origin is tuple:  # a shared type's field (ModelArch's, say): a YAML list
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, got {value!r}")
        args = typing.get_args(tp)
        items = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(items) != len(value):
            raise UserError(f"{key} must be a list of {len(items)}, got {value!r}")
        return tuple(_convert(v, a, f"{key}[{j}]") for j, (v, a) in enumerate(zip(value, items)))
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise UserError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise UserError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise UserError(f"{key} must be a string, got {value!r}")
        return value
    raise AssertionError(f"unhandled config type {tp} at {key}")


def from_dict(cls: Any, raw: dict[str, Any], *, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict; unknown keys are refused with the closest known name."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.5)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise UserError(f"unknown config key {prefix}{key}{hint}")
        kwargs[key] = _convert(value, hints[key], prefix + key)
    try:
        return cls(**kwargs)
    except (
        SettingError
    ) as e:  # a rule of a shared type (layout, objective, estimators), in the config's names
        raise e.spelled(SPELLING) from None
    except (TypeError, ValueError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"{prefix.rstrip('.') or 'config'}: {e}") from None


def to_dict(cfg: Any) -> dict[str, Any]:
    """The resolved config as plain data (what config.yaml in the run folder holds; tuples as lists, as YAML)."""

    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as YAML: `8` is an int, `1e-5` a float, `null` None)."""
    import yaml

    if "=" not in text:
        raise UserError(f"override {text!r} must look like section.key=value")
    key, _, value = text.partition("=")
    parts = key.strip().split(".")
    if not all(parts):
        raise UserError(f"override {text!r}: empty key part")
    try:
        parsed = yaml.safe_load(value) if value.strip() else ""
    except yaml.YAMLError:
        parsed = value
    # YAML 1.1 reads `1e-5` as a string (it wants `1.0e-5`): accept what a user means.
    if isinstance(parsed, str):
        try:
            parsed = float(parsed) if any(c in parsed for c in ".eE") else parsed
        except ValueError:
            pass
    return parts, parsed


def _set_path(raw: dict[str, Any], parts: list[str], value: Any, text: str) -> None:
    node = raw
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = node[p] = {}
        if not isinstance(child, dict):
            raise UserError(f"override {text!r}: {p} is not a section")
        node = child
    node[parts[-1]] = value


def _fix_yaml_floats(node: Any) -> Any:
    """YAML 1.1 (pyyaml) reads `1e-5` as a string; numbers written that way are meant as floats."""
    if isinstance(node, dict):
        return {k: _fix_yaml_floats(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_fix_yaml_floats(v) for v in node]
    if isinstance(node, str):
        try:
            return float(node) if any(c in node for c in "eE") and node[0] in "0123456789.-+" else node
        except ValueError:
            return node
    return node


def load_config(path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:  # type: ignore[assignment]
    """Read the YAML file (None = all defaults), apply dotted overrides, build and validate the config."""
    import yaml

    raw: dict[str, Any] = {}
    if path is not None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise UserError(f"cannot read config: {e.strerror or e}", where=str(path)) from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            line = f":{mark.line + 1}" if mark is not None else ""
            problem = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise UserError(f"invalid YAML ({problem})", where=f"{path}{line}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise UserError("the config must be a mapping of sections", where=str(path))
        raw = _fix_yaml_floats(loaded or {})
    keys = []
    for text in overrides:
        parts, value = parse_override(text)
        try:
            _check_override(parts, value)
        except UserError as e:
            raise UserError(str(e), where=f"override {text!r}") from None
        _set_path(raw, parts, value, text)
        keys.append((".".join(parts), text))
    try:
        return from_dict(TrainConfig, raw)
    except UserError as e:
        # a rule between fields: blamed on the override that set one of them, else on the file
        blamed = [t for k, t in keys if re.search(rf"(?<![\w.]){re.escape(k)}(?![\w])", str(e))]
        where = f"override {blamed[-1]!r}" if blamed else (f"{path}" if path is not None else "config")
        raise UserError(str(e), where=where) from None


def _check_override(parts: list[str], value: Any) -> None:
    """One override on its own: its key exists and its value has the field's type (so a mistake in it is blamed
    on it, not on the YAML file)."""
    cls: Any = TrainConfig
    for j, name in enumerate(parts):
        key = ".".join(parts[: j + 1])
        names = [f.name for f in dataclasses.fields(cls)]
        if name not in names:
            prefix = ".".join(parts[:j])
            close = difflib.get_close_matches(name, names, n=1, cutoff=0.5)
            hint = f" (did you mean {prefix + '.' if prefix else ''}{close[0]}?)" if close else ""
            raise UserError(f"unknown config key {key}{hint}")
        tp = typing.get_type_hints(cls)[name]
        if j == len(parts) - 1:
            _convert(value, tp, key)
            return
        inner = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if not inner:
            raise UserError(f"{key} is not a section")
        cls = inner[0]


# ---- cross-field checks ---------------------------------------------------------------------------------------


def _positive(name: str, value: int | float | None) -> None:
    if value is not None and value <= 0:
        raise UserError(f"{name} must be positive, got {value}")


def validate(cfg: TrainConfig) -> None:
    """Checks that need several fields (each field's type is checked while building). One line per error."""
    a, act, r, d, t = cfg.algorithm, cfg.actor, cfg.rollout, cfg.data, cfg.trainer
    for name, v in [
        ("rollout.n", r.n),
        ("rollout.response_length", r.response_length),
        ("data.train_batch_size", d.train_batch_size),
        ("data.num_prompts", d.num_prompts),
        ("actor.ppo_epochs", act.ppo_epochs),
        ("actor.ppo_mini_batch_size", act.ppo_mini_batch_size),
        ("actor.ppo_micro_batch_size", act.ppo_micro_batch_size),
        ("trainer.total_training_steps", t.total_training_steps),
        ("optim.lr", cfg.optim.lr),
        ("schedule.branch_micro_batch", cfg.schedule.branch_micro_batch),
        ("tokenizer.vocab_size", cfg.tokenizer.vocab_size),
        ("data.max_prompt_length", d.max_prompt_length),
    ]:
        _positive(name, v)
    if t.save_freq == 0 or t.save_freq < -1:
        raise UserError(f"trainer.save_freq must be a positive number of steps or -1, got {t.save_freq}")
    if r.temperature < 0 or not 0 < r.top_p <= 1 or (r.top_k == 0 or r.top_k < -1):
        raise UserError(
            f"rollout: temperature >= 0, 0 < top_p <= 1, top_k > 0 or -1; got {r.temperature}, {r.top_p}, {r.top_k}"
        )
    if sorted(set(r.branch_at)) != r.branch_at or any(k <= 0 or k >= r.response_length for k in r.branch_at):
        raise UserError(
            f"rollout.branch_at must be increasing token counts in (0, response_length={r.response_length}), "
            f"got {r.branch_at}"
        )
    if r.branch_at and (r.branch_factor < 1 or r.n % (r.branch_factor ** len(r.branch_at))):
        raise UserError(
            f"rollout.n={r.n} must be divisible by rollout.branch_factor ** len(rollout.branch_at) = "
            f"{r.branch_factor ** len(r.branch_at)}"
        )
    sc = cfg.schedule
    try:
        cfg.parallel.check_no_op()
        check_sampling(share_prefix=r.share_prefix, branch_at=r.branch_at)
        check_precision(cfg.model.dtype, training=True)
        check_run(sc.name, cp=cfg.parallel.cp, recompute=sc.recompute,
                  recompute_layers=sc.enable_gradient_checkpointing, backend=sc.backend)  # fmt: skip
        algo = resolve_algorithm(cfg)
        check_pipeline(sc.name, pp=cfg.parallel.pp, critic=algo.trains_critic, root_pieces=sc.root_pieces)
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
    elif d.task is None and d.reward is None:
        raise UserError("data.train_files needs data.reward (module:function)")
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


def optimizer_settings(cfg: TrainConfig, *, lr: float, decay_steps: int | None = None) -> Any:
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


def check_optimizer(cfg: TrainConfig) -> None:
    """The optim section is one megatron can run for model.dtype on this machine."""
    import torch

    from megatron_branch.update.optimizer import check_supported

    settings = optimizer_settings(cfg, lr=cfg.optim.lr)
    try:
        check_supported(settings, getattr(torch, cfg.model.dtype))
    except ValueError as e:
        raise UserError(f"optim: {e}") from None


def model_arch(cfg: TrainConfig, vocab_size: int | None = None) -> ModelArch:
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


def check_model(cfg: TrainConfig) -> None:
    """The architecture exists and splits over parallel.tp and parallel.pp (reads only config.json)."""
    arch = model_arch(cfg)
    try:
        check_pipeline(
            cfg.schedule.name, pp=cfg.parallel.pp, num_layers=arch.num_layers, hybrid=arch.is_hybrid,
            moe=arch.is_moe,
        )  # fmt: skip
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    try:
        arch.check_tensor_parallel(cfg.parallel.tp)
    except UserError as e:
        raise UserError(f"parallel.tp: {e}") from None
    try:
        check_schedule_supports(arch, cfg.schedule.name, cp=cfg.parallel.cp, tp=cfg.parallel.tp)
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    check_moe(cfg, arch)
    if cfg.data.max_prompt_length is not None:
        check_fits_context(
            cfg,
            max_prompt_tokens=cfg.data.max_prompt_length,
            context=arch.max_position_embeddings,
            where="config",
        )


def check_fits_context(cfg: TrainConfig, *, max_prompt_tokens: int, context: int, where: str) -> None:
    """A prompt plus the longest response must fit the model's context (RoPE table)."""
    need = max_prompt_tokens + cfg.rollout.response_length
    if need > context:
        raise UserError(
            f"prompt ({max_prompt_tokens} tokens) + rollout.response_length ({cfg.rollout.response_length}) = "
            f"{need} exceeds the model's context of {context} tokens",
            where=where,
        )


def write_resolved(cfg: TrainConfig, path: Path) -> None:
    import yaml

    path.write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
