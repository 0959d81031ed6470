"""The actor (and PPO's critic) of the loop: sampling, advantages, reference scores, and the updates of a step.

Built on the objectives issue's pieces: megatron DDP + megatron's optimizer and scheduler (`update.build_optimizer`),
`update.update_step` (one optimizer step over a GLOBAL mini-batch, DP split and micro-batches inside), the
objectives (`PolicyObjective`, `ValueObjective`, `DPOObjective`, `AdvantagePolicyGradient` for the warm-up) and
`update.attach_scores` (forward-only values / reference logprobs). Per RL step:

    GRPO  advantages from the group's rewards                        -> ppo_epochs x mini-batches of actor steps
    PPO   values by the critic, per-token rewards (the score on the last token), GAE  -> actor and critic steps
    DPO   pairs (chosen, rejected) with the frozen reference's scores -> one step per mini-batch of pairs

Mini-batches are whole prompt groups in the step's order and stay the same across epochs, so each rollout's
reference logprobs / old values are scored once per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron_branch.data import Rollout
from megatron_branch.models import ModelArch
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.train.config import TrainConfig


def _policy_only(key: str) -> bool:
    """Metrics the actor's update reports for the step (the critic's own would overwrite them): the tree's
    positions and a MoE policy's routing metrics (losses/router.py names)."""
    from megatron_branch.losses.router import LOSS_NAMES

    return key.startswith(("tree/", "moe/")) or key in LOSS_NAMES.values()


def _settings(cfg: TrainConfig, lr: float, total_updates: int) -> Any:
    from megatron_branch.update import OptimizerSettings

    o = cfg.optim
    decay = max(total_updates - o.lr_warmup_steps, 1) if o.lr_decay_style != "constant" else None
    return OptimizerSettings(
        lr=lr, min_lr=min(o.min_lr, lr), weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps, clip_grad=o.clip_grad, warmup_steps=o.lr_warmup_steps, decay_steps=decay,
        decay_style=o.lr_decay_style,
    )  # fmt: skip


class Trainee:
    """A model under megatron DDP with megatron's optimizer and scheduler: the actor's or the critic's."""

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype, settings: Any, pgc: Any) -> None:
        from megatron_branch.parallel.ddp import wrap_megatron_ddp
        from megatron_branch.update import build_optimizer

        self.model = model
        self.ddp = wrap_megatron_ddp(model, dtype=dtype, pg_collection=pgc)
        self.optimizer, self.scheduler = build_optimizer(self.ddp, settings, dtype=dtype)

    def sharded_state(self, prefix: str, *, loading: bool) -> dict[str, Any]:
        model_sd = self.model.sharded_state_dict(prefix=prefix)
        return {
            "model": model_sd,
            "optimizer": self.optimizer.sharded_state_dict(model_sd, is_loading=loading),
        }

    def load(self, state: dict[str, Any], prefix: str) -> None:
        self.model.load_state_dict(
            {k.removeprefix(prefix): v for k, v in state["model"].items()}, strict=True
        )
        self.optimizer.load_state_dict(state["optimizer"])


class Actor:
    """Everything of a step that touches the policy (and the critic, for PPO)."""

    def __init__(
        self, cfg: TrainConfig, model: torch.nn.Module, *, arch: ModelArch, groups: ParallelGroups,
        dtype: torch.dtype,
    ) -> None:  # fmt: skip
        from megatron.core.process_groups_config import ProcessGroupCollection

        from megatron_branch.generation import BranchSampler, SamplingParams
        from megatron_branch.schedule import ScheduleOptions
        from megatron_branch.update import UpdatePlan

        self.cfg, self.arch, self.groups, self.dtype = cfg, arch, groups, dtype
        r, a = cfg.rollout, cfg.actor
        self.params = SamplingParams(
            n=r.n, max_new_tokens=r.response_length, temperature=r.temperature, top_k=max(r.top_k, 0),
            top_p=r.top_p, branch_at=tuple(r.branch_at), branch_factor=r.branch_factor,
        )  # fmt: skip
        self.pgc = ProcessGroupCollection.use_mpu_process_groups()
        mini = a.ppo_mini_batch_size or cfg.data.train_batch_size
        self.num_mini = cfg.data.train_batch_size // mini
        updates = cfg.trainer.total_training_steps * self.num_mini * a.ppo_epochs
        self.policy = Trainee(
            model, dtype=dtype, settings=_settings(cfg, cfg.optim.lr, updates), pgc=self.pgc
        )
        from megatron_branch.train import moe

        moe_opts = moe.options(cfg) if arch.is_moe else None
        self.sampler = BranchSampler(
            self.policy.ddp, vocab_size=arch.vocab_size, groups=groups, backend=cfg.schedule.backend,
            record_routing=moe_opts is not None and moe_opts.routing_replay,
        )  # fmt: skip
        opts = ScheduleOptions(
            groups=groups, vocab_size=arch.vocab_size, backend=cfg.schedule.backend,
            branch_micro_batch=cfg.schedule.branch_micro_batch, recompute=cfg.schedule.recompute,
            recompute_layers=cfg.schedule.enable_gradient_checkpointing, moe=moe_opts,
        )  # fmt: skip
        micro = -(-mini // (a.ppo_micro_batch_size or mini))  # micro-batches of a mini-batch
        self.plan = UpdatePlan(
            opts=opts, schedule=cfg.schedule.name, micro_batches=micro, pg_collection=self.pgc
        )
        self.critic: Trainee | None = None
        if cfg.algorithm.name == "ppo":
            self.critic = self._build_critic(model, updates)

    def _build_critic(self, policy: torch.nn.Module, updates: int) -> Trainee:
        """The critic starts from the policy's weights (its trunk; a fresh value head)."""
        from megatron_branch.models import build_critic

        g = self.groups
        critic = build_critic(
            self.arch, dtype=self.dtype, tp=g.tp_size, sequence_parallel=g.sequence_parallel,
            head_seed=self.cfg.trainer.seed, init_weights=False, ep=g.ep_size,
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
    def set_stop_tokens(self, ids: tuple[int, ...]) -> None:
        self.params = dataclasses.replace(self.params, stop_token_ids=tuple(ids))

    def generate(self, prompts: list[tuple[int, ...]], rng: torch.Generator) -> Any:
        return self.sampler.generate(prompts, self.params, generator=rng)

    # ---- one RL step -----------------------------------------------------------------------------------------
    def _mini_batches(self, batch: list[Rollout], group_size: int) -> list[list[Rollout]]:
        per = len(batch) // self.num_mini
        assert per % group_size == 0, (per, group_size)
        return [batch[k : k + per] for k in range(0, len(batch), per)]

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

    def update(self, rollouts: list[Rollout], rewards: list[float], *, reference: Any) -> dict[str, float]:
        """All updates of one RL step on the global batch `rollouts` (n per prompt, prompt-major)."""
        from megatron_branch.losses import (
            Aggregation,
            PolicyObjective,
            ValueObjective,
            with_gae,
            with_group_advantages,
        )
        from megatron_branch.update import update_step

        cfg, a = self.cfg, self.cfg.actor
        if self.critic is None:
            batch = with_group_advantages(
                rollouts, rewards, norm_by_std=cfg.algorithm.norm_adv_by_std_in_grpo
            )
        else:  # PPO: the outcome score on the last response token, the critic's values, GAE
            batch = [
                dataclasses.replace(r, token_fields={**r.token_fields, "rewards": (0.0,) * (len(r.response) - 1) + (s,)})
                for r, s in zip(rollouts, rewards)
            ]  # fmt: skip
        minis = self._mini_batches(batch, cfg.rollout.n)
        for k, mb in enumerate(minis):  # scores the updates need, once per step
            if self.critic is not None:
                mb = self._score_all(self.critic.ddp, mb, "values")
                mb = with_gae(mb, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam)
            if reference is not None and a.kl_loss_coef > 0:
                mb = self._score_all(reference, mb, "ref_logprobs")
            minis[k] = mb
        sums: dict[str, float] = {}
        count = 0
        for _ in range(a.ppo_epochs):
            for mb in minis:
                agg = Aggregation.of_batch(mb, a.loss_agg_mode, a.loss_agg_norm)
                actor = PolicyObjective(
                    agg=agg, clip_low=a.clip_ratio_low, clip_high=a.clip_ratio_high, clip_c=a.clip_ratio_c,
                    kl_coef=a.kl_loss_coef, kl_type=a.kl_loss_type, entropy_coef=a.entropy_coeff,
                    entropy_metric=True,
                )  # fmt: skip
                self.policy.model.train()
                res = update_step(
                    self.policy.ddp, mb, actor, self.plan, optimizer=self.policy.optimizer,
                    scheduler=self.policy.scheduler,
                )  # fmt: skip
                metrics = dict(res.metrics)
                if self.critic is not None:
                    crit = update_step(
                        self.critic.ddp, mb, ValueObjective(agg=agg, clip=cfg.critic.cliprange_value), self.plan,
                        optimizer=self.critic.optimizer, scheduler=self.critic.scheduler,
                    )  # fmt: skip
                    metrics.update({k: v for k, v in crit.metrics.items() if not _policy_only(k)})
                for key, v in metrics.items():
                    sums[key] = sums.get(key, 0.0) + v
                count += 1
        out = {k: v / count for k, v in sums.items()}  # means over the step's updates
        out["loss"] = out.pop("actor/loss")
        return out

    def update_dpo(self, pairs: list[Rollout], *, reference: Any) -> dict[str, float]:
        """DPO: one optimizer step per mini-batch of pairs (chosen/rejected rollouts), reference scored."""
        from megatron_branch.losses import DPOObjective
        from megatron_branch.update import update_step

        al = self.cfg.algorithm
        sums: dict[str, float] = {}
        count = 0
        for mb in self._mini_batches(pairs, 2):
            mb = self._score_all(reference, mb, "ref_logprobs")
            for _ in range(self.cfg.actor.ppo_epochs):
                obj = DPOObjective(num_pairs=len(mb) // 2, beta=al.dpo_beta, loss_type=al.dpo_loss)
                res = update_step(
                    self.policy.ddp, mb, obj, self.plan, optimizer=self.policy.optimizer,
                    scheduler=self.policy.scheduler,
                )  # fmt: skip
                for key, v in res.metrics.items():
                    sums[key] = sums.get(key, 0.0) + v
                count += 1
        out = {k: v / count for k, v in sums.items()}
        out["loss"] = out.pop("actor/loss")
        return out

    # ---- supervised warm-up (a separate optimizer: RL starts with fresh Adam moments) -------------------------
    def warmup(self, batches: list[list[Rollout]], lr: float, log: Any, stop: Any = None) -> int:
        """Supervised steps on `batches` until `stop(k)` (called after step k) says so; returns the steps run."""
        from megatron_branch.losses import AdvantagePolicyGradient
        from megatron_branch.update import build_optimizer, update_step

        settings = dataclasses.replace(_settings(self.cfg, lr, len(batches)), warmup_steps=0, decay_style="constant",
                                       decay_steps=None)  # fmt: skip
        opt, sched = build_optimizer(self.policy.ddp, settings, dtype=self.dtype)
        self.policy.model.train()
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
