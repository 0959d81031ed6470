"""Hugging Face folder -> megatron-core distributed checkpoint (loads under any TP layout).

Runs single process or on every rank of a torchrun launch. Each rank builds the model for its TP shard, streams
the HF tensors one rule at a time from safetensors (memory-mapped) and copies only its shard into the parameters,
so no second full copy of the model is ever materialised; megatron's random init is skipped. The checkpoint is
`megatron.core.dist_checkpointing` (`torch_dist`) of `model.sharded_state_dict()` plus `megatron_branch.json`
describing the architecture and recording every file of the checkpoint (size, SHA-256), which loading checks.
Everything that needs no model (the output folder, the HF folder, the architecture, TP against the launch) is
checked before any work, on every rank, with one verdict (docs/errors.md).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch import outputs
from megatron_branch.checkpoint.dist_ckpt import save_sharded
from megatron_branch.checkpoint.hf_io import (
    TOKENIZER_FILES,
    HFTensorReader,
    copy_tokenizer_files,
    load_hf_config,
)
from megatron_branch.checkpoint.integrity import complete_record
from megatron_branch.checkpoint.param_map import iter_hf_to_mcore, mcore_names, sharded_keys
from megatron_branch.checkpoint.tp import load_full_tensor
from megatron_branch.errors import UserError, launched_world_size
from megatron_branch.models.arch import ModelArch
from megatron_branch.parallel.agree import agree_on_error, check_on_every_rank
from megatron_branch.precision import dtype_table, long_name

META_FILE = "megatron_branch.json"
FORMAT = "megatron-branch/mcore-checkpoint"
FORMAT_VERSION = 2  # 2: "files" records every file of the checkpoint (size, sha256); 1 had no record
TOKENIZER_SUBDIR = "tokenizer"
DTYPES = dtype_table(("float32", "bfloat16", "float16"))
"""What a converted checkpoint holds (an HF folder holds no float64); precision.py is the one table."""


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    key = dtype.removeprefix("torch.")
    key = long_name(key)
    if key not in DTYPES:
        raise UserError(f"unsupported dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _broadcast_from_rank0(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _make_tmp_dir(out_dir: Path, *, overwrite: bool) -> Path:
    """Rank 0 checks the target and makes a temp folder next to it; every rank gets the path or the same error."""
    result: tuple[str | None, str | None] = (None, None)
    if _rank_world()[0] == 0:
        try:
            result = (str(outputs.make_temp_dir(out_dir, overwrite=overwrite, marker=META_FILE)), None)
        except UserError as e:
            result = (None, str(e))
    path, err = _broadcast_from_rank0(result)
    agree_on_error(err, error=UserError)
    return Path(path)


def check_sharded_keys(sharded: dict[str, Any], arch: ModelArch, stage: bool = False) -> None:
    """The model's checkpoint keys are those of megatron's TE layer spec (param_map.sharded_keys), so the
    checkpoint loads under either spec; a megatron-core that names them otherwise is refused, in one line.
    `stage`: the model is one pipeline stage, whose keys are some of them (the stages together save all)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    from megatron_branch.compat.cpu import CompatError

    keys = {sh.key for sh in sharded.values() if isinstance(sh, ShardedTensor | ShardedTensorFactory)}
    expected = set(sharded_keys(arch))
    if (not keys <= expected) if stage else keys != expected:
        odd = sorted(keys - expected) or [f"(missing) {k}" for k in sorted(expected - keys)]
        raise CompatError(
            f"megatron-core names checkpoint tensor {odd[0]!r} differently from the TE layer spec's names the "
            "parameter map expects (param_map.sharded_keys); megatron-branch targets megatron-core 0.16.1"
        )


def save_mcore_checkpoint(
    model: torch.nn.Module,
    out_dir: str | os.PathLike,
    *,
    arch: ModelArch,
    dtype: torch.dtype,
    tp: int,
    source: str | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Save `model` (this rank's shards) as a dist checkpoint + megatron_branch.json. All ranks call it.

    Every rank writes its shards into a temp folder next to `out_dir`; rank 0 then adds the description (with
    the file record) and the tokenizer files and renames the folder into place (outputs.commit_dir), so
    `out_dir` is never half-written. An error on any rank is raised on every rank (no rank is left waiting in a
    collective). An existing checkpoint at `out_dir` is replaced only with `overwrite`.
    """
    out = Path(out_dir)
    sharded = model.sharded_state_dict()
    stage = getattr(model.config, "pipeline_model_parallel_size", 1) > 1  # a pipeline stage: some of the keys
    check_sharded_keys(
        sharded, arch, stage
    )  # the same on every rank: raised everywhere, before anything is written
    tmp = _make_tmp_dir(out, overwrite=overwrite)
    rank, _ = _rank_world()
    ok = False
    try:
        files = save_sharded(sharded, tmp)
        err = None
        if rank == 0:
            try:
                _finish_on_rank0(
                    model,
                    tmp,
                    out,
                    arch=arch,
                    dtype=dtype,
                    tp=tp,
                    source=source,
                    tokenizer_dir=tokenizer_dir,
                    files=files,
                    overwrite=overwrite,
                )
            except UserError as e:
                err = str(e)
            except Exception as e:  # must reach the other ranks, which wait in agree_on_error
                err = f"cannot write {str(out)!r}: {e}"
        agree_on_error(err, error=UserError)
        ok = True
    finally:
        if not ok and rank == 0:
            outputs.discard(tmp)
    return out


def copy_tokenizer(tokenizer_dir: str | os.PathLike, ckpt_dir: Path) -> None:
    """The tokenizer, in a form transformers loads, into `ckpt_dir/tokenizer/` (mcore-to-hf exports it)."""
    (ckpt_dir / TOKENIZER_SUBDIR).mkdir()
    copy_tokenizer_files(tokenizer_dir, ckpt_dir / TOKENIZER_SUBDIR)


def write_description(ckpt_dir: Path, files: dict[str, Any], **description: Any) -> dict[str, Any]:
    """Write `megatron_branch.json` LAST: the description (arch, dtype, ...) and the record of every file in the
    checkpoint (size and SHA-256: `files` as `save_sharded` hashed the shards, the rest hashed now), which
    loading verifies. Converted and training checkpoints share it (checkpoint/store.py). Returns it."""
    meta = {"format": FORMAT, "version": FORMAT_VERSION, **description}
    meta["files"] = complete_record(ckpt_dir, files)
    (ckpt_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def _finish_on_rank0(
    model: torch.nn.Module,
    tmp: Path,
    out: Path,
    *,
    arch: ModelArch,
    dtype: torch.dtype,
    tp: int,
    source: str | None,
    tokenizer_dir: str | os.PathLike | None,
    files: dict[str, Any],
    overwrite: bool,
) -> None:
    if tokenizer_dir is not None and any((Path(tokenizer_dir) / n).is_file() for n in TOKENIZER_FILES):
        copy_tokenizer(tokenizer_dir, tmp)
    write_description(
        tmp,
        files,
        arch=arch.to_dict(),
        dtype=dtype_name(dtype),
        padded_vocab_size=model.embedding.word_embeddings.weight.shape[0] * tp,
        saved_tensor_parallel=tp,
        source=source,
    )
    outputs.commit_dir(tmp, out, overwrite=overwrite, marker=META_FILE)


def convert_hf_to_mcore(
    hf_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    etp: int | None = None,
    dtype: str | torch.dtype | None = None,
    progress: bool = True,
    overwrite: bool = False,
) -> Path:
    """Convert a local HF folder (any family of models/arch.py) into a megatron-core dist checkpoint at `out_dir`.

    `tp` must divide the number of launched ranks (1 when single process); `ep` (a MoE model's experts split over
    it, inside the data-parallel ranks) must divide launched ranks / tp; `etp` the experts' tensor-parallel size (None:
    tp; 1: every expert whole on each TP rank, as gpt-oss's expert biases need). `dtype` None keeps the storage dtype.
    Everything is checked (on every rank, one verdict) before any model is built.
    """
    from megatron_branch.models import build_model
    from megatron_branch.parallel.groups import ParallelConfig, init_distributed, initialize_parallel

    def validate() -> tuple[ModelArch, HFTensorReader, torch.dtype]:
        if pp != 1:
            raise UserError(
                f"--pp {pp}: pipeline-parallel conversion is not supported; convert with --pp 1 "
                "(a dist checkpoint is layout-independent)"
            )
        outputs.check_output_dir(out_dir, overwrite=overwrite, marker=META_FILE)
        cfg = load_hf_config(hf_dir)
        arch = ModelArch.from_hf_config(cfg, where=str(Path(hf_dir) / "config.json"))
        ParallelConfig(tp=tp, ep=ep, etp=etp)  # etp: 1 or tp (a SettingError, --etp)
        arch.check_tensor_parallel(tp, etp=etp)
        arch.check_expert_parallel(ep, tp=tp, etp=etp)
        reader = HFTensorReader(hf_dir)
        dt = parse_dtype(dtype) or reader.dtype()
        if dt not in DTYPES.values():
            raise UserError(f"checkpoint dtype {dt} is not supported; pass --dtype")
        world = launched_world_size()
        if world % tp:
            raise UserError(
                f"--tp {tp} needs a launch whose process count is a multiple of {tp} (this one has {world})"
            )
        if (world // tp) % ep:
            raise UserError(f"--ep {ep} must divide the launch's {world} processes / --tp {tp}")
        return arch, reader, dt

    arch, reader, dtype = check_on_every_rank(validate)
    init_distributed()
    groups = initialize_parallel(ParallelConfig(tp=tp, ep=ep, etp=etp))
    # Every parameter is overwritten below: skip megatron's random init (a full fp32 master copy of each
    # weight on every rank, filled with normal_()).
    model = build_model(arch, dtype=dtype, tp=tp, init_weights=False, ep=ep, etp=etp)
    padded = arch.padded_vocab_size(tp)
    params = dict(model.named_parameters())
    names = iter_hf_to_mcore(reader.keys(), reader.get, arch, padded_vocab=padded, where=str(hf_dir))
    if progress and _rank_world()[0] == 0:
        from tqdm import tqdm

        names = tqdm(names, total=len(mcore_names(arch)), desc="hf -> mcore", unit="tensor")
    loaded = set()
    with torch.no_grad():
        for name, full in names:
            load_full_tensor(model, name, full, groups.tp, params=params, ep_group=groups.ep)
            loaded.add(name)
    from megatron_branch.checkpoint.experts import global_name, local_experts, rank_size

    ep_rank, _ = rank_size(groups.ep)
    held = {global_name(n, ep_rank, local_experts(list(params))) for n in params}
    assert held <= loaded, sorted(held - loaded)
    return save_mcore_checkpoint(
        model,
        out_dir,
        arch=arch,
        dtype=dtype,
        tp=tp,
        source=str(hf_dir),
        tokenizer_dir=hf_dir,
        overwrite=overwrite,
    )
