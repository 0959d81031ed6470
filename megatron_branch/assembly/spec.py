"""What one run is, in one value: `RunSpec` (model source, layout, schedule, objective, precision, options).

Every entry point describes its run as a RunSpec, validated by `rules.check(spec)` (the one check sequence) and
realised by `assembly/engine.py` `build_engine(spec)`:
    grad        from its flags (commands/grad_flags.py generates them from these dataclasses' fields)
    train       from its config (train/config.py: the `schedule` and `moe` sections ARE the classes below)
    drop-in     integration/schedule.py: megatron's model and groups, the schedule's options
    verl        integration/verl_step.py: verl's engine's model and groups
    bench       bench/runner.py, bench/precision.py, bench/rehearsal.py, plan/measure.py
Field docstrings are the help of grad's flags and the rows of docs/training.md's config reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_branch.attention.dispatch import BACKENDS
from megatron_branch.losses.config import ObjectiveConfig
from megatron_branch.parallel.layout import ParallelLayout
from megatron_branch.precision import DtypeName
from megatron_branch.rules import AUTO_SCHEDULE, TRAIN_SCHEDULES
from megatron_branch.schedule.options import DEFAULT_CHUNK_TOKENS


@dataclass(kw_only=True)
class ScheduleConfig:
    """How the engine runs a batch of rollouts (all give the same gradient)."""

    name: Literal[(*TRAIN_SCHEDULES, AUTO_SCHEDULE)] = "replay"  # rules.TRAIN_SCHEDULES and auto
    """replay (DFS over the prefix tree), packed (one pass), naive (one rollout at a time, megatron's own
    attention); the baselines without sharing on the engine's kernels: naive-fused (each rollout alone) and
    packed-nosharing (all rollouts block-diagonal in one pass); replay-stopgrad is NOT exact, a comparison only:
    the prompt's K/V as constants (the announced stop-gradient system); auto: packed when its planned activation
    peak fits memory_budget_gb and the batch's tree is at most one chunk of chunk_tokens, replay otherwise,
    decided per batch (plan/auto.py; the pick and why in the metrics)."""
    backend: Literal[BACKENDS] | None = None  # attention/dispatch.py BACKENDS: the executor registry
    """Attention executor (default merge), the same at cp 1 and under CP; one that cannot run the step is
    refused."""
    branch_micro_batch: int = 8
    """replay: sibling leaves per forward with chunk_tokens off, and with chunks for consecutive leaves each larger
    than chunk_tokens (smaller leaves share a chunk by tokens)."""
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS
    """replay (also auto's replay): pack small subtrees (sibling leaves, short turns, small prompt groups) into chunks
    of at most this many tokens, one forward and backward each against their ancestors' cached state (exact); on by
    default; null (grad: --chunk-tokens 0) turns it off: every segment walked, leaves in micro-batches of
    branch_micro_batch (ScheduleOptions.chunk_tokens). auto: a batch's tree over one chunk picks replay."""
    recompute: bool = False
    """replay: recompute inner segments at backward."""
    root_pieces: int = 1
    """replay under pipeline parallelism (parallel.pp > 1): cut each shared root (prompt) into this many sequence
    pieces, which flow through the stages like micro-batches (exact; 1 = whole roots; docs/parallelism.md)."""
    memory_budget_gb: float | None = None
    """auto: GB per rank for a batch's activations that packed's planned peak must fit; None: the device's free
    memory (a CPU: the host's available memory shared by the node's ranks)."""
    enable_gradient_checkpointing: bool = False
    """Per-layer activation checkpointing inside every chunk (ScheduleOptions.recompute_layers): each transformer
    layer keeps only its input and is recomputed in backward, one layer at a time; with `recompute` it is the
    planner's `recompute full`. verl's name (actor_rollout_ref.model.enable_gradient_checkpointing) rather than
    megatron's `recompute_granularity`: the engine has one granularity (every layer, non-reentrant), which a
    boolean states, and megatron's "selective" would mean something else here (planner: segment recompute)."""

    def __post_init__(self) -> None:
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise ValueError(f"memory_budget_gb must be positive, got {self.memory_budget_gb}")


@dataclass(kw_only=True)
class MoEConfig:
    """Router losses and routing replay of a mixture-of-experts policy (ignored keys of a dense one are refused)."""

    aux_loss_coeff: float = 0.0
    """Load-balancing loss over each micro-batch (megatron's aux_loss), weighted by multiplicity."""
    seq_aux_loss_coeff: float = 0.0
    """Load-balancing loss per rollout's sequence (megatron's seq_aux_loss)."""
    global_aux_loss_coeff: float = 0.0
    """Load-balancing loss on the update's running counts, summed over DP (megatron's global_aux_loss)."""
    z_loss_coeff: float = 0.0
    """Router z-loss (megatron's moe_z_loss_coeff)."""
    router_replay: Literal["disabled", "R3"] = "disabled"
    """verl's router_replay.mode. R3: the sampler records every fed token's experts (Rollout.routed_experts) and
    every training and scoring forward routes those tokens to them (probabilities from the current router)."""
    expert_capacity_factor: float | None = None
    """megatron's moe_expert_capacity_factor (token dropping). Refused: which tokens an expert drops depends on
    which tokens share its batch, so no schedule that shares a prefix is exact with it."""

    @property
    def router_settings(self) -> bool:
        """Router losses or routing replay were asked for (any coefficient set, a bad one included: a dense model
        refuses it rather than ignore it)."""
        coeffs = (self.aux_loss_coeff, self.seq_aux_loss_coeff, self.global_aux_loss_coeff, self.z_loss_coeff)
        return any(v != 0 for v in coeffs) or self.router_replay != "disabled"

    @property
    def active(self) -> bool:
        return self.router_settings or self.expert_capacity_factor is not None

    def options(self) -> Any:
        """The schedules' MoEOptions (losses/router.py); a ValueError names a bad coefficient."""
        from megatron_branch.losses.router import MoEOptions, RouterLossConfig

        losses = RouterLossConfig(
            aux_loss_coeff=self.aux_loss_coeff,
            seq_aux_loss_coeff=self.seq_aux_loss_coeff,
            global_aux_loss_coeff=self.global_aux_loss_coeff,
            z_loss_coeff=self.z_loss_coeff,
        )
        return MoEOptions(losses=losses, routing_replay=self.router_replay == "R3")


@dataclass(kw_only=True)
class RunSpec:
    """One run: what every entry point hands `rules.check` and `build_engine`."""

    hf_path: str | None = None
    """Model source: a Hugging Face folder (config.json + safetensors) whose weights load into this rank's stage;
    None = a random init of `arch` (seeded)."""
    arch: Any = None
    """The models.ModelArch (read from hf_path's config.json by the entry point); None while only the settings are
    checked (rules.check skips the model's rules)."""
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    """The rank layout (tp, cp, pp, ep, sequence parallel; parallel/layout.py)."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """The schedule and its options."""
    objective: ObjectiveConfig | None = None
    """The policy objective (losses/config.py); None where the caller brings its own (drop-in, verl, bench)."""
    dtype: DtypeName = "float32"
    """Parameters and compute (precision.py); bfloat16 / float16: megatron's mixed precision (fp32 main gradients;
    softmax, logprobs and dK/dV sums in fp32; grad writes its gradients in fp32)."""
    grad_sync: Literal["ddp", "manual"] = "ddp"
    """Multi-process gradient reduction: megatron-core DDP + finalize_model_grads, or parallel/grads.py's plain
    one."""
    training: bool = False
    """An optimizer steps on the gradients (fp16 is refused then: rules.check_precision)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """A mixture-of-experts policy's router options."""
    init_seed: int = 0
    """Seed of the random init when hf_path is None."""
