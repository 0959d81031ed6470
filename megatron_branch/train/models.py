"""The loop's megatron-core models: the policy (from an HF folder through the converter's parameter map, or a
config-defined architecture with a seeded random init), a frozen reference copy, and the final HF export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.precision import DTYPE_NAMES, torch_dtype

DTYPES = {name: torch_dtype(name) for name in DTYPE_NAMES}
"""model.dtype -> torch dtype (precision.py: bf16 / fp16 are megatron's mixed precision)."""


def build_policy(
    arch: ModelArch, *, hf_path: str | None, dtype: torch.dtype, groups: ParallelGroups, init_seed: int
) -> torch.nn.Module:
    """This rank's shard of the policy (its pipeline stage's layers under PP). Random init is TP- and
    PP-invariant: megatron initialises each full weight on the CPU from the default generator, seeded here
    identically on every rank, then slices it; under PP the whole model is built that way and the stage keeps its
    share (a second copy of the model during init only: HF-initialised runs load just their stage's tensors)."""
    from megatron_branch.checkpoint.stages import copy_from_whole, load_stage

    stage = {"pp": groups.pp_size, "pp_rank": groups.pp_rank}
    shape = {
        "dtype": dtype,
        "tp": groups.tp_size,
        "sequence_parallel": groups.sequence_parallel,
        "ep": groups.ep_size,
    }
    if hf_path is None:
        torch.manual_seed(init_seed)
        model = build_model(arch, **shape)
        if arch.is_moe:
            init_experts(model, arch, groups, seed=init_seed)
        if groups.pp_size > 1:  # (a dense model: MoE is not pipelined, rules.check_pipeline)
            whole, model = model, build_model(arch, **shape, init_weights=False, **stage)
            copy_from_whole(model, whole)
    else:
        from megatron_branch.checkpoint.hf_io import HFTensorReader
        from megatron_branch.checkpoint.param_map import iter_hf_to_mcore

        reader = HFTensorReader(hf_path)
        model = build_model(arch, **shape, init_weights=False, **stage)
        tensors = iter_hf_to_mcore(
            reader.keys(),
            reader.get,
            arch,
            padded_vocab=arch.padded_vocab_size(groups.tp_size),
            where=hf_path,
        )
        load_stage(model, ((name, full.to(dtype)) for name, full in tensors), groups)
    if torch.cuda.is_available():
        model.cuda()
    return prepare_for_layout(model, groups)


def init_experts(model: torch.nn.Module, arch: ModelArch, groups: ParallelGroups, *, seed: int) -> None:
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


def prepare_for_layout(model: torch.nn.Module, groups: ParallelGroups) -> torch.nn.Module:
    """Under expert parallelism across DP replicas, the model's calls pair up between replicas
    (parallel/lockstep.py); otherwise nothing to do."""
    if groups.ep_spans_dp:
        from megatron_branch.parallel import lockstep

        lockstep.install(model, rows=groups.tp_size if groups.sequence_parallel else 1)
    return model


def frozen_copy(
    model: torch.nn.Module, arch: ModelArch, *, dtype: torch.dtype, groups: ParallelGroups
) -> Any:
    """A reference model: same shards, no gradients, never stepped."""
    ref = build_model(
        arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel, init_weights=False,
        pp=groups.pp_size, pp_rank=groups.pp_rank, ep=groups.ep_size,
    )  # fmt: skip
    ref.load_state_dict(unwrap(model).state_dict(), strict=True)
    ref.requires_grad_(False)
    ref.eval()
    if torch.cuda.is_available():
        ref.cuda()
    return prepare_for_layout(ref, groups)


def whole_copy(arch: ModelArch, *, dtype: torch.dtype, groups: ParallelGroups) -> torch.nn.Module:
    """A frozen whole-model copy (every layer; this TP rank's shards) for the sampler under pipeline parallelism:
    the simplest exact way to sample with a pipelined policy is to run the whole model on every rank
    (`refresh_whole` copies the stages' current weights into it before each generate). Its price: one more copy of
    the model's weights per rank."""
    whole = build_model(
        arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel, init_weights=False
    )
    whole.requires_grad_(False)
    whole.eval()
    if torch.cuda.is_available():
        whole.cuda()
    return whole


def refresh_whole(whole: torch.nn.Module, stage: torch.nn.Module, groups: ParallelGroups) -> None:
    """`whole` <- the current weights of every pipeline stage (an all-gather over the pipeline group)."""
    from megatron_branch.checkpoint.stages import gather_stage_shards

    params = dict(whole.named_parameters())
    shards = gather_stage_shards(unwrap(stage), groups)
    assert set(shards) == set(params), sorted(set(shards) ^ set(params))
    with torch.no_grad():
        for name, t in shards.items():
            params[name].copy_(t)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside megatron's DDP wrapper (or the model itself)."""
    return getattr(model, "module", model)


def export_hf(
    model: torch.nn.Module,
    out: Path,
    *,
    arch: ModelArch,
    dtype: torch.dtype,
    groups: ParallelGroups,
    tokenizer_dir: Path | None,
) -> Path:
    """The policy as a megatron dist checkpoint (OUT/policy_mcore) and, through the converter, an HF folder
    (OUT/hf), each replacing the previous export atomically (a resumed run re-exports its new last step). All ranks
    call it; it re-initialises megatron's parallel state (the run is over)."""
    from megatron_branch.checkpoint.hf_to_mcore import save_mcore_checkpoint
    from megatron_branch.checkpoint.mcore_to_hf import convert_mcore_to_hf

    mcore = out / "policy_mcore"
    save_mcore_checkpoint(
        unwrap(model), mcore, arch=arch, dtype=dtype, tp=groups.tp_size, source="megatron-branch train",
        tokenizer_dir=tokenizer_dir, overwrite=True,
    )  # fmt: skip
    return convert_mcore_to_hf(mcore, out / "hf", overwrite=True)
