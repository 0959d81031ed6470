"""`megatron-branch grad`: one logical batch forward/backward, gradients written under HF names.

Contract (stable; other tools rely on it):
    megatron-branch grad --hf DIR --rollouts FILE.jsonl --out GRADS.safetensors
        [--schedule replay|packed|naive] [--dtype float32|float64] [--tp N] [--cp N] [--sequence-parallel]
        [--logprobs-out LP.jsonl] [--grad-sync ddp|manual]
Loss (on-policy GRPO form): L = -(1/T) sum_i sum_{t in response_i} A_i logp(i,t), T = all response tokens.
GRADS: dL/dparam for every trainable parameter, full unsharded, HF names, in --dtype. The last stdout line is JSON.
Runs single-process or under `torchrun --nproc_per_node N -m megatron_branch grad ...` (world = tp*cp*dp).
With more than one process the gradients are reduced by megatron-core's DistributedDataParallel and
finalize_model_grads (--grad-sync ddp, the default) or by megatron_branch.parallel.grads (--grad-sync manual).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.errors import UserError

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def add_grad_command(sub: Any) -> None:
    p = sub.add_parser(
        "grad",
        help="gradient of the GRPO loss over a rollout file (parity checks from outside)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--hf", required=True, help="Hugging Face folder (config.json + safetensors): Llama or Qwen2"
    )
    p.add_argument(
        "--rollouts", required=True, help='JSONL: {"prompt": [ids], "response": [ids], "advantage": x}'
    )
    p.add_argument("--out", required=True, help="where to write the gradients (.safetensors, HF names)")
    p.add_argument("--schedule", default="replay", choices=["replay", "packed", "naive"])
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (ring attention)")
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallel over the TP group")
    p.add_argument(
        "--backend", default=None, choices=["merge", "packed", "reference"], help="attention backend override"
    )
    p.add_argument("--recompute", action="store_true", help="replay: recompute inner segments at backward")
    p.add_argument(
        "--branch-micro-batch", type=_positive_int, default=8, help="replay: sibling leaves per forward"
    )
    p.add_argument("--logprobs-out", default=None, help="write each rollout's response logprobs (JSONL)")
    p.add_argument(
        "--grad-sync",
        default="ddp",
        choices=["ddp", "manual"],
        help="multi-process gradient reduction: megatron-core DDP + finalize_model_grads, or the plain reference",
    )
    p.set_defaults(func=run_grad)


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _check_output(path: str | None) -> None:
    if path is None:
        return
    if not Path(path).parent.is_dir():
        raise UserError(f"output folder {str(Path(path).parent)!r} does not exist")
    if Path(path).is_dir():
        raise UserError(f"output {path!r} is a directory; give a file name")


def _atomic_write(path: str, write: Any) -> None:
    """Write via a temporary file in the same folder, then rename: never a half-written output."""
    target = Path(path)
    _check_output(path)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def run_grad(args: argparse.Namespace) -> int:
    from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config
    from megatron_branch.checkpoint.param_map import iter_hf_to_mcore, mcore_to_hf_state
    from megatron_branch.checkpoint.tp import gather_full_grads, load_full_tensor
    from megatron_branch.data import PrefixTree, read_rollouts_jsonl
    from megatron_branch.losses import PolicyGradientObjective
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.data import assign_groups
    from megatron_branch.parallel.grads import finalize_grads
    from megatron_branch.parallel.groups import (
        ParallelConfig,
        agree_on_error,
        comm_device,
        init_distributed,
        initialize_parallel,
    )
    from megatron_branch.schedule import ScheduleOptions, run_schedule

    dtype = DTYPES[args.dtype]
    # Validate everything the user gave before any collective or model work.
    pcfg = ParallelConfig(tp=args.tp, cp=args.cp, sequence_parallel=args.sequence_parallel)
    _check_output(args.out)
    _check_output(args.logprobs_out)
    if pcfg.cp > 1 and args.schedule == "naive":
        # naive runs every rollout whole through megatron's own attention: it has no ring, so under CP every CP
        # rank would compute the whole batch and the CP sum would count it cp times.
        raise UserError(
            f"--schedule naive has no context parallelism (it is the unsplit baseline); "
            f"use --schedule packed or replay with --cp {pcfg.cp}"
        )
    arch = ModelArch.from_hf_config(load_hf_config(args.hf), where=os.path.join(args.hf, "config.json"))
    arch.check_tensor_parallel(pcfg.tp)
    reader = HFTensorReader(args.hf)
    rollouts = read_rollouts_jsonl(args.rollouts, vocab_size=arch.vocab_size)
    full_tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    rank, world = init_distributed()
    dp_size = pcfg.data_parallel_size(world)
    if pcfg.cp > 1:
        from megatron_branch.parallel.cp_layout import check_cp_fits

        # each DP rank runs its own share of the groups: every share must fill its CP ranks
        for share in assign_groups(full_tree, dp_size):
            if share:
                sub = PrefixTree.build([rollouts[i] for i in share], vocab_size=arch.vocab_size)
                check_cp_fits(sub, pcfg.cp)

    groups = initialize_parallel(pcfg)
    model = build_model(arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, full in iter_hf_to_mcore(
            reader.keys(),
            reader.get,
            arch,
            padded_vocab=arch.padded_vocab_size(groups.tp_size),
            where=args.hf,
        ):
            load_full_tensor(model, name, full.to(dtype), groups.tp, params=params)
    if torch.cuda.is_available():  # weights are loaded on the host, then the model moves to this rank's GPU
        model.cuda()

    # megatron's DDP (when there is more than one process): main_grad buffers, SUM over dp x cp, SP norm sum over TP
    ddp = None
    if args.grad_sync == "ddp" and world > 1:
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_branch.parallel.ddp import finalize_megatron_grads, wrap_megatron_ddp

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()  # the entry point owns the groups
        ddp = wrap_megatron_ddp(model, dtype=dtype, pg_collection=pg_collection)

    dp_rank = dist.get_rank(groups.dp)
    mine = assign_groups(full_tree, groups.dp_size)[dp_rank]
    T = full_tree.num_response_tokens_logical()  # GLOBAL logical count: any DP size gives the same gradient
    model.zero_grad(set_to_none=True)
    loss, result, tree = 0.0, None, None
    if mine:
        tree = PrefixTree.build([rollouts[i] for i in mine], vocab_size=arch.vocab_size)
        objective = PolicyGradientObjective.grpo([rollouts[i].advantage for i in mine], T)
        opts = ScheduleOptions(
            groups=groups,
            vocab_size=arch.vocab_size,
            backend=args.backend,
            branch_micro_batch=args.branch_micro_batch,
            recompute=args.recompute,
            keep_logprobs=args.logprobs_out is not None,
        )
        result = run_schedule(args.schedule, ddp if ddp is not None else model, tree, objective, opts)
        loss = result.loss
    if ddp is not None:
        finalize_megatron_grads(ddp, pg_collection=pg_collection)
    else:
        finalize_grads(
            model, tp_group=groups.tp, dp_cp_group=groups.dp_cp, sequence_parallel=groups.sequence_parallel
        )
    loss_t = torch.tensor(
        [loss, result.positions_computed if result else 0], dtype=torch.float64, device=comm_device(groups.dp)
    )
    if groups.dp_size > 1:
        dist.all_reduce(loss_t, group=groups.dp)
    grads = mcore_to_hf_state(gather_full_grads(model, groups.tp), arch)

    lp_rows: list[tuple[int, list[float]]] = []
    if args.logprobs_out is not None and result is not None:
        lp_rows = [(mine[j], result.rollout_logprobs(tree, j).tolist()) for j in range(len(mine))]
    if args.logprobs_out is not None and groups.dp_size > 1:
        gathered: list[Any] = [None] * groups.dp_size
        dist.all_gather_object(gathered, lp_rows, group=groups.dp)
        lp_rows = [row for part in gathered for row in part]

    summary = {
        "schedule": args.schedule,
        "loss": float(loss_t[0]),
        "positions_logical": full_tree.positions_logical,
        "positions_computed": int(loss_t[1]) if args.schedule != "naive" else full_tree.positions_logical,
        "positions_tree": full_tree.positions_computed,
        "rollouts": len(rollouts),
        "response_tokens": T,
        "dtype": args.dtype,
        "tp": groups.tp_size,
        "cp": groups.cp_size,
        "dp": groups.dp_size,
        "sequence_parallel": groups.sequence_parallel,
        "out": args.out,
    }
    err = None
    if rank == 0:  # rank 0 writes; a failure there must reach every rank, which would otherwise wait forever
        try:
            _write_outputs(args, grads, lp_rows, dtype)
        except (UserError, OSError) as e:
            err = str(e)
    agree_on_error(err, error=UserError)
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return 0


def _write_outputs(
    args: argparse.Namespace,
    grads: dict[str, torch.Tensor],
    lp_rows: list[tuple[int, list[float]]],
    dtype: torch.dtype,
) -> None:
    from safetensors.torch import save_file

    host = {n: g.to(device="cpu", dtype=dtype).contiguous() for n, g in grads.items()}
    _atomic_write(args.out, lambda p: save_file(host, p))
    if args.logprobs_out is not None:

        def write_lp(p: str) -> None:
            with open(p, "w") as f:
                for i, lp in sorted(lp_rows):
                    f.write(json.dumps({"index": i, "logprobs": lp}) + "\n")

        _atomic_write(args.logprobs_out, write_lp)
