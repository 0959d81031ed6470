"""The fused output projection + logprob (losses/fused_logprobs.py) at several row-chunk sizes, against the
materialised path (logits, then the vocab-parallel logprob), forward + backward, round-robin in one process.

Reported per variant: the minimum and median over `--repeats` rounds (order rotated each round), the projection
GEMM FLOPs the analytic count assumes (3 per row) and the achieved rate counting the 4 GEMMs the fused path runs
(forward 1, backward recompute + 2).

    python benchmarks/fused_logprob_speed.py [--rows 4096] [--hidden 512] [--vocab 32000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_branch.losses.fused_logprobs import fused_linear_logprobs
from megatron_branch.losses.logprobs import vocab_parallel_logprobs


def _step(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, vocab: int, chunk: int) -> float:
    hidden.grad = weight.grad = None
    t0 = time.perf_counter()
    if chunk == 0:  # materialised: [rows, vocab] logits kept for backward
        lp = vocab_parallel_logprobs(hidden @ weight.t(), target, vocab_size=vocab)
    else:
        lp = fused_linear_logprobs(hidden, weight, target, vocab_size=vocab, chunk_rows=chunk)
    lp.sum().backward()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--chunks", default="128,256,512,1024", help="fused row-chunk sizes; 0 = materialised")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.manual_seed(0)
    hidden = torch.randn(args.rows, args.hidden, requires_grad=True)
    weight = (torch.randn(args.vocab, args.hidden) * 0.02).requires_grad_()
    target = torch.randint(0, args.vocab, (args.rows,))
    variants = [0] + [int(c) for c in args.chunks.split(",")]
    for c in variants:  # warm-up
        _step(hidden, weight, target, args.vocab, c)
    times: dict[int, list[float]] = {c: [] for c in variants}
    for r in range(args.repeats):
        for c in variants[r % len(variants) :] + variants[: r % len(variants)]:
            times[c].append(_step(hidden, weight, target, args.vocab, c))
    gemm = 2 * args.rows * args.hidden * args.vocab
    print(
        f"rows {args.rows}, hidden {args.hidden}, vocab {args.vocab}, float32, {torch.get_num_threads()} threads"
    )
    print("| variant | min s | median s | analytic GFLOP (3 GEMMs) | GFLOP/s over the 4 GEMMs run |")
    print("|---|---:|---:|---:|---:|")
    for c in variants:
        name = "materialised logits" if c == 0 else f"fused, {c}-row chunks"
        run = 3 if c == 0 else 4
        best = min(times[c])
        print(f"| {name} | {best:.3f} | {statistics.median(times[c]):.3f} | {3 * gemm / 1e9:,.0f} | "
              f"{run * gemm / best / 1e9:,.0f} |")  # fmt: skip


if __name__ == "__main__":
    main()
