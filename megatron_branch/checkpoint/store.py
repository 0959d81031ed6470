"""A folder of numbered megatron-core dist checkpoints, each written atomically and verified before it loads.

    store = CheckpointStore(run_dir / "checkpoints")
    store.save(step, sharded_state_dict, common={"step": step, ...}, describe={...})   # every rank calls it
    path = store.newest_verified(notice=print)         # newest checkpoint that verifies (fallback noticed) or None
    state, common = store.load(path, sharded_state_dict)                              # every rank calls it

Layout: `ROOT/step_00000010/` = the torch_dist files of `megatron.core.dist_checkpointing` (model, optimizer,
per-rank RNG as ShardedObjects, ...), `train_state.json` (the `common` dict: step, data position, scheduler state,
layout), whatever `finish` adds (the tokenizer) and, written LAST, `megatron_branch.json`: the description
converted checkpoints carry (arch, dtype, ... from `describe`, so `convert mcore-to-hf` exports any training
checkpoint) with the record of EVERY file, train_state.json included (size and SHA-256: the converter's own
`write_description` / `verify_checkpoint`, checkpoint/hf_to_mcore.py and integrity.py). Atomicity: every rank
writes into one temp folder beside the target; after all ranks finished, rank 0 writes the state file and the
description and renames the folder into place. A crash before the rename leaves a `.step_*.tmp-*` folder that the
store ignores (and the next save removes). A folder that is damaged afterwards (a flipped byte, a deleted or
truncated file) fails verification, named in one line; `newest_verified` then falls back to the previous one.

Errors on one rank are raised on every rank (`agree_on_error`), so no rank waits forever in a collective.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_branch.checkpoint.dist_ckpt import load_sharded, save_sharded
from megatron_branch.checkpoint.hf_to_mcore import META_FILE, write_description
from megatron_branch.checkpoint.integrity import verify_checkpoint
from megatron_branch.errors import UserError
from megatron_branch.outputs import apply_umask
from megatron_branch.parallel.agree import agree_on_error

STATE_FILE = "train_state.json"
FORMAT = "megatron-branch/train-checkpoint"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _broadcast(value: Any) -> Any:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class CheckpointStore:
    """Numbered checkpoints under `root`. Collective methods (`save`, `load`, `newest_verified`) are called by all ranks."""

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None) -> None:
        self.root = Path(root)
        self.keep_last = keep_last

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the checkpoint folders, complete or not, oldest first (this process's view of the folder;
        temp folders of an unfinished save are not listed)."""
        if not self.root.is_dir():
            return []
        out = [int(m.group(1)) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
        return sorted(out)

    def verify(self, path: str | os.PathLike) -> None:
        """Refuse (one UserError, on every rank) a checkpoint that is incomplete, damaged or not plain data: its
        description present and readable, then every file it records present, of its size and SHA-256."""
        d = Path(path)
        err, files = None, None
        try:
            body = json.loads((d / META_FILE).read_text())
            files = body["files"]
            if not isinstance(files, dict):
                raise TypeError("not a mapping")
        except FileNotFoundError:
            err = f"{d}: incomplete checkpoint: {META_FILE} (its file record, written last) is missing"
        except (OSError, ValueError, KeyError, TypeError) as e:
            err = f"{d / META_FILE}: unreadable file record ({type(e).__name__}: {e})"
        agree_on_error(err, error=UserError)
        verify_checkpoint(d, files, recorded_in=META_FILE)

    def newest_verified(self, notice: Callable[[str], None]) -> Path | None:
        """The newest checkpoint that verifies; each newer one that does not is named through `notice` (one line),
        never skipped silently. None when there is no checkpoint; a UserError when none verifies. Collective."""
        steps = _broadcast(self.steps() if _rank() == 0 else None)
        first_error = None
        for step in reversed(steps):
            try:
                self.verify(self.path(step))
            except UserError as e:
                first_error = first_error or str(e)
                notice(f"checkpoint {self.path(step).name} is not usable ({e}); trying the one before")
                continue
            return self.path(step)
        if first_error is not None:
            raise UserError(f"no checkpoint under {str(self.root)!r} verifies (the newest: {first_error})")
        return None

    # ---- save ----------------------------------------------------------------------------------------------
    def save(
        self,
        step: int,
        sharded_state_dict: dict[str, Any],
        *,
        common: dict[str, Any],
        describe: dict[str, Any] | None = None,
        finish: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write checkpoint `step` atomically. `common` must be JSON data (rank 0's copy is written); `describe`
        the description converted checkpoints carry (arch, dtype, padded_vocab_size, saved_tensor_parallel, ...),
        which makes the checkpoint exportable by `convert mcore-to-hf`.

        `finish(tmp_dir)` runs on rank 0 after the shards are written and before the state file, the description
        and the rename (e.g. to add a tokenizer); a failure there also leaves the previous checkpoint newest.
        """
        target = self.path(step)
        tmp, err = None, None
        if _rank() == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                for stale in self.root.glob(".step_*.tmp-*"):  # left by a crash mid-save
                    shutil.rmtree(stale, ignore_errors=True)
                tmp = tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=self.root)
            except OSError as e:
                err = f"cannot create checkpoint folder under {str(self.root)!r}: {e.strerror or e}"
        tmp, err = _broadcast((tmp, err))
        if err:
            raise UserError(err)
        tmp_path = Path(tmp)
        files = save_sharded(sharded_state_dict, tmp_path)
        err = None
        if _rank() == 0:
            try:
                if finish is not None:
                    finish(tmp_path)
                body = {"format": FORMAT, "step": step, **common}
                (tmp_path / STATE_FILE).write_text(json.dumps(body, indent=1) + "\n")
                write_description(tmp_path, files, **(describe or {}), kind=FORMAT, step=step)
                apply_umask(tmp_path)  # mkdtemp made it 0700: a checkpoint is as readable as the umask says
                if target.exists():  # a re-save of the same step (after resume): replace it
                    shutil.rmtree(target)
                os.replace(tmp_path, target)
                self._prune()
            except Exception as e:  # must reach the other ranks, which wait in agree_on_error
                err = f"cannot write checkpoint {str(target)!r}: {e}"
                shutil.rmtree(tmp_path, ignore_errors=True)
        agree_on_error(err, error=UserError)
        return target

    def _prune(self) -> None:
        if self.keep_last is None:
            return
        for s in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.path(s), ignore_errors=True)

    # ---- load ----------------------------------------------------------------------------------------------
    def read_common(self, path: str | os.PathLike) -> dict[str, Any]:
        f = Path(path) / STATE_FILE
        try:
            body = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise UserError(f"unreadable checkpoint state ({e})", where=str(f)) from None
        if body.get("format") != FORMAT:
            raise UserError(f"format is {body.get('format')!r}, expected {FORMAT!r}", where=str(f))
        return body

    def load(
        self, path: str | os.PathLike, sharded_state_dict: dict[str, Any], *, verified: bool = False
    ) -> tuple[dict[str, Any], dict]:
        """Load the shards described by `sharded_state_dict` and the common state, after verifying the checkpoint
        (unless the caller just did: `verified`). All ranks call it."""
        if not verified:
            self.verify(path)
        common = self.read_common(path)
        state = load_sharded(sharded_state_dict, path, verify=False)
        return state, common


def rng_sharded_object(key: str, state: Any) -> Any:
    """A per-rank object (RNG states differ by rank) as a megatron ShardedObject over the whole world."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world = dist.get_world_size() if dist.is_initialized() else 1
    return ShardedObject(key, state, (world,), (_rank(),), replica_id=0)
