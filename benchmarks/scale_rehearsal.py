"""The 2.1M-position rehearsal: the user's target batch through `replay` under CP8 and TP2 x CP4 (+SP) on CPU.

16 rollouts share a 131,008-token prompt, each with its own 64-token response: 16 x 131,072 = 2,097,152 logical
positions (131,008 + 16 x 64 = 132,032 computed by replay). A tiny Llama (1 layer, hidden 32, 4 heads / 2 KV
groups, vocabulary 64, float32) keeps it runnable on a laptop-class CPU; the SEQUENCE is the real one, so every
sequence-dependent tensor (activations, K/V cache, ring blocks) has the target's length.

    python benchmarks/scale_rehearsal.py                       # CP1 reference, CP8, TP2xCP4+SP; table on stdout
    python benchmarks/scale_rehearsal.py --prompt 4032 --json /tmp/r.json   # a quick scaled-down run

Each layout runs in its own launch (the CP1 reference as one process, the others under torchrun with 8 processes),
so each process's peak RSS is its own. Every layout's loss and gradients are compared with the CP1 reference (same
batch, same weights: megatron_branch.bench.rehearsal.layout_free_state). Reported per rank: peak RSS (whole
process), RSS before the step, the activation meter's peak (saved-for-backward tensors and replay's K/V cache), the
largest tensor any op created, the ring's message counts and bytes, and the step's wall time. Wall times are only
meaningful on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {  # name -> (tp, cp, sequence parallel)
    "cp1": (1, 1, False),
    "cp8": (1, 8, False),
    "tp2cp4sp": (2, 4, True),
}


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=131_008)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--layouts", default="cp8,tp2cp4sp", help="comma-separated, from: cp8, tp2cp4sp")
    ap.add_argument("--json", default=None, help="write every figure to this JSON file")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per launch")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: run one layout
    ap.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def _batch_and_arch(args: argparse.Namespace):  # noqa: ANN202
    from megatron_branch.bench.rehearsal import RehearsalBatch, rehearsal_arch

    batch = RehearsalBatch(rollouts=args.rollouts, prompt=args.prompt, response=args.response)
    arch = rehearsal_arch(
        hidden=args.hidden, layers=args.layers, vocab=batch.vocab, max_positions=args.prompt + args.response
    )
    return batch, arch


def worker(args: argparse.Namespace) -> None:
    """One layout, in this (torchrun) process: run the step; rank 0 saves (cp1) or compares (others) and writes."""
    import torch

    from megatron_branch.bench.rehearsal import max_relative_error, run_step
    from megatron_branch.parallel.groups import ParallelConfig, init_distributed, initialize_parallel

    tp, cp, sp = LAYOUTS[args.worker]
    rank, _ = init_distributed(timeout_s=args.timeout)
    torch.set_num_threads(1)
    batch, arch = _batch_and_arch(args)
    groups = initialize_parallel(ParallelConfig(tp=tp, cp=cp, sequence_parallel=sp))
    rep = run_step(batch, arch, groups)
    if rank != 0:
        return
    work = Path(args.workdir)
    out = rep.summary()
    if args.worker == "cp1":
        torch.save({"loss": rep.loss, "grads": rep.grads}, work / "cp1.pt")
    else:
        ref = torch.load(work / "cp1.pt", weights_only=True)
        err, where = max_relative_error(rep.grads, ref["grads"])
        out.update(
            loss_abs_diff=abs(rep.loss - ref["loss"]), max_grad_rel_err=err, max_grad_rel_err_param=where
        )
    (work / f"{args.worker}.json").write_text(json.dumps(out, indent=1, default=str))


def _launch(name: str, args: argparse.Namespace, work: Path) -> None:
    tp, cp, _ = LAYOUTS[name]
    script = [str(Path(__file__).resolve()), *_passthrough(args), "--worker", name, "--workdir", str(work)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tp * cp == 1:
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp * cp}"]
        cmd += ["--local-ranks-filter=0", *script]
    print(f"[rehearsal] {name}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, env=env, check=True, timeout=args.timeout)


def _passthrough(args: argparse.Namespace) -> list[str]:
    keys = ("rollouts", "prompt", "response", "layers", "hidden", "timeout")
    return [x for k in keys for x in (f"--{k}", str(getattr(args, k)))]


def _span(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(hi, fmt) if format(lo, fmt) == format(hi, fmt) else f"{format(lo, fmt)}-{format(hi, fmt)}"


def _table(results: dict[str, dict]) -> str:
    """One row per layout; a range where the ranks differ (every rank's figures are in the JSON)."""
    cols = [
        ("local rows", "local_rows", "d", 1),
        ("peak RSS (MB)", "peak_rss_mb", ".0f", 1),
        ("RSS before step (MB)", "rss_before_mb", ".0f", 1),
        ("activation peak (MB)", "activation_peak_mb", ".1f", 1),
        ("largest tensor (MB)", "largest_tensor_mb", ".2f", 1),
        ("K/V msgs", "kv_messages", "d", 1),
        ("dK/dV msgs", "grad_messages", "d", 1),
        ("ring MB sent", "ring_bytes_sent", ".1f", 2**-20),
        ("kernel calls", "kernel_calls", "d", 1),
        ("wall (s)", "wall_s", ".1f", 1),
    ]
    lines = ["| layout | ranks | " + " | ".join(c[0] for c in cols) + " |", "|---" * (len(cols) + 2) + "|"]
    for name, res in results.items():
        cells = []
        for _, key, fmt, mul in cols:
            vals = [r[key] * mul for r in res["ranks"]]
            cells.append(_span([int(v) for v in vals] if fmt == "d" else vals, fmt))
        lines.append(f"| {name} | {len(res['ranks'])} | " + " | ".join(cells) + " |")
    lines.append("")
    for name, res in results.items():
        if "max_grad_rel_err" in res:
            lines.append(
                f"- {name} vs cp1: loss |diff| {res['loss_abs_diff']:.2e}, largest per-parameter relative gradient "
                f"error {res['max_grad_rel_err']:.2e} ({res['max_grad_rel_err_param']})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = _args(argv)
    if args.worker:
        worker(args)
        return
    batch, _ = _batch_and_arch(args)
    print(
        f"[rehearsal] {batch.rollouts} x ({batch.prompt} + {batch.response}) = {batch.positions_logical:,} logical"
    )
    with tempfile.TemporaryDirectory(prefix="scale_rehearsal_") as tmp:
        work = Path(tmp)
        names = ["cp1", *[n for n in args.layouts.split(",") if n]]
        results = {}
        for name in names:
            _launch(name, args, work)
            results[name] = json.loads((work / f"{name}.json").read_text())
    print(_table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    bad = [n for n, r in results.items() if r.get("max_grad_rel_err", 0.0) > 1e-5]
    if bad:
        raise SystemExit(f"gradients differ from CP1 beyond 1e-5 in {bad}")


if __name__ == "__main__":
    main()
