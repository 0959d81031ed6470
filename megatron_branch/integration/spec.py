"""The model-side patch of an existing megatron-core run: our core attention in the layer spec's attention slot.

`BranchCoreAttention` goes into `self_attention.submodules.core_attention`, megatron's plug-in point, in the local
spec (where megatron puts DotProductAttention) and in the TransformerEngine spec (TEDotProductAttention) alike:
the other TE modules (TELayerNormColumnParallelLinear with the input norm fused into the QKV projection, TE's
row-parallel output projection and MLP) stay as they are, since only attention needs to know about branches.
Without a BranchContext attached, BranchCoreAttention IS megatron's DotProductAttention, so the patched model
behaves exactly as before until a schedule attaches one.

A plain megatron `TransformerLayer` becomes `BranchTransformerLayer` (models/layer_checkpoint.py), the same layer
that checkpoints itself while an attached context asks for it (ScheduleOptions.recompute_layers); other layer
classes stay as they are (recompute_layers then refuses to run).

RoPE from explicit position ids (`enable_position_rope`, models/rotary.py) is the other model-side change.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_branch.attention.core_attention import BranchCoreAttention
from megatron_branch.models.layer_checkpoint import BranchTransformerLayer


def patch_layer_spec(spec: Any) -> Any:
    """A copy of a GPT layer spec (ModuleSpec) or block spec (TransformerBlockSubmodules) with our core attention."""
    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attn = layer.submodules.self_attention
        if not hasattr(attn, "submodules") or not hasattr(attn.submodules, "core_attention"):
            raise ValueError("this layer spec has no self_attention.submodules.core_attention slot to patch")
        attn.submodules.core_attention = BranchCoreAttention
        if layer.module is TransformerLayer:  # the same layer, checkpointed only when asked
            layer.module = BranchTransformerLayer
    return spec
