"""Read and write Hugging Face model folders (config.json + safetensors), one tensor at a time.

Reading never downloads: the config is parsed from the local folder only, and weights are read from safetensors
only (pickled `.bin`/`.pt` weights are never opened: unpickling runs code). Every failure of the user's files
(no folder, no config, an index naming a missing shard, a truncated or corrupt shard) is a one-line `UserError`
that names the file. Writing follows megatron_branch.outputs: a temporary folder next to the target, renamed at
the end, so a failure never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from megatron_branch import outputs
from megatron_branch.checkpoint.fused_experts import is_fused
from megatron_branch.errors import UserError

HF_MARKER = "config.json"  # every HF model folder has one: --overwrite replaces only such folders
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.bin")
TOKENIZER_FILES = (
    "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
"""What a transformers tokenizer folder may hold (copied whole: special tokens and chat template kept)."""
FUSED_EXPERT_SUFFIXES = (".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")
"""A MoE layer's experts stored as 3-D tensors (transformers' in-memory layout, which some checkpoints keep)."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_hf_config(hf_dir: str | os.PathLike) -> Any:
    """The transformers config of a local folder (never downloads)."""
    d = Path(hf_dir)
    if d.exists() and not d.is_dir():
        raise UserError(
            f"{str(d)!r} is a file; give the Hugging Face model folder (the one holding config.json)"
        )
    if not d.is_dir():
        raise UserError(f"Hugging Face model folder {str(d)!r} does not exist")
    if not (d / "config.json").is_file():
        raise UserError("no config.json in the Hugging Face model folder", where=str(d))
    from transformers import AutoConfig

    from megatron_branch.models.families import check_supported_architecture

    where = str(d / "config.json")
    try:
        raw = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UserError(f"cannot read config: {type(e).__name__}: {_first_line(e)}", where=where) from None
    if not isinstance(raw, dict):
        raise UserError(f"cannot read config: a JSON object expected, got {type(raw).__name__}", where=where)
    # before transformers parses it: it may re-map an unknown model_type to another one
    check_supported_architecture(raw.get("model_type"), raw.get("architectures"), where=where)

    try:
        return AutoConfig.from_pretrained(str(d), local_files_only=True)
    except (ValueError, KeyError, OSError, json.JSONDecodeError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot read config: {msg}", where=str(d / "config.json")) from None


def hf_experts_kwargs(config: Any) -> dict[str, Any]:
    """transformers' loader kwargs for the reference implementation of a MoE model's experts (the per-expert loop;
    its default grouped_mm path refuses float64): what verify-conversion's reference and the tests' oracle use."""
    moe = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    return {"experts_implementation": "eager"} if moe else {}


class HFTensorReader:
    """Lazy access to the tensors of a (possibly sharded) safetensors checkpoint."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.dir = Path(hf_dir)
        self._handles: dict[str, Any] = {}
        index = self.dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise UserError(f"malformed index ({type(e).__name__}: {e})", where=str(index)) from None
            for shard in sorted(set(weight_map.values())):
                if not (self.dir / shard).is_file():
                    raise UserError(f"index names shard {shard!r}, which does not exist", where=str(index))
            self.file_of: dict[str, str] = dict(weight_map)
        elif (self.dir / SINGLE_FILE).is_file():
            self.file_of = {n: SINGLE_FILE for n in self._open(SINGLE_FILE).keys()}
        else:
            pickled = [n for n in PICKLED_WEIGHTS if (self.dir / n).is_file()]
            if pickled:
                raise UserError(
                    f"the weights are pickled ({pickled[0]}), which megatron-branch never unpickles (it can run "
                    f"code); save them as safetensors ({SINGLE_FILE})",
                    where=str(self.dir),
                )
            raise UserError(f"no {SINGLE_FILE} or {INDEX_FILE} in the model folder", where=str(self.dir))
        # Open every shard once up front: a truncated or corrupt header fails here, naming its file.
        for shard in sorted(set(self.file_of.values())):
            handle = self._open(shard)
            listed = {n for n, f in self.file_of.items() if f == shard}
            absent = sorted(listed - set(handle.keys()))
            if absent:
                raise UserError(
                    f"index places {absent[0]!r} in this shard, which lacks it", where=str(self.dir / shard)
                )
        self.expert_views = self._split_fused_experts()

    def _split_fused_experts(self) -> dict[str, tuple[str, int, slice | None]]:
        """Per-expert names for a layer's experts stored as two 3-D tensors (the published Qwen3.5-MoE checkpoints:
        `mlp.experts.gate_up_proj` [E, 2e, h] = per expert [gate; up], `mlp.experts.down_proj` [E, h, e]), named
        as save_pretrained writes them (`mlp.experts.{j}.gate_proj.weight`, ...): name -> (stored, j, rows)."""
        views: dict[str, tuple[str, int, slice | None]] = {}
        self.file_of_fused: dict[str, str] = {}
        if is_fused(
            self.file_of
        ):  # gpt-oss's layout: split by the parameter map (checkpoint/fused_experts.py)
            return views
        for name in [n for n in self.file_of if n.endswith(FUSED_EXPERT_SUFFIXES)]:
            stem, kind = name.rsplit(".", 1)  # "...mlp.experts", "gate_up_proj" | "down_proj"
            shape = self._open(self.file_of[name]).get_slice(name).get_shape()
            if len(shape) != 3 or (kind == "gate_up_proj" and shape[1] % 2):
                raise UserError(f"fused experts {name!r} have shape {list(shape)}", where=str(self.dir))
            half = shape[1] // 2
            for j in range(shape[0]):
                if kind == "down_proj":
                    views[f"{stem}.{j}.down_proj.weight"] = (name, j, None)
                else:
                    views[f"{stem}.{j}.gate_proj.weight"] = (name, j, slice(0, half))
                    views[f"{stem}.{j}.up_proj.weight"] = (name, j, slice(half, 2 * half))
            self.file_of_fused[name] = self.file_of.pop(name)
        return views

    def _open(self, shard: str) -> Any:
        if shard not in self._handles:
            from safetensors import safe_open

            path = self.dir / shard
            try:
                self._handles[shard] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises SafetensorError (not exported stably) for bad files
                raise UserError(f"cannot read safetensors file ({_first_line(e)})", where=str(path)) from None
        return self._handles[shard]

    def keys(self) -> list[str]:
        return [*self.file_of, *self.expert_views]

    def __contains__(self, name: str) -> bool:
        return name in self.file_of or name in self.expert_views

    def get(self, name: str) -> torch.Tensor:
        if name in self.expert_views:  # one expert's slice of a fused 3-D tensor: only its bytes are read
            stored, j, rows = self.expert_views[name]
            shard = self.file_of_fused[stored]
            t = self._read(shard, stored, lambda h: h.get_slice(stored)[j : j + 1][0])
            return t if rows is None else t[rows].clone()
        shard = self.file_of[name]
        return self._read(shard, name, lambda h: h.get_tensor(name))

    def _read(self, shard: str, name: str, read: Any) -> torch.Tensor:
        try:
            return read(self._open(shard))
        except Exception as e:  # a truncated data section fails only when the tensor is read
            raise UserError(
                f"cannot read tensor {name!r} ({_first_line(e)})", where=str(self.dir / shard)
            ) from None

    def dtype(self) -> torch.dtype:
        """The dtype of the first floating-point tensor (the checkpoint's storage dtype)."""
        first = next(iter(self.file_of))
        return self.get(first).dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.get(name)


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else type(e).__name__


# --- writing --------------------------------------------------------------------------------------------------------
def _is_hf_tokenizer(src: Path) -> bool:
    """A transformers tokenizer folder: a tokenizer_config.json, or a tokenizer.json in transformers' format (a
    sentencepiece folder's settings file is not one)."""
    if (src / "tokenizer_config.json").is_file() or (src / "vocab.json").is_file():
        return True
    try:
        body = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(body, dict) and "model" in body


def check_tokenizer_dir(tokenizer_dir: str | os.PathLike) -> list[str]:
    """The tokenizer files present in `tokenizer_dir` (a transformers tokenizer, or a sentencepiece
    `tokenizer.model`, which is converted on export), refusing a folder without any."""
    src = Path(tokenizer_dir)
    if not src.is_dir():
        raise UserError(f"tokenizer folder {str(src)!r} does not exist")
    copied = [n for n in TOKENIZER_FILES if (src / n).is_file()]
    if copied and not (_is_hf_tokenizer(src) or (src / "tokenizer.model").is_file()):
        raise UserError(
            f'{", ".join(copied)} in {str(src)!r} is not a transformers tokenizer (tokenizer.json has no "model"; '
            "e.g. a sentencepiece settings file) and there is no tokenizer.model to convert"
        )
    if not copied:
        raise UserError(f"no tokenizer files ({', '.join(TOKENIZER_FILES)}) in {str(src)!r}")
    return copied


def copy_tokenizer_files(tokenizer_dir: str | os.PathLike, out: Path) -> list[str]:
    """Put a tokenizer `transformers.AutoTokenizer` loads into `out`: a transformers tokenizer's files as they
    are (special tokens and chat template kept); a bare sentencepiece model converted by transformers' own
    converter (tokenizer/spm.py `save_hf`)."""
    src = Path(tokenizer_dir)
    copied = check_tokenizer_dir(src)
    if not _is_hf_tokenizer(src):
        from megatron_branch.tokenizer.spm import SentencePieceTokenizer

        SentencePieceTokenizer(src / "tokenizer.model").save_hf(out)
        return sorted(p.name for p in out.iterdir() if p.name in TOKENIZER_FILES)
    for n in copied:
        shutil.copyfile(src / n, out / n)
    return copied


def parse_size(s: str | int) -> int:
    """'5GB', '200MB', '10KB' or a byte count."""
    if isinstance(s, int):
        return s
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = s.strip().upper()
    for u, mult in units.items():
        if t.endswith(u) and t[: -len(u)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(u)]) * mult)
    if t.isdigit():
        return int(t)
    raise UserError(f"cannot parse size {s!r} (use e.g. 5GB, 200MB or a byte count)")


def write_hf_folder(
    out_dir: str | os.PathLike,
    config: Any,
    tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    max_shard_size: int | str = "5GB",
    tokenizer_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
) -> Path:
    """Write config.json + safetensors shards (with an index when more than one) + tokenizer files, atomically.

    `tensors` is consumed lazily: a shard is written as soon as it is full, so at most one shard is resident.
    An existing HF folder at `out_dir` is replaced only with `overwrite` (megatron_branch.outputs).
    """
    from safetensors.torch import save_file

    limit = parse_size(max_shard_size)
    out = Path(out_dir)
    with outputs.atomic_dir(out, overwrite=overwrite, marker=HF_MARKER) as tmp:
        shards: list[dict[str, torch.Tensor]] = [{}]
        sizes = [0]
        files: list[str] = []
        total = 0

        def flush() -> None:
            name = f"shard-{len(files):05d}.tmp"  # renamed once the shard count is known
            save_file(shards[-1], str(tmp / name), metadata={"format": "pt"})
            files.append(name)
            shards[-1] = {}
            sizes[-1] = 0

        weight_map_idx: dict[str, int] = {}
        for name, t in tensors:
            nbytes = t.numel() * t.element_size()
            if shards[-1] and sizes[-1] + nbytes > limit:
                flush()
            shards[-1][name] = t.detach().contiguous()
            sizes[-1] += nbytes
            total += nbytes
            weight_map_idx[name] = len(files)
        if shards[-1] or not files:
            flush()
        n = len(files)
        final = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        for f, g in zip(files, final, strict=True):
            os.replace(tmp / f, tmp / g)
        if n > 1:
            index = {
                "metadata": {"total_size": total},
                "weight_map": {k: final[v] for k, v in weight_map_idx.items()},
            }
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        config.save_pretrained(str(tmp))
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
    return out
