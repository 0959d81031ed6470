"""The planner behind `megatron-branch plan`: pure functions from (model arch, rollout shape, GPUs, layout) to
per-rank memory by term, FLOPs per schedule, a step-time estimate and a recommended layout. No GPU, no model, no
tensors: arithmetic on the architecture (ModelArch) only."""

from megatron_branch.plan.model import GPU, GPU_PRESETS, Layout, RolloutShape, load_model
from megatron_branch.plan.presets import MODEL_PRESETS
from megatron_branch.plan.search import Plan, evaluate, plan, what_would_fit

__all__ = [
    "GPU",
    "GPU_PRESETS",
    "MODEL_PRESETS",
    "Layout",
    "Plan",
    "RolloutShape",
    "evaluate",
    "load_model",
    "plan",
    "what_would_fit",
]
