"""The update's time in verl's engine on CPU, round robin: verl's own path (no switch) vs the tree in one pass vs
the tree in two passes (docs/verl.md "One pass or two"). One process, fp32, verl's TrainingWorker as in
tests/unit/test_verl_engine.py; each path has its own worker, built before the clock starts, and each round times
one `train_mini_batch` (update_actor: forward, verl's loss, backward, megatron's optimizer step) of the same batch
per path, in turn.

    PYTHONPATH=$PWD:tests OMP_NUM_THREADS=1 .venv/bin/python tests/verl_bench.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

PATHS = ("verl", "tree one pass", "tree two passes")


def _workers(hf: str) -> dict[str, Any]:
    from verl_helpers import make_worker, set_switch

    from megatron_branch.integration.verl import BranchOptions

    set_switch(False)
    out = {"verl": make_worker(hf)}
    set_switch(True)
    for name, one_pass in (("tree one pass", True), ("tree two passes", False)):
        out[name] = make_worker(hf)
        out[name].engine.branch_options = BranchOptions(schedule="replay", one_pass=one_pass)
    set_switch(False)
    return out


def main() -> None:
    from functools import partial

    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.losses import ppo_loss
    from verl_helpers import actor_config, as_update, grpo_batch, one_rank

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--n", type=int, default=8, help="rollouts per prompt")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--shared", type=int, default=16, help="response tokens half of each group shares")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args()
    torch.manual_seed(0)

    def batch() -> Any:
        td = grpo_batch(
            seed=0, groups=a.groups, n=a.n, prompt_len=a.prompt, response_len=a.response, shared=a.shared
        )
        return as_update(td)

    shape = dict(hidden_size=a.hidden, num_layers=a.layers, heads=8, kv_heads=4, ffn=2 * a.hidden)
    with tempfile.TemporaryDirectory() as tmp, one_rank(Path(tmp) / "hf", **shape) as hf:
        workers = _workers(hf)
        for w in workers.values():
            w.set_loss_fn(partial(ppo_loss, config=actor_config(ppo_micro_batch_size_per_gpu=4)))
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        passes: dict[str, Any] = {}
        for r in range(a.rounds + 1):  # round 0 warms every path up and is not counted
            for p in PATHS:
                td = batch()
                t0 = time.perf_counter()
                out = workers[p].train_mini_batch(td)
                dt = time.perf_counter() - t0
                if r:
                    times[p].append(dt)
                passes[p] = tu.get(out, "metrics").get("tree/update_passes")
    rollouts = a.groups * a.n
    print(
        f"update_actor, {rollouts} rollouts ({a.groups} prompts x {a.n}), prompt {a.prompt}, response <= "
        f"{a.response} ({a.shared} shared by half of each group); qwen2 hidden {a.hidden} x {a.layers} layers, "
        f"fp32 CPU, 1 thread; {a.rounds} rounds round robin (+1 warm-up)"
    )
    base = statistics.median(times["verl"])
    for p in PATHS:
        med = statistics.median(times[p])
        print(
            f"{p:16s} median {med:7.3f} s  min {min(times[p]):7.3f} s  vs verl x{base / med:5.2f}  "
            f"update_passes={passes[p]}"
        )


if __name__ == "__main__":
    main()
