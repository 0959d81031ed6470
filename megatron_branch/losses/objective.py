"""RL objectives on the LOGICAL batch, behind the one interface every schedule uses, and the hooks of an update.

A schedule never sees a whole rollout's loss at once: `packed` and `replay` hold chunks of the prefix tree, `naive`
holds one rollout. So an objective is *bound* to a tree once (`bind`), fixing its normalisation on the logical batch
(what naive training would count, across micro-batches and DP ranks), and then answers two questions:

    chunk_loss(logp [m], targets [m], entropy [m] | None) -> (loss, stats [K])   packed targets (tree schedules)
    rollout_loss(i, logp [L-1], entropy [L-1] | None)     -> (loss, stats [K])   rollout i's tokens 1..L-1 (naive)

Both must add up to the same total. `stats` are detached float64 metric contributions named by `stat_names`,
already normalised on the global batch, so they add over chunks, micro-batches and ranks like the loss does.
`needs_entropy` asks the schedule for each row's full-vocabulary entropy (computed in the fused projection). A token
shared by k rollouts appears once in the tree and has the same logprob in all of them, so any objective that is a
sum over (rollout, token) of f_i,t(logp) fits: the policy gradient below (linear), and PPO's clipped ratio (a
per-token function) alike (losses/token.py, losses/pairs.py).

An update (update/step.py) drives every objective the same way, through `ObjectiveBase`'s hooks: `role` names its
metrics (actor, or critic for a value head), `needs_reference` asks for the frozen reference's `ref_logprobs`, and
per micro-batch `prepare(tree, scores)` says what the schedule runs. A per-token objective runs itself. A
sequence-level objective (DPO) sets `needs_scores`: a forward-only pass scores the micro-batch first, and
`prepare` turns its loss into per-rollout coefficients of a linear pass (losses/dpo.py). Objectives are built from
the one config (losses/config.py) by the registry (losses/registry.py): `from_config(cfg, batch)`.

`PolicyGradientObjective` is the on-policy GRPO form used by `megatron-branch grad`:
    L = -(1/T) * sum_i sum_{t in response_i} m_{i,t} A_i * logp(i, t),   T = total trained response tokens
(m the rollout's loss_mask: 1 = trained, absent = all ones; a context token carries no term for that rollout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.errors import UserError
from megatron_branch.losses.registry import register_policy_loss


class BoundObjective(Protocol):
    needs_entropy: bool
    stat_names: tuple[str, ...]

    def chunk_loss(
        self, logp: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def rollout_loss(
        self, i: int, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


class Objective(Protocol):
    """What a schedule runs: bound to each tree it trains on."""

    def bind(self, tree: PrefixTree) -> BoundObjective: ...


class SequenceScores(Protocol):
    """A forward-only pass's result as an objective reads it (schedule.score.Scores)."""

    def sums(self) -> torch.Tensor: ...


@dataclass(kw_only=True)
class Prepared:
    """What one micro-batch trains on."""

    objective: Objective
    """What the schedule binds and back-propagates."""
    loss: float | None = None
    """The micro-batch's loss when `objective` is a surrogate with the same gradient (DPO's linear pass); None =
    the schedule's own loss."""
    stats: dict[str, float] | None = None
    """Its metric contributions in that case (None = the schedule's)."""


class ObjectiveBase:
    """The hooks an update (update/step.py) calls on every objective; the defaults are a per-token objective's."""

    role: ClassVar[str] = "actor"
    """Metric prefix and the model it trains: "actor" (a policy) or "critic" (a value head, models/critic.py)."""
    needs_scores: ClassVar[bool] = False
    """`prepare` needs a forward-only pass over its micro-batch first (sequence-level objectives: DPO)."""

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> ObjectiveBase:
        """This objective with the settings of `cfg` (losses.config.ObjectiveConfig), normalised on the GLOBAL
        batch `batch`; the registry's builder."""
        raise NotImplementedError(f"{cls.__name__} is not built from a config")

    @classmethod
    def check_name(cls, name: str) -> None:
        """Refuse a member name of a "family:" registration ("verl:<loss_mode>") before any work."""

    @classmethod
    def requires_reference(cls, cfg: Any) -> bool:
        """Whether the objective `cfg` describes reads `ref_logprobs` (a frozen reference must score them)."""
        return False

    @property
    def needs_reference(self) -> bool:
        return False

    def metric_names(self) -> tuple[str, ...]:
        """The metrics it reports (a rank with no rollouts still joins their sum over DP)."""
        return ()

    def check(self, tree: PrefixTree) -> None:
        """Refuse, before any work, a batch without the fields the objective reads (UserError naming file:line)."""
        self.bind(tree)  # type: ignore[attr-defined]

    def prepare(self, tree: PrefixTree, scores: SequenceScores | None) -> Prepared:
        """What the schedule runs on micro-batch `tree` (`scores`: the forward-only pass, when `needs_scores`)."""
        return Prepared(objective=self)  # type: ignore[arg-type]


@dataclass(kw_only=True)
class PolicyGradientObjective(ObjectiveBase):
    """Linear policy-gradient loss; `coef[i]` multiplies every response logprob of rollout i."""

    coef: torch.Tensor
    """[num_rollouts] float64: A_i / T (or any per-rollout scalar already normalised on the logical batch)."""

    @classmethod
    def grpo(cls, advantages: Sequence[float], num_response_tokens: int) -> PolicyGradientObjective:
        """On-policy GRPO: coef_i = A_i / T with T the GLOBAL logical trained response-token count (all DP
        ranks); each coefficient multiplies the rollout's trained tokens only."""
        if num_response_tokens <= 0:
            raise ValueError("the batch has no response tokens")
        return cls(coef=torch.tensor(list(advantages), dtype=torch.float64) / num_response_tokens)

    def bind(self, tree: PrefixTree) -> _BoundPolicyGradient:
        if len(self.coef) != len(tree.rollouts):
            raise ValueError(f"{len(self.coef)} coefficients for {len(tree.rollouts)} rollouts")
        return _BoundPolicyGradient(self, tree)


_NO_STATS = torch.zeros(0, dtype=torch.float64)


class _BoundPolicyGradient:
    needs_entropy = False
    stat_names: tuple[str, ...] = ()

    def __init__(self, objective: PolicyGradientObjective, tree: PrefixTree) -> None:
        self.objective, self.tree = objective, tree
        # [N] weight of each packed token's logprob: the sum over the rollouts that TRAIN it (loss_mask 1)
        self.weights = tree.token_weights(objective.coef, trained_only=True)

    def chunk_loss(
        self, logp: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return -(logp * self.weights[targets.cpu()].to(device=logp.device, dtype=logp.dtype)).sum(), _NO_STATS

    def rollout_loss(
        self, i: int, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.tree.rollouts[i]
        # logp[j] is the logprob of token j+1; response tokens start at index len(prompt)
        w = torch.zeros(len(r.prompt) + len(r.response) - 1, dtype=torch.float64)
        w[max(len(r.prompt) - 1, 0) :] = self.objective.coef[i]
        if r.loss_mask is not None:  # context tokens carry no term (an empty prompt's first token has no row)
            mask = torch.tensor(r.loss_mask, dtype=torch.float64)
            w[max(len(r.prompt) - 1, 0) :] *= mask if r.prompt else mask[1:]
        return -(logp * w.to(device=logp.device, dtype=logp.dtype)).sum(), _NO_STATS


@register_policy_loss("pg")
@dataclass(kw_only=True)
class AdvantagePolicyGradient(ObjectiveBase):
    """`PolicyGradientObjective.grpo` bound to any (sub-)tree from its rollouts' own advantages: the form an
    update over micro-batches and DP shards needs (T is the GLOBAL response-token count)."""

    num_response_tokens: int
    """T of the global batch: its trained response tokens (loss_mask 1)."""

    @classmethod
    def from_config(cls, cfg: Any, batch: Sequence[Rollout]) -> AdvantagePolicyGradient:
        return cls(num_response_tokens=sum(r.num_trained for r in batch))

    def bind(self, tree: PrefixTree) -> _BoundPolicyGradient:
        for i, r in enumerate(tree.rollouts):
            if r.advantage is None:
                raise UserError("missing field 'advantage'", where=r.describe(i))
        return PolicyGradientObjective.grpo(
            [r.advantage for r in tree.rollouts], self.num_response_tokens
        ).bind(tree)
