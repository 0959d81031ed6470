"""Pipeline stages: the link between a stage and its neighbours (megatron-core's P2PCommunicator), the stage's
parameter names in the whole model's terms, and what stages share (the last stage's results, gathered tensors).

SHAPE LEGEND (ranks; tensors sequence first as megatron):
    pp    stages of one model replica; stage r holds layers [r L/pp, (r+1) L/pp) (megatron's even split), the
          embedding on stage 0, the final norm and output layer on stage pp-1 (a tied output weight: a copy of the
          embedding there, megatron's embedding group keeps the two equal)
    msg   what goes between stages for one chunk: its hidden states on this rank [rows, 1, h] (rows: the chunk's
          local rows under CP, divided by tp under sequence parallelism), downstream in forward, their gradient
          upstream in backward. The pipeline group joins the ranks of equal (tp, cp, dp) coordinates, so each TP/CP
          rank talks to its own counterpart of the next stage.

Process groups come in through `ParallelGroups`; nothing here reads megatron's parallel_state.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.data import PrefixTree
from megatron_branch.parallel.groups import ParallelGroups, comm_device

Shape = tuple[int, int, int]


class StageLink:
    """This stage's messages to and from its neighbours, through megatron's P2PCommunicator (its
    `send_forward_recv_backward` / `send_backward_recv_forward` pair the two directions of 1F1B's steady state so
    that no two neighbours wait on each other's send). Every call is made by every stage in the same order; the
    first stage receives nothing from before it and the last sends nothing after it (None / no-op, megatron's
    convention)."""

    def __init__(self, groups: ParallelGroups, config: Any) -> None:
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        from megatron_branch.compat.pipeline import apply_pipeline_shims

        apply_pipeline_shims()
        assert groups.pp is not None and groups.pp_size > 1 and config.pipeline_dtype is not None
        self.first, self.last = groups.first_stage, groups.last_stage
        self.stage, self.stages = groups.pp_rank, groups.pp_size
        config = copy.copy(config)
        config.variable_seq_lengths = False  # every message's shape comes from the tree: no shape exchange
        config.timers = None
        self.p2p = P2PCommunicator(pp_group=groups.pp, config=config)

    def recv_forward(self, shape: Shape) -> torch.Tensor | None:
        return self.p2p.recv_forward(shape, self.first)

    def send_forward(self, output: torch.Tensor) -> None:
        if not self.last:
            self.p2p.send_forward(_message(output), self.last)

    def recv_backward(self, shape: Shape) -> torch.Tensor | None:
        return self.p2p.recv_backward(shape, self.last)

    def send_backward(self, grad: torch.Tensor | None) -> None:
        if not self.first:
            self.p2p.send_backward(_message(grad), self.first)

    def send_forward_recv_backward(self, output: torch.Tensor, shape: Shape) -> torch.Tensor | None:
        if self.last:
            return None
        return self.p2p.send_forward_recv_backward(_message(output), shape, self.last)

    def send_backward_recv_forward(self, grad: torch.Tensor | None, shape: Shape) -> torch.Tensor | None:
        if self.first:
            return None
        return self.p2p.send_backward_recv_forward(_message(grad), shape, self.first)


def _message(t: torch.Tensor | None) -> torch.Tensor:
    """A tensor as it goes on the wire: detached and contiguous (gloo sends contiguous buffers only)."""
    assert t is not None, "a stage sends a message every stage expects"
    return t.detach().contiguous()


def broadcast_from_last(t: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
    """`t` as the last stage holds it, on every stage (a collective over the pipeline group; same shape everywhere)."""
    dev = comm_device(groups.pp)
    buf = t.to(dev).contiguous()
    dist.broadcast(buf, src=dist.get_global_rank(groups.pp, groups.pp_size - 1), group=groups.pp)
    return buf.to(t.device)


def check_same_tree(tree: PrefixTree, groups: ParallelGroups) -> None:
    """Every stage must walk the same tree (one program, matching messages): a fingerprint of its tokens, positions
    and segment lengths, gathered over the pipeline group (an invariant: each stage built it from the same
    rollouts)."""
    lengths = torch.tensor([s.length for s in tree.segments], dtype=torch.long)
    weights = torch.arange(
        1, tree.num_tokens + 1, dtype=torch.long
    )  # an int64 sum may wrap: still a fingerprint
    mine = torch.tensor(
        [
            tree.num_tokens,
            len(tree.segments),
            int(((tree.tokens + 1) * weights).sum()),
            int(((tree.position_ids + 1) * weights).sum()),
            int((lengths * torch.arange(1, len(lengths) + 1)).sum()),
        ],
        dtype=torch.long,
        device=comm_device(groups.pp),
    )
    every = [torch.empty_like(mine) for _ in range(groups.pp_size)]
    dist.all_gather(every, mine, group=groups.pp)
    assert all(torch.equal(e, mine) for e in every), "pipeline stages hold different prefix trees"


# ---- the stage's parameters in the whole model's names -----------------------------------------------------------
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..*)$")
TIED_COPY = "output_layer.weight"
"""The last stage's copy of a tied embedding (megatron's `shared_embedding`): not a tensor of the whole model."""
EMBEDDING = "embedding.word_embeddings.weight"


def layer_offset(model: torch.nn.Module) -> int:
    """Global index of the stage's first layer (megatron numbers layers from the stage's offset, 1-based)."""
    layers = _unwrap(model).decoder.layers
    return int(layers[0].layer_number) - 1 if len(layers) else 0


def global_name(name: str, offset: int) -> str:
    """A stage parameter's name in the whole model (`decoder.layers.<local>` -> `decoder.layers.<global>`)."""
    m = _LAYER.match(name)
    return f"{m.group(1)}{int(m.group(2)) + offset}{m.group(3)}" if m else name


def is_tied_copy(model: torch.nn.Module, name: str) -> bool:
    """Whether `name` is the last stage's copy of the tied embedding (megatron marks it `shared_embedding`)."""
    base = _unwrap(model)
    return bool(name == TIED_COPY and base.share_embeddings_and_output_weights and not base.pre_process)


def stage_names(model: torch.nn.Module) -> dict[str, str]:
    """Local parameter name -> its name in the whole model, for every parameter of this stage but the tied copy."""
    offset = layer_offset(model)
    return {
        n: global_name(n, offset) for n, _ in _unwrap(model).named_parameters() if not is_tied_copy(model, n)
    }


def local_targets(model: torch.nn.Module, name: str) -> list[str]:
    """The local parameters a whole-model tensor `name` loads into on this stage (none when another stage holds
    it; the embedding also fills the last stage's tied copy)."""
    out = [local for local, full in stage_names(model).items() if full == name]
    if name == EMBEDDING and is_tied_copy(model, TIED_COPY) and _unwrap(model).post_process:
        out.append(TIED_COPY)
    return out


def gather_stages(local: dict[str, torch.Tensor], groups: ParallelGroups) -> dict[str, torch.Tensor]:
    """Every stage's tensors (by whole-model name) on every rank of the pipeline group (host copies). All stages
    call it; a size-1 pipeline returns `local` as is."""
    if groups.pp is None or groups.pp_size == 1:
        return local
    parts: list[Any] = [None] * groups.pp_size
    dist.all_gather_object(parts, {n: t.detach().cpu() for n, t in local.items()}, group=groups.pp)
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part)
    return out


def _unwrap(model: torch.nn.Module) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model
