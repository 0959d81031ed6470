"""Numerical error of fp32 `replay` (and `packed`) under context parallelism vs the fp64 naive result.

Run once per ring size; each run appends one JSON row to --out, then `--table` prints the markdown table:

    .venv/bin/python benchmarks/cp_error_table.py --out /tmp/cp_error.jsonl                    # CP1
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node=2 \\
        benchmarks/cp_error_table.py --out /tmp/cp_error.jsonl                                 # CP2 (also 4, 8)
    .venv/bin/python benchmarks/cp_error_table.py --table /tmp/cp_error.jsonl

Every rank loads the same weights (a seeded tiny HF Qwen2, converted), runs the fp64 naive reference alone (tp=1,
cp=1, megatron's own attention), then the fp32 schedule with cp = world size (ring attention), gradients summed over
CP (`parallel.grads.finalize_grads`). Error per parameter: ||g - g_ref|| / ||g_ref|| (Frobenius); the table gives the
max over parameters, and the max absolute error of the response logprobs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_branch.checkpoint.param_map import hf_to_mcore_state
from megatron_branch.checkpoint.tp import load_full_state
from megatron_branch.data import PrefixTree
from megatron_branch.losses import PolicyGradientObjective
from megatron_branch.models import ModelArch, build_model
from megatron_branch.parallel.grads import finalize_grads
from megatron_branch.parallel.groups import ParallelConfig, init_distributed, initialize_parallel
from megatron_branch.schedule import ScheduleOptions, run_schedule
from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model


def _run(hf, tree: PrefixTree, schedule: str, dtype: torch.dtype, groups, cp: int):  # noqa: ANN001, ANN202
    """(grads by mcore name in float64, every rollout's logprobs) of one schedule."""
    arch = ModelArch.from_hf_config(hf.config)
    model = build_model(arch, dtype=dtype)
    load_full_state(
        model, hf_to_mcore_state(hf.state_dict(), arch, padded_vocab=arch.padded_vocab_size(1)), None
    )
    obj = PolicyGradientObjective.grpo(
        [r.advantage for r in tree.rollouts], tree.num_response_tokens_logical()
    )
    ring = {"groups": groups} if cp > 1 else {}
    opts = ScheduleOptions(vocab_size=arch.vocab_size, keep_logprobs=True, branch_micro_batch=4, **ring)
    res = run_schedule(schedule, model, tree, obj, opts)
    finalize_grads(
        model, tp_group=None, dp_cp_group=groups.dp_cp if cp > 1 else None, sequence_parallel=False
    )
    grads = {n: p.grad.double() for n, p in model.named_parameters()}
    return grads, [res.rollout_logprobs(tree, i).double() for i in range(len(tree.rollouts))]


def measure() -> dict:
    _, world = init_distributed()
    groups = initialize_parallel(ParallelConfig(cp=world))
    torch.set_num_threads(1)
    hf = tiny_hf_model(tiny_hf_config("qwen2", hidden_size=64, heads=4, kv_heads=2, ffn=128), seed=3)
    rollouts = random_tree_rollouts(groups=2, prompt_len=61, branches=4, levels=2, seg_len=(5, 23), seed=1)
    tree = PrefixTree.build(rollouts, vocab_size=37)
    ref_g, ref_lp = _run(hf.double(), tree, "naive", torch.float64, groups, 1)
    row: dict = {"cp": world, "tokens_tree": tree.num_tokens, "rollouts": len(rollouts)}
    for schedule in ("replay", "packed"):
        t0 = time.perf_counter()
        g, lp = _run(hf.float(), tree, schedule, torch.float32, groups, world)
        row[f"{schedule}_s"] = round(time.perf_counter() - t0, 2)
        row[f"{schedule}_grad_rel"] = max(((g[n] - r).norm() / r.norm()).item() for n, r in ref_g.items())
        row[f"{schedule}_logprob_abs"] = max((a - b).abs().max().item() for a, b in zip(lp, ref_lp))
    return row


def table(path: Path) -> str:
    rows = {r["cp"]: r for r in map(json.loads, path.read_text().splitlines())}  # the last run of each size
    out = [
        "| CP (ring size) | replay fp32: max rel grad error | replay: max abs logprob error "
        "| packed fp32: max rel grad error |",
        "|---|---|---|---|",
    ]
    for cp in sorted(rows):
        r = rows[cp]
        out.append(
            f"| {cp} | {r['replay_grad_rel']:.2e} | {r['replay_logprob_abs']:.2e} | {r['packed_grad_rel']:.2e} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="append this run's JSON row here (rank 0)")
    ap.add_argument("--table", type=Path, help="print the markdown table of a results file and exit")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
        return
    row = measure()
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
