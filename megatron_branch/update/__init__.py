"""The policy (or critic) update: megatron's optimizer over megatron DDP, and one reusable update step.

optimizer.py  OptimizerSettings, build_optimizer (get_megatron_optimizer + OptimizerParamScheduler)
step.py       UpdatePlan, update_step (score, run the schedule per micro-batch, finalise, step, metrics),
              accumulate_gradients + finalize + reduce_metrics (its parts; `megatron-branch grad` uses them),
              attach_scores (forward-only old/ref logprobs or values into the rollouts)
"""

from megatron_branch.update.optimizer import OptimizerSettings, build_optimizer, current_lr
from megatron_branch.update.step import (
    Accumulated,
    UpdatePlan,
    UpdateResult,
    accumulate_gradients,
    attach_scores,
    finalize,
    reduce_metrics,
    split_micro_batches,
    update_step,
)

__all__ = [
    "Accumulated",
    "OptimizerSettings",
    "UpdatePlan",
    "UpdateResult",
    "accumulate_gradients",
    "attach_scores",
    "build_optimizer",
    "current_lr",
    "finalize",
    "reduce_metrics",
    "split_micro_batches",
    "update_step",
]
