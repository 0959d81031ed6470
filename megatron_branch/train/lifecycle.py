"""A run's life cycle around its steps: which layout a checkpoint was saved at (and whether this run can load it),
the final exports' freshness, and stopping on a signal at a step boundary.

    layout_record(groups, cfg)                       # into train_state.json
    check_resharding(saved, current, where=path)     # True: layouts differ (RNG restarted); refusal: one line
    with SignalStop(enabled=cfg.trainer.save_on_signal) as stop:
        ... after each step: if stop.requested(): save, say so, leave

megatron's dist checkpointing reshards model and optimizer tensors (TP / CP / DP) by their global offsets; the
per-rank RNG states cannot be: they belong to the ranks of the old layout (train/state.py `restart_rng`).
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch.errors import UserError

EXPORTS_FILE = "exports.json"
"""OUT/exports.json: the step the final exports (policy_mcore/, hf/) hold, written after both (each is renamed
into place atomically; a crash between them leaves the stamp at the old step, so the next run re-exports)."""


def layout_record(groups: Any, *, distributed_optimizer: bool, padded_vocab_size: int) -> dict[str, Any]:
    """The layout a checkpoint is saved at (train_state.json "layout")."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {
        "tp": groups.tp_size,
        "cp": groups.cp_size,
        "dp": groups.dp_size,
        "pp": groups.pp_size,
        "world": world,
        "use_distributed_optimizer": distributed_optimizer,
        "padded_vocab_size": padded_vocab_size,
    }


def _spell(layout: dict[str, Any]) -> str:
    pp = layout.get("pp", 1)
    return f"tp={layout['tp']} cp={layout['cp']} dp={layout['dp']}" + (f" pp={pp}" if pp != 1 else "")


def check_resharding(saved: dict[str, Any] | None, current: dict[str, Any], *, where: str) -> bool:
    """Whether a checkpoint saved at layout `saved` loads at `current` by resharding (True: the layouts differ,
    the RNG states must restart); what megatron cannot reshard is refused in one line naming both layouts."""
    if saved is None or {k: saved.get(k, 1 if k == "pp" else None) for k in current} == current:
        return False  # a checkpoint from before pipeline parallelism was saved at pp 1
    key = "use_distributed_optimizer"
    if bool(saved.get(key)) != current[key]:
        raise UserError(
            f"saved at {_spell(saved)} with optim.{key}={str(bool(saved.get(key))).lower()}, this run is "
            f"{_spell(current)} with optim.{key}={str(current[key]).lower()}: megatron's dist checkpointing "
            "reshards the optimizer over tp/cp/dp but not between optimizer kinds; resume with the saved "
            f"optim.{key}",
            where=where,
        )
    rows = saved.get("padded_vocab_size")
    if rows is not None and rows != current["padded_vocab_size"]:
        raise UserError(
            f"saved at {_spell(saved)} with the vocabulary padded to {rows} rows, this run is {_spell(current)} "
            f"which pads it to {current['padded_vocab_size']}: the padded embedding, output layer and their "
            "optimizer state do not reshard exactly; resume at a tp that pads alike, or train with a vocabulary "
            "(model.arch.vocab_size) that divides by every tp you use",
            where=where,
        )
    return True


def reshard_notice(path: str, saved: dict[str, Any], current: dict[str, Any]) -> str:
    return (
        f"resuming {path} (saved at {_spell(saved)}) at {_spell(current)}: model and optimizer resharded by "
        "megatron's dist checkpointing; RNG streams restarted from the run's seeds and the step"
    )


def interrupted_line(step: int, last: str | None) -> str:
    """What Ctrl-C prints: where the run stood, the last complete checkpoint and how to go on."""
    if last is None:
        return f"interrupted at step {step}: no checkpoint was written yet (nothing to resume)"
    return (
        f"interrupted at step {step}: the last complete checkpoint is {last}; "
        "resume: the same command with --resume auto"
    )


class SignalStop:
    """SIGTERM (what a cluster scheduler sends before it kills a job) asks the run to stop at the next step
    boundary, with a checkpoint. The handler only sets a flag; `requested()` is the step-boundary check, agreed
    over all ranks (one all-reduce) so every rank stops at the same step. Disabled: SIGTERM keeps its default."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self._flag = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        self._flag = True

    def __enter__(self) -> SignalStop:
        if self.enabled:
            try:
                self._previous = signal.signal(signal.SIGTERM, self._handler)
            except ValueError:  # not the main thread (an embedding caller): no handler, no stop
                self.enabled = False
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.enabled and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def requested(self) -> bool:
        if not self.enabled:
            return False
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return self._flag
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        box = torch.tensor([1 if self._flag else 0], dtype=torch.int64, device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        return bool(box.item())


class DeferredInterrupt:
    """Ctrl-C (SIGINT) while a checkpoint is written waits for the write to finish, then interrupts as usual.
    Raised inside torch's writer, a KeyboardInterrupt can surface as something else: measured in the suite, a
    SIGINT inside torch.save's zip writer (torch.distributed.checkpoint's FileSystemWriter) came out as torch's
    "RuntimeError: ... unexpected pos 30 vs 0" inside a CheckpointException, the run exited 1 with a traceback
    instead of the one interrupted line and 130, and the checkpoint was left half-written. So the handler only
    records the first SIGINT; the KeyboardInterrupt is raised when the block ends (after the checkpoint is complete,
    which the interrupted line then names). A second SIGINT interrupts at once, as before. Not the main thread (an
    embedding caller): no handler, signals as before."""

    def __init__(self) -> None:
        self._pending = False
        self._previous: Any = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self._pending:  # the second Ctrl-C: now
            raise KeyboardInterrupt
        self._pending = True

    def __enter__(self) -> DeferredInterrupt:
        try:
            self._previous = signal.signal(signal.SIGINT, self._handler)
        except ValueError:  # not the main thread
            self._previous = None
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
        if self._pending and exc_type is None:
            raise KeyboardInterrupt


def stamp_exports(out: Path, step: int, *, enabled: bool) -> None:
    if enabled:
        from megatron_branch.outputs import write_text

        write_text(out / EXPORTS_FILE, json.dumps({"step": step}) + "\n", overwrite=True)


def exports_step(out: Path) -> int | None:
    """The step of the final exports, if both are in place."""
    try:
        step = json.loads((out / EXPORTS_FILE).read_text())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = (out / "policy_mcore" / "megatron_branch.json").is_file() and (out / "hf" / "config.json").is_file()
    return int(step) if ok else None


def say(text: str, *, enabled: bool, err: bool = False) -> None:
    if enabled:
        print(text, file=sys.stderr if err else sys.stdout, flush=True)
