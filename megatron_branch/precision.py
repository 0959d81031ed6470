"""Precision: the dtypes the engine trains in, and what it keeps in float32 when the parameters are bf16 / fp16.

Mixed precision is megatron's (Micikevicius et al. 2018, as megatron-core implements it): parameters, activations
and every GEMM in bf16 (fp16: plus megatron's dynamic loss scale), each backward's parameter gradient added into
megatron DDP's fp32 gradient buffer (`DistributedDataParallelConfig.grad_reduce_in_fp32`), and megatron's
`Float16OptimizerWithFloat16Params` (or its `DistributedOptimizer`, with or without the CPU offload) stepping fp32
main parameters with fp32 Adam moments and copying them back into the bf16 parameters (update/optimizer.py).

What the engine itself keeps in float32 (float64 in a float64 run: `accumulation_dtype`), where it is computed:
    softmax statistics   every attention kernel's log-sum-exp, the LSE merge, and one call's out / dq / dk / dv
                         accumulators (attention/kernels.py, merge.py, executor.py); the CPU flash kernel returns
                         its lse in fp32 for bf16 inputs
    logprobs, entropy    the logits come out of the output projection in the model dtype (megatron's output
                         layer); the softmax and the returned logprob / entropy are fp32 (megatron's cross-entropy
                         upcasts the same way), so the objective's math is fp32 (losses/fused_logprobs.py,
                         logprobs.py)
    dK/dV accumulators   replay's cached leaves receive one gradient per child chunk; for a bf16 leaf they are
                         summed in an fp32 accumulator, not in the leaf's bf16 `.grad` (schedule/prefix_cache.py):
                         the analogue of the fp32 main gradient, for the prefix state
    main gradients, main parameters, Adam's moments   megatron's (above)
What stays in the model dtype: weights, activations, the cached prefix K/V (they ARE the tensors naive's attention
reads: bf16 outputs of the same projection and RoPE), each backward's own parameter gradient.

docs/design.md ("bf16: what exact means") states the bound this gives and how it is measured.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float64", "bfloat16", "float16")
"""The parameter / compute dtypes `train` (model.dtype) and `grad` (--dtype) run in."""
DtypeName = Literal["float32", "float64", "bfloat16", "float16"]
HALF_NAMES = ("bfloat16", "float16")
"""Mixed precision: fp32 main gradients and main parameters beside these parameters."""
SHORT_NAMES = {"fp32": "float32", "fp64": "float64", "bf16": "bfloat16", "fp16": "float16"}
"""megatron-LM's (and verl's) short names of the same dtypes: the optimizer's --main-grads-dtype, the planner."""
BYTES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}
"""Bytes per element (the planner's memory terms)."""


def long_name(name: str) -> str:
    """A DTYPE_NAMES entry for a long or short name (`bf16` -> `bfloat16`)."""
    return SHORT_NAMES.get(name, name)


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a DTYPE_NAMES entry or its short name: the one dtype table every part reads."""
    import torch

    assert long_name(name) in DTYPE_NAMES, name
    return getattr(torch, long_name(name))


def dtype_table(names: tuple[str, ...] = DTYPE_NAMES) -> dict[str, torch.dtype]:
    """{name: torch dtype} for the names a part accepts (its choices), read off the one table."""
    return {n: torch_dtype(n) for n in names}


def is_half(dtype: torch.dtype) -> bool:
    """bf16 or fp16 parameters: megatron's mixed precision applies."""
    import torch

    return dtype in (torch.bfloat16, torch.float16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where sums and statistics of `dtype` tensors are kept: float64 for float64, else float32."""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32
