"""Gradient reduction after a schedule's backward under TP / CP / DP (megatron's finalize_model_grads convention).

Shape legend: none; every tensor is a parameter gradient, reduced elementwise.

Under context parallelism each CP rank back-propagates only the loss terms of ITS targets (and receives dK/dV for
its keys through the ring), so a replicated parameter's full gradient is the SUM over CP ranks; data-parallel ranks
hold disjoint rollouts, and the objective is already normalised by the GLOBAL logical token count, so DP is a SUM
too (not a mean). Parameters marked `sequence_parallel` (norm weights in the sequence-parallel region) see only this
TP rank's rows and are summed over TP, as megatron-core's `_allreduce_layernorm_grads` does; so are q/k norms
(`q_layernorm`, `k_layernorm`: they see only this rank's heads), with or without SP, by the same name rule.
Under pipeline parallelism a tied embedding lives twice, on the first stage (the embedding) and on the last (the
output layer's copy): each copy's gradient is summed over the embedding group, as megatron's
`_allreduce_word_embedding_grads` does, so both stages step the same weight.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def param_grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    """megatron DDP accumulates into `main_grad`; plain modules into `grad`."""
    g = getattr(p, "main_grad", None)
    return g if g is not None else p.grad


def _all_reduce_sum(grads: list[torch.Tensor], group: Any) -> None:
    """One coalesced SUM all-reduce per dtype (few large messages instead of one per parameter)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = _flatten_dense_tensors(same)
        dist.all_reduce(flat, group=group)
        for g, synced in zip(same, _unflatten_dense_tensors(flat, same)):
            g.copy_(synced)


def finalize_grads(
    model: torch.nn.Module,
    *,
    tp_group: Any,
    dp_cp_group: Any,
    sequence_parallel: bool,
    embd_group: Any = None,
) -> None:
    """SUM sequence-parallel params' grads over `tp_group`, then every grad over `dp_cp_group` (in place).

    Collective over both groups: every rank calls it with the same model structure. Params without a grad get a
    zero one first, so every rank reduces the same list.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    for p in params:
        if param_grad(p) is None:
            p.grad = torch.zeros_like(p)
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        # megatron's rule (finalize_model_grads._allreduce_non_tensor_model_parallel_grads): norms in the SP
        # region, and q/k norms, which see only this rank's heads (with or without SP), summed once over TP
        partial = [
            param_grad(p)
            for n, p in named
            if (sequence_parallel and getattr(p, "sequence_parallel", False))
            or "q_layernorm" in n
            or "k_layernorm" in n
        ]
        if partial:
            _all_reduce_sum(partial, tp_group)  # type: ignore[arg-type]
    if dp_cp_group is not None and dist.get_world_size(dp_cp_group) > 1:
        _all_reduce_sum([param_grad(p) for p in params], dp_cp_group)  # type: ignore[misc]
    tied = _tied_weight(model)
    if embd_group is not None and dist.get_world_size(embd_group) > 1 and tied is not None:
        _all_reduce_sum([param_grad(tied)], embd_group)  # type: ignore[list-item]


def _tied_weight(model: torch.nn.Module) -> torch.nn.Parameter | None:
    """The stage's copy of a tied embedding / output weight (megatron's `shared_embedding_or_output_weight`)."""
    base = getattr(model, "module", model)
    if not getattr(base, "share_embeddings_and_output_weights", False):
        return None
    return base.shared_embedding_or_output_weight()
