"""Peak resident memory (RSS) of `convert hf-to-mcore` on a model of a few hundred MB.

A Llama model is built by transformers from a config with random weights and saved to a temp folder (safetensors).
Each measurement then runs in a fresh subprocess; its peak RSS is read from `getrusage(RUSAGE_CHILDREN).ru_maxrss`
in this process (the largest of the finished children, so the cheapest one runs first):

1. baseline: the interpreter with torch, megatron-core and megatron-branch imported and torch.distributed set up
   (a world of one), converting nothing;
2. with --tp N (N > 1) the conversion under `torchrun --nproc_per_node N` (the peak of the largest rank);
3. the conversion at TP1 (single process): `convert_hf_to_mcore(hf, out, tp=1)`.

    .venv/bin/python benchmarks/convert_memory.py                # ~470 MB fp32 model
    .venv/bin/python benchmarks/convert_memory.py --layers 2 --tp 2
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MB = 1024 * 1024

BASELINE = """
import megatron.core, torch, megatron_branch.checkpoint
from megatron_branch.models import build_model
from megatron_branch.parallel.groups import init_distributed
init_distributed()
"""

CONVERT = """
import sys
from megatron_branch.checkpoint import convert_hf_to_mcore
convert_hf_to_mcore(sys.argv[1], sys.argv[2], tp=int(sys.argv[3]), progress=False)
"""


def build_hf(out: Path, *, hidden: int, layers: int, vocab: int, ffn: int) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 256,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(str(out))
    sizes = {n: p.numel() * p.element_size() for n, p in model.named_parameters()}
    largest = max(sizes, key=sizes.__getitem__)
    return {
        "model_mb": sum(sizes.values()) / MB,
        "largest_tensor_mb": sizes[largest] / MB,
        "largest": largest,
    }


def children_peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # Linux reports KiB


def run(cmd: list[str]) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    t = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--tp", type=int, default=1, help="also measure a torchrun conversion at this TP (> 1)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="convert-mem-") as tmp:
        hf = Path(tmp) / "hf"
        info = build_hf(hf, hidden=args.hidden, layers=args.layers, vocab=args.vocab, ffn=args.ffn)
        py = sys.executable
        report: dict[str, object] = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
            **{k: round(v, 1) if isinstance(v, float) else v for k, v in info.items()},
        }
        run([py, "-c", BASELINE])
        report["baseline_rss_mb"] = round(children_peak_mb(), 1)
        if args.tp > 1:
            script = Path(tmp) / "convert.py"
            script.write_text(CONVERT)
            cmd = [
                py,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={args.tp}",
                str(script),
            ]
            secs = run([*cmd, str(hf), str(Path(tmp) / f"mc{args.tp}"), str(args.tp)])
            report[f"tp{args.tp}_rank_peak_rss_mb"] = round(children_peak_mb(), 1)
            report[f"tp{args.tp}_seconds"] = round(secs, 1)
        secs = run([py, "-c", CONVERT, str(hf), str(Path(tmp) / "mc1"), "1"])
        report["tp1_peak_rss_mb"] = round(children_peak_mb(), 1)
        report["tp1_seconds"] = round(secs, 1)
        base, model, big = report["baseline_rss_mb"], info["model_mb"], info["largest_tensor_mb"]
        report["tp1_above_baseline_mb"] = round(report["tp1_peak_rss_mb"] - base, 1)
        report["tp1_above_baseline_minus_shard_and_largest_mb"] = round(
            report["tp1_peak_rss_mb"] - base - model - big, 1
        )
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
