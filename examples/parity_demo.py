"""`make parity-demo` (formerly `make demo`): one exact branch-replay step on a tiny random Qwen2-style model, checked against naive training.

What it shows, on its embedded default (no download, a few seconds on a laptop CPU):
  * a GRPO-style batch: one shared prompt, 8 rollouts whose responses share beginnings at two levels;
  * the prefix tree megatron-branch builds from them (positions naive training computes vs positions we compute);
  * the same loss and the same per-parameter gradients (float64) from `naive`, `packed` and `replay`.

    python examples/parity_demo.py [--prompt-len 96] [--branches 4] [--levels 2] [--dtype float64]
"""

from __future__ import annotations

import argparse
import warnings

import torch

warnings.filterwarnings("ignore")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--branches", type=int, default=4, help="branches at the last level (2 at inner levels)")
    ap.add_argument("--levels", type=int, default=2, help="levels of shared response beginnings")
    ap.add_argument("--dtype", default="float64", choices=["float32", "float64"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)

    from megatron_branch.checkpoint.param_map import hf_to_mcore_state, mcore_to_hf_state
    from megatron_branch.checkpoint.tp import gather_full_grads, load_full_state
    from megatron_branch.data import PrefixTree
    from megatron_branch.losses import PolicyGradientObjective
    from megatron_branch.models import ModelArch, build_model
    from megatron_branch.parallel.groups import ParallelConfig, initialize_parallel
    from megatron_branch.schedule import ScheduleOptions, run_schedule
    from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

    initialize_parallel(ParallelConfig())
    cfg = tiny_hf_config("qwen2", vocab_size=97, hidden_size=64, num_layers=2, heads=4, kv_heads=2, ffn=128)
    hf = tiny_hf_model(cfg, seed=0, dtype=dtype)
    arch = ModelArch.from_hf_config(cfg)
    model = build_model(arch, dtype=dtype)
    load_full_state(
        model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1)), None
    )

    rollouts = random_tree_rollouts(
        vocab_size=97, prompt_len=args.prompt_len, branches=args.branches, levels=args.levels, seg_len=(8, 24)
    )
    tree = PrefixTree.build(rollouts, vocab_size=arch.vocab_size)
    objective = PolicyGradientObjective.grpo(
        [r.advantage for r in rollouts], tree.num_response_tokens_logical()
    )
    print(f"model: megatron-core GPTModel (Qwen2-style, GQA 4/2, QKV bias), {args.dtype}, CPU")
    print(tree.describe())

    runs = {}
    for schedule in ("naive", "packed", "replay"):
        model.zero_grad(set_to_none=True)
        res = run_schedule(schedule, model, tree, objective, ScheduleOptions(vocab_size=arch.vocab_size))
        runs[schedule] = (res, mcore_to_hf_state(gather_full_grads(model, None), arch))

    _, naive_grads = runs["naive"]
    print()
    print(f"{'schedule':<8} {'positions':>10} {'forwards':>9} {'loss':>22} {'max rel grad err vs naive':>27}")
    for schedule, (res, grads) in runs.items():
        err = max(((grads[n] - naive_grads[n]).norm() / naive_grads[n].norm()).item() for n in grads)
        print(f"{schedule:<8} {res.positions_computed:>10} {res.forwards:>9} {res.loss:>22.16f} {err:>27.2e}")
    ok = all(
        max(((g[n] - naive_grads[n]).norm() / naive_grads[n].norm()).item() for n in g)
        <= (1e-9 if dtype == torch.float64 else 1e-5)
        for _, g in runs.values()
    )
    ratio = tree.positions_logical / tree.positions_computed
    print()
    print(
        f"replay computed {tree.positions_computed} of {tree.positions_logical} logical positions ({ratio:.2f}x fewer)"
    )
    print("gradients: " + ("EXACT (same as training every rollout separately)" if ok else "MISMATCH"))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
