"""Full megatron tensors <-> this rank's tensor-parallel shards.

megatron-core marks each sharded parameter with `tensor_model_parallel = True` and `partition_dim` (0 for
column-parallel: linear_qkv, linear_fc1, word_embeddings, output_layer, a GatedDeltaNet's in_proj, conv1d,
A_log and dt_bias; 1 for row-parallel: linear_proj, linear_fc2, out_proj). A shard is a contiguous chunk of the
full tensor along that dim, except for fused tensors whose rank r holds its share of every section
(checkpoint/layouts.py `tp_sections`): the SwiGLU linear_fc1 holds [gate_r; up_r] (megatron's MLP chunks its local
output in two halves), a GatedDeltaNet's in_proj [q_r; k_r; v_r; z_r; beta_r; alpha_r] and its conv1d
[q_r; k_r; v_r] channels; their full tensors ([gate; up], [q; k; v; z; beta; alpha], [q; k; v]) are re-assembled
section by section. Norm weights are replicated (also under sequence parallel).

Routed experts under expert parallelism (`ep_group`): each EP rank holds E/ep experts per layer; full states name
them by their global index (checkpoint/experts.py), gathered over the EP group after the TP gather, and a rank
loads only its own. Expert tensor parallelism is TP (an expert's shards live on the TP group's ranks) or 1: then
every TP rank holds whole experts, unmarked as tensor-parallel (models/expert_tp.py), so they are neither split nor
gathered here.

The vocabulary-parallel tensors keep their padding as-is; `repad_vocab` re-pads a full tensor saved at another TP.
Process groups are arguments: nothing here reads megatron's parallel_state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.checkpoint.layouts import tp_sections
from megatron_branch.errors import UserError
from megatron_branch.parallel.grads import param_grad

VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _rank_size(tp_group: Any) -> tuple[int, int]:
    if tp_group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group=tp_group), dist.get_world_size(group=tp_group)


def _sections(name: str, model: torch.nn.Module | None) -> tuple[int, ...] | None:
    return tp_sections(name, getattr(model, "config", None))


def _section_sizes(rows: int, sections: tuple[int, ...]) -> list[int]:
    """`sections` (relative sizes) scaled to a tensor of `rows` rows."""
    unit, rem = divmod(rows, sum(sections))
    assert rem == 0, (rows, sections)
    return [s * unit for s in sections]


def _partition_dim(param: torch.Tensor) -> int | None:
    if getattr(param, "tensor_model_parallel", False):
        return int(param.partition_dim)
    return None


def shard_full_tensor(
    full: torch.Tensor,
    *,
    name: str,
    dim: int | None,
    rank: int,
    size: int,
    sections: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """This rank's shard of a full megatron tensor (`sections`: fused sections, each split over the ranks)."""
    if dim is None or size == 1:
        return full
    if sections is not None:
        parts = full.split(_section_sizes(full.shape[dim], sections), dim=dim)
        for p in parts:
            assert p.shape[dim] % size == 0, (
                f"{name}: a section of {p.shape[dim]} rows does not split over TP {size}"
            )
        return torch.cat([p.chunk(size, dim=dim)[rank] for p in parts], dim=dim)
    assert full.shape[dim] % size == 0, (
        f"{name}: dim {dim} of {list(full.shape)} does not split over TP {size}"
    )
    return full.chunk(size, dim=dim)[rank]


def _gather(
    local: torch.Tensor, *, dim: int | None, tp_group: Any, sections: tuple[int, ...] | None
) -> torch.Tensor:
    rank, size = _rank_size(tp_group)
    if dim is None or size == 1:
        return local.detach().clone()
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.detach().contiguous(), group=tp_group)
    if sections is not None:
        sizes = [n // size for n in _section_sizes(local.shape[dim] * size, sections)]
        split = [p.split(sizes, dim=dim) for p in parts]  # rank -> its share of each section
        return torch.cat([split[r][k] for k in range(len(sizes)) for r in range(size)], dim=dim)
    return torch.cat(parts, dim=dim)


def gather_full_state(model: torch.nn.Module, tp_group: Any, ep_group: Any = None) -> dict[str, torch.Tensor]:
    """Every parameter of `model` as its full (TP-unsharded) megatron tensor, on every rank of `tp_group` (and of
    `ep_group`: every expert, by its global index).

    All ranks of the groups must call this (collectives in parameter order). Vocabulary padding is kept.
    """
    local = {
        name: _gather(p, dim=_partition_dim(p), tp_group=tp_group, sections=_sections(name, model))
        for name, p in model.named_parameters()
    }
    return _gather_experts(local, ep_group)


def _gather_experts(local: dict[str, torch.Tensor], ep_group: Any) -> dict[str, torch.Tensor]:
    """Local expert tensors gathered over the EP group and named by their global index (others unchanged)."""
    from megatron_branch.checkpoint.experts import expert_index, global_name, local_experts, rank_size

    _, ep = rank_size(ep_group)
    if ep == 1:
        return local
    num_local = local_experts(list(local))
    out = {}
    for name, t in local.items():
        if expert_index(name) is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(ep)]
        dist.all_gather(parts, t.contiguous(), group=ep_group)
        for r, part in enumerate(parts):
            out[global_name(name, r, num_local)] = part
    return out


def gather_full_grads(model: torch.nn.Module, tp_group: Any, ep_group: Any = None) -> dict[str, torch.Tensor]:
    """Like `gather_full_state` for gradients: `param.main_grad` when present (megatron DDP), else `param.grad`.

    A parameter without a gradient gives zeros, so every rank runs the same collectives.
    """
    out = {}
    for name, p in model.named_parameters():
        g = param_grad(p)
        if g is None:
            g = torch.zeros_like(p)
        out[name] = _gather(g, dim=_partition_dim(p), tp_group=tp_group, sections=_sections(name, model))
    return _gather_experts(out, ep_group)


def repad_vocab(full: torch.Tensor, rows: int) -> torch.Tensor:
    """A vocabulary-parallel tensor with `rows` rows: zero rows appended, or trailing padding rows cut."""
    if full.shape[0] == rows:
        return full
    if full.shape[0] > rows:
        return full[:rows]
    out = full.new_zeros(rows, *full.shape[1:])
    out[: full.shape[0]] = full
    return out


def full_shape(param: torch.Tensor, tp_size: int) -> tuple[int, ...]:
    """The full (unsharded) shape of a parameter held by one rank of a TP group of `tp_size`."""
    shape = list(param.shape)
    dim = _partition_dim(param)
    if dim is not None:
        shape[dim] *= tp_size
    return tuple(shape)


@torch.no_grad()
def load_full_tensor(
    model: torch.nn.Module,
    name: str,
    full: torch.Tensor,
    tp_group: Any,
    *,
    params: Mapping[str, Any] | None = None,
    ep_group: Any = None,
) -> None:
    """Copy this rank's shard of one full megatron tensor into the parameter `name` (streamed conversion). An
    expert (global index) that another EP rank of `ep_group` holds is skipped."""
    params = dict(model.named_parameters()) if params is None else params
    from megatron_branch.checkpoint.experts import local_experts, local_name, rank_size

    ep_rank, ep = rank_size(ep_group)
    if ep > 1:
        mine = local_name(name, ep_rank, local_experts(list(params)))
        if mine is None:
            return
        name = mine
    if name not in params:
        raise UserError(f"the model has no parameter {name!r}")
    p = params[name]
    rank, size = _rank_size(tp_group)
    if name in VOCAB_PARAMS:
        full = repad_vocab(full, full_shape(p, size)[0])
    if tuple(full.shape) != full_shape(p, size):
        raise UserError(
            f"tensor {name!r} has shape {list(full.shape)}; the model expects {list(full_shape(p, size))}"
        )
    shard = shard_full_tensor(
        full, name=name, dim=_partition_dim(p), rank=rank, size=size, sections=_sections(name, model)
    )
    p.copy_(shard.to(p.dtype))


def load_full_state(
    model: torch.nn.Module, full_state: Mapping[str, torch.Tensor], tp_group: Any, ep_group: Any = None
) -> None:
    """Copy every parameter's shard for this rank from full megatron tensors (no collectives)."""
    params = dict(model.named_parameters())
    from megatron_branch.checkpoint.experts import global_name, local_experts, rank_size

    ep_rank, ep = rank_size(ep_group)
    if ep > 1:  # every expert of the full state; this rank loads its own
        n = local_experts(list(params))
        held = {global_name(k, ep_rank, n) for k in params}
        missing = sorted(held - set(full_state))
        if missing:
            raise UserError(f"state lacks tensor {missing[0]!r} needed by the model")
        for name, full in full_state.items():
            load_full_tensor(model, name, full, tp_group, params=params, ep_group=ep_group)
        return
    missing = sorted(set(params) - set(full_state))
    if missing:
        raise UserError(f"state lacks tensor {missing[0]!r} needed by the model")
    unexpected = sorted(set(full_state) - set(params))
    if unexpected:
        raise UserError(f"state has tensor {unexpected[0]!r} that the model does not have")
    for name, full in full_state.items():
        load_full_tensor(model, name, full, tp_group, params=params)
