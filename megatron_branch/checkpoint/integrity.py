"""Checking a megatron-core dist checkpoint BEFORE anything of it is loaded: complete, undamaged, no pickled code.

What megatron-core 0.16.1 / torch 2.13 would otherwise unpickle from a checkpoint folder, and how each is made safe:
- `.metadata` (torch.distributed.checkpoint's index) is read with a plain `pickle.load`
  (`FileSystemReader.read_metadata`): any code in it runs, whatever torch's `weights_only` default. Here it is
  first read by `SafeMetadataUnpickler`, which admits only the dataclasses of that index (a fixed allow-list);
  a file that needs anything else is refused before megatron reads it.
- byte items in the `.distcp` shards (megatron's ShardedObjects: `_extra_state`, RNG states, ...) are loaded by
  torch's `DefaultLoadPlanner.load_bytes` with `torch.load(..., weights_only=False)`. Here each is first
  loaded with `weights_only=True` (numpy arrays admitted, as torch's docs recommend for RNG states).
- `common.pt` and ShardedObject `*.pt` files: megatron's `TorchCommonLoadStrategy` calls `torch.load` WITHOUT
  `weights_only`, so `TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1` (or an older torch) makes it unpickle anything. Here
  they are loaded with `weights_only=True` explicitly first, and `SafeCommonLoadStrategy` (handed to
  `dist_checkpointing.load`) loads them that way too.
- tensor items: torch loads them with `weights_only=True` explicitly already.
- `metadata.json` (megatron's backend description) is JSON; it is checked to parse, as megatron does not guard it.
Completeness: the file list that `dist_ckpt.save_sharded` records (size and SHA-256 of every file, hashed while
writing) is checked first, then every storage item `.metadata` names must lie inside its file. Every problem is
one `UserError` naming the file. A collective when torch.distributed is initialised (the checksums are split over
the ranks and the verdict is shared).
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_branch.errors import UserError, one_line

METADATA_FILE = ".metadata"
COMMON_FILE = "common.pt"
BACKEND_FILE = "metadata.json"
HASH = "sha256"
_CHUNK = 1 << 20

# (module, name) pairs a torch.distributed.checkpoint `.metadata` file may name (torch 2.13): the index's
# dataclasses and what they hold (sizes, dtypes, layouts, the checkpoint id path).
_DCP_MD = "torch.distributed.checkpoint.metadata"
_METADATA_GLOBALS = {
    (_DCP_MD, n)
    for n in (
        "Metadata",
        "MetadataIndex",
        "ChunkStorageMetadata",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles a dist-checkpoint index, refusing every global outside the allow-list (Python's documented
    way to restrict unpickling: override `find_class`)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}")


def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.new(HASH)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class HashingStream(io.RawIOBase):
    """A write-only file that hashes what is written (the checksum costs no second read). Falls back to hashing
    the finished file if the writer ever seeks."""

    def __init__(self, f: Any, record: dict[str, Any], name: str) -> None:
        self._f, self._record, self._name = f, record, name
        self._h = hashlib.new(HASH)
        self._seeked = False

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        n = self._f.write(b)
        self._h.update(memoryview(b)[:n] if n is not None else b)
        return n

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        if not (whence == 0 and offset == self._f.tell()):
            self._seeked = True
        return self._f.seek(offset, whence)

    def seekable(self) -> bool:
        return self._f.seekable()

    def fileno(self) -> int:
        return self._f.fileno()

    def flush(self) -> None:
        if not self._f.closed:
            self._f.flush()

    def close(self) -> None:
        if not self.closed:
            self._f.close()
            path = self._f.name
            digest = file_digest(path) if self._seeked else self._h.hexdigest()
            self._record[self._name] = {"size": os.path.getsize(path), HASH: digest}
        super().close()


# --- checks -----------------------------------------------------------------------------------------------------
def read_metadata_safely(ckpt: Path) -> Any:
    """The dist-checkpoint index, unpickled by the allow-listed unpickler (never plain pickle)."""
    f = ckpt / METADATA_FILE
    if not f.is_file():
        raise UserError(f"checkpoint file {METADATA_FILE} is missing", where=str(ckpt))
    try:
        with open(f, "rb") as fh:
            md = SafeMetadataUnpickler(fh).load()
    except pickle.UnpicklingError as e:
        raise UserError(f"not a dist-checkpoint index ({one_line(e)}); not loaded", where=str(f)) from None
    except Exception as e:  # truncated or garbage: EOFError, ValueError, ...
        raise UserError(
            f"damaged dist-checkpoint index ({type(e).__name__}: {one_line(e)})", where=str(f)
        ) from None
    if type(md).__name__ != "Metadata" or not isinstance(getattr(md, "storage_data", None), dict):
        raise UserError("not a dist-checkpoint index", where=str(f))
    return md


def _safe_globals() -> list[Any]:
    """numpy arrays in pickles (RNG states): torch's documented additions for `weights_only=True`."""
    try:
        import numpy as np
    except ImportError:  # pragma: no cover
        return []
    core = getattr(np, "_core", None) or np.core
    return [
        core.multiarray._reconstruct,
        np.ndarray,
        np.dtype,
        *{type(np.dtype(t)) for t in np.typecodes["All"]},
    ]


def short_reason(e: BaseException) -> str:
    """One short line for a loading failure: the gist of torch's weights_only refusal (its message is a page),
    the first failure of a torch.distributed.checkpoint CheckpointException (its message carries tracebacks)."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        e = first[0] if isinstance(first, tuple) else first
    text = one_line(e)
    if "WeightsUnpickler error:" in text:
        text = "not plain data: " + text.split("WeightsUnpickler error:", 1)[1].split(". ")[0].strip()
    return f"{type(e).__name__}: {text[:200]}"


def torch_load_weights_only(src: Any, *, where: str) -> Any:
    """`torch.load(src, weights_only=True)` (explicitly), a refusal or damage being one UserError naming `where`."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(src, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise UserError(f"refusing to unpickle ({short_reason(e)})", where=where) from None
    except Exception as e:
        raise UserError(f"damaged or not a torch file ({short_reason(e)})", where=where) from None


def _check_listed_files(
    ckpt: Path, files: Mapping[str, Any], *, rank: int, world: int, recorded_in: str
) -> None:
    for name in sorted(files):
        if not (ckpt / name).is_file():
            raise UserError(f"checkpoint file {name} is missing ({recorded_in} lists it)", where=str(ckpt))
    for name in sorted(files):
        size = os.path.getsize(ckpt / name)
        if size != files[name]["size"]:
            raise UserError(
                f"checkpoint file {name} is truncated or damaged: {size} bytes, {recorded_in} records "
                f"{files[name]['size']}",
                where=str(ckpt),
            )
    for i, name in enumerate(sorted(files)):
        if i % world == rank and file_digest(ckpt / name) != files[name][HASH]:
            raise UserError(
                f"checkpoint file {name} is damaged: its {HASH} differs from the one {recorded_in} records",
                where=str(ckpt),
            )


def _check_items(ckpt: Path, md: Any) -> None:
    """Every storage item inside its file; byte items loadable with weights_only=True."""
    sizes: dict[str, int] = {}
    byte_keys = {k for k, v in md.state_dict_metadata.items() if type(v).__name__ == "BytesStorageMetadata"}
    for index, info in md.storage_data.items():
        rel = str(info.relative_path)
        if rel not in sizes:
            p = ckpt / rel
            if Path(rel).is_absolute() or ".." in Path(rel).parts or not p.is_file():
                raise UserError(
                    f"checkpoint file {rel} is missing ({METADATA_FILE} names it)", where=str(ckpt)
                )
            sizes[rel] = os.path.getsize(p)
        if info.offset + info.length > sizes[rel]:
            raise UserError(
                f"checkpoint file {rel} is truncated: {sizes[rel]} bytes, {METADATA_FILE} places data up to byte "
                f"{info.offset + info.length}",
                where=str(ckpt),
            )
        if getattr(info, "transform_descriptors", None):
            raise UserError(f"{rel}: transformed (compressed) items are not supported", where=str(ckpt))
        if index.fqn in byte_keys:
            with open(ckpt / rel, "rb") as f:
                f.seek(info.offset)
                data = io.BytesIO(f.read(info.length))
            torch_load_weights_only(data, where=f"{ckpt / rel} (item {index.fqn})")


def _check_backend_config(ckpt: Path) -> None:
    """megatron's `metadata.json` (JSON: which backend wrote the checkpoint), which megatron parses unguarded."""
    import json

    f = ckpt / BACKEND_FILE
    try:
        ok = isinstance(json.loads(f.read_text(encoding="utf-8")), dict)
    except FileNotFoundError:
        raise UserError(f"checkpoint file {BACKEND_FILE} is missing", where=str(ckpt)) from None
    except (OSError, ValueError):
        ok = False
    if not ok:
        raise UserError("damaged checkpoint file: not a JSON object", where=str(f))


def verify_checkpoint(ckpt: str | os.PathLike, files: Mapping[str, Any] | None, *, recorded_in: str) -> None:
    """Refuse a dist checkpoint that is incomplete, damaged or carries pickled code, before anything is loaded.

    `files`: {name: {"size", "sha256"}} as `save_sharded` returned it (None for a checkpoint without a record:
    then only the structure is checked). Collective when torch.distributed is initialised.
    """
    import torch.distributed as dist

    from megatron_branch.parallel.agree import agree_on_error

    d = Path(ckpt)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    err = None
    try:
        if files is not None:
            _check_listed_files(d, files, rank=rank, world=world, recorded_in=recorded_in)
        _check_backend_config(d)
        md = read_metadata_safely(d)
        _check_items(d, md)
        for pt in sorted(d.rglob("*.pt")):
            torch_load_weights_only(pt, where=str(pt))
    except UserError as e:
        err = str(e)
    agree_on_error(err, error=UserError)


def safe_common_strategy() -> Any:
    """megatron's common-state loader with `weights_only=True` passed explicitly (megatron passes nothing)."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class SafeCommonLoadStrategy(TorchCommonLoadStrategy):  # type: ignore[misc,valid-type]
        def load_common(self, checkpoint_dir: Any) -> Any:
            path = Path(checkpoint_dir) / COMMON_FILE
            if not path.is_file():
                raise UserError(f"checkpoint file {COMMON_FILE} is missing", where=str(checkpoint_dir))
            return torch_load_weights_only(path, where=str(path))

        def load_sharded_objects(self, sharded_objects_state_dict: Any, checkpoint_dir: Any) -> Any:
            from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
            from megatron.core.dist_checkpointing.mapping import ShardedObject

            def load_one(sh_obj: Any) -> Any:
                if not isinstance(sh_obj, ShardedObject):
                    return sh_obj
                path = Path(checkpoint_dir) / f"{sh_obj.unique_key}.pt"
                if not path.is_file():
                    raise UserError(
                        f"object shard {sh_obj.unique_key}.pt is missing", where=str(checkpoint_dir)
                    )
                return torch_load_weights_only(path, where=str(path))

            return dict_list_map_inplace(load_one, sharded_objects_state_dict)

    return SafeCommonLoadStrategy()
