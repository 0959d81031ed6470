"""What "exact" means in bf16: each schedule's bf16 gradient against a float64 reference of the same weights.

In bf16 no two schedules agree bitwise (each rounds to bf16 at other places and sums in another order), so the
bound is relative to naive training in the SAME precision: against float64 naive training of the same bf16-valued
weights on the same batch (float64 naive is exact vs Hugging Face at 1e-9: tests/unit/test_schedules.py), a
schedule's bf16 error is compared with naive's bf16 error, per parameter tensor (relative L2 error of the fp32
main gradient), for the loss and for the response logprobs (largest absolute error). docs/design.md ("bf16: what
exact means") states the bound and the measured figures; benchmarks/bf16_bound.py prints them, and
tests/unit/test_bf16.py asserts the bound.

Every run here is megatron's mixed precision as `train` runs it (precision.py): the model in bf16 inside megatron
DDP with fp32 main gradients (`grad_reduce_in_fp32`), one process; `main_grads_fp32=False` is the planted bug
(gradients summed in bf16).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_branch.data import Rollout
from megatron_branch.data.random_trees import random_tree_rollouts

VOCAB = 37
SCHEDULES = ("naive", "packed", "replay")


def bf16_weights(seed: int, *, scale: float = 3.0) -> dict[str, torch.Tensor]:
    """A tiny Llama's weights (models/tiny.py tiny_branch_model's init, x `scale`: peaked distributions), rounded to bf16:
    every dtype below holds exactly these values."""
    from megatron_branch.models.tiny import tiny_branch_model

    model = tiny_branch_model(torch.float32, seed=seed, scale=scale, vocab_size=VOCAB)
    return {n: p.detach().to(torch.bfloat16) for n, p in model.named_parameters()}


def model_with(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    """The tiny Llama in `dtype` holding `weights` (on the current single-process parallel state)."""
    from megatron_branch.models.tiny import tiny_branch_model

    model = tiny_branch_model(dtype, vocab_size=VOCAB)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[n].to(dtype))
    return model


def tree_batch(seed: int, *, groups: int = 2, prompt_len: int = 16, branches: int = 8) -> list[Rollout]:
    """Rollouts sharing each group's prompt and response beginnings (two levels), with GRPO-like per-group
    zero-mean advantages that vary per token, so a shared token carries a different weight in every rollout, and
    reference logprobs for the KL term."""
    rng = random.Random(seed)
    rs = random_tree_rollouts(
        vocab_size=VOCAB, groups=groups, prompt_len=prompt_len, branches=branches, levels=2, seg_len=(3, 7),
        seed=seed,
    )  # fmt: skip
    per_group = len(rs) // groups
    out = []
    for g in range(groups):
        part = rs[g * per_group : (g + 1) * per_group]
        mean = sum(r.advantage for r in part) / len(part)
        for r in part:
            adv = tuple(r.advantage - mean + rng.uniform(-0.3, 0.3) for _ in r.response)
            ref = tuple(rng.uniform(-4.0, -1.0) for _ in r.response)
            out.append(dataclasses.replace(r, token_fields={"advantages": adv, "ref_logprobs": ref}))
    return out


def objective_config() -> Any:
    """GRPO's clipped surrogate (dual clip), a low-variance KL to the reference and an entropy bonus."""
    from megatron_branch.losses import ObjectiveConfig

    return ObjectiveConfig(
        policy_loss="vanilla",
        clip_ratio_c=3.0,
        kl_loss_coef=0.05,
        kl_loss_type="low_var_kl",
        entropy_coeff=0.01,
    )


@dataclass(kw_only=True)
class Run:
    """One schedule's gradient of the batch in one dtype."""

    grads: dict[str, torch.Tensor]
    """Parameter name -> the main gradient (fp32 for bf16 runs), as float64."""
    loss: float
    logprobs: dict[int, list[float]] = field(default_factory=dict)
    """Rollout -> its response logprobs."""


def gradients(
    weights: dict[str, torch.Tensor],
    dtype: torch.dtype,
    schedule: str,
    rollouts: Sequence[Rollout],
    *,
    groups: Any,
    branch_micro_batch: int = 8,
    main_grads_fp32: bool = True,
    **options: Any,
) -> Run:
    """The gradient of the batch's objective (`objective_config`) in `dtype` through megatron DDP (one process);
    `options`: further ScheduleConfig fields (chunk_tokens=None: replay walked segment by segment)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_branch.assembly import RunSpec, ScheduleConfig, schedule_options
    from megatron_branch.losses import build_objective
    from megatron_branch.parallel.ddp import wrap_megatron_ddp
    from megatron_branch.update import UpdatePlan, accumulate_gradients, finalize

    model = model_with(weights, dtype)
    pgc = ProcessGroupCollection.use_mpu_process_groups()
    fp32 = None if main_grads_fp32 else False
    ddp = wrap_megatron_ddp(model, dtype=dtype, pg_collection=pgc, grad_reduce_in_fp32=fp32)
    spec = RunSpec(schedule=ScheduleConfig(name=schedule, branch_micro_batch=branch_micro_batch, **options))
    opts = schedule_options(spec, groups, VOCAB)
    plan = UpdatePlan(opts=opts, schedule=schedule, pg_collection=pgc)
    objective = build_objective(objective_config(), rollouts)
    acc = accumulate_gradients(ddp, rollouts, objective, plan, keep_logprobs=True)
    finalize(ddp, plan)
    grads = {n: p.main_grad.detach().double().clone() for n, p in model.named_parameters()}
    return Run(grads=grads, loss=acc.loss, logprobs=acc.logprobs)


def errors(run: Run, ref: Run) -> dict[str, Any]:
    """{"grads": {name: relative L2 error}, "loss": relative error, "logprobs": root-mean-square absolute error
    over every response token (one token's error alone is too noisy a statistic)."""
    grads = {n: float((g - ref.grads[n]).norm() / ref.grads[n].norm()) for n, g in run.grads.items()}
    diffs = [a - b for i, lps in run.logprobs.items() for a, b in zip(lps, ref.logprobs[i], strict=True)]
    lp = (sum(d * d for d in diffs) / len(diffs)) ** 0.5
    return {"grads": grads, "loss": abs(run.loss - ref.loss) / abs(ref.loss), "logprobs": lp}


def measure(
    seed: int,
    *,
    groups: Any,
    schedules: Sequence[str] = SCHEDULES,
    branch_micro_batch: int = 8,
    **batch_kw: Any,
) -> dict[str, dict[str, Any]]:
    """Errors of each schedule in bf16 against float64 naive, for one seed (weights and batch)."""
    weights = bf16_weights(seed)
    rollouts = tree_batch(seed, **batch_kw)
    ref = gradients(weights, torch.float64, "naive", rollouts, groups=groups)
    kw = {"groups": groups, "branch_micro_batch": branch_micro_batch}
    return {s: errors(gradients(weights, torch.bfloat16, s, rollouts, **kw), ref) for s in schedules}


def ratios(errs: dict[str, dict[str, Any]], schedule: str) -> dict[str, float]:
    """Per parameter tensor (and loss, logprobs): `schedule`'s bf16 error / naive's."""
    mine, naive = errs[schedule], errs["naive"]
    out = {n: e / naive["grads"][n] for n, e in mine["grads"].items()}
    out["loss"] = mine["loss"] / naive["loss"]
    out["logprobs"] = mine["logprobs"] / naive["logprobs"]
    return out
