"""The model-side patch of a GPTModel verl has already built (by mbridge / Megatron-Bridge, any layer spec).

verl builds its model itself, so the layer spec cannot be patched before construction (integration/spec.py does
that for scripts that build their own). After construction, two things change, both reversible in effect:

* every layer's `self_attention.core_attention` (TEDotProductAttention on a GPU, or any other) is wrapped in
  `BranchFallbackAttention`: with a BranchContext attached (our schedules) it attends over the tree; without one it
  calls the ORIGINAL module with every argument, packed_seq_params included, so verl's own forward paths run as
  before. Core attention holds no parameters in megatron-core's specs, so the parameter names, the optimizer and
  checkpoints are untouched (tests/unit/test_verl_engine.py checks the names);
* RoPE follows explicit position ids (`enable_position_rope`); without position ids it is megatron's table;
* every plain `TransformerLayer` becomes `BranchTransformerLayer` (models/layer_checkpoint.py: the same class with
  a forward that checkpoints itself only when the attached context asks, `recompute_layers`; otherwise megatron's
  forward), so the planner's `recompute full` runs in verl's engine too;
* a hybrid's linear-attention layers (megatron's `GatedDeltaNet`, which the bridges build for Qwen3.5 / Qwen3.6 /
  Qwen3-Next with `experimental_attention_variant="gated_delta_net"`) become `BranchGatedDeltaNet` (models/gdn.py:
  the same class, parameters and state dict; megatron's forward when no context is attached, else each tree
  segment starts from its parent's recurrent state and conv inputs, handed down through the `StateKind` seam).
  Its `in_proj` is whatever the bridge built (TE's fused norm + linear on a GPU, the local norm + linear here).

Beside the patch, the two model-side helpers verl_step.py uses: `unwrap` (the GPTModel inside the wrappers) and
`temperature_scaled` (verl's logits temperature as a hook on the output layer).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from megatron.core.ssm.gated_delta_net import GatedDeltaNet
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_branch.attention.core_attention import BranchCoreAttention
from megatron_branch.models.gdn import BranchGatedDeltaNet
from megatron_branch.models.layer_checkpoint import BranchTransformerLayer
from megatron_branch.models.rotary import enable_position_rope


class BranchFallbackAttention(BranchCoreAttention):
    """BranchCoreAttention around an existing core attention `stock` (TEDotProductAttention on a GPU, or any
    other): its softmax scale, and `stock` itself, every argument forwarded, when no context is attached."""

    def __init__(self, stock: torch.nn.Module, layer_number: int) -> None:
        super().__init__(
            stock.config,
            layer_number,
            None,  # the mask type and attention type are stock's business: the context's layout decides
            "self",
            softmax_scale=getattr(stock, "softmax_scale", None),
            stock=stock,
        )


def patch_verl_model(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap every core attention of the GPTModel `model` (unwrapped from DDP/Float16Module), make its gated delta
    nets branch-aware and enable position RoPE; idempotent. Refuses, in one line and before changing anything, a
    model it cannot patch: one without a RoPE table (`rotary_pos_emb`; under multi-latent attention each layer's
    own), without self-attention layers, or with a layer whose token mixer is neither attention with a core
    attention slot nor megatron's GatedDeltaNet."""
    layers = [m for m in model.modules() if hasattr(m, "self_attention")]
    if not layers:
        raise ValueError("this model has no self-attention layers to patch for branch replay")
    for layer in layers:
        if not hasattr(layer.self_attention, "core_attention") and not _is_gated_delta_net(
            layer.self_attention
        ):
            raise ValueError(
                f"layer {getattr(layer, 'layer_number', '?')}: {type(layer.self_attention).__name__} has no core "
                "attention for branch replay to wrap (verl's engine runs softmax attention and megatron's GatedDeltaNet)"
            )
    mla = bool(getattr(model.config, "multi_latent_attention", False))  # each MLA layer holds its own RoPE
    if getattr(model, "position_embedding_type", None) != "rope" or not (
        mla or hasattr(model, "rotary_pos_emb")
    ):
        raise ValueError(
            "branch replay needs the model's own RoPE table (position_embedding_type='rope', rotary_pos_emb) to "
            "follow the tree's position ids"
        )
    for layer in layers:
        attn = layer.self_attention
        if _is_gated_delta_net(attn):
            _branch_gated_delta_net(attn)
        elif not isinstance(attn.core_attention, BranchCoreAttention):
            core = attn.core_attention
            attn.core_attention = BranchFallbackAttention(core, getattr(layer, "layer_number", 1))
        if type(layer) is TransformerLayer:  # same constructor, parameters and forward (module doc)
            layer.__class__ = BranchTransformerLayer
    enable_position_rope(model)
    return model


def _is_gated_delta_net(module: torch.nn.Module) -> bool:
    """megatron's own GatedDeltaNet (what megatron's and the bridges' specs build) or ours: a subclass from
    elsewhere may change the forward the class swap would drop, so it is not taken for one."""
    return type(module) is GatedDeltaNet or isinstance(module, BranchGatedDeltaNet)


def _branch_gated_delta_net(gdn: GatedDeltaNet) -> None:
    """megatron's GatedDeltaNet as built by verl's bridge -> BranchGatedDeltaNet in place (a subclass adding no
    parameter: the optimizer, DDP buffers and checkpoints keep their tensors; only the forward learns the tree)."""
    if isinstance(gdn, BranchGatedDeltaNet):
        return
    gdn.__class__ = BranchGatedDeltaNet
    gdn._head_blocks = {}  # what BranchGatedDeltaNet.__init__ adds: the CP head exchange's index cache


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


@contextlib.contextmanager
def temperature_scaled(model_chunk: torch.nn.Module, temperature: float) -> Iterator[None]:
    """verl's `logits.div_(temperature)` before logprob and entropy, as a hook on megatron's output layer."""
    layer = getattr(unwrap(model_chunk), "output_layer", None)  # None: a pipeline stage before the last
    if temperature == 1.0 or layer is None:
        yield
        return

    def scale(_: torch.nn.Module, __: Any, out: Any) -> Any:
        return (out[0] / temperature, *out[1:]) if isinstance(out, tuple) else out / temperature

    handle = layer.register_forward_hook(scale)
    try:
        yield
    finally:
        handle.remove()
