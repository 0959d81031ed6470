"""A drop-in for megatron-core's `get_forward_backward_func()`: the step's rollouts run as one prefix tree.

megatron's training loop calls

    losses_reduced = forward_backward_func(forward_step_func=..., data_iterator=..., model=..., num_microbatches=...,
                                           seq_length=..., micro_batch_size=..., forward_only=False, ...)

and reduces `losses_reduced` (one dict per micro-batch; a 2-element value [sum, count] is summed over micro-batches
and over the dp x cp group, then divided). The callable returned here takes the SAME keywords and returns the same
kind of list, with these differences, all deliberate:

* `data_iterator` yields ROLLOUT batches, `num_microbatches` of them: each a `Rollout`, a dict
  {"prompt", "response", "advantage", optional per-token lists} or a list of either. All of them form ONE prefix
  tree, so sharing across micro-batches is found too. Every DP rank's iterator yields its own rollouts (as in
  megatron); TP and CP ranks of one DP replica must yield the same ones (as megatron's data loader does).
* `forward_step_func` is NOT called: the engine runs the model itself (chunks of the tree with the configured
  schedule) and the configured objective is the loss (default: on-policy GRPO, `-(1/T) sum A_i logp` with T the
  response tokens of the whole step over all DP ranks). It is accepted so that the call site does not change.
* `seq_length`, `micro_batch_size`, `decoder_seq_length`, `first_val_step`, `collect_non_loss_data`,
  `adjust_tensor_shapes_fn`, `p2p_communicator` are accepted and unused: every message's shape comes from the tree
  (`force_all_reduce` is passed on to finalize_model_grads).
* Pipeline parallelism (megatron's parallel_state with pipeline_model_parallel_size > 1, one model chunk per
  stage: the stage's GPTModel(pre_process=, post_process=)): the step runs on every stage (schedule/pipeline.py,
  replay or packed). The rollouts are read on the FIRST stage only (megatron builds data iterators on the first
  and last stages; elsewhere `data_iterator` may be None) and broadcast over the pipeline group, so every stage
  builds the same prefix tree. As megatron's pipeline schedules do, only the last stage returns the loss dicts
  (the others return []); interleaved (virtual) stages are refused in one line.
* `forward_only=True` runs no backward (the loss and, when kept, logprobs only).
* The returned list has `num_microbatches` dicts {"lm loss": tensor([loss_share, weight])}; the first carries this
  rank's share, the rest zeros, so megatron's reduction (sum, all-reduce over dp x cp, divide) gives the step's
  loss exactly.
* Gradients: as megatron's schedule does, `config.finalize_model_grads_func` is called after backward when set
  (megatron's finalize_model_grads: DDP all-reduce over dp x cp, sequence-parallel norm grads over TP). The whole
  step runs inside `config.no_sync_func` so that DDP reduces once, after the last backward. The objective is
  normalised on the global batch and CP ranks hold disjoint loss terms, so the gradient wanted is the SUM over
  dp x cp; megatron DDP with its default scaling (1 / dp_cp, unless `calculate_per_token_loss`) takes the MEAN,
  so then the backward is scaled by dp_cp to compensate (`ScaledObjective`), and the gradient is the same either way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.assembly import RunSpec, build_engine
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.errors import SettingError, UserError
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.rules import API, GRAD_SCHEDULES, check_pipeline
from megatron_branch.schedule import StepResult, run_schedule

ObjectiveFactory = Callable[[list[Rollout], int], Any]
"""(this rank's rollouts, T = global response tokens) -> an Objective (losses/objective.py)."""


def grpo_objective(rollouts: list[Rollout], num_response_tokens: int) -> PolicyGradientObjective:
    return PolicyGradientObjective.grpo([r.advantage for r in rollouts], num_response_tokens)


@dataclass(frozen=True)
class ScaledObjective:
    """`objective` with every loss term multiplied by `scale` (to undo a gradient reduction that averages)."""

    objective: Any
    scale: float

    def bind(self, tree: PrefixTree) -> Any:
        return _ScaledBound(self.objective.bind(tree), self.scale)


@dataclass(frozen=True)
class _ScaledBound:
    """The bound objective's loss times `scale`; its metric statistics unchanged (they are not gradients)."""

    bound: Any
    scale: float

    @property
    def needs_entropy(self) -> bool:
        return bool(self.bound.needs_entropy)

    @property
    def stat_names(self) -> tuple[str, ...]:
        return tuple(self.bound.stat_names)

    def chunk_loss(
        self, logp: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, stats = self.bound.chunk_loss(logp, targets, entropy)
        return loss * self.scale, stats

    def rollout_loss(
        self, i: int, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, stats = self.bound.rollout_loss(i, logp, entropy)
        return loss * self.scale, stats


def _ddp_mean_factor(model: torch.nn.Module, dp_cp: int) -> float:
    """dp_cp when `model` is megatron DDP scaling grads by 1 / dp_cp (its default), else 1."""
    from megatron.core.distributed import DistributedDataParallel

    if dp_cp == 1 or not isinstance(model, DistributedDataParallel):
        return 1.0
    # megatron's DDP: a plain SUM only with calculate_per_token_loss; otherwise 1 / dp_cp, applied before the sum
    # or by an averaging collective (average_in_collective)
    return 1.0 if model.config.calculate_per_token_loss else float(dp_cp)


def _as_rollouts(item: Any, where: str) -> list[Rollout]:
    if isinstance(item, Rollout):
        return [item]
    if isinstance(item, dict):
        fields = {k: v for k, v in item.items() if k not in ("prompt", "response", "advantage", "loss_mask")}
        try:
            return [
                Rollout(
                    prompt=item["prompt"],
                    response=item["response"],
                    advantage=item.get("advantage", 0.0),
                    token_fields={k: v for k, v in fields.items() if isinstance(v, (list, tuple))},
                    loss_mask=item.get("loss_mask"),
                )
            ]
        except KeyError as e:
            raise UserError(f"rollout batch lacks field {e.args[0]!r}", where=where) from None
    if isinstance(item, (list, tuple)):
        return [r for x in item for r in _as_rollouts(x, where)]
    raise UserError(
        f"expected a rollout batch (Rollout, dict or list), got {type(item).__name__}", where=where
    )


@dataclass(kw_only=True)
class BranchForwardBackward:
    """The callable `get_forward_backward_func()` returns (megatron's keyword signature)."""

    schedule: str = "replay"
    objective: ObjectiveFactory = grpo_objective
    vocab_size: int | None = None
    """Real vocabulary (padded logits excluded); None = the model's (padded) vocab_size, as megatron's loss."""
    options: dict[str, Any] = field(default_factory=dict)
    """Extra ScheduleOptions (branch_micro_batch, recompute, backend, keep_logprobs, ...)."""
    last_result: StepResult | None = None
    """The engine's record of the last step (positions computed, forwards, logprobs when kept)."""

    def __call__(
        self,
        *,
        forward_step_func: Callable[..., Any] | None,
        data_iterator: Iterator[Any] | list[Iterator[Any]],
        model: torch.nn.Module | list[torch.nn.Module],
        num_microbatches: int,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable[..., Any] | None = None,
        p2p_communicator: Any = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> list[dict[str, torch.Tensor]]:
        del forward_step_func, seq_length, micro_batch_size, decoder_seq_length, first_val_step
        del collect_non_loss_data, adjust_tensor_shapes_fn, p2p_communicator
        if isinstance(model, list):
            _check_virtual(len(model))
            model = model[0]
        if isinstance(data_iterator, list):
            _check_virtual(len(data_iterator))
            data_iterator = data_iterator[0]
        if num_microbatches <= 0:
            raise UserError(f"num_microbatches must be positive, got {num_microbatches}")
        base = _unwrap(model)
        pgc = _pg_collection(pg_collection)
        groups = ParallelGroups.from_parallel_state(
            sequence_parallel=bool(base.config.sequence_parallel), pg_collection=pgc, reduces_grads=False
        )  # dp_cp None: gradients are finalised by megatron's finalize_model_grads_func, not by us
        rollouts = self._rollouts(data_iterator, num_microbatches, groups)
        vocab = self.vocab_size or base.vocab_size
        tree = PrefixTree.build(rollouts, vocab_size=vocab)
        T = _global_count(tree.num_trained_tokens_logical(), groups.dp)
        opts = build_engine(RunSpec(), model=base, groups=groups, vocab_size=vocab, **self.options).opts
        objective = self.objective(rollouts, T)
        scale = _ddp_mean_factor(model, groups.dp_size * groups.cp_size)
        if scale != 1.0:
            objective = ScaledObjective(objective, scale)
        config = base.config
        no_sync = config.no_sync_func or contextlib.nullcontext
        with no_sync():
            result = run_schedule(self.schedule, model, tree, objective, opts, forward_only=forward_only)
        if config.finalize_model_grads_func is not None and not forward_only:
            config.finalize_model_grads_func(
                [model], None, pg_collection=pgc, force_all_reduce=force_all_reduce
            )
        result.loss /= scale
        self.last_result = result
        share = 1.0 / (groups.dp_size * groups.cp_size)
        # StepResult.loss is already summed over CP: each CP rank reports loss/cp so that dp x cp sums to the total
        first = torch.tensor([result.loss * share * groups.dp_size, share], dtype=torch.float64)
        zeros = torch.zeros(2, dtype=torch.float64)
        if groups.pp_rank != groups.pp_size - 1:  # megatron: the loss dicts live on the last stage only
            return []
        return [{"lm loss": first}] + [{"lm loss": zeros.clone()} for _ in range(num_microbatches - 1)]

    def _rollouts(self, it: Iterator[Any] | None, n: int, groups: ParallelGroups) -> list[Rollout]:
        """The step's rollouts: read from the iterator (under PP on the first stage, then broadcast: one tree on
        every stage)."""
        if groups.pp_size == 1:
            return self._read(it, n)
        mine: Any = None
        err = None
        if groups.pp_rank == 0:
            try:
                mine = self._read(it, n)
            except UserError as e:
                err = str(e)
        box = [(mine, err)]
        dist.broadcast_object_list(box, src=dist.get_global_rank(groups.pp, 0), group=groups.pp)
        rollouts, err = box[0]
        if err is not None:
            raise UserError(err)
        return rollouts

    @staticmethod
    def _read(it: Iterator[Any] | None, n: int) -> list[Rollout]:
        if it is None:
            raise UserError("data_iterator is None (pass the step's rollouts on the first pipeline stage)")
        out: list[Rollout] = []
        for i in range(n):
            try:
                item = next(it)
            except StopIteration:
                raise UserError(f"data_iterator ran out after {i} of {n} micro-batches") from None
            out += _as_rollouts(item, where=f"micro-batch {i}")
        if not out:
            raise UserError("the step's micro-batches hold no rollouts")
        return out


def _check_virtual(chunks: int) -> None:
    """One model chunk (and data iterator) per stage: more are megatron's interleaved (virtual) stages."""
    try:
        check_pipeline("replay", pp=1, virtual=chunks)
    except SettingError as e:
        raise e.spelled(API) from None


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):
        model = model.module
    return model


def _pg_collection(pg_collection: Any) -> Any:
    """megatron's ProcessGroupCollection: the one given, else parallel_state's, as megatron's own schedule resolves
    the groups."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    return pg_collection if pg_collection is not None else ProcessGroupCollection.use_mpu_process_groups()


def _global_count(n: int, dp_group: Any) -> int:
    if not dist.is_initialized() or dist.get_world_size(dp_group) == 1:
        return n
    from megatron_branch.parallel.groups import comm_device

    t = torch.tensor([n], dtype=torch.long, device=comm_device(dp_group))
    dist.all_reduce(t, group=dp_group)
    return int(t.item())


def get_forward_backward_func(
    pp_size: int | None = None,
    vp_size: int | None = None,
    *,
    schedule: str = "replay",
    objective: ObjectiveFactory = grpo_objective,
    vocab_size: int | None = None,
    **options: Any,
) -> BranchForwardBackward:
    """megatron-core's `get_forward_backward_func(pp_size, vp_size)`, returning the branch-replay step.

    `schedule`: replay | packed | naive; `objective(rollouts, T)` builds the loss; `options` are extra
    ScheduleOptions fields (branch_micro_batch, recompute, backend, ...).
    """
    if schedule not in GRAD_SCHEDULES:
        raise UserError(f"schedule must be replay, packed or naive, got {schedule!r}")
    try:  # the pipeline's rules (rules/): the tree schedules only, no interleaved stages
        check_pipeline(schedule, pp=pp_size or 1, virtual=vp_size)
    except SettingError as e:
        raise e.spelled(API) from None
    return BranchForwardBackward(
        schedule=schedule, objective=objective, vocab_size=vocab_size, options=options
    )


def rollout_batches(rollouts: Iterable[Rollout], per_microbatch: int) -> Iterator[list[Rollout]]:
    """Group rollouts into micro-batches for a data iterator (a convenience for tests and examples)."""
    batch: list[Rollout] = []
    for r in rollouts:
        batch.append(r)
        if len(batch) == per_microbatch:
            yield batch
            batch = []
    if batch:
        yield batch
