"""Forward+backward time of naive / packed / replay / replay+recompute, round-robin in ONE process.

CPU machines here are shared and noisy (the same GEMM has swung 40-305 GFLOP/s within one session), so the
variants are interleaved: every round runs each schedule once (the order rotated per round), after one warm-up
round that is not timed, and we report medians over rounds and ratios against naive. Absolute seconds are only
comparable within one run of this script.

Beside the times, an analytic count of USEFUL FLOPs: every token position's matmuls (QKV, output projection,
SwiGLU MLP, LM head) plus attention over exactly the keys the position may see (causal counted exactly, not as a
dense square), backward = 2x forward, and replay+recompute's extra forward of the inner segments. Backends that
compute masked work (megatron's unfused attention in naive computes the full s x s square) execute more than this.

    .venv/bin/python benchmarks/schedule_speed.py               # P=1024, G=8, S=64, hidden 128, 2 layers, 5 rounds
    .venv/bin/python benchmarks/schedule_speed.py --rounds 3 --prompt 256
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from variants import VARIANTS  # benchmarks/ is on sys.path when a script here runs

from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, StepResult, run_schedule
from megatron_branch.testing import random_tree_rollouts


@dataclass(frozen=True)
class Flops:
    """Useful forward FLOPs of one logical batch under a schedule, split so the table can show both parts."""

    dense: float  # token positions x per-token matmul FLOPs
    attention: float  # (query, visible key) pairs x per-pair FLOPs

    @property
    def forward(self) -> float:
        return self.dense + self.attention


def per_token_flops(arch: ModelArch) -> float:
    """Forward matmul FLOPs of one token position (2 per multiply-add)."""
    h, hd = arch.hidden_size, arch.head_dim or arch.hidden_size // arch.num_attention_heads
    q, kv = arch.num_attention_heads * hd, arch.num_query_groups * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * arch.ffn_hidden_size  # QKV, proj, SwiGLU (gate, up, down)
    return 2.0 * (arch.num_layers * per_layer + h * arch.vocab_size)


def per_pair_flops(arch: ModelArch) -> float:
    """Forward attention FLOPs of one (query, visible key) pair over all layers: q.k and p.v per head."""
    hd = arch.head_dim or arch.hidden_size // arch.num_attention_heads
    return 4.0 * arch.num_attention_heads * hd * arch.num_layers


def useful_flops(arch: ModelArch, tree: PrefixTree) -> dict[str, tuple[Flops, float]]:
    """schedule -> (forward FLOPs, forward+backward FLOPs), backward counted as 2x forward."""
    tok, pair = per_token_flops(arch), per_pair_flops(arch)
    # naive: each rollout alone, causally: a sequence of L sees L(L+1)/2 pairs
    lengths = [len(r.prompt) + len(r.response) for r in tree.rollouts]
    naive = Flops(tok * sum(lengths), pair * sum(n * (n + 1) // 2 for n in lengths))
    # shared: every distinct position once; a position with position id p sees its p+1 path ancestors (itself too)
    shared = Flops(tok * tree.positions_computed, pair * float((tree.position_ids + 1).sum()))
    # recompute: one more forward of every segment with children (replay's inner segments)
    inner = [s for s in tree.segments if s.children]
    again = Flops(
        tok * sum(s.length for s in inner),
        pair * sum(s.start_position * s.length + s.length * (s.length + 1) // 2 for s in inner),
    )
    out = {name: (f, 3 * f.forward) for name, f in (("naive", naive), ("packed", shared), ("replay", shared))}
    out["replay+recompute"] = (
        Flops(shared.dense + again.dense, shared.attention + again.attention),
        3 * shared.forward + again.forward,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8, help="replay's branch_micro_batch")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    initialize_parallel(ParallelConfig())
    torch.manual_seed(0)
    arch = ModelArch(
        family="llama",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=args.heads,
        num_query_groups=args.heads,
        ffn_hidden_size=3 * args.hidden,
        max_position_embeddings=max(4096, args.prompt + args.response),
    )
    model = build_model(arch, dtype=torch.float32)
    rs = random_tree_rollouts(  # one prompt, G leaves of length S right below it
        vocab_size=args.vocab,
        prompt_len=args.prompt,
        branches=args.branches,
        seg_len=(args.response, args.response),
    )
    tree = PrefixTree.build(rs, vocab_size=args.vocab)
    obj = PolicyGradientObjective.grpo([r.advantage for r in rs], tree.num_response_tokens_logical())

    def step(label: str) -> tuple[float, StepResult]:
        schedule, kw = VARIANTS[label]
        model.zero_grad(set_to_none=True)  # fresh grads: every timed step does the same accumulation work
        opts = ScheduleOptions(vocab_size=args.vocab, branch_micro_batch=args.micro, **kw)
        t0 = time.perf_counter()
        res = run_schedule(schedule, model, tree, obj, opts)
        return time.perf_counter() - t0, res

    labels = list(VARIANTS)
    results = {label: step(label)[1] for label in labels}  # warm-up round (first-call allocations), untimed
    times: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(args.rounds):
        for label in labels[r % len(labels) :] + labels[: r % len(labels)]:  # rotate: no fixed position bias
            times[label].append(step(label)[0])

    flops = useful_flops(arch, tree)
    med = {label: statistics.median(ts) for label, ts in times.items()}
    print(
        f"P={args.prompt}, G={args.branches}, S={args.response}; hidden {args.hidden}, {args.layers} layers, "
        f"{args.heads} heads, ffn {arch.ffn_hidden_size}, vocab {args.vocab}, fp32; branch_micro_batch={args.micro}; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.rounds} rounds after 1 warm-up\n"
    )
    print(
        "| schedule | positions computed (+recomputed) | median s fwd+bwd | min-max s | speed vs naive | "
        "useful GFLOP fwd+bwd | of which attention (fwd) | FLOP ratio naive / this |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for label in labels:
        res = results[label]
        fwd, total = flops[label]
        pos = f"{res.positions_computed:,}" + (
            f" (+{res.positions_recomputed:,})" if res.positions_recomputed else ""
        )
        print(
            f"| {label} | {pos} | {med[label]:.3f} | {min(times[label]):.3f}-{max(times[label]):.3f} | "
            f"{med['naive'] / med[label]:.2f}x | {total / 1e9:.2f} | {fwd.attention / 1e9:.2f} | "
            f"{flops['naive'][1] / total:.2f}x |"
        )


if __name__ == "__main__":
    main()
