"""The layouts the planner's search tries (plan/search.py `plan`): TP dividing the heads, PP dividing the layers
(the schedules that pipeline), CP the schedule runs at and a hybrid's GDN or Mamba-2 heads split into, DP up to
the prompt groups, EP splitting a MoE's experts (at the expert TP asked for: tp, or 1), every recompute level; and
the refusal of fixed sizes that do not fit --gpus. Which sizes run with which schedule is rules/'s (asked here, not
restated)."""

from __future__ import annotations

import math

from megatron_branch.errors import UserError
from megatron_branch.models.arch import ModelArch
from megatron_branch.plan.model import RECOMPUTE, Layout, RolloutShape
from megatron_branch.rules import check_pipeline, check_plannable, check_run, gdn_context_parallel_sizes


def candidate_layouts(
    arch: ModelArch,
    shape: RolloutShape,
    gpus: int,
    *,
    tp: int | None,
    cp: int | None,
    dp: int | None,
    recompute: str | None,
    schedule: str,
    pp: int | None = None,
    ep: int | None = None,
    etp: int | None = None,
) -> list[Layout]:
    out = []
    for t in (tp,) if tp else (1, 2, 4, 8):
        if gpus % t or etp not in (None, 1, t):  # expert TP: the whole TP group or none (parallel/layout.py)
            continue
        try:
            arch.check_tensor_parallel(t, etp=etp)
        except UserError:
            continue
        for p in (pp,) if pp else [p for p in (1, 2, 4, 8) if (gpus // t) % p == 0]:
            if (gpus // t) % p or not _runs(schedule, 1, p, arch):
                continue
            rest = gpus // (t * p)
            for c in (cp,) if cp else [c for c in range(1, rest + 1) if rest % c == 0]:
                if rest % c or not _runs(schedule, c, 1, arch) or not _splits_gdn_heads(arch, t, c):
                    continue
                if not _splits_mamba_heads(arch, schedule, t, c):
                    continue
                d = rest // c
                if (dp and d != dp) or d > shape.prompts:
                    continue
                for e in _expert_parallel_sizes(arch, t, c * d, ep, etp):
                    piped = Layout(tp=t, cp=c, dp=d, pp=p, ep=e, etp=etp)
                    if p > 1 and e > 1 and not _runs_experts_piped(schedule, piped, arch):
                        continue
                    for rc in (recompute,) if recompute else RECOMPUTE:
                        out.append(Layout(tp=t, cp=c, dp=d, pp=p, recompute=rc, ep=e, etp=etp))
    return out


def _expert_parallel_sizes(
    arch: ModelArch, tp: int, cp_dp: int, ep: int | None, etp: int | None = None
) -> list[int]:
    """EP sizes to try: the fixed one, else (MoE) every divisor of cp * dp that splits the experts."""
    if ep:
        return [ep] if cp_dp % ep == 0 else []
    if not arch.is_moe:
        return [1]
    out = []
    for e in range(1, cp_dp + 1):
        if cp_dp % e == 0:
            try:
                arch.check_expert_parallel(e, tp=tp, etp=etp)
            except UserError:
                continue
            out.append(e)
    return out


def _runs_experts_piped(schedule: str, layout: Layout, arch: ModelArch) -> bool:
    """A MoE's experts split over EP ranks under pipeline parallelism (rules/: each EP group inside a replica)."""
    try:
        check_pipeline(schedule, pp=layout.pp, moe=arch.is_moe, ep=layout.ep, ep_spans_dp=layout.ep_spans_dp)
    except UserError:
        return False
    return True


def _runs(schedule: str, cp: int, pp: int, arch: ModelArch) -> bool:
    """The schedule can run at this CP / PP size (rules/: naive has no CP and no PP; PP divides the layers; no PP
    for a Mamba-2 hybrid, nor, in the planner, for a gated-delta-net hybrid); what the planner prices at a CP size
    depends on TP too: `_splits_gdn_heads`, `_splits_mamba_heads`."""
    try:
        check_run(schedule, cp=cp)
        check_pipeline(
            schedule, pp=pp, num_layers=arch.num_layers, hybrid=arch.is_hybrid, moe=arch.is_moe,
            mamba=arch.hybrid_override_pattern is not None, planner=True,
        )  # fmt: skip
    except UserError:
        return False
    return True


def _splits_gdn_heads(arch: ModelArch, tp: int, cp: int) -> bool:
    """A hybrid's GDN heads split into cp head blocks on a TP rank (rules.check_gdn_context_parallel)."""
    if not arch.is_hybrid:
        return True
    sizes = gdn_context_parallel_sizes(
        key_heads=arch.linear_num_key_heads, value_heads=arch.linear_num_value_heads, tp=tp
    )
    return cp in sizes


def _splits_mamba_heads(arch: ModelArch, schedule: str, tp: int, cp: int) -> bool:
    """A Mamba-2 hybrid's heads and groups split into cp head blocks on a TP rank (rules.check_plannable, which
    asks the engine's rule, check_mamba_run)."""
    try:
        check_plannable(arch, schedule=schedule, cp=cp, tp=tp)
    except UserError:
        return False
    return True


def check_fixed_sizes(gpus: int, **sizes: int | None) -> None:
    """The sizes given (--tp 4 --cp 4) must fit --gpus: their product, said outright when it is larger (16 > 8),
    not the search's "no layout satisfies" that hides why."""
    given = {k: v for k, v in sizes.items() if v}
    product = math.prod(given.values())
    if product > gpus or gpus % product:
        names = " x ".join(f"--{k} {v}" for k, v in given.items())
        relation = f"> --gpus {gpus}" if product > gpus else f"does not divide --gpus {gpus}"
        raise UserError(f"{names} = {product} GPUs {relation}")
