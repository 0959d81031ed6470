"""The actor: sampling from the policy, advantages, reference scores, and the policy updates of one RL step.

TEMPORARY update path (replaced by the objectives issue's update function): on-policy policy gradient with
torch's Adam. Kept only until that function lands in main.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.models import ModelArch
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.train.config import TrainConfig


@dataclass(kw_only=True)
class Batch:
    rollouts: list[Rollout]
    """The step's global batch with advantages set (and ref_logprobs when KL is on)."""
    groups: list[list[int]]
    """Rollout indices of each prompt."""


def group_advantages(rewards: list[float], groups: list[list[int]], *, norm_by_std: bool) -> list[float]:
    out = [0.0] * len(rewards)
    for g in groups:
        r = torch.tensor([rewards[i] for i in g], dtype=torch.float64)
        if len(g) < 2 or bool((r == r[0]).all()):
            continue
        a = r - r.mean()
        if norm_by_std:
            a = a / (r.std() + 1e-6)
        for i, v in zip(g, a.tolist()):
            out[i] = v
    return out


class Actor:
    def __init__(
        self,
        cfg: TrainConfig,
        model: torch.nn.Module,
        *,
        arch: ModelArch,
        groups: ParallelGroups,
        dtype: torch.dtype,
    ) -> None:
        from megatron_branch.generation import BranchSampler, SamplingParams

        self.cfg, self.model, self.arch, self.groups, self.dtype = cfg, model, arch, groups, dtype
        r = cfg.rollout
        self.params = SamplingParams(
            n=r.n, max_new_tokens=r.response_length, temperature=r.temperature, top_k=max(r.top_k, 0),
            top_p=r.top_p, branch_at=tuple(r.branch_at), branch_factor=r.branch_factor,
        )  # fmt: skip
        self.sampler = BranchSampler(
            model, vocab_size=arch.vocab_size, tp_group=groups.tp, sequence_parallel=groups.sequence_parallel,
            backend=cfg.schedule.backend,
        )  # fmt: skip
        self.opt = torch.optim.Adam(
            model.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.adam_beta1, cfg.optim.adam_beta2),
            eps=cfg.optim.adam_eps, weight_decay=cfg.optim.weight_decay,
        )  # fmt: skip

    def set_stop_tokens(self, ids: tuple[int, ...]) -> None:
        import dataclasses

        self.params = dataclasses.replace(self.params, stop_token_ids=tuple(ids))

    def generate(self, prompts: list[tuple[int, ...]], rng: torch.Generator) -> Any:
        self.model.eval()
        return self.sampler.generate(prompts, self.params, generator=rng)

    def prepare(
        self, rollouts: list[Rollout], rewards: list[float], groups: list[list[int]], *, reference: Any
    ) -> Batch:
        adv = group_advantages(rewards, groups, norm_by_std=self.cfg.algorithm.norm_adv_by_std_in_grpo)
        out = [Rollout(prompt=r.prompt, response=r.response, advantage=a, token_fields=r.token_fields)
               for r, a in zip(rollouts, adv)]  # fmt: skip
        return Batch(rollouts=out, groups=groups)

    def _schedule_step(self, rollouts: list[Rollout]) -> float:
        from megatron_branch.losses import PolicyGradientObjective
        from megatron_branch.parallel.data import assign_groups
        from megatron_branch.parallel.grads import finalize_grads
        from megatron_branch.schedule import ScheduleOptions, run_schedule

        full = PrefixTree.build(rollouts, vocab_size=self.arch.vocab_size)
        T = full.num_response_tokens_logical()
        mine = assign_groups(full, self.groups.dp_size)[torch.distributed.get_rank(self.groups.dp)]
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        loss = 0.0
        if mine:
            tree = PrefixTree.build([rollouts[i] for i in mine], vocab_size=self.arch.vocab_size)
            obj = PolicyGradientObjective.grpo([rollouts[i].advantage for i in mine], T)
            opts = ScheduleOptions(
                tp_group=self.groups.tp, tp_size=self.groups.tp_size,
                sequence_parallel=self.groups.sequence_parallel, vocab_size=self.arch.vocab_size,
                backend=self.cfg.schedule.backend, branch_micro_batch=self.cfg.schedule.branch_micro_batch,
                recompute=self.cfg.schedule.recompute,
            )  # fmt: skip
            loss = run_schedule(self.cfg.schedule.name, self.model, tree, obj, opts).loss
        finalize_grads(
            self.model, tp_group=self.groups.tp, dp_cp_group=self.groups.dp_cp,
            sequence_parallel=self.groups.sequence_parallel,
        )  # fmt: skip
        t = torch.tensor([loss], dtype=torch.float64)
        if self.groups.dp_size > 1:
            torch.distributed.all_reduce(t, group=self.groups.dp)
        if self.cfg.optim.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_grad)
        self.opt.step()
        return float(t[0])

    def update(self, batch: Batch, *, step: int) -> dict[str, float]:
        loss = self._schedule_step(batch.rollouts)
        return {"loss": loss}

    def supervised_step(self, rollouts: list[Rollout]) -> float:
        return self._schedule_step(rollouts)  # advantage 1, token-mean: the mean NLL

    def sharded_state(self, model_sd: dict[str, Any], *, loading: bool) -> dict[str, Any]:
        from megatron_branch.checkpoint.store import rng_sharded_object

        return {
            "optimizer": rng_sharded_object("torch_optimizer", None if loading else self.opt.state_dict())
        }

    def common_state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: dict[str, Any], common: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["optimizer"])
