"""The training configuration: one YAML file, nested dataclasses, dotted command-line overrides.

    megatron-branch train CONFIG.yaml rollout.n=8 optim.lr=1e-5 actor.kl_loss_coef=0.001

Key names follow verl where verl has one (`rollout.n`, `actor.clip_ratio_low`, `actor.kl_loss_coef`,
`actor.loss_agg_mode`, `actor.ppo_epochs`, `actor.ppo_mini_batch_size`, `data.train_batch_size`,
`trainer.total_training_steps`, `trainer.save_freq`, `trainer.resume_mode`). Every field has a docstring
(docs/training.md is the reference). A mistake (unknown key, wrong type, impossible combination) is one
`UserError` line naming the key, raised before any work is done.

Sections that describe something the engine has one type for ARE that type (derived, not mirrored): `parallel` is
the ParallelLayout (parallel/layout.py), `actor` the ObjectiveConfig (losses/config.py) plus the update split,
`algorithm` the estimators' AdvantageConfig plus the recipe, `model.arch` a ModelArch (models/arch.py), `schedule`
and `moe` the run assembly's ScheduleConfig and MoEConfig (assembly/spec.py, the same fields grad's flags are
generated from). Their rules are checked where they live; refusals name the config key (validate.SPELLING).

This file: the sections and TrainConfig. Reading YAML and overrides: config_io.py (`load_config`); the checks
between fields, run by TrainConfig on construction: validate.py.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_branch.assembly.spec import MoEConfig, ScheduleConfig
from megatron_branch.losses.config import ObjectiveConfig
from megatron_branch.models.arch import ModelArch
from megatron_branch.models.families import families, get_family
from megatron_branch.models.families.registry import TRAIN_DEFAULT_FIELDS
from megatron_branch.parallel.layout import ParallelLayout
from megatron_branch.precision import DtypeName
from megatron_branch.train.algorithm import AlgorithmConfig

# ---------------------------------------------------------------------------------------------------------------


@dataclass(kw_only=True)
class ArchConfig(ModelArch):
    """A config-defined architecture (random init), the demo's tiny policy: a ModelArch (models/arch.py) whose
    every field is a key; the fields below are the ones whose default differs. `resolve` is the validated arch."""

    family: str = "llama"
    """"llama" or another registered family (models/families/: qwen2, qwen3, the hybrid qwen3_5, the mixtures of
    experts qwen3_moe, mixtral, qwen2_moe, glm4_moe, deepseek_v3 (multi-latent attention), the MoE hybrids
    qwen3_5_moe, qwen3_next, the Mamba-2 hybrid nemotron_h); the family's spec gives the defaults of qkv_bias,
    qk_norm, zero_centered_norm, attention_output_gate, moe_score_function and moe_expert_bias. A hybrid needs
    layer_types and the linear_* widths, a Mamba hybrid hybrid_override_pattern and the mamba_* widths, a MoE
    num_experts, moe_top_k and moe_ffn_hidden_size."""
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
    """Bias on the Q/K/V projections; None = the family's (FamilySpec.train_defaults; qwen2, qwen2_moe: true)."""
    qk_norm: bool | None = None  # type: ignore[assignment]
    """RMSNorm on each head's query and key; None = the family's (qwen3, qwen3_moe and the hybrids: true)."""
    zero_centered_norm: bool | None = None  # type: ignore[assignment]
    """RMSNorm weights stored as offsets from one; None = the family's (the hybrids: true)."""
    attention_output_gate: bool | None = None  # type: ignore[assignment]
    """Gated full attention (sigmoid gate from q_proj); None = the family's (the hybrids: true)."""
    moe_score_function: str | None = None  # type: ignore[assignment]
    """The MoE router's score function, softmax or sigmoid; None = the family's (glm4_moe: sigmoid)."""
    moe_expert_bias: bool | None = None  # type: ignore[assignment]
    """The sigmoid router's correction bias (in the expert choice only); None = the family's (glm4_moe: true)."""

    def __post_init__(self) -> None:
        self.resolve(1)  # ModelArch's own checks, before the tokenizer gives the vocabulary

    def resolve(self, vocab_size: int) -> ModelArch:
        """The ModelArch this section describes, its vocabulary `vocab_size` unless the config gives one."""
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(ModelArch)}
        kw["vocab_size"] = self.vocab_size or vocab_size
        # an unknown family: ModelArch's own check names the registered ones
        spec = get_family(self.family) if self.family in families() else None
        for name in TRAIN_DEFAULT_FIELDS:
            if kw[name] is None:
                kw[name] = spec.train_default(name) if spec is not None else TRAIN_DEFAULT_FIELDS[name]
        return ModelArch(**kw)


@dataclass(kw_only=True)
class ModelConfig:
    """The policy (and, by default, the reference and the critic's trunk)."""

    hf_path: str | None = None
    """Hugging Face folder (config.json + safetensors: Llama, Qwen2, Qwen3, Qwen3.5/3.6 hybrids, the mixtures of
    experts Qwen3-MoE, Mixtral, Qwen2-MoE, GLM-4.5 / 4.6 MoE, DeepSeek-V3, Qwen3.5-MoE, Qwen3-Next, the Nemotron-H
    Mamba-2 hybrids) to start from; loaded through the converter."""
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
class MultiTurnConfig:
    """Multi-turn rollouts with an environment (verl's `rollout.multi_turn` names; generation/multi_turn.py): the
    policy's turn ends at a turn-end token, the environment answers with an observation (loss_mask 0)."""

    enable: bool = False
    """Sample multi-turn rollouts; the rollout's reward is the sum of the environment's rewards."""
    environment: str | None = None
    """"module:Class" of the environment, built per rollout as Class(row, tokenizer, **environment_args) (`row`:
    the prompt's dataset row); None = the built-in task's own."""
    environment_args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the environment class."""
    turn_end: list[str] = field(default_factory=list)
    """Strings (one token each) that end a policy turn (a tool-call close); empty = the built-in task's own."""
    max_assistant_turns: int | None = None
    """Most policy turns per rollout; null = only rollout.response_length bounds them."""
    max_user_turns: int | None = None
    """Most observations (tool answers) per rollout; null = no limit."""
    max_tool_response_length: int | None = 256
    """An observation longer than this many tokens is cut to its first ones; null = no cut."""
    branch_at_turns: list[int] = field(default_factory=list)
    """After these numbers of finished policy turns every trajectory forks into rollout.branch_factor
    continuations sharing the earlier turns (tool output included); rollout.n = the leaves."""


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
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with an environment (off by default)."""


@dataclass(kw_only=True)
class ActorConfig(ObjectiveConfig):
    """The policy loss (losses/config.py: verl's keys, clipped surrogate + KL + entropy, DPO's beta) and how the
    batch is split into updates."""

    policy_loss: str | None = None  # type: ignore[assignment]
    """A registered objective (vanilla = grpo, pg, gspo, cispo, sapo, geo_mean, clip_cov, kl_cov, dpo,
    verl:<loss_mode>, or a plugin's); None = the algorithm's (grpo, ppo: vanilla; dpo: dpo). verl's
    actor.policy_loss.loss_mode is an alias."""
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
    """A mixture-of-experts policy's router losses and routing replay (assembly/spec.py MoEConfig)."""

    def __post_init__(self) -> None:
        from megatron_branch.train.validate import validate  # it reads these sections: imported when run

        validate(self)
