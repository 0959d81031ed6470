"""megatron-core's optimizer and learning-rate scheduler over a megatron DDP model, on GPU and (shimmed) on CPU.

`build_optimizer` is `get_megatron_optimizer(OptimizerConfig(...), [ddp_model])` (Adam(W), weight decay, gradient
clipping by the global norm: megatron reduces the squared norm over the model-parallel group and skips TP
duplicates) plus `OptimizerParamScheduler` (warm-up, then constant / linear / cosine decay to `min_lr`). On a
machine without CUDA the optimizer's CUDA assumptions are shimmed first (compat/optimizer.py); nothing else differs.

The distributed optimizer (optimizer state sharded over DP) is megatron's own when `use_distributed_optimizer`:
it needs CUDA parameters of float32 / bfloat16 / float16 (megatron asserts CUDA tensor types while building its
buffers), so it is refused on CPU (gloo) and for float64, where the plain optimizer runs instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.compat.optimizer import apply_optimizer_shims


@dataclass(kw_only=True)
class OptimizerSettings:
    """The update's optimizer and learning-rate schedule (verl's actor.optim names where it has them)."""

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
    """Shard the optimizer state over DP (megatron's DistributedOptimizer; CUDA only, wrap DDP to match)."""

    def __post_init__(self) -> None:
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown decay style {self.decay_style!r}: constant, linear or cosine")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")


def build_optimizer(
    ddp_model: torch.nn.Module, settings: OptimizerSettings, *, dtype: torch.dtype
) -> tuple[Any, Any]:
    """(megatron optimizer, OptimizerParamScheduler) for a model wrapped in megatron DDP (parallel/ddp.py)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if settings.use_distributed_optimizer and (not torch.cuda.is_available() or dtype == torch.float64):
        raise ValueError(
            "megatron's distributed optimizer needs CUDA parameters in float32/bfloat16/float16; "
            "use the plain optimizer on CPU (gloo) or in float64"
        )
    apply_optimizer_shims()
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
    )
    optimizer = get_megatron_optimizer(config, [ddp_model])
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


def current_lr(optimizer: Any) -> float:
    """The learning rate the next step uses (megatron's canonical group)."""
    return float(optimizer.param_groups[0]["lr"])
