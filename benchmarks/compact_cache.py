"""What the compact prefix cache costs and saves (issue 19, item 1), before and after in ONE run.

The attention contexts copy V out of megatron's fused QKV output (attention/prefix_state.compact) before the
executor saves it and before replay caches it: one write of g d values per row and layer, per chunk. Without the
copy ("view", what the engine did before) V is a view of the QKV buffer, which then stays alive with every saved
or cached row. Same model, same rollouts, round-robin (order rotated per round, one untimed warm-up), per variant:
median step seconds with and without the copy, their ratio, the activation meter's peak (deterministic) and the
cached K/V bytes per prefix row and layer.

    .venv/bin/python benchmarks/compact_cache.py --preset A --layers 1 --rounds 3
    .venv/bin/python benchmarks/compact_cache.py --preset C --prompt 2048 --response 64 --variants replay
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from contextlib import ExitStack
from unittest import mock

import torch

from megatron_branch.attention import context as local_context
from megatron_branch.bench.config import PRESETS, BenchConfig
from megatron_branch.bench.runner import _step, build_bench_model, make_case
from megatron_branch.memory import ActivationMeter, track_extra
from megatron_branch.schedule import prefix_cache

MODES = ("compact", "view")


def _mode(mode: str, cached: dict[int, int]) -> ExitStack:
    """The copy on or off, and the cache's storages recorded (as plan/measure.py does)."""
    stack = ExitStack()
    if mode == "view":
        stack.enter_context(mock.patch.object(local_context, "compact", lambda t: t))

    def track(tensors) -> None:  # noqa: ANN001
        ts = list(tensors)
        for t in ts:
            cached[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        track_extra(ts)

    stack.enter_context(mock.patch.object(prefix_cache, "track_extra", track))
    return stack


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="A", choices=["A", "B", "C", "tiny"])
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None)
    p.add_argument("--response", type=int, default=None)
    p.add_argument("--variants", default="replay,replay+recompute")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    kw = dict(PRESETS[a.preset])
    if a.layers:
        kw["model"] = dataclasses.replace(kw["model"], layers=a.layers)
    if a.prompt:
        kw["prompts"] = (a.prompt,)
    if a.response:
        kw["response"] = a.response
    cfg = BenchConfig(**{**kw, "variants": tuple(a.variants.split(",")), "rounds": a.rounds, "meter": False})
    arch, model = build_bench_model(cfg)
    case = make_case(cfg, arch, cfg.prompts[0], cfg.branches[0])
    cells = [(v, m) for v in a.variants.split(",") for m in MODES]
    times: dict[tuple[str, str], list[float]] = {c: [] for c in cells}
    for r in range(a.rounds + 1):  # round 0: warm-up, untimed
        for v, m in cells[r % len(cells) :] + cells[: r % len(cells)]:
            with _mode(m, {}):
                t0 = time.perf_counter()
                _step(cfg, arch, model, case, v)
                dt = time.perf_counter() - t0
            if r:
                times[(v, m)].append(dt)
    rows = case.tree.segments[0].length  # the prompt: the cached prefix
    print(f"preset {a.preset}: {arch.num_layers} layers, hidden {arch.hidden_size}, {arch.num_attention_heads} "
          f"heads / {arch.num_query_groups} kv, P={cfg.prompts[0]}, G={cfg.branches[0]}, S={cfg.response}, "
          f"{a.rounds} rounds; torch {torch.__version__}")  # fmt: skip
    print("| variant | V | median s | vs view | meter peak MB | cached bytes per prefix row and layer |")
    print("|---|---|---:|---:|---:|---:|")
    for v, m in cells:
        cached: dict[int, int] = {}
        with _mode(m, cached), ActivationMeter(model) as meter:
            _step(cfg, arch, model, case, v)
        med = statistics.median(times[(v, m)])
        ratio = med / statistics.median(times[(v, "view")])
        per_row = sum(cached.values()) / (rows * arch.num_layers)
        print(f"| {v} | {m} | {med:.3f} | {ratio:.3f} | {meter.peak_bytes / 2**20:.1f} | {per_row:.0f} |")


if __name__ == "__main__":
    main()
