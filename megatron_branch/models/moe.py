"""Mixture-of-experts layers: megatron-core's MoELayer in the MLP slot, with a router the schedules can steer.

Shape legend (Megatron, sequence first): s rows of this rank (s/tp under sequence parallel), b batch (1), h hidden,
E routed experts, k experts per token (top-k), E/ep experts held by this expert-parallel rank.

    router    [s, b, h] -> logits [s*b, E] -> (probs [s*b, E], routing_map [s*b, E] bool, k True per row)
    dispatch  megatron's all-to-all token dispatcher (moe_token_dispatcher_type="alltoall") over the EP group
    experts   SequentialMLP on CPU (one SwiGLU MLP per local expert), TEGroupedMLP's grouped GEMM on a GPU with
              TransformerEngine; every expert's fc1 is [gate; up] as the dense MLP's
    shared    Qwen2-MoE's shared expert (megatron's SharedExpertMLP) scaled by sigmoid(x . gate_weight); GLM-4.5's
              shared experts ungated
    sigmoid   the DeepSeek-style router (GLM-4.5): sigmoid scores, the correction bias [E] (a frozen parameter,
              float32) in the choice only, group-limited top-k, scaled weights (models/router_settings.py)

Dropless only: megatron's capacity factor drops the tokens over an expert's capacity, and which tokens those are
depends on which other tokens share the micro-batch, so a prefix computed once for many rollouts could keep a
token that some rollout's own batch would drop. The tree schedules refuse it (losses/router.py
`check_dropless`).

`BranchRouter` is megatron's TopKRouter placed through the layer spec (`MoESubmodules.router`). With no context
attached it IS megatron's router (the stock routing, aux losses from megatron's config, which we keep at zero).
With a `RouterContext` attached (losses/routing.py) the context decides: routing replay (forced top-k), the
multiplicity-weighted load-balancing and z losses, routing counts and records. Contexts are attached per forward
by the schedules and the sampler (`attach_router_context`), as BranchContext is to the core attention.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from megatron.core.models.backends import LocalSpecProvider
from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_branch.models.router_settings import router_config_kwargs


class RouterContext(Protocol):
    """What a router asks of the context attached to it (losses/router.py implements it)."""

    def route(self, router: BranchRouter, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [s, b, E] (this rank's rows) -> (probs [s*b, E], routing_map [s*b, E] bool)."""
        ...


class BranchRouter(TopKRouter):
    """megatron's TopKRouter (same constructor, parameters, state dict); routing goes through the attached context.

    Only `routing` is replaced: the gating linear (megatron's router_gating_linear), input jitter and expert bias
    stay megatron's own."""

    context: RouterContext | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.expert_bias is not None:
            # megatron keeps the sigmoid router's correction bias as a buffer that its aux-loss-free balancing
            # updates; here it is a checkpoint tensor RL holds fixed (HF's e_score_correction_bias): a frozen
            # parameter, so that conversion, TP/EP gathering and loading (which walk parameters) carry it. Same
            # name, dtype (float32) and state-dict key as megatron's buffer.
            bias = self._buffers.pop("expert_bias")
            self.expert_bias = torch.nn.Parameter(bias, requires_grad=False)

    def routing(self, logits: torch.Tensor, padding_mask: torch.Tensor | None = None) -> Any:
        if self.context is None:
            return super().routing(logits, padding_mask=padding_mask)
        assert padding_mask is None, "a routed chunk marks its padding rows itself (RouterContext)"
        return self.context.route(self, logits)


class PlainRouting:
    """megatron's top-k routing of a router's config without any loss attached: what a lockstep dummy forward
    routes with (parallel/lockstep.py), whatever router losses the model's own config sets (verl's engine sets
    megatron's aux and z losses there; a dummy's one token must add nothing to the gradient)."""

    def route(self, router: BranchRouter, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

        cfg = router.config
        return topk_routing_with_score_function(
            logits.view(-1, cfg.num_moe_experts),
            router.topk,
            use_pre_softmax=cfg.moe_router_pre_softmax,
            num_groups=cfg.moe_router_num_groups,
            group_topk=cfg.moe_router_group_topk,
            scaling_factor=cfg.moe_router_topk_scaling_factor,
            score_function=router.score_function,
            expert_bias=router.expert_bias,
            fused=False,
        )


def uses_grouped_gemm() -> bool:
    """Grouped GEMM experts (TransformerEngine's TEGroupedMLP) where they run: a GPU with TE installed."""
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


def moe_config_kwargs(arch: Any) -> dict[str, Any]:
    # `arch`: a models/arch.ModelArch (not imported: arch.py calls this, one direction)
    """TransformerConfig fields of `arch`'s MoE layers. megatron's own aux and z losses stay off (coefficient 0,
    z None): the router losses are computed by the attached context, weighted by multiplicity."""
    pattern = arch.moe_layer_pattern
    return dict(
        num_moe_experts=arch.num_experts,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        # an int keeps megatron's stacked (homogeneous) checkpoint keys; a list names every layer by its index
        moe_layer_freq=1 if pattern is None else list(pattern),
        **router_config_kwargs(arch),
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_z_loss_coeff=None,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=uses_grouped_gemm(),
        moe_shared_expert_intermediate_size=arch.shared_expert_ffn_hidden_size or None,
        moe_shared_expert_gate=arch.shared_expert_gate,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


class ExpertFc2(RowParallelLinear):
    """megatron's RowParallelLinear as a routed expert's fc2 (SequentialMLP's local MLPs). With a bias (gpt-oss)
    megatron's MLP.forward adds `output_bias * probs` INTO the output in place (transformer/mlp.py), but on a
    one-rank expert-TP group the output IS the reduce's input returned by an autograd Function, a view autograd
    forbids modifying ("Output 0 of _ReduceFromModelParallelRegion is a view"): the output is returned as a fresh
    tensor then (one [tokens, h] copy per expert; without a bias nothing changes)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out, bias = super().forward(*args, **kwargs)
        return (out if bias is None else out.clone()), bias


def moe_layer_spec(dense_layer_spec: ModuleSpec) -> ModuleSpec:
    """`dense_layer_spec` (the model's attention layer: same norms, attention and layer class) with megatron's
    MoELayer in the MLP slot, its router a `BranchRouter`."""
    spec = copy.deepcopy(dense_layer_spec)
    if uses_grouped_gemm():
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        backend: Any = TESpecProvider()
    else:
        backend = LocalSpecProvider()
    mlp = get_moe_module_spec_for_backend(
        backend=backend, num_experts=1, moe_grouped_gemm=uses_grouped_gemm()
    )
    mlp.submodules.router = BranchRouter
    if not uses_grouped_gemm():  # SequentialMLP: megatron's local MLP per expert
        mlp.submodules.experts.submodules.linear_fc2 = ExpertFc2
    spec.submodules.mlp = mlp
    # megatron's TE MoE spec keeps the pre-MLP norm apart (nothing to fuse it into): its checkpoint name is
    # `pre_mlp_layernorm.weight`, so only the attention norm is renamed (the local spec would rename both)
    spec.submodules.sharded_state_dict_keys_map = {
        k: v for k, v in spec.submodules.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."
    }
    return spec


DISPATCHER_STATE = ("probs", "routing_map", "reversed_local_input_permutation_mapping", "tokens_per_expert")
"""What megatron's all-to-all dispatcher keeps of its last forward as attributes (dispatch_preprocess), until its
next forward: tensors of a graph that has been back-propagated already."""


def release_dispatcher_state(model: torch.nn.Module) -> None:
    """Drop the dispatchers' references to the last forward's routing (after a schedule call: nothing reads them
    any more, and the activation meter would count them as held)."""
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

    for m in model.modules():
        dispatcher = getattr(m, "token_dispatcher", None)
        if isinstance(dispatcher, MoETokenDispatcher):
            for name in DISPATCHER_STATE:
                if getattr(dispatcher, name, None) is not None:
                    setattr(dispatcher, name, None)


def branch_routers(model: torch.nn.Module) -> list[BranchRouter]:
    """The model's routers in layer order."""
    return [m for m in model.modules() if isinstance(m, BranchRouter)]


@contextmanager
def attach_router_context(model: torch.nn.Module, ctx: RouterContext | None) -> Iterator[None]:
    """Attach `ctx` to every BranchRouter of `model` for one forward (no-op for a dense model or ctx None)."""
    routers = branch_routers(model) if ctx is not None else []
    held = [r.context for r in routers]
    for r in routers:
        r.context = ctx
    try:
        yield
    finally:
        for r, h in zip(routers, held, strict=True):
            r.context = h


@contextmanager
def attached_to_layer(layer: torch.nn.Module, ctx: RouterContext | None) -> Iterator[None]:
    """`ctx` attached to the router of one transformer layer (a checkpointed layer's recomputation in backward,
    after the schedule's attach_router_context has exited), then whatever was attached before."""
    router = getattr(getattr(layer, "mlp", None), "router", None)
    if not isinstance(router, BranchRouter) or ctx is None:
        yield
        return
    held, router.context = router.context, ctx
    try:
        yield
    finally:
        router.context = held


def layer_router_context(layer: torch.nn.Module) -> RouterContext | None:
    router = getattr(getattr(layer, "mlp", None), "router", None)
    return router.context if isinstance(router, BranchRouter) else None
