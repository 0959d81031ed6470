"""Set-ups the distributed tests share (one home each): a temporary folder every rank sees, the environment of a
fresh one-process run started from under torchrun, and a checkpoint's tensors read whole."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

TORCHRUN_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""What torchrun sets for its workers: a child process started without them is a world of one."""


def shared_tmp(prefix: str = "dist-test-") -> Path:
    """A fresh temporary folder, made on rank 0, its path broadcast to every rank (collective)."""
    box = [tempfile.mkdtemp(prefix=prefix) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


def single_process_env(**extra: str) -> dict[str, str]:
    """This process's environment without torchrun's variables (and TORCHELASTIC_*), plus `extra`: a child
    started with it initialises a world of one."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC")}
    return {**env, **extra}


def plain_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a distributed checkpoint, whole (model weights and the optimizer's master copy and moments),
    by dotted name."""
    from megatron.core.dist_checkpointing import load_plain_tensors

    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, d: object) -> None:
        if isinstance(d, dict):
            for k, v in d.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(d, torch.Tensor):
            flat[prefix[:-1]] = d

    walk("", load_plain_tensors(str(path)))
    return flat
