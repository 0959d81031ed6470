"""One training step of a long-context batch under a parallel layout, measured: the scale rehearsal's engine.

SHAPE LEGEND (positions): G rollouts sharing one prompt of P tokens, each with its own response of R tokens;
logical positions G * (P + R), computed positions P + G * R (replay computes the shared prompt once).

`run_step` builds a model with weights that do not depend on the layout (`layout_free_state`: one seeded full
tensor per parameter, sharded for this TP rank), runs one schedule step (replay by default) of the batch under
(tp, cp, sequence parallel) on the CURRENT process group, reduces the gradients and returns the full gradients on
every rank with per-rank measurements: process peak RSS, the activation meter (megatron_branch/memory.py), the
largest tensor any op created (`LargestTensorMode`), the ring's message counts and the wall time. The same function
runs the CP1 reference in one process, so the comparison is "same batch, same weights, different layout" (the
layout: parallel/layout.py's ParallelLayout, the one layout type). A measurement harness, so it lives with the
bench, above the engine it measures (parallel/ imports no checkpoint, loss or schedule).
Used by benchmarks/scale_rehearsal.py (the 2,097,152-position batch) and tests/distributed/test_ring_memory.py (a
scaled-down batch, same code path).
"""

from __future__ import annotations

import random
import resource
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.models import ModelArch
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.parallel.layout import ParallelLayout
from megatron_branch.rules import check_run


@dataclass(kw_only=True)
class RehearsalBatch:
    """G rollouts sharing one prompt (the user's target: 16 x (131,008 + 64) = 2,097,152 logical positions)."""

    rollouts: int = 16
    """G: rollouts sharing the prompt."""
    prompt: int = 131_008
    """P: prompt tokens."""
    response: int = 64
    """R: response tokens per rollout (distinct first tokens, so every response is its own branch)."""
    vocab: int = 64
    """Token ids are drawn from [0, vocab)."""
    seed: int = 0
    """Seed of the token ids and advantages."""

    def __post_init__(self) -> None:
        if min(self.rollouts, self.prompt, self.response) <= 0:
            raise ValueError(f"rollouts, prompt and response must be positive: {self}")
        if self.rollouts > self.vocab:
            raise ValueError(f"{self.rollouts} distinct first response tokens need vocab >= rollouts")

    @property
    def positions_logical(self) -> int:
        return self.rollouts * (self.prompt + self.response)

    def build(self) -> list[Rollout]:
        rng = random.Random(self.seed)
        prompt = [rng.randrange(self.vocab) for _ in range(self.prompt)]
        firsts = rng.sample(range(self.vocab), self.rollouts)
        return [
            Rollout(
                prompt=prompt,
                response=[f] + [rng.randrange(self.vocab) for _ in range(self.response - 1)],
                advantage=rng.uniform(-1.5, 1.5),
            )
            for f in firsts
        ]


def rehearsal_arch(
    *, hidden: int = 32, layers: int = 1, vocab: int = 64, max_positions: int = 262_144
) -> ModelArch:
    """A tiny Llama (models/tiny.py tiny_arch: 4 heads / 2 KV groups, SwiGLU ffn = 2 * hidden) whose RoPE table covers
    `max_positions`."""
    from megatron_branch.models.tiny import tiny_arch

    return tiny_arch(hidden=hidden, layers=layers, vocab_size=vocab, max_position_embeddings=max_positions)


def layout_free_state(model: torch.nn.Module, arch: ModelArch, tp_size: int, *, seed: int = 0) -> dict:
    """Full megatron tensors for `model`'s parameters, the same for every TP size (seeded, in parameter order).

    Vocabulary-parallel tensors get exactly `arch.vocab_size` rows (load_full_tensor pads them per TP).
    """
    from megatron_branch.checkpoint.tp import VOCAB_PARAMS, full_shape

    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, p in model.named_parameters():
        shape = list(full_shape(p, tp_size))
        if name in VOCAB_PARAMS:
            shape[0] = arch.vocab_size
        if "norm" in name:
            state[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            state[name] = 0.08 * torch.randn(shape, generator=gen, dtype=torch.float64)
    return state


class LargestTensorMode(TorchDispatchMode):
    """Records the largest storage any op creates while active (bytes, op, shape): a dispatch mode sees every op,
    including those inside custom autograd Functions and the autograd engine's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0
        self.op = ""
        self.shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    n = t.untyped_storage().nbytes()
                except (RuntimeError, NotImplementedError):
                    continue
                if n > self.nbytes:
                    self.nbytes, self.op, self.shape = n, str(func), tuple(t.shape)
        return out


def _rss_mb() -> float:
    """Current resident set size of this process (MiB), from /proc (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


@dataclass(kw_only=True)
class RankReport:
    """What one rank measured in one step."""

    rank: int
    local_rows: int
    """Rows of the largest chunk this rank held (its zigzag share of the prompt, padded)."""
    rss_before_mb: float
    """RSS after building the model and the tree, before the step."""
    peak_rss_mb: float
    """Peak RSS of the whole process (ru_maxrss: includes torch, megatron, the model)."""
    activation_peak_mb: float
    """Peak of the activation meter over the step (saved-for-backward tensors + replay's K/V cache)."""
    largest_tensor_mb: float
    largest_tensor_op: str
    largest_tensor_shape: tuple[int, ...]
    kv_messages: int
    grad_messages: int
    ring_bytes_sent: int
    blocks_computed: int
    blocks_skipped: int
    kernel_calls: int
    wall_s: float


@dataclass(kw_only=True)
class StepReport:
    loss: float
    grads: dict[str, torch.Tensor] = field(repr=False)
    """Full (TP-gathered, CP/DP-reduced) gradients, vocabulary rows trimmed to the real vocabulary."""
    ranks: list[RankReport]
    layout: ParallelLayout
    """The layout the step ran under (dp 1)."""
    positions_logical: int
    positions_computed: int

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def sequence_parallel(self) -> bool:
        return self.layout.sp

    def summary(self) -> dict:
        """The report as plain data (tp, cp, sequence_parallel at the top, as benchmarks/plan_vs_measured.py reads
        them)."""
        out = {k: v for k, v in asdict(self).items() if k not in ("grads", "layout")}
        return {"tp": self.tp, "cp": self.cp, "sequence_parallel": self.sequence_parallel, **out}


def run_step(
    batch: RehearsalBatch,
    arch: ModelArch,
    groups: ParallelGroups | None,
    *,
    schedule: str = "replay",
    dtype: torch.dtype = torch.float32,
    branch_micro_batch: int = 8,
    record_largest: bool = True,
) -> StepReport:
    """One step of `batch` under `groups` (initialize_parallel's; dp must be 1): collective over its tp x cp ranks,
    every rank returns the report. `groups=None`: a local step in this process alone (no collectives; megatron's
    parallel_state must have TP size 1), the CP1 reference inside a distributed test."""
    from megatron_branch.assembly import RunSpec, ScheduleConfig, schedule_options
    from megatron_branch.checkpoint.tp import VOCAB_PARAMS, gather_full_grads, load_full_state
    from megatron_branch.losses import PolicyGradientObjective
    from megatron_branch.memory import ActivationMeter
    from megatron_branch.models import build_model
    from megatron_branch.parallel.cp_layout import check_cp_fits, zigzag_offsets
    from megatron_branch.parallel.grads import finalize_grads
    from megatron_branch.parallel.groups import ParallelGroups
    from megatron_branch.parallel.ring import RingStats
    from megatron_branch.schedule import run_schedule

    layout = groups.layout if groups is not None else ParallelLayout(dp=1)
    tp, cp, sp = layout.tp, layout.cp, layout.sp
    assert layout.dp == 1, "the rehearsal runs on tp * cp = world ranks (dp 1)"
    check_run(schedule, cp=cp)
    rollouts = batch.build()
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    check_cp_fits(tree, cp)
    model = build_model(arch, dtype=dtype, tp=tp, sequence_parallel=sp)
    tp_group = groups.tp if groups is not None else None
    load_full_state(model, layout_free_state(model, arch, tp), tp_group)
    objective = PolicyGradientObjective.grpo(
        [r.advantage for r in rollouts], tree.num_response_tokens_logical()
    )
    stats = RingStats()
    spec = RunSpec(schedule=ScheduleConfig(name=schedule, branch_micro_batch=branch_micro_batch))
    groups_or_one = groups if groups is not None else ParallelGroups.single()
    opts = schedule_options(spec, groups_or_one, arch.vocab_size, ring_stats=stats)  # the run assembly
    model.zero_grad(set_to_none=True)
    rss_before = _rss_mb()
    largest = LargestTensorMode()
    if groups is not None:
        dist.barrier()
    start = time.perf_counter()
    with ActivationMeter(model) as meter:
        if record_largest:
            with largest:
                result = run_schedule(schedule, model, tree, objective, opts)
        else:
            result = run_schedule(schedule, model, tree, objective, opts)
    wall = time.perf_counter() - start
    if groups is not None:
        finalize_grads(model, tp_group=groups.tp, dp_cp_group=groups.dp_cp, sequence_parallel=sp)
    grads = gather_full_grads(model, tp_group)
    grads = {n: (g[: arch.vocab_size] if n in VOCAB_PARAMS else g) for n, g in grads.items()}
    longest = max(s.length for s in tree.segments)
    mine = RankReport(
        rank=dist.get_rank() if dist.is_initialized() else 0,
        local_rows=int(zigzag_offsets(longest, cp, 0).numel()) if cp > 1 else longest,
        rss_before_mb=rss_before,
        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        activation_peak_mb=meter.peak_mb,
        largest_tensor_mb=largest.nbytes / 2**20,
        largest_tensor_op=largest.op,
        largest_tensor_shape=largest.shape,
        kv_messages=stats.kv_messages,
        grad_messages=stats.grad_messages,
        ring_bytes_sent=stats.bytes_sent,
        blocks_computed=stats.blocks_computed,
        blocks_skipped=stats.blocks_skipped,
        kernel_calls=stats.kernel_calls,
        wall_s=wall,
    )
    ranks: list[Any] = [mine]
    if groups is not None and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    return StepReport(
        loss=result.loss,
        grads=grads,
        ranks=ranks,
        layout=layout,
        positions_logical=tree.positions_logical,
        positions_computed=result.positions_computed,
    )


def max_relative_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, str]:
    """Largest per-parameter relative Frobenius error of `grads` against `ref` (and the parameter's name)."""
    assert set(grads) == set(ref), sorted(set(grads) ^ set(ref))
    worst, where = 0.0, ""
    for n, g in ref.items():
        err = ((grads[n].double() - g.double()).norm() / g.double().norm().clamp(min=1e-30)).item()
        if err > worst:
            worst, where = err, n
    return worst, where
