"""megatron-core distributed checkpoint -> model at the current TP, and -> Hugging Face folder.

Any checkpoint megatron-branch writes: a converted one, the trainer's final `policy_mcore/` and its
`checkpoints/step_*` (the same description and file record; the optimizer and RNG entries are not read).

A dist checkpoint saved at any TP loads at the current one: megatron-core re-shards every tensor by its global
offsets, including the SwiGLU fc1 (saved as global [gate; up]). The one thing it cannot re-shard is the vocabulary
PADDING, which depends on TP (37 rows pad to 38 at TP2, 40 at TP4): the two vocabulary tensors are therefore read
whole at their saved shape and re-padded here. Before anything is read, the saved tensor shapes are checked
against `megatron_branch.json`, so a checkpoint whose description disagrees with its tensors is refused; and
before that, every file is checked against the record in `megatron_branch.json` (present, full size, SHA-256) and
the files megatron would unpickle are checked for code (checkpoint/integrity.py): a deleted or truncated shard is
named in one line before any tensor is loaded.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch import outputs
from megatron_branch.checkpoint.dist_ckpt import load_sharded
from megatron_branch.checkpoint.hf_io import HF_MARKER, check_tokenizer_dir, write_hf_folder
from megatron_branch.checkpoint.hf_to_mcore import (
    FORMAT,
    FORMAT_VERSION,
    META_FILE,
    TOKENIZER_SUBDIR,
    dtype_name,
    parse_dtype,
)
from megatron_branch.checkpoint.integrity import verify_checkpoint
from megatron_branch.checkpoint.param_map import iter_mcore_to_hf
from megatron_branch.checkpoint.tp import (
    VOCAB_PARAMS,
    full_shape,
    gather_full_state,
    repad_vocab,
    shard_full_tensor,
)
from megatron_branch.errors import UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.parallel import agree
from megatron_branch.parallel.agree import check_on_every_rank


def read_meta(mcore_dir: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's description (JSON; nothing is unpickled). Adds "arch_obj" (a ModelArch)."""
    d = Path(mcore_dir)
    if d.exists() and not d.is_dir():
        raise UserError(f"megatron checkpoint {str(d)!r} is a file; give the checkpoint folder")
    if not d.is_dir():
        raise UserError(f"megatron checkpoint folder {str(d)!r} does not exist")
    f = d / META_FILE
    if not f.is_file():
        raise UserError(f"no {META_FILE}: not a checkpoint written by megatron-branch", where=str(d))
    try:
        meta = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"malformed JSON ({e})", where=str(f)) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
        raise UserError(f"format is {got!r}, expected {FORMAT!r}", where=str(f))
    version = meta.get("version")
    if version not in (1, FORMAT_VERSION):
        raise UserError(f"format version {version!r} is not one this megatron-branch reads", where=str(f))
    files = meta.get("files")
    if version >= 2 and not (
        isinstance(files, dict)
        and all(isinstance(v, dict) and {"size", "sha256"} <= set(v) for v in files.values())
    ):
        raise UserError(
            'the file record ("files": name -> size, sha256) is missing or malformed', where=str(f)
        )
    try:
        meta["arch_obj"] = ModelArch.from_dict(meta["arch"])
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"bad arch description ({e})", where=str(f)) from None
    return meta


def _expected_sharded_tensors(sharded_sd: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """param name -> (checkpoint key, global shape) for every tensor the model will load."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    out = {}
    for name, sh in sharded_sd.items():
        if isinstance(sh, ShardedTensorFactory):
            built = sh.build()
            sh = built[0] if isinstance(built, list) else next(iter(built.values()))
        if isinstance(sh, ShardedTensor):
            out[name] = (sh.key, tuple(sh.global_shape))
    return out


def _why(key: str, saved: Any) -> str:
    """A hint when a norm is saved under the local module's own name, i.e. by a layer spec without megatron's
    `sharded_state_dict_keys_map` (both megatron specs name it as TE does; param_map.sharded_keys)."""
    for te, local in (
        ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
        ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
    ):
        if te in key and key.replace(te, local) in saved:
            return (
                f" (it has {key.replace(te, local)!r}: written by a layer spec without megatron's "
                "sharded_state_dict_keys_map; megatron's local and TE specs both save the TE name)"
            )
    return ""


def load_mcore_checkpoint(
    mcore_dir: str | os.PathLike,
    *,
    tp_group: Any = None,
    tp: int = 1,
    etp: int | None = None,
    dtype: str | torch.dtype | None = None,
) -> tuple[torch.nn.Module, ModelArch, dict[str, Any]]:
    """Build the model at TP `tp` and expert TP `etp` (None = tp; megatron's parallel_state must match) and load the
    checkpoint into it.

    The checkpoint may come from megatron's local or TransformerEngine layer spec: both save the same keys
    (param_map.sharded_keys; a TE run's `*._extra_state` entries load into the local layers, whose
    set_extra_state ignores them; not yet tried on a checkpoint written by TE). All ranks call it.
    Returns (model, arch, meta).
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_branch.models import build_model

    d = Path(mcore_dir)
    meta = read_meta(d)
    arch: ModelArch = meta["arch_obj"]
    arch.check_tensor_parallel(tp, etp=etp)
    # Before megatron reads anything: every file present, full size, undamaged; nothing pickled runs code.
    verify_checkpoint(d, meta.get("files"), recorded_in=META_FILE)
    dt = parse_dtype(dtype) or parse_dtype(meta.get("dtype", "float32"))
    model = build_model(arch, dtype=dt, tp=tp, etp=etp)
    sharded = model.sharded_state_dict()
    try:
        saved = dist_checkpointing.load_tensors_metadata(str(d))
    except (
        Exception
    ) as e:  # a missing/corrupt metadata file raises from deep inside torch.distributed.checkpoint
        raise UserError(
            f"cannot read dist checkpoint metadata ({str(e).strip().splitlines()[0]})", where=str(d)
        ) from None
    for name, (key, shape) in _expected_sharded_tensors(sharded).items():
        if key not in saved:
            raise UserError(
                f"checkpoint lacks tensor {key!r} that {META_FILE} implies{_why(key, saved)}", where=str(d)
            )
        got = tuple(saved[key].global_shape)
        ok = (
            got == shape if name not in VOCAB_PARAMS else (got[1:] == shape[1:] and got[0] >= arch.vocab_size)
        )
        if not ok:
            raise UserError(
                f"tensor {key!r} has shape {list(got)} but {META_FILE} implies {list(shape)}", where=str(d)
            )
    # Vocabulary tensors: read whole at the saved (padded) shape, re-pad and slice for this rank below.
    # Every rank reads the whole tensor, so exactly one rank may be its main replica (replica_id 0): the global
    # rank is unique across TP and DP (the TP rank alone repeats over data-parallel replicas, which megatron
    # rejects as an invalid access pattern).
    rank = dist.get_rank(group=tp_group) if tp_group is not None and dist.is_initialized() else 0
    replica = dist.get_rank() if dist.is_initialized() else 0
    vocab_keys = {}
    for name in VOCAB_PARAMS:
        if name in sharded:
            key = sharded[name].key
            vocab_keys[name] = key
            buf = torch.empty(tuple(saved[key].global_shape), dtype=dt)
            sharded[name] = ShardedTensor.from_rank_offsets(key, buf, replica_id=replica)
    state = load_sharded(sharded, d, verify=False)  # verified above
    # megatron merges the checkpoint's common state (a training checkpoint's optimizer groups, ...) into what it
    # returns: only the model's own entries are loaded into the model
    state = {k: v for k, v in state.items() if k in sharded}
    params = dict(model.named_parameters())
    for name in vocab_keys:
        p = params[name]
        full = repad_vocab(state[name], full_shape(p, tp)[0])
        state[name] = shard_full_tensor(full, name=name, dim=0, rank=rank, size=tp)
    model.load_state_dict(state, strict=True)
    return model, arch, meta


def convert_mcore_to_hf(
    mcore_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    tokenizer_dir: str | os.PathLike | None = None,
    max_shard_size: int | str = "5GB",
    dtype: str | torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write an HF folder (config.json, safetensors shards + index, tokenizer files) from a dist checkpoint.

    Loads at the current world's TP (the whole world when launched, 1 when single process); rank 0 writes.
    The output, the description and the options are checked before any work, on every rank.
    """
    from megatron_branch.checkpoint.hf_io import parse_size
    from megatron_branch.parallel.groups import ParallelConfig, init_distributed, initialize_parallel

    def validate() -> dict[str, Any]:
        outputs.check_output_dir(out_dir, overwrite=overwrite, marker=HF_MARKER)
        meta = read_meta(mcore_dir)  # before any distributed set-up: a wrong folder fails fast
        parse_size(max_shard_size)
        parse_dtype(dtype)
        if tokenizer_dir is not None:
            check_tokenizer_dir(tokenizer_dir)
        return meta

    meta = check_on_every_rank(validate)
    _, world = init_distributed()
    arch = meta["arch_obj"]
    etp = 1 if arch.is_moe and arch.linear_bias else None  # megatron allows expert biases at expert TP 1 only
    try:
        arch.check_tensor_parallel(world, etp=etp)
        tp = world
    except UserError:  # a world the heads do not split over: every rank loads the whole model
        tp = 1
    groups = initialize_parallel(ParallelConfig(tp=tp, etp=etp))
    model, arch, meta = load_mcore_checkpoint(
        mcore_dir, tp_group=groups.tp, tp=groups.tp_size, etp=etp, dtype=dtype
    )
    full = gather_full_state(model, groups.tp)
    del model
    if tokenizer_dir is None and (Path(mcore_dir) / TOKENIZER_SUBDIR).is_dir():
        tokenizer_dir = Path(mcore_dir) / TOKENIZER_SUBDIR
    out = Path(out_dir)

    def write() -> None:
        cfg = arch.to_hf_config()
        cfg.dtype = dtype_name(next(iter(full.values())).dtype)
        write_hf_folder(
            out,
            cfg,
            iter_mcore_to_hf(full.__getitem__, arch, where=str(mcore_dir)),
            max_shard_size=max_shard_size,
            tokenizer_dir=tokenizer_dir,
            overwrite=overwrite,
        )

    agree.write_on_rank0(write)  # a failure on rank 0 is raised on every rank
    return out
