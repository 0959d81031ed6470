"""The run folder: created atomically (set-up happens in a temp folder renamed into place before the first
step), so a bad config, bad data or a failing set-up leaves nothing behind; on resume the folder is reused, and
what set-up rewrites in it (the tokenizer below, config.yaml, engine.json, metrics.jsonl) is replaced whole."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_branch.errors import UserError
from megatron_branch.outputs import apply_umask, atomic_dir, check_parent, temp_path_beside
from megatron_branch.parallel.agree import agree_on_error

HF_TOKENIZER = "hf_tokenizer"
"""OUT/hf_tokenizer/: the run's tokenizer in transformers' format (copied into checkpoints and the HF export)."""
TOKENIZER_MARKER = "tokenizer_config.json"
"""A file every transformers tokenizer folder holds (save_pretrained writes it): what `--overwrite` replaces."""


def _broadcast(value: object) -> object:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextlib.contextmanager
def run_folder(target: Path, *, resume: bool) -> Iterator[Path]:
    """Yield the folder set-up writes into: `target` itself when resuming an existing run, else a fresh temp
    folder beside it that becomes `target` when the block exits cleanly (rank 0 renames; all ranks call it).

    A fresh run refuses a `target` holding anything (so two runs never mix their metrics and checkpoints).
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    result: tuple[str | None, bool, str | None] = (None, False, None)
    if rank == 0:
        try:
            if resume and target.is_dir():
                result = (str(target), True, None)
            else:
                if target.exists() and (not target.is_dir() or any(target.iterdir())):
                    raise UserError(
                        f"run folder {str(target)!r} already holds a run; resume it with --resume auto "
                        "(trainer.resume_mode=auto) or choose another trainer.default_local_dir"
                    )
                # the outputs rule (docs/errors.md): a missing parent folder is refused, never created
                check_parent(target, "run folder")
                tmp_dir = temp_path_beside(target)
                os.mkdir(tmp_dir)
                result = (str(tmp_dir), False, None)
        except (UserError, OSError) as e:
            result = (None, False, str(e))
    path, existing, err = _broadcast(result)  # type: ignore[misc]
    if err:
        raise UserError(err)
    tmp = Path(path)
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        err = None
        if rank == 0 and not existing:
            if ok:
                try:
                    if target.exists():
                        target.rmdir()  # checked empty above
                    apply_umask(tmp)
                    tmp.replace(target)
                except OSError as e:
                    err = f"cannot create run folder {str(target)!r}: {e}"
                    shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        if ok:
            agree_on_error(err, error=UserError)


def save_tokenizer(tokenizer: Any, folder: Path) -> None:
    """`tokenizer` as transformers loads it, in `folder` (every checkpoint and the HF export carry it). Written in
    a temp folder beside it and swapped in (outputs.atomic_dir): on resume a failure keeps the previous one."""
    with atomic_dir(folder, overwrite=True, marker=TOKENIZER_MARKER, what="tokenizer folder") as tmp:
        try:
            tokenizer.save_hf(tmp)
        except Exception as e:  # transformers' conversion: one line, before any step
            raise UserError(f"cannot save the tokenizer for transformers ({type(e).__name__}: {e})") from None
