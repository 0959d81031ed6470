"""Whole-model megatron tensors <-> this rank's pipeline stage (and its tensor- and expert-parallel shards).

Shape legend: a whole-model tensor is full (TP-unsharded) and named as in a one-stage model
(`decoder.layers.<global index>...`); a stage holds the layers [r L/pp, (r+1) L/pp) under local names
(`decoder.layers.<local index>...`), the embedding on stage 0, the final norm and output layer on the last stage.
A tied output weight's copy on the last stage is filled from the embedding and never listed as a tensor of its own
(the whole model has none). The name map lives in parallel/pipeline.py; at pp = 1 everything here is
checkpoint/tp.py itself (TP shards, a MoE's experts by EP rank). Under PP a stage's routed experts are named by
their global index too (its EP rank's offset, checkpoint/experts.py, then the stage's layer offset).

Process groups are arguments (`ParallelGroups`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from megatron_branch.checkpoint import experts
from megatron_branch.checkpoint.tp import gather_full_grads, gather_full_state, load_full_tensor
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.parallel.pipeline import (
    gather_stages,
    global_name,
    layer_offset,
    local_targets,
    stage_names,
)


@torch.no_grad()
def load_stage(
    model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], groups: ParallelGroups
) -> None:
    """Copy this rank's share of every whole-model tensor its stage holds into `model` (the rest are skipped);
    under PP every parameter of the stage must be filled."""
    params = dict(model.named_parameters())
    if (
        groups.pp_size == 1
    ):  # the whole model: its own names (a MoE's experts: this EP rank's, by load_full_tensor)
        for name, full in tensors:
            load_full_tensor(model, name, full, groups.tp, params=params, ep_group=groups.ep)
        return
    loaded: set[str] = set()
    ep_rank, ep = experts.rank_size(groups.ep)
    by_whole = _expert_targets(model, ep_rank) if ep > 1 else {}
    for name, full in tensors:
        for local in by_whole.get(name) or local_targets(model, name):
            load_full_tensor(model, local, full, groups.tp, params=params)
            loaded.add(local)
    assert loaded == set(params), sorted(set(params) ^ loaded)


def _expert_targets(model: torch.nn.Module, ep_rank: int) -> dict[str, list[str]]:
    """Whole-model name -> [local name] of every routed expert parameter this stage's EP rank holds."""
    names = list(stage_names(model))
    n_local, offset = experts.local_experts(names), layer_offset(model)
    return {
        global_name(experts.global_name(n, ep_rank, n_local), offset): [n]
        for n in names
        if experts.expert_index(n) is not None
    }


def _whole(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This stage's full tensors (experts by global index: checkpoint/tp.py) by whole-model name, the tied copy
    left out."""
    names, offset = stage_names(model), layer_offset(model)
    return {global_name(n, offset): t for n, t in tensors.items() if n in names or experts.expert_index(n)}


@torch.no_grad()
def copy_from_whole(model: torch.nn.Module, whole: torch.nn.Module) -> None:
    """Copy a whole-model copy's parameters (the same TP rank's shards) into this stage (no collective)."""
    params = dict(model.named_parameters())
    for name, t in whole.named_parameters():
        for local in local_targets(model, name):
            params[local].copy_(t)


def gather_model_grads(model: torch.nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Every gradient of the whole model, full and by whole-model name, on every rank (collectives over TP and
    EP, then the pipeline group). Finalise first: the tied embedding's gradient is then the same on both stages."""
    if groups.pp_size == 1:
        return gather_full_grads(model, groups.tp, groups.ep)
    return gather_stages(_whole(model, gather_full_grads(model, groups.tp, groups.ep)), groups)


def gather_model_state(model: torch.nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Every parameter of the whole model, full and by whole-model name, on every rank (as gather_model_grads)."""
    if groups.pp_size == 1:
        return gather_full_state(model, groups.tp, groups.ep)
    return gather_stages(_whole(model, gather_full_state(model, groups.tp, groups.ep)), groups)


def gather_stage_shards(model: torch.nn.Module, groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Every stage's parameters as this TP rank holds them (shards, not full), by whole-model name, on every rank
    of the pipeline group: what a whole-model copy on this TP rank loads (the sampler's, train/models.py)."""
    names = stage_names(model)
    return gather_stages({names[n]: p for n, p in model.named_parameters() if n in names}, groups)
