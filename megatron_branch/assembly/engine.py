"""The one run assembly: a checked RunSpec -> the model (this rank's pipeline stage), its groups and the schedule's
options. Every entry point builds its engine here, so a schedule option, a group or a weight loader is written once.

    spec = RunSpec(hf_path=..., arch=arch, layout=..., schedule=..., dtype="float32")
    rules.check(spec)                                   # the one check sequence (before any work)
    engine = build_engine(spec)                         # groups (megatron's parallel_state), model, options
    run_schedule(spec.schedule.name, engine.model, tree, objective, engine.opts)

Callers that receive a model and groups from outside (megatron's drop-in, verl's engine) pass them in and get the
options (`build_engine(spec, model=..., groups=...)`); the groups they read from megatron's parallel_state come from
`ParallelGroups.from_parallel_state` (parallel/groups.py). ScheduleOptions and ParallelGroups are constructed
nowhere else in the package (tests/unit/test_assembly.py greps for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.assembly.spec import RunSpec
from megatron_branch.parallel.groups import ParallelGroups, initialize_parallel
from megatron_branch.precision import torch_dtype
from megatron_branch.schedule.options import ScheduleOptions


@dataclass(kw_only=True)
class Engine:
    """What build_engine returns: the parts a step runs with."""

    model: Any
    """This rank's model: its pipeline stage, TP shards and EP rank's experts (None when none was asked for)."""
    groups: ParallelGroups
    """The process groups the math is handed."""
    opts: ScheduleOptions
    """The schedule's options."""


def build_engine(
    spec: RunSpec,
    *,
    model: Any = None,
    groups: ParallelGroups | None = None,
    vocab_size: int | None = None,
    **extra: Any,
) -> Engine:
    """The engine of a checked `spec`. `groups`: given, or laid out now on megatron's parallel_state from
    spec.layout (parallel/groups.py initialize_parallel). `model`: given, or built on this rank (HF weights of
    spec.hf_path, or a seeded random init of spec.arch: build_stage). `vocab_size`: the real
    vocabulary (default spec.arch's). `extra`: further ScheduleOptions fields of the caller (keep_logprobs,
    ring_stats, ...)."""
    if groups is None:
        groups = initialize_parallel(spec.layout)
    if model is None:
        model = build_stage(spec, groups)
    if vocab_size is None:
        vocab_size = spec.arch.vocab_size
    return Engine(model=model, groups=groups, opts=schedule_options(spec, groups, vocab_size, **extra))


def schedule_options(spec: RunSpec, groups: ParallelGroups, vocab_size: int, **extra: Any) -> ScheduleOptions:
    """The ScheduleOptions of `spec` on `groups` (a MoE policy's router options from spec.moe)."""
    s = spec.schedule
    moe = extra.pop("moe", None)
    if moe is None and spec.arch is not None and getattr(spec.arch, "is_moe", False):
        moe = spec.moe.options()
    kw = dict(
        backend=s.backend, branch_micro_batch=s.branch_micro_batch, chunk_tokens=s.chunk_tokens,
        recompute=s.recompute,
        recompute_layers=s.enable_gradient_checkpointing, root_pieces=s.root_pieces, moe=moe,
    )  # fmt: skip
    kw.update(extra)  # the caller's own options win (the drop-in's keyword arguments)
    return ScheduleOptions(groups=groups, vocab_size=vocab_size, **kw)


def build_stage(spec: RunSpec, groups: ParallelGroups, **config_overrides: Any) -> torch.nn.Module:
    """This rank's share of the policy: spec.hf_path's weights (load_hf_weights), or a random init of spec.arch
    that is the same whatever the layout (megatron initialises each full weight on the CPU from the default
    generator, seeded identically on every rank, then slices it; under PP the whole model is built that way and the
    stage keeps its share; a MoE's experts are re-drawn per global expert). On this rank's GPU when there is one,
    with the lockstep calls an EP group across replicas needs. `config_overrides`: TransformerConfig fields (a MoE's
    moe_expert_capacity_factor)."""
    from megatron_branch.checkpoint.stages import copy_from_whole
    from megatron_branch.models import build_model

    arch, dtype = spec.arch, torch_dtype(spec.dtype)
    if spec.moe.expert_capacity_factor is not None:  # token dropping (naive only: rules.check_moe_run)
        config_overrides.setdefault("moe_expert_capacity_factor", spec.moe.expert_capacity_factor)
    shape = {"dtype": dtype, "tp": groups.tp_size, "sequence_parallel": groups.sequence_parallel,
             "ep": groups.ep_size, "etp": groups.etp_size, **config_overrides}  # fmt: skip
    stage = {"pp": groups.pp_size, "pp_rank": groups.pp_rank}
    if spec.hf_path is not None:
        model = build_model(arch, **shape, init_weights=False, **stage)
        load_hf_weights(model, spec.hf_path, arch, groups, dtype)
    else:
        torch.manual_seed(spec.init_seed)
        model = build_model(arch, **shape)
        if arch.is_moe:
            init_experts(model, arch, groups, seed=spec.init_seed)
        if groups.pp_size > 1:  # the whole model's init (a MoE's experts too), each stage keeps its share
            whole, model = model, build_model(arch, **shape, init_weights=False, **stage)
            copy_from_whole(model, whole)
    if torch.cuda.is_available():  # weights are loaded on the host, then the model moves to this rank's GPU
        model.cuda()
    return prepare_for_layout(model, groups)


def init_experts(model: torch.nn.Module, arch: Any, groups: ParallelGroups, *, seed: int) -> None:
    """Re-draw every routed expert's weights from its own generator (layer, global expert, tensor), with megatron's
    init methods on the full tensor, so that a random init is the same whatever the EP (and TP) layout: megatron's
    CPU init draws each rank's LOCAL experts from one stream, so under EP2 global experts 0 and 2 would start
    equal, and an EP2 run would not be an EP1 run."""
    from megatron_branch.checkpoint.experts import expert_index, global_name, local_experts, rank_size
    from megatron_branch.checkpoint.tp import full_shape, load_full_tensor

    params = dict(model.named_parameters())
    ep_rank, _ = rank_size(groups.ep)
    n_local = local_experts(list(params))
    cfg = model.config
    for name, p in params.items():
        if expert_index(name) is None:
            continue
        full_name = global_name(name, ep_rank, n_local)
        layer = int(name.split(".")[2])
        j = expert_index(full_name)[1]  # type: ignore[index]
        which = 1 if name.endswith("linear_fc1.weight") else 2
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(((seed * 1_000_003 + layer) * 4099 + j) * 3 + which)
            full = torch.empty(full_shape(p, groups.tp_size), dtype=torch.float32)
            (cfg.init_method if which == 1 else cfg.output_layer_init_method)(full)
        load_full_tensor(model, full_name, full, groups.tp, params=params, ep_group=groups.ep)


def load_hf_weights(
    model: torch.nn.Module, hf_dir: str, arch: Any, groups: ParallelGroups, dtype: torch.dtype
) -> None:
    """The one loader of HF weights into a stage: every tensor of `hf_dir` through the converter's parameter map
    (checkpoint/param_map.py), this rank's share of it (its stage's layers, TP shards, EP rank's experts:
    checkpoint/stages.py) copied into `model` in `dtype`."""
    from megatron_branch.checkpoint.hf_io import HFTensorReader
    from megatron_branch.checkpoint.param_map import iter_hf_to_mcore
    from megatron_branch.checkpoint.stages import load_stage

    reader = HFTensorReader(hf_dir)
    tensors = iter_hf_to_mcore(
        reader.keys(), reader.get, arch, padded_vocab=arch.padded_vocab_size(groups.tp_size), where=hf_dir
    )
    load_stage(model, ((name, full.to(dtype)) for name, full in tensors), groups)


def prepare_for_layout(model: torch.nn.Module, groups: ParallelGroups) -> torch.nn.Module:
    """Under expert parallelism across DP replicas, the model's calls pair up between replicas
    (parallel/lockstep.py); otherwise nothing to do."""
    if groups.ep_spans_dp:
        from megatron_branch.parallel import lockstep

        lockstep.install(model, rows=groups.tp_size if groups.sequence_parallel else 1)
    return model
