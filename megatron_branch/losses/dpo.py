"""DPO on preference pairs, exact under branch replay: one no-grad pass, then one linear gradient pass.

A pair is two rollouts with the same prompt and the same `pair` key, one `chosen`. With pi = the sum of a
response's logprobs under the policy and ref the same under the frozen reference (`ref_logprobs`, given or scored
forward-only), over P pairs of the GLOBAL batch:

    sigmoid (Rafailov et al. 2023):  z = beta ((pi_c - ref_c) - (pi_r - ref_r)),   L = -(1/P) sum log sigmoid(z)
    ipo (TRL's form):                a = (pi - ref) / |o|,   L = (1/P) sum ((a_c - a_r) - 1/(2 beta))^2

With a loss_mask, pi and ref sum the TRAINED tokens only (loss_mask 1) and |o| is their count: context tokens
inside a response (a tool's output) condition the policy but are not its choice.

L depends on the policy only through the sums pi. So with g_i = dL/dpi_i computed from a forward-only pass, the
gradient is sum_i g_i dpi_i/dtheta: the linear per-rollout objective of losses/objective.py with coefficient
-g_i per response logprob (PolicyGradientObjective). That pass is an ordinary schedule run, so sharing (the
pair's prompt, any common start of the two responses) is exact as for every other objective.

Metrics (TRL's names): dpo/loss, rewards/chosen, rewards/rejected (beta (pi - ref), means over pairs),
rewards/accuracies, rewards/margins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.errors import UserError
from megatron_branch.losses.config import DPO_LOSSES
from megatron_branch.losses.objective import ObjectiveBase, PolicyGradientObjective, Prepared, SequenceScores
from megatron_branch.losses.registry import register_policy_loss

METRICS = ("dpo/loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")


def preference_pairs(rollouts: Sequence[Rollout]) -> list[tuple[int, int]]:
    """(chosen, rejected) rollout indices of every pair, in first-appearance order; a malformed pair is a
    one-line UserError naming the rollout's file:line."""
    by_key: dict[object, list[int]] = {}
    for i, r in enumerate(rollouts):
        if r.pair is None:
            raise UserError("missing field 'pair' (DPO needs preference pairs)", where=r.describe(i))
        if r.chosen is None:
            raise UserError("missing field 'chosen' (true or false)", where=r.describe(i))
        if r.num_trained == 0:
            raise UserError("loss_mask is all 0: a DPO response needs a trained token", where=r.describe(i))
        key = (type(r.pair).__name__, r.pair)  # 1 and "1" are different keys, as in JSON
        by_key.setdefault(key, []).append(i)
    out = []
    for (_, key), idx in by_key.items():
        last = rollouts[idx[-1]].describe(idx[-1])
        if len(idx) != 2:
            raise UserError(f"pair {key!r} has {len(idx)} rollouts; a pair is exactly two", where=last)
        a, b = idx
        if rollouts[a].chosen == rollouts[b].chosen:
            raise UserError(f"pair {key!r} needs one chosen and one rejected rollout", where=last)
        if rollouts[a].prompt != rollouts[b].prompt:
            raise UserError(f"pair {key!r}: the two rollouts have different prompts", where=last)
        if not rollouts[a].prompt:  # the pair must be one prompt group (one tree root) to stay on one rank
            raise UserError(f"pair {key!r} has an empty prompt; DPO pairs need a prompt", where=last)
        out.append((a, b) if rollouts[a].chosen else (b, a))
    return out


def reference_sums(tree: PrefixTree) -> torch.Tensor:
    """[R] float64 sum of each rollout's `ref_logprobs` over its scored, trained response tokens (an empty
    prompt's first token has no logprob, for the policy or the reference; loss_mask 0 tokens are context)."""
    out = torch.zeros(len(tree.rollouts), dtype=torch.float64)
    for i, r in enumerate(tree.rollouts):
        ref = r.field("ref_logprobs")
        if ref is None:
            raise UserError("missing field 'ref_logprobs' (one per response token)", where=r.describe(i))
        mask = r.loss_mask or (True,) * len(ref)
        out[i] = sum(x for j, (x, m) in enumerate(zip(ref, mask)) if m and (j or r.prompt))
    return out


@register_policy_loss("dpo")
@dataclass(kw_only=True)
class DPOObjective(ObjectiveBase):
    """DPO / IPO loss, sequence-level: `prepare` (through `linearise`) turns it into the gradient pass's linear
    objective at the policy sums a forward-only pass scored."""

    needs_scores = True

    num_pairs: int
    """P: pairs in the GLOBAL batch (every micro-batch and DP rank)."""
    beta: float = 0.1
    """Inverse temperature (sigmoid) or the IPO regulariser's 1/(2 beta) target."""
    loss_type: str = "sigmoid"
    """sigmoid | ipo."""

    def __post_init__(self) -> None:
        if self.loss_type not in DPO_LOSSES:
            raise ValueError(f"unknown DPO loss {self.loss_type!r}; choose one of {', '.join(DPO_LOSSES)}")
        if not self.beta > 0:
            raise ValueError(f"beta must be positive, got {self.beta}")
        if self.num_pairs <= 0:
            raise ValueError("the batch has no preference pairs")

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> DPOObjective:
        return cls(num_pairs=len(preference_pairs(batch)), beta=cfg.dpo_beta, loss_type=cfg.dpo_loss)

    @classmethod
    def requires_reference(cls, cfg: Any) -> bool:
        return True

    @property
    def needs_reference(self) -> bool:
        return True

    def metric_names(self) -> tuple[str, ...]:
        return METRICS

    def check(self, tree: PrefixTree) -> None:
        preference_pairs(tree.rollouts)
        reference_sums(tree)  # every rollout has ref_logprobs

    def prepare(self, tree: PrefixTree, scores: SequenceScores | None) -> Prepared:
        assert scores is not None, "DPO needs the forward-only pass's policy sums (needs_scores)"
        linear, loss, stats = self.linearise(tree, scores.sums())
        return Prepared(objective=linear, loss=loss, stats=stats)

    def loss(self, tree: PrefixTree, pi: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """(loss of this tree's pairs as a differentiable function of pi [R], metric contributions)."""
        pairs = preference_pairs(tree.rollouts)
        c = torch.tensor([a for a, _ in pairs], dtype=torch.long)
        r = torch.tensor([b for _, b in pairs], dtype=torch.long)
        ref = reference_sums(tree).to(pi.dtype)
        logratio = pi - ref  # [R]
        if self.loss_type == "sigmoid":
            z = self.beta * (logratio[c] - logratio[r])
            per = -torch.nn.functional.logsigmoid(z)
        else:
            n = torch.tensor([float(x.num_trained) for x in tree.rollouts], dtype=pi.dtype)  # |o| trained
            a = logratio / n
            per = ((a[c] - a[r]) - 1.0 / (2.0 * self.beta)).square()
        P = self.num_pairs
        rc, rr = (self.beta * logratio[c]).detach(), (self.beta * logratio[r]).detach()
        stats = {
            "dpo/loss": float(per.detach().sum()) / P,
            "rewards/chosen": float(rc.sum()) / P,
            "rewards/rejected": float(rr.sum()) / P,
            "rewards/accuracies": float((rc > rr).to(torch.float64).sum()) / P,
            "rewards/margins": float((rc - rr).sum()) / P,
        }
        return per.sum() / P, stats

    def linearise(
        self, tree: PrefixTree, pi: torch.Tensor
    ) -> tuple[PolicyGradientObjective, float, dict[str, float]]:
        """(the gradient pass's objective, this tree's DPO loss, metric contributions) at policy sums pi [R]."""
        x = pi.detach().to(torch.float64).requires_grad_()
        loss, stats = self.loss(tree, x)
        (g,) = torch.autograd.grad(loss, x)  # [R] dL/dpi_i
        return PolicyGradientObjective(coef=-g), float(loss.detach()), stats
