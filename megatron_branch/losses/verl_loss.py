"""Any verl policy loss, exactly, through verl's own function: `policy_loss = "verl:<loss_mode>"`.

Shape legend: R rollouts of the micro-batch, W its longest response, P its (rollout, token) pairs.

verl's policy losses (verl 0.9.1 `core_algos.get_policy_loss_fn`: vanilla, gspo, sapo, gpg, clip_cov, kl_cov,
geo_mean, dro, cispo, dppo_tv, dppo_kl, bypass_mode, and any a plugin registers there) are functions of the
per-token logprobs on verl's padded [R, W] layout. Two passes, as DPO's (losses/dpo.py) and the verl
integration's (integration/verl_step.py):

    1. a forward-only pass scores the micro-batch: logp [R, W], the current policy's response logprobs;
    2. verl's function runs on logp held as an autograd leaf, with old_logprobs, the advantages and the response
       mask; g = dL/dlogp [R, W] is its gradient per (rollout, token) pair;
    3. the gradient pass back-propagates sum_p g_p logp_p through the tree (a shared token sums its rollouts' g).

Exact for any loss that is a function of the response logprobs (the linearisation has the same gradient at the
scored point). verl's aggregation is made global: `global_batch_info` carries the GLOBAL token and rollout counts
(and L_norm), so micro-batch losses add up to the batch's. A loss that reads the whole batch in one call
(`WHOLE_BATCH`: geo_mean's mean over rows, clip_cov's and kl_cov's covariance ranking) is exact only when the
micro-batch is the whole batch; otherwise it is refused. The KL penalty and the entropy bonus are added natively
(losses/policy.py) with loss_agg_mode, as verl's actor adds them outside the loss function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.errors import SettingError, UserError
from megatron_branch.losses.aggregation import Aggregation
from megatron_branch.losses.objective import Prepared, SequenceScores
from megatron_branch.losses.pairs import TokenPairs
from megatron_branch.losses.policy import PolicyObjective, policy_settings
from megatron_branch.losses.registry import register_policy_loss

PREFIX = "verl:"
"""policy_loss = PREFIX + verl's loss_mode."""
WHOLE_BATCH = ("geo_mean", "clip_cov", "kl_cov")
"""verl losses whose value depends on every row of the call (not a per-token function given global counts)."""


def verl_loss_fn(name: str) -> Any:
    """verl's policy loss function `name` (a loss_mode); a one-line SettingError without verl or for a name verl
    does not register."""
    try:
        from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY, get_policy_loss_fn
    except ImportError:
        raise SettingError(
            lambda s: (
                f"{s.value('policy_loss', PREFIX + name)} needs verl, which is not installed (make setup-verl; "
                "docs/verl.md)"
            )
        ) from None
    if name not in POLICY_LOSS_REGISTRY:
        known = ", ".join(sorted(POLICY_LOSS_REGISTRY))
        raise SettingError(
            lambda s: f"unknown {s.name('policy_loss')} {PREFIX + name!r}; verl registers: {known}"
        )
    return get_policy_loss_fn(name)


def _verl_config(cfg: Any, mode: str, agg: Aggregation) -> Any:
    """verl's ActorConfig with the objective's settings and the GLOBAL batch's counts."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    kw: dict[str, Any] = {}
    if cfg.clip_ratio_c is not None:
        kw["clip_ratio_c"] = cfg.clip_ratio_c  # None: verl's own default (3.0)
    info: dict[str, Any] = {
        "dp_size": 1,
        "batch_num_tokens": agg.num_tokens,
        "global_batch_size": agg.num_rollouts,
    }
    if agg.norm is not None:
        info["loss_scale_factor"] = agg.norm
    return ActorConfig(
        strategy="megatron",
        ppo_mini_batch_size=1,
        ppo_micro_batch_size_per_gpu=1,
        rollout_n=1,
        clip_ratio_low=cfg.clip_ratio_low,
        clip_ratio_high=cfg.clip_ratio_high,
        tau_pos=cfg.tau_pos,
        tau_neg=cfg.tau_neg,
        loss_agg_mode=cfg.loss_agg_mode,
        policy_loss=PolicyLossConfig(loss_mode=mode),
        global_batch_info=info,
        **kw,
    )


@register_policy_loss(PREFIX)
@dataclass(kw_only=True)
class VerlPolicyLoss(PolicyObjective):
    """verl's loss function `mode`, linearised at the forward-only pass (module doc)."""

    needs_scores = True

    mode: str
    """verl's loss_mode."""
    verl_config: Any = None
    """verl's ActorConfig the function reads."""
    coef: torch.Tensor | None = None
    """[P] dL/dlogp of each pair of the prepared micro-batch, divided by its aggregation weight."""
    value: torch.Tensor | None = None
    """[P] the micro-batch's verl loss spread over its pairs, divided by each pair's aggregation weight."""
    clipfrac: tuple[float, float] = (0.0, 0.0)
    """verl's actor/pg_clipfrac and actor/pg_clipfrac_lower of the micro-batch (token means)."""

    @classmethod
    def check_name(cls, name: str) -> None:
        """Refuse, before any work, a verl loss without verl or one verl does not register."""
        verl_loss_fn(name[len(PREFIX) :])

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> VerlPolicyLoss:
        mode = cfg.policy_loss[len(PREFIX) :]
        verl_loss_fn(mode)
        settings = policy_settings(cfg, batch)
        return cls(**settings, mode=mode, verl_config=_verl_config(cfg, mode, settings["agg"]))

    def check(self, tree: PrefixTree) -> None:
        pairs = TokenPairs(tree)
        zero = torch.zeros(pairs.num_pairs, dtype=torch.float64)
        dataclasses.replace(self, coef=zero, value=zero).bind(tree)

    def prepare(self, tree: PrefixTree, scores: SequenceScores | None) -> Prepared:
        assert scores is not None, "a verl loss needs the forward-only pass's logprobs (needs_scores)"
        if self.mode in WHOLE_BATCH and len(tree.rollouts) != self.agg.rows:
            raise UserError(
                f"verl's {self.mode} reads the whole batch in one call: run the update as one micro-batch on one "
                f"DP rank ({len(tree.rollouts)} of {self.agg.rows} rollouts here)"
            )
        pairs = TokenPairs(tree)
        rows, cols = pairs.rollout, pairs.position
        width = max(len(r.response) for r in tree.rollouts)
        cur = torch.cat(
            [scores.logprobs[i].to(torch.float64) for i in range(len(tree.rollouts))]  # type: ignore[attr-defined]
        )
        offsets = torch.tensor([0] + [len(r.response) for r in tree.rollouts]).cumsum(0)
        cur = cur[offsets[rows] + cols]  # [P] current logprob of each pair
        old, has_old = pairs.field("old_logprobs", required=False)
        adv, _ = pairs.field("advantages", scalar="advantage")

        def padded(x: torch.Tensor) -> torch.Tensor:
            out = torch.zeros(len(tree.rollouts), width, dtype=torch.float64)
            out[rows, cols] = x
            return out

        logp = padded(cur).requires_grad_()  # [R, W]
        mask = padded(torch.ones_like(cur))
        with torch.enable_grad():
            loss, metrics = verl_loss_fn(self.mode)(
                padded(torch.where(has_old, old, cur)),
                logp,
                padded(adv),
                mask,
                self.agg.mode,
                self.verl_config,
            )
            (g,) = torch.autograd.grad(loss, logp, allow_unused=True)
        g = torch.zeros_like(logp) if g is None else g
        w = self.agg.rollout_weight
        weight = torch.tensor([w(r.num_trained) for r in tree.rollouts], dtype=torch.float64)[rows]
        return Prepared(
            objective=dataclasses.replace(
                self,
                coef=g[rows, cols] / weight,
                value=float(loss.detach()) / (max(pairs.num_pairs, 1) * weight),
                clipfrac=(
                    float(metrics.get("actor/pg_clipfrac", 0.0)),
                    float(metrics.get("actor/pg_clipfrac_lower", 0.0)),
                ),
            )
        )

    def pair_data(self, pairs: TokenPairs) -> dict[str, torch.Tensor]:
        assert self.coef is not None and self.value is not None, (
            "bind a prepared verl loss (prepare(tree, scores))"
        )
        assert len(self.coef) == pairs.num_pairs, "coefficients of another micro-batch"
        return {**super().pair_data(pairs), "coef": self.coef, "value": self.value}

    def pg_terms(
        self, logp: torch.Tensor, d: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # value: verl's loss (weighted sum over the pairs); gradient: verl's dL/dlogp at the scored point
        pg = d["value"] + d["coef"] * (logp - logp.detach())
        clip, lower = (torch.full_like(logp, v) for v in self.clipfrac)
        return pg, clip, lower
