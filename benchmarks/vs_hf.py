"""`grad --schedule replay` against per-rollout Hugging Face + SDPA training, timed from outside as whole processes.

What a user could run instead of megatron-branch is a plain transformers loop: every rollout alone through the HF
model (SDPA attention, logits on every row), its loss backward, gradients accumulated. This script writes the
assets, runs that peer, and times both as whole processes, round-robin (A B A B ...), with each command's start-up
(imports, model load, writing the gradients) subtracted by the same command on a tiny rollout file:

    python benchmarks/vs_hf.py assets --out /tmp/vs_hf        # HF folder + rollouts (P=3000, G=8, S=100) + tiny
    python benchmarks/vs_hf.py time --dir /tmp/vs_hf --rounds 3 [--json out.json]

The shape is issue 24's small one: a 3-layer, hidden-384 Llama (6 heads / 2 kv, ffn 1024, vocabulary 8000).
`time` prints each command's median wall seconds, the step time net of start-up, the speed-up of replay over the
HF peer and the analytic limit (the peer's FLOPs over the tree's minimal FLOPs, bench/flops.py's formulas; the
peer computes logits on every row, as HF does). Both compute the same loss and gradient (`check` compares them).
Only ratios from one run on a quiet machine mean anything.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPE = dict(hidden_size=384, num_layers=3, heads=6, kv_heads=2, ffn=1024, vocab_size=8000)
TREE = dict(prompt_len=3000, branches=8, seg_len=(100, 100))
TINY = dict(prompt_len=8, branches=2, seg_len=(2, 2))


def assets(out: Path) -> None:
    """The HF folder (random weights), the rollouts and the tiny rollout file for start-up subtraction."""
    from megatron_branch.data import write_rollouts_jsonl
    from megatron_branch.testing import random_tree_rollouts, tiny_hf_config, tiny_hf_model

    out.mkdir(parents=True, exist_ok=True)
    cfg = tiny_hf_config("llama", **SHAPE)
    cfg.max_position_embeddings = 4096
    tiny_hf_model(cfg, seed=0).save_pretrained(out / "hf")
    for name, tree in (("rollouts", TREE), ("tiny", TINY)):
        rollouts = random_tree_rollouts(vocab_size=SHAPE["vocab_size"], seed=0, **tree)
        write_rollouts_jsonl(out / f"{name}.jsonl", rollouts)
    print(f"wrote {out / 'hf'}, {out / 'rollouts.jsonl'}, {out / 'tiny.jsonl'}")


def hf_peer(hf: Path, rollouts_path: Path, out: Path) -> None:
    """The peer: each rollout alone through HF + SDPA, L = -(1/T) sum_i A_i sum_t logp(i,t), grads accumulated."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from megatron_branch.data import read_rollouts_jsonl

    model = AutoModelForCausalLM.from_pretrained(hf, attn_implementation="sdpa", dtype=torch.float32)
    rollouts = read_rollouts_jsonl(rollouts_path)
    T = sum(len(r.response) for r in rollouts)
    total = 0.0
    for r in rollouts:
        seq = torch.tensor([list(r.prompt) + list(r.response)])
        logits = model(input_ids=seq).logits[0]  # [L, V]: every row, as HF computes it
        logp = torch.log_softmax(logits[:-1].float(), -1).gather(1, seq[0, 1:, None]).squeeze(1)
        loss = -(r.advantage / T) * logp[len(r.prompt) - 1 :].sum()
        loss.backward()
        total += float(loss.detach())
    save_file({n: p.grad.contiguous() for n, p in model.named_parameters()}, str(out))
    print(json.dumps({"loss": total}))


def flop_limit(hf: Path, rollouts_path: Path) -> dict[str, float]:
    """The peer's step FLOPs (logits on every row) over the tree's minimal FLOPs (replay's)."""
    from megatron_branch.bench.flops import (
        per_pair_flops,
        per_position_flops,
        per_row_head_flops,
        variant_flops,
    )
    from megatron_branch.checkpoint.hf_io import load_hf_config
    from megatron_branch.data import PrefixTree, read_rollouts_jsonl
    from megatron_branch.models import ModelArch

    arch = ModelArch.from_hf_config(load_hf_config(hf))
    rollouts = read_rollouts_jsonl(rollouts_path)
    tok, row, pair = per_position_flops(arch), per_row_head_flops(arch), per_pair_flops(arch)
    peer = 3 * sum(tok * n + row * n + pair * n * (n + 1) / 2
                   for n in (len(r.prompt) + len(r.response) for r in rollouts))  # fmt: skip
    minimal = variant_flops(arch, PrefixTree.build(rollouts, vocab_size=arch.vocab_size))["minimal"].step
    return dict(peer_gflop=peer / 1e9, replay_gflop=minimal / 1e9, limit=peer / minimal)


def commands(d: Path) -> dict[str, list[str]]:
    py, here = sys.executable, str(Path(__file__).resolve())
    grad = [py, "-m", "megatron_branch", "grad", "--hf", str(d / "hf"), "--schedule", "replay", "--overwrite"]
    out: dict[str, list[str]] = {}
    for name in ("rollouts", "tiny"):
        out[f"hf/{name}"] = [py, here, "hf", "--hf", str(d / "hf"), "--rollouts", str(d / f"{name}.jsonl"),
                             "--out", str(d / f"hf_{name}.safetensors")]  # fmt: skip
        out[f"replay/{name}"] = [*grad, "--rollouts", str(d / f"{name}.jsonl"),
                                 "--out", str(d / f"replay_{name}.safetensors")]  # fmt: skip
    return out


def time_them(d: Path, rounds: int) -> dict[str, Any]:
    cmds = commands(d)
    names = list(cmds)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0 warms the file cache, untimed
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            subprocess.run(cmds[n], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if r:
                times[n].append(time.perf_counter() - t0)
        print(f"round {r}/{rounds} done", file=sys.stderr)
    med = {n: statistics.median(t) for n, t in times.items()}
    net = {s: med[f"{s}/rollouts"] - med[f"{s}/tiny"] for s in ("hf", "replay")}
    limit = flop_limit(d / "hf", d / "rollouts.jsonl")
    speedup = net["hf"] / net["replay"]
    return dict(median_s=med, times_s=times, net_s=net, speedup=speedup, **limit,
                fraction_of_limit=speedup / limit["limit"], load_average=list(os.getloadavg()))  # fmt: skip


def check(d: Path) -> float:
    """Largest relative gradient difference between the peer's and replay's outputs (HF names both)."""
    from safetensors.torch import load_file

    a, b = load_file(str(d / "hf_rollouts.safetensors")), load_file(str(d / "replay_rollouts.safetensors"))
    return max(float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-30)) for k in a)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("assets").add_argument("--out", type=Path, required=True)
    p = sub.add_parser("hf")
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--rollouts", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    t = sub.add_parser("time")
    t.add_argument("--dir", type=Path, required=True)
    t.add_argument("--rounds", type=int, default=3)
    t.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "assets":
        assets(args.out)
    elif args.cmd == "hf":
        hf_peer(args.hf, args.rollouts, args.out)
    else:
        report = time_them(args.dir, args.rounds)
        report["max_rel_grad_diff"] = check(args.dir)
        if args.json:
            args.json.write_text(json.dumps(report, indent=1))
        print(json.dumps({k: v for k, v in report.items() if k != "times_s"}, indent=1))


if __name__ == "__main__":
    main()
