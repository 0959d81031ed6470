"""The loop's megatron-core models: the policy (from an HF folder through the converter's parameter map, or a
config-defined architecture with a seeded random init), a frozen reference copy, and the final HF export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelGroups

DTYPES = {"float32": torch.float32, "float64": torch.float64}


def build_policy(
    arch: ModelArch, *, hf_path: str | None, dtype: torch.dtype, groups: ParallelGroups, init_seed: int
) -> torch.nn.Module:
    """This rank's shard of the policy (its pipeline stage's layers under PP). Random init is TP- and
    PP-invariant: megatron initialises each full weight on the CPU from the default generator, seeded here
    identically on every rank, then slices it; under PP the whole model is built that way and the stage keeps its
    share (a second copy of the model during init only: HF-initialised runs load just their stage's tensors)."""
    from megatron_branch.checkpoint.stages import copy_from_whole, load_stage

    stage = {"pp": groups.pp_size, "pp_rank": groups.pp_rank}
    shape = {"dtype": dtype, "tp": groups.tp_size, "sequence_parallel": groups.sequence_parallel}
    if hf_path is None:
        torch.manual_seed(init_seed)
        model = build_model(arch, **shape)
        if groups.pp_size > 1:
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
        loaded = load_stage(model, ((name, full.to(dtype)) for name, full in tensors), groups)
        params = {n for n, _ in model.named_parameters()}
        assert loaded == params, sorted(params ^ loaded)
    if torch.cuda.is_available():
        model.cuda()
    return model


def frozen_copy(
    model: torch.nn.Module, arch: ModelArch, *, dtype: torch.dtype, groups: ParallelGroups
) -> Any:
    """A reference model: same shards, no gradients, never stepped."""
    ref = build_model(
        arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel, init_weights=False,
        pp=groups.pp_size, pp_rank=groups.pp_rank,
    )  # fmt: skip
    ref.load_state_dict(unwrap(model).state_dict(), strict=True)
    ref.requires_grad_(False)
    ref.eval()
    if torch.cuda.is_available():
        ref.cuda()
    return ref


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
