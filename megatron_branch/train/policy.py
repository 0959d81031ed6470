"""The actor (and PPO's critic) of the loop: sampling, advantages, reference scores, and the updates of a step.

Built on: megatron DDP + megatron's optimizer and scheduler (`update.build_optimizer`), `update.update_step` (one
optimizer step over a GLOBAL mini-batch, DP split and micro-batches inside), the registries (the run's objective
and advantage estimator, resolved once: train/algorithm.py), `ValueObjective` for the critic,
`AdvantagePolicyGradient` for the warm-up, and `update.attach_scores` (forward-only values / reference logprobs).
One path for every algorithm; per RL step and mini-batch:

    values       the critic scores them when the estimator needs them (PPO's gae)
    advantages   the estimator, from the rewards and each rollout's prompt instance (none for DPO's pairs)
    objective    built from the actor config on the mini-batch (build_objective); ref_logprobs scored by the
                 frozen reference when it reads them (KL, DPO)
then ppo_epochs x mini-batches of actor steps (and critic steps). Mini-batches are whole prompt groups (DPO: whole
pairs) in the step's order and stay the same across epochs, so each is scored once per step.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from megatron_branch.data import Rollout
from megatron_branch.models import ModelArch
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.train.algorithm import Algorithm
from megatron_branch.train.auto_schedule import auto_schedule
from megatron_branch.train.config import TrainConfig
from megatron_branch.train.models import refresh_whole, whole_copy
from megatron_branch.train.validate import optimizer_settings, sampling_params


def _policy_only(key: str) -> bool:
    """Metrics the actor's update reports for the step (the critic's own would overwrite them): the tree's
    positions and a MoE policy's routing metrics (losses/router.py names)."""
    from megatron_branch.losses.router import LOSS_NAMES

    return key.startswith(("tree/", "moe/")) or key in LOSS_NAMES.values()


def _settings(cfg: TrainConfig, lr: float, total_updates: int) -> Any:
    o = cfg.optim
    decay = max(total_updates - o.lr_warmup_steps, 1) if o.lr_decay_style != "constant" else None
    return optimizer_settings(cfg, lr=lr, decay_steps=decay)


class Trainee:
    """A model under megatron DDP with megatron's optimizer and scheduler: the actor's or the critic's."""

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype, settings: Any, pgc: Any) -> None:
        from megatron_branch.parallel.ddp import wrap_megatron_ddp
        from megatron_branch.update import build_optimizer

        self.model = model
        self.ddp = wrap_megatron_ddp(model, dtype=dtype, pg_collection=pgc, **settings.ddp_options(dtype))
        self.optimizer, self.scheduler = build_optimizer(self.ddp, settings, dtype=dtype)

    def sharded_state(self, prefix: str, *, loading: bool) -> dict[str, Any]:
        from megatron_branch.update.optimizer import optimizer_sharded_state

        model_sd = self.model.sharded_state_dict(prefix=prefix)
        return {
            "model": model_sd,
            "optimizer": optimizer_sharded_state(self.optimizer, model_sd, loading=loading),
        }

    def load(self, state: dict[str, Any], prefix: str) -> None:
        self.model.load_state_dict(
            {k.removeprefix(prefix): v for k, v in state["model"].items()}, strict=True
        )
        from megatron_branch.update.optimizer import load_optimizer_state

        load_optimizer_state(self.optimizer, state["optimizer"])


class Actor:
    """Everything of a step that touches the policy (and the critic, for PPO)."""

    def __init__(
        self, cfg: TrainConfig, model: torch.nn.Module, *, opts: Any, algo: Algorithm, arch: ModelArch,
        groups: ParallelGroups, dtype: torch.dtype,
    ) -> None:  # fmt: skip
        """`opts`: the run assembly's ScheduleOptions (assembly/engine.py build_engine)."""
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_branch.generation import BranchSampler
        from megatron_branch.update import UpdatePlan

        self.cfg, self.algo, self.arch, self.groups, self.dtype = cfg, algo, arch, groups, dtype
        a = cfg.actor
        self.params = sampling_params(cfg)  # validated with the config: here it cannot fail
        self.pgc = ProcessGroupCollection.use_mpu_process_groups()
        mini = a.ppo_mini_batch_size or cfg.data.train_batch_size
        self.num_mini = cfg.data.train_batch_size // mini
        updates = cfg.trainer.total_training_steps * self.num_mini * a.ppo_epochs
        self.policy = Trainee(
            model, dtype=dtype, settings=_settings(cfg, cfg.optim.lr, updates), pgc=self.pgc
        )
        moe_opts = opts.moe
        # under PP the sampler runs a whole-model copy refreshed from the stages (train/models.py whole_copy)
        self.whole = None if groups.pp_size == 1 else whole_copy(arch, dtype=dtype, groups=groups)
        self.sampler = BranchSampler(
            self.policy.ddp if self.whole is None else self.whole, vocab_size=arch.vocab_size, groups=groups,
            backend=cfg.schedule.backend, record_routing=moe_opts is not None and moe_opts.routing_replay,
        )  # fmt: skip
        micro = -(-mini // (a.ppo_micro_batch_size or mini))  # micro-batches of a mini-batch
        self.auto = auto_schedule(cfg, arch, groups, micro_batches=micro, act_bytes=dtype.itemsize)
        self.plan = UpdatePlan(
            opts=opts, schedule=cfg.schedule.name if self.auto is None else "replay", micro_batches=micro,
            pg_collection=self.pgc,
        )  # fmt: skip
        self.critic: Trainee | None = None
        if algo.trains_critic:
            self.critic = self._build_critic(model, updates)

    def _build_critic(self, policy: torch.nn.Module, updates: int) -> Trainee:
        """The critic starts from the policy's weights (its trunk; a fresh value head), stage by stage under PP
        (the head on the last stage)."""
        from megatron_branch.models import build_critic

        g = self.groups
        critic = build_critic(
            self.arch, dtype=self.dtype, tp=g.tp_size, sequence_parallel=g.sequence_parallel,
            head_seed=self.cfg.trainer.seed, init_weights=False, ep=g.ep_size, etp=g.etp_size, pp=g.pp_size,
            pp_rank=g.pp_rank,
        )  # fmt: skip
        missing, unexpected = critic.load_state_dict(policy.state_dict(), strict=False)
        assert not unexpected and all(k.startswith("value_head.") for k in missing), (missing, unexpected)
        if torch.cuda.is_available():
            critic.cuda()
        from megatron_branch.train.models import prepare_for_layout

        prepare_for_layout(critic, g)
        lr = self.cfg.critic.lr or self.cfg.optim.lr
        return Trainee(critic, dtype=self.dtype, settings=_settings(self.cfg, lr, updates), pgc=self.pgc)

    # ---- sampling --------------------------------------------------------------------------------------------
    def set_stop_tokens(self, ids: tuple[int, ...], turn_end_ids: tuple[int, ...] = ()) -> None:
        """The tokenizer's stop ids, and with multi-turn rollouts the turn-end ids."""
        mt = self.params.multi_turn
        if mt is not None:
            mt = dataclasses.replace(mt, turn_end_token_ids=turn_end_ids)
        self.params = dataclasses.replace(self.params, stop_token_ids=tuple(ids), multi_turn=mt)

    def generate(self, prompts: list[tuple[int, ...]], rng: torch.Generator, environments: Any = None) -> Any:
        """`environments`: with multi-turn rollouts, prompt index (of `prompts`) -> a fresh environment."""
        self._refresh_sampler()
        return self.sampler.generate(prompts, self.params, generator=rng, environments=environments)

    def _refresh_sampler(self) -> None:
        """Under PP: the sampler's whole-model copy takes the stages' current weights (every rank)."""
        if self.whole is not None:
            refresh_whole(self.whole, self.policy.model, self.groups)

    # ---- one RL step -----------------------------------------------------------------------------------------
    def _mini_batches(self, batch: list[Rollout], group_size: int) -> list[tuple[int, int]]:
        """[start, end) of each mini-batch of `batch` (whole groups of `group_size` rollouts)."""
        per = len(batch) // self.num_mini
        assert per % group_size == 0, (per, group_size)
        return [(k, k + per) for k in range(0, len(batch), per)]

    def _score_all(self, model: torch.nn.Module, batch: list[Rollout], name: str) -> list[Rollout]:
        """Per-token field `name` scored forward-only for EVERY rollout of `batch`: each DP rank scores its
        share (update.attach_scores), then the shares are exchanged (GAE needs every rollout's values)."""
        import torch.distributed as dist

        from megatron_branch.update import attach_scores

        scored = attach_scores(model, batch, name, self.plan)
        if self.groups.dp_size == 1:
            return scored
        mine = {i: r.token_fields[name] for i, r in enumerate(scored) if name in r.token_fields}
        parts: list[Any] = [None] * self.groups.dp_size
        dist.all_gather_object(parts, mine, group=self.groups.dp)
        every = {i: v for part in parts for i, v in part.items()}
        assert sorted(every) == list(range(len(batch))), "every rollout is scored by exactly one DP rank"
        return [
            dataclasses.replace(r, token_fields={**r.token_fields, name: every[i]})
            for i, r in enumerate(batch)
        ]

    def update(
        self, batch: list[Rollout], rewards: list[float] | None, *, reference: Any
    ) -> dict[str, float]:
        """All updates of one RL step on the global `batch`: rollout.n rollouts per prompt, prompt-major, with
        their `rewards`; offline (DPO): chosen/rejected pairs, no rewards."""
        from megatron_branch.losses import Aggregation, ValueObjective, build_objective
        from megatron_branch.update import update_step

        cfg, algo = self.cfg, self.algo
        group = 2 if algo.offline else cfg.rollout.n
        if self.auto is not None:  # schedule.name: auto: one pick for the step's updates
            self._pick([batch[lo:hi] for lo, hi in self._mini_batches(batch, group)])
        rejection: dict[str, float] = {}
        if (
            algo.objective.rollout_rs is not None
        ):  # verl's rollout_rs: rejected tokens get loss_mask 0, step-wide
            from megatron_branch.losses.rollout_correction import reject_rollouts

            batch, rejection = reject_rollouts(
                batch, algo.objective.rollout_rs, algo.objective.rollout_rs_threshold
            )
        minis, skipped = [], 0
        scoring = 0.0  # seconds of forward-only scoring (values, reference logprobs): verl's timing_s/ref
        for lo, hi in self._mini_batches(batch, group):  # what the updates need, once per step
            mb = batch[lo:hi]
            if not any(r.num_trained for r in mb):  # every token masked (rollout_rs rejected all): no update
                skipped += 1
                continue
            if algo.estimator is not None:
                assert rewards is not None
                if algo.estimator.needs_values:
                    assert self.critic is not None
                    t0 = time.perf_counter()
                    mb = self._score_all(self.critic.ddp, mb, "values")
                    scoring += time.perf_counter() - t0
                index = [
                    j // group for j in range(lo, hi)
                ]  # the prompt instance of each rollout (verl's uid)
                mb = algo.estimator.compute(mb, rewards[lo:hi], index, cfg.algorithm)
            objective = build_objective(algo.objective, mb)
            if objective.needs_reference:
                assert reference is not None, "the run's objective reads ref_logprobs: a reference is built"
                t0 = time.perf_counter()
                mb = self._score_all(reference, mb, "ref_logprobs")
                scoring += time.perf_counter() - t0
            minis.append((mb, objective))
        sums: dict[str, float] = {}
        count = 0
        for _ in range(cfg.actor.ppo_epochs):
            for mb, objective in minis:
                self.policy.model.train()
                res = update_step(
                    self.policy.ddp, mb, objective, self.plan, optimizer=self.policy.optimizer,
                    scheduler=self.policy.scheduler,
                )  # fmt: skip
                metrics = dict(res.metrics)
                if self.critic is not None:
                    agg = Aggregation.of_batch(mb, cfg.actor.loss_agg_mode, cfg.actor.loss_agg_norm)
                    crit = update_step(
                        self.critic.ddp, mb, ValueObjective(agg=agg, clip=cfg.critic.cliprange_value), self.plan,
                        optimizer=self.critic.optimizer, scheduler=self.critic.scheduler,
                    )  # fmt: skip
                    metrics.update({k: v for k, v in crit.metrics.items() if not _policy_only(k)})
                for key, v in metrics.items():
                    sums[key] = sums.get(key, 0.0) + v
                count += 1
        out = {k: v / count for k, v in sums.items()} if count else {}  # means over the step's updates
        out["loss"] = (
            out.pop(f"{objective.role}/loss") if count else float("nan")
        )  # JSON null: nothing trained
        out["timing_s/ref"] = scoring
        out.update(rejection)
        if rejection:
            out["actor/skipped_updates"] = float(skipped * cfg.actor.ppo_epochs)
        if skipped:
            self._warn_skipped(skipped, len(minis) + skipped)
        if self.auto is not None:
            out.update(self.auto.metrics())
        return out

    def _warn_skipped(self, skipped: int, total: int) -> None:
        """One line on rank 0 when a step trains nothing in some mini-batches (every token masked: verl's
        rollout_rs rejected them all): those updates are skipped, not an error (actor/skipped_updates)."""
        import torch.distributed as dist

        from megatron_branch.train.lifecycle import say

        what = (
            "actor.rollout_rs rejected" if self.algo.objective.rollout_rs is not None else "loss_mask masks"
        )
        say(f"megatron-branch: warning: {what} every response token of {skipped} of {total} mini-batches: their "
            "updates are skipped (actor/skipped_updates)", enabled=not dist.is_initialized() or dist.get_rank() == 0,
            err=True)  # fmt: skip

    def _pick(self, batches: list[list[Rollout]]) -> None:
        """schedule.name: auto: the plan's schedule for the updates of `batches` (train/auto_schedule.py)."""
        assert self.auto is not None
        self.plan = dataclasses.replace(self.plan, schedule=self.auto.pick(batches, self.groups).schedule)

    # ---- supervised warm-up (a separate optimizer: RL starts with fresh Adam moments) -------------------------
    def warmup(self, batches: list[list[Rollout]], lr: float, log: Any, stop: Any = None) -> int:
        """Supervised steps on `batches` until `stop(k)` (called after step k) says so; returns the steps run."""
        from megatron_branch.losses import AdvantagePolicyGradient
        from megatron_branch.update import build_optimizer, update_step

        settings = dataclasses.replace(_settings(self.cfg, lr, len(batches)), warmup_steps=0, decay_style="constant",
                                       decay_steps=None)  # fmt: skip
        opt, sched = build_optimizer(self.policy.ddp, settings, dtype=self.dtype)
        self.policy.model.train()
        if self.auto is not None:
            self._pick(batches)
        # the inexact replay-stopgrad is an RL-update comparison: its warm-up is exact, so both start from one policy
        plan = (
            dataclasses.replace(self.plan, schedule="replay")
            if self.plan.schedule == "replay-stopgrad"
            else self.plan
        )
        if plan.opts.moe is not None and plan.opts.moe.routing_replay:
            # the reference answers were never sampled, so no routing was recorded: the warm-up routes freshly
            moe = dataclasses.replace(plan.opts.moe, routing_replay=False)
            plan = dataclasses.replace(plan, opts=dataclasses.replace(plan.opts, moe=moe))
        for k, batch in enumerate(batches):
            # advantage 1 on the answer tokens, token-mean: the loss is the answers' mean NLL (SFT)
            obj = AdvantagePolicyGradient(num_response_tokens=sum(len(r.response) for r in batch))
            res = update_step(self.policy.ddp, batch, obj, plan, optimizer=opt, scheduler=sched)
            log(k, res.metrics["actor/loss"])
            if stop is not None and stop(k):
                return k + 1
        return len(batches)

    def greedy_exact(self, prompts: list[tuple[int, ...]], answers: list[tuple[int, ...]]) -> float:
        """Fraction of prompts whose greedy response is exactly the answer (answers end with eos, as sampled)."""
        params = dataclasses.replace(self.params, n=1, temperature=0.0, branch_at=())
        self._refresh_sampler()
        out = self.sampler.generate(prompts, params, generator=None)
        return sum(g[0].response == a for g, a in zip(out.samples, answers)) / len(prompts)

    # ---- checkpoint parts ------------------------------------------------------------------------------------
    def sharded_state(self, *, loading: bool) -> dict[str, Any]:
        sd = {"policy": self.policy.sharded_state("", loading=loading)}
        if self.critic is not None:
            sd["critic"] = self.critic.sharded_state("critic.", loading=loading)
        return sd

    def common_state(self) -> dict[str, Any]:
        out = {"scheduler": self.policy.scheduler.state_dict()}
        if self.critic is not None:
            out["critic_scheduler"] = self.critic.scheduler.state_dict()
        return out

    def load_state(self, state: dict[str, Any], common: dict[str, Any]) -> None:
        self.policy.load(state["policy"], "")
        self.policy.scheduler.load_state_dict(common["scheduler"])
        if self.critic is not None:
            self.critic.load(state["critic"], "critic.")
            self.critic.scheduler.load_state_dict(common["critic_scheduler"])
