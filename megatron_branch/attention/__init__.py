"""Branch attention: shared-prefix (tree) attention with exact gradients; one visibility plan, several executors."""

from __future__ import annotations

from megatron_branch.attention.context import (
    BranchContext,
    LocalContext,
    PrefixContext,
    attach_context,
)
from megatron_branch.attention.dispatch import (
    BACKENDS,
    EXECUTORS,
    attention,
    backend_problem,
    default_backend,
    resolve_backend,
)
from megatron_branch.attention.kernels import (
    fused_attention_backward,
    fused_attention_forward,
    math_attention_backward,
    math_attention_forward,
)
from megatron_branch.attention.layout import AttentionLayout, QuerySegment
from megatron_branch.attention.merge import lse_merge, merge_parts
from megatron_branch.attention.plan import BlockPlan
from megatron_branch.attention.plan_sources import plan_from_layout, plan_from_meta
from megatron_branch.attention.prefix_state import ATTENTION_KV, ChunkTree, StateKind
from megatron_branch.attention.reference import reference_attention

__all__ = [
    "ATTENTION_KV",
    "BACKENDS",
    "EXECUTORS",
    "AttentionLayout",
    "BlockPlan",
    "BranchContext",
    "ChunkTree",
    "LocalContext",
    "PrefixContext",
    "QuerySegment",
    "StateKind",
    "attach_context",
    "attention",
    "backend_problem",
    "default_backend",
    "fused_attention_backward",
    "fused_attention_forward",
    "lse_merge",
    "math_attention_backward",
    "math_attention_forward",
    "merge_parts",
    "plan_from_layout",
    "plan_from_meta",
    "reference_attention",
    "resolve_backend",
]
