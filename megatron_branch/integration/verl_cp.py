"""Context parallelism inside verl's MegatronEngine with the switch: what changes, and megatron's loss scaling.

verl's own CP path (verl 0.9.1, verl/models/mcore/util.py): `preprocess_thd_engine` splits every packed sequence
zigzag over the CP ranks (padded to tp * cp * 2), TransformerEngine's attention runs the CP exchange, and
`postprocess_thd_engine` all-gathers the per-token outputs over CP, so EVERY CP rank's `log_probs` / `entropy`
are the full nested tensors [B, j] (only the rank's own rows carry a gradient); verl's loss runs on them on every
CP rank and megatron's schedule back-propagates it.

With the switch (`VerlTreeStep`, verl_step.py) nothing of that split is used: the step's micro-batches form one
prefix tree and megatron-branch's own CP runs it (the groups verl's engine initialised, CP included, reach the
schedule through `ParallelGroups.from_parallel_state`): each tree segment split zigzag over the CP ranks, ring
attention with the tree mask (docs/parallelism.md). The tree's per-target logprobs and entropies are summed over
CP (each is computed on exactly one rank), so every CP rank holds all of them and builds verl's full nested
outputs, as verl's all-gather does; verl's loss runs on every CP rank on identical values, so G = dL/dlogp is the
same everywhere, and each CP rank back-propagates the terms of the targets it holds: the CP ranks' parameter
gradients are partial sums, as in verl's path.

What remains is the loss scale megatron's schedule applies (`forward_step_calc_loss`,
megatron/core/pipeline_parallel/schedules.py), reproduced by `scale_micro_batch_loss` below:

* a 2-tuple loss (the default): times the CP size, over the number of micro-batches; megatron's DDP then AVERAGES
  the gradients over dp x cp (gradient_scaling_factor 1 / |dp_cp|), so the CP ranks' partial sums add up to the
  gradient of the loss;
* a 3-tuple (loss_sum, num_tokens, output) under `calculate_per_token_loss` (Megatron-Bridge turns it on at
  CP > 1; verl returns the 3-tuple then): unscaled; the token counts are summed and `finalize_model_grads`
  divides the gradients by their total (DDP sums without averaging).

`dynamic_context_parallel` (a CP group per micro-batch, verl's DynamicCPScheduler) is refused (verl.py
refuse_unsupported): megatron-core 0.16.1 has no dynamic DPxCP groups, so verl itself cannot run it.
"""

from __future__ import annotations

from typing import Any

import torch


def scale_micro_batch_loss(
    result: tuple[Any, ...], *, num_microbatches: int, cp_size: int, per_token_loss: bool
) -> tuple[torch.Tensor, dict[str, Any], torch.Tensor | None]:
    """verl's `postprocess_micro_batch_func` result -> (the loss megatron back-propagates, before
    `grad_scale_func`; the micro-batch's output; its token count under `calculate_per_token_loss`, else None),
    exactly as megatron's forward_step_calc_loss scales it (module doc)."""
    if len(result) == 3:
        loss, num_tokens, out = result
        if per_token_loss:
            return loss, out, torch.as_tensor(num_tokens).detach().reshape(())
        loss = loss / torch.clamp(torch.as_tensor(num_tokens), min=1)
        return loss / num_microbatches, out, None
    loss, out = result
    return loss * cp_size / num_microbatches, out, None
