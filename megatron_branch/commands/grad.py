"""`megatron-branch grad`: one logical batch forward/backward, gradients written under HF names.

Contract (stable; other tools rely on it):
    megatron-branch grad --hf DIR --rollouts FILE.jsonl --out GRADS.safetensors
        [--schedule replay|packed|naive] [--dtype float32|float64|bfloat16|float16] [--tp N] [--cp N] [--pp N]
        [--sequence-parallel] [--logprobs-out LP.jsonl] [--grad-sync ddp|manual]
Loss (--objective pg, the default; on-policy GRPO form): L = -(1/T) sum_i sum_{t in response_i} A_i logp(i,t),
T = all response tokens.
Additions (other objectives, docs/design.md "Objectives"; verl's names, the older flags kept as aliases):
    --objective pg|grpo|dpo|NAME   pg = the loss above; grpo (= vanilla) = clipped surrogate + KL + entropy;
                                   dpo = DPO / IPO on preference pairs; NAME = one a --plugin registers
    --plugin MODULE                import MODULE (dotted, or a .py file) first; its @register_policy_loss
                                   objectives become --objective names (repeatable)
    --clip-ratio-low 0.2 --clip-ratio-high 0.2 [--clip-ratio-c C]       (aliases --clip-low --clip-high --clip-c)
    --kl-loss-coef 0.0 --kl-loss-type k1|k2|k3 --entropy-coeff 0.0      (aliases --kl-coef --kl-type --entropy-coef)
    --loss-agg-mode token-mean|seq-mean-token-mean|seq-mean-token-sum|seq-mean-token-sum-norm [--loss-agg-norm L]
                                                                        (alias --loss-agg)
    --dpo-beta 0.1 --dpo-loss sigmoid|ipo                               (alias --beta)
    Rollout fields: advantage (float) or advantages (one per response token); old_logprobs, ref_logprobs (one per
    response token; old_logprobs absent = on-policy); DPO: pair (a JSON scalar shared by the pair), chosen (bool),
    ref_logprobs required. A missing field or a malformed pair: a one-line error naming file:line.
    --schedule auto [--memory-budget GB]   packed when its planned activation peak fits the budget (on a CPU
                                 --memory-budget; on a GPU the free device memory), replay otherwise (plan/auto.py);
                                 the JSON's schedule_auto says which and why
    --chunk-tokens N             replay: small subtrees packed into chunks of <= N tokens, one forward each
GRADS: dL/dparam for every trainable parameter, full unsharded, HF names, in --dtype (bfloat16 / float16: the fp32
main gradients megatron's optimizer steps on). The last stdout line is JSON.
Mixture-of-experts policies (Qwen3-MoE, Mixtral, Qwen2-MoE; docs/design.md "Mixture of experts"):
    --ep N                       expert parallelism inside dp x cp, as megatron lays it out
    --moe-aux-loss-coeff C --moe-seq-aux-loss-coeff C --moe-global-aux-loss-coeff C --moe-z-loss-coeff C
                                 megatron's router losses, every token weighted by its multiplicity
    --routing-replay             route recorded tokens to the rollouts' routed_experts (JSONL field)
    --moe-expert-capacity-factor F   token dropping: naive only (the tree schedules refuse it)
Runs single-process or under `torchrun --nproc_per_node N -m megatron_branch grad ...` (world = tp*cp*pp*dp;
--pp: the layers in pipeline stages, replay or packed, schedule/pipeline.py).
With more than one process the gradients are reduced by megatron-core's DistributedDataParallel and
finalize_model_grads (--grad-sync ddp, the default) or by megatron_branch.parallel.grads (--grad-sync manual).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch import outputs
from megatron_branch.data.rollouts import CONTEXT_OVERRIDE_FLAG
from megatron_branch.errors import SettingError, Spelling, UserError
from megatron_branch.parallel.agree import check_on_every_rank, write_on_rank0
from megatron_branch.precision import DTYPE_NAMES, accumulation_dtype, is_half, torch_dtype

DTYPES = {name: torch_dtype(name) for name in DTYPE_NAMES}
"""--dtype: float32, float64, or megatron's mixed precision (bfloat16, float16: fp32 main gradients, written fp32)."""


def add_grad_command(sub: Any) -> None:
    p = sub.add_parser(
        "grad",
        help="gradient of the GRPO loss over a rollout file (parity checks from outside)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--hf",
        required=True,
        help="Hugging Face folder (config.json + safetensors): Llama, Qwen2, Qwen3, Qwen3.5/3.6, or a mixture of "
        "experts (Qwen3-MoE, Mixtral, Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next)",
    )
    p.add_argument(
        "--rollouts", required=True, help='JSONL: {"prompt": [ids], "response": [ids], "advantage": x}'
    )
    p.add_argument(
        "--out", required=True, help="where to write the gradients (.safetensors, HF names; see --overwrite)"
    )
    p.add_argument(
        "--schedule",
        default="replay",
        choices=["replay", "packed", "naive", "auto"],
        help="auto: packed when its planned activation peak fits --memory-budget (on a GPU by default the free "
        "device memory), replay otherwise; the JSON says which and why (plan/auto.py)",
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="GB",
        help="--schedule auto: GB per rank for the step's activations (needed on a CPU)",
    )
    p.add_argument(
        "--dtype",
        default="float32",
        choices=list(DTYPES),
        help="parameters and compute; bfloat16 / float16: megatron's mixed precision (fp32 main gradients; "
        "softmax, logprobs and dK/dV sums in fp32; the gradients are written in fp32)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size (ring attention)")
    p.add_argument(
        "--pp",
        type=int,
        default=1,
        help="pipeline-parallel stages (replay or packed; must divide the layers)",
    )
    p.add_argument(
        "--root-pieces",
        type=int,
        default=1,
        help="replay under --pp: cut each shared root (prompt) into this many sequence pieces, which flow through "
        "the stages like micro-batches (exact; default 1: whole roots)",
    )
    p.add_argument("--sequence-parallel", action="store_true", help="sequence parallel over the TP group")
    p.add_argument(
        "--ep",
        type=_positive_int,
        default=1,
        help="expert-parallel size (MoE; inside dp x cp, as megatron's)",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=["merge", "packed", "reference", "flex", "repeat"],
        help="attention executor (default merge), the same at --cp 1 and under CP; one that cannot run this step "
        "is refused",
    )
    p.add_argument("--recompute", action="store_true", help="replay: recompute inner segments at backward")
    p.add_argument(
        "--recompute-layers",
        action="store_true",
        help="replay/packed: per-layer activation checkpointing inside every chunk (with --recompute: the "
        "planner's `recompute full`)",
    )
    p.add_argument(
        "--branch-micro-batch", type=_positive_int, default=8, help="replay: sibling leaves per forward"
    )
    p.add_argument(
        "--chunk-tokens",
        type=_positive_int,
        default=None,
        help="replay: pack small subtrees (leaves, short turns, small prompt groups) into chunks of at most this "
        "many tokens, one forward each (default: leaf micro-batches only)",
    )
    p.add_argument("--logprobs-out", default=None, help="write each rollout's response logprobs (JSONL)")
    o = p.add_argument_group("objective (additions to the contract; verl's names, older flags as aliases)")
    o.add_argument(
        "--objective",
        dest="policy_loss",
        default="pg",
        metavar="NAME",
        help="registered objective: pg (default), grpo (= vanilla), dpo, or one a --plugin registers",
    )
    o.add_argument(
        "--plugin",
        dest="plugins",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE (dotted, or a .py file) before the objective is looked up (repeatable)",
    )
    o.add_argument("--clip-ratio-low", "--clip-low", dest="clip_ratio_low", type=float, default=0.2,
                   help="grpo: ratio clipped below at 1 - clip_ratio_low")  # fmt: skip
    o.add_argument("--clip-ratio-high", "--clip-high", dest="clip_ratio_high", type=float, default=0.2,
                   help="grpo: ratio clipped above at 1 + clip_ratio_high")  # fmt: skip
    o.add_argument("--clip-ratio-c", "--clip-c", dest="clip_ratio_c", type=float, default=None,
                   help="grpo: dual-clip bound for A < 0 (> 1; verl: 3)")  # fmt: skip
    o.add_argument("--kl-loss-coef", "--kl-coef", dest="kl_loss_coef", type=float, default=0.0,
                   help="grpo: coefficient of the KL to ref_logprobs")  # fmt: skip
    o.add_argument("--kl-loss-type", "--kl-type", dest="kl_loss_type", default="k1",
                   choices=["k1", "k2", "k3", "kl", "mse", "low_var_kl"])  # fmt: skip
    o.add_argument("--entropy-coeff", "--entropy-coef", dest="entropy_coeff", type=float, default=0.0,
                   help="grpo: entropy bonus coefficient")  # fmt: skip
    o.add_argument("--loss-agg-mode", "--loss-agg", dest="loss_agg_mode", default="token-mean",
                   choices=list(_agg_modes()), help="grpo: aggregation")  # fmt: skip
    o.add_argument("--loss-agg-norm", type=float, default=None, help="L_norm of seq-mean-token-sum-norm")
    o.add_argument("--dpo-beta", "--beta", dest="dpo_beta", type=float, default=0.1, help="dpo: beta")
    o.add_argument("--dpo-loss", default="sigmoid", choices=["sigmoid", "ipo"], help="dpo: loss form")
    m = p.add_argument_group("mixture of experts (additions to the contract)")
    for name, what in (
        ("aux-loss", "megatron's aux_loss (per micro-batch)"),
        ("seq-aux-loss", "seq_aux_loss (per rollout)"),
        ("global-aux-loss", "global_aux_loss (counts over the update)"),
        ("z-loss", "router z-loss"),
    ):
        m.add_argument(
            f"--moe-{name}-coeff", type=float, default=0.0, help=f"{what}; weighted by multiplicity"
        )
    m.add_argument(
        "--routing-replay", action="store_true", help="route recorded tokens to their routed_experts"
    )
    m.add_argument(
        "--moe-expert-capacity-factor",
        type=float,
        default=None,
        help="token dropping (naive only: not exact under sharing, refused by packed and replay)",
    )
    p.add_argument(
        "--grad-sync",
        default="ddp",
        choices=["ddp", "manual"],
        help="multi-process gradient reduction: megatron-core DDP + finalize_model_grads, or the plain reference",
    )
    p.add_argument(
        CONTEXT_OVERRIDE_FLAG,
        action="store_true",
        help="accept rollouts longer than the model's max_position_embeddings (RoPE extrapolates; off by default)",
    )
    outputs.add_overwrite_argument(p)
    p.set_defaults(func=run_grad)


def _agg_modes() -> tuple[str, ...]:
    from megatron_branch.losses.aggregation import AGG_MODES

    return AGG_MODES


SPELLING = Spelling(
    names={
        "policy_loss": "--objective",
        "plugins": "--plugin",
        "moe": "--moe-* / --routing-replay",
        "capacity_factor": "--moe-expert-capacity-factor",
    }
)
"""How grad's messages name a setting: its flag (the objective's fields by their verl-named flags)."""


def objective_config(args: argparse.Namespace) -> Any:
    """The one objective config (losses/config.py) from the flags: each objective flag's dest is its field."""
    from megatron_branch.losses import ObjectiveConfig

    return ObjectiveConfig(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(ObjectiveConfig)
            if hasattr(args, f.name)
        }
    )


def make_objective(args: argparse.Namespace, rollouts: list[Any], full_tree: Any) -> Any:
    """The objective the flags describe (the registry's builder, as `train` uses), normalised on the whole batch,
    validated on every rollout (UserError naming file:line for a missing field or a malformed pair) before any
    collective."""
    from megatron_branch.losses import build_objective, load_plugins

    try:
        load_plugins(args.plugins)
        objective = build_objective(objective_config(args), rollouts)
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    except UserError:
        raise
    except ValueError as e:  # a bad value the objective itself refuses
        raise UserError(str(e)) from None
    objective.check(full_tree)  # every rollout has the fields the objective reads
    return objective


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def moe_options(args: argparse.Namespace, arch: Any) -> Any:
    """The MoE options the flags describe (None for a dense model), refusing what the run cannot do."""
    from megatron_branch.losses.router import MoEOptions, RouterLossConfig

    coeffs = {
        "aux_loss_coeff": args.moe_aux_loss_coeff,
        "seq_aux_loss_coeff": args.moe_seq_aux_loss_coeff,
        "global_aux_loss_coeff": args.moe_global_aux_loss_coeff,
        "z_loss_coeff": args.moe_z_loss_coeff,
    }
    from megatron_branch.rules import check_moe_run

    try:
        check_moe_run(
            args.schedule, moe=arch.is_moe, tp=args.tp, sequence_parallel=args.sequence_parallel, ep=args.ep,
            router_settings=any(coeffs.values()) or args.routing_replay,
            capacity_factor=args.moe_expert_capacity_factor,
        )  # fmt: skip
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    if not arch.is_moe:
        return None
    arch.check_expert_parallel(args.ep, tp=args.tp)
    try:
        return MoEOptions(losses=RouterLossConfig(**coeffs), routing_replay=args.routing_replay)
    except ValueError as e:
        raise UserError(str(e).replace("_coeff must", "-coeff must").replace("_", "-")) from None


def check_routing_records(rollouts: list[Any], arch: Any, *, replay: bool) -> list[Any]:
    """With --routing-replay every rollout needs routed_experts shaped for `arch`; without it records are dropped
    (they would split the prefix tree for nothing)."""
    import dataclasses

    if not replay:
        return [dataclasses.replace(r, routed_experts=None) for r in rollouts]
    want = (len(arch.moe_layers), arch.moe_top_k)
    for i, r in enumerate(rollouts):
        rec = r.routed_experts
        if rec is None:
            raise UserError("--routing-replay: missing field 'routed_experts'", where=r.describe(i))
        if tuple(rec.shape[1:]) != want or int(rec.max()) >= arch.num_experts:
            raise UserError(
                f"routed_experts has shape {list(rec.shape)} (max id {int(rec.max())}); the model routes "
                f"{want[0]} MoE layers x top-{want[1]} over {arch.num_experts} experts",
                where=r.describe(i),
            )
    return rollouts


def auto_choice(
    args: argparse.Namespace, arch: Any, rollouts: list[Any], pcfg: Any, world: int, dtype: Any
) -> Any:
    """--schedule auto (plan/auto.py): the budget is --memory-budget, or the free device memory now (after the model
    is loaded), the smallest over the ranks, so every rank picks the same."""
    from megatron_branch.plan import Layout
    from megatron_branch.plan.auto import grad_choice
    from megatron_branch.rules import check_run

    if args.memory_budget is not None:
        budget = int(args.memory_budget * 1e9)
    else:
        free = torch.tensor([torch.cuda.mem_get_info()[0]], dtype=torch.long, device="cuda")
        if dist.is_initialized():
            dist.all_reduce(free, op=dist.ReduceOp.MIN)
        budget = int(free.item())
    try:  # what packed refuses (segment recompute, chunk_tokens are replay's options)
        check_run("packed", cp=pcfg.cp, recompute=args.recompute, recompute_layers=args.recompute_layers,
                  backend=args.backend)  # fmt: skip
        problem = "--chunk-tokens is replay's" if args.chunk_tokens is not None else None
    except (UserError, SettingError) as e:
        problem = str(e)
    layout = Layout(tp=pcfg.tp, cp=pcfg.cp, pp=pcfg.pp, dp=pcfg.data_parallel_size(world),
                    sequence_parallel=pcfg.sequence_parallel)  # fmt: skip
    return grad_choice(arch, rollouts, layout, act_bytes=dtype.itemsize, layer_recompute=args.recompute_layers,
                       budget_bytes=budget, packed_problem=problem)  # fmt: skip


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _check_output(path: str | None, overwrite: bool) -> None:
    if path is not None:
        outputs.check_output_file(path, overwrite=overwrite)


def _atomic_write(path: str, write: Any, overwrite: bool) -> None:
    """Write via a temporary file in the same folder, then rename: never a half-written output."""
    with outputs.atomic_file(path, overwrite=overwrite) as tmp:
        write(str(tmp))


def _backend_ran(args: argparse.Namespace) -> str:
    """The attention that ran: the resolved executor, or megatron-core's own for the naive schedule."""
    from megatron_branch.attention.dispatch import resolve_backend

    return "megatron-core" if args.schedule == "naive" else resolve_backend(args.backend)


def run_grad(args: argparse.Namespace) -> int:
    """The thin command around the update's gradient part (update.accumulate_gradients + finalize)."""
    from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config
    from megatron_branch.checkpoint.param_map import mcore_to_hf_state
    from megatron_branch.checkpoint.stages import gather_model_grads
    from megatron_branch.data import PrefixTree, read_rollouts_jsonl
    from megatron_branch.losses.router import fold_expert_metrics
    from megatron_branch.models import ModelArch
    from megatron_branch.models.arch import check_schedule_supports
    from megatron_branch.parallel.data import assign_groups
    from megatron_branch.parallel.groups import init_distributed, initialize_parallel
    from megatron_branch.parallel.layout import ParallelLayout
    from megatron_branch.rules import check_pipeline, check_precision, check_run
    from megatron_branch.schedule import ScheduleOptions
    from megatron_branch.update import UpdatePlan, accumulate_gradients, finalize, reduce_metrics

    dtype = DTYPES[args.dtype]
    auto = args.schedule == "auto"
    if (
        auto
    ):  # checked as replay (what auto falls back to); packed is asked after the model loads (auto_choice)
        args.schedule = "replay"

    def validate() -> tuple[Any, ...]:
        # Everything the user gave, before any collective or model work (on every rank, one verdict).
        pcfg = ParallelLayout(
            tp=args.tp, cp=args.cp, pp=args.pp, sequence_parallel=args.sequence_parallel, ep=args.ep
        )
        pcfg.check_no_op()
        check_precision(args.dtype, grad_sync=args.grad_sync)
        check_run(args.schedule, cp=pcfg.cp, recompute=args.recompute, recompute_layers=args.recompute_layers,
                  backend=args.backend)  # fmt: skip
        if args.ep > 1 and args.grad_sync == "manual":
            raise UserError(
                "--grad-sync manual does not reduce expert-parallel gradients (over the expert data-parallel "
                "group); use --grad-sync ddp with --ep"
            )
        _check_output(args.out, args.overwrite)
        _check_output(args.logprobs_out, args.overwrite)
        arch = ModelArch.from_hf_config(load_hf_config(args.hf), where=os.path.join(args.hf, "config.json"))
        arch.check_tensor_parallel(pcfg.tp)
        check_pipeline(
            args.schedule, pp=pcfg.pp, num_layers=arch.num_layers, hybrid=arch.is_hybrid, moe=arch.is_moe,
            root_pieces=args.root_pieces,
        )  # fmt: skip
        check_schedule_supports(arch, args.schedule, cp=pcfg.cp, tp=pcfg.tp)
        moe = moe_options(args, arch)
        HFTensorReader(args.hf)  # every shard's header is read now: a broken file fails before any work
        max_positions = None if args.allow_longer_context else arch.max_position_embeddings
        rollouts = read_rollouts_jsonl(args.rollouts, vocab_size=arch.vocab_size, max_positions=max_positions)
        if moe is not None:
            rollouts = check_routing_records(rollouts, arch, replay=args.routing_replay)
        full_tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
        objective = make_objective(args, rollouts, full_tree)
        if auto and args.memory_budget is None and not torch.cuda.is_available():
            raise UserError(
                "--schedule auto on a CPU needs --memory-budget GB (per rank, for the activations)"
            )
        if auto and args.memory_budget is not None and args.memory_budget <= 0:
            raise UserError(f"--memory-budget must be positive, got {args.memory_budget}")
        return pcfg, arch, rollouts, full_tree, objective, moe

    pcfg, arch, rollouts, full_tree, objective, moe = check_on_every_rank(validate)
    rank, world = init_distributed()

    def validate_layout() -> None:  # needs the world size; still before any model work, one verdict
        dp_size = pcfg.data_parallel_size(world)
        if pcfg.cp > 1:
            from megatron_branch.parallel.cp_layout import check_cp_fits

            # each DP rank runs its own share of the groups: every share must fill its CP ranks
            for share in assign_groups(full_tree, dp_size):
                if share:
                    sub = PrefixTree.build([rollouts[i] for i in share], vocab_size=arch.vocab_size)
                    check_cp_fits(sub, pcfg.cp)

    check_on_every_rank(validate_layout)

    groups = initialize_parallel(pcfg)
    model = load_policy(args.hf, arch, groups, dtype, capacity_factor=args.moe_expert_capacity_factor)
    # megatron's DDP: main_grad buffers, SUM over dp x cp, SP norm sum over TP; with more than one process, and
    # always for bf16 / fp16 parameters (each backward's gradient is added into its fp32 main gradient)
    ddp, pg_collection = None, None
    if args.grad_sync == "ddp" and (world > 1 or is_half(dtype)):
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_branch.parallel.ddp import wrap_megatron_ddp

        pg_collection = ProcessGroupCollection.use_mpu_process_groups()  # the entry point owns the groups
        ddp = wrap_megatron_ddp(model, dtype=dtype, pg_collection=pg_collection)
    if groups.ep_spans_dp:  # EP groups across DP replicas: their model calls pair up (parallel/lockstep.py)
        from megatron_branch.parallel import lockstep

        lockstep.install(model, rows=groups.tp_size if groups.sequence_parallel else 1)

    opts = ScheduleOptions(
        groups=groups,
        vocab_size=arch.vocab_size,
        backend=args.backend,
        branch_micro_batch=args.branch_micro_batch,
        chunk_tokens=args.chunk_tokens,
        recompute=args.recompute,
        recompute_layers=args.recompute_layers,
        root_pieces=args.root_pieces,
        moe=moe,
    )
    choice = None
    if auto:
        choice = auto_choice(args, arch, rollouts, pcfg, world, dtype)
        args.schedule = choice.schedule
    plan = UpdatePlan(opts=opts, schedule=args.schedule, pg_collection=pg_collection)
    model.zero_grad(set_to_none=True)
    acc = accumulate_gradients(
        ddp if ddp is not None else model,
        rollouts,
        objective,
        plan,
        keep_logprobs=args.logprobs_out is not None,
    )
    finalize(ddp if ddp is not None else model, plan)
    metrics = reduce_metrics(acc, objective, groups)
    grads = mcore_to_hf_state(gather_model_grads(model, groups), arch)

    lp_rows: list[tuple[int, list[float]]] = sorted(acc.logprobs.items())
    if args.logprobs_out is not None and groups.dp_size > 1:
        gathered: list[Any] = [None] * groups.dp_size
        dist.all_gather_object(gathered, lp_rows, group=groups.dp)
        lp_rows = [row for part in gathered for row in part]

    summary = {
        "schedule": args.schedule,
        "schedule_auto": None if choice is None else choice.to_json(),
        "backend": _backend_ran(args),
        "loss": metrics.pop(f"{objective.role}/loss"),
        "positions_logical": full_tree.positions_logical,
        "positions_computed": int(metrics["tree/positions_computed"]),
        "positions_tree": full_tree.positions_computed,
        "rollouts": len(rollouts),
        "response_tokens": full_tree.num_response_tokens_logical(),
        "dtype": args.dtype,
        "grad_dtype": _name(accumulation_dtype(dtype)),  # what GRADS holds (bf16 / fp16: the fp32 main grads)
        "tp": groups.tp_size,
        "cp": groups.cp_size,
        "dp": groups.dp_size,
        "pp": groups.pp_size,
        "root_pieces": args.root_pieces,
        "sequence_parallel": groups.sequence_parallel,
        "ep": groups.ep_size,
        "out": args.out,
        "objective": args.policy_loss,
        "metrics": fold_expert_metrics(metrics),  # MoE: tokens per expert as one list per layer
    }
    # rank 0 writes; a failure there must reach every rank, which would otherwise wait forever
    write_on_rank0(lambda: _write_outputs(args, grads, lp_rows, accumulation_dtype(dtype)))
    if rank == 0:
        print(json.dumps(summary), flush=True)
    return 0


def load_policy(
    hf_dir: str, arch: Any, groups: Any, dtype: torch.dtype, *, capacity_factor: float | None = None
) -> torch.nn.Module:
    """The megatron-core model of `arch` on this rank with the HF weights of `hf_dir` (its pipeline stage's
    tensors, TP shards, this EP rank's experts), on this rank's GPU when there is one. `capacity_factor`: a MoE's
    token dropping (naive only)."""
    from megatron_branch.checkpoint.hf_io import HFTensorReader
    from megatron_branch.checkpoint.param_map import iter_hf_to_mcore
    from megatron_branch.checkpoint.stages import load_stage
    from megatron_branch.models import build_model

    reader = HFTensorReader(hf_dir)
    extra = {} if capacity_factor is None else {"moe_expert_capacity_factor": capacity_factor}
    model = build_model(
        arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel, ep=groups.ep_size,
        pp=groups.pp_size, pp_rank=groups.pp_rank, **extra,
    )  # fmt: skip
    tensors = iter_hf_to_mcore(
        reader.keys(), reader.get, arch, padded_vocab=arch.padded_vocab_size(groups.tp_size), where=hf_dir
    )
    load_stage(model, ((name, full.to(dtype)) for name, full in tensors), groups)
    if torch.cuda.is_available():  # weights are loaded on the host, then the model moves to this rank's GPU
        model.cuda()
    return model


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
