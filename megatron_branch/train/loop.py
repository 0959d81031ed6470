"""The RL loop: sample -> reward -> (reference scores) -> ppo_epochs x mini-batch updates -> next step.

    trainer = Trainer(cfg)      # validate, build tokenizer/data/models/optimizer, resume if asked (all ranks)
    summary = trainer.run()     # steps, metrics, checkpoints, curves, HF export

Under torchrun the world is tp * cp * dp. Every rank of a data-parallel replica (its TP and CP ranks) samples the
same rollouts (same prompts, a generator seeded by the DP rank alone: the sampler has no CP, so CP ranks generate
redundantly); replicas sample different prompts of the step's global batch, and the rollouts are gathered so that
every rank builds the same global batch for the update, which splits it over DP again by prefix group
(parallel/data.py), runs each share's ring over CP (the groups of `ScheduleOptions`), SUMS the gradients over
dp x cp in megatron's DDP and normalises the loss on the GLOBAL batch: DP1, DP2 and CP2 give the same update.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_branch import outputs
from megatron_branch.assembly import build_engine
from megatron_branch.checkpoint.hf_io import HF_MARKER
from megatron_branch.checkpoint.hf_to_mcore import META_FILE
from megatron_branch.checkpoint.store import CheckpointStore
from megatron_branch.data import Rollout
from megatron_branch.errors import SettingError, UserError
from megatron_branch.losses.router import fold_expert_metrics
from megatron_branch.parallel import agree
from megatron_branch.parallel.agree import agree_on_error
from megatron_branch.parallel.groups import init_distributed, initialize_parallel
from megatron_branch.precision import torch_dtype
from megatron_branch.rules import UNSHARED
from megatron_branch.train import lifecycle
from megatron_branch.train import policy as policy_ops
from megatron_branch.train.algorithm import resolve_algorithm
from megatron_branch.train.auto_schedule import run_summary
from megatron_branch.train.checkpointing import RunCheckpoints
from megatron_branch.train.config import TrainConfig
from megatron_branch.train.config_io import write_resolved
from megatron_branch.train.data import load_dataset
from megatron_branch.train.metrics import RunLogger, multi_turn_metrics
from megatron_branch.train.models import frozen_copy
from megatron_branch.train.record import engine_record, write_engine_record
from megatron_branch.train.run_dir import HF_TOKENIZER, run_folder, save_tokenizer
from megatron_branch.train.state import PromptOrder
from megatron_branch.train.validate import SPELLING, check_fits_context, model_arch, run_spec


def _gather_over(group: Any, obj: Any) -> list[Any]:
    if group is None or dist.get_world_size(group) == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


class Trainer(RunCheckpoints):
    """One training run (all ranks construct it with the same config); its checkpoints: train/checkpointing.py."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.rank, self.world = init_distributed()
        self.is_main = self.rank == 0
        t = cfg.trainer
        self.out = Path(t.default_local_dir)
        resume = t.resume_mode == "auto"
        self.dtype = torch_dtype(cfg.model.dtype)
        # Everything the user gave is read and checked before anything is written (one line on failure).
        self.algo = resolve_algorithm(cfg)  # validated with the config: here it cannot fail
        layout = cfg.parallel
        try:
            layout.data_parallel_size(self.world)
        except SettingError as e:
            raise e.spelled(SPELLING) from None
        with run_folder(self.out, resume=resume) as setup_dir:
            self.fresh = (
                setup_dir != self.out
            )  # a new run folder (removed again if the run fails before step 1)
            err = None
            try:  # every rank reads the same data: a bad file is one error, printed once
                self._read_data(setup_dir)
                if self.is_main:  # the outputs: checked now, not after the work (the run's own: replaced)
                    outputs.check_output_dir(setup_dir / "policy_mcore", overwrite=True, marker=META_FILE)
                    outputs.check_output_dir(setup_dir / "hf", overwrite=True, marker=HF_MARKER)
                    save_tokenizer(self.dataset.tokenizer, setup_dir / HF_TOKENIZER)
            except UserError as e:
                err = str(e)
            agree_on_error(err)
            # rank 0 writes; a failure (a full disk) is one line on every rank, not a hang (outputs.py)
            agree.write_on_rank0(lambda: write_resolved(cfg, setup_dir / "config.yaml"))
            self.groups = initialize_parallel(layout, seed=t.seed)
            self.dp_rank = dist.get_rank(self.groups.dp)
            engine = build_engine(run_spec(cfg, self.arch), groups=self.groups)  # the run assembly
            self.policy = engine.model
            self.actor = policy_ops.Actor(
                cfg, self.policy, opts=engine.opts, algo=self.algo, arch=self.arch, groups=self.groups,
                dtype=self.dtype,
            )  # fmt: skip
            ds = self.dataset
            self.actor.set_stop_tokens(ds.stop_token_ids(cfg.rollout.stop), ds.turn_end_ids)
            # what megatron and the engine were given (train/record.py), beside config.yaml
            agree.write_on_rank0(
                lambda: write_engine_record(setup_dir, engine_record(self.actor.policy, self.actor.plan))
            )
            self.order = PromptOrder(
                num_prompts=len(self.dataset), batch_size=cfg.data.train_batch_size,
                shuffle=cfg.data.shuffle, seed=cfg.data.seed,
            )  # fmt: skip
            # One stream per DP replica: its TP and CP ranks must draw the same tokens (groups.dp excludes CP).
            self.sample_rng = torch.Generator().manual_seed(cfg.rollout.seed * 1_000_003 + self.dp_rank)
            self.reference: torch.nn.Module | None = None
            self.needs_reference = self.algo.requires_reference
            self.store = CheckpointStore(self.out / "checkpoints", keep_last=cfg.checkpoint.keep_last)
            self.step = 0
            self.saved_step: int | None = None
            notice = lambda text: lifecycle.say(text, enabled=self.is_main)  # noqa: E731
            latest = self.store.newest_verified(notice) if resume and not self.fresh else None
            if resume and latest is None:  # --resume auto on a new or empty folder: say so, never silently
                notice(f"no checkpoint found under {self.store.root}, starting fresh")
            if latest is not None:
                self._load(latest)
            else:
                self._warmup()
                if self.needs_reference:
                    self.reference = frozen_copy(self.policy, self.arch, dtype=self.dtype, groups=self.groups)
        self.logger = RunLogger(
            self.out,
            total_steps=t.total_training_steps,
            start_step=self.step,
            enabled=self.is_main,
            tensorboard=cfg.logging.tensorboard,
            # no bar when there is no step to run: it would cross the "nothing to do" line
            progress_bar=cfg.logging.progress_bar and self.step < t.total_training_steps,
        )

    def _read_data(self, setup_dir: Path) -> None:
        cfg = self.cfg
        self.dataset = load_dataset(cfg, setup_dir, pairs=self.algo.offline)
        self.arch = model_arch(cfg, vocab_size=self.dataset.tokenizer.vocab_size)
        if self.arch.vocab_size < self.dataset.tokenizer.vocab_size:
            raise UserError(
                f"the tokenizer has {self.dataset.tokenizer.vocab_size} tokens but the model's vocabulary "
                f"is {self.arch.vocab_size}"
            )
        check_fits_context(
            cfg, max_prompt_tokens=self.dataset.max_prompt_tokens, context=self.arch.max_position_embeddings,
            where="data",
        )  # fmt: skip

    # ---- one RL step -----------------------------------------------------------------------------------------
    def _sample(self, indices: list[int]) -> tuple[list[Rollout], list[float], dict[str, float]]:
        """Sample rollout.n continuations of each prompt of this replica's share; gather the global batch."""
        slots = list(range(len(indices)))[self.dp_rank :: self.groups.dp_size]  # positions in the batch
        make_env = self.dataset.environment
        out = self.actor.generate(
            [self.dataset.prompt_ids(indices[k]) for k in slots], self.sample_rng,
            None if make_env is None else lambda j: make_env(indices[slots[j]]),
        )  # fmt: skip
        local = []
        for k, group in zip(slots, out.samples):
            for s in group:  # a multi-turn rollout's reward is its environment's
                reward = self.dataset.reward(indices[k], s.response) if s.env_reward is None else s.env_reward
                turns = (s.loss_mask, s.turns, s.tool_calls)
                local.append((k, s.prompt, s.response, s.logprobs, reward, s.routed_experts, turns))
        rows = [r for part in _gather_over(self.groups.dp, local) for r in part]
        rows.sort(key=lambda r: r[0])  # the global batch in the step's prompt order (stable within a group)
        rewards = [r[4] for r in rows]
        rollouts = [
            Rollout(
                prompt=r[1],
                response=r[2],
                token_fields={"old_logprobs": r[3], "rollout_logprobs": r[3]},
                routed_experts=r[5],
                loss_mask=r[6][0],
            )
            for r in rows
        ]  # the sampler's logprobs: old (one update per sampling) and rollout's (the mismatch metric);
        # routed_experts: MoE routing replay's records (moe.router_replay: R3), else None
        stats = {
            "gen/prefill_positions": out.stats.prefill_positions,
            "gen/decode_steps": out.stats.decode_steps,
            "gen/tokens_per_s": out.stats.tokens_per_s,
        }
        if make_env is not None:
            stats.update(multi_turn_metrics([r[6][1:] for r in rows], rollouts))
        return rollouts, rewards, stats

    def train_step(self) -> dict[str, Any]:
        """One RL step (offline: one pass over a batch of pairs); returns its metrics line."""
        if self.algo.offline:
            return self._pairs_step()
        cfg = self.cfg
        t0 = time.perf_counter()
        indices = self.order.next_batch()
        rollouts, rewards, gen_stats = self._sample(indices)
        t_gen = time.perf_counter()
        metrics = self.actor.update(rollouts, rewards, reference=self.reference)
        t_upd = time.perf_counter()
        self.last_batch, self.last_rewards = rollouts, rewards  # inspected by tests
        resp = [len(r.response) for r in rollouts]
        self.step += 1
        step_s = t_upd - t0
        mean = sum(rewards) / len(rewards)
        positions = self._positions(rollouts)
        return {
            "step": self.step,
            "reward_mean": mean,
            "loss": metrics.pop("loss"),
            **positions,
            "critic/score/mean": mean,
            "critic/score/max": max(rewards),
            "critic/score/min": min(rewards),
            "response_length/mean": sum(resp) / len(resp),
            **fold_expert_metrics(metrics),  # MoE: tokens per expert as one list per layer
            **gen_stats,
            "timing_s/gen": t_gen - t0,
            "timing_s/update_actor": t_upd - t_gen,
            "timing_s/step": step_s,
            # logical tokens (what naive training would process) per second of the whole RL step
            "perf/throughput": positions["positions_logical"] * cfg.actor.ppo_epochs / step_s,
        }

    def _positions(self, rollouts: list[Rollout]) -> dict[str, int]:
        """Token positions of one pass over the step's batch: naive training's count and what the schedule ran."""
        tree = self.actor.plan.trees.build(rollouts, vocab_size=self.arch.vocab_size)  # the update's tree
        naive = self.cfg.schedule.name in UNSHARED
        return {
            "positions_logical": tree.positions_logical,
            "positions_computed": tree.positions_logical if naive else tree.positions_computed,
        }

    def _pairs_step(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        pairs = []
        for j in self.order.next_batch():
            p = self.dataset.pairs[j]  # type: ignore[index]
            pairs.append(Rollout(prompt=p["prompt"], response=p["chosen"], pair=j, chosen=True))
            pairs.append(Rollout(prompt=p["prompt"], response=p["rejected"], pair=j, chosen=False))
        metrics = self.actor.update(pairs, None, reference=self.reference)
        self.last_batch, self.last_rewards = pairs, []
        self.step += 1
        step_s = time.perf_counter() - t0
        return {
            "step": self.step,
            "reward_mean": metrics["rewards/accuracies"],  # DPO has no reward: the pairs ranked right
            "loss": metrics.pop("loss"),
            **self._positions(pairs),
            "response_length/mean": sum(len(r.response) for r in pairs) / len(pairs),
            **fold_expert_metrics(metrics),
            "timing_s/update_actor": step_s,
            "timing_s/step": step_s,
            "perf/throughput": self._positions(pairs)["positions_logical"] / step_s,
        }

    # ---- the run ---------------------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg.trainer
        last: dict[str, Any] = {}
        start = self.step
        if start >= cfg.total_training_steps and self._exports_current():
            lifecycle.say(
                f"nothing to do: {self.out} is at step {start} (trainer.total_training_steps="
                f"{cfg.total_training_steps}); raise trainer.total_training_steps to extend it",
                enabled=self.is_main,
            )
            self.logger.close()
            return self._summary(self._current_export(), last, nothing_to_do=True)
        try:
            with lifecycle.SignalStop(enabled=cfg.save_on_signal) as stop:
                while self.step < cfg.total_training_steps:
                    last = self.train_step()
                    self.logger.log(last)
                    if cfg.save_freq > 0 and self.step % cfg.save_freq == 0:
                        self.save()
                    if stop.requested():
                        return self._stop_on_signal(last)
            if self.saved_step != self.step:  # the final state is always saved
                self.save()
            elif self.cfg.logging.plot:
                self.logger.plot()
            exported = self._export()
        except KeyboardInterrupt:
            lifecycle.say(lifecycle.interrupted_line(self.step, self._last_checkpoint()), enabled=self.is_main,
                          err=True)  # fmt: skip
            self._discard_if_unstarted(start)
            raise
        except BaseException:
            self._discard_if_unstarted(start)
            raise
        finally:
            self.logger.close()
        return self._summary(exported, last)

    def _summary(self, exported: Path | None, last: dict[str, Any], **extra: Any) -> dict[str, Any]:
        return {
            "steps": self.step,
            "out": str(self.out),
            "metrics": str(self.out / "metrics.jsonl"),
            "curves": str(self.out / "curves.png"),
            "checkpoint": str(self.store.path(self.step)),
            "hf": str(exported) if exported else None,
            "last": last,
            **self._auto_summary(),
            **extra,
        }

    def _auto_summary(self) -> dict[str, Any]:
        """schedule.name: auto: the last pick and why; replay's chunks (train/auto_schedule.py run_summary)."""
        return run_summary(self.actor.auto, self.cfg.schedule)

    def _stop_on_signal(self, last: dict[str, Any]) -> dict[str, Any]:
        if self.saved_step != self.step:
            self.save()
        lifecycle.say(
            f"SIGTERM: stopped after step {self.step} with checkpoint {self.store.path(self.step)}; resume: the "
            "same command with --resume auto",
            enabled=self.is_main,
            err=True,
        )
        return self._summary(None, last, stopped_by="SIGTERM")

    def _discard_if_unstarted(self, start: int) -> None:
        """A fresh run that failed before its first step leaves no run folder (a rerun is not refused)."""
        if self.fresh and start == 0 and self.step == 0 and self.is_main:
            import shutil

            shutil.rmtree(self.out, ignore_errors=True)

    def _exportable(self) -> bool:
        """The converter writes this dtype: float32, bfloat16, float16 (an HF folder holds no float64)."""
        from megatron_branch.checkpoint.hf_to_mcore import DTYPES as CONVERTER_DTYPES

        return self.dtype in CONVERTER_DTYPES.values()

    def _exports_current(self) -> bool:
        """The final exports hold this step (or none are asked for)."""
        if not self.cfg.checkpoint.hf_export or not self._exportable():
            return True
        return lifecycle.exports_step(self.out) == self.step

    def _current_export(self) -> Path | None:
        """The run's HF export when it is there and holds this step (a finished run resumed: "nothing to do")."""
        current = self.cfg.checkpoint.hf_export and lifecycle.exports_step(self.out) == self.step
        return self.out / "hf" if current else None

    def _export(self) -> Path | None:
        if not self.cfg.checkpoint.hf_export:
            return None
        if not self._exportable():
            self.logger.write("HF export skipped: float64 runs are not exported (HF holds fp32, bf16, fp16)")
            return None
        from megatron_branch.train.models import export_hf

        hf = export_hf(
            self.policy, self.out, arch=self.arch, dtype=self.dtype, groups=self.groups,
            tokenizer_dir=self.out / HF_TOKENIZER,
        )  # fmt: skip
        lifecycle.stamp_exports(self.out, self.step, enabled=self.is_main)
        return hf

    # ---- warm-up ---------------------------------------------------------------------------------------------
    def _warmup(self) -> None:
        w = self.cfg.warmup
        if w.steps == 0:
            return
        if self.dataset.warmup is None:
            raise UserError(
                "warmup.steps > 0 needs a built-in task (data.task): it supplies the reference answers"
            )
        if self.is_main:
            print(
                f"supervised warm-up: {w.steps} steps on the task's reference answers (before RL)", flush=True
            )
        # warm-up and held-out prompts come from their own seeds: not the RL prompts
        pool = self.dataset.warmup(w.steps * w.batch_size, self.cfg.data.seed + 7919)
        batches = [pool[k * w.batch_size : (k + 1) * w.batch_size] for k in range(w.steps)]
        held = self.dataset.warmup(w.eval_prompts, self.cfg.data.seed + 104729) if w.until_exact else []

        def log(k: int, loss: float) -> None:
            if self.is_main and ((k + 1) % max(1, w.steps // 4) == 0 or k == 0):
                print(f"  warm-up step {k + 1}/{w.steps}: answer NLL {loss:.4f}", flush=True)

        def stop(k: int) -> bool:
            if not held or (k + 1) % w.eval_every:
                return False
            exact = self.actor.greedy_exact([r.prompt for r in held], [r.response for r in held])
            if self.is_main:
                print(
                    f"  warm-up step {k + 1}: greedy exact {exact:.2f} on {len(held)} held-out prompts",
                    flush=True,
                )
            return exact >= w.until_exact  # type: ignore[operator]

        ran = self.actor.warmup(batches, w.lr or self.cfg.optim.lr, log, stop)
        self.warmup_steps_run = ran
        if self.is_main:
            print(f"warm-up done after {ran} steps; RL starts", flush=True)
