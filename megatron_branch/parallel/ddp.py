"""Gradient reduction through megatron-core's own DistributedDataParallel and `finalize_model_grads`.

Shape legend: none; every tensor is a parameter gradient (`main_grad`), reduced elementwise.

megatron's DDP keeps one contiguous `main_grad` buffer per (param dtype, grad dtype) and a post-hook on every
parameter's AccumulateGrad node that adds `param.grad` into `main_grad` and frees `param.grad`. The schedules call
backward several times per step (replay: once per chunk, plus the injected dK/dV backward of every inner segment);
each call fires the hook again, so `main_grad` is the sum over all of them, exactly like `param.grad` without DDP.

`finish_grad_sync` all-reduces the buffer over the dp x cp group (`intra_dp_cp_group`). megatron's default scales
the grads by 1/(dp*cp) first (a MEAN, for a loss averaged per replica). Our objective is already normalised by the
GLOBAL logical token count and CP ranks hold disjoint loss terms, so the reduction must be a SUM: DDP is given a
copy of the model config with `calculate_per_token_loss=True`, which makes megatron use scaling factor 1.0 (and
forbids averaging in the collective), and `finalize_model_grads` is called without `num_tokens`, so it applies no
1/num_tokens scaling either. It also SUMS the grads of sequence-parallel parameters (norm weights) over TP
(`_allreduce_non_tensor_model_parallel_grads`), the same rule `grads.finalize_grads` implements.

Used by `megatron-branch grad` (default `--grad-sync ddp`); `grads.finalize_grads` stays as the plain reference
and the tests check that both give the same gradients.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


def wrap_megatron_ddp(
    model: torch.nn.Module,
    *,
    dtype: torch.dtype,
    pg_collection: Any,
    use_distributed_optimizer: bool = False,
    grad_reduce_in_fp32: bool | None = None,
) -> torch.nn.Module:
    """`model` inside megatron-core's DDP, reducing to a SUM (see the module doc).

    `pg_collection` is the entry point's `ProcessGroupCollection.use_mpu_process_groups()`: DDP needs dp, dp_cp,
    tp, pp, ep and expt_dp from it (without expt_dp it would call `new_group` for this rank alone, a collective
    the other ranks do not join), finalize_model_grads tp, pp, embd, pos_embd, dp_cp.
    `use_distributed_optimizer` lays the buffers out for megatron's DistributedOptimizer (the gradient buffer is
    reduce-scattered over dp x cp, the parameter buffer all-gathered after the step); it must match the
    optimizer's setting (`OptimizerSettings.ddp_options`). `grad_reduce_in_fp32` (None: True unless the parameters
    are float64) keeps the main gradients in fp32: for bf16 / fp16 parameters megatron's mixed precision (Megatron-LM
    forces it for bf16: "bfloat16 requires gradient accumulation and all-reduce to be done in fp32"; False = bf16
    main gradients, the precision-aware option, not exact); for float32 it changes nothing; a float64 run's main
    gradients stay float64 (fp32 would round them).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype != torch.float64 if grad_reduce_in_fp32 is None else grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        average_in_collective=False,
    )
    config = copy.copy(model.config)
    config.calculate_per_token_loss = True  # -> gradient scaling factor 1.0: the all-reduce is a plain SUM
    ddp = DistributedDataParallel(config, ddp_config, model, pg_collection=pg_collection)
    ddp.zero_grad_buffer()
    return ddp


def finalize_megatron_grads(ddp_model: torch.nn.Module, *, pg_collection: Any) -> None:
    """megatron's `finalize_model_grads`: DDP all-reduce (SUM over dp x cp), then SP norm grads summed over TP."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp_model], num_tokens=None, pg_collection=pg_collection)
