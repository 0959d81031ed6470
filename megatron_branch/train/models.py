"""The loop's megatron-core models besides the policy (built by the run assembly, assembly/engine.py): a frozen
reference copy, the sampler's whole-model copy under pipeline parallelism, and the final HF export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron_branch.assembly import prepare_for_layout
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelGroups


def frozen_copy(
    model: torch.nn.Module, arch: ModelArch, *, dtype: torch.dtype, groups: ParallelGroups
) -> Any:
    """A reference model: same shards, no gradients, never stepped."""
    ref = build_model(
        arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel, init_weights=False,
        pp=groups.pp_size, pp_rank=groups.pp_rank, ep=groups.ep_size, etp=groups.etp_size,
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
