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
    """This rank's shard of the policy. Random init is TP-invariant (megatron initialises the full weight on
    the CPU from the default generator, seeded here identically on every rank, then slices it)."""
    if hf_path is None:
        torch.manual_seed(init_seed)
        model = build_model(arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel)
    else:
        from megatron_branch.checkpoint.hf_io import HFTensorReader
        from megatron_branch.checkpoint.param_map import iter_hf_to_mcore
        from megatron_branch.checkpoint.tp import load_full_tensor

        reader = HFTensorReader(hf_path)
        model = build_model(
            arch,
            dtype=dtype,
            tp=groups.tp_size,
            sequence_parallel=groups.sequence_parallel,
            init_weights=False,
        )
        params = dict(model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for name, full in iter_hf_to_mcore(
                reader.keys(),
                reader.get,
                arch,
                padded_vocab=arch.padded_vocab_size(groups.tp_size),
                where=hf_path,
            ):
                load_full_tensor(model, name, full.to(dtype), groups.tp, params=params)
                loaded.add(name)
        assert loaded == set(params), sorted(set(params) ^ loaded)
    if torch.cuda.is_available():
        model.cuda()
    return model


def frozen_copy(
    model: torch.nn.Module, arch: ModelArch, *, dtype: torch.dtype, groups: ParallelGroups
) -> Any:
    """A reference model: same shards, no gradients, never stepped."""
    ref = build_model(
        arch, dtype=dtype, tp=groups.tp_size, sequence_parallel=groups.sequence_parallel, init_weights=False
    )
    ref.load_state_dict(unwrap(model).state_dict(), strict=True)
    ref.requires_grad_(False)
    ref.eval()
    if torch.cuda.is_available():
        ref.cuda()
    return ref


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
