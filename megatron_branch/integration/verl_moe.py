"""Mixture-of-experts policies in verl's MegatronEngine with branch replay (verl 0.9.1): the model verl built, made
routable by the tree schedules, and the router options of one verl step.

What verl sets (verl/workers/engine/megatron/transformer_impl.py `_build_tf_config`): EP / ETP from the engine
config (`expert_model_parallel_size`, `expert_tensor_parallel_size`), `moe_token_dispatcher_type="alltoall"`,
`moe_router_load_balancing_type="none"` unless `override_transformer_config` says otherwise (with
`moe_aux_loss_coeff`, `moe_z_loss_coeff`). What verl's own path then computes, per megatron micro-batch (one of
verl's micro-batches, packed THD with batch 1): megatron's router losses over that micro-batch's tokens (every
position fed: prompt and response), times 1/num_microbatches, the DP mean in DDP.

What the switch does (`patch_verl_moe`, at initialize):
* every megatron `TopKRouter` becomes megatron-branch's `BranchRouter` (a subclass with the same parameters and
  state dict; with no context attached it IS megatron's router, so verl's own paths are unchanged);
* the model gets its `ModelArch` (from verl's HF config) for the schedules' router plan (schedule/moe.py);
* under EP across DP replicas, the model's calls pair up between replicas (parallel/lockstep.py): each replica's
  tree has its own shape, megatron's all-to-alls need matching calls.
Per step (`moe_step_options`): the router plan's options with verl's micro-batches as the loss groups
(losses/router.py `MoEOptions.micro_batches`: each micro-batch's aux / seq-aux / z losses, the rows of a shared
token weighted by the rollouts of each micro-batch through it) and megatron's scale 1/num_microbatches (times
the optimizer's loss scale, as megatron's forward_step sets `MoEAuxLossAutoScaler`).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["hand_r2_routes", "is_moe", "moe_step_options", "patch_verl_moe", "r2_record", "r3_routes"]

BALANCING = {"none": None, "aux_loss": "aux_loss_coeff", "seq_aux_loss": "seq_aux_loss_coeff"}
"""verl's / megatron's moe_router_load_balancing_type -> the RouterLossConfig field its coefficient sets (none: no
balancing loss). global_aux_loss and the aux-loss-free expert bias are refused (refusal_reason)."""


def is_moe(tf_config: Any) -> bool:
    return (getattr(tf_config, "num_moe_experts", None) or 0) > 0


def _balancing_types(tf_config: Any) -> list[str]:
    t = tf_config.moe_router_load_balancing_type
    return list(t) if isinstance(t, (list, tuple)) else [t]


def refusal_reason(tf_config: Any) -> str | None:
    """Why branch replay cannot run this MoE model in verl's engine (one line), or None."""
    kinds = _balancing_types(tf_config)
    unknown = [k for k in kinds if k not in BALANCING]
    if unknown:
        return (
            f"moe_router_load_balancing_type={unknown[0]} (supported with the switch: "
            f"{', '.join(BALANCING)}; global_aux_loss's running average over DP is not wired)"
        )
    if tf_config.moe_expert_capacity_factor is not None:
        return (
            "token dropping (moe_expert_capacity_factor): which tokens an expert drops depends on the batch a "
            "shared prefix sits in; use dropless routing"
        )
    if getattr(tf_config, "moe_router_enable_expert_bias", False) and (
        getattr(tf_config, "moe_router_bias_update_rate", 0) or 0
    ):
        return "the aux-loss-free expert bias update (moe_router_bias_update_rate > 0) is not wired"
    if getattr(tf_config, "moe_router_fusion", False):
        return "moe_router_fusion=True (the tree's router plan routes with megatron's unfused top-k)"
    # multi-latent attention with expert parallelism runs: its earlier 6e-5 gap was Adam's first step magnifying
    # fp32 noise, not the switch (docs/verl.md "Multi-latent attention"; test_verl_mla_ep2_switch_equals_verl)
    return None


def patch_verl_moe(base: torch.nn.Module, hf_config: Any) -> None:
    """Make the MoE GPTModel verl built (`base`, unwrapped from DDP) routable by the tree schedules (module doc);
    idempotent; nothing for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megatron_branch.models import ModelArch
    from megatron_branch.models.moe import BranchRouter
    from megatron_branch.parallel import lockstep
    from megatron_branch.parallel.groups import ParallelGroups

    if not is_moe(base.config):
        return
    for m in base.modules():
        if type(m) is TopKRouter:  # same constructor, parameters and state dict; only `routing` differs
            m.__class__ = BranchRouter
    if getattr(base, "arch", None) is None:
        base.arch = ModelArch.from_hf_config(hf_config, where="verl's model config")
    sp = bool(base.config.sequence_parallel)
    groups = ParallelGroups.from_parallel_state(sequence_parallel=sp, reduces_grads=False)
    if groups.ep_spans_dp:
        lockstep.install(base, rows=groups.tp_size if groups.sequence_parallel else 1)


def r3_routes(mode: str, base: Any, micro_batches: list[Any]) -> list[list[torch.Tensor]] | None:
    """verl's router replay (`enable_routing_replay` in the batch) where it replays: per micro-batch, per rollout,
    the recorded experts [n, MoE layers, k] where verl replays them and -1 where it routes natively. R3 (the
    rollout engine's records): verl's own alignment (`align_r3_router_replay_data`) and mask
    (`build_r3_replay_mask`: every row but a sequence's last). R2 (compute_log_prob's records, `r2_record`): every
    row. None without replay (the flag off or router_replay.mode disabled), and in R2's recording pass."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.megatron.router_replay_utils import align_r3_router_replay_data, build_r3_replay_mask

    if not tu.get_non_tensor_data(micro_batches[0], key="enable_routing_replay", default=False):
        return None
    if mode not in ("R2", "R3"):
        return None  # verl's engine replays nothing then either (its forward_step checks the mode)
    if tu.get_non_tensor_data(micro_batches[0], key="record_r2_routes", default=False):
        return None  # R2's recording pass: routed natively, recorded (r2_record)
    moe_layers = list(base.arch.moe_layers)
    out = []
    for mb in micro_batches:
        ids = mb["input_ids"]
        if mode == "R3":
            routes = align_r3_router_replay_data(mb["routed_experts"], ids).unbind()
            masks = build_r3_replay_mask(ids, mb["response_mask"]).unbind()
        else:  # R2: verl replays every row (set_router_replay_data without a mask)
            routes = mb["routed_experts"].unbind()
            masks = [torch.ones(len(r), dtype=torch.bool) for r in routes]
        rows = []
        for rec, mask in zip(routes, masks, strict=True):
            rec = rec.to(device="cpu", dtype=torch.long)
            if rec.shape[1] == base.config.num_layers and rec.shape[1] != len(moe_layers):
                rec = rec[:, moe_layers]  # verl indexes by layer when it records every layer
            rows.append(torch.where(mask.cpu()[:, None, None].bool(), rec, torch.full_like(rec, -1)))
        out.append(rows)
    return out


def r2_record(base: Any, micro_batches: list[Any], num_tokens: int) -> Any:
    """verl's R2 recording pass (compute_log_prob with `record_r2_routes`): the table the tree's scoring forward
    writes each packed token's experts into (losses/router.py RouteRecord), or None."""
    from verl.utils import tensordict_utils as tu

    from megatron_branch.losses.router import RouteRecord

    if not tu.get_non_tensor_data(micro_batches[0], key="record_r2_routes", default=False):
        return None
    shape = (num_tokens, len(base.arch.moe_layers), base.config.moe_router_topk)
    columns = None
    if (
        base.config.pipeline_model_parallel_size > 1
    ):  # this stage's MoE layers (megatron's global layer_number)
        here = {layer.layer_number - 1 for layer in base.decoder.layers}
        columns = tuple(c for c, layer in enumerate(base.arch.moe_layers) if layer in here)
    return RouteRecord(table=torch.full(shape, -1, dtype=torch.long), columns=columns)


def hand_r2_routes(record: Any, slots: Any, into: list[Any], device: Any) -> None:
    """The recorded routes in the form verl's `merge_router_topk_indices` appends per micro-batch to the engine's
    `mini_layer_topk_idx_list` (`into`; a jagged int16 tensor [B, j, MoE layers, k]); verl's
    forward_backward_batch merges them, restores the dynamic-batch order and returns them as `routed_experts`.
    `device`: the model's (the TP reduction's). Under pipeline parallelism a stage hands its own layers' columns
    (RouteRecord.columns), as verl's recording does; verl joins the stages' (pp_gather)."""
    from megatron.core import parallel_state as ps

    table = record.table if record.columns is None else record.table[:, list(record.columns)]
    tp = ps.get_tensor_model_parallel_group()
    if tp.size() > 1:  # under sequence parallel each TP rank routed its own rows
        table = table.to(device)
        torch.distributed.all_reduce(table, op=torch.distributed.ReduceOp.MAX, group=tp)
        table = table.cpu()
    assert not bool((table < 0).any()), "router replay R2: the tree's scoring pass left tokens unrouted"
    tree = slots.tree
    bounds = [*slots.rollout_offset, len(tree.rollouts)]
    for k in range(len(slots.rollout_offset)):
        seqs = [table[tree.rollout_indices(i)].to(torch.int16) for i in range(bounds[k], bounds[k + 1])]
        into.append(torch.nested.as_nested_tensor(seqs, layout=torch.jagged))


def moe_step_options(
    model: torch.nn.Module,
    rollout_offset: list[int],
    num_rollouts: int,
    *,
    routing_replay: bool = False,
    route_record: Any = None,
) -> dict[str, Any]:
    """ScheduleOptions fields of one verl step on a MoE model (empty for a dense one): the router options with
    verl's micro-batches (rollouts [rollout_offset[k], rollout_offset[k+1])) as the loss groups; `routing_replay`:
    the rollouts' records (r3_routes) force their routing."""
    from megatron_branch.losses.router import MoEOptions, RouterLossConfig

    config = model.config
    if not is_moe(config):
        return {}
    coeff: dict[str, float] = {}
    kinds, c = _balancing_types(config), config.moe_aux_loss_coeff
    for i, kind in enumerate(kinds):  # megatron: one coefficient, or one per type (a list)
        if BALANCING[kind] is not None:
            coeff[BALANCING[kind]] = float((c[i] if isinstance(c, (list, tuple)) else c) or 0.0)
    coeff["z_loss_coeff"] = float(config.moe_z_loss_coeff or 0.0)
    n = len(rollout_offset)
    bounds = [*rollout_offset, num_rollouts]
    batches = tuple(tuple(range(bounds[k], bounds[k + 1])) for k in range(n))
    scale = 1.0
    if config.grad_scale_func is not None:  # megatron's forward_step: loss_scale / num_microbatches
        one = torch.ones(1, device=next(model.parameters()).device)
        scale = float(config.grad_scale_func(one).item())
    return {
        "moe": MoEOptions(
            losses=RouterLossConfig(**coeff),
            loss_scale=scale / n,
            micro_batches=batches,
            routing_replay=routing_replay,
            route_record=route_record,
        )
    }
