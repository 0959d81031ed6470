"""A MoE forward's routing under a RouterPlan (losses/router_plan.py): `RowContext` routes one forward's rows
through megatron's top-k (recorded routes forced by `ForcedTopK`, megatron's RouterReplay), counts their top-k maps
and attaches the multiplicity-weighted losses; `RoutingRecorder` keeps the experts megatron's router picks (the
sampler, for routing replay).

Shape legend: n rows of one router call on this rank (s/tp under sequence parallel), E routed experts, k top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from megatron_branch.models.moe import BranchRouter


class ForcedTopK:
    """megatron's RouterReplay REPLAY_FORWARD for the rows with a recorded choice: top-k indices = the record,
    probabilities = the current scores gathered there (router_replay.py); rows without one (-1) keep the computed
    top-k. Passed as `router_replay` to megatron's topk_routing_with_score_function."""

    def __init__(self, forced: torch.Tensor) -> None:
        self.forced = forced  # [n, k] long, -1 rows: no record

    def get_replay_topk(
        self,
        scores: torch.Tensor,
        topk: int,
        num_groups: int | None = None,
        group_topk: int | None = None,
        default_compute_topk: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _, computed = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        forced = self.forced.to(computed.device)
        idx = torch.where((forced >= 0).all(dim=-1, keepdim=True), forced, computed)
        return scores.gather(1, idx), idx


class RowContext:
    """The rows of one forward and their router work (the RouterContext models/moe.py attaches)."""

    # `plan` is a losses/router_plan.RouterPlan (not imported: router_plan builds RowContexts, one direction)
    def __init__(self, plan: Any, packed: torch.Tensor, groups: torch.Tensor) -> None:
        self.plan, self.packed, self.groups = plan, packed, groups  # [s] each; -1 = padding
        self.recompute = False

    def for_recompute(self) -> RowContext:
        """The context a checkpointed layer's recomputation routes with: the same rows and forced routes, the same
        losses re-attached (the recomputed graph must match the first one), nothing counted or recorded again."""
        ctx = RowContext(self.plan, self.packed, self.groups)
        ctx.recompute = True
        return ctx

    def _local(self, router: BranchRouter, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed [n], groups [n]) of this rank's rows: under sequence parallel, its contiguous slice."""
        if n == self.packed.numel():
            return self.packed, self.groups
        tp = router.tp_group.size()
        assert n * tp == self.packed.numel() and router.config.sequence_parallel, (n, self.packed.numel())
        lo = router.tp_group.rank() * n
        return self.packed[lo : lo + n], self.groups[lo : lo + n]

    def route(self, router: BranchRouter, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.transformer.moe.moe_utils import (
            MoEAuxLossAutoScaler,
            compute_routing_scores_for_aux_loss,
            topk_routing_with_score_function,
        )

        plan, cfg = self.plan, router.config
        E = cfg.num_moe_experts
        logits = logits.view(-1, E)  # [n, E]
        packed, groups = self._local(router, logits.shape[0])
        dev = logits.device
        packed, groups = packed.to(dev), groups.to(dev)
        layer = router.layer_number - 1  # 0-based model layer
        plan.tp_cp_group = router.tp_cp_group
        real = groups >= 0
        w = torch.where(real, plan.weight.to(dev)[groups.clamp(min=0)], torch.zeros((), dtype=torch.float64))
        train = router.training and torch.is_grad_enabled() and not plan.counting
        record = not self.recompute
        if (
            train and plan.cfg.z_loss_coeff > 0
        ):  # megatron: on the logits, before the top-k (router.apply_z_loss)
            logits = MoEAuxLossAutoScaler.apply(logits, plan.z_loss(layer, logits, groups, record=record))
        replay = None
        if plan.routes is not None:
            li = plan.moe_layers.index(layer)
            rec = plan.routes.to(dev)[packed.clamp(min=0), li]  # [n, k]
            replay = ForcedTopK(torch.where(real[:, None], rec, torch.full_like(rec, -1)))
        probs, routing_map = topk_routing_with_score_function(
            logits,
            router.topk,
            use_pre_softmax=cfg.moe_router_pre_softmax,
            num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=router.score_function,
            expert_bias=router.expert_bias,
            fused=False,
            router_replay=replay,
        )
        if plan.opts.route_record is not None and record and not plan.counting:  # verl's R2 RECORD
            li = plan.moe_layers.index(layer)
            ids = routing_map[real].nonzero()[:, 1].view(-1, router.topk)  # [n_real, k] ascending
            plan.opts.route_record.table[packed[real].cpu(), li] = ids.cpu()
        if (
            cfg.moe_expert_capacity_factor is not None
        ):  # naive only (check_dropless): megatron's token dropping
            from megatron.core.transformer.moe.moe_utils import apply_router_token_dropping

            probs, routing_map = apply_router_token_dropping(
                probs,
                routing_map,
                router_topk=router.topk,
                capacity_factor=cfg.moe_expert_capacity_factor,
                drop_policy=cfg.moe_token_drop_policy,
                pad_to_capacity=cfg.moe_pad_expert_input_to_capacity,
            )
        if plan.needs_counts and (plan.counting or train):
            aux_map, scores = compute_routing_scores_for_aux_loss(logits, router.topk, router.score_function)
            if record:
                table = plan.counts if plan.counting else plan.seen
                c = torch.zeros(len(plan.weight), E, dtype=torch.float64, device=dev)
                c.index_add_(0, groups[real], aux_map[real].to(torch.float64))
                table[layer] = table[layer] + c if layer in table else c
            if train:
                loss = plan.balancing_loss(layer, scores, groups, w, record=record)
                probs = MoEAuxLossAutoScaler.apply(probs, loss)
        if train and record:  # the forward whose graph is back-propagated (replay's recompute: the second)
            routed = routing_map[real].to(torch.float64)  # [n_real, E]
            add = torch.stack([routed.sum(dim=0), (routed * w[real, None]).sum(dim=0)])  # [2, E]
            plan.tokens[layer] = plan.tokens[layer] + add if layer in plan.tokens else add
        return probs, routing_map


class RoutingRecorder:
    """Records the experts megatron's router picks for every row of a forward (the sampler, routing replay): the
    routing is megatron's own (the stock TopKRouter.routing), each router keeps its rows' top-k map."""

    def __init__(self) -> None:
        self.maps: dict[int, torch.Tensor] = {}  # 0-based layer -> [n, E] bool (this rank's rows)
        self.tp_group: Any = None

    def route(self, router: BranchRouter, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.transformer.moe.router import TopKRouter

        probs, routing_map = TopKRouter.routing(router, logits)
        self.maps[router.layer_number - 1] = routing_map.detach()
        if router.config.sequence_parallel:
            self.tp_group = router.tp_group
        return probs, routing_map

    def experts(self, layers: Sequence[int], top_k: int) -> torch.Tensor:
        """[s, len(layers), k] int32: each row's experts per MoE layer (ascending), rows gathered over TP under
        sequence parallel (a collective over the TP group then)."""
        out = []
        for layer in layers:
            m = self.maps[layer]  # [n, E]
            if self.tp_group is not None and self.tp_group.size() > 1:
                from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

                m = gather_from_sequence_parallel_region(m.to(torch.uint8), group=self.tp_group).bool()
            ids = m.nonzero()[:, 1].view(m.shape[0], top_k)  # row-major: each row's experts ascending
            out.append(ids)
        return torch.stack(out, dim=1).to(torch.int32).cpu()
