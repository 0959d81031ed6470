"""The pipeline bubble on CPU: replay's pipeline efficiency against naive-fused's under the same PP (issue 22).

Under torchrun with N processes (N pipeline stages, gloo): a tiny random Llama of 2N layers, one prompt group of
`--prompt` tokens with `--branches` responses of `--response` tokens (distinct first tokens: one root, G leaves),
float32. Per round and variant (round-robin, the order rotated, one untimed warm-up step each), one full gradient
step through schedule/pipeline.py; per stage the seconds its chunk forwards and backwards ran (busy) against the
step's wall time. Printed per variant: median step seconds, each stage's efficiency (busy / wall), the mean over
stages, and replay's speed-up over naive-fused. The planner's bubble model (plan/pipeline.py) predicts replay's
efficiency from the root's share of the work; this measures it. With `--root-pieces K` (K > 1) a third variant,
replay with its root cut into K sequence pieces (ScheduleOptions.root_pieces, data/pieces.py), runs in the same
rounds.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        benchmarks/pipeline_bubble.py --prompt 2048 --branches 8 --response 64 --rounds 3 --root-pieces 4

Timings are only meaningful on a quiet machine (the figures in docs/parallelism.md are pending one).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

from megatron_branch.data import PrefixTree, Rollout
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.schedule import pipeline as pipeline_mod

VARIANTS = ("naive-fused", "replay")
PIECES = "replay+pieces"
"""The variant name of replay with its root cut into --root-pieces pieces."""


def _rollouts(prompt: int, branches: int, response: int, vocab: int) -> list[Rollout]:
    gen = torch.Generator().manual_seed(0)
    p = torch.randint(0, vocab, (prompt,), generator=gen).tolist()
    out = []
    for i in range(branches):
        tail = torch.randint(0, vocab, (response - 1,), generator=gen).tolist()
        out.append(Rollout(prompt=p, response=[i % vocab] + tail, advantage=float(i % 3 - 1)))
    return out


def _timed(busy: list[float]) -> Any:
    """Patch the stage's chunk forward/backward to add their seconds to `busy` (this rank's stage)."""
    real_f, real_b = pipeline_mod._Stage.forward, pipeline_mod._Stage.backward

    def forward(self: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = real_f(self, *a, **kw)
        busy.append(time.perf_counter() - t0)
        return out

    def backward(self: Any, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = real_b(self, *a, **kw)
        busy.append(time.perf_counter() - t0)
        return out

    return mock.patch.multiple(pipeline_mod._Stage, forward=forward, backward=backward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--branch-micro-batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--root-pieces", type=int, default=1, help="K > 1: also replay with its root in K pieces")
    args = ap.parse_args()
    groups = initialize_parallel(ParallelConfig(pp=int(os.environ.get("WORLD_SIZE", "1"))))
    pp = groups.pp_size
    assert pp > 1, "run under torchrun with one process per pipeline stage"
    vocab = 512
    arch = ModelArch(family="llama", vocab_size=vocab, hidden_size=args.hidden, num_layers=2 * pp,
                     num_attention_heads=4, num_query_groups=2, ffn_hidden_size=2 * args.hidden)  # fmt: skip
    torch.manual_seed(0)
    model = build_model(arch, dtype=torch.float32, pp=pp, pp_rank=groups.pp_rank)
    rollouts = _rollouts(args.prompt, args.branches, args.response, vocab)
    tree = PrefixTree.build(rollouts, vocab_size=vocab)
    objective = PolicyGradientObjective.grpo(
        [r.advantage for r in rollouts], tree.num_response_tokens_logical()
    )
    opts = ScheduleOptions(groups=groups, vocab_size=vocab, branch_micro_batch=args.branch_micro_batch)
    variants = VARIANTS + ((PIECES,) if args.root_pieces > 1 else ())
    runs = {v: (v, opts) for v in VARIANTS}
    runs[PIECES] = ("replay", dataclasses.replace(opts, root_pieces=args.root_pieces))
    wall: dict[str, list[float]] = {v: [] for v in variants}
    eff: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds + 1):  # round 0: warm-up, not recorded
        k = r % len(variants)
        for v in variants[k:] + variants[:k]:
            name, o = runs[v]
            busy: list[float] = []
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            with _timed(busy):
                run_schedule(name, model, tree, objective, o)
            dist.barrier()
            t = time.perf_counter() - t0
            every = [torch.zeros(1, dtype=torch.float64) for _ in range(pp)]
            dist.all_gather(every, torch.tensor([sum(busy)], dtype=torch.float64), group=groups.pp)
            if r:
                wall[v].append(t)
                eff[v].append(statistics.mean(float(b) / t for b in every))
    if dist.get_rank() == 0:
        print(f"PP{pp}, {arch.num_layers} layers, hidden {args.hidden}: {tree.describe()}")
        for v in variants:
            print(f"  {v:<14} median step {statistics.median(wall[v]):.3f} s, stage efficiency (busy / wall) "
                  f"{statistics.median(eff[v]):.2f}")  # fmt: skip
        speed = statistics.median(wall["naive-fused"]) / statistics.median(wall["replay"])
        print(f"  replay speed-up over naive-fused under PP{pp}: {speed:.2f}x")
        if PIECES in variants:
            speed = statistics.median(wall["naive-fused"]) / statistics.median(wall[PIECES])
            print(f"  replay with {args.root_pieces} root pieces, speed-up over naive-fused: {speed:.2f}x")


if __name__ == "__main__":
    main()
