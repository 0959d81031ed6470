"""verl's update in ONE tree pass, for verl losses that are per-token functions given global normalisers.

Shape legend: P packed tokens of the step's prefix tree, m targets of one chunk, N flat slots of one verl
micro-batch (verl's no-padding layout, verl_batch.py).

The two-pass path (verl_step.py) first scores the tree forward-only, then linearises verl's loss at those values.
That forward exists only to know each token's logprob before its gradient is needed. When verl's loss L is
sum over response slots s of f_s(logp_s, H_s), with f_s fixed by the batch's data (old logprobs, advantages,
masks, reference logprobs, the GLOBAL token / rollout counts verl puts in the micro-batch), dL/dlogp_s needs
only slot s's own value, which the tree's training pass produces in the chunk that predicts that token. So the
objective here evaluates verl's own loss inside the pass: per chunk, for each micro-batch holding one of its
tokens, verl's `postprocess_micro_batch_func` (hence `ppo_loss`) runs on a slot tensor that carries the chunk's
live logprobs (and entropies) at their slots and a constant elsewhere. Every term at a constant slot has no
gradient, every term at a live slot is f_s at its true value, so the chunk loss's gradient is exactly the chunk's
share of dL/dtheta (its forward value is not L and is not used). A token shared by k rollouts fills k slots from
one live value: autograd sums the k gradients, as the tree needs. verl's outputs and metrics then come from one
more call of verl's post-processing per micro-batch on the pass's own (detached) values: no model work.

Per-token (one pass), verl 0.9.1's `core_algos` read term by term: policy loss modes vanilla (dual clip
included), dppo_tv, dppo_kl, sapo, gpg, dro, cispo; every `loss_agg_mode` (token-mean, token-sum,
seq-mean-token-sum, seq-mean-token-sum-norm, seq-mean-token-mean: their normalisers are mask counts and the
global counts, never logprobs); the entropy bonus; every KL loss type (kl/k1, abs, mse/k2, low_var_kl/k3 and
their "+" forms). Two passes (the value at one token depends on others' logprobs): gspo (the rollout's mean
log-ratio s_i), geo_mean (the rollout's mean clipped log-ratio), clip_cov and kl_cov (a covariance ranking over
the micro-batch), bypass_mode (IS weights / rejection from the current logprobs, per sequence or batch), any
mode a plugin registers, any loss function other than verl's `ppo_loss` / `value_loss`, and the `naive` schedule.
verl's `value_loss` (the critic's clipped value loss, any loss_agg_mode) is per token: one pass, the values of
the critic's one-output head standing where the policy's logprobs do.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from megatron_branch.data import PrefixTree
from megatron_branch.integration.verl_batch import TreeSlots

PER_TOKEN_LOSS_MODES = frozenset({"vanilla", "dppo_tv", "dppo_kl", "sapo", "gpg", "dro", "cispo"})
"""verl policy loss modes whose value is a sum of per-token terms given the batch's data (module doc)."""
AGG_MODES = frozenset(
    {"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"}
)
"""verl's loss_agg_modes: normalisers from masks and global counts only."""
ONE_PASS_SCHEDULES = ("replay", "packed")
"""Schedules that feed the objective per chunk of tree tokens (`naive` keeps the two-pass path)."""

_FILL = -1.0
"""The constant at slots outside the chunk: a finite logprob / entropy (no inf or NaN in verl's forward)."""
_NO_STATS = torch.zeros(0, dtype=torch.float64)


def verl_model_output(
    slots: TreeSlots, k: int, values: torch.Tensor, entropy: torch.Tensor | None, *, value_model: bool
) -> Any:
    """Micro-batch k's [N] slot values as verl's `prepare_model_outputs` takes them: the language-model engine a
    dict of `log_probs` (and `entropy`), the value engine the values themselves (it makes `{"values": ...}`)."""
    if value_model:
        return slots.as_nested(k, values)
    out = {"log_probs": slots.as_nested(k, values)}
    if entropy is not None:
        out["entropy"] = slots.as_nested(k, entropy)
    return out


def two_pass_reason(postprocess: Callable[..., Any], schedule: str) -> str | None:
    """None when verl's loss behind `postprocess` (verl's partial of `postprocess_micro_batch_func`) runs in one
    tree pass; otherwise why the update keeps the two-pass path (one line, for the log)."""
    from verl.workers.utils.losses import ppo_loss, value_loss

    if schedule not in ONE_PASS_SCHEDULES:
        return f"schedule {schedule!r} evaluates rollouts one by one"
    fn = getattr(postprocess, "keywords", {}).get("loss_function")
    if isinstance(fn, functools.partial) and fn.func is value_loss and "config" in fn.keywords:
        agg = fn.keywords["config"].loss_agg_mode  # the clipped value loss is per token
        return None if agg in AGG_MODES else f"loss_agg_mode={agg} is not one of verl 0.9.1's"
    if not (isinstance(fn, functools.partial) and fn.func is ppo_loss and "config" in fn.keywords):
        return f"the loss {getattr(fn, 'func', fn)!r} is not verl's ppo_loss"
    cfg = fn.keywords["config"]
    mode = (cfg.policy_loss or {}).get("loss_mode", "vanilla")
    if mode not in PER_TOKEN_LOSS_MODES:
        return f"policy_loss.loss_mode={mode} reads other tokens' logprobs (a sequence or batch term)"
    if cfg.loss_agg_mode not in AGG_MODES:
        return f"loss_agg_mode={cfg.loss_agg_mode} is not one of verl 0.9.1's"
    return None


@dataclass(frozen=True, kw_only=True)
class VerlOnePassObjective:
    """verl's loss evaluated inside the tree's training pass (module doc). `scale` turns the sum of the
    micro-batches' verl losses into what megatron back-propagates: / num_microbatches, then `grad_scale_func`."""

    postprocess: Callable[..., Any]
    micro_batches: list[Any]
    slots: TreeSlots
    scale: Callable[[torch.Tensor], torch.Tensor]
    entropy: bool
    device: torch.device
    value_model: bool = False
    """verl's value model: the pass's per-row values stand where the policy's logprobs do."""

    def bind(self, tree: PrefixTree) -> _BoundOnePass:
        # the step's tree, or its root pieces under PP (data/pieces.py split_roots: the same rollouts and packed
        # layout, so the slots' token indices hold)
        assert tree.rollouts is self.slots.tree.rollouts and tree.num_tokens == self.slots.tree.num_tokens
        return _BoundOnePass(self)


class _BoundOnePass:
    stat_names: tuple[str, ...] = ()

    def __init__(self, objective: VerlOnePassObjective) -> None:
        self.o = objective
        self.needs_entropy = objective.entropy

    def _live(self, k: int, where: torch.Tensor, values: torch.Tensor) -> torch.Tensor | None:
        """Micro-batch k's [N] slots: `values[where[token]]` at the response slots of the chunk's tokens, the
        constant elsewhere; None when the chunk holds none of its tokens."""
        slots = self.o.slots
        j = where[slots.tokens[k]]
        hit = j >= 0
        if not bool(hit.any()):
            return None
        flat = torch.full((int(slots.offsets[k][-1]),), _FILL, dtype=torch.float32, device=self.o.device)
        idx = slots.slots[k][hit].to(self.o.device)
        return flat.index_put((idx,), values[j[hit].to(values.device)].to(torch.float32))

    def chunk_loss(
        self, logp: torch.Tensor, targets: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[m] live logprobs (entropies) of the chunk's targets -> the chunk's share of megatron's loss."""
        slots = self.o.slots
        where = torch.full((slots.tree.num_tokens,), -1, dtype=torch.long)
        where[targets.cpu()] = torch.arange(len(targets))
        total = (
            logp.float().sum() * 0.0
        )  # on the graph even when no slot is live (a chunk every loss ignores)
        for k, mb in enumerate(self.o.micro_batches):
            lp = self._live(k, where, logp)
            if lp is None:
                continue
            ent = None
            if self.needs_entropy:
                assert entropy is not None, "the schedule did not compute the entropy verl's loss reads"
                ent = self._live(k, where, entropy)
            output = verl_model_output(slots, k, lp, ent, value_model=self.o.value_model)
            loss, _ = self.o.postprocess(output, data=mb)
            total = total + loss
        return self.o.scale(total).to(logp.dtype), _NO_STATS

    def rollout_loss(
        self, i: int, logp: torch.Tensor, entropy: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise AssertionError("the naive schedule keeps verl's two-pass path (two_pass_reason)")


def one_pass_objective(
    model_chunk: torch.nn.Module,
    config: Any,
    postprocess: Callable[..., Any],
    micro_batches: list[Any],
    slots: TreeSlots,
    *,
    entropy: bool,
    value_model: bool,
) -> VerlOnePassObjective:
    """The objective of the step's one training pass: verl's loss per micro-batch, scaled as megatron's schedule
    scales what it back-propagates (/ num_microbatches, then `grad_scale_func` of `config`, the model's
    TransformerConfig)."""
    n = len(micro_batches)

    def scale(loss: torch.Tensor) -> torch.Tensor:
        loss = loss / n  # megatron's forward_step divides each micro-batch loss by num_microbatches
        return config.grad_scale_func(loss) if config.grad_scale_func is not None else loss

    return VerlOnePassObjective(
        postprocess=postprocess,
        micro_batches=micro_batches,
        slots=slots,
        scale=scale,
        entropy=entropy,
        device=next(model_chunk.parameters()).device,
        value_model=value_model,
    )
