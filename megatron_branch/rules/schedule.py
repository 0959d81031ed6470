"""The schedule's rules: which schedules exist, what each runs (context parallelism, recompute, the engine's
backend and layer checkpointing, a hybrid model, the pipeline) and the precision a run may sum its gradients in.

The rules are listed in the package doc (megatron_branch/rules/__init__.py); `check` there runs them in order.
"""

from __future__ import annotations

from megatron_branch.errors import SettingError

TRAIN_SCHEDULES = ("replay", "packed", "naive", "naive-fused", "packed-nosharing", "replay-stopgrad")
"""Schedules a training run (`train`'s schedule.name) can step with; all but replay-stopgrad are exact."""
AUTO_SCHEDULE = "auto"
"""`schedule.name: auto` / `grad --schedule auto` (plan/auto.py): packed when its planned memory fits the budget and the
tree is at most one of replay's chunks, replay otherwise; checked as replay (what it falls back to), packed asked per
batch."""
GRAD_SCHEDULES = ("replay", "packed", "naive")
"""The schedules of `grad`'s stable contract and of megatron's drop-in (integration/schedule.py)."""
UNSHARED = ("naive", "naive-fused", "packed-nosharing")
"""Schedules that compute every rollout's every position (nothing shared): the baselines."""
NO_RING = ("naive", "naive-fused", "packed-nosharing", "replay-stopgrad")
"""Schedules without context parallelism."""
HYBRID_SCHEDULES = ("naive", "naive-fused", "packed", "replay", "packed-nosharing")
"""Schedules that run a hybrid (gated delta net) model exactly."""
REPLAY_SCHEDULES = ("replay", "replay-stopgrad")
"""Schedules with segment recompute (replay's depth-first walk)."""
MEGATRON_ATTENTION = ("naive",)
"""Schedules that run megatron-core's own attention: no ring, no engine backend, no engine layer checkpointing."""


def check_run(
    schedule: str,
    *,
    cp: int = 1,
    recompute: bool = False,
    recompute_layers: bool = False,
    backend: str | None = None,
    training: bool = True,
    device: str | None = None,
) -> None:
    """Refuse a schedule with settings it cannot honour (see the module doc). A SettingError, command-line
    wording; re-spell it at entry points with other names. `training` and `device` (default: cuda when available)
    say how and where the backend must run."""
    own = schedule in MEGATRON_ATTENTION
    if schedule in NO_RING and cp > 1:
        raise SettingError(
            lambda s: (
                f"{s.value('schedule', schedule)} has no context parallelism (it has no ring: every CP rank "
                f"would compute the whole batch); use packed or replay with {s.name('cp')} > 1"
            )
        )
    if recompute and schedule not in REPLAY_SCHEDULES:
        raise SettingError(
            lambda s: (
                f"{s.name('recompute')} applies to {s.name('schedule')} replay only; "
                f"{s.value('schedule', schedule)} ignores it"
            )
        )
    if own and recompute_layers:
        raise SettingError(
            lambda s: (
                f"{s.name('recompute_layers')} applies to {s.name('schedule')} replay or packed; the "
                f"{schedule} schedule runs megatron's own attention without the engine's layer checkpointing"
            )
        )
    if own and backend is not None:
        raise SettingError(
            lambda s: (
                f"{s.name('backend')} applies to {s.name('schedule')} replay or packed; the {schedule} "
                "schedule runs megatron's own attention, not an engine backend"
            )
        )
    if not own:
        from megatron_branch.attention.dispatch import (
            backend_problem,
        )  # lazy: rules stay importable without torch

        if device is None:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
        problem = backend_problem(backend, cp_size=cp, training=training, device=device)
        if problem is not None:
            raise SettingError(lambda s: f"{s.value('backend', backend)}: {problem}")


def check_hybrid_schedule(schedule: str, *, model: str) -> None:
    """Refuse a schedule that cannot run a hybrid (gated delta net) model exactly; `model` describes the model."""
    if schedule not in HYBRID_SCHEDULES:
        raise SettingError(
            lambda s: (
                f"{s.value('schedule', schedule)} cannot run a hybrid model ({model}); use {s.name('schedule')} "
                f"{', '.join(HYBRID_SCHEDULES)}"
            )
        )


PIPELINE_SCHEDULES = ("replay", "packed", "naive-fused")
"""Schedules that run under pipeline parallelism (schedule/pipeline.py; naive-fused: the benchmark's fair
baseline)."""


def check_pipeline(
    schedule: str,
    *,
    pp: int,
    num_layers: int | None = None,
    virtual: int | None = None,
    hybrid: bool = False,
    moe: bool = False,
    ep: int = 1,
    ep_spans_dp: bool | None = None,
    mamba: bool = False,
    planner: bool = False,
    root_pieces: int = 1,
) -> None:
    """Refuse what pipeline parallelism cannot run (see the module doc): a SettingError, command-line wording.
    `num_layers`: the model's (when known); `virtual`: megatron's virtual_pipeline_model_parallel_size;
    `root_pieces`: the sequence pieces each replay root is cut into (schedule/options.py). A mixture-of-experts
    model (`moe`) pipelines with its router losses, metrics and routing replay per stage (schedule/moe.py), its
    experts split over `ep` ranks when each EP group stays inside one data-parallel replica (EP over the CP ranks:
    tests/distributed/test_pipeline_moe.py); `ep_spans_dp` (an EP group holds ranks of different replicas) is
    refused: the replicas' lockstep (parallel/lockstep.py) agrees over all ranks at every model call, while a
    pipeline stage waits on its neighbour stage's sends, so the two would wait on each other; None (a caller that
    does not tell, verl's engine) keeps EP > 1 under PP refused there (not shown). A `hybrid`
    (gated delta net) model pipelines too (each stage's prefix cache holds its GDN layers' fork states); the
    planner (`planner`: the caller is plan/) prices a dense hybrid's stages by layer kind, not a MoE hybrid's; a
    Mamba-2 hybrid (`mamba`) is not shown."""
    if root_pieces < 1:
        raise SettingError(
            lambda s: f"{s.name('root_pieces')} must be a positive number of pieces, got {root_pieces}"
        )
    if root_pieces > 1 and schedule != "replay":
        raise SettingError(
            lambda s: (
                f"{s.value('root_pieces', root_pieces)} applies to {s.name('schedule')} replay only (it cuts "
                f"replay's shared roots into pieces); {s.value('schedule', schedule)} has no root chunk to cut"
            )
        )
    if root_pieces > 1 and pp == 1:
        raise SettingError(
            lambda s: (
                f"{s.value('root_pieces', root_pieces)} needs pipeline parallelism ({s.name('pp')} > 1): the "
                "pieces fill the stages; on one stage they would run one after another as the whole root does"
            )
        )
    if virtual not in (None, 1):
        raise SettingError(
            lambda s: (
                f"{s.value('vp', virtual)}: interleaved (virtual) pipeline stages are not supported; branch replay "
                "runs one contiguous block of layers per stage"
            )
        )
    if pp == 1:
        return
    if schedule not in PIPELINE_SCHEDULES:
        raise SettingError(
            lambda s: (
                f"{s.value('schedule', schedule)} has no pipeline parallelism; use {s.name('schedule')} replay or "
                f"packed (or naive-fused, the baseline) with {s.value('pp', pp)}"
            )
        )
    if num_layers is not None and num_layers % pp:
        raise SettingError(
            lambda s: (
                f"{s.value('pp', pp)} does not divide the model's {num_layers} layers (each stage holds "
                "num_layers / pp consecutive layers)"
            )
        )
    if mamba:
        raise SettingError(
            lambda s: (
                f"{s.value('pp', pp)}: pipeline parallelism cannot run a Mamba-2 hybrid model yet (not shown); "
                f"use {s.value('pp', 1)}"
            )
        )
    if hybrid and moe and planner:
        raise SettingError(
            lambda s: (
                f"{s.value('pp', pp)}: the planner does not price a mixture-of-experts hybrid (gated delta net) "
                f"model's pipeline stages yet (plan/pipeline.py prices a dense hybrid's stages by layer kind); "
                f"use {s.value('pp', 1)}"
            )
        )
    if moe and ep > 1 and ep_spans_dp is None:
        raise SettingError(
            lambda s: (
                f"{s.value('pp', pp)} with {s.value('ep', ep)}: expert parallelism under pipeline parallelism is "
                f"not shown here yet (a mixture-of-experts model pipelines with {s.value('ep', 1)}); use one of them"
            )
        )
    if moe and ep > 1 and ep_spans_dp:
        raise SettingError(
            lambda s: (
                f"{s.value('pp', pp)} with {s.value('ep', ep)} across data-parallel replicas: expert parallelism "
                "under pipeline parallelism needs each EP group inside one replica (ep x etp dividing tp x cp, e.g. "
                f"EP over the CP ranks); use {s.value('ep', 1)} or a larger {s.name('cp')} / {s.name('tp')}"
            )
        )


def check_precision(dtype: str, *, grad_sync: str = "ddp", training: bool = False) -> None:
    """Refuse a half-precision run whose gradients would be summed in that precision (bf16 / fp16 parameters
    accumulate in megatron DDP's fp32 main gradients, precision.py; the plain reduction sums `param.grad` in its
    dtype), and fp16 training (`training`: an optimizer steps on the gradients): megatron's fp16 needs its dynamic
    loss scale multiplied into every backward, and the schedules' backward calls (replay's injections included) do
    not apply it, so the scaler would unscale gradients that were never scaled."""
    from megatron_branch.precision import HALF_NAMES

    if dtype in HALF_NAMES and grad_sync != "ddp":
        raise SettingError(
            lambda s: (
                f"{s.value('dtype', dtype)} accumulates gradients in megatron DDP's fp32 main gradients; "
                f"{s.value('grad_sync', grad_sync)} would sum them in {dtype}: use {s.value('grad_sync', 'ddp')}"
            )
        )
    if dtype == "float16" and training:
        raise SettingError(
            lambda s: (
                f"{s.value('dtype', dtype)}: training in fp16 needs megatron's dynamic loss scale in every backward, "
                "which the engine's schedules do not apply yet; use bfloat16 (megatron's bf16 needs no loss scale)"
            )
        )
