"""A run's checkpoints: what one holds, saving it, and resuming from it (on the same or another layout).

A checkpoint (CheckpointStore, checkpoint/store.py: verified before every load) holds the actor's sharded state
(policy, critic, optimizers, schedulers: train/policy.py), the sampler's RNG per rank, the frozen reference when
the algorithm needs one, and as common state the data position, the step and the layout it was saved from
(lifecycle.layout_record). Resuming on another layout reshards (lifecycle.check_resharding) and restarts the
per-rank RNG streams from the seeds, since the old streams belong to the old layout's ranks. The run's
tokenizer (OUT/hf_tokenizer) is copied into each one.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from megatron_branch.checkpoint.hf_to_mcore import META_FILE
from megatron_branch.checkpoint.store import CheckpointStore, rng_sharded_object
from megatron_branch.train import lifecycle
from megatron_branch.train.models import prepare_for_layout
from megatron_branch.train.run_dir import HF_TOKENIZER
from megatron_branch.train.state import PromptOrder, capture_rng, restart_rng, restore_rng

if TYPE_CHECKING:
    from megatron_branch.models import ModelArch
    from megatron_branch.parallel.groups import ParallelGroups
    from megatron_branch.train.config import TrainConfig
    from megatron_branch.train.metrics import RunLogger
    from megatron_branch.train.policy import Actor


class RunCheckpoints:
    """The checkpoint half of the Trainer (train/loop.py), as a mixin: it saves and loads the run the Trainer
    built (the attributes below)."""

    cfg: TrainConfig
    out: Path
    is_main: bool
    actor: Actor
    arch: ModelArch
    dtype: torch.dtype
    groups: ParallelGroups
    dp_rank: int
    order: PromptOrder
    sample_rng: torch.Generator
    reference: torch.nn.Module | None
    needs_reference: bool
    store: CheckpointStore
    step: int
    saved_step: int | None
    logger: RunLogger

    def _last_checkpoint(self) -> str | None:
        """The newest checkpoint folder this process sees complete (no collective: used while interrupted)."""
        done = [s for s in self.store.steps() if (self.store.path(s) / META_FILE).is_file()]
        return str(self.store.path(done[-1])) if done else None

    def _sharded_state(self, *, loading: bool) -> dict[str, Any]:
        sd: dict[str, Any] = self.actor.sharded_state(loading=loading)
        sd["rng"] = rng_sharded_object("rng_state", None if loading else capture_rng(self.sample_rng))
        if self.needs_reference:
            ref = self.reference if self.reference is not None else self._empty_reference()
            self.reference = ref
            sd["reference"] = ref.sharded_state_dict(prefix="reference.")
        return sd

    def _empty_reference(self) -> torch.nn.Module:
        from megatron_branch.models import build_model

        ref = build_model(
            self.arch, dtype=self.dtype, tp=self.groups.tp_size,
            sequence_parallel=self.groups.sequence_parallel, init_weights=False, pp=self.groups.pp_size,
            pp_rank=self.groups.pp_rank, ep=self.groups.ep_size,
        )  # fmt: skip
        ref.requires_grad_(False)
        return prepare_for_layout(ref, self.groups)

    def save(self) -> Path:
        """This step's checkpoint (a collective: every rank calls it), then the curves; returns its folder."""
        import shutil

        from megatron_branch.checkpoint.hf_to_mcore import TOKENIZER_SUBDIR

        common = {
            "data": self.order.state_dict(),
            **self.actor.common_state(),
            "layout": self._layout(),
        }
        describe = {
            "arch": self.arch.to_dict(),
            "dtype": self.cfg.model.dtype,
            "padded_vocab_size": self.arch.padded_vocab_size(self.groups.tp_size),
            "saved_tensor_parallel": self.groups.tp_size,
            "source": "megatron-branch train",
        }
        tok = self.out / HF_TOKENIZER

        def finish(tmp: Path) -> None:
            if tok.is_dir():
                shutil.copytree(tok, tmp / TOKENIZER_SUBDIR)

        with lifecycle.DeferredInterrupt():  # Ctrl-C waits for a complete checkpoint (its doc: why)
            path = self.store.save(
                self.step, self._sharded_state(loading=False), common=common, describe=describe, finish=finish
            )
            self.saved_step = self.step
        if self.cfg.logging.plot:
            self.logger.plot()
        return path

    def _layout(self) -> dict[str, Any]:
        return lifecycle.layout_record(
            self.groups, distributed_optimizer=self.cfg.optim.use_distributed_optimizer,
            padded_vocab_size=self.arch.padded_vocab_size(self.groups.tp_size),
        )  # fmt: skip

    def _load(self, path: Path) -> None:
        """Resume from the verified checkpoint `path`, resharding when the layout changed."""
        saved = self.store.read_common(path).get("layout")
        current = self._layout()
        moved = lifecycle.check_resharding(saved, current, where=str(path))
        sharded = self._sharded_state(loading=True)
        if moved:  # per-rank RNG states belong to the old layout's ranks
            sharded.pop("rng")
        state, common = self.store.load(path, sharded, verified=True)
        self.actor.load_state(state, common)
        if "reference" in state:
            ref_state = {k.removeprefix("reference."): v for k, v in state["reference"].items()}
            self.reference.load_state_dict(ref_state, strict=True)  # type: ignore[union-attr]
            self.reference.eval()  # type: ignore[union-attr]
        self.order.load_state_dict(common["data"])
        self.step = int(common["step"])
        self.saved_step = self.step
        if moved:
            restart_rng(self.sample_rng, seed=self.cfg.trainer.seed, rollout_seed=self.cfg.rollout.seed,
                        step=self.step, dp_rank=self.dp_rank)  # fmt: skip
            lifecycle.say(lifecycle.reshard_notice(str(path), saved, current), enabled=self.is_main)  # type: ignore[arg-type]
        else:
            restore_rng(state["rng"], self.sample_rng)
        if self.is_main:
            print(f"resumed from {path} (step {self.step})", flush=True)
