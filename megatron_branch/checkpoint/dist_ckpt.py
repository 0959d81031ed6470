"""Saving and loading megatron-core dist checkpoints so that an error on one rank is an error on every rank.

megatron-core checks a sharded state dict (every tensor element owned by exactly one main replica) on global
rank 0 ONLY and raises there, while the other ranks walk on into the collectives of torch.distributed.checkpoint
and wait for rank 0 until the process-group timeout. That is how a wrong `replica_id` turned into a "hang" of
the multi-rank checkpoint test. Here the same check runs before megatron's, its verdict is shared with every
rank, and every rank raises the same `CheckpointError`; megatron's own (rank-0-only) check is then skipped.

Integrity: `save_sharded` returns the checkpoint's file record (size and SHA-256 of every file; the shards are
hashed while they are written) for the caller to store in its description, and `load_sharded` checks it, and
refuses pickled code, before megatron reads anything (checkpoint/integrity.py).

megatron's dist_checkpointing always uses the default (whole-world) process group, so every rank of the world
calls these functions, in the same order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_branch.checkpoint.integrity import (
    HashingStream,
    complete_record,
    safe_common_strategy,
    short_reason,
    verify_checkpoint,
)
from megatron_branch.compat.cpu import CompatError
from megatron_branch.errors import UserError
from megatron_branch.parallel.agree import agree_on_error

__all__ = [
    "CheckpointError",
    "check_sharding",
    "load_sharded",
    "save_sharded",
    "sync_save_strategy",
]


class CheckpointError(RuntimeError):
    """A dist checkpoint cannot be saved or loaded as asked (raised on every rank alike)."""


def _megatron(module: str, *names: str) -> list[Any]:
    import importlib

    mod = importlib.import_module(module)
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise CompatError(
            f"megatron-core changed: {module}.{missing[0]} is gone; megatron-branch's checkpoint code targets "
            "megatron-core 0.16.1"
        )
    return [getattr(mod, n) for n in names]


def check_sharding(sharded_state_dict: dict[str, Any]) -> None:
    """megatron's sharding-integrity check, with its verdict on every rank. A collective (whole world).

    `sharded_state_dict` is not modified (megatron's load_preprocess works on a copy).
    """
    (load_preprocess,) = _megatron("megatron.core.dist_checkpointing.state_dict_utils", "load_preprocess")
    (extract_sharded_base,) = _megatron("megatron.core.dist_checkpointing.utils", "extract_sharded_base")
    determine_global_metadata, validate_sharding_integrity = _megatron(
        "megatron.core.dist_checkpointing.validation",
        "determine_global_metadata",
        "validate_sharding_integrity",
    )
    if not dist.is_initialized():
        raise CheckpointError("megatron dist checkpoints need torch.distributed (a world of one is fine)")
    preprocessed, _, _ = load_preprocess(sharded_state_dict)
    sharded_part, _ = extract_sharded_base(preprocessed)
    _, global_metadata = determine_global_metadata(sharded_part)
    err = None
    if dist.get_rank() == 0:
        try:
            validate_sharding_integrity(global_metadata)
        except Exception as e:  # CheckpointingException or an AssertionError from megatron's checks
            err = f"invalid sharding: {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    agree_on_error(err, error=CheckpointError)


def _hashing_file_system(record: dict[str, Any]) -> Any:
    """torch's FileSystem whose shard streams (`*.distcp`) hash what is written into `record[name]`."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):  # type: ignore[misc,valid-type]
        @contextlib.contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
            if mode != "wb" or not str(path).endswith(".distcp"):
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            stream = HashingStream(open(path, "wb"), record, Path(path).name)  # noqa: SIM115 (closed below)
            try:
                yield stream
            finally:
                stream.close()

    return HashingFileSystem()


@contextlib.contextmanager
def interrupts_unwrapped() -> Iterator[None]:
    """Ctrl-C inside torch.distributed.checkpoint stays a KeyboardInterrupt. torch's save/load run each step under
    a collective that catches BaseException per rank and raises them all as one CheckpointException (itself a
    BaseException), which no `except KeyboardInterrupt` matches: a run interrupted while writing a checkpoint printed
    torch's traceback and exited 1 instead of the one interrupted line and 130 (tests/unit/test_checkpoint_io.py)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as e:
        if any(isinstance(failure[0], KeyboardInterrupt) for failure in e.failures.values()):
            raise KeyboardInterrupt from None
        raise


def sync_save_strategy(record: dict[str, Any] | None = None) -> Any:
    """megatron's `torch_dist` format, written synchronously by torch's FileSystemWriter in this process.

    megatron's own writer (FileSystemWriterAsync, also used for "synchronous" saves) is unusable here:
    - it forks one writer process per bucket, and each child calls `psutil` to log its memory; psutil is not a
      dependency of megatron-core (not installed here), the child dies, and the parent then waits forever in
      `count_queue.join()` for a task the child never marked done: a crash in a child is a hang in the parent;
    - it first stages tensors to host memory and calls `torch.cuda.synchronize()`, which raises without CUDA;
    - it spawns a multiprocessing Manager (a fresh interpreter) for the results queue.
    The files are the same torch.distributed.checkpoint layout (`__<rank>_<i>.distcp` + `.metadata`), so
    megatron's loader, and any megatron training run, reads them. None of the three issues applies to this
    writer, so no CUDA shim is needed for saving. `record` (when given) receives {shard file: {size, sha256}} of
    the shards this rank writes, hashed while writing.
    """
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    base, planner_cls, replace_keys, to_pyt = _megatron(
        "megatron.core.dist_checkpointing.strategies.torch",
        "TorchDistSaveShardedStrategy",
        "MCoreSavePlanner",
        "_replace_state_dict_keys_with_sharded_keys",
        "mcore_to_pyt_state_dict",
    )

    class SyncTorchDistSave(base):  # type: ignore[misc,valid-type]
        def save(self, sharded_state_dict: Any, checkpoint_dir: Any) -> None:
            # The same translation as megatron's TorchDistSaveShardedStrategy.async_save, then torch's writer.
            sharded_state_dict, _, _ = replace_keys(sharded_state_dict, self.keep_only_main_replica)
            pyt_state_dict = to_pyt(sharded_state_dict, False)
            writer = FileSystemWriter(str(checkpoint_dir), thread_count=1)
            if record is not None:
                writer.fs = _hashing_file_system(record)
            with interrupts_unwrapped():
                dcp_save(
                    pyt_state_dict,
                    storage_writer=writer,
                    planner=planner_cls(
                        dedup_replicated_tensors=not self.keep_only_main_replica, flatten_state_dict=False
                    ),
                )

    return SyncTorchDistSave("torch_dist", 1)


def save_sharded(sharded_state_dict: dict[str, Any], checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """`dist_checkpointing.save` with the synchronous writer and an every-rank sharding check. All ranks call it.

    Returns, on every rank, the checkpoint's file record {file name: {"size", "sha256"}} (every file in
    `checkpoint_dir` after the save; the shards hashed while written) to be stored with the checkpoint and given
    back to `load_sharded`.
    """
    from megatron.core import dist_checkpointing

    check_sharding(sharded_state_dict)
    mine: dict[str, Any] = {}
    dist_checkpointing.save(
        sharded_state_dict,
        str(checkpoint_dir),
        sharded_strategy=sync_save_strategy(mine),
        validate_access_integrity=False,  # done above, on every rank
    )
    parts: list[Any] = [mine]
    if dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)  # also: every rank has finished writing
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        files = {k: v for part in parts for k, v in part.items()}
        box = [
            complete_record(checkpoint_dir, files)
        ]  # .metadata, common.pt, metadata.json: small, hashed now
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def load_sharded(
    sharded_state_dict: dict[str, Any],
    checkpoint_dir: str | os.PathLike,
    *,
    files: dict[str, Any] | None = None,
    verify: bool = True,
    recorded_in: str = "the checkpoint's file record",
) -> dict[str, Any]:
    """`dist_checkpointing.load` after an every-rank sharding check. All ranks call it.

    First (`verify`, the default) the checkpoint is checked against `files` (what `save_sharded` returned; None
    checks the structure only) and refused if pickled code is in it (checkpoint/integrity.py); `verify=False`
    when the caller has just run `verify_checkpoint` itself. The common state is loaded with weights_only=True.
    """
    from megatron.core import dist_checkpointing

    if verify:
        verify_checkpoint(checkpoint_dir, files, recorded_in=recorded_in)
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from torch.distributed.checkpoint.api import CheckpointException

    check_sharding(sharded_state_dict)
    try:
        with interrupts_unwrapped():
            return dist_checkpointing.load(
                sharded_state_dict,
                str(checkpoint_dir),
                common_strategy=safe_common_strategy(),
                validate_access_integrity=False,
            )
    except (CheckpointingException, CheckpointException) as e:
        # torch's reader gathers every rank's failure into one CheckpointException, raised on every rank
        raise UserError(
            f"cannot load the dist checkpoint ({short_reason(e)})", where=str(checkpoint_dir)
        ) from None
