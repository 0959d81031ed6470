"""Measure what the planner predicts, on this machine: a step's saved-for-backward peak (the activation meter),
the replay cache's bytes, and the executed matmul FLOPs (torch's FlopCounterMode), for one rollout shape.

Used by the planner's tests (tests/unit/test_plan.py, tests/distributed/test_plan_parallel.py) and by
benchmarks/plan_vs_measured.py. Parallel groups are passed in (None = single rank).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch

from megatron_branch.assembly import RunSpec, ScheduleConfig, schedule_options
from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.memory import ActivationMeter
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.plan.model import RolloutShape
from megatron_branch.schedule import run_schedule


def shape_rollouts(shape: RolloutShape, vocab: int, seed: int = 0) -> list[Rollout]:
    """Rollouts with exactly `shape`'s prefix tree: per prompt group a random prompt and shared response start,
    then responses whose next tokens differ (so each is its own leaf). Needs responses <= vocab."""
    assert shape.responses <= vocab, "distinct fork tokens need responses <= vocab"
    rng = random.Random(seed)
    out = []
    for _ in range(shape.prompts):
        prompt = [rng.randrange(vocab) for _ in range(shape.prompt_length)]
        shared = [rng.randrange(vocab) for _ in range(shape.shared_response_length)]
        rest = shape.response_length - shape.shared_response_length
        for i in range(shape.responses):
            tail = [rng.randrange(vocab) for _ in range(rest - 1)]
            out.append(Rollout(prompt=prompt, response=shared + [i] + tail, advantage=rng.uniform(-1, 1)))
    return out


@dataclass(frozen=True, kw_only=True)
class Measured:
    saved_peak: int
    """ActivationMeter peak: bytes saved for backward + replay's cached K/V and accumulators."""
    activations: int = 0
    """At that peak: bytes saved for backward (the planner's `activations` term)."""
    cached_at_peak: int = 0
    """At that peak: the prefix cache's storages (the planner's `cached_kv`)."""
    kv_grads: int = 0
    """At that peak: the cache's dK/dV accumulators (the planner's `kv_grads`)."""
    cached_kv: int
    """Bytes of the distinct storages the replay cache registered over the step (one prompt group: its root
    cache; 0 for other schedules)."""
    matmul_flops: int
    """FlopCounterMode's count (CPU fused attention kernels count 0: this is the non-attention part)."""
    positions_computed: int


def measure_step(
    model: torch.nn.Module,
    shape: RolloutShape,
    *,
    vocab: int,
    schedule: str = "replay",
    branch_micro_batch: int = 8,
    recompute: bool = False,
    recompute_layers: bool = False,
    chunk_tokens: int | None = None,
    count_flops: bool = False,
    seed: int = 0,
    rollouts: list[Rollout] | None = None,
    **parallel: Any,
) -> Measured:
    """One step of `schedule` over `shape`'s rollouts with the meter on (grads accumulate into `model`); `rollouts`:
    these instead (an agentic tree's, plan/agentic.py)."""
    from megatron_branch.schedule import prefix_cache as cache_module  # where replay registers its cache

    rollouts = shape_rollouts(shape, vocab, seed) if rollouts is None else rollouts
    tree = PrefixTree.build(rollouts, vocab_size=vocab)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_response_tokens_logical())
    # chunk_tokens None by default: replay walked segment by segment, the chunks plan/memory.py's replay terms price
    sched = ScheduleConfig(branch_micro_batch=branch_micro_batch, recompute=recompute, chunk_tokens=chunk_tokens,
                           enable_gradient_checkpointing=recompute_layers)  # fmt: skip
    groups = parallel.pop("groups", None) or ParallelGroups.single()
    opts = schedule_options(RunSpec(schedule=sched), groups, vocab, **parallel)  # the run assembly
    cached: dict[int, int] = {}  # storage ptr -> bytes, of the cache registered so far and still alive
    peak_cached = 0
    real_track = cache_module.track_extra

    def track(tensors: Any, kind: str = "registered") -> None:
        nonlocal peak_cached
        ts = list(tensors)
        if kind == "registered":  # the cache itself (not its fp32 gradient sums: WideSum registers those)
            for t in ts:
                s = t.untyped_storage()
                cached[s.data_ptr()] = s.nbytes()
            peak_cached = max(peak_cached, sum(cached.values()))
        real_track(ts, kind)

    model.zero_grad(set_to_none=True)
    flops = 0
    with mock.patch.object(cache_module, "track_extra", track), ActivationMeter(model) as meter:
        if count_flops:
            from torch.utils.flop_counter import FlopCounterMode

            with FlopCounterMode(display=False) as counter:
                res = run_schedule(schedule, model, tree, obj, opts)
            flops = counter.get_total_flops()
        else:
            res = run_schedule(schedule, model, tree, obj, opts)
    assert meter.current_bytes == 0, f"{meter.current_bytes} bytes still held after the step"
    return Measured(
        saved_peak=meter.peak_bytes,
        activations=meter.peak_by_kind["saved"],
        cached_at_peak=meter.peak_by_kind["registered"],
        kv_grads=meter.peak_by_kind["registered_grad"],
        cached_kv=peak_cached,
        matmul_flops=flops,
        positions_computed=res.positions_computed,
    )


def per_term(measured: Measured, planned: Any) -> dict[str, tuple[int, int]]:
    """term -> (measured, planned) for the planner's saved terms (a plan.memory.Peak), from the meter's split at its
    peak (memory.KINDS: saved -> activations, registered -> cached_kv, registered_grad -> kv_grads)."""
    return {
        "activations": (measured.activations, planned.activations),
        "cached_kv": (measured.cached_at_peak, planned.cached_kv),
        "kv_grads": (measured.kv_grads, planned.kv_grads),
    }
