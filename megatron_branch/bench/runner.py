"""Run the variants round-robin in ONE process on the same rollouts and model, and measure them.

Shared machines are noisy (the same GEMM swung 40-305 GFLOP/s within one session, docs/design.md), so: one untimed
warm-up round (first-call allocations), then `rounds` rounds that each run every variant once with the order
rotated by one per round (no fixed position bias), fresh gradients before every step; medians and min-max.
Only ratios within one run mean anything.

Memory, per variant: the peak process RSS above its value at the step's start (CPU; freed heap is handed back to
the OS before each step with glibc's malloc_trim, so a variant does not hide inside its predecessor's free lists),
`torch.cuda.max_memory_allocated` above the step's start (CUDA), and the deterministic activation meter
(megatron_branch.memory: bytes autograd saves for backward, identical on every machine) from one extra untimed step.
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_branch.assembly import RunSpec, ScheduleConfig, schedule_options
from megatron_branch.bench.config import BASELINE, DTYPES, VARIANTS, BenchConfig, with_context
from megatron_branch.bench.flops import Flops, variant_flops
from megatron_branch.data import PrefixTree
from megatron_branch.data.random_trees import agentic_tree_rollouts, random_tree_rollouts
from megatron_branch.errors import UserError
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.memory import ActivationMeter
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelGroups
from megatron_branch.plan.auto import AutoChoice, decide, free_device_bytes, packed_peak_bytes
from megatron_branch.plan.model import Layout
from megatron_branch.schedule import StepResult, run_schedule


def _rss_bytes() -> int:
    """Current resident set size (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS deltas may then under-count
        pass


class PeakRss:
    """Context manager: the peak RSS above the value at entry, sampled every `interval` seconds by a thread."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_bytes() - self.start)
            time.sleep(self.interval)

    def __enter__(self) -> PeakRss:
        self.start = _rss_bytes()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes() - self.start)


@dataclass(kw_only=True)
class Measurement:
    """One variant on one tree shape."""

    variant: str
    prompt: int
    branches: int
    times: list[float] = field(default_factory=list)
    rss_peak: int = 0
    cuda_peak: int = 0
    meter_peak: int = 0
    result: StepResult | None = None
    flops: Flops | None = None
    failed: str = ""
    """Why the variant has no timing (it ran out of memory), or empty."""

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclass(kw_only=True)
class Case:
    """The rollouts of one (P, G) shape, with what every variant needs."""

    prompt: int
    branches: int
    tree: PrefixTree
    objective: PolicyGradientObjective
    flops: dict[str, Flops]
    auto: AutoChoice
    """What the `auto` variant runs on this tree."""


def make_case(cfg: BenchConfig, arch: ModelArch, prompt: int, branches: int) -> Case:
    if cfg.turns:  # an agentic tree: turns, observations (loss_mask 0), forks at turns
        rollouts = agentic_tree_rollouts(
            vocab_size=cfg.model.vocab_size, prompt_len=prompt, n=branches, turns=cfg.turns,
            turn_len=cfg.response, observation_len=cfg.observation, branch_at_turns=cfg.branch_at_turns,
            seed=cfg.seed,
        )  # fmt: skip
    else:  # `groups` prompts (lengths spread from min_prompt to P), each with its own response tree
        rollouts = [
            r
            for g in range(cfg.groups)
            for r in random_tree_rollouts(
                vocab_size=cfg.model.vocab_size,
                prompt_len=_prompt_len(cfg, prompt, g),
                branches=branches,
                levels=cfg.levels,
                seg_len=(cfg.response, cfg.response),
                seed=cfg.seed + 7919 * g,
            )  # fmt: skip
        ]
    tree = PrefixTree.build(rollouts, vocab_size=cfg.model.vocab_size)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rollouts], tree.num_trained_tokens_logical())
    flops = variant_flops(arch, tree)
    return Case(
        prompt=prompt, branches=branches, tree=tree, objective=obj, flops=flops, auto=_auto(cfg, arch, tree)
    )


def _prompt_len(cfg: BenchConfig, prompt: int, group: int) -> int:
    """Group `group`'s prompt length: P, or spread evenly from cfg.min_prompt to P over the groups."""
    if cfg.groups == 1 or not cfg.min_prompt:
        return prompt
    return round(cfg.min_prompt + (prompt - cfg.min_prompt) * group / (cfg.groups - 1))


def _auto(cfg: BenchConfig, arch: ModelArch, tree: PrefixTree) -> AutoChoice:
    """The `auto` variant's pick on this tree (plan/auto.py's rule, as `grad --schedule auto`): packed's planned
    activation peak against cfg.memory_budget_gb, else the device's free memory, and the tree's tokens against the
    chunk budget the variant's replay runs with (its options', else ScheduleConfig's default, as `_step`)."""
    budget = int(cfg.memory_budget_gb * 1e9) if cfg.memory_budget_gb is not None else free_device_bytes()
    peak = packed_peak_bytes(
        arch, tree, Layout(sequence_parallel=False), act_bytes=DTYPES[cfg.dtype].itemsize
    )
    chunk_tokens = VARIANTS["auto"][1].get("chunk_tokens", ScheduleConfig().chunk_tokens)  # what _step runs
    return decide(peak, budget, tokens=tree.num_tokens, chunk_tokens=chunk_tokens)


def build_bench_model(cfg: BenchConfig) -> tuple[ModelArch, torch.nn.Module]:
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    torch.manual_seed(cfg.seed)
    arch = with_context(cfg.model, max(cfg.prompts) + cfg.response_tokens + 1)
    model = build_model(arch, dtype=DTYPES[cfg.dtype])
    return arch, model.to(cfg.device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(cfg: BenchConfig, arch: ModelArch, model: torch.nn.Module, case: Case, variant: str) -> StepResult:
    schedule, kw = VARIANTS[variant]
    if schedule == "auto":
        schedule = case.auto.schedule
    model.zero_grad(set_to_none=True)  # fresh grads: every step does the same accumulation work
    spec = RunSpec(schedule=ScheduleConfig(branch_micro_batch=cfg.micro))
    opts = schedule_options(spec, ParallelGroups.single(), arch.vocab_size, **kw)  # the run assembly
    return run_schedule(schedule, model, case.tree, case.objective, opts)


def _peak_memory(
    cfg: BenchConfig, arch: ModelArch, model: torch.nn.Module, case: Case, v: str
) -> tuple[int, int]:
    """Peak RSS (and CUDA memory) of one step above its start. The heap is trimmed first so that the RSS delta is
    the step's own; that trim hands every freed page back to the OS and makes the next step fault its working set
    in again, which a training loop never pays, so this step is not timed (the timed rounds trim nothing)."""
    _trim_heap()
    base = 0
    if cfg.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    _sync(cfg.device)
    with PeakRss() as rss:
        _step(cfg, arch, model, case, v)
        _sync(cfg.device)
    cuda = torch.cuda.max_memory_allocated() - base if cfg.device == "cuda" else 0
    return rss.peak, cuda


def measure(
    cfg: BenchConfig, arch: ModelArch, model: torch.nn.Module, case: Case, log: Any = print
) -> list[Measurement]:
    """All variants of `cfg` on `case`, round-robin; returns one Measurement per variant (in cfg order)."""
    labels = list(cfg.variants)
    out = {v: Measurement(variant=v, prompt=case.prompt, branches=case.branches) for v in labels}
    for v in labels:  # warm-up round, untimed; a variant that runs out of memory is reported, not fatal
        out[v].flops = case.flops[v]
        try:
            out[v].result = _step(cfg, arch, model, case, v)
        except (torch.cuda.OutOfMemoryError, MemoryError) as e:
            out[v].failed = f"out of memory: {str(e).splitlines()[0][:120]}"
            log(f"  {v}: {out[v].failed}")
            model.zero_grad(set_to_none=True)
            if cfg.device == "cuda":
                torch.cuda.empty_cache()
    if out[BASELINE].failed:
        raise UserError(f"the baseline {BASELINE} ran out of memory at P={case.prompt}, G={case.branches}")
    labels = [v for v in labels if not out[v].failed]
    for r in range(cfg.rounds):  # timed as a training loop runs: no heap trim, no RSS sampler thread
        for v in labels[r % len(labels) :] + labels[: r % len(labels)]:
            _sync(cfg.device)
            t0 = time.perf_counter()
            _step(cfg, arch, model, case, v)
            _sync(cfg.device)
            out[v].times.append(time.perf_counter() - t0)
        log(f"  P={case.prompt} G={case.branches}: round {r + 1}/{cfg.rounds} done")
    for v in labels:  # peak memory in an untimed step of its own
        out[v].rss_peak, out[v].cuda_peak = _peak_memory(cfg, arch, model, case, v)
    if cfg.meter:
        for v in labels:
            with ActivationMeter(model) as meter:
                _step(cfg, arch, model, case, v)
            out[v].meter_peak = meter.peak_bytes
    return list(out.values())


def summarize(cfg: BenchConfig, case: Case, ms: list[Measurement]) -> list[dict[str, Any]]:
    """JSON-ready rows: times, throughput, memory, FLOPs, speed-up over the baseline next to the analytic limit."""
    base = next(m for m in ms if m.variant == BASELINE)
    limit = case.flops[BASELINE].step / case.flops["minimal"].step
    rows = []
    for m in ms:
        if m.failed:
            rows.append(dict(variant=m.variant, prompt=case.prompt, branches=case.branches, failed=m.failed,
                             analytic_limit=limit))  # fmt: skip
            continue
        assert m.result is not None and m.flops is not None
        med = m.median
        speedup = base.median / med
        achieved = m.flops.step / med
        computed = m.result.positions_computed + m.result.positions_recomputed
        rows.append(
            dict(
                variant=m.variant,
                prompt=case.prompt,
                branches=case.branches,
                response=cfg.response,
                median_s=med,
                min_s=min(m.times),
                max_s=max(m.times),
                times_s=m.times,
                logical_tokens_per_s=case.tree.positions_logical / med,
                computed_tokens_per_s=computed / med,
                positions_logical=case.tree.positions_logical,
                positions_computed=m.result.positions_computed,
                positions_recomputed=m.result.positions_recomputed,
                rss_peak_mb=m.rss_peak / 2**20,
                cuda_peak_mb=m.cuda_peak / 2**20 if cfg.device == "cuda" else None,
                activation_meter_mb=m.meter_peak / 2**20 if cfg.meter else None,
                gflop_step=m.flops.step / 1e9,
                gflop_attention_fwd=m.flops.attention / 1e9,
                gflop_head_fwd=m.flops.head / 1e9,
                achieved_tflops=achieved / 1e12,
                mfu=achieved / (cfg.peak_tflops * 1e12) if cfg.peak_tflops > 0 else None,
                speedup=speedup,
                flop_ratio=case.flops[BASELINE].step / m.flops.step,
                analytic_limit=limit,
                fraction_of_limit=speedup / limit,
                loss=m.result.loss,
                auto=case.auto.to_json() if m.variant == "auto" else None,
                failed="",
            )
        )
    return rows


def machine() -> dict[str, Any]:
    info: dict[str, Any] = dict(
        platform=platform.platform(),
        processor=platform.processor() or platform.machine(),
        cpu_count=os.cpu_count(),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")
FLASH_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_flash_attention_forward")
FLASH_BACKWARD_OPS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_flash_attention_backward",
)


def gemm_rate(cfg: BenchConfig, arch: ModelArch, reps: int = 5) -> float:
    """The machine's measured GEMM rate (FLOP/s, best of `reps`) at the model's MLP shape, 4096 rows."""
    dt = DTYPES[cfg.dtype]
    a = torch.randn(4096, arch.hidden_size, dtype=dt, device=cfg.device)
    b = torch.randn(arch.hidden_size, arch.ffn_hidden_size, dtype=dt, device=cfg.device)
    best = float("inf")
    for _ in range(reps):
        _sync(cfg.device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        _sync(cfg.device)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * a.shape[0] * a.shape[1] * b.shape[1] / best


def profile_step(
    cfg: BenchConfig, arch: ModelArch, model: torch.nn.Module, case: Case, variant: str
) -> dict[str, Any]:
    """One step of `variant` under torch.profiler: the top ops (by self time) and where the step's time goes --
    op time (GEMMs, the fused attention forward and backward, other ops) and time outside any op (Python,
    dispatch, per-chunk bookkeeping), next to the analytic FLOPs at the measured GEMM rate."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cfg.device == "cuda" else [])
    with profile(activities=acts) as prof:
        _sync(cfg.device)
        t0 = time.perf_counter()
        _step(cfg, arch, model, case, variant)
        _sync(cfg.device)
        wall = time.perf_counter() - t0
    key = "self_cuda_time_total" if cfg.device == "cuda" else "self_cpu_time_total"
    events = prof.key_averages()
    self_s = {e.key: getattr(e, key) / 1e6 for e in events}  # self time: nested ops are not counted twice
    op = sum(self_s.values())
    part = {name: sum(self_s.get(k, 0.0) for k in ops) for name, ops in
            (("gemm", GEMM_OPS), ("flash_forward", FLASH_OPS), ("flash_backward", FLASH_BACKWARD_OPS))}  # fmt: skip
    rate = gemm_rate(cfg, arch)
    return dict(
        table=events.table(sort_by=key, row_limit=15),
        wall_s=wall,
        op_s=op,
        outside_ops_s=max(wall - op, 0.0),
        **{f"{k}_s": v for k, v in part.items()},
        other_ops_s=op - sum(part.values()),
        gemm_gflops=rate / 1e9,
        flop_time_at_gemm_rate_s=case.flops[variant].step / rate,
    )


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    """The whole benchmark: every (P, G) of the grid, every variant; a JSON-ready dict."""
    from megatron_branch.bench.load import LoadMeter, warnings

    arch, model = build_bench_model(cfg)
    meter = LoadMeter.start()  # what else ran on the machine meanwhile (bench/load.py)
    rows, profiled = [], None
    for prompt in cfg.prompts:
        for branches in cfg.branches:
            case = make_case(cfg, arch, prompt, branches)
            log(f"bench: {case.tree.describe()}")
            rows += summarize(cfg, case, measure(cfg, arch, model, case, log))
            if cfg.profile is not None and profiled is None:
                profiled = dict(variant=cfg.profile, prompt=prompt, branches=branches,
                                **profile_step(cfg, arch, model, case, cfg.profile))  # fmt: skip
    load = meter.read()
    report = dict(config=cfg.to_dict(), arch=arch.to_dict(), machine=machine(), baseline=BASELINE, rows=rows,
                  load=load, warnings=warnings(load, rows))  # fmt: skip
    if profiled is not None:
        report["profile"] = profiled
    return report
