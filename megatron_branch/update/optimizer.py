"""megatron-core's optimizer and learning-rate scheduler over a megatron DDP model, on GPU and (shimmed) on CPU.

`build_optimizer` is `get_megatron_optimizer(OptimizerConfig(...), [ddp_model])` (Adam(W), weight decay, gradient
clipping by the global norm: megatron reduces the squared norm over the model-parallel group and skips TP
duplicates) plus `OptimizerParamScheduler` (warm-up, then constant / linear / cosine decay to `min_lr`). On a
machine without CUDA the optimizer's CUDA assumptions are shimmed first (compat/optimizer.py); nothing else differs.

Three of megatron's options change where the optimizer state lives (megatron's names, all off by default):
  * `use_distributed_optimizer`: megatron's DistributedOptimizer shards the fp32 master copy and Adam's moments
    over the data-parallel x context-parallel group (the DDP model must be wrapped with the same setting: its
    gradient buffer is reduce-scattered, the parameter buffer all-gathered after the step). Exact: the same update.
    On CPU (gloo) compat/distrib_optimizer.py lets it hold float32 and float64 parameters.
  * `optimizer_cpu_offload` + `optimizer_offload_fraction`: megatron's HybridDeviceOptimizer keeps that fraction
    of the (sharded) optimizer state and its fp32 master copy in host memory and steps it there (gradients copied
    to the host, updated parameters back). megatron requires the distributed optimizer and
    `use_precision_aware_optimizer` with it (the hybrid optimizer reuses that flag's code path). Exact with the
    precision-aware dtypes left at fp32. On CPU compat/offload.py lets the CPU play the device and the host.
  * `use_precision_aware_optimizer` with `main_grads_dtype` / `exp_avg_dtype` / `exp_avg_sq_dtype` = bf16:
    lower-precision gradients and Adam moments. NOT exact (docs/training.md states the measured cost). megatron
    implements bf16 moments in TransformerEngine's FusedAdam only (its hybrid optimizer keeps them in fp32), and
    bf16 main gradients are DDP's gradient buffer in the parameters' dtype, so they need bf16 parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.compat.optimizer import apply_optimizer_shims
from megatron_branch.precision import dtype_table

PRECISION_DTYPES = dtype_table(("fp32", "bf16", "fp16"))
"""megatron-LM's names for the precision-aware optimizer's dtypes (--main-grads-dtype, --exp-avg-dtype, ...)."""


@dataclass(kw_only=True)
class OptimizerSettings:
    """The update's optimizer and learning-rate schedule (verl's actor.optim names where it has them, megatron's
    for where the optimizer state lives)."""

    lr: float = 1e-6
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled (AdamW) weight decay; megatron exempts biases and norm weights."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's beta1, beta2."""
    eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Clip gradients to this global L2 norm (0 = off)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many updates."""
    decay_steps: int | None = None
    """Updates over which the learning rate decays after warm-up (None = warmup_steps + 1: then constant)."""
    decay_style: str = "constant"
    """constant | linear | cosine (megatron's OptimizerParamScheduler styles)."""
    use_distributed_optimizer: bool = False
    """Shard the optimizer state over DP x CP (megatron's DistributedOptimizer); wrap DDP with the same setting."""
    optimizer_cpu_offload: bool = False
    """Keep (a fraction of) the optimizer state in host memory and step it there (megatron's
    HybridDeviceOptimizer); needs use_distributed_optimizer and use_precision_aware_optimizer."""
    optimizer_offload_fraction: float = 1.0
    """With optimizer_cpu_offload: the fraction of the optimizer state (by elements) kept on the host."""
    overlap_cpu_optimizer_d2h_h2d: bool = False
    """With optimizer_cpu_offload on a GPU: overlap the host step with the copies (megatron's CUDA streams)."""
    use_precision_aware_optimizer: bool = False
    """megatron's precision-aware optimizer (the dtypes below); needs use_distributed_optimizer."""
    main_grads_dtype: str = "fp32"
    """fp32 | bf16: the gradients reduced and stepped (bf16 needs bf16 parameters; not exact)."""
    exp_avg_dtype: str = "fp32"
    """fp32 | bf16 | fp16: Adam's first moment (not fp32: TransformerEngine's FusedAdam only; not exact)."""
    exp_avg_sq_dtype: str = "fp32"
    """fp32 | bf16 | fp16: Adam's second moment (as exp_avg_dtype)."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown decay style {self.decay_style!r}: constant, linear or cosine")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")
        for name in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype"):
            if getattr(self, name) not in PRECISION_DTYPES:
                raise ValueError(
                    f"{name} must be one of {', '.join(PRECISION_DTYPES)}, got {getattr(self, name)!r}"
                )
        if self.main_grads_dtype == "fp16":
            raise ValueError(
                "main_grads_dtype must be fp32 or bf16 (megatron reduces gradients in one of them)"
            )
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"optimizer_offload_fraction must be in [0, 1], got {self.optimizer_offload_fraction}"
            )
        # megatron's own rules (megatron-core OptimizerConfig, Megatron-LM's argument checks), checked here first
        if self.optimizer_cpu_offload and not (
            self.use_distributed_optimizer and self.use_precision_aware_optimizer
        ):
            raise ValueError(
                "optimizer_cpu_offload needs use_distributed_optimizer and use_precision_aware_optimizer "
                "(megatron's hybrid device optimizer reuses the precision-aware code path)"
            )
        if self.use_precision_aware_optimizer and not self.use_distributed_optimizer:
            raise ValueError(
                "use_precision_aware_optimizer needs use_distributed_optimizer (megatron's rule)"
            )
        lowered = [
            n for n in ("main_grads_dtype", "exp_avg_dtype", "exp_avg_sq_dtype") if getattr(self, n) != "fp32"
        ]
        if lowered and not self.use_precision_aware_optimizer:
            raise ValueError(f"{lowered[0]}={getattr(self, lowered[0])} needs use_precision_aware_optimizer")
        moments = [n for n in ("exp_avg_dtype", "exp_avg_sq_dtype") if getattr(self, n) != "fp32"]
        if moments and self.optimizer_cpu_offload:
            raise ValueError(
                f"{moments[0]}={getattr(self, moments[0])} with optimizer_cpu_offload: megatron's hybrid device "
                "optimizer keeps Adam's moments in fp32 (only TransformerEngine's FusedAdam lowers them)"
            )

    @property
    def exact(self) -> bool:
        """Whether the update is the plain optimizer's (no lowered dtype)."""
        return (self.main_grads_dtype, self.exp_avg_dtype, self.exp_avg_sq_dtype) == ("fp32",) * 3

    def ddp_options(self, dtype: torch.dtype) -> dict[str, Any]:
        """What parallel/ddp.wrap_megatron_ddp needs to match these settings."""
        return {
            "use_distributed_optimizer": self.use_distributed_optimizer,
            "grad_reduce_in_fp32": dtype == torch.float32 or (dtype in (torch.bfloat16, torch.float16)
                                                              and self.main_grads_dtype == "fp32"),
        }  # fmt: skip


def check_supported(settings: OptimizerSettings, dtype: torch.dtype) -> None:
    """Refuse (ValueError) what megatron cannot run here for these parameters, before anything is built."""
    if settings.main_grads_dtype == "bf16" and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(
            f"main_grads_dtype=bf16 needs bf16 parameters (megatron keeps the gradients in the parameters' dtype "
            f"unless it reduces them in fp32); the parameters are {str(dtype).removeprefix('torch.')}"
        )
    if settings.use_precision_aware_optimizer and not settings.optimizer_cpu_offload:
        from megatron.core.utils import get_te_version

        if not torch.cuda.is_available() or get_te_version() is None:
            raise ValueError(
                "use_precision_aware_optimizer without optimizer_cpu_offload needs TransformerEngine's FusedAdam "
                "on a GPU (megatron's only implementation of it; lowered Adam moments live there)"
            )
    if settings.use_distributed_optimizer and dtype == torch.float64 and torch.cuda.is_available():
        raise ValueError(
            "megatron's distributed optimizer refuses float64 parameters on a GPU (it accepts CUDA float32, "
            "bfloat16 and float16 only); float64 runs use it on CPU, where megatron-branch routes float64 through "
            "megatron's fp32 path"
        )


def build_optimizer(
    ddp_model: torch.nn.Module, settings: OptimizerSettings, *, dtype: torch.dtype
) -> tuple[Any, Any]:
    """(megatron optimizer, OptimizerParamScheduler) for a model wrapped in megatron DDP (parallel/ddp.py) with
    `settings.ddp_options(dtype)`."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from megatron_branch.compat.offload import apply_offload_fixes
    from megatron_branch.models.expert_tp import count_whole_experts_in_grad_norm

    check_supported(settings, dtype)
    ddp_cfg = getattr(ddp_model, "ddp_config", None)
    if ddp_cfg is not None and ddp_cfg.use_distributed_optimizer != settings.use_distributed_optimizer:
        raise ValueError(
            f"the DDP model was wrapped with use_distributed_optimizer={ddp_cfg.use_distributed_optimizer}, the "
            f"optimizer asks for {settings.use_distributed_optimizer}: wrap with settings.ddp_options(dtype)"
        )
    apply_optimizer_shims()
    if settings.optimizer_cpu_offload:
        apply_offload_fixes()  # a megatron-core 0.16.1 bug, on every device (compat/offload.py)
    on_gpu = torch.cuda.is_available()
    config = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.min_lr,
        weight_decay=settings.weight_decay,
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        clip_grad=settings.clip_grad,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        use_distributed_optimizer=settings.use_distributed_optimizer,
        optimizer_cpu_offload=settings.optimizer_cpu_offload,
        optimizer_offload_fraction=settings.optimizer_offload_fraction,
        overlap_cpu_optimizer_d2h_h2d=settings.overlap_cpu_optimizer_d2h_h2d and on_gpu,
        pin_cpu_grads=on_gpu,
        pin_cpu_params=on_gpu,
        use_precision_aware_optimizer=settings.use_precision_aware_optimizer,
        main_grads_dtype=PRECISION_DTYPES[settings.main_grads_dtype],
        exp_avg_dtype=PRECISION_DTYPES[settings.exp_avg_dtype],
        exp_avg_sq_dtype=PRECISION_DTYPES[settings.exp_avg_sq_dtype],
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
    count_whole_experts_in_grad_norm(
        optimizer, ddp_model
    )  # expert TP 1: megatron's grad norm (models/expert_tp.py)
    decay = settings.decay_steps if settings.decay_steps is not None else settings.warmup_steps + 1
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if settings.warmup_steps else settings.lr,
        max_lr=settings.lr,
        min_lr=settings.min_lr,
        lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=max(decay, settings.warmup_steps + 1),
        lr_decay_style=settings.decay_style,
        start_wd=settings.weight_decay,
        end_wd=settings.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return optimizer, scheduler


def checkpoint_metadata() -> dict[str, Any]:
    """How megatron's distributed optimizer lays its state out in a dist checkpoint: `fully_reshardable` (each
    parameter's master copy and moments as whole tensors, so the checkpoint loads into any TP / CP / DP layout;
    0.16.1's default `fully_sharded_model_space` is refused by its own ShardedTensor). Without CUDA the shards are
    gathered over gloo (`..._mem_efficient`: megatron's gloo path; its NCCL path moves them `.cuda()`)."""
    return {
        "distrib_optim_sharding_type": "fully_reshardable",
        "distrib_optim_fully_reshardable_mem_efficient": not torch.cuda.is_available(),
    }


def optimizer_sharded_state(optimizer: Any, model_sharded_state: dict[str, Any], *, loading: bool) -> Any:
    """The optimizer's part of a dist checkpoint (megatron's sharded state dict, any optimizer).

    Loading into a distributed optimizer that has not stepped yet: with torch's Adam (no TE / apex) megatron's
    `DistributedOptimizer.state_dict` asserts that every parameter's state holds one common `step`, which a
    fresh optimizer lacks, so its state first gets megatron's own dummy values
    (`_init_optimizer_states_with_dummy_values`, for the hybrid optimizer `dummy_step`: one step on zero / random
    gradients; the load then overwrites master copy, moments, step and the model's weights)."""
    if loading:
        from megatron.core.optimizer import distrib_optimizer as dopt

        for inner in inner_optimizers(optimizer):
            if (
                isinstance(inner, dopt.DistributedOptimizer)
                and not inner.is_stub_optimizer
                and not dopt.HAVE_APEX_OR_TE
                and len(inner.optimizer.state) == 0
            ):
                if isinstance(inner.optimizer, dopt.HybridDeviceOptimizer):
                    inner.optimizer.dummy_step()  # megatron's own, as its load_state_dict does later
                else:
                    inner._init_optimizer_states_with_dummy_values()
    sd = optimizer.sharded_state_dict(model_sharded_state, is_loading=loading, metadata=checkpoint_metadata())
    for groups in _saved_param_groups(optimizer, sd):
        for g in groups:  # the hybrid optimizer's classes (cpu/gpu_optimizer_cls): code, not data
            for k in [k for k, v in g.items() if isinstance(v, type)]:
                del g[k]
    return sd


def load_optimizer_state(optimizer: Any, state: Any) -> None:
    """`optimizer.load_state_dict(state)` for what `optimizer_sharded_state` saved: the hybrid optimizer's class
    entries it left out (a checkpoint holds data only: checkpoint/integrity.py loads no pickled code) come back
    from the running optimizer first."""
    for inner, groups in zip(inner_optimizers(optimizer), _saved_param_groups(optimizer, state)):
        defaults = getattr(getattr(inner, "optimizer", None), "defaults", {})
        for g in groups:
            for k, v in defaults.items():
                if isinstance(v, type):
                    g.setdefault(k, v)
    optimizer.load_state_dict(state)


def _saved_param_groups(optimizer: Any, sd: Any) -> list[list[dict[str, Any]]]:
    """The param-group lists inside a (chained) optimizer state dict, one per inner optimizer."""
    inner = inner_optimizers(optimizer)
    parts = [sd] if len(inner) == 1 else [sd[i] for i in range(len(inner))]
    out = []
    for part in parts:
        opt = part.get("optimizer") if isinstance(part, dict) else None
        out.append(opt.get("param_groups", []) if isinstance(opt, dict) else [])
    return out


def inner_optimizers(optimizer: Any) -> list[Any]:
    """megatron's optimizers inside a (chained) optimizer: FP32Optimizer / DistributedOptimizer, one per group."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def current_lr(optimizer: Any) -> float:
    """The learning rate the next step uses (megatron's canonical group)."""
    return float(optimizer.param_groups[0]["lr"])
