"""Branch attention: shared-prefix (tree) attention with exact gradients, several interchangeable backends."""

from __future__ import annotations

from megatron_branch.attention.dispatch import (
    BACKENDS,
    attention,
    default_backend,
    set_default_backend,
    use_backend,
)
from megatron_branch.attention.flex import flex_attention_forward
from megatron_branch.attention.kernels import (
    fused_attention_backward,
    fused_attention_forward,
    math_attention_backward,
    math_attention_forward,
)
from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.attention.merge import lse_merge, merge_parts
from megatron_branch.attention.merge_backend import merge_attention
from megatron_branch.attention.packed_backend import packed_attention
from megatron_branch.attention.reference import reference_attention

__all__ = [
    "BACKENDS",
    "AttentionLayout",
    "QuerySegment",
    "attention",
    "default_backend",
    "fused_attention_backward",
    "fused_attention_forward",
    "flex_attention_forward",
    "lse_merge",
    "math_attention_backward",
    "math_attention_forward",
    "merge_attention",
    "merge_parts",
    "packed_attention",
    "reference_attention",
    "set_default_backend",
    "use_backend",
]
