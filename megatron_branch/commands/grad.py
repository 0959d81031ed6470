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
    --kl-loss-coef 0.0 --kl-loss-type low_var_kl --entropy-coeff 0.0   (aliases --kl-coef --kl-type --entropy-coef;
                                   the KL type's default is verl's actor default, low_var_kl = k3)
    --loss-agg-mode token-mean|token-sum|seq-mean-token-mean|seq-mean-token-sum|seq-mean-token-sum-norm
                                   [--loss-agg-norm L]
                                                                        (alias --loss-agg)
    --dpo-beta 0.1 --dpo-loss sigmoid|ipo                               (alias --beta)
    Rollout fields: advantage (float) or advantages (one per response token); old_logprobs, ref_logprobs (one per
    response token; old_logprobs absent = on-policy); DPO: pair (a JSON scalar shared by the pair), chosen (bool),
    ref_logprobs required; loss_mask (0/1 per response token, 0 = context: no loss term, in no count).
    A missing field, a malformed pair or mask: a one-line error naming file:line.
    Every setting's flag, choices, default and help come from the dataclass the train config uses for it
    (commands/grad_flags.py): `grad --help` lists them all.
    --schedule auto [--memory-budget GB]   packed when its planned activation peak fits the budget (on a CPU
                                 --memory-budget; on a GPU the free memory) and the tree is one chunk of
                                 --chunk-tokens, else replay (plan/auto.py); the JSON's schedule_auto says why
    --chunk-tokens N             replay (and auto's replay): small subtrees packed into chunks of <= N tokens, one
                                 forward each (default 4096); 0: off, every segment walked on its own; the
                                 JSON's chunk_tokens says the budget that ran
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
import os
from typing import Any

import torch

from megatron_branch import outputs, rules
from megatron_branch.commands.grad_flags import SPELLING, add_grad_flags, objective_config, run_spec
from megatron_branch.errors import SettingError, UserError
from megatron_branch.parallel.agree import check_on_every_rank
from megatron_branch.progress import Progress, add_quiet_argument

__all__ = ["SPELLING", "add_grad_command", "objective_config", "run_grad"]


def add_grad_command(sub: Any) -> None:
    p = sub.add_parser(
        "grad",
        help="gradient of a policy loss (default --objective pg) over a rollout file (parity checks from outside)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_grad_flags(p)  # commands/grad_flags.py: generated from the run's dataclasses
    add_quiet_argument(p)
    p.set_defaults(func=run_grad)


def run_grad(args: argparse.Namespace) -> int:
    """The thin command around the update's gradient part (update.accumulate_gradients + finalize)."""
    from megatron_branch.assembly import build_engine
    from megatron_branch.commands.grad_auto import auto_choice
    from megatron_branch.commands.grad_outputs import write_results
    from megatron_branch.parallel.groups import init_distributed
    from megatron_branch.precision import torch_dtype
    from megatron_branch.update import UpdatePlan, accumulate_gradients, finalize, reduce_metrics

    # its first line comes after the checks: a bad input stays one line on stderr
    progress = Progress("grad", quiet=args.quiet)
    auto = args.schedule == "auto"
    if (
        auto
    ):  # checked as replay (what auto falls back to); packed is asked once the model is loaded (auto_choice)
        args.schedule = "replay"
    spec, rollouts, full_tree, objective, rejection = check_on_every_rank(lambda: validate(args, auto=auto))
    _, world = init_distributed()
    check_on_every_rank(lambda: validate_layout(spec, rollouts, full_tree, world))
    progress.phase(f"inputs checked; prefix tree: {len(rollouts)} rollouts, {full_tree.positions_logical:,} "
                   f"positions, {full_tree.positions_computed:,} distinct")  # fmt: skip
    progress.phase(f"loading the model from {args.hf}")
    engine = build_engine(
        spec
    )  # megatron's parallel_state, this rank's stage with the HF weights, the options
    model, groups = engine.model, engine.groups
    dtype = torch_dtype(spec.dtype)
    ddp, pg_collection = _megatron_ddp(model, spec, world)
    choice = None
    if auto:
        choice = auto_choice(args, spec, rollouts, world)
        spec = dataclasses.replace(spec, schedule=dataclasses.replace(spec.schedule, name=choice.schedule))
    plan = UpdatePlan(opts=engine.opts, schedule=spec.schedule.name, pg_collection=pg_collection)
    model.zero_grad(set_to_none=True)
    progress.phase(f"{spec.schedule.name} schedule: forward and backward")
    trained = ddp if ddp is not None else model
    acc = accumulate_gradients(
        trained, rollouts, objective, plan, keep_logprobs=args.logprobs_out is not None
    )
    finalize(trained, plan)
    metrics = {**reduce_metrics(acc, objective, groups), **rejection}
    progress.phase(f"writing {args.out}")
    write_results(args, spec, model, groups, acc, metrics, objective, full_tree, dtype,
                  auto=None if choice is None else choice.to_json())  # fmt: skip
    progress.done()
    return 0


def validate(args: argparse.Namespace, *, auto: bool = False) -> tuple[Any, ...]:
    """Everything the user gave, before any collective or model work (on every rank, one verdict): the run's
    settings (rules.check), the outputs, the model's config and its rules, the weights' headers, the rollouts and
    the objective."""
    from megatron_branch.checkpoint.hf_io import HFTensorReader, load_hf_config
    from megatron_branch.data import PrefixTree, read_rollouts_jsonl
    from megatron_branch.models import ModelArch

    try:
        spec = run_spec(args)
        rules.check(spec)
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    for path in (args.out, args.logprobs_out):
        if path is not None:
            outputs.check_output_file(path, overwrite=args.overwrite)
    arch = ModelArch.from_hf_config(load_hf_config(args.hf), where=os.path.join(args.hf, "config.json"))
    spec = dataclasses.replace(spec, arch=arch)
    try:
        rules.check_model(spec)
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    arch.check_tensor_parallel(spec.layout.tp, etp=spec.layout.etp)
    _check_moe(spec)
    HFTensorReader(args.hf)  # every shard's header is read now: a broken file fails before any work
    max_positions = None if args.allow_longer_context else arch.max_position_embeddings
    rollouts = read_rollouts_jsonl(args.rollouts, vocab_size=arch.vocab_size, max_positions=max_positions)
    if arch.is_moe:
        rollouts = check_routing_records(rollouts, arch, replay=spec.moe.router_replay == "R3")
    rejection: dict[str, float] = {}
    if spec.objective.rollout_rs is not None:  # verl's rollout_rs: rejected tokens get loss_mask 0
        from megatron_branch.losses.rollout_correction import reject_rollouts

        rs = spec.objective
        rollouts, rejection = reject_rollouts(
            rollouts, rs.rollout_rs, rs.rollout_rs_threshold, refuse_empty=True
        )
    full_tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    objective = make_objective(args, spec.objective, rollouts, full_tree)
    if auto and args.memory_budget is None and not torch.cuda.is_available():
        raise UserError("--schedule auto on a CPU needs --memory-budget GB (per rank, for the activations)")
    if args.memory_budget is not None and args.memory_budget <= 0:
        raise UserError(f"--memory-budget must be positive, got {args.memory_budget}")
    return spec, rollouts, full_tree, objective, rejection


def validate_layout(spec: Any, rollouts: list[Any], full_tree: Any, world: int) -> None:
    """What needs the world size; still before any model work, one verdict."""
    from megatron_branch.data import PrefixTree
    from megatron_branch.parallel.data import assign_groups

    dp_size = spec.layout.data_parallel_size(world)
    if spec.layout.cp > 1:
        from megatron_branch.parallel.cp_layout import check_cp_fits

        # each DP rank runs its own share of the groups: every share must fill its CP ranks
        for share in assign_groups(full_tree, dp_size):
            if share:
                sub = PrefixTree.build([rollouts[i] for i in share], vocab_size=spec.arch.vocab_size)
                check_cp_fits(sub, spec.layout.cp)


def _check_moe(spec: Any) -> None:
    """A MoE model's expert split and router settings (the run's MoE rules: rules.check_model)."""
    if not spec.arch.is_moe:
        return
    spec.arch.check_expert_parallel(spec.layout.ep, tp=spec.layout.tp, etp=spec.layout.etp)
    try:
        spec.moe.options()
    except ValueError as e:
        raise UserError(str(e).replace("_coeff must", "-coeff must").replace("_", "-")) from None


def _megatron_ddp(model: Any, spec: Any, world: int) -> tuple[Any, Any]:
    """megatron's DDP: main_grad buffers, SUM over dp x cp, SP norm sum over TP; with more than one process, and
    always for bf16 / fp16 parameters (each backward's gradient is added into its fp32 main gradient)."""
    from megatron_branch.precision import HALF_NAMES

    if spec.grad_sync != "ddp" or (world == 1 and spec.dtype not in HALF_NAMES):
        return None, None
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.parallel.ddp import wrap_megatron_ddp
    from megatron_branch.precision import torch_dtype

    pg_collection = ProcessGroupCollection.use_mpu_process_groups()  # the entry point owns the groups
    return wrap_megatron_ddp(model, dtype=torch_dtype(spec.dtype), pg_collection=pg_collection), pg_collection


def make_objective(args: argparse.Namespace, cfg: Any, rollouts: list[Any], full_tree: Any) -> Any:
    """The objective the flags describe (the registry's builder, as `train` uses), normalised on the whole batch,
    validated on every rollout (UserError naming file:line for a missing field or a malformed pair) before any
    collective."""
    from megatron_branch.losses import build_objective, load_plugins

    try:
        load_plugins(args.plugins)
        objective = build_objective(cfg, rollouts)
    except SettingError as e:
        raise e.spelled(SPELLING) from None
    except UserError:
        raise
    except ValueError as e:  # a bad value the objective itself refuses
        raise UserError(str(e)) from None
    objective.check(full_tree)  # every rollout has the fields the objective reads
    return objective


def check_routing_records(rollouts: list[Any], arch: Any, *, replay: bool) -> list[Any]:
    """With --routing-replay every rollout needs routed_experts shaped for `arch`; without it records are dropped
    (they would split the prefix tree for nothing)."""
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
