"""Process groups: set up once by the entry point, then passed into the math as arguments.

megatron-core's `parallel_state` owns the groups (tensor, context, data, pipeline parallel) so that its layers, DDP and
checkpointing see the same layout. Everything in megatron_branch's math takes the groups it needs as arguments
(`ParallelGroups`); nothing below the entry points reads parallel_state or the environment. The groups are laid out
from a ParallelLayout (parallel/layout.py, the one layout type) and report it back (`ParallelGroups.layout`).
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.compat.cpu import apply_cpu_shims
from megatron_branch.parallel.layout import ParallelLayout

ParallelConfig = ParallelLayout
"""The layout's former name here (one type: parallel/layout.py)."""


@dataclass(kw_only=True)
class ParallelGroups:
    """The groups the math needs, passed into it whole (schedule options, the update step). Under torchrun every
    axis is a real group (size-1 groups included); `single()` is one process with no groups at all."""

    tp: Any
    cp: Any
    dp: Any
    dp_cp: Any
    tp_size: int
    cp_size: int
    dp_size: int
    sequence_parallel: bool
    pp: Any = None
    """The pipeline group: this rank's stage and the other stages of its model replica (megatron's
    pipeline_model_parallel_group; None without pipeline parallelism)."""
    pp_size: int = 1
    pp_rank: int = 0
    """This rank's stage (0 = the embedding's, pp_size - 1 = the output layer's and the loss's)."""
    embd: Any = None
    """The embedding group: the first and the last stage, which both hold the tied embedding / output weight
    (megatron's embedding group; None without pipeline parallelism, and on the stages in between)."""
    ep: Any = None
    """The expert-parallel group (MoE models; None: no expert parallelism)."""
    ep_size: int = 1
    etp_size: int = 1
    """The experts' tensor-parallel size (megatron's expert_tensor_parallel_size): tp_size, or 1 where every TP rank
    holds whole experts (their grads then summed over megatron's expert-data-parallel group, which spans TP)."""
    ep_spans_dp: bool = False
    """Some EP group holds ranks of different data-parallel replicas: their model calls must pair up
    (parallel/lockstep.py)."""

    @property
    def layout(self) -> ParallelLayout:
        """The layout these groups realise."""
        return ParallelLayout(
            tp=self.tp_size, cp=self.cp_size, dp=self.dp_size, pp=self.pp_size, ep=self.ep_size,
            etp=self.etp_size, sequence_parallel=self.sequence_parallel,
        )  # fmt: skip

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @classmethod
    def from_parallel_state(
        cls, *, sequence_parallel: bool, pg_collection: Any = None, reduces_grads: bool = True
    ) -> ParallelGroups:
        """The groups megatron's parallel_state holds (every axis: tp, cp, dp, pp and its embedding group, ep), as
        megatron's own schedule resolves them: tp, cp, pp and embd from `pg_collection` when one is given (megatron's
        ProcessGroupCollection). `sequence_parallel`: the model's setting (in effect only at tp > 1).
        `reduces_grads`: the engine sums the gradients itself (dp_cp set); False where megatron's
        finalize_model_grads_func does it (the drop-in, verl's engine)."""
        from megatron.core import parallel_state as ps

        pgc = pg_collection
        tp = pgc.tp if pgc is not None else ps.get_tensor_model_parallel_group()
        cp = pgc.cp if pgc is not None else ps.get_context_parallel_group()
        pp = getattr(pgc, "pp", None) if pgc is not None else ps.get_pipeline_model_parallel_group()
        dp = ps.get_data_parallel_group()
        tp_size, pp_size, ep_size = _size(tp), _size(pp), ps.get_expert_model_parallel_world_size()
        piped = pp_size > 1
        embd = (
            getattr(pgc, "embd", None) if pgc is not None else ps.get_embedding_group(check_initialized=False)
        )
        return cls(
            tp=tp, cp=cp, dp=dp, dp_cp=ps.get_data_parallel_group(with_context_parallel=True) if reduces_grads else None,
            tp_size=tp_size, cp_size=_size(cp), dp_size=_size(dp), sequence_parallel=sequence_parallel and tp_size > 1,
            pp=pp if piped else None, pp_size=pp_size, pp_rank=dist.get_rank(pp) if piped else 0,
            embd=embd if piped else None,  # None off stages 0, pp-1
            ep=ps.get_expert_model_parallel_group() if ep_size > 1 else None, ep_size=ep_size,
            etp_size=_size(ps.get_expert_tensor_parallel_group(check_initialized=False)),
            ep_spans_dp=ep_size > 1 and _ep_spans_replicas(ps),
        )  # fmt: skip

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process, no parallelism: no groups at all (the math never calls a collective on a size-1 axis)."""
        return cls(
            tp=None, cp=None, dp=None, dp_cp=None, tp_size=1, cp_size=1, dp_size=1, sequence_parallel=False
        )


def _size(group: Any) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(*, timeout_s: int = 300) -> tuple[int, int]:
    """Initialise torch.distributed from torchrun's environment, or as a world of one. Returns (rank, world)."""
    apply_cpu_shims()
    if not dist.is_initialized():
        if torch.cuda.is_available():  # one GPU per local rank, as torchrun lays them out
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://127.0.0.1:{_free_port()}",
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
    return dist.get_rank(), dist.get_world_size()


def initialize_parallel(cfg: ParallelLayout, *, seed: int = 1234) -> ParallelGroups:
    """Initialise megatron's parallel_state for layout `cfg` on the current world and return the groups.

    Refuses a layout the world does not fit before any work starts.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    _, world = init_distributed()
    dp = cfg.data_parallel_size(world)
    destroy_parallel()  # frees the previous layout's groups too
    ps.initialize_model_parallel(
        tensor_model_parallel_size=cfg.tp,
        pipeline_model_parallel_size=cfg.pp,
        context_parallel_size=cfg.cp,
        expert_model_parallel_size=cfg.ep,
        expert_tensor_parallel_size=cfg.expert_tp,
    )
    # torch 2.13 starts each process from a different CPU seed: seed explicitly so replicas agree.
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    groups = ParallelGroups.from_parallel_state(sequence_parallel=cfg.sequence_parallel)
    sizes = (groups.tp_size, groups.cp_size, groups.dp_size, groups.pp_size, groups.ep_size, groups.etp_size)
    assert sizes == (cfg.tp, cfg.cp, dp, cfg.pp, cfg.ep, cfg.expert_tp), (sizes, cfg)
    return groups


def _ep_spans_replicas(ps: Any) -> bool:
    """Whether any rank's EP group reaches outside its data-parallel replica (its TP x CP ranks); every rank
    learns the same answer (a MAX all-reduce over the world)."""
    ep = set(dist.get_process_group_ranks(ps.get_expert_model_parallel_group()))
    replica = set(dist.get_process_group_ranks(ps.get_tensor_and_context_parallel_group()))
    flag = torch.tensor([int(not ep <= replica)], device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def comm_device(group: Any = None) -> torch.device:
    """Where a tensor must live to go through `group`'s collectives: NCCL wants CUDA tensors, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shutdown_distributed() -> None:
    """What the entry point that set up torch.distributed does before its process exits: free every group, the
    default one included. A process that exits with a live gloo group can die in its C++ destructors
    ("terminate called without an active exception", SIGABRT; seen under torchrun after a user error), so an
    exit status 2 would become torchrun's 1 with a traceback."""
    destroy_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def destroy_parallel() -> None:
    """Tear down megatron's parallel_state AND free its process groups.

    megatron's destroy_model_parallel only drops its references: every gloo group stays registered with
    torch.distributed and keeps its transport thread polling, so a process that lays out the groups again and
    again (a test suite: ~20 groups per layout) piles up thousands of busy threads (measured). Every group but
    the default one is destroyed here; the groups belong to the entry point, which set them up.
    """
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return
    ps.destroy_model_parallel()
    if dist.is_initialized():
        registered = dist.distributed_c10d._world.pg_map  # torch has no public list of live groups
        for group in [g for g in registered if g is not dist.GroupMember.WORLD]:
            dist.destroy_process_group(group)
