"""Branch replay's step inside verl's MegatronEngine (verl 0.9.1): what megatron's `get_forward_backward_func()`
returns, for the duration of one `forward_backward_batch` call, in the engine verl.py registers.

verl's own method runs (global token count, `prepare_micro_batches` with dynamic batch size,
`postprocess_batch_func`, routing of outputs); `VerlTreeStep` replaces megatron's schedule: all the step's
micro-batches form ONE prefix tree (prompts and shared response beginnings computed once). Two paths for the
update (`tree/update_passes` says which ran; one log line per engine says why):

* one pass (verl_onepass.py) where verl's loss is a per-token function given the batch's global normalisers
  (`two_pass_reason` is None): verl's loss runs inside the tree's training pass on the live logprobs;
* two passes otherwise: a forward-only pass scores every response token (logprob, entropy); verl's
  `postprocess_micro_batch_func` (hence verl's loss, e.g. `ppo_loss`) runs per micro-batch on those values, held as
  autograd leaves; its gradient per token is back-propagated through the tree in one gradient pass with the
  linear objective of verl_batch.py. Exact for any verl loss of the per-token logprobs and entropies.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.integration import verl_auto
from megatron_branch.integration.verl_batch import LinearSlotObjective, TreeSlots
from megatron_branch.integration.verl_cp import scale_micro_batch_loss
from megatron_branch.integration.verl_model import temperature_scaled, unwrap
from megatron_branch.integration.verl_onepass import one_pass_objective, two_pass_reason, verl_model_output

logger = logging.getLogger(__name__)

STEP_METRICS = (
    "tree/positions_logical",
    "tree/positions_computed",
    "tree/token_ratio",
    "tree/prompts_split_over_dp",
    "tree/update_passes",
)
"""Our metrics, added to verl's (the actor's become `actor/tree/...` in verl's trainer)."""


@dataclass(kw_only=True)
class BranchOptions:
    """How the tree step runs inside verl."""

    schedule: str = "auto"
    """auto (packed when it fits and the tree is one chunk, else replay: verl_auto.py) | replay (DFS) | packed (one
    pass) | naive."""
    memory_budget_gb: float | None = None
    """auto's budget for packed's planned activation peak (GB); None: the free device memory at each call."""
    schedule_options: dict[str, Any] = field(default_factory=dict)
    """Extra ScheduleOptions fields (branch_micro_batch, recompute, recompute_layers, backend, ...)."""
    one_pass: bool = True
    """The update in one tree pass where verl's loss is per-token (verl_onepass.py); False: always two passes
    (a forward-only pass fixes dL/dlogp, then the gradient pass)."""

    def __post_init__(self) -> None:
        if self.schedule not in ("auto", "replay", "packed", "naive"):
            raise ValueError(f"schedule must be auto, replay, packed or naive, got {self.schedule!r}")
        if self.memory_budget_gb is not None and self.memory_budget_gb <= 0:
            raise ValueError(f"memory_budget_gb must be positive, got {self.memory_budget_gb}")


class VerlBranchError(ValueError):
    """A verl setting branch replay does not support (one line, raised before any work)."""


def _refuse_batch(data: Any) -> None:
    from verl.utils import tensordict_utils as tu

    for key in (
        "distillation_use_topk",
        "distillation_only",
        "calculate_sum_pi_squared",
    ):
        if tu.get_non_tensor_data(data, key=key, default=False):
            raise VerlBranchError(f"branch replay in verl's engine does not support {key}=True")
    if "multi_modal_inputs" in data.keys():
        raise VerlBranchError("branch replay in verl's engine supports text-only models")


def _uniform_temperature(micro_batches: list[Any]) -> float:
    """The one sampling temperature of the step (verl divides the logits by it before logprob and entropy)."""
    values = []
    for mb in micro_batches:
        t = mb["temperature"]
        values += torch.as_tensor(t.values() if getattr(t, "is_nested", False) else t).flatten().tolist()
    if not values or any(v != values[0] for v in values):
        raise VerlBranchError("branch replay needs one temperature per step (got several)")
    return max(float(values[0]), 1e-8)


@dataclass(kw_only=True)
class VerlTreeStep:
    """What `get_forward_backward_func()` returns inside our engine's `forward_backward_batch` (megatron's
    keyword signature). `forward_step_func` is verl's `partial(self.forward_step, ...,
    postprocess_micro_batch_func=...)`: the model forward is ours, the post-processing (loss, metrics, outputs)
    is verl's."""

    engine: Any
    options: BranchOptions
    num_tokens: torch.Tensor | None = None
    """The step's token count under calculate_per_token_loss (verl's 3-tuple losses), for finalize_model_grads."""
    auto: Any = None
    """schedule auto: this call's pick (plan/auto.py AutoChoice), else None."""

    @property
    def schedule(self) -> str:  # the schedule this call runs: the options', or auto's pick
        return self.auto.schedule if self.auto is not None else self.options.schedule

    def __call__(
        self,
        *,
        forward_step_func: Callable[..., Any],
        data_iterator: Iterator[Any] | list[Iterator[Any]],
        model: list[torch.nn.Module],
        num_microbatches: int,
        forward_only: bool = False,
        **_: Any,
    ) -> list[dict[str, Any]]:
        from megatron_branch.integration.verl_moe import (
            hand_r2_routes,
            moe_step_options,
            r2_record,
            r3_routes,
        )
        from megatron_branch.parallel import lockstep
        from megatron_branch.schedule import run_schedule, score_rollouts

        assert not isinstance(data_iterator, list) and len(model) == 1, "one model chunk per stage (no VPP)"
        postprocess = forward_step_func.keywords["postprocess_micro_batch_func"]
        model_chunk = model[0]
        device = next(model_chunk.parameters()).device
        micro_batches = [next(data_iterator).to(device) for _ in range(num_microbatches)]
        for mb in micro_batches:
            _refuse_batch(mb)
        opts = self._schedule_options(model_chunk)
        base, mode = unwrap(model_chunk), self.engine.engine_config.router_replay.mode
        routes = r3_routes(mode, base, micro_batches)  # verl's router replay (replaying), or None
        slots = TreeSlots.build(micro_batches, vocab_size=opts.vocab_size, routes=routes)
        record = r2_record(base, micro_batches, slots.tree.num_tokens)  # R2's recording pass, or None
        moe = moe_step_options(
            base,
            slots.rollout_offset,
            len(slots.tree.rollouts),
            routing_replay=routes is not None,
            route_record=record,
        )
        opts = dataclasses.replace(opts, **moe)
        self.auto = verl_auto.pick(self.engine, base, slots.tree, opts, self.options)  # None unless auto
        value = self.value_model
        want_entropy = not value and _wants_entropy(micro_batches)
        temperature = 1.0 if value else _uniform_temperature(micro_batches)  # verl's value forward reads none
        two_pass = None if forward_only else self._two_pass_reason(postprocess, opts)
        with temperature_scaled(model_chunk, temperature):
            if not forward_only and two_pass is None and record is None:  # R2 records in forward-only passes
                outputs = self._one_pass(
                    model_chunk, postprocess, micro_batches, slots, opts, want_entropy, run_schedule
                )
                return self._finish(outputs, slots, passes=1)
            with lockstep.region(model_chunk):  # EP across DP replicas: their model calls pair up
                scores = score_rollouts(self.schedule, model_chunk, slots.tree, opts, entropy=want_entropy)
            if record is not None:
                hand_r2_routes(record, slots, self.engine.mini_layer_topk_idx_list, device)
            logp_tok = scores.result.target_logprobs  # [P] float64 (NaN outside responses)
            ent_tok = scores.result.target_entropy if want_entropy else None
            outputs, G, H = self._verl_postprocess(
                postprocess, micro_batches, slots, logp_tok, ent_tok, device, forward_only, opts.cp_size
            )
            if not forward_only:
                linear = LinearSlotObjective(G=G, H=H if H is not None and bool(H.any()) else None)
                self._gradient_pass(model_chunk, slots, linear, opts, run_schedule)
        return self._finish(outputs, slots, passes=None if forward_only else 2)

    def _finish(
        self, outputs: list[dict[str, Any]], slots: TreeSlots, passes: int | None
    ) -> list[dict[str, Any]]:
        """The DP split check and our metrics on verl's outputs; none before the last pipeline stage (where
        megatron's pipeline schedules return none: verl reads them on the last stage)."""
        from megatron.core import parallel_state as ps

        split = _prompts_split_over_dp(slots)
        if split and not getattr(self.engine, "_branch_split_warned", False):
            self.engine._branch_split_warned = True  # once per engine
            logger.warning(
                "megatron-branch: %d prompt group(s) are split over DP ranks (less sharing, still exact); keep "
                "data.train_batch_size and actor.ppo_mini_batch_size multiples of the DP size, actor.shuffle=False",
                split,
            )
        if not ps.is_pipeline_last_stage(ignore_virtual=True):
            return []
        self._add_metrics(outputs, slots, split)
        if passes is not None and outputs:
            outputs[0]["metrics"]["tree/update_passes"] = float(passes)
        return outputs

    def _two_pass_reason(self, postprocess: Callable[..., Any], opts: Any) -> str | None:
        """None: the update runs in one tree pass (verl_onepass.py); else why it keeps two (logged once)."""
        if not self.options.one_pass:
            reason: str | None = "BranchOptions(one_pass=False)"
        elif opts.cp_size > 1 or unwrap(self.engine.module[0]).config.calculate_per_token_loss:
            # the one-pass objective is not wired to CP chunks (each rank's rows) nor to megatron's per-token regime
            reason = (
                "context parallelism / calculate_per_token_loss (the one-pass objective is not wired to them)"
            )
        else:
            reason = two_pass_reason(postprocess, self.schedule)
        if getattr(self.engine, "_branch_passes_logged", False) != (reason or True):
            self.engine._branch_passes_logged = reason or True  # once per engine and path
            if reason is None:
                logger.warning("megatron-branch: verl's update runs in one tree pass (per-token loss)")
            else:
                logger.warning("megatron-branch: verl's update runs in two tree passes: %s", reason)
        return reason

    @property
    def value_model(self) -> bool:
        """verl's value model (the critic): values per response token where the policy has logprobs."""
        return bool(getattr(self.engine, "is_value_model", False))

    # -- pieces ------------------------------------------------------------------------------------------------

    def _schedule_options(self, model_chunk: torch.nn.Module) -> Any:
        """The step's ScheduleOptions through the run assembly: megatron's groups as verl's engine laid them out
        (every axis, pp and ep included; dp_cp None: gradients are finalised by megatron's
        finalize_model_grads_func, as verl's path does)."""
        from megatron_branch.assembly import RunSpec, build_engine
        from megatron_branch.parallel.groups import ParallelGroups

        base = unwrap(model_chunk)
        groups = ParallelGroups.from_parallel_state(
            sequence_parallel=bool(base.config.sequence_parallel), reduces_grads=False
        )
        # the model's (padded) vocabulary: verl's vocab_parallel_log_probs_from_logits normalises over all of it
        extra = self.options.schedule_options
        return build_engine(RunSpec(), model=base, groups=groups, vocab_size=base.vocab_size, **extra).opts

    def _one_pass(
        self,
        model_chunk: torch.nn.Module,
        postprocess: Callable[..., Any],
        micro_batches: list[Any],
        slots: TreeSlots,
        opts: Any,
        entropy: bool,
        run_schedule: Callable[..., Any],
    ) -> list[dict[str, Any]]:
        """The update in one tree pass with verl's loss inside (verl_onepass.py), then verl's post-processing on
        the pass's own values for verl's outputs and metrics (no model work)."""
        objective = one_pass_objective(
            model_chunk,
            unwrap(model_chunk).config,
            postprocess,
            micro_batches,
            slots,
            entropy=entropy,
            value_model=self.value_model,
        )
        opts = dataclasses.replace(opts, keep_logprobs=True, keep_entropy=entropy)
        res = self._gradient_pass(model_chunk, slots, objective, opts, run_schedule)
        device = next(model_chunk.parameters()).device
        ent_tok = res.target_entropy if entropy else None
        outputs, _, _ = self._verl_postprocess(
            postprocess, micro_batches, slots, res.target_logprobs, ent_tok, device, forward_only=True
        )
        return outputs

    def _verl_postprocess(
        self,
        postprocess: Callable[..., Any],
        micro_batches: list[Any],
        slots: TreeSlots,
        logp_tok: torch.Tensor,
        ent_tok: torch.Tensor | None,
        device: torch.device,
        forward_only: bool,
        cp_size: int = 1,
    ) -> tuple[list[dict[str, Any]], torch.Tensor, torch.Tensor | None]:
        """verl's post-processing of each micro-batch on the tree's values; returns megatron's
        `forward_data_store` and the tree's per-token weights (dJ/dlogp, dJ/dentropy) of the loss megatron would
        back-propagate: sum over micro-batches of loss_mb / num_microbatches, times `grad_scale_func`."""
        P = slots.tree.num_tokens
        G = torch.zeros(P, dtype=torch.float64)
        H = torch.zeros(P, dtype=torch.float64) if ent_tok is not None else None
        n = len(micro_batches)
        config = unwrap(self.engine.module[0]).config
        outputs = []
        for k, mb in enumerate(micro_batches):
            lp = slots.nested(k, logp_tok, dtype=torch.float32, device=device).requires_grad_(
                not forward_only
            )
            ent = None
            if ent_tok is not None:
                ent = slots.nested(k, ent_tok, dtype=torch.float32, device=device)
                ent.requires_grad_(not forward_only)
            model_output = verl_model_output(slots, k, lp, ent, value_model=self.value_model)
            with torch.enable_grad():
                result = postprocess(model_output, data=mb)
            loss, out, tokens = scale_micro_batch_loss(
                result, num_microbatches=n, cp_size=cp_size, per_token_loss=config.calculate_per_token_loss
            )
            outputs.append(out)
            if tokens is not None:
                self.num_tokens = tokens if self.num_tokens is None else self.num_tokens + tokens
            if forward_only:
                continue
            if config.grad_scale_func is not None:
                loss = config.grad_scale_func(loss)
            leaves = [lp] + ([ent] if ent is not None else [])
            grads = torch.autograd.grad(loss, leaves, allow_unused=True)
            if grads[0] is not None:
                slots.tree_weights(k, grads[0], G)
            if H is not None and grads[1] is not None:
                slots.tree_weights(k, grads[1], H)
        return outputs, G, H

    def _gradient_pass(
        self,
        model_chunk: torch.nn.Module,
        slots: TreeSlots,
        objective: Any,
        opts: Any,
        run_schedule: Callable[..., Any],
    ) -> Any:
        """One training pass of the tree with `objective` (two-pass: J = sum G logp + H entropy; one pass: verl's
        loss itself, verl_onepass.py); then megatron's finalize_model_grads, exactly where megatron's schedule
        calls it (DDP reduction over dp, SP norm grads over TP). Returns the schedule's StepResult."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_branch.parallel import lockstep

        config = unwrap(model_chunk).config
        no_sync = config.no_sync_func or contextlib.nullcontext
        with no_sync(), lockstep.region(model_chunk):  # EP across DP replicas: calls pair up
            result = run_schedule(self.schedule, model_chunk, slots.tree, objective, opts)
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(
                [model_chunk],
                self.num_tokens if config.calculate_per_token_loss else None,
                pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
            )
        return result

    def _add_metrics(self, outputs: list[dict[str, Any]], slots: TreeSlots, split: int) -> None:
        """positions logical / computed of this rank's tree and the prompts shared with another DP rank, on the
        first micro-batch's metrics (verl gathers them over DP; the trainer reports their mean)."""
        if not outputs:
            return
        tree = slots.tree
        metrics = outputs[0].setdefault("metrics", {})
        metrics["tree/positions_logical"] = float(tree.positions_logical)
        metrics["tree/positions_computed"] = float(tree.positions_computed)
        metrics["tree/token_ratio"] = tree.positions_logical / tree.positions_computed
        metrics["tree/prompts_split_over_dp"] = float(split)
        metrics.update(verl_auto.metrics(self.auto))


def _prompts_split_over_dp(slots: TreeSlots) -> int:
    """How many of this rank's prompts (tree roots' first tokens and lengths) another DP rank also holds: the
    check of the rule that keeps GRPO groups whole on one rank (docs/verl.md). Exactness does not depend on it;
    sharing does."""
    from megatron.core import parallel_state as ps

    if not dist.is_initialized() or ps.get_data_parallel_world_size() == 1:
        return 0
    mine = {hash(tuple(r.prompt)) for r in slots.tree.rollouts}
    every: list[Any] = [None] * ps.get_data_parallel_world_size()
    dist.all_gather_object(every, mine, group=ps.get_data_parallel_group())
    me = ps.get_data_parallel_rank()
    others = set().union(*(s for i, s in enumerate(every) if i != me))
    return len(mine & others)


def _wants_entropy(micro_batches: list[Any]) -> bool:
    from verl.utils import tensordict_utils as tu

    return bool(tu.get_non_tensor_data(micro_batches[0], key="calculate_entropy", default=False))
