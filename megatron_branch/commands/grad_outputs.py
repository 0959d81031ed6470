"""What `megatron-branch grad` writes: the gradients under HF names (GRADS), the logprobs (--logprobs-out), and the
JSON summary line on stdout. Rank 0 writes, atomically (never a half-written output); a failure there reaches every
rank (parallel/agree.py)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch import outputs
from megatron_branch.parallel.agree import write_on_rank0
from megatron_branch.precision import accumulation_dtype


def write_results(
    args: argparse.Namespace,
    spec: Any,
    model: torch.nn.Module,
    groups: Any,
    acc: Any,
    metrics: dict[str, Any],
    objective: Any,
    full_tree: Any,
    dtype: torch.dtype,
    *,
    auto: dict[str, Any] | None = None,
) -> None:
    """Gather the gradients (and logprobs) of every rank, write them on rank 0, print the summary there (`auto`:
    what --schedule auto picked and why)."""
    from megatron_branch.checkpoint.param_map import mcore_to_hf_state
    from megatron_branch.checkpoint.stages import gather_model_grads

    grads = mcore_to_hf_state(gather_model_grads(model, groups), spec.arch)
    lp_rows: list[tuple[int, list[float]]] = sorted(acc.logprobs.items())
    if args.logprobs_out is not None and groups.dp_size > 1:
        gathered: list[Any] = [None] * groups.dp_size
        dist.all_gather_object(gathered, lp_rows, group=groups.dp)
        lp_rows = [row for part in gathered for row in part]
    from megatron_branch.schedule.options import chunks_ran

    ran = auto["picked"] if auto else spec.schedule.name  # what ran (auto: its pick)
    summary = {
        **_summary(args, spec, groups, metrics, objective, full_tree, dtype),
        "schedule_auto": auto,
        **chunks_ran(ran, spec.schedule.chunk_tokens),  # replay's chunks: the budget, or why none
    }
    write_on_rank0(lambda: _write_outputs(args, grads, lp_rows, accumulation_dtype(dtype)))
    if dist.get_rank() == 0:
        print(json.dumps(summary), flush=True)


def _summary(
    args: argparse.Namespace,
    spec: Any,
    groups: Any,
    metrics: dict[str, Any],
    objective: Any,
    full_tree: Any,
    dtype: torch.dtype,
) -> dict[str, Any]:
    from megatron_branch.losses.router import fold_expert_metrics

    return {
        "schedule": spec.schedule.name,
        "backend": _backend_ran(spec),
        "loss": metrics.pop(f"{objective.role}/loss"),
        "positions_logical": full_tree.positions_logical,
        "positions_computed": int(metrics["tree/positions_computed"]),
        "positions_tree": full_tree.positions_computed,
        "rollouts": len(full_tree.rollouts),
        "response_tokens": full_tree.num_response_tokens_logical(),
        "dtype": spec.dtype,
        "grad_dtype": str(accumulation_dtype(dtype)).removeprefix(
            "torch."
        ),  # bf16 / fp16: the fp32 main grads
        "tp": groups.tp_size,
        "cp": groups.cp_size,
        "dp": groups.dp_size,
        "pp": groups.pp_size,
        "root_pieces": spec.schedule.root_pieces,
        "sequence_parallel": groups.sequence_parallel,
        "ep": groups.ep_size,
        "out": args.out,
        "objective": args.policy_loss,
        "metrics": fold_expert_metrics(metrics),  # MoE: tokens per expert as one list per layer
    }


def _backend_ran(spec: Any) -> str:
    """The attention that ran: the resolved executor, or megatron-core's own for the naive schedule."""
    from megatron_branch.attention.dispatch import resolve_backend

    s = spec.schedule
    return "megatron-core" if s.name == "naive" else resolve_backend(s.backend)


def _atomic_write(path: str, write: Any, overwrite: bool) -> None:
    """Write via a temporary file in the same folder, then rename: never a half-written output."""
    with outputs.atomic_file(path, overwrite=overwrite) as tmp:
        write(str(tmp))


def _write_outputs(
    args: argparse.Namespace,
    grads: dict[str, torch.Tensor],
    lp_rows: list[tuple[int, list[float]]],
    dtype: torch.dtype,
) -> None:
    from safetensors.torch import save_file

    host = {n: g.to(device="cpu", dtype=dtype).contiguous() for n, g in grads.items()}
    _atomic_write(args.out, lambda p: save_file(host, p), args.overwrite)
    if args.logprobs_out is not None:

        def write_lp(p: str) -> None:
            with open(p, "w") as f:
                for i, lp in sorted(lp_rows):
                    f.write(json.dumps({"index": i, "logprobs": lp}) + "\n")

        _atomic_write(args.logprobs_out, write_lp, args.overwrite)
