"""What a training run actually built: OUT/engine.json, read off the live objects (not the config).

The config says what was asked for; this says what megatron and the engine were given and made of it: the
parameters' dtype, megatron's optimizer classes (Float16OptimizerWithFloat16Params, DistributedOptimizer, the
HybridDeviceOptimizer of the CPU offload) and the dtype of what they step (the fp32 main parameters), DDP's main
gradient dtype and options, how much of the optimizer state sits in host copies, the layout and the schedule's
options, and whether the layers checkpoint themselves. A launcher's test (tests/unit/test_launchers.py) reads it to
check that the planner's options reached the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

ENGINE_FILE = "engine.json"
"""The record's name in the run folder."""


OPTIMIZER_CONFIG_KEYS = (
    "bf16",
    "fp16",
    "params_dtype",
    "use_distributed_optimizer",
    "optimizer_cpu_offload",
    "optimizer_offload_fraction",
    "use_precision_aware_optimizer",
    "main_grads_dtype",
    "clip_grad",
)
"""megatron OptimizerConfig fields the record copies (from the optimizer megatron built, not from our settings)."""


def _plain(v: Any) -> Any:
    return _name(v) if isinstance(v, torch.dtype) else v


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _stepped(inner: Any) -> tuple[list[torch.Tensor], dict[str, int]]:
    """(tensors the torch optimizers inside megatron's optimizer step, offload element counts)."""
    opt = getattr(inner, "optimizer", None)
    if opt is None:  # a stub (this rank holds no shard)
        return [], {}
    subs = getattr(opt, "sub_optimizers", None)
    if subs is None:
        return [p for g in opt.param_groups for p in g["params"]], {}
    stepped = [p for o in subs for g in o.param_groups for p in g["params"]]
    host = sum(p.numel() for p in opt.gpu_params_map_cpu_copy)
    total = sum(p.numel() for g in opt.param_groups for p in g["params"])
    return stepped, {"host_elements": host, "elements": total}


def engine_record(trainee: Any, plan: Any) -> dict[str, Any]:
    """The record of one Trainee (train/policy.py) stepping with `plan` (update.UpdatePlan)."""
    from megatron_branch.models.layer_checkpoint import uses_layer_checkpointing
    from megatron_branch.update.optimizer import inner_optimizers

    params = [p for p in trainee.model.parameters() if p.requires_grad]
    inner = inner_optimizers(trainee.optimizer)
    stepped, offload = [], {"host_elements": 0, "elements": 0}
    for o in inner:
        s, counts = _stepped(o)
        stepped += s
        for k, v in counts.items():
            offload[k] += v
    ddp = trainee.ddp.ddp_config
    opts, groups = plan.opts, plan.opts.groups
    return {
        "param_dtypes": sorted({_name(p.dtype) for p in params}),
        "main_grad_dtypes": sorted({_name(p.main_grad.dtype) for p in params if p.main_grad is not None}),
        "ddp": {
            "grad_reduce_in_fp32": ddp.grad_reduce_in_fp32,
            "use_distributed_optimizer": ddp.use_distributed_optimizer,
        },
        "optimizer": [type(o).__name__ for o in inner],
        "inner_optimizer": sorted({type(getattr(o, "optimizer", None)).__name__ for o in inner}),
        "optimizer_config": {k: _plain(getattr(inner[0].config, k)) for k in OPTIMIZER_CONFIG_KEYS},
        "main_param_dtypes": sorted({_name(p.dtype) for p in stepped}),
        "offload": offload,
        "layout": {
            "tp": groups.tp_size,
            "cp": groups.cp_size,
            "dp": groups.dp_size,
            "pp": groups.pp_size,
            "sequence_parallel": groups.sequence_parallel,
        },
        "schedule": {
            "name": plan.schedule,
            "recompute": opts.recompute,
            "recompute_layers": opts.recompute_layers,
            "branch_micro_batch": opts.branch_micro_batch,
            "root_pieces": opts.root_pieces,
        },
        "layers_checkpoint_themselves": uses_layer_checkpointing(trainee.model),
    }


def write_engine_record(out: Path, record: dict[str, Any]) -> Path:
    """OUT/engine.json, replaced whole (a resume rewrites it: a crash keeps the previous one)."""
    from megatron_branch.outputs import write_text

    text = json.dumps(record, indent=1, sort_keys=True) + "\n"
    return write_text(out / ENGINE_FILE, text, overwrite=True, what="engine record")
