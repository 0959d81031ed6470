"""Patching an existing megatron-core run for branch replay: the two model-side changes, as functions.

1. The layer spec: put `BranchCoreAttention` in `self_attention.submodules.core_attention` (megatron's plug-in
   point). Without a BranchContext attached it IS megatron's DotProductAttention, so the patched model behaves
   exactly as before until a schedule attaches one.
2. RoPE from explicit position ids (`enable_position_rope`): a branch continues from its parent's end.

Then the training step hands the batch to `megatron_branch.schedule.run_schedule` instead of looping over rollouts.
patches/branch_replay.patch shows the whole change on examples/plain_grpo_step.py.
"""

from __future__ import annotations

import copy
from typing import Any

from megatron_branch.attention.core_attention import BranchCoreAttention
from megatron_branch.models.rotary import enable_position_rope

__all__ = ["enable_position_rope", "patch_layer_spec"]


def patch_layer_spec(spec: Any) -> Any:
    """A copy of a GPT layer spec (ModuleSpec) or block spec (TransformerBlockSubmodules) with our core attention."""
    spec = copy.deepcopy(spec)
    layers = getattr(spec, "layer_specs", None) or [spec]
    for layer in layers:
        attn = layer.submodules.self_attention
        if not hasattr(attn, "submodules") or not hasattr(attn.submodules, "core_attention"):
            raise ValueError("this layer spec has no self_attention.submodules.core_attention slot to patch")
        attn.submodules.core_attention = BranchCoreAttention
    return spec
