"""Rollout generation: shared-prefix sampling vs the same sampler with every sample's prompt prefilled separately.

The baseline is what an engine without prefix sharing does (and the best a user of this package could run
instead): `n` copies of each prompt, one sample each. Both run on the same tiny random megatron-core model,
round-robin in one process; reported: medians of wall time, their ratio, and the deterministic counts (prefill
positions, decode positions) next to them.

    python benchmarks/generation_speed.py [--prompt-len 512] [--n 8] [--prompts 4] [--new 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from megatron_branch.generation import BranchSampler, SamplingParams
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel

    initialize_parallel(ParallelConfig())
    vocab = 1000
    arch = ModelArch(family="llama", vocab_size=vocab, hidden_size=args.hidden, num_layers=args.layers,
                     num_attention_heads=8, num_query_groups=2, ffn_hidden_size=4 * args.hidden,
                     max_position_embeddings=args.prompt_len + args.new + 8)  # fmt: skip
    model = build_model(arch).eval()
    sampler = BranchSampler(model, vocab_size=vocab)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    shared = (prompts, SamplingParams(n=args.n, max_new_tokens=args.new, temperature=1.0))
    unshared = ([p for p in prompts for _ in range(args.n)], SamplingParams(n=1, max_new_tokens=args.new))
    times: dict[str, list[float]] = {"shared": [], "unshared": []}
    stats = {}
    for _ in range(args.repeats):  # round-robin: both variants see the same machine state
        for name, (ps, sp) in (("shared", shared), ("unshared", unshared)):
            t0 = time.perf_counter()
            out = sampler.generate(ps, sp, generator=torch.Generator().manual_seed(1))
            times[name].append(time.perf_counter() - t0)
            stats[name] = out.stats
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in ("shared", "unshared"):
        st = stats[name]
        print(json.dumps(dict(variant=name, median_s=round(med[name], 3), prefill_positions=st.prefill_positions,
                              decode_positions=st.decode_positions, response_tokens=st.response_tokens,
                              tokens_per_s=round(st.response_tokens / med[name], 1))))  # fmt: skip
    print(json.dumps(dict(speedup=round(med["unshared"] / med["shared"], 2),
                          prefill_ratio=round(stats["unshared"].prefill_positions / stats["shared"].prefill_positions, 2))))  # fmt: skip


if __name__ == "__main__":
    main()
